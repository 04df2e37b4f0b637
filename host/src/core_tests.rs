//! Unit tests of [`HostCore`](super::HostCore): one rule each, with concrete sizes, on the
//! accounting backend (addresses only) or, for the register path, real mappings.

use std::sync::Arc;
use std::time::Duration;

use gpualloc_accounting::AccountingBackend;
use gpualloc_runtime::{Backend, DeviceId};

use super::*;
use crate::clock::ManualClock;

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

fn setup(config: HostConfig) -> (Arc<AccountingBackend>, HostCore) {
    let backend = Arc::new(AccountingBackend::manual_events(1, GIB));
    let clock = Arc::new(ManualClock::with_step(Duration::from_micros(1)));
    let core = HostCore::new(backend.clone(), config, clock).unwrap();
    (backend, core)
}

fn check_invariant(core: &HostCore) {
    let s = core.stats();
    assert_eq!(
        s.reserved_bytes.current,
        s.allocated_bytes.current + s.cached_bytes + s.reserve_unused_bytes,
        "{s:?}"
    );
}

#[test]
fn power_of_two_classes_and_exact_class_reuse() {
    let (backend, mut core) = setup(HostConfig::default());
    let a = core.malloc(KIB).unwrap();
    let b = core.malloc(KIB + 1).unwrap();
    assert_eq!((a.size, a.requested), (KIB, KIB));
    assert_eq!(b.size, 2 * KIB);
    core.free(a.ptr).unwrap();
    core.free(b.ptr).unwrap();
    assert_eq!(
        core.malloc(600).unwrap().ptr,
        a.ptr,
        "600 B is in the 1 KiB class"
    );
    let c = core.malloc(512).unwrap();
    assert_ne!(c.ptr, b.ptr, "a 2 KiB block never serves the 512 B class");
    assert_eq!(core.malloc(2000).unwrap().ptr, b.ptr);
    assert_eq!(backend.counts().host_allocs, 3);
    let s = core.stats();
    assert_eq!((s.allocation.current, s.segment.current), (3, 3));
    assert_eq!(s.allocated_bytes.current, KIB + 2 * KIB + 512);
    check_invariant(&core);
}

#[test]
fn a_1_1_gib_request_holds_at_most_1_1x_with_the_threshold_and_2x_without() {
    let request = GIB + GIB / 10;
    let backend = Arc::new(AccountingBackend::new(1, GIB).with_host_capacity(4 * GIB));
    let clock: Arc<dyn Clock> = Arc::new(ManualClock::default());
    let mut fine = HostCore::new(backend.clone(), HostConfig::default(), clock.clone()).unwrap();
    let blk = fine.malloc(request).unwrap();
    let held = fine.stats().reserved_bytes.current;
    assert_eq!(held, blk.size);
    assert!(held as f64 <= 1.1 * request as f64, "{held} for {request}");
    assert!(held - request < 2 * MIB);
    // A slightly smaller request reuses the cached block (it is within 1/16 over the request's
    // rounded size); half the request does not.
    fine.free(blk.ptr).unwrap();
    assert_ne!(fine.malloc(request / 2).unwrap().ptr, blk.ptr);
    assert_eq!(fine.malloc(request - 10 * MIB).unwrap().ptr, blk.ptr);
    drop(fine);

    let pow2 = HostConfig {
        pinned_max_round_threshold_mb: None,
        ..HostConfig::default()
    };
    let mut pytorch = HostCore::new(backend, pow2, clock).unwrap();
    pytorch.malloc(request).unwrap();
    assert_eq!(pytorch.stats().reserved_bytes.current, 2 * GIB);
}

#[test]
fn the_cache_cap_releases_the_oldest_cached_blocks() {
    let config = HostConfig {
        pinned_max_cached_size_mb: Some(1),
        ..HostConfig::default()
    };
    let (backend, mut core) = setup(config);
    let blocks: Vec<_> = (0..3).map(|_| core.malloc(512 * KIB).unwrap()).collect();
    core.free(blocks[0].ptr).unwrap();
    core.free(blocks[1].ptr).unwrap();
    assert_eq!(core.stats().cached_bytes, MIB, "exactly at the cap");
    assert_eq!(backend.counts().host_frees, 0);
    core.free(blocks[2].ptr).unwrap();
    let s = core.stats();
    assert_eq!(
        (s.cached_bytes, s.num_host_free, s.segment.current),
        (MIB, 1, 2)
    );
    assert_eq!(backend.counts().host_frees, 1);
    // The oldest (blocks[0]) went back; the newest is handed out first.
    assert_eq!(core.malloc(512 * KIB).unwrap().ptr, blocks[2].ptr);
    assert_eq!(core.malloc(512 * KIB).unwrap().ptr, blocks[1].ptr);
    check_invariant(&core);

    let (backend, mut core) = setup(HostConfig {
        pinned_max_cached_size_mb: Some(0),
        ..HostConfig::default()
    });
    let a = core.malloc(4 * KIB).unwrap();
    core.free(a.ptr).unwrap();
    assert_eq!(
        (core.stats().cached_bytes, backend.counts().host_frees),
        (0, 1),
        "cap 0 caches nothing"
    );
}

