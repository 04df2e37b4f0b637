//! The OOM chain on the simulated GPU, driven by its fault injection and capacity limit: each
//! step of the chain is reached by making the device's malloc fail a given number of times.

mod common;

use std::sync::Arc;

use gpualloc_devices::{AllocError, AllocatorConfig, DeviceCore, Miss, MissStep, TraceAction};
use gpualloc_runtime::{Backend, BackendError, DeviceId, StreamHandle};
use gpualloc_sim::{Fault, Op, SimBackend, SimConfig};

const MIB: u64 = 1 << 20;

fn rig(capacity: u64, conf: &str) -> (Arc<SimBackend>, DeviceCore, StreamHandle, StreamHandle) {
    let sim = SimBackend::new(SimConfig {
        capacity_per_device: capacity,
        ..SimConfig::fast(1)
    })
    .unwrap();
    let dynb: Arc<dyn Backend> = sim.clone();
    let s0 = dynb.stream_create(DeviceId(0)).unwrap();
    let s1 = dynb.stream_create(DeviceId(0)).unwrap();
    let mut core =
        DeviceCore::new(dynb, DeviceId(0), AllocatorConfig::parse(conf).unwrap()).unwrap();
    core.record_history(Some(1000));
    (sim, core, s0, s1)
}

fn fail_mallocs(sim: &SimBackend, count: u64) {
    let oom = BackendError::OutOfMemory {
        requested: 0,
        what: "injected".into(),
    };
    sim.inject(
        Op::Malloc,
        Fault::FailNext {
            skip: 0,
            count,
            error: oom,
        },
    );
}

fn actions(core: &DeviceCore) -> Vec<TraceAction> {
    core.snapshot().trace.iter().map(|e| e.action).collect()
}

#[test]
fn one_failed_malloc_releases_oversize_cached_blocks_then_succeeds() {
    let (sim, mut core, s0, _) = rig(16 << 30, "max_split_size_mb:64");
    let big = core.malloc(100 * MIB, s0).unwrap();
    core.free(big.ptr).unwrap();
    fail_mallocs(&sim, 1);
    // 80 MiB may not take the 100 MiB block (the waste would reach max_non_split_rounding).
    let a = core.malloc(80 * MIB, s0).unwrap();
    assert_eq!(
        sim.counts().get(Op::Free),
        1,
        "the cached 100 MiB oversize block went back"
    );
    assert_eq!(
        core.stats().num_alloc_retries,
        0,
        "no full release was needed"
    );
    assert_eq!(core.reserved_bytes(), 80 * MIB);
    assert_ne!(a.ptr, big.ptr);
    core.check_invariants().unwrap();
}

#[test]
fn two_failed_mallocs_reach_the_synchronized_release_of_everything() {
    let (sim, mut core, s0, s1) = rig(16 << 30, "");
    let a = core.malloc(30 * MIB, s0).unwrap();
    core.record_stream(a.ptr, s1).unwrap();
    core.free(a.ptr).unwrap();
    let small = core.malloc(4096, s0).unwrap();
    core.free(small.ptr).unwrap();
    fail_mallocs(&sim, 1);
    // Without max_split_size the oversize release does nothing; the chain then waits for
    // the pending free, returns every cached segment and retries once.
    let b = core.malloc(50 * MIB, s0).unwrap();
    assert_eq!(core.stats().num_alloc_retries, 1);
    assert_eq!(core.stats().num_sync_all_streams, 1);
    assert_eq!(
        sim.counts().get(Op::Free),
        2,
        "the 30 MiB and the 2 MiB segments"
    );
    assert_eq!(core.pending_frees(), 0);
    let acts = actions(&core);
    let last_alloc = acts
        .iter()
        .rposition(|a| *a == TraceAction::SegmentAlloc)
        .unwrap();
    assert_eq!(
        acts[last_alloc - 2..last_alloc],
        [TraceAction::SegmentFree, TraceAction::SegmentFree]
    );
    core.free(b.ptr).unwrap();
    core.check_invariants().unwrap();
}

#[test]
fn mallocs_that_keep_failing_end_in_a_counted_oom_with_a_report() {
    let (sim, mut core, s0, _) = rig(16 << 30, "");
    let keep = core.malloc(8 * MIB, s0).unwrap();
    fail_mallocs(&sim, u64::MAX);
    let err = core.malloc(50 * MIB, s0).unwrap_err();
    let AllocError::OutOfMemory(report) = err else {
        panic!("expected OOM")
    };
    assert_eq!(report.requested, 50 * MIB);
    assert_eq!(report.allocated, 8 * MIB);
    assert_eq!(report.reserved, 20 * MIB);
    assert_eq!(core.stats().num_ooms, 1);
    assert_eq!(core.stats().num_alloc_retries, 1);
    assert_eq!(*actions(&core).last().unwrap(), TraceAction::Oom);
    sim.clear_faults();
    core.free(keep.ptr).unwrap();
    core.empty_cache().unwrap();
    assert_eq!(sim.used_bytes(DeviceId(0)).unwrap(), 0);
}

