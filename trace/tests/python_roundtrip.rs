//! Round trip through CPython: snapshots we export load with Python's `pickle` and equal what
//! we wrote (and, for the real snapshots, what PyTorch wrote), and load back with our reader.
//! Skipped, with a printed reason, when python3 is not installed.

mod common;

use std::io::Write;
use std::process::{Command, Stdio};

use gpualloc_trace::pickle::{self, Value};
use gpualloc_trace::{
    Action, Block, BlockState, Frame, Segment, SegmentType, Snapshot, TraceEntry,
};

/// Loads `bytes` with CPython's pickle and runs `script` on it (bound to `d`); returns
/// stdout, or `None` (reason printed) when python3 is unavailable.
fn python(bytes: &[u8], script: &str, args: &[&str]) -> Option<String> {
    let program = format!("import pickle, sys, json\nd = pickle.load(sys.stdin.buffer)\n{script}");
    let child = Command::new("python3")
        .arg("-c")
        .arg(&program)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn();
    let mut child = match child {
        Ok(c) => c,
        Err(e) => {
            eprintln!("skipping: cannot run python3: {e}");
            return None;
        }
    };
    child
        .stdin
        .take()
        .expect("stdin is piped")
        .write_all(bytes)
        .expect("python reads its stdin");
    let out = child.wait_with_output().expect("python3 runs");
    assert!(
        out.status.success(),
        "python3 failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Some(String::from_utf8(out.stdout).expect("utf-8 output"))
}

fn to_json(v: &Value) -> serde_json::Value {
    use serde_json::Value as J;
    match v {
        Value::None => J::Null,
        Value::Bool(b) => J::from(*b),
        Value::Int(i) => J::from(*i),
        Value::Float(f) => J::from(*f),
        Value::Str(s) => J::from(s.as_str()),
        Value::List(items) | Value::Tuple(items) => J::Array(items.iter().map(to_json).collect()),
        Value::Dict(items) => J::Object(
            items
                .iter()
                .map(|(k, v)| (k.as_str().expect("str keys").to_owned(), to_json(v)))
                .collect(),
        ),
        other => panic!("not used in snapshots: {other:?}"),
    }
}

fn synthetic() -> Snapshot {
    let frames = vec![
        Frame::new("train.py", 42, "step"),
        Frame::new("??", 0, "c10::cuda::CUDACachingAllocator::malloc"),
        Frame::new("caf\u{e9}.py", 7, "\u{20ac}"),
    ];
    let base = 0x7f3a_0000_0000u64;
    let mut events = vec![
        TraceEntry::new(Action::SegmentAlloc, base, 20 << 20, 0),
        TraceEntry::new(Action::Alloc, base, 1 << 20, 0),
        TraceEntry::new(Action::FreeRequested, base, 1 << 20, 0),
        TraceEntry::new(Action::FreeCompleted, base, 1 << 20, 0),
        TraceEntry::new(Action::SegmentFree, base, 20 << 20, 0),
        TraceEntry {
            device_free: Some(5 << 30),
            ..TraceEntry::new(Action::Oom, 0, 80 << 30, 0x5555_0000)
        },
        TraceEntry::new(Action::Snapshot, 0, 0, 0),
    ];
    for (i, e) in events.iter_mut().enumerate() {
        e.time_us = Some(1_772_552_894_612_373 + i as i64);
        e.frames = frames.clone();
    }
    Snapshot {
        segments: vec![Segment {
            device: 0,
            address: base,
            total_size: 20 << 20,
            allocated_size: 2 << 20,
            active_size: 3 << 20,
            requested_size: (2 << 20) - 100,
            stream: 0x5555_0000,
            segment_type: SegmentType::Large,
            segment_pool_id: (1, 7),
            is_expandable: true,
            frames: frames.clone(),
            blocks: vec![
                Block {
                    address: base,
                    size: 2 << 20,
                    requested_size: (2 << 20) - 100,
                    state: BlockState::ActiveAllocated,
                    frames: frames.clone(),
                },
                Block {
                    address: base + (2 << 20),
                    size: 1 << 20,
                    requested_size: 1 << 20,
                    state: BlockState::ActivePendingFree,
                    frames: vec![],
                },
                Block {
                    address: base + (3 << 20),
                    size: 17 << 20,
                    requested_size: 17 << 20,
                    state: BlockState::Inactive,
                    frames: vec![],
                },
            ],
        }],
        device_traces: vec![events, vec![]],
        allocator_settings: Some(
            [
                ("expandable_segments".to_owned(), Value::Bool(true)),
                ("max_split_size".to_owned(), Value::Int(-1)),
                ("garbage_collection_threshold".to_owned(), Value::Float(0.5)),
                (
                    "PYTORCH_CUDA_ALLOC_CONF".to_owned(),
                    Value::from("expandable_segments:True"),
                ),
            ]
            .into_iter()
            .collect(),
        ),
        external_annotations: None,
    }
}

#[test]
fn synthetic_snapshot_loads_in_python_as_written() {
    let snap = synthetic();
    let bytes = snap.to_pickle().expect("exportable");
    for op in pickle::opcodes_used(&bytes).expect("well-formed") {
        assert!(pickle::MEMORYVIZ_WHITELIST.contains(&op), "{op:#04x}");
    }
    // Our reader gets the same snapshot back.
    assert_eq!(Snapshot::from_pickle(&bytes).as_ref(), Ok(&snap));
    let Some(out) = python(&bytes, "print(json.dumps(d))", &[]) else {
        return;
    };
    let from_python: serde_json::Value = serde_json::from_str(&out).expect("json");
    assert_eq!(from_python, to_json(&snap.to_value().expect("value")));
    // Spot checks on what Python sees.
    assert_eq!(from_python["device_traces"][0][5]["action"], "oom");
    assert_eq!(
        from_python["device_traces"][0][5]["device_free"],
        5u64 << 30
    );
    assert_eq!(
        from_python["segments"][0]["segment_pool_id"],
        serde_json::json!([1, 7])
    );
    assert_eq!(
        from_python["segments"][0]["blocks"][1]["state"],
        "active_pending_free"
    );
    // Python also sees the tuple as a tuple.
    let Some(kind) = python(
        &bytes,
        "print(type(d['segments'][0]['segment_pool_id']).__name__)",
        &[],
    ) else {
        return;
    };
    assert_eq!(kind.trim(), "tuple");
}

/// Python compares our export of a real snapshot with the original file (minus the event
/// keys our model does not keep).
#[test]
fn real_snapshots_exported_equal_the_originals_in_python() {
    let Some(dir) = common::traces_dir() else {
        return;
    };
    let script = "orig = pickle.load(open(sys.argv[1], 'rb'))\n\
        for t in orig['device_traces']:\n    for e in t:\n        e.pop('compile_context', None)\n        e.pop('user_metadata', None)\n\
        print('EQUAL' if orig == d else 'DIFFERENT', sum(map(len, d['device_traces'])))";
    for (name, events) in [
        ("transformer-lm-forward-bf16.pickle", 2_811),
        ("transformer-lm-train.pickle", 5_163),
    ] {
        let path = dir.join(name);
        let Ok(original) = std::fs::read(&path) else {
            eprintln!("skipping {name}: unreadable");
            continue;
        };
        let snap = Snapshot::from_pickle(&original).expect("parses");
        let ours = snap.to_pickle().expect("exportable");
        let Some(out) = python(&ours, script, &[path.to_str().expect("utf-8 path")]) else {
            return;
        };
        assert_eq!(out.trim(), format!("EQUAL {events}"), "{name}");
    }
}
