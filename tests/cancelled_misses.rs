//! Misses whose requests were cancelled: their memory lands in the
//! cache, a live request that finds the device full while they are in flight waits for them
//! and retries instead of failing, and an out-of-memory report says where the memory is.

use std::sync::Arc;
use std::time::Duration;

mod common;

use common::{build, wait_in_flight, MIB};
use gpualloc::runtime::sim::{LatencyModel, SimBackend};
use gpualloc::{Allocator, DeviceId};

fn slow_sim(capacity: u64, malloc: Duration) -> Arc<SimBackend> {
    common::sim_with(
        capacity,
        LatencyModel {
            malloc,
            map: malloc / 10,
            ..LatencyModel::zero()
        },
    )
}

/// The bytes an out-of-memory report says are in flight on device 0 (asked for with a
/// request larger than the device, which fails at once).
async fn in_flight_reported(alloc: &Allocator, s: &gpualloc::Stream) -> u64 {
    let oversized = alloc.malloc(4096 * MIB, s).await.unwrap_err();
    oversized
        .oom_report()
        .expect("an out-of-memory report")
        .in_flight
}

/// Starts `n` mallocs of `size` at once and cancels them all while their misses are in
/// flight (the device's malloc takes the sim's latency).
async fn cancel_misses_in_flight(alloc: &Allocator, n: usize, size: u64) {
    let actor = alloc.device_actor(DeviceId(0)).unwrap().clone();
    let tasks: Vec<_> = (0..n)
        .map(|_| {
            let (a, s) = (alloc.clone(), alloc.new_stream(DeviceId(0)).unwrap());
            tokio::spawn(async move { a.malloc(size, &s).await })
        })
        .collect();
    // With expandable segments the core maps pages under its gate, one miss at a time: wait
    // for the first ones to be in flight, not for all.
    assert!(
        wait_in_flight(&actor, 2500, |m| m >= n / 2).await >= n / 2,
        "misses are not in flight"
    );
    for t in tasks {
        t.abort();
        let _ = t.await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_request_waits_for_cancelled_misses_instead_of_failing() {
    for conf in ["", "thread_cache:False", "expandable_segments:True"] {
        let sim = slow_sim(1024 * MIB, Duration::from_millis(100));
        let alloc = build(sim.clone(), conf);
        // 15 × 64 MiB in flight, all cancelled: 960 of the 1024 MiB are being allocated.
        cancel_misses_in_flight(&alloc, 15, 64 * MIB).await;
        let s = alloc.new_stream(DeviceId(0)).unwrap();
        let buf = alloc
            .malloc(256 * MIB, &s)
            .await
            .unwrap_or_else(|e| panic!("{conf:?}: {e}"));
        assert_eq!(buf.len(), 256 * MIB);
        let actor = alloc.device_actor(DeviceId(0)).unwrap();
        assert_eq!(
            wait_in_flight(actor, 5000, |m| m == 0).await,
            0,
            "{conf:?}: every miss lands"
        );
        drop(buf);
        let st = alloc.stats(DeviceId(0)).await.unwrap();
        assert_eq!(
            st.allocated_bytes.all().current,
            0,
            "{conf:?}: the cancelled requests' memory was never handed out"
        );
        alloc.empty_cache().await.unwrap();
        alloc.shutdown().await.unwrap();
        assert_eq!(sim.used_bytes(DeviceId(0)).unwrap(), 0, "{conf:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_oom_report_counts_memory_in_flight_and_the_process() {
    let sim = slow_sim(1024 * MIB, Duration::from_millis(400));
    let alloc = build(sim.clone(), "thread_cache:False");
    let s = alloc.new_stream(DeviceId(0)).unwrap();
    // Live misses (not cancelled) hold 2 × 400 MiB while a third request finds no room.
    let (a1, s1) = (alloc.clone(), s.clone());
    let first = tokio::spawn(async move { a1.malloc(400 * MIB, &s1).await });
    let (a2, s2) = (alloc.clone(), s.clone());
    let second = tokio::spawn(async move { a2.malloc(400 * MIB, &s2).await });
    let actor = alloc.device_actor(DeviceId(0)).unwrap().clone();
    assert_eq!(wait_in_flight(&actor, 2500, |m| m == 2).await, 2);
    tokio::time::sleep(Duration::from_millis(50)).await;
    let held = (
        first.await.unwrap().unwrap(),
        second.await.unwrap().unwrap(),
    );
    // Now the device is 800 MiB full with live buffers: the report says so.
    let err = alloc.malloc(400 * MIB, &s).await.unwrap_err();
    let report = err.oom_report().expect("an out-of-memory report");
    assert_eq!(report.in_flight, 0);
    assert_eq!(report.process_used, Some(800 * MIB));
    let text = err.to_string();
    assert!(
        text.contains("this process has 800.00 MiB in use"),
        "{text}"
    );
    assert!(
        !text.contains("expandable_segments"),
        "nothing is reserved but unallocated: no fragmentation hint: {text}"
    );
    drop(held);
    alloc.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_larger_than_the_device_gets_no_fragmentation_hint() {
    let sim = slow_sim(64 * MIB, Duration::ZERO);
    let alloc = build(sim.clone(), "");
    let s = alloc.new_stream(DeviceId(0)).unwrap();
    // Fragment: 40 MiB reserved, 30 MiB of it idle.
    let a = alloc.malloc(30 * MIB, &s).await.unwrap();
    let b = alloc.malloc(10 * MIB, &s).await.unwrap();
    drop(a);
    let huge = alloc.malloc(100 * MIB, &s).await.unwrap_err().to_string();
    assert!(!huge.contains("expandable_segments"), "{huge}");
    drop(b);
    alloc.shutdown().await.unwrap();
}

/// Concurrent misses, each checking `per_process_memory_fraction` before its device malloc
/// off the gate, must not overshoot the cap together.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_misses_respect_the_memory_fraction() {
    let sim = slow_sim(1024 * MIB, Duration::from_millis(100));
    let alloc = build(
        sim.clone(),
        "per_process_memory_fraction:0.5,thread_cache:False",
    );
    let tasks: Vec<_> = (0..10u64)
        .map(|i| {
            let (a, s) = (alloc.clone(), alloc.new_stream(DeviceId(0)).unwrap());
            tokio::spawn(async move { a.malloc(100 * MIB + i * 2 * MIB, &s).await })
        })
        .collect();
    let mut served = Vec::new();
    for t in tasks {
        if let Ok(buf) = t.await.unwrap() {
            served.push(buf);
        }
    }
    let st = alloc.stats(DeviceId(0)).await.unwrap();
    assert!(
        st.reserved_bytes.all().peak <= 512 * MIB,
        "peak reserved {} MiB over the 512 MiB cap ({} served)",
        st.reserved_bytes.all().peak / MIB,
        served.len()
    );
    assert!(served.len() >= 3, "{} served", served.len());
    drop(served);
    alloc.shutdown().await.unwrap();
}

/// A miss whose backend panics after its request was cancelled (a custom backend's bug) must
/// not count as in flight forever, or every request that later runs out of memory waits for
/// it to land. (Before, it stayed in flight: the panic ended the task without delivering, and
/// the cancelled request was not there to take the landing. Now the panic is an error the
/// task delivers, and a landing nobody took lands when its last handle goes:
/// `gpualloc_actor::landing`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_miss_whose_backend_panicked_does_not_stay_in_flight() {
    use gpualloc::runtime::sim::{Fault, Op};
    // Expandable segments: a miss creates a physical handle (slow here), then maps it (the
    // injected panic), so the request can be cancelled in between.
    let sim = common::sim_with(
        1024 * MIB,
        LatencyModel {
            phys: Duration::from_millis(300),
            ..LatencyModel::zero()
        },
    );
    let alloc = build(sim.clone(), "expandable_segments:True,thread_cache:False");
    let actor = alloc.device_actor(DeviceId(0)).unwrap().clone();
    sim.inject(Op::Map, Fault::PanicNext { skip: 0 });
    let (a, s) = (alloc.clone(), alloc.new_stream(DeviceId(0)).unwrap());
    let request = tokio::spawn(async move { a.malloc(64 * MIB, &s).await });
    assert_eq!(
        wait_in_flight(&actor, 2500, |m| m == 1).await,
        1,
        "the miss is not in flight"
    );
    request.abort();
    let _ = request.await;
    let left = wait_in_flight(&actor, 5000, |m| m == 0).await;
    assert_eq!(sim.counts().get(Op::Map), 1, "the map was tried");
    assert_eq!(left, 0, "the dead miss still counts");
    sim.clear_faults();
}

/// A miss whose backend call panics (a custom backend's bug) fails its request with an
/// error and gives back what it had claimed: the bytes it was obtaining no longer count as
/// in flight, so they neither shrink `per_process_memory_fraction` for every later request
/// nor show in out-of-memory reports. (Before, 64 MiB stayed "in flight" for good, and a
/// 480 MiB request under the 512 MiB cap ran out of memory.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_miss_whose_backend_panicked_gives_its_claim_back() {
    use gpualloc::runtime::sim::{Fault, Op};
    for (conf, op) in [
        (
            "per_process_memory_fraction:0.5,expandable_segments:False,thread_cache:False",
            Op::Malloc,
        ),
        (
            "per_process_memory_fraction:0.5,expandable_segments:True,thread_cache:False",
            Op::Map,
        ),
    ] {
        let sim = common::sim_with(1024 * MIB, LatencyModel::zero());
        let alloc = build(sim.clone(), conf);
        let s = alloc.new_stream(DeviceId(0)).unwrap();
        sim.inject(op, Fault::PanicNext { skip: 0 });
        let err = alloc.malloc(64 * MIB, &s).await.unwrap_err();
        sim.clear_faults();
        assert!(err.to_string().contains("panicked"), "{conf}: {err}");
        assert_eq!(
            in_flight_reported(&alloc, &s).await,
            0,
            "{conf}: nothing is in flight"
        );
        let big = alloc
            .malloc(480 * MIB, &s)
            .await
            .unwrap_or_else(|e| panic!("{conf}: 480 MiB under the 512 MiB cap: {e}"));
        drop(big);
        alloc.shutdown().await.unwrap();
    }
}

/// A miss that releases the cache to make room, where the backend panics while freeing a
/// cached segment (a custom backend's bug), fails with a typed error and gives its claim
/// back. (Before, the panic ended the miss's task: the request got an internal error and
/// its memory stayed counted in flight for good.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_while_releasing_the_cache_gives_the_claim_back() {
    use gpualloc::runtime::sim::{Fault, Op};
    let conf = "expandable_segments:False,thread_cache:False";
    let sim = common::sim_with(256 * MIB, LatencyModel::zero());
    let alloc = build(sim.clone(), conf);
    // 200 MiB cached on one stream: too small to lend a request of 210 MiB on another
    // stream, and the device has no room for a new segment until the cache is released.
    let (s1, s2) = (
        alloc.new_stream(DeviceId(0)).unwrap(),
        alloc.new_stream(DeviceId(0)).unwrap(),
    );
    drop(alloc.malloc(200 * MIB, &s1).await.unwrap());
    sim.inject(Op::Free, Fault::PanicNext { skip: 0 });
    let err = alloc.malloc(210 * MIB, &s2).await.unwrap_err();
    sim.clear_faults();
    assert!(!err.to_string().contains("task failed"), "{err}");
    assert_eq!(
        in_flight_reported(&alloc, &s2).await,
        0,
        "nothing is in flight"
    );
    alloc.shutdown().await.unwrap();
}

/// A named pool's request cancelled during its miss, then the pool dropped while the miss is
/// still making its segment. Meanwhile another request's out-of-memory chain releases the
/// cache and forgets released pools that hold no segment: the dropped pool held none yet.
/// The segment that lands afterwards is the pool's, and must still go back at the next
/// `empty_cache` (it stayed reserved until shutdown: no release looked at a forgotten pool).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_pools_cancelled_miss_lands_where_empty_cache_releases_it() {
    use gpualloc::PoolOptions;
    for conf in ["", "expandable_segments:False", "thread_cache:False"] {
        let alloc = build(slow_sim(100 * MIB, Duration::from_millis(200)), conf);
        let actor = alloc.device_actor(DeviceId(0)).unwrap().clone();
        let s = alloc.new_stream(DeviceId(0)).unwrap();
        let held = alloc.malloc(60 * MIB, &s).await.unwrap();
        let pool = alloc.pool("p", PoolOptions::default()).await.unwrap();
        let request = {
            let (pool, s) = (pool.clone(), s.clone());
            tokio::spawn(async move { pool.malloc(12 * MIB, &s).await })
        };
        assert_eq!(
            wait_in_flight(&actor, 2000, |n| n == 1).await,
            1,
            "[{conf}]"
        );
        request.abort();
        assert!(request.await.unwrap_err().is_cancelled(), "[{conf}]");
        drop(pool);
        // Does not fit beside the 60 MiB and the 12 MiB in flight: its chain releases the
        // cache (and forgets the released pools without segments) before it fails.
        let denied = alloc.malloc(50 * MIB, &s).await;
        assert!(denied.is_err(), "[{conf}]");
        assert_eq!(
            wait_in_flight(&actor, 5000, |n| n == 0).await,
            0,
            "[{conf}]"
        );
        drop(held);
        alloc.empty_cache().await.unwrap();
        let st = alloc.stats(DeviceId(0)).await.unwrap();
        assert_eq!(
            st.reserved_bytes[0].current, 0,
            "[{conf}]: the landed segment went back"
        );
        alloc.shutdown().await.unwrap();
    }
}