#[test]
fn the_device_capacity_limit_is_an_oom_not_a_crash() {
    let (sim, mut core, s0, _) = rig(64 * MIB, "");
    let a = core.malloc(40 * MIB, s0).unwrap();
    assert!(core.malloc(40 * MIB, s0).unwrap_err().is_oom());
    core.free(a.ptr).unwrap();
    // The cached 40 MiB segment is released by the chain and the request then fits.
    let b = core.malloc(50 * MIB, s0).unwrap();
    assert_eq!(core.reserved_bytes(), 50 * MIB);
    assert_eq!(sim.used_bytes(DeviceId(0)).unwrap(), 50 * MIB);
    core.free(b.ptr).unwrap();
}

#[test]
fn a_non_oom_driver_error_is_returned_as_is() {
    let (sim, mut core, s0, _) = rig(16 << 30, "");
    let err = BackendError::Driver {
        code: 999,
        name: "CUDA_ERROR_UNKNOWN".into(),
    };
    sim.inject(
        Op::Malloc,
        Fault::FailNext {
            skip: 0,
            count: 1,
            error: err.clone(),
        },
    );
    assert_eq!(core.malloc(MIB, s0).unwrap_err(), AllocError::Backend(err));
    assert_eq!(core.reserved_bytes(), 0);
    core.check_invariants().unwrap();
}

/// An owner's miss off the core (the device actor's): the device had no room when it tried,
/// and a block freed meanwhile serves the request, with no backend call; with nothing freed,
/// the out-of-memory report, counted once.
#[test]
fn an_off_core_miss_serves_from_blocks_freed_meanwhile_or_reports() {
    let (sim, mut core, s0, _s1) = rig(64 * MIB, "");
    let a = core.malloc(40 * MIB, s0).unwrap();
    let gpualloc_devices::CachedOutcome::Miss(req) = core.try_cached(30 * MIB, s0).unwrap() else {
        panic!("nothing is cached yet");
    };
    // The owner tried the device off the core meanwhile; then `a` was freed.
    core.free(a.ptr).unwrap();
    sim.reset_counts();
    let step = common::drive_miss(&mut core, Miss::off_core(req), common::segment_malloc);
    let MissStep::Done(b) = step else {
        panic!("expected the block freed meanwhile to serve it");
    };
    assert_eq!(b.ptr, a.ptr, "served from the block freed meanwhile");
    assert_eq!(sim.counts().total(), 0, "no backend call at all");
    let gpualloc_devices::CachedOutcome::Miss(req) = core.try_cached(40 * MIB, s0).unwrap() else {
        panic!("the cache cannot hold 40 MiB more");
    };
    let step = common::drive_miss(&mut core, Miss::off_core(req), common::segment_malloc);
    let MissStep::Failed(AllocError::OutOfMemory(report)) = step else {
        panic!("expected out of memory");
    };
    assert_eq!(report.requested, 40 * MIB);
    assert_eq!(report.reserved, 40 * MIB);
    assert_eq!(core.stats().num_ooms, 1);
    assert_eq!(sim.counts().get(Op::Malloc), 0);
    assert_eq!(sim.counts().get(Op::Free), 0);
    core.free(a.ptr).unwrap();
    core.check_invariants().unwrap();
}

#[test]
fn a_failed_event_record_synchronizes_and_keeps_its_event_for_reuse() {
    let (sim, mut core, s0, s1) = rig(64 * MIB, "");
    let a = core.malloc(MIB, s0).unwrap();
    core.record_stream(a.ptr, s1).unwrap();
    sim.inject(
        Op::EventRecord,
        Fault::FailNext {
            skip: 0,
            count: 1,
            error: BackendError::Driver {
                code: 719,
                name: "injected".into(),
            },
        },
    );
    sim.reset_counts();
    core.free(a.ptr).unwrap();
    // The record failed: the device was synchronized instead, and the block is free.
    assert_eq!(sim.counts().get(Op::DeviceSynchronize), 1);
    let b = core.malloc(MIB, s0).unwrap();
    assert_eq!(b.ptr, a.ptr);
    // The event made for the failed record is pooled, not lost: the next cross-stream free
    // reuses it.
    core.record_stream(b.ptr, s1).unwrap();
    core.free(b.ptr).unwrap();
    assert_eq!(sim.counts().get(Op::EventCreate), 1, "an event leaked");
    assert_eq!(sim.counts().get(Op::EventRecord), 2);
    core.empty_cache().unwrap();
    core.shutdown().unwrap();
}
