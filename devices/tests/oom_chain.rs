//! The miss path and OOM chain, one test per step, in PyTorch's order: free-memory callbacks,
//! garbage collection, private-pool fallback, release of oversize cached blocks, release of
//! everything after synchronizing pending events, then the OOM report.

mod common;

use std::sync::{Arc, Mutex};

use gpualloc_accounting::AccountingBackend;
use gpualloc_devices::{
    AllocError, AllocatorConfig, CachedOutcome, DeviceCore, Miss, MissIo, MissStep, TraceAction,
};
use gpualloc_runtime::{Backend, DeviceId, DevicePtr, StreamHandle};

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;

fn rig(
    capacity: u64,
    conf: &str,
    manual: bool,
) -> (
    Arc<AccountingBackend>,
    DeviceCore,
    StreamHandle,
    StreamHandle,
) {
    let backend = Arc::new(if manual {
        AccountingBackend::manual_events(1, capacity)
    } else {
        AccountingBackend::new(1, capacity)
    });
    let dynb: Arc<dyn Backend> = backend.clone();
    let s0 = dynb.stream_create(DeviceId(0)).unwrap();
    let s1 = dynb.stream_create(DeviceId(0)).unwrap();
    let mut core =
        DeviceCore::new(dynb, DeviceId(0), AllocatorConfig::parse(conf).unwrap()).unwrap();
    core.record_history(Some(1000));
    (backend, core, s0, s1)
}

fn actions(core: &DeviceCore) -> Vec<TraceAction> {
    core.snapshot().trace.iter().map(|e| e.action).collect()
}

#[test]
fn step1_free_memory_callbacks_run_before_a_device_malloc() {
    let (backend, mut core, s0, _) = rig(20 * MIB, "", false);
    let a = core.malloc(19 * MIB + 512 * 1024, s0).unwrap();
    let released: Arc<Mutex<Vec<DevicePtr>>> = Arc::new(Mutex::new(vec![a.ptr]));
    let r = released.clone();
    core.add_free_memory_callback(Box::new(move || std::mem::take(&mut *r.lock().unwrap())));
    let b = core.malloc(19 * MIB, s0).unwrap();
    assert_eq!(b.ptr, a.ptr, "the callback's free made a cache hit");
    assert_eq!(backend.counts().mallocs, 1);
    assert_eq!(backend.counts().failed_mallocs, 0);
    core.check_invariants().unwrap();
}

#[test]
fn step2_garbage_collection_frees_the_oldest_cached_segments() {
    // 100 MiB device, all of it allowed, GC above 50 MiB reserved.
    let (backend, mut core, s0, _) = rig(
        100 * MIB,
        "garbage_collection_threshold:0.5,per_process_memory_fraction:1.0",
        false,
    );
    let old = core.malloc(12 * MIB, s0).unwrap();
    let young = core.malloc(14 * MIB, s0).unwrap();
    let busy = core.malloc(26 * MIB, s0).unwrap();
    core.free(old.ptr).unwrap();
    // Lookups age the cached block: each hit on `busy`'s size counts.
    core.free(busy.ptr).unwrap();
    for _ in 0..5 {
        let b = core.malloc(26 * MIB, s0).unwrap();
        core.free(b.ptr).unwrap();
    }
    core.free(young.ptr).unwrap();
    assert_eq!(core.reserved_bytes(), 52 * MIB);
    // A miss above the threshold collects: `old` (age 6) is above the average, `young`
    // (age 0) and `busy` (age 1) are not.
    let _c = core.malloc(30 * MIB, s0).unwrap();
    let segs: Vec<u64> = core.snapshot().segments.iter().map(|s| s.address).collect();
    assert!(!segs.contains(&old.ptr.0), "oldest segment collected");
    assert!(segs.contains(&young.ptr.0) && segs.contains(&busy.ptr.0));
    assert_eq!(backend.counts().frees, 1);
    assert_eq!(core.reserved_bytes(), 40 * MIB + 30 * MIB);
    core.check_invariants().unwrap();
}

