//! The core under stream captures (`pools/capture.rs`), on the simulated GPU: graph pools
//! route a capture's allocations, and no event is recorded on a capturing stream or queried
//! while an announced capture is under way, as PyTorch's rules say.

use std::sync::Arc;

use gpualloc_devices::{AllocError, AllocatorConfig, DeviceCore};
use gpualloc_runtime::capture::CaptureMode;
use gpualloc_runtime::{Backend, CaptureSafe, DeviceId, StreamHandle};
use gpualloc_sim::{Op, SimBackend, SimConfig};

mod common;
use common::hold;

const MIB: u64 = 1 << 20;
const D0: DeviceId = DeviceId(0);

struct Rig {
    sim: Arc<SimBackend>,
    core: DeviceCore,
    s0: StreamHandle,
    s1: StreamHandle,
}

const CONFIGS: [&str; 3] = [
    "expandable_segments:False",
    "expandable_segments:True",
    "garbage_collection_threshold:0.6,per_process_memory_fraction:0.9",
];

fn rig(conf: &str) -> Rig {
    let sim = SimBackend::new(SimConfig::fast(1)).unwrap();
    let dynb: Arc<dyn Backend> = sim.clone();
    let s0 = dynb.stream_create(D0).unwrap();
    let s1 = dynb.stream_create(D0).unwrap();
    // The allocator's calls go through `CaptureSafe`, as the facade makes them.
    let safe: Arc<dyn Backend> = Arc::new(CaptureSafe::new(dynb));
    let core = DeviceCore::new(safe, D0, AllocatorConfig::parse(conf).unwrap()).unwrap();
    Rig { sim, core, s0, s1 }
}

fn capture_id(sim: &SimBackend, s: StreamHandle) -> u64 {
    sim.stream_capture_status(s).unwrap().id().unwrap()
}

#[test]
fn a_captures_allocations_come_from_its_pool_and_others_do_not() {
    for conf in CONFIGS {
        let mut r = rig(conf);
        let pool = r.core.create_pool(false);
        r.sim
            .stream_begin_capture(r.s0, CaptureMode::Global)
            .unwrap();
        let id = capture_id(&r.sim, r.s0);
        r.core.begin_capture(id, pool, r.s0).unwrap();
        assert_eq!(r.core.capture_of(r.s0), Some(id));
        assert!(r.core.pool_in_capture(pool) && r.core.captures_underway());
        let idle = r.core.create_pool(false);
        assert!(!r.core.pool_in_capture(idle));
        let a = r.core.malloc(3 * MIB, r.s0).unwrap();
        let small = r.core.malloc(1000, r.s0).unwrap();
        let outside = r.core.malloc(3 * MIB, r.s1).unwrap();
        assert_eq!(
            (a.pool, small.pool, outside.pool),
            (Some(pool), Some(pool), None),
            "{conf}"
        );
        // A stream that joined the capture (through an event recorded in it) allocates from
        // the pool too: the core asks the backend which capture the stream is part of.
        let fork = r.sim.event_create(D0).unwrap();
        r.sim.event_record(fork, r.s0).unwrap();
        r.sim.stream_wait_event(r.s1, fork).unwrap();
        let joined = r.core.malloc(MIB, r.s1).unwrap();
        assert_eq!(joined.pool, Some(pool), "{conf}");
        assert_eq!(r.core.capture_of(r.s1), Some(id));
        // ... and the capture's end needs it joined back.
        let join = r.sim.event_create(D0).unwrap();
        r.sim.event_record(join, r.s1).unwrap();
        r.sim.stream_wait_event(r.s0, join).unwrap();
        // A block freed during the capture serves a later request of it on its stream.
        r.core.free(a.ptr).unwrap();
        let again = r.core.malloc(3 * MIB, r.s0).unwrap();
        assert_eq!((again.ptr, again.pool), (a.ptr, Some(pool)), "{conf}");
        r.core.end_capture(id).unwrap();
        assert!(!r.core.captures_underway() && !r.core.pool_in_capture(pool));
        assert_eq!(r.core.capture_of(r.s0), None);
        let after = r.core.malloc(3 * MIB, r.s0).unwrap();
        assert_eq!(after.pool, None);
        // The capture itself was never invalidated by the allocator's driver calls.
        let g = r.sim.stream_end_capture(r.s0).unwrap();
        r.sim.graph_destroy(g).unwrap();
        for p in [again.ptr, small.ptr, outside.ptr, joined.ptr, after.ptr] {
            r.core.free(p).unwrap();
        }
    }
}

