//! The three real PyTorch snapshots in the shared traces directory load with the counts their
//! SOURCES.md states, and survive an export / re-import round trip.

mod common;

use std::time::Instant;

use gpualloc_trace::pickle;
use gpualloc_trace::{Action, BlockState, Snapshot};

fn load(name: &str) -> Option<Snapshot> {
    let bytes = common::trace_bytes(name)?;
    let start = Instant::now();
    let snap = Snapshot::from_pickle(&bytes).expect("real snapshot parses");
    eprintln!(
        "{name}: {} bytes parsed in {:?}",
        bytes.len(),
        start.elapsed()
    );
    Some(snap)
}

#[test]
fn llama_lora_finetune() {
    let Some(s) = load("llama-lora-finetune.pickle") else {
        return;
    };
    assert_eq!(s.device_traces.len(), 1);
    assert_eq!(s.event_count(), 10_307);
    assert_eq!(s.count(Action::SegmentAlloc), 152);
    assert_eq!(s.count(Action::Alloc), 3_505);
    assert_eq!(s.count(Action::FreeRequested), 3_325);
    assert_eq!(s.count(Action::FreeCompleted), 3_325);
    // Older format: no timestamps, no allocator settings.
    assert!(s.device_traces[0].iter().all(|e| e.time_us.is_none()));
    assert!(s.allocator_settings.is_none());
    assert!(s.external_annotations.is_none());
    assert_eq!(s.segments.len(), 215);
    let blocks: usize = s.segments.iter().map(|seg| seg.blocks.len()).sum();
    assert_eq!(blocks, 1_079);
    let first = &s.segments[0];
    assert_eq!(first.address, 139_927_954_128_896);
    assert_eq!(first.total_size, 132_120_576);
    assert_eq!(first.allocated_size, 24_576_000);
    assert_eq!(first.blocks[0].requested_size, 8_192_000);
    assert_eq!(first.blocks[0].state, BlockState::Inactive);
    let e0 = &s.device_traces[0][0];
    assert_eq!(e0.action, Action::Alloc);
    assert_eq!(e0.addr, 139_936_756_924_416);
    assert_eq!(e0.size, 8_192_000);
    assert_eq!(&*e0.frames[0].name, "torch::unwind::unwind()");
    assert_eq!(&*e0.frames[0].filename, "??");
    let frames: usize = s.device_traces[0].iter().map(|e| e.frames.len()).sum();
    assert_eq!(frames, 984_474);
    let block_frames: usize = s
        .segments
        .iter()
        .flat_map(|seg| seg.blocks.iter().map(|b| b.frames.len()))
        .sum();
    assert_eq!(block_frames, 22_475);
    let segment_frames: usize = s.segments.iter().map(|seg| seg.frames.len()).sum();
    assert_eq!(segment_frames, 4_983);
}

#[test]
fn transformer_lm_train() {
    let Some(s) = load("transformer-lm-train.pickle") else {
        return;
    };
    assert_eq!(s.event_count(), 5_163);
    assert_eq!(s.count(Action::SegmentAlloc), 0);
    assert_eq!(s.count(Action::SegmentFree), 0);
    assert_eq!(s.count(Action::Alloc), 1_721);
    assert_eq!(s.segments.len(), 216);
    assert!(s.device_traces[0].iter().all(|e| e.time_us.is_some()));
    assert_eq!(s.device_traces[0][0].time_us, Some(1_776_479_641_085_368));
    let settings = s.allocator_settings.as_ref().expect("allocator_settings");
    assert_eq!(
        settings.get("max_split_size"),
        Some(&pickle::Value::Int(-1))
    );
    assert_eq!(
        settings.get("expandable_segments"),
        Some(&pickle::Value::Bool(false))
    );
    assert_eq!(s.external_annotations, Some(pickle::Value::List(vec![])));
}

#[test]
fn transformer_lm_forward_bf16() {
    let Some(s) = load("transformer-lm-forward-bf16.pickle") else {
        return;
    };
    assert_eq!(s.event_count(), 2_811);
    assert_eq!(s.count(Action::Alloc), 937);
    assert_eq!(s.count(Action::FreeCompleted), 937);
    assert_eq!(s.segments.len(), 43);
    let annotations = s.external_annotations.as_ref().expect("annotations");
    let first = &annotations.as_seq().expect("a list")[0];
    assert_eq!(first.get("stage").and_then(|v| v.as_str()), Some("START"));
    assert_eq!(
        first.get("time_us").and_then(|v| v.as_i64()),
        Some(1_772_552_894_612_167)
    );
}

#[test]
fn real_snapshots_round_trip_through_our_writer() {
    for name in [
        "transformer-lm-forward-bf16.pickle",
        "transformer-lm-train.pickle",
    ] {
        let Some(s) = load(name) else {
            return;
        };
        let bytes = s.to_pickle().expect("exportable");
        let used = pickle::opcodes_used(&bytes).expect("well-formed");
        for op in &used {
            assert!(
                pickle::MEMORYVIZ_WHITELIST.contains(op),
                "{name}: opcode {op:#04x} outside the whitelist"
            );
        }
        let back = Snapshot::from_pickle(&bytes).expect("re-import");
        assert_eq!(back, s, "{name}");
    }
}

#[test]
fn real_snapshots_use_only_data_opcodes() {
    let Some(dir) = common::traces_dir() else {
        return;
    };
    for name in [
        "llama-lora-finetune.pickle",
        "transformer-lm-train.pickle",
        "transformer-lm-forward-bf16.pickle",
    ] {
        let Ok(bytes) = std::fs::read(dir.join(name)) else {
            eprintln!("skipping {name}: unreadable");
            continue;
        };
        let used = pickle::opcodes_used(&bytes).expect("well-formed");
        assert!(
            used.iter().all(|op| !pickle::FORBIDDEN.contains(op)),
            "{name}"
        );
        assert!(
            used.contains(&pickle::opcodes::LONG1),
            "{name}: addresses need LONG1"
        );
        assert!(used.contains(&pickle::opcodes::MEMOIZE), "{name}");
    }
}

/// Without call stacks, a snapshot reads the same except that every `frames` list is empty.
#[test]
fn reading_without_frames_drops_only_the_frames() {
    for name in [
        "llama-lora-finetune.pickle",
        "transformer-lm-forward-bf16.pickle",
        "transformer-lm-train.pickle",
    ] {
        let Some(bytes) = common::trace_bytes(name) else {
            return;
        };
        let mut full = Snapshot::from_pickle(&bytes).unwrap();
        let lean = Snapshot::from_pickle_without_frames(&bytes).unwrap();
        let stacks: usize = full
            .device_traces
            .iter()
            .flatten()
            .map(|e| e.frames.len())
            .sum();
        assert!(stacks > 0, "{name} has call stacks to drop");
        for e in full.device_traces.iter_mut().flatten() {
            e.frames.clear();
        }
        for s in &mut full.segments {
            s.frames.clear();
            for b in &mut s.blocks {
                b.frames.clear();
            }
        }
        assert_eq!(full, lean, "{name}");
    }
}