#[test]
fn the_reserve_segment_is_carved_at_4k_and_never_released_piecewise() {
    let config = HostConfig {
        pinned_reserve_segment_size_mb: 1,
        ..HostConfig::default()
    };
    let (backend, mut core) = setup(config);
    let a = core.malloc(1).unwrap();
    let base = a.ptr.0;
    let b = core.malloc(KIB).unwrap();
    let c = core.malloc(5000).unwrap();
    assert_eq!((b.ptr.0 - base, c.ptr.0 - base), (4096, 8192));
    assert_eq!(c.size, 8 * KIB);
    assert_eq!(
        backend.counts().host_allocs,
        1,
        "one allocation: the reserve itself"
    );
    let s = core.stats();
    assert_eq!((s.segment.current, s.reserved_bytes.current), (1, MIB));
    assert_eq!(s.reserve_unused_bytes, MIB - 1 - KIB - 8 * KIB);
    check_invariant(&core);
    // 16 KiB pieces no longer fit: carving stops, fresh segments follow.
    let d = core.malloc(MIB - 16 * KIB + 1).unwrap();
    assert!(!(base..base + MIB).contains(&d.ptr.0));
    assert_eq!(backend.counts().host_allocs, 2);
    for p in [a.ptr, b.ptr, c.ptr, d.ptr] {
        core.free(p).unwrap();
    }
    core.empty_cache().unwrap();
    let s = core.stats();
    assert_eq!(
        (s.segment.current, s.reserved_bytes.current, s.cached_bytes),
        (1, MIB, 0)
    );
    assert_eq!(s.reserve_unused_bytes, MIB, "rewound: nothing carved");
    assert_eq!(
        backend.counts().host_frees,
        1,
        "only the fresh block went back"
    );
    assert_eq!(
        core.malloc(100).unwrap().ptr.0,
        base,
        "carved afresh from the start"
    );
}

#[test]
fn a_reserve_block_in_use_keeps_the_carving() {
    let config = HostConfig {
        pinned_reserve_segment_size_mb: 1,
        ..HostConfig::default()
    };
    let (_backend, mut core) = setup(config);
    let a = core.malloc(4096).unwrap();
    let b = core.malloc(4096).unwrap();
    core.free(b.ptr).unwrap();
    core.empty_cache().unwrap();
    assert_eq!(
        core.stats().cached_bytes,
        4096,
        "carved blocks stay while one is in use"
    );
    assert_eq!(core.malloc(4096).unwrap().ptr, b.ptr);
    assert_eq!(core.malloc(4096).unwrap().ptr.0, a.ptr.0 + 8192);
}

#[test]
fn events_are_recorded_lazily_at_free_and_guard_reuse() {
    let (backend, mut core) = setup(HostConfig::default());
    let s1 = backend.stream_create(DeviceId(0)).unwrap();
    let s2 = backend.stream_create(DeviceId(0)).unwrap();
    let a = core.malloc(64 * KIB).unwrap();
    core.record_stream(a.ptr, s1).unwrap();
    core.record_stream(a.ptr, s1).unwrap();
    core.record_stream(a.ptr, s2).unwrap();
    assert_eq!(backend.pending_events(), 0, "nothing recorded before free");
    core.free(a.ptr).unwrap();
    assert_eq!(
        (core.pending_events(), backend.pending_events()),
        (2, 2),
        "one per stream"
    );
    let b = core.malloc(64 * KIB).unwrap();
    assert_ne!(
        b.ptr, a.ptr,
        "a block with pending events is not handed out"
    );
    core.free(b.ptr).unwrap();
    let s = core.stats();
    assert_eq!(
        (s.allocation.current, s.cached_bytes),
        (1, 64 * KIB),
        "pending counts as allocated"
    );
    check_invariant(&core);

    let list = core.pending_event_list();
    assert!(list.iter().all(|(_, p)| *p == a.ptr));
    backend.complete_event(list[0].0);
    assert_eq!(core.process_events().unwrap(), 0, "one of two events done");
    backend.complete_event(list[1].0);
    assert_eq!(core.process_events().unwrap(), 1);
    assert_eq!(core.pending_events(), 0);
    // Newest cached first: a, then b.
    assert_eq!(core.malloc(64 * KIB).unwrap().ptr, a.ptr);
    assert_eq!(core.malloc(64 * KIB).unwrap().ptr, b.ptr);
    // Completed events are pooled: the next free reuses one rather than creating one.
    let c = core.malloc(64 * KIB).unwrap();
    core.record_stream(c.ptr, s1).unwrap();
    core.free(c.ptr).unwrap();
    assert!(list
        .iter()
        .any(|(e, _)| core.pending_event_list()[0].0 == *e));
}

