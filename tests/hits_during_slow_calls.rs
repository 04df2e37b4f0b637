//! Cache hits keep flowing while a miss makes slow driver calls: the
//! pages of an expandable growth are mapped, and a garbage-collection pass frees segments,
//! outside the actor's gate. Checked by order, not by time: with each slow call costing
//! 300 ms on the sim, a hit must come back while the miss is still in flight.

use std::time::Duration;

mod common;

use common::{build, sim, until_started, MIB};
use gpualloc::runtime::sim::{LatencyModel, Op};
use gpualloc::DeviceId;

const SLOW: Duration = Duration::from_millis(300);

/// A 512 KiB cache hit asked from a plain thread of its own (so no thread cache of a tokio
/// worker can answer it): it must come back while the slow call is still in flight.
fn hit_from_another_thread(
    alloc: &gpualloc::Allocator,
    s: &gpualloc::Stream,
) -> gpualloc::DeviceBuffer {
    let (alloc, s) = (alloc.clone(), s.clone());
    std::thread::spawn(move || futures::executor::block_on(alloc.malloc(512 << 10, &s)))
        .join()
        .unwrap()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hits_flow_while_an_expandable_segment_grows() {
    for conf in [
        "expandable_segments:True,thread_cache:False",
        "expandable_segments:True",
    ] {
        let sim = sim(1 << 30);
        let alloc = build(sim.clone(), conf);
        let s = alloc.new_stream(DeviceId(0)).unwrap();
        // A cached small block to hit, and a mapped large page in use.
        drop(alloc.malloc(512 << 10, &s).await.unwrap());
        let held = alloc.malloc(15 * MIB, &s).await.unwrap();
        sim.set_latency(LatencyModel {
            map: SLOW,
            ..LatencyModel::zero()
        });
        sim.reset_counts();
        let grower = {
            let (alloc, s) = (alloc.clone(), s.clone());
            tokio::spawn(async move { alloc.malloc(100 * MIB, &s).await })
        };
        until_started(&sim, Op::Map, 1).await;
        let actor = alloc.device_actor(DeviceId(0)).unwrap();
        let hit = hit_from_another_thread(&alloc, &s);
        // Five 20 MiB pages are mapped one after another, 300 ms each: the hit comes back
        // while the first is being mapped.
        assert_eq!(
            (sim.counts().get(Op::Map), actor.misses_in_flight()),
            (1, 1),
            "{conf:?}: the hit waited for the growth (pages mapped under the gate)"
        );
        drop(hit);
        let grown = grower.await.unwrap().unwrap();
        assert_eq!(grown.len(), 100 * MIB);
        sim.set_latency(LatencyModel::zero());
        drop((grown, held));
        alloc.shutdown().await.unwrap();
        assert_eq!(sim.used_bytes(DeviceId(0)).unwrap(), 0, "{conf:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hits_flow_during_a_garbage_collection_pass() {
    let sim = sim(100 * MIB);
    let alloc = build(
        sim.clone(),
        // Ordinary segments (the garbage collector frees whole segments).
        "expandable_segments:False,garbage_collection_threshold:0.5,per_process_memory_fraction:1.0",
    );
    let s = alloc.new_stream(DeviceId(0)).unwrap();
    drop(alloc.malloc(512 << 10, &s).await.unwrap());
    // 60 MiB cached in two segments: above the 50 MiB threshold.
    let (a, b) = (
        alloc.malloc(30 * MIB, &s).await.unwrap(),
        alloc.malloc(30 * MIB, &s).await.unwrap(),
    );
    drop((a, b));
    sim.set_latency(LatencyModel {
        free: SLOW,
        ..LatencyModel::zero()
    });
    sim.reset_counts();
    let collector = {
        let (alloc, s) = (alloc.clone(), s.clone());
        tokio::spawn(async move { alloc.malloc(40 * MIB, &s).await })
    };
    until_started(&sim, Op::Free, 1).await;
    let actor = alloc.device_actor(DeviceId(0)).unwrap();
    let hit = alloc.malloc(512 << 10, &s).await.unwrap();
    // Two segments are freed one after the other, 300 ms each: the hit comes back while the
    // first is being freed.
    assert_eq!(
        (sim.counts().get(Op::Free), actor.misses_in_flight()),
        (1, 1),
        "the hit waited for the garbage collection's frees"
    );
    drop(hit);
    let big = collector.await.unwrap().unwrap();
    assert_eq!(
        sim.counts().get(Op::Free),
        2,
        "the pass freed both segments"
    );
    sim.set_latency(LatencyModel::zero());
    drop(big);
    alloc.shutdown().await.unwrap();
    assert_eq!(sim.used_bytes(DeviceId(0)).unwrap(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hits_flow_while_empty_cache_waits_for_a_busy_stream() {
    let sim = sim(1 << 30);
    let alloc = build(sim.clone(), "expandable_segments:True,thread_cache:False");
    let (s, h) = (
        alloc.new_stream(DeviceId(0)).unwrap(),
        alloc.new_stream(DeviceId(0)).unwrap(),
    );
    drop(alloc.malloc(512 << 10, &h).await.unwrap());
    drop(alloc.malloc(30 * MIB, &s).await.unwrap());
    // The segment's stream is busy for 300 ms: its pages are unmapped only after that.
    sim.launch_kernel(s.handle(), SLOW, |_| Ok(())).unwrap();
    sim.reset_counts();
    let emptier = {
        let alloc = alloc.clone();
        tokio::spawn(async move { alloc.empty_cache().await })
    };
    until_started(&sim, Op::StreamSynchronize, 1).await;
    let hit = hit_from_another_thread(&alloc, &h);
    assert!(
        !emptier.is_finished(),
        "the hit waited for empty_cache's stream synchronization (under the gate)"
    );
    drop(hit);
    emptier.await.unwrap().unwrap();
    let st = alloc.stats(DeviceId(0)).await.unwrap();
    assert!(
        st.reserved_bytes.large().current == 0,
        "the large pages went back"
    );
    alloc.shutdown().await.unwrap();
    assert_eq!(sim.used_bytes(DeviceId(0)).unwrap(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hits_flow_while_a_miss_over_the_memory_fraction_frees_the_cache() {
    for conf in [
        // Ordinary segments (expandable ones: the test below).
        "expandable_segments:False,per_process_memory_fraction:0.5",
        "expandable_segments:False,per_process_memory_fraction:0.5,thread_cache:False",
    ] {
        // 1 GiB device, 512 MiB allowed; 400 MiB cached in two segments.
        let sim = sim(1 << 30);
        let alloc = build(sim.clone(), conf);
        let s = alloc.new_stream(DeviceId(0)).unwrap();
        drop(alloc.malloc(512 << 10, &s).await.unwrap());
        let (a, b) = (
            alloc.malloc(200 * MIB, &s).await.unwrap(),
            alloc.malloc(200 * MIB, &s).await.unwrap(),
        );
        drop((a, b));
        sim.set_latency(LatencyModel {
            free: SLOW,
            ..LatencyModel::zero()
        });
        sim.reset_counts();
        // 300 MiB more would pass the cap: the cache must be freed first.
        let big = {
            let (alloc, s) = (alloc.clone(), s.clone());
            tokio::spawn(async move { alloc.malloc(300 * MIB, &s).await })
        };
        until_started(&sim, Op::Free, 1).await;
        let actor = alloc.device_actor(DeviceId(0)).unwrap();
        let hit = hit_from_another_thread(&alloc, &s);
        assert_eq!(
            (sim.counts().get(Op::Free), actor.misses_in_flight()),
            (1, 1),
            "{conf:?}: the hit waited for the frees of the cache"
        );
        drop(hit);
        let big = big.await.unwrap().unwrap();
        assert_eq!(big.len(), 300 * MIB);
        sim.set_latency(LatencyModel::zero());
        drop(big);
        alloc.shutdown().await.unwrap();
        assert_eq!(sim.used_bytes(DeviceId(0)).unwrap(), 0, "{conf:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oom_on_a_full_device_makes_no_device_call_under_the_gate() {
    // The device calls the miss makes, all off the gate, in PyTorch's order: a segment
    // malloc, and its retry after the cache's release (which found nothing to release); or a
    // growth that creates two 20 MiB pages of the 56 MiB left and fails on the third (then
    // rolls back), twice. When the core's last step still called the device under the gate,
    // these were 3 and 9; when the actor skipped the retry after an empty release, 1 and 3.
    for (conf, op, calls) in [
        ("expandable_segments:False", Op::Malloc, 2),
        (
            "expandable_segments:False,thread_cache:False",
            Op::Malloc,
            2,
        ),
        ("expandable_segments:True", Op::PhysCreate, 6),
        // The default config: expandable segments (the `gpualloc` policy, virtual memory).
        ("", Op::PhysCreate, 6),
    ] {
        let sim = sim(256 * MIB);
        let alloc = build(sim.clone(), conf);
        let s = alloc.new_stream(DeviceId(0)).unwrap();
        let held = alloc.malloc(200 * MIB, &s).await.unwrap();
        sim.reset_counts();
        // Nothing is cached: the device is simply full. The miss tries the device off the
        // gate; the core's last step then only writes the report.
        let err = alloc.malloc(100 * MIB, &s).await.unwrap_err();
        assert!(err.is_oom(), "{conf:?}: {err}");
        assert_eq!(
            sim.counts().get(op),
            calls,
            "{conf:?}: the device was tried again under the gate"
        );
        assert_eq!(sim.used_bytes(DeviceId(0)).unwrap(), 200 * MIB, "{conf:?}");
        let stats = alloc.stats(DeviceId(0)).await.unwrap();
        assert_eq!(stats.num_ooms, 1, "{conf:?}");
        drop(held);
        alloc.shutdown().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hits_flow_while_an_expandable_miss_over_the_fraction_unmaps_the_cache() {
    for conf in [
        "expandable_segments:True,per_process_memory_fraction:0.5",
        "expandable_segments:True,per_process_memory_fraction:0.5,thread_cache:False",
    ] {
        // 1 GiB device, 512 MiB allowed; 400 MiB of pages cached for another stream, one
        // small block in use beside a cached one to hit.
        let sim = sim(1 << 30);
        let alloc = build(sim.clone(), conf);
        let s = alloc.new_stream(DeviceId(0)).unwrap();
        let other = alloc.new_stream(DeviceId(0)).unwrap();
        let small = alloc.malloc(512 << 10, &s).await.unwrap();
        drop(alloc.malloc(512 << 10, &s).await.unwrap());
        let (a, b) = (
            alloc.malloc(200 * MIB, &other).await.unwrap(),
            alloc.malloc(200 * MIB, &other).await.unwrap(),
        );
        drop((a, b));
        sim.set_latency(LatencyModel {
            map: SLOW,
            ..LatencyModel::zero()
        });
        sim.reset_counts();
        // 450 MiB more would pass the cap: cached pages must be unmapped first (the other
        // stream's free 400 MiB are too few to lend).
        let big = {
            let (alloc, s) = (alloc.clone(), s.clone());
            tokio::spawn(async move { alloc.malloc(450 * MIB, &s).await })
        };
        until_started(&sim, Op::Unmap, 1).await;
        let actor = alloc.device_actor(DeviceId(0)).unwrap();
        let hit = hit_from_another_thread(&alloc, &s);
        assert_eq!(
            (sim.counts().get(Op::Unmap), actor.misses_in_flight()),
            (1, 1),
            "{conf:?}: the hit waited for the unmapping of the cache"
        );
        drop(hit);
        sim.set_latency(LatencyModel::zero());
        let big = big.await.unwrap().unwrap();
        assert_eq!(big.len(), 450 * MIB);
        drop((big, small));
        alloc.shutdown().await.unwrap();
        assert_eq!(sim.used_bytes(DeviceId(0)).unwrap(), 0, "{conf:?}");
    }
}