#[test]
fn step3_private_pool_marked_use_on_oom_serves_a_failing_request() {
    let (backend, mut core, s0, _) = rig(40 * MIB, "", false);
    let pool = core.create_pool(true);
    core.begin_allocate_to_pool(pool, s0).unwrap();
    let a = core.malloc(19 * MIB + 512 * 1024, s0).unwrap();
    core.end_allocate_to_pool(s0);
    core.free(a.ptr).unwrap();
    let _b = core.malloc(19 * MIB + 512 * 1024, s0).unwrap();
    assert_eq!(
        backend.counts().mallocs,
        2,
        "default pool got its own segment"
    );
    let c = core.malloc(19 * MIB, s0).unwrap();
    assert_eq!(c.ptr, a.ptr, "served from the private pool");
    assert_eq!(backend.counts().failed_mallocs, 1);
    assert_eq!(
        core.snapshot()
            .segments
            .iter()
            .filter(|s| s.pool_id != (0, 0))
            .count(),
        1
    );
    // A pool without use_on_oom is never borrowed from.
    let (_, mut core2, t0, _) = rig(40 * MIB, "", false);
    let p2 = core2.create_pool(false);
    core2.begin_allocate_to_pool(p2, t0).unwrap();
    let x = core2.malloc(19 * MIB + 512 * 1024, t0).unwrap();
    core2.end_allocate_to_pool(t0);
    core2.free(x.ptr).unwrap();
    let _y = core2.malloc(19 * MIB + 512 * 1024, t0).unwrap();
    assert!(core2.malloc(19 * MIB, t0).unwrap_err().is_oom());
    core.check_invariants().unwrap();
    core2.check_invariants().unwrap();
}

#[test]
fn step4_oversize_cached_blocks_are_released_first() {
    let (backend, mut core, s0, _) = rig(80 * MIB, "max_split_size_mb:30", false);
    let a = core.malloc(60 * MIB, s0).unwrap();
    core.free(a.ptr).unwrap();
    let small = core.malloc(5 * MIB, s0).unwrap(); // 20 MiB segment, not the oversize block
    assert_ne!(small.ptr, a.ptr);
    // 40 MiB may not take the 60 MiB block (waste ≥ 20 MiB) and does not fit beside it.
    let _b = core.malloc(40 * MIB, s0).unwrap();
    assert_eq!(backend.counts().frees, 1, "the oversize block was released");
    assert_eq!(backend.counts().failed_mallocs, 1);
    assert_eq!(core.stats().num_alloc_retries, 0);
    assert_eq!(core.stats().num_sync_all_streams, 0);
    assert_eq!(core.stats().oversize_segments.current, 1);
    let acts = actions(&core);
    let i_free = acts
        .iter()
        .position(|a| *a == TraceAction::SegmentFree)
        .unwrap();
    assert!(
        acts[..i_free]
            .iter()
            .filter(|a| **a == TraceAction::SegmentAlloc)
            .count()
            == 2
    );
    core.check_invariants().unwrap();
}

#[test]
fn step5_release_everything_after_synchronizing_pending_frees() {
    let (backend, mut core, s0, s1) = rig(40 * MIB, "", true);
    let a = core.malloc(19 * MIB + 512 * 1024, s0).unwrap();
    core.record_stream(a.ptr, s1).unwrap();
    core.free(a.ptr).unwrap();
    let _b = core.malloc(19 * MIB + 512 * 1024, s0).unwrap();
    assert_eq!(core.pending_frees(), 1);
    let c = core.malloc(19 * MIB, s1).unwrap();
    assert_eq!(core.pending_frees(), 0);
    assert_eq!(core.stats().num_alloc_retries, 1);
    assert_eq!(core.stats().num_sync_all_streams, 1);
    assert_eq!(backend.counts().frees, 1);
    assert_eq!(c.stream, s1);
    core.check_invariants().unwrap();
}

#[test]
fn step6_out_of_memory_reports_the_numbers() {
    let (_, mut core, s0, _) = rig(40 * MIB, "", false);
    let _a = core.malloc(19 * MIB + 512 * 1024, s0).unwrap();
    let _b = core.malloc(14 * MIB + 1, s0).unwrap(); // a 16 MiB segment, split
    let err = core.malloc(10 * MIB, s0).unwrap_err();
    let AllocError::OutOfMemory(report) = err else {
        panic!("expected OOM, got {err:?}")
    };
    assert_eq!(report.requested, 10 * MIB);
    assert_eq!(report.alloc_size, 10 * MIB);
    assert_eq!(report.device_total, 40 * MIB);
    assert_eq!(report.device_free, 4 * MIB);
    assert_eq!(report.reserved, 36 * MIB);
    assert_eq!(report.allocated, 20 * MIB + 14 * MIB + 512);
    assert_eq!(report.reserved_unallocated(), 2 * MIB - 512);
    assert_eq!(core.stats().num_ooms, 1);
    assert_eq!(core.stats().num_alloc_retries, 1);
    assert_eq!(*actions(&core).last().unwrap(), TraceAction::Oom);
    core.check_invariants().unwrap();
}

