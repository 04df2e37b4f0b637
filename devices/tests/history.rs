//! The history's times and marks (issue 23): entries are stamped with the time last set, or
//! with the trace clock while one is set; a snapshot taken while recording leaves PyTorch's
//! `snapshot` mark with the allocated bytes.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use gpualloc_devices::{AllocatorConfig, DeviceCore, TraceAction};
use gpualloc_runtime::accounting::AccountingBackend;
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
