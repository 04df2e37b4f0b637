//! Snapshot export (read back by Python's pickle and by our importer, within MemoryViz.js's
//! opcode whitelist), and bad input to the replay: each a typed error or a counted warning.

use std::io::Write;
use std::process::{Command, Stdio};
use std::sync::Arc;

use gpualloc_accounting::AccountingBackend;
use gpualloc_devices::{AllocatorConfig, DeviceCore};
use gpualloc_replay::export::to_pickle;
use gpualloc_replay::input::from_bytes;
use gpualloc_replay::{replay, ReplayError, ReplayOptions};
use gpualloc_runtime::{Backend, DeviceId};
use gpualloc_trace::pickle::{opcodes_used, MEMORYVIZ_WHITELIST};
use gpualloc_trace::{Action, Snapshot};

const MIB: u64 = 1 << 20;

/// A core with some history: two segments, a split, a free, an expandable-free config.
fn exported() -> Vec<u8> {
    let backend: Arc<dyn Backend> = Arc::new(AccountingBackend::new(1, 1 << 40));
    let s = backend.stream_create(DeviceId(0)).unwrap();
    let config = AllocatorConfig::parse("max_split_size_mb:512").unwrap();
    let mut core = DeviceCore::new(backend, DeviceId(0), config.clone()).unwrap();
    core.record_history(Some(100));
    core.set_time_us(1_000);
    let a = core.malloc(5 * MIB, s).unwrap();
    let _b = core.malloc(3000, s).unwrap();
    core.set_time_us(2_000);
    core.free(a.ptr).unwrap();
    let _c = core.malloc(7 * MIB, s).unwrap();
    to_pickle(&[core.snapshot()], &config).unwrap()
}

#[test]
fn export_uses_only_memoryviz_opcodes_and_reads_back() {
    let bytes = exported();
    let used = opcodes_used(&bytes).unwrap();
    for op in &used {
        assert!(
            MEMORYVIZ_WHITELIST.contains(op),
            "opcode {op:#x} is not one MemoryViz.js decodes"
        );
    }
    let snap = Snapshot::from_pickle(&bytes).unwrap();
    assert_eq!(snap.segments.len(), 2);
    assert_eq!(snap.count(Action::Alloc), 3);
    assert_eq!(snap.count(Action::FreeRequested), 1);
    assert_eq!(snap.count(Action::SegmentAlloc), 2);
    let large = snap
        .segments
        .iter()
        .find(|s| s.total_size == 20 * MIB)
        .unwrap();
    assert_eq!(large.allocated_size, 7 * MIB);
    assert_eq!(large.blocks.len(), 2);
    let settings = snap.allocator_settings.unwrap();
    assert!(settings.contains_key("max_split_size"));
    assert_eq!(snap.device_traces[0][0].time_us, Some(1_000));
}

#[test]
fn python_pickle_loads_the_export() {
    let bytes = exported();
    let script = "import pickle,sys\n\
d=pickle.load(sys.stdin.buffer)\n\
segs=d['segments']; tr=d['device_traces'][0]\n\
print(len(segs), sum(s['total_size'] for s in segs), len(tr), tr[0]['action'], tr[0]['time_us'],\n\
      sorted(segs[0].keys())==sorted(['device','address','total_size','allocated_size','active_size','requested_size','stream','segment_type','segment_pool_id','is_expandable','frames','blocks']),\n\
      d['allocator_settings']['max_split_size'])\n";
    let child = Command::new("python3")
        .args(["-c", script])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn();
    let Ok(mut child) = child else {
        eprintln!("skipped: python3 is not available");
        return;
    };
    child.stdin.take().unwrap().write_all(&bytes).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    assert_eq!(
        text.trim(),
        format!("2 {} 7 segment_alloc 1000 True {}", 22 * MIB, 512 * MIB)
    );
}