#[test]
fn a_cross_stream_free_during_a_capture_waits_for_its_end_and_records_events_only_outside_it() {
    for conf in CONFIGS {
        let mut r = rig(conf);
        let (s2, s3) = (
            r.sim.stream_create(D0).unwrap(),
            r.sim.stream_create(D0).unwrap(),
        );
        let pool = r.core.create_pool(false);
        // A default-pool block used on s1 before the capture, freed during it.
        let old = r.core.malloc(3 * MIB, r.s0).unwrap();
        r.core.record_stream(old.ptr, r.s1).unwrap();
        r.sim
            .stream_begin_capture(r.s0, CaptureMode::Global)
            .unwrap();
        let id = capture_id(&r.sim, r.s0);
        r.core.begin_capture(id, pool, r.s0).unwrap();
        // s2 joins the capture.
        let fork = r.sim.event_create(D0).unwrap();
        r.sim.event_record(fork, r.s0).unwrap();
        r.sim.stream_wait_event(s2, fork).unwrap();
        // A graph-pool block used on s2 during the capture, freed during it: that use is the
        // graph's (other sizes: the test tells which blocks wait).
        let inner = r.core.malloc(5 * MIB, r.s0).unwrap();
        r.core.record_stream(inner.ptr, s2).unwrap();
        // A default-pool block used during the capture on s1, which is no part of it: eager
        // work of another task, which the free must wait for as always.
        let eager = r.core.malloc(7 * MIB, s3).unwrap();
        assert_eq!(eager.pool, None, "{conf}");
        r.core.record_stream(eager.ptr, r.s1).unwrap();
        r.sim.reset_counts();
        r.core.free(old.ptr).unwrap();
        r.core.free(inner.ptr).unwrap();
        r.core.free(eager.ptr).unwrap();
        assert_eq!(r.core.process_events().unwrap(), 0);
        let counts = r.sim.counts();
        assert_eq!(
            (counts.get(Op::EventRecord), counts.get(Op::EventQuery)),
            (0, 0),
            "no event recorded or queried during the capture ({conf})"
        );
        assert_eq!(
            r.core.empty_cache(),
            Err(AllocError::CaptureUnderway("empty_cache"))
        );
        // At its end: the old and the eager blocks wait for s1's work (an event each), the
        // graph's block does not (its use on s2 was the graph's).
        let join = r.sim.event_create(D0).unwrap();
        r.sim.event_record(join, s2).unwrap();
        r.sim.stream_wait_event(r.s0, join).unwrap();
        let g = r.sim.stream_end_capture(r.s0).unwrap();
        r.sim.graph_destroy(g).unwrap();
        let open = hold(&r.sim, r.s1);
        r.sim.reset_counts();
        r.core.end_capture(id).unwrap();
        assert_eq!(r.sim.counts().get(Op::EventRecord), 2, "{conf}");
        r.core.process_events().unwrap();
        let stats = r.core.stats();
        assert_eq!(
            stats.active_bytes[0].current,
            old.block_size + eager.block_size,
            "{conf}"
        );
        drop(open);
        r.sim.stream_synchronize(r.s1).unwrap();
        r.core.process_events().unwrap();
        assert_eq!(r.core.stats().active_bytes[0].current, 0, "{conf}");
        for e in [fork, join] {
            r.sim.event_destroy(e).unwrap();
        }
    }
}

