//! A user's `Stream` may be dropped while the allocator still caches blocks of it. The
//! allocator keeps every stream it needs alive (see `Stream`'s docs), so every
//! path that touches a cached block's stream keeps working afterwards: a malloc on another
//! stream, the out-of-memory chain, `empty_cache`, snapshots, shutdown, the thread cache, and
//! frees of buffers recorded on a stream the user dropped. Run in every config.

mod common;

use common::{build, sim, MIB};
use gpualloc::runtime::sim::{Op, SimBackend};
use gpualloc::{Allocator, DeviceId};

const CONFIGS: &[&str] = &[
    "",
    "expandable_segments:True",
    "thread_cache:False",
    "expandable_segments:True,thread_cache:False",
    "garbage_collection_threshold:0.6",
];

/// No call of the allocator's named a stream or an event it had let go of.
fn no_unknown_handles(sim: &SimBackend, conf: &str) {
    assert_eq!(
        sim.unknown_handle_calls(),
        0,
        "[{conf}]: a backend call named a destroyed stream or event"
    );
}

/// Caches large and small blocks of a stream, then drops the stream.
async fn cache_blocks_of_a_dropped_stream(alloc: &Allocator) {
    let gone = alloc.new_stream(DeviceId(0)).unwrap();
    let big = alloc.malloc(40 * MIB, &gone).await.unwrap();
    let small = alloc.malloc(1000, &gone).await.unwrap();
    drop(big);
    drop(small);
    drop(gone);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_path_works_after_a_stream_with_cached_blocks_is_dropped() {
    for conf in CONFIGS {
        let sim = sim(1 << 30);
        let alloc = build(sim.clone(), conf);
        cache_blocks_of_a_dropped_stream(&alloc).await;
        let other = alloc.new_stream(DeviceId(0)).unwrap();
        let b = alloc
            .malloc(40 * MIB, &other)
            .await
            .unwrap_or_else(|e| panic!("{conf:?}: malloc on another stream: {e}"));
        let snap = alloc.snapshot().await.unwrap();
        assert!(!snap[0].segments.is_empty(), "{conf:?}");
        drop(b);
        alloc
            .empty_cache()
            .await
            .unwrap_or_else(|e| panic!("{conf:?}: empty_cache: {e}"));
        let st = alloc.stats(DeviceId(0)).await.unwrap();
        assert_eq!(
            st.reserved_bytes[0].current, 0,
            "{conf:?}: empty_cache released everything"
        );
        alloc
            .shutdown()
            .await
            .unwrap_or_else(|e| panic!("{conf:?}: shutdown: {e}"));
        assert_eq!(sim.used_bytes(DeviceId(0)).unwrap(), 0, "{conf:?}");
        drop(other);
        assert_eq!(
            sim.live_streams(),
            0,
            "{conf:?}: no stream outlives its users"
        );
        no_unknown_handles(&sim, conf);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_oom_chain_releases_blocks_of_a_dropped_stream() {
    for conf in CONFIGS {
        let sim = sim(100 * MIB);
        let alloc = build(sim.clone(), conf);
        cache_blocks_of_a_dropped_stream(&alloc).await;
        let other = alloc.new_stream(DeviceId(0)).unwrap();
        // 40 MiB cached + 80 MiB more does not fit in 100 MiB: the cache must be released.
        let b = alloc
            .malloc(80 * MIB, &other)
            .await
            .unwrap_or_else(|e| panic!("{conf:?}: malloc needing the dropped stream's cache: {e}"));
        drop(b);
        alloc.shutdown().await.unwrap();
        assert_eq!(sim.used_bytes(DeviceId(0)).unwrap(), 0, "{conf:?}");
        drop(other);
        assert_eq!(sim.live_streams(), 0, "{conf:?}");
        no_unknown_handles(&sim, conf);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_right_after_the_stream_is_dropped() {
    for conf in CONFIGS {
        let sim = sim(1 << 30);
        let alloc = build(sim.clone(), conf);
        cache_blocks_of_a_dropped_stream(&alloc).await;
        alloc
            .shutdown()
            .await
            .unwrap_or_else(|e| panic!("{conf:?}: shutdown: {e}"));
        assert_eq!(sim.used_bytes(DeviceId(0)).unwrap(), 0, "{conf:?}");
        assert_eq!(sim.live_streams(), 0, "{conf:?}");
        no_unknown_handles(&sim, conf);
    }
}

/// A buffer recorded on a stream the user then drops: its free still records its event on
/// that stream (kept alive by the allocator) instead of falling back to a device synchronize,
/// and the memory comes back once the stream's work is done.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_free_recorded_on_a_dropped_stream_waits_on_its_event() {
    for conf in CONFIGS {
        let sim = sim(1 << 30);
        let alloc = build(sim.clone(), conf);
        let home = alloc.new_stream(DeviceId(0)).unwrap();
        let user = alloc.new_stream(DeviceId(0)).unwrap();
        let buf = alloc.malloc(4 * MIB, &home).await.unwrap();
        buf.record_stream(&user).unwrap();
        drop(user);
        sim.reset_counts();
        drop(buf);
        // Any request runs queued messages first: the free has happened by the time it answers.
        let st = alloc.stats(DeviceId(0)).await.unwrap();
        let counts = sim.counts();
        assert_eq!(
            counts.get(Op::DeviceSynchronize),
            0,
            "{conf:?}: the free recorded an event instead of synchronizing the device"
        );
        assert!(counts.get(Op::EventRecord) >= 1, "{conf:?}");
        assert_eq!(st.allocated_bytes[0].current, 0, "{conf:?}");
        alloc.empty_cache().await.unwrap();
        let st = alloc.stats(DeviceId(0)).await.unwrap();
        assert_eq!(st.reserved_bytes[0].current, 0, "{conf:?}");
        alloc.shutdown().await.unwrap();
        drop(home);
        assert_eq!(sim.live_streams(), 0, "{conf:?}");
        no_unknown_handles(&sim, conf);
    }
}

/// Streams the allocator kept alive go once nothing of theirs is cached: a server that makes
/// a fresh stream per request does not accumulate them past `empty_cache`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kept_streams_are_released_with_their_segments() {
    for conf in CONFIGS {
        let sim = sim(1 << 30);
        let alloc = build(sim.clone(), conf);
        for _ in 0..20 {
            cache_blocks_of_a_dropped_stream(&alloc).await;
        }
        assert!(
            sim.live_streams() >= 1,
            "{conf:?}: cached blocks keep their stream"
        );
        let actor = alloc.device_actor(DeviceId(0)).unwrap().clone();
        let kept = actor.kept_streams().await.unwrap();
        assert!(
            (1..=20).contains(&kept),
            "{conf:?}: {kept} streams kept for 20 dropped"
        );
        alloc.empty_cache().await.unwrap();
        assert_eq!(actor.kept_streams().await.unwrap(), 0, "{conf:?}");
        assert_eq!(
            sim.live_streams(),
            0,
            "{conf:?}: no cached block is left, so no stream is kept"
        );
        alloc.shutdown().await.unwrap();
        no_unknown_handles(&sim, conf);
    }
}

/// A pinned buffer recorded on a stream the user then drops: its free records its event on
/// that stream (kept alive by the pinned actor), so the block is neither lost nor reused early.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pinned_free_recorded_on_a_dropped_stream_comes_back() {
    let sim = sim(1 << 30);
    let alloc = build(sim.clone(), "");
    let host = alloc.host();
    let stream = alloc.new_stream(DeviceId(0)).unwrap();
    let buf = host.malloc(64 << 10).await.unwrap();
    buf.record_stream(&stream).unwrap();
    drop(stream);
    drop(buf);
    let mut st = host.stats().await.unwrap();
    for _ in 0..500 {
        if st.allocation.current == 0 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(2)).await;
        st = host.stats().await.unwrap();
    }
    assert_eq!(st.allocation.current, 0, "the block came back to the cache");
    assert_eq!(st.cached_bytes, 64 << 10);
    alloc.shutdown().await.unwrap();
    assert_eq!(sim.live_streams(), 0, "no stream outlives its users");
    no_unknown_handles(&sim, "");
}

/// A miss keeps its stream alive, but the core names the stream only once a segment of it
/// exists. A miss on a stream with no segment that first releases memory off the gate (here
/// the page move before a growth past the most ever held: another stream's free pages are
/// unmapped) leaves its stream named by nothing meanwhile, and a pass that lets go of
/// unnamed streams (the one after another task's `empty_cache`) let go of it. The miss's new
/// segment then cached blocks of a stream nobody kept; once the user dropped the stream,
/// releasing those blocks synchronized a destroyed stream (`empty_cache` failed with an
/// invalid handle; on a driver the handle may name another stream by then).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_let_go_during_its_miss_is_kept_again_when_the_segment_lands() {
    use gpualloc::runtime::sim::LatencyModel;
    use std::time::Duration;
    for conf in ["", "thread_cache:False", "expandable_segments:False"] {
        let sim = common::sim_with(1 << 30, LatencyModel::zero());
        let alloc = build(sim.clone(), conf);
        let other = alloc.new_stream(DeviceId(0)).unwrap();
        drop(alloc.malloc(40 * MIB, &other).await.unwrap());
        // Slow unmaps and device mallocs.
        sim.set_latency(LatencyModel {
            map: Duration::from_millis(150),
            malloc: Duration::from_millis(150),
            ..LatencyModel::zero()
        });
        let stream = alloc.new_stream(DeviceId(0)).unwrap();
        // Past the most ever held, with 40 MiB of free pages elsewhere: they are unmapped
        // first, then this stream's segment is made (with ordinary segments, the device malloc
        // itself runs while nothing names the stream).
        let miss = {
            let (alloc, stream) = (alloc.clone(), stream.clone());
            tokio::spawn(async move { alloc.malloc(50 * MIB, &stream).await })
        };
        tokio::time::sleep(Duration::from_millis(30)).await;
        while !miss.is_finished() {
            alloc.empty_cache().await.unwrap();
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let buf = miss.await.unwrap().unwrap();
        sim.set_latency(LatencyModel::zero());
        drop(buf);
        drop(stream);
        // Its block is cached in its segment: the allocator keeps the stream.
        assert_eq!(
            sim.live_streams(),
            2,
            "[{conf}]: a stream the cache names was destroyed"
        );
        alloc.empty_cache().await.unwrap();
        let stats = alloc.stats(DeviceId(0)).await.unwrap();
        assert_eq!(stats.reserved_bytes[0].current, 0, "[{conf}]");
        assert_eq!(
            sim.live_streams(),
            1,
            "[{conf}]: let go once nothing names it"
        );
        drop(other);
        alloc.shutdown().await.unwrap();
        no_unknown_handles(&sim, conf);
    }
}
