//! The history's times and marks: entries are stamped with the time last set, or
//! with the trace clock while one is set; a snapshot taken while recording leaves PyTorch's
//! `snapshot` mark with the allocated bytes.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use gpualloc_accounting::AccountingBackend;
use gpualloc_devices::{AllocatorConfig, DeviceCore, TraceAction};
use gpualloc_runtime::{Backend, DeviceId};

#[test]
fn entries_take_the_clock_while_one_is_set_and_snapshots_leave_a_mark() {
    let backend: Arc<dyn Backend> = Arc::new(AccountingBackend::new(1, 1 << 30));
    let s = backend.stream_create(DeviceId(0)).unwrap();
    let mut core = DeviceCore::new(backend, DeviceId(0), AllocatorConfig::default()).unwrap();
    core.record_history(Some(100));
    core.set_time_us(7);
    let a = core.malloc(1000, s).unwrap();
    let ticks = Arc::new(AtomicU64::new(1_000));
    let t = ticks.clone();
    core.set_trace_clock(Some(Box::new(move || t.fetch_add(10, Ordering::Relaxed))));
    let b = core.malloc(3000, s).unwrap();
    core.record_snapshot_taken();
    core.set_trace_clock(None);
    core.free(a.ptr).unwrap();
    let trace: Vec<(TraceAction, u64, u64)> = core
        .snapshot()
        .trace
        .iter()
        .map(|e| (e.action, e.size, e.time_us))
        .collect();
    assert_eq!(
        trace,
        vec![
            (TraceAction::SegmentAlloc, 2 << 20, 7),
            (TraceAction::Alloc, 1000, 7),
            (TraceAction::Alloc, 3000, 1_000),
            // The allocated bytes: both blocks, rounded to 512.
            (TraceAction::Snapshot, 1024 + 3072, 1_010),
            (TraceAction::FreeRequested, 1000, 7),
            (TraceAction::FreeCompleted, 1000, 7),
        ]
    );
    assert_eq!(ticks.load(Ordering::Relaxed), 1_020);
    // Not recording: no mark.
    core.record_history(None);
    core.record_snapshot_taken();
    assert!(core.snapshot().trace.is_empty());
    core.free(b.ptr).unwrap();
}

#[test]
fn frames_attach_to_the_newest_alloc_entry_and_to_the_live_block_only() {
    use gpualloc_devices::{Frame, Frames};
    let backend: Arc<dyn Backend> = Arc::new(AccountingBackend::new(1, 1 << 30));
    let s = backend.stream_create(DeviceId(0)).unwrap();
    let mut core = DeviceCore::new(backend, DeviceId(0), AllocatorConfig::default()).unwrap();
    let frames = |name: &str| -> Frames {
        vec![Frame {
            name: name.into(),
            filename: "f.rs".into(),
            line: 3,
        }]
        .into()
    };
    // Not recording: nothing is kept.
    let a = core.malloc(1000, s).unwrap();
    core.attach_frames(a.ptr.0, frames("early"));
    core.record_history(Some(100));
    let block_frames = |core: &DeviceCore, addr: u64| {
        core.snapshot()
            .segments
            .iter()
            .flat_map(|s| s.blocks.clone())
            .find(|b| b.address == addr)
            .and_then(|b| b.frames)
            .map(|f| f[0].name.clone())
    };
    assert_eq!(block_frames(&core, a.ptr.0), None);
    core.free(a.ptr).unwrap();
    // The same address again: the newest alloc entry gets the frames, the older one not.
    let b = core.malloc(1000, s).unwrap();
    assert_eq!(b.ptr, a.ptr);
    core.free(b.ptr).unwrap();
    let c = core.malloc(1000, s).unwrap();
    assert_eq!(c.ptr, a.ptr);
    // Another allocation lands between c's and the attach (a concurrent request).
    let other = core.malloc(5000, s).unwrap();
    core.attach_frames(c.ptr.0, frames("c"));
    // An address that is not live: nothing.
    core.attach_frames(c.ptr.0 + 512, frames("nobody"));
    let named: Vec<Option<String>> = core
        .snapshot()
        .trace
        .iter()
        .filter(|e| e.action == TraceAction::Alloc)
        .map(|e| e.frames.as_ref().map(|f| f[0].name.clone()))
        .collect();
    assert_eq!(named, vec![None, Some("c".to_string()), None]);
    assert_eq!(block_frames(&core, c.ptr.0).as_deref(), Some("c"));
    // Freed: its block no longer carries them, nor does the next allocation there.
    core.free(c.ptr).unwrap();
    let d = core.malloc(1000, s).unwrap();
    assert_eq!(d.ptr, a.ptr);
    assert_eq!(block_frames(&core, d.ptr.0), None);
    core.attach_frames(d.ptr.0, frames("d"));
    assert_eq!(block_frames(&core, d.ptr.0).as_deref(), Some("d"));
    // Stopping forgets them.
    core.record_history(None);
    core.record_history(Some(100));
    assert_eq!(block_frames(&core, d.ptr.0), None);
    core.free(d.ptr).unwrap();
    core.free(other.ptr).unwrap();
}