#[test]
fn the_miss_chain_does_not_synchronize_during_a_capture() {
    // 64 MiB: a cached 40 MiB segment cannot serve a 40 MiB request of the graph pool, and
    // releasing it needs the chain's synchronizing link.
    let sim = SimBackend::new(SimConfig {
        capacity_per_device: 64 * MIB,
        ..SimConfig::fast(1)
    })
    .unwrap();
    let dynb: Arc<dyn Backend> = sim.clone();
    let s0 = dynb.stream_create(D0).unwrap();
    let mut core = DeviceCore::new(
        Arc::new(CaptureSafe::new(dynb)),
        D0,
        AllocatorConfig::parse("expandable_segments:False").unwrap(),
    )
    .unwrap();
    let cached = core.malloc(40 * MIB, s0).unwrap();
    core.free(cached.ptr).unwrap();
    let pool = core.create_pool(false);
    sim.stream_begin_capture(s0, CaptureMode::Global).unwrap();
    let id = capture_id(&sim, s0);
    core.begin_capture(id, pool, s0).unwrap();
    let before = core.stats().num_sync_all_streams;
    let r = core.malloc(40 * MIB, s0);
    assert!(matches!(r, Err(AllocError::OutOfMemory(_))), "{r:?}");
    assert_eq!(core.stats().num_sync_all_streams, before);
    core.end_capture(id).unwrap();
    // The capture survived the allocator's miss.
    let g = sim.stream_end_capture(s0).unwrap();
    sim.graph_destroy(g).unwrap();
    // After it, the same request releases the cache and succeeds.
    let a = core.malloc(40 * MIB, s0).unwrap();
    assert_eq!(a.pool, None);
}

#[test]
fn a_use_on_a_stream_that_captures_unannounced_holds_the_free_back() {
    let mut r = rig("expandable_segments:False");
    let a = r.core.malloc(3 * MIB, r.s0).unwrap();
    r.core.record_stream(a.ptr, r.s1).unwrap();
    let s2 = r.sim.stream_create(D0).unwrap();
    let b = r.core.malloc(5 * MIB, r.s0).unwrap();
    r.core.record_stream(b.ptr, s2).unwrap();
    // The user captures s1 without telling the allocator.
    r.sim
        .stream_begin_capture(r.s1, CaptureMode::Global)
        .unwrap();
    r.sim.reset_counts();
    r.core.free(a.ptr).unwrap();
    r.core.process_events().unwrap();
    assert_eq!(
        r.sim.counts().get(Op::EventRecord),
        0,
        "no event on a capturing stream"
    );
    assert_eq!(
        r.core.stats().active_bytes[0].current,
        a.block_size + b.block_size
    );
    // A use on a stream that does not capture gets its event at once, capture or not.
    r.core.free(b.ptr).unwrap();
    assert_eq!(r.sim.counts().get(Op::EventRecord), 1);
    // (Synchronizing from this thread, which captures, needs relaxed mode.)
    let mode = r.sim.exchange_capture_mode(CaptureMode::Relaxed).unwrap();
    r.sim.stream_synchronize(s2).unwrap();
    r.sim.exchange_capture_mode(mode).unwrap();
    r.core.process_events().unwrap();
    assert_eq!(r.core.stats().active_bytes[0].current, a.block_size);
    let g = r
        .sim
        .stream_end_capture(r.s1)
        .expect("the allocator left the capture valid");
    r.sim.graph_destroy(g).unwrap();
    r.core.process_events().unwrap();
    r.sim.stream_synchronize(r.s1).unwrap();
    r.core.process_events().unwrap();
    assert_eq!(r.core.stats().active_bytes[0].current, 0);
}

/// The same for a stream whose capture the owner prepared (`prepare_capture`, before the
/// backend's begin, which may run between the core's check and its record): the free is
/// held back until the preparation ends, then made with its event.
#[test]
fn a_use_on_a_stream_about_to_capture_holds_the_free_back() {
    for conf in CONFIGS {
        let mut r = rig(conf);
        let a = r.core.malloc(3 * MIB, r.s0).unwrap();
        r.core.record_stream(a.ptr, r.s1).unwrap();
        assert!(r.core.prepare_capture(r.s1));
        r.sim.reset_counts();
        r.core.free(a.ptr).unwrap();
        r.core.process_events().unwrap();
        assert_eq!(r.sim.counts().get(Op::EventRecord), 0, "{conf}");
        assert_eq!(r.core.stats().active_bytes[0].current, a.block_size);
        r.core.unprepare_capture(r.s1);
        r.core.process_events().unwrap();
        assert_eq!(r.sim.counts().get(Op::EventRecord), 1, "{conf}");
        r.sim.stream_synchronize(r.s1).unwrap();
        r.core.process_events().unwrap();
        assert_eq!(r.core.stats().active_bytes[0].current, 0, "{conf}");
    }
}