#[test]
fn per_process_memory_fraction_caps_reserved_memory() {
    let (backend, mut core, s0, _) = rig(100 * MIB, "per_process_memory_fraction:0.5", false);
    let _a = core.malloc(30 * MIB, s0).unwrap();
    let err = core.malloc(30 * MIB, s0).unwrap_err();
    let AllocError::OutOfMemory(report) = err else {
        panic!("expected OOM")
    };
    assert_eq!(report.allowed, Some(50 * MIB));
    assert_eq!(
        report.device_free,
        70 * MIB,
        "the device had room: the fraction said no"
    );
    assert_eq!(backend.counts().failed_mallocs, 0, "never asked the device");
    assert!(report.to_string().contains("50.00 MiB allowed"));
}

/// The off-core garbage collection (`detach_gc_victims`) picks, round by round, the cached
/// segments at least as old as the average of those left, until enough is reclaimed.
#[test]
fn detached_garbage_collection_picks_old_segments_round_by_round() {
    // 100 MiB allowed, collect above 45 MiB.
    let (_backend, mut core, s0, _) = rig(
        100 * MIB,
        "garbage_collection_threshold:0.45,per_process_memory_fraction:1.0",
        false,
    );
    let [a, b, c, d] = [0; 4].map(|_| core.malloc(20 * MIB, s0).unwrap());
    let x = core.malloc(12 * MIB, s0).unwrap();
    // Each 12 MiB malloc is one large-pool lookup (it hits `x`): the ages of the others.
    let lookups = |core: &mut DeviceCore, n: usize| {
        for _ in 0..n {
            let m = core.malloc(12 * MIB, s0).unwrap();
            assert_eq!(m.ptr, x.ptr);
            core.free(m.ptr).unwrap();
        }
    };
    core.free(a.ptr).unwrap();
    core.free(x.ptr).unwrap();
    lookups(&mut core, 4);
    core.free(b.ptr).unwrap();
    lookups(&mut core, 3);
    core.free(c.ptr).unwrap();
    lookups(&mut core, 1);
    core.free(d.ptr).unwrap();
    lookups(&mut core, 1);
    // Ages a 9, b 5, c 2, d 1, x 0; 92 MiB reserved, 47 MiB to reclaim. Round 1 (average
    // 3.4): a, b (40 MiB). Round 2 over c, d, x (average 1): c, d.
    assert_eq!(core.reserved_bytes(), 92 * MIB);
    let victims = core.detach_gc_victims().unwrap();
    let mut got: Vec<u64> = victims.iter().map(|s| s.ptr.0).collect();
    got.sort_unstable();
    let mut want = vec![a.ptr.0, b.ptr.0, c.ptr.0, d.ptr.0];
    want.sort_unstable();
    assert_eq!(got, want);
    assert_eq!(core.reserved_bytes(), 12 * MIB);
    // Out of the books, the device's until the caller's frees return.
    assert_eq!(core.releasing_bytes(), 80 * MIB);
    let backend = core.backend().clone();
    gpualloc_devices::free_detached(backend.as_ref(), core.device(), &victims).unwrap();
    core.finish_segment_frees(&victims);
    assert_eq!(core.releasing_bytes(), 0);
    core.check_invariants().unwrap();
    assert!(
        core.detach_gc_victims().unwrap().is_empty(),
        "under the threshold now"
    );
}