#[test]
fn malloc_processes_events_unless_background_threads_do() {
    let (backend, mut core) = setup(HostConfig::default());
    let s = backend.stream_create(DeviceId(0)).unwrap();
    let a = core.malloc(8 * KIB).unwrap();
    core.record_stream(a.ptr, s).unwrap();
    core.free(a.ptr).unwrap();
    backend.complete_all_events();
    assert_eq!(
        core.malloc(8 * KIB).unwrap().ptr,
        a.ptr,
        "foreground: processed in malloc"
    );

    let config = HostConfig {
        pinned_use_background_threads: true,
        ..HostConfig::default()
    };
    let (backend, mut core) = setup(config);
    let s = backend.stream_create(DeviceId(0)).unwrap();
    let a = core.malloc(8 * KIB).unwrap();
    let b = core.malloc(8 * KIB).unwrap();
    core.record_stream(a.ptr, s).unwrap();
    core.free(a.ptr).unwrap();
    core.free(b.ptr).unwrap();
    backend.complete_all_events();
    assert_eq!(
        core.malloc(8 * KIB).unwrap().ptr,
        b.ptr,
        "hit: events left to the reaper"
    );
    assert_eq!(core.pending_events(), 1);
    assert_eq!(
        core.malloc(8 * KIB).unwrap().ptr,
        a.ptr,
        "miss: events processed first"
    );
    assert_eq!(backend.counts().host_allocs, 2);
}

#[test]
fn a_failed_record_leaves_the_block_allocated() {
    let (backend, mut core) = setup(HostConfig::default());
    let s = backend.stream_create(DeviceId(0)).unwrap();
    let a = core.malloc(KIB).unwrap();
    core.record_stream(a.ptr, s).unwrap();
    backend.stream_destroy(s).unwrap();
    assert!(matches!(core.free(a.ptr), Err(HostError::Backend(_))));
    assert_eq!(core.live_blocks(), 1);
    assert_eq!(core.stats().allocation.current, 1);
}

#[test]
fn bad_input_gets_typed_errors() {
    let (backend, mut core) = setup(HostConfig::default());
    assert_eq!(core.malloc(0), Err(HostError::ZeroSize));
    let huge = u64::MAX - 100;
    assert_eq!(
        core.malloc(huge),
        Err(HostError::TooLarge { requested: huge })
    );
    let (_, mut pow2) = setup(HostConfig {
        pinned_max_round_threshold_mb: None,
        ..HostConfig::default()
    });
    assert_eq!(
        pow2.malloc(huge),
        Err(HostError::TooLarge { requested: huge })
    );
    assert_eq!(
        core.free(HostPtr(0x1234)),
        Err(HostError::UnknownPointer(HostPtr(0x1234)))
    );
    let a = core.malloc(100).unwrap();
    assert_eq!(
        core.free(HostPtr(a.ptr.0 + 1)),
        Err(HostError::UnknownPointer(HostPtr(a.ptr.0 + 1)))
    );
    core.free(a.ptr).unwrap();
    assert_eq!(core.free(a.ptr), Err(HostError::DoubleFree(a.ptr)));
    let s = backend.stream_create(DeviceId(0)).unwrap();
    assert_eq!(
        core.record_stream(a.ptr, s),
        Err(HostError::NotAllocated(a.ptr))
    );
    let b = core.malloc(100).unwrap();
    core.record_stream(b.ptr, s).unwrap();
    core.free(b.ptr).unwrap();
    assert_eq!(
        core.free(b.ptr),
        Err(HostError::DoubleFree(b.ptr)),
        "pending is freed too"
    );
    let bad = HostConfig {
        pinned_num_register_threads: 3,
        ..HostConfig::default()
    };
    let clock: Arc<dyn Clock> = Arc::new(ManualClock::default());
    assert!(matches!(
        HostCore::new(backend, bad, clock),
        Err(HostError::Config(_))
    ));
    check_invariant(&core);
}