#[test]
fn capture_announcements_are_checked() {
    let mut r = rig("expandable_segments:False");
    let pool = r.core.create_pool(false);
    let other = StreamHandle {
        device: DeviceId(1),
        raw: r.s0.raw,
    };
    assert!(matches!(
        r.core.begin_capture(1, pool, other),
        Err(AllocError::WrongDevice { .. })
    ));
    assert_eq!(
        r.core
            .begin_capture(1, gpualloc_devices::MemPoolId(999), r.s0),
        Err(AllocError::UnknownPool(999))
    );
    r.core.begin_capture(1, pool, r.s0).unwrap();
    assert_eq!(
        r.core.begin_capture(1, pool, r.s1),
        Err(AllocError::UnknownCapture(1))
    );
    assert!(!r.core.join_capture(2, r.s1));
    assert!(!r.core.join_capture(1, other));
    assert_eq!(r.core.end_capture(2), Err(AllocError::UnknownCapture(2)));
    r.core.end_capture(1).unwrap();
    assert_eq!(r.core.end_capture(1), Err(AllocError::UnknownCapture(1)));
}

#[test]
fn a_pool_a_graph_holds_cannot_sleep_until_the_graph_is_dropped() {
    use gpualloc_devices::{MemPoolId, PoolOptions, SleepMode};
    let mut r = rig("expandable_segments:True");
    let pool = r.core.create_named_pool("decode", PoolOptions::default());
    let a = r.core.malloc_in(pool, 3 * MIB, r.s0).unwrap();
    r.core.graph_captured(pool).unwrap();
    r.core.graph_captured(pool).unwrap();
    let held = |graphs| {
        Err(AllocError::PoolInGraph {
            pool: "decode".into(),
            graphs,
            capturing: false,
        })
    };
    assert_eq!(
        r.core.begin_sleep(pool, SleepMode::Discard).map(|_| ()),
        held(2)
    );
    r.core.graph_dropped(pool);
    assert_eq!(
        r.core.begin_sleep(pool, SleepMode::Discard).map(|_| ()),
        held(1)
    );
    r.core.graph_dropped(pool);
    r.core.graph_dropped(pool); // one too many: no underflow
    r.core.free(a.ptr).unwrap();
    assert!(r.core.begin_sleep(pool, SleepMode::Discard).is_ok());
    assert_eq!(
        r.core.graph_captured(MemPoolId(999)),
        Err(AllocError::UnknownPool(999))
    );
}

#[test]
fn a_graphs_memory_stays_its_own_while_it_lives_and_until_its_launches_are_done() {
    use gpualloc_devices::{PoolOptions, SleepMode};
    for conf in ["expandable_segments:True", "expandable_segments:False"] {
        let mut r = rig(conf);
        let options = PoolOptions {
            quota: Some(24 * MIB),
            ..Default::default()
        };
        let pool = r.core.create_named_pool("decode", options);
        let a = r.core.malloc_in(pool, 4 * MIB, r.s0).unwrap();
        r.core.free(a.ptr).unwrap();
        r.core.graph_captured(pool).unwrap();
        let reserved = |r: &Rig| r.core.pool_usage(pool).unwrap().reserved[0].current;
        let held = reserved(&r);
        assert!(held >= 4 * MIB, "{conf}: {held}");
        // While the graph lives, the capture stream goes: its segment of the pool is neither
        // orphaned nor emptied.
        r.core.retire_stream(r.s0).unwrap();
        assert_eq!(reserved(&r), held, "{conf}");
        // The graph is dropped with launches running: nor by the next orphan pass.
        r.core.graph_dropped_with_launches(pool);
        r.core.orphan_retired().unwrap();
        assert_eq!(reserved(&r), held, "{conf}");
        // A request past the quota does not release the graph's memory.
        assert!(
            matches!(
                r.core.malloc_in(pool, 22 * MIB, r.s1),
                Err(AllocError::PoolQuota { .. })
            ),
            "{conf}"
        );
        assert_eq!(reserved(&r), held, "{conf}");
        // Nor does another stream's request of the pool adopt it.
        match r.core.malloc_in(pool, 4 * MIB, r.s1) {
            Ok(b) => {
                assert_ne!(b.ptr, a.ptr, "{conf}");
                r.core.free(b.ptr).unwrap();
            }
            Err(e) => assert!(matches!(e, AllocError::PoolQuota { .. }), "{conf}: {e}"),
        }
        if conf == "expandable_segments:True" {
            assert_eq!(
                r.core.begin_sleep(pool, SleepMode::Discard).map(|_| ()),
                Err(AllocError::PoolBusy {
                    pool: "decode".into()
                }),
                "{conf}"
            );
        }
        r.core.graph_launches_done(pool);
        // One call too many does not underflow.
        r.core.graph_launches_done(pool);
        r.core.graph_launches_done(pool);
        // Done: the next orphan pass and the quota's release go ahead.
        r.core.orphan_retired().unwrap();
        let b = r.core.malloc_in(pool, 22 * MIB, r.s1).unwrap();
        assert!(reserved(&r) <= 24 * MIB, "{conf}");
        r.core.free(b.ptr).unwrap();
        if conf == "expandable_segments:True" {
            assert!(
                r.core.begin_sleep(pool, SleepMode::Discard).is_ok(),
                "{conf}"
            );
        }
    }
}