/// A segment claimed by an owner allocating off the core counts against
/// `per_process_memory_fraction` in the core's own chain, and the out-of-memory report names
/// it as in flight; the claim ends when the segment is adopted.
#[test]
fn claimed_segments_count_against_the_cap_and_show_in_the_report() {
    let (backend, mut core, s0, _) = rig(100 * MIB, "per_process_memory_fraction:1.0", false);
    let req = match core.try_cached(60 * MIB, s0).unwrap() {
        gpualloc_devices::CachedOutcome::Miss(r) => r,
        gpualloc_devices::CachedOutcome::Hit(_) => panic!("empty core"),
    };
    let mut m = Miss::off_core(req);
    let MissStep::Io(io @ MissIo::AllocSegment { .. }) = core.advance_miss(&mut m, None) else {
        panic!("expected a segment malloc");
    };
    assert_eq!(core.growing_bytes(), 60 * MIB);
    let err = core.malloc(60 * MIB, s0).unwrap_err();
    let AllocError::OutOfMemory(report) = err else {
        panic!("expected out of memory, got {err}");
    };
    assert_eq!(report.in_flight, 60 * MIB);
    assert!(
        report
            .to_string()
            .contains("60.00 MiB is being allocated by requests in flight"),
        "{report}"
    );
    let second = match core.try_cached(60 * MIB, s0).unwrap() {
        gpualloc_devices::CachedOutcome::Miss(r) => r,
        gpualloc_devices::CachedOutcome::Hit(_) => panic!("nothing cached"),
    };
    assert!(
        matches!(core.advance_miss(&mut Miss::off_core(second), None), MissStep::Failed(ref e) if e.is_oom()),
        "a second 60 MiB off the core does not fit either"
    );
    let done = io.perform(backend.as_ref());
    let MissStep::Done(a) = core.advance_miss(&mut m, Some(done)) else {
        panic!("expected the new segment's block");
    };
    assert_eq!((core.growing_bytes(), core.reserved_bytes()), (0, 60 * MIB));
    core.free(a.ptr).unwrap();
    core.check_invariants().unwrap();
}

/// A request its owner retries (`SegmentRequest::quiet_oom`) fails without counting; the
/// owner's `count_oom` counts the failure once, with the entry a counted failure has. The mark
/// holds through an off-core miss's retries too.
#[test]
fn a_quiet_request_is_counted_once_by_its_owner() {
    let (_, mut core, s0, _) = rig(40 * MIB, "", false);
    let _a = core.malloc(19 * MIB + 512 * 1024, s0).unwrap();
    let _b = core.malloc(14 * MIB + 1, s0).unwrap();
    let miss = |core: &mut DeviceCore| match core.try_cached(10 * MIB, s0).unwrap() {
        CachedOutcome::Miss(r) => r,
        CachedOutcome::Hit(_) => panic!("10 MiB cannot be cached"),
    };
    let mut req = miss(&mut core);
    req.quiet_oom();
    let err = core.malloc_after_miss(req).unwrap_err();
    assert!(err.is_oom(), "{err}");
    // Off the core, the device without room at each try: the chain's retries keep the mark.
    let mut req = miss(&mut core);
    req.quiet_oom();
    let step = common::drive_miss(&mut core, Miss::off_core(req), common::segment_malloc);
    let MissStep::Failed(err2) = step else {
        panic!("10 MiB cannot be served");
    };
    assert!(err2.is_oom(), "{err2}");
    assert_eq!(core.stats().num_ooms, 0);
    assert!(!actions(&core).contains(&TraceAction::Oom));
    core.count_oom(&err2, s0);
    assert_eq!(core.stats().num_ooms, 1);
    let oom = core.snapshot().trace.pop().unwrap();
    assert_eq!(oom.action, TraceAction::Oom);
    assert_eq!((oom.size, oom.addr), (10 * MIB, 4 * MIB));
    // A request not marked counts itself, with the same entry.
    let req = miss(&mut core);
    let err3 = core.malloc_after_miss(req).unwrap_err();
    assert_eq!(err3, err2);
    assert_eq!(core.stats().num_ooms, 2);
    let counted = core.snapshot().trace.pop().unwrap();
    assert_eq!((counted.size, counted.addr), (oom.size, oom.addr));
    // Errors that are not out of memory count nothing.
    core.count_oom(&AllocError::Shutdown, s0);
    assert_eq!(core.stats().num_ooms, 2);
    core.check_invariants().unwrap();
}