#[test]
fn bad_input_is_a_typed_error_or_a_counted_warning() {
    let good = exported();
    // Truncated pickles: every prefix is an error, never a panic.
    for cut in (0..good.len()).step_by(7) {
        assert!(
            from_bytes("t", &good[..cut]).is_err(),
            "prefix {cut} accepted"
        );
    }
    // A pickle that would run code.
    let evil = b"\x80\x02cos\nsystem\nq\x00X\x02\x00\x00\x00lsq\x01\x85q\x02Rq\x03.";
    match from_bytes("evil", evil) {
        Err(e @ ReplayError::Parse { .. }) => {
            let text = e.to_string();
            assert!(text.starts_with("evil: "), "names the file: {text}");
            assert!(text.to_lowercase().contains("global"), "{text}")
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    // Negative size and wrong types in JSON Lines.
    assert!(from_bytes(
        "neg",
        b"{\"action\":\"alloc\",\"addr\":4096,\"size\":-5,\"stream\":0}\n"
    )
    .is_err());
    assert!(from_bytes(
        "type",
        b"{\"action\":\"alloc\",\"addr\":\"x\",\"size\":5,\"stream\":0}\n"
    )
    .is_err());
    // Not a trace at all.
    assert!(from_bytes("bin", &[0xff, 0xfe, 0x00]).is_err());
    // A free of an address the trace never allocated and that no snapshot explains is a
    // counted warning (it is taken as alive before recording, so it is not one here: a double
    // free is).
    let text = "{\"action\":\"alloc\",\"addr\":4096,\"size\":1000,\"stream\":0}\n\
                {\"action\":\"free_requested\",\"addr\":4096,\"size\":1000,\"stream\":0}\n\
                {\"action\":\"free_requested\",\"addr\":4096,\"size\":1000,\"stream\":0}\n";
    let traces = from_bytes("double", text.as_bytes()).unwrap();
    let r = replay(&traces[0], &ReplayOptions::default()).unwrap();
    assert_eq!(
        r.warnings, 2,
        "the double free, counted by the analysis and by the replay"
    );
    // Warm replay needs segments: a typed error for a JSON Lines trace.
    let warm = ReplayOptions {
        warm: true,
        ..ReplayOptions::default()
    };
    assert!(matches!(
        replay(&traces[0], &warm),
        Err(ReplayError::NoSegments(_))
    ));
}

#[test]
fn rmm_csv_logs_replay() {
    let csv = "Thread,Time,Action,Pointer,Size,Stream\n\
               1,10:00:00.000001,allocate,0x7f0000000000,1048576,0x0\n\
               1,10:00:00.000002,allocate,0x7f0000100000,4096,0x0\n\
               1,10:00:00.000003,free,0x7f0000000000,1048576,0x0\n\
               1,10:00:00.000004,allocate,0x7f0000000000,524288,0x0\n";
    let traces = from_bytes("rmm.csv", csv.as_bytes()).unwrap();
    let r = replay(&traces[0], &ReplayOptions::default()).unwrap();
    assert_eq!(r.warnings, 0);
    assert_eq!(
        r.device_mallocs, 1,
        "all three fit in one 2 MiB small segment"
    );
    assert_eq!(r.peak_reserved, 2 * MIB);
}

/// Python's `pickle.dumps(snapshot, protocol=0)` and `protocol=1` of a one-segment snapshot
/// with two events: read as pickles by their content, not as JSON Lines.
#[test]
fn protocol_0_and_1_pickles_are_read_as_pickles() {
    let p0 = "(dp0\nVsegments\np1\n(lp2\n(dp3\nVdevice\np4\nI0\nsVaddress\np5\nI4096\nsVtotal_size\np6\nI2097152\nsVstream\np7\nI0\nsVsegment_type\np8\nVsmall\np9\nsVblocks\np10\n(lp11\n(dp12\ng5\nI4096\nsVsize\np13\nI512\nsVrequested_size\np14\nI500\nsVstate\np15\nVactive_allocated\np16\nsa(dp17\ng5\nI4608\nsg13\nI2096640\nsg14\nI0\nsg15\nVinactive\np18\nsasasVdevice_traces\np19\n(lp20\n(lp21\n(dp22\nVaction\np23\nVsegment_alloc\np24\nsVaddr\np25\nI4096\nsg13\nI2097152\nsg7\nI0\nsa(dp26\ng23\nValloc\np27\nsg25\nI4096\nsg13\nI500\nsg7\nI0\nsaas.";
    let p1: &[u8] = b"}q\x00(X\x08\x00\x00\x00segmentsq\x01]q\x02}q\x03(X\x06\x00\x00\x00deviceq\x04K\x00X\x07\x00\x00\x00addressq\x05M\x00\x10X\n\x00\x00\x00total_sizeq\x06J\x00\x00 \x00X\x06\x00\x00\x00streamq\x07K\x00X\x0c\x00\x00\x00segment_typeq\x08X\x05\x00\x00\x00smallq\tX\x06\x00\x00\x00blocksq\n]q\x0b(}q\x0c(h\x05M\x00\x10X\x04\x00\x00\x00sizeq\rM\x00\x02X\x0e\x00\x00\x00requested_sizeq\x0eM\xf4\x01X\x05\x00\x00\x00stateq\x0fX\x10\x00\x00\x00active_allocatedq\x10u}q\x11(h\x05M\x00\x12h\rJ\x00\xfe\x1f\x00h\x0eK\x00h\x0fX\x08\x00\x00\x00inactiveq\x12ueuaX\r\x00\x00\x00device_tracesq\x13]q\x14]q\x15(}q\x16(X\x06\x00\x00\x00actionq\x17X\r\x00\x00\x00segment_allocq\x18X\x04\x00\x00\x00addrq\x19M\x00\x10h\rJ\x00\x00 \x00h\x07K\x00u}q\x1a(h\x17X\x05\x00\x00\x00allocq\x1bh\x19M\x00\x10h\rM\xf4\x01h\x07K\x00ueau.";
    for (name, bytes) in [("p0", p0.as_bytes()), ("p1", p1)] {
        let traces = from_bytes(name, bytes).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(traces.len(), 1, "{name}");
        assert_eq!(traces[0].events.len(), 2, "{name}");
        assert_eq!(
            traces[0].final_segments.as_ref().unwrap().len(),
            1,
            "{name}"
        );
        let warm = ReplayOptions {
            warm: true,
            ..ReplayOptions::default()
        };
        let r = replay(&traces[0], &warm).unwrap();
        assert_eq!(r.address_match, Some((1, 1)), "{name}");
    }
    // JSON Lines and comments stay JSON Lines; a text that only looks like protocol 0 at one
    // end is not taken for a pickle.
    let jsonl = b"# a comment\n{\"action\":\"alloc\",\"addr\":4096,\"size\":512,\"stream\":0}\n";
    assert_eq!(from_bytes("j", jsonl).unwrap()[0].events.len(), 1);
    match from_bytes("almost", b"(not a pickle") {
        Err(e) => assert!(e.to_string().starts_with("almost: "), "{e}"),
        Ok(_) => panic!("accepted"),
    }
}