#[test]
fn a_released_graph_pool_gives_its_free_segments_back_at_once() {
    for conf in ["expandable_segments:False", "expandable_segments:True"] {
        let mut r = rig(conf);
        let pool = r.core.create_pool(false);
        let a = r.core.malloc_in(pool, 3 * MIB, r.s0).unwrap();
        let b = r.core.malloc_in(pool, 30 * MIB, r.s0).unwrap();
        r.core.free(a.ptr).unwrap();
        // Not released yet: it keeps its segments.
        assert!(
            r.core.detach_pool_segments(pool).unwrap().is_empty(),
            "{conf}"
        );
        r.core.release_pool(pool).unwrap();
        let segments = r.core.detach_pool_segments(pool).unwrap();
        // The free segment of `a` goes; `b`'s, live, stays.
        assert_eq!(segments.len(), 1, "{conf}");
        assert_eq!(
            segments[0].size,
            20 * MIB,
            "{conf}: PyTorch's 20 MiB segment of `a`"
        );
        gpualloc_devices::free_detached(r.core.backend().as_ref(), D0, &segments).unwrap();
        r.core.finish_segment_frees(&segments);
        assert_eq!(
            r.core.stats().reserved_bytes[0].current,
            b.block_size,
            "{conf}"
        );
        assert_eq!(
            r.core
                .detach_pool_segments(gpualloc_devices::MemPoolId(999)),
            Err(AllocError::UnknownPool(999))
        );
        r.core.free(b.ptr).unwrap();
    }
}

/// A released pool whose last segment is being freed off the core is forgotten when the free
/// returns, not before: until then the memory is the device's, and counts against its quota.
#[test]
fn a_released_pool_is_forgotten_once_its_last_segments_free_returns() {
    let mut r = rig("expandable_segments:False");
    let pool = r.core.create_pool(false);
    let a = r.core.malloc_in(pool, 30 * MIB, r.s0).unwrap();
    r.core.free(a.ptr).unwrap();
    r.core.release_pool(pool).unwrap();
    let segments = r.core.detach_pool_segments(pool).unwrap();
    assert_eq!(segments.len(), 1);
    assert!(r.core.pool_usage(pool).is_some(), "its free is in flight");
    gpualloc_devices::free_detached(r.core.backend().as_ref(), D0, &segments).unwrap();
    r.core.finish_segment_frees(&segments);
    assert_eq!(r.core.pool_usage(pool), None, "forgotten");
    assert_eq!(r.core.releasing_bytes(), 0);
    r.core.check_invariants().unwrap();
}