#[test]
fn out_of_memory_releases_the_cache_and_retries_once() {
    let backend = Arc::new(AccountingBackend::new(1, GIB).with_host_capacity(4 * MIB));
    let clock: Arc<dyn Clock> = Arc::new(ManualClock::default());
    let mut core = HostCore::new(backend.clone(), HostConfig::default(), clock).unwrap();
    let a = core.malloc(2 * MIB).unwrap();
    let b = core.malloc(MIB).unwrap();
    core.free(a.ptr).unwrap();
    core.free(b.ptr).unwrap();
    let c = core.malloc(4 * MIB).unwrap();
    assert_eq!(c.size, 4 * MIB);
    assert_eq!(
        backend.counts().host_frees,
        2,
        "the cache went back to make room"
    );
    let e = core.malloc(KIB).unwrap_err();
    assert!(e.is_oom(), "{e}");
    check_invariant(&core);
}

#[test]
fn timings_and_counts_come_from_the_given_clock() {
    let (_backend, mut core) = setup(HostConfig {
        pinned_max_cached_size_mb: Some(0),
        ..HostConfig::default()
    });
    for _ in 0..3 {
        let a = core.malloc(KIB).unwrap();
        core.free(a.ptr).unwrap();
    }
    let s = core.stats();
    assert_eq!((s.num_host_alloc, s.num_host_free), (3, 3));
    assert_eq!(s.host_alloc_time.count, 3);
    assert_eq!(
        s.host_alloc_time.total,
        Duration::from_micros(3),
        "one 1 µs step per call"
    );
    assert_eq!(s.host_free_time.max, Duration::from_micros(1));
    assert_eq!(s.allocation.peak, 1);
    let m = s.as_map();
    assert_eq!(
        (
            m["num_host_alloc"],
            m["host_alloc_time.total"],
            m["allocation.allocated"]
        ),
        (3, 3, 3)
    );
    core.reset_accumulated_stats();
    assert_eq!(core.stats().num_host_alloc, 0);
}

#[test]
fn the_register_path_maps_prefaults_and_registers_real_memory() {
    let config = HostConfig {
        pinned_use_cuda_host_register: true,
        pinned_num_register_threads: 4,
        ..HostConfig::default()
    };
    let (backend, mut core) = setup(config);
    let page = page_size() as u64;
    let a = core.malloc(3 * MIB).unwrap();
    assert_eq!((a.size, a.ptr.0 % page), (4 * MIB, 0));
    let small = core.malloc(10).unwrap();
    assert_eq!(
        small.size, page,
        "sub-page requests take a page on the register path"
    );
    assert_eq!(backend.counts().host_registers, 2);
    assert_eq!(backend.host_used(), 4 * MIB + page);
    core.free(a.ptr).unwrap();
    core.free(small.ptr).unwrap();
    assert_eq!(
        core.malloc(100).unwrap().ptr,
        small.ptr,
        "100 B shares the page class"
    );
    core.empty_cache().unwrap();
    assert_eq!(backend.counts().host_unregisters, 1);
    assert_eq!(backend.host_used(), page);
    check_invariant(&core);
}

#[test]
fn dropping_the_core_returns_everything_not_in_use() {
    let config = HostConfig {
        pinned_reserve_segment_size_mb: 1,
        ..HostConfig::default()
    };
    let (backend, mut core) = setup(config);
    let s = backend.stream_create(DeviceId(0)).unwrap();
    let big = core.malloc(2 * MIB).unwrap();
    let pending = core.malloc(4 * MIB).unwrap();
    core.record_stream(pending.ptr, s).unwrap();
    core.free(pending.ptr).unwrap();
    core.free(big.ptr).unwrap();
    core.malloc(KIB).unwrap();
    drop(core);
    let n = backend.counts();
    assert_eq!(
        (n.host_allocs, n.host_frees),
        (3, 1),
        "reserve in use and the pending block stay"
    );
}

#[test]
fn a_failed_reserve_falls_back_to_fresh_blocks_and_is_not_retried() {
    let backend = Arc::new(AccountingBackend::new(1, GIB).with_host_capacity(MIB));
    let config = HostConfig {
        pinned_reserve_segment_size_mb: 2,
        ..HostConfig::default()
    };
    let mut core =
        HostCore::new(backend.clone(), config, Arc::new(ManualClock::default())).unwrap();
    let a = core.malloc(KIB).unwrap();
    let b = core.malloc(KIB).unwrap();
    assert_ne!(a.ptr, b.ptr);
    let s = core.stats();
    assert_eq!((s.segment.current, s.reserve_unused_bytes), (2, 0));
    assert_eq!(
        backend.counts().host_allocs,
        2,
        "two fresh blocks; the 2 MiB reserve never fit"
    );
}

#[test]
fn the_core_can_move_to_an_actor_thread() {
    fn assert_send<T: Send>() {}
    assert_send::<HostCore>();
}
