//! Snapshot export (read back by Python's pickle and by our importer, within MemoryViz.js's
//! opcode whitelist), and bad input to the replay: each a typed error or a counted warning.

use std::io::Write;
use std::process::{Command, Stdio};
use std::sync::Arc;

use gpualloc_devices::{AllocatorConfig, DeviceCore};
use gpualloc_replay::export::to_pickle;
use gpualloc_replay::input::from_bytes;
use gpualloc_replay::{replay, ReplayError, ReplayOptions};
use gpualloc_runtime::accounting::AccountingBackend;
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
        Err(ReplayError::Trace(e)) => {
            assert!(e.to_string().to_lowercase().contains("global"), "{e}")
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