#[test]
fn no_page_of_a_stream_about_to_capture_is_released_and_its_capture_waits_for_one_in_flight() {
    let mut r = rig("expandable_segments:True");
    let reserved = |r: &Rig| r.core.stats().reserved_bytes[0].current;
    let a = r.core.malloc(40 * MIB, r.s0).unwrap();
    r.core.free(a.ptr).unwrap();
    // A release of s0's free pages is in flight off the core (a miss's, or a cache release's).
    let releases = r.core.detach_free_pages().unwrap();
    assert!(!releases.is_empty());
    assert!(
        !r.core.prepare_capture(r.s0),
        "the capture must wait: the release will synchronize s0"
    );
    assert!(
        r.core.prepare_capture(r.s1),
        "s1 has no page work in flight"
    );
    r.core.unprepare_capture(r.s1);
    gpualloc_devices::release_pages(r.core.backend().as_ref(), &releases).unwrap();
    for rel in releases {
        r.core.finish_page_release(rel).unwrap();
    }
    assert!(r.core.prepare_capture(r.s0));
    // Prepared: s0's free pages stay mapped, off the core and in place (an unmap would
    // synchronize s0 once it captures).
    let b = r.core.malloc(40 * MIB, r.s0).unwrap();
    r.core.free(b.ptr).unwrap();
    let held = reserved(&r);
    assert!(held >= 40 * MIB, "{held}");
    assert!(r.core.detach_free_pages().unwrap().is_empty());
    r.core.empty_cache().unwrap();
    assert_eq!(reserved(&r), held);
    // Given up: they go.
    r.core.unprepare_capture(r.s0);
    r.core.empty_cache().unwrap();
    assert_eq!(reserved(&r), 0);
    // Announced captures end the preparation: begun on the backend, then announced.
    assert!(r.core.prepare_capture(r.s0));
    r.sim
        .stream_begin_capture(r.s0, CaptureMode::Relaxed)
        .unwrap();
    let id = capture_id(&r.sim, r.s0);
    let pool = r.core.create_pool(false);
    r.core.begin_capture(id, pool, r.s0).unwrap();
    r.core.end_capture(id).unwrap();
    let g = r.sim.stream_end_capture(r.s0).unwrap();
    r.sim.graph_destroy(g).unwrap();
    let c = r.core.malloc(40 * MIB, r.s0).unwrap();
    r.core.free(c.ptr).unwrap();
    r.core.empty_cache().unwrap();
    assert_eq!(
        reserved(&r),
        0,
        "no preparation left after the announced capture"
    );
}

#[test]
fn a_pool_whose_stream_captures_into_another_pool_refuses_to_sleep() {
    use gpualloc_devices::{PoolOptions, SleepMode};
    let mut r = rig("expandable_segments:True");
    let named = r.core.create_named_pool("weights", PoolOptions::default());
    let a = r.core.malloc_in(named, 4 * MIB, r.s0).unwrap();
    r.core.free(a.ptr).unwrap();
    let graphs = r.core.create_pool(false);
    r.sim
        .stream_begin_capture(r.s0, CaptureMode::Relaxed)
        .unwrap();
    let id = capture_id(&r.sim, r.s0);
    r.core.begin_capture(id, graphs, r.s0).unwrap();
    r.sim.reset_counts();
    assert_eq!(
        r.core.begin_sleep(named, SleepMode::Discard).map(|_| ()),
        Err(AllocError::CaptureUnderway("putting a pool to sleep"))
    );
    assert_eq!(
        r.sim.counts().get(Op::EventRecord),
        0,
        "nothing recorded in the capture"
    );
    r.core.end_capture(id).unwrap();
    let g = r.sim.stream_end_capture(r.s0).unwrap();
    r.sim.graph_destroy(g).unwrap();
    assert!(r.core.begin_sleep(named, SleepMode::Discard).is_ok());
}