/// The OOM message suggests `expandable_segments:True` against fragmentation only where the
/// segments are not expandable already: with them on (the `gpualloc` policy's default where
/// the backend has virtual memory) the advice cannot help. The same fragmented state under
/// both settings: sixty-five 1.5 MiB blocks on a 100 MiB device (five 20 MiB segments of 13
/// blocks without expandable segments), every other one freed, then 30 MiB asked for. (No
/// free 1.5 MiB hole holds a whole 2 MiB page, so expandable segments cannot unmap any.)
#[test]
fn the_fragmentation_hint_names_expandable_segments_only_where_they_are_off() {
    for (conf, hinted) in [
        ("expandable_segments:False", true),
        ("expandable_segments:True", false),
    ] {
        let (_backend, mut core, s, _) = rig(100 * MIB, conf, false);
        let blocks: Vec<_> = (0..65)
            .map(|_| core.malloc(1536 * KIB, s).unwrap())
            .collect();
        for b in blocks.iter().step_by(2) {
            core.free(b.ptr).unwrap();
        }
        let Err(AllocError::OutOfMemory(report)) = core.malloc(30 * MIB, s) else {
            panic!("{conf}: expected an out-of-memory error");
        };
        // Fragmented either way: 32 blocks live, 33 free between them. (In a 20 MiB segment
        // the 13th block takes the last 2 MiB whole, PyTorch's split rule leaving no remainder
        // of 1 MiB or less: two of them are live.)
        let allocated = if hinted { 49 * MIB } else { 48 * MIB };
        assert_eq!(report.allocated, allocated, "{conf}");
        assert!(
            report.reserved_unallocated() >= 40 * MIB,
            "{conf}: {report:?}"
        );
        assert_eq!(report.expandable_segments, !hinted, "{conf}");
        let text = report.to_string();
        assert_eq!(
            text.contains("try expandable_segments:True"),
            hinted,
            "{conf}: {text}"
        );
    }
}

/// Expandable segments serve a request from the whole pages of freed blocks scattered
/// between live ones: the out-of-memory chain's release unmaps them (a growth's handles end
/// where its request ends, so each freed block's whole pages are whole handles) and the
/// segment maps them again where the request needs them. Ten 9 MiB blocks on a 100 MiB
/// device, every other one freed, then 30 MiB: with one handle per growth, as before, this
/// was out of memory (45 MiB free, no handle wholly inside a free block).
#[test]
fn expandable_segments_serve_a_request_from_pages_freed_between_live_blocks() {
    let (backend, mut core, s, _) = rig(100 * MIB, "expandable_segments:True", false);
    let blocks: Vec<_> = (0..10).map(|_| core.malloc(9 * MIB, s).unwrap()).collect();
    for b in blocks.iter().step_by(2) {
        core.free(b.ptr).unwrap();
    }
    let reserved = core.reserved_bytes();
    let unmaps = backend.counts().unmaps;
    assert_eq!((reserved, unmaps), (94 * MIB, 0));
    // 45 MiB live and 49 MiB free: too little room on the device for 30 MiB more. The chain
    // gives back 44 MiB of whole pages (7 handles: the 1 MiB left is parts of pages beside
    // live blocks) and maps the 30 MiB at the end of the segment.
    let big = core.malloc(30 * MIB, s).unwrap();
    assert_eq!(
        (core.reserved_bytes(), backend.counts().unmaps),
        (80 * MIB, 7)
    );
    assert_eq!(big.ptr.0 - blocks[0].ptr.0, 114 * MIB);
    assert_eq!(core.stats().num_ooms, 0);
    core.check_invariants().unwrap();
}

/// `empty_cache` waits for every pending free first (PyTorch's `synchronize_and_free_events`
/// in `release_cached_blocks`), and counts it in `num_sync_all_streams` each time, with frees
/// pending or not.
#[test]
fn empty_cache_counts_one_synchronization_each_time() {
    let (_, mut core, s0, s1) = rig(1 << 30, "", false);
    let a = core.malloc(MIB, s0).unwrap();
    core.record_stream(a.ptr, s1).unwrap();
    core.free(a.ptr).unwrap();
    assert_eq!(core.pending_frees(), 1);
    core.empty_cache().unwrap();
    assert_eq!(core.pending_frees(), 0);
    assert_eq!(core.stats().num_sync_all_streams, 1);
    core.empty_cache().unwrap();
    assert_eq!(core.stats().num_sync_all_streams, 2);
    assert_eq!(core.reserved_bytes(), 0);
}