/// After announcing a capture, its owner waits for the other streams with segments in the
/// capture's pool (`streams_before_capture`): their queued work may still use blocks the
/// capture can hand out. A block of the pool freed during the capture on a stream outside
/// it is held back until the capture ends; one freed on the capture's stream is not.
#[test]
fn a_capture_names_its_pools_other_streams_and_holds_their_eager_frees_back() {
    use gpualloc_devices::PoolOptions;
    for conf in CONFIGS {
        let mut r = rig(conf);
        let s2 = r.sim.stream_create(D0).unwrap();
        let named = r.core.create_named_pool("decode", PoolOptions::default());
        let other = r.core.create_named_pool("other", PoolOptions::default());
        // s0 and s1 have segments in the pool, s2 only in another pool and the default one.
        let a = r.core.malloc_in(named, 4 * MIB, r.s0).unwrap();
        let b = r.core.malloc_in(named, 4 * MIB, r.s1).unwrap();
        let c = r.core.malloc_in(other, 4 * MIB, s2).unwrap();
        let d = r.core.malloc(4 * MIB, s2).unwrap();
        r.sim
            .stream_begin_capture(r.s0, CaptureMode::Relaxed)
            .unwrap();
        let id = capture_id(&r.sim, r.s0);
        assert!(
            r.core.streams_before_capture(id).is_empty(),
            "not announced"
        );
        r.core.begin_capture(id, named, r.s0).unwrap();
        assert_eq!(r.core.streams_before_capture(id), vec![r.s1], "{conf}");
        let active = |r: &Rig| r.core.stats().active_bytes[0].current;
        let before = active(&r);
        // s1's eager free is held back; s0's (the capture's) and the other pools' are not.
        r.core.free(b.ptr).unwrap();
        assert_eq!(active(&r), before, "{conf}: s1's free was made");
        for x in [a, c, d] {
            r.core.free(x.ptr).unwrap();
        }
        assert_eq!(active(&r), before - 3 * a.block_size, "{conf}");
        r.core.end_capture(id).unwrap();
        let g = r.sim.stream_end_capture(r.s0).unwrap();
        r.sim.graph_destroy(g).unwrap();
        assert_eq!(active(&r), 0, "{conf}: made at the capture's end");
        assert!(r.core.streams_before_capture(id).is_empty(), "ended");
        r.core.check_invariants().unwrap();
    }
}

/// A block of the pool handed out to a stream before it joined the capture (during the
/// capture, or before it began) is eager work's: freed after that stream joined, it is still
/// held back until the capture ends, and the stream's request in the capture gets other
/// memory. One handed out to it in the capture is not held back.
#[test]
fn a_block_handed_out_before_its_stream_joined_a_capture_is_held_back() {
    use gpualloc_devices::PoolOptions;
    for conf in CONFIGS {
        for before_the_capture in [false, true] {
            let mut r = rig(conf);
            let named = r.core.create_named_pool("decode", PoolOptions::default());
            let early = before_the_capture.then(|| r.core.malloc_in(named, 4 * MIB, r.s1).unwrap());
            r.sim
                .stream_begin_capture(r.s0, CaptureMode::Relaxed)
                .unwrap();
            let id = capture_id(&r.sim, r.s0);
            r.core.begin_capture(id, named, r.s0).unwrap();
            let eager = match early {
                Some(a) => a,
                None => r.core.malloc_in(named, 4 * MIB, r.s1).unwrap(),
            };
            // s1 joins the capture, then frees the eager block and asks for as much there.
            let fork = r.sim.event_create(D0).unwrap();
            r.sim.event_record(fork, r.s0).unwrap();
            r.sim.stream_wait_event(r.s1, fork).unwrap();
            let active = |r: &Rig| r.core.stats().active_bytes[0].current;
            r.core.free(eager.ptr).unwrap();
            let case = format!("{conf}, before the capture: {before_the_capture}");
            assert_eq!(active(&r), 4 * MIB, "{case}: the free is held back");
            let in_capture = r.core.malloc(4 * MIB, r.s1).unwrap();
            assert_eq!(in_capture.pool, Some(named));
            assert_ne!(
                in_capture.ptr, eager.ptr,
                "{case}: the capture got the eager block"
            );
            // Handed out in the capture: its free there is the graph's, made at once.
            r.core.free(in_capture.ptr).unwrap();
            assert_eq!(
                active(&r),
                4 * MIB,
                "{case}: the capture's free was held back"
            );
            let join = r.sim.event_create(D0).unwrap();
            r.sim.event_record(join, r.s1).unwrap();
            r.sim.stream_wait_event(r.s0, join).unwrap();
            r.core.end_capture(id).unwrap();
            let g = r.sim.stream_end_capture(r.s0).unwrap();
            r.sim.graph_destroy(g).unwrap();
            assert_eq!(active(&r), 0, "{case}: made at the capture's end");
            r.core.check_invariants().unwrap();
        }
    }
}
