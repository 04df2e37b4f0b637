//! Memory on its way back to the device is the device's until the driver call returns: a
//! request made while `empty_cache` frees a segment (or unmaps pages) off the gate, under
//! `per_process_memory_fraction`, waits for the release instead of taking the device past
//! the cap. (PyTorch holds its lock across `cudaFree`, so its request waits too.)
//!
//! The release is held up by work on the device: a segment free synchronizes the device, a
//! page unmap the segment's stream; a 300 ms kernel keeps it in flight.

use std::time::Duration;

mod common;

use common::{build, sim, until_started, wait_in_flight, MIB};
use gpualloc::runtime::sim::Op;
use gpualloc::{CaptureMode, DeviceId, PoolOptions};

const D0: DeviceId = DeviceId(0);

/// 100 MiB allowed of the sim's 1 GiB.
const CAP: &str = "per_process_memory_fraction:0.09765625";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malloc_during_a_cache_release_waits_for_it_and_stays_under_the_cap() {
    for conf in [
        "expandable_segments:False,thread_cache:False",
        "expandable_segments:False",
        "expandable_segments:True,thread_cache:False",
        "expandable_segments:True",
    ] {
        let sim = sim(1 << 30);
        let alloc = build(sim.clone(), &format!("{conf},{CAP}"));
        let (s, t) = (alloc.new_stream(D0).unwrap(), alloc.new_stream(D0).unwrap());
        // 60 MiB cached on `s`, and the device busy for a while.
        drop(alloc.malloc(60 * MIB, &s).await.unwrap());
        sim.launch_kernel(s.handle(), Duration::from_millis(300), |_| Ok(()))
            .unwrap();
        let emptier = {
            let alloc = alloc.clone();
            tokio::spawn(async move { alloc.empty_cache().await })
        };
        // The release took the memory out of the books and waits for the kernel.
        let actor = alloc.device_actor(D0).unwrap();
        assert_eq!(wait_in_flight(actor, 5000, |n| n == 1).await, 1, "{conf}");
        assert_eq!(sim.used_bytes(D0).unwrap(), 60 * MIB, "{conf}");
        // 60 + 50 > 100: the request waits for the release, then gets its memory.
        let b = alloc.malloc(50 * MIB, &t).await.unwrap();
        let used = sim.used_bytes(D0).unwrap();
        assert!(
            used <= 100 * MIB,
            "{conf}: the device held {} MiB, past the 100 MiB allowed",
            used / MIB
        );
        emptier.await.unwrap().unwrap();
        assert_eq!(b.len(), 50 * MIB);
        drop(b);
        alloc.shutdown().await.unwrap();
        assert_eq!(sim.used_bytes(D0).unwrap(), 0, "{conf}");
    }
}

/// A named pool's quota the same way: a request of the pool made while the pool's own release
/// (its miss at the quota) frees a segment waits for that miss to land, then fits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pools_request_during_its_own_release_waits_and_stays_within_its_quota() {
    for conf in [
        "expandable_segments:False,thread_cache:False",
        "expandable_segments:False",
    ] {
        let sim = sim(1 << 30);
        let alloc = build(sim.clone(), conf);
        let (s, t) = (alloc.new_stream(D0).unwrap(), alloc.new_stream(D0).unwrap());
        let options = PoolOptions {
            quota: Some(100 * MIB),
            use_on_oom: false,
            unsplit: None,
        };
        let kv = alloc.pool("kv_cache", options).await.unwrap();
        // 30 MiB live and 60 MiB cached on `s`, and the device busy for a while.
        let live = kv.malloc(30 * MIB, &s).await.unwrap();
        drop(kv.malloc(60 * MIB, &s).await.unwrap());
        sim.launch_kernel(s.handle(), Duration::from_millis(300), |_| Ok(()))
            .unwrap();
        sim.reset_counts();
        // 20 MiB on `t`: 90 + 20 passes the quota, so the pool frees its cached 60 MiB first.
        let first = {
            let (kv, t) = (kv.clone(), t.clone());
            tokio::spawn(async move { kv.malloc(20 * MIB, &t).await })
        };
        until_started(&sim, Op::Free, 1).await;
        // 40 MiB on `t`: 30 + 60 (being freed) + 40 passes it now; 30 + 20 + 40 will not.
        let second = kv.malloc(40 * MIB, &t).await.unwrap();
        let used = sim.used_bytes(D0).unwrap();
        assert!(
            used <= 100 * MIB,
            "{conf}: the pool held {} MiB, past its 100 MiB quota",
            used / MIB
        );
        let first = first.await.unwrap().unwrap();
        assert_eq!((first.len(), second.len()), (20 * MIB, 40 * MIB));
        drop((first, second, live));
        alloc.shutdown().await.unwrap();
        assert_eq!(sim.used_bytes(D0).unwrap(), 0, "{conf}");
    }
}

/// A graph pool's release (its last holder gone) frees its segments off the caller's thread:
/// once they are back, nothing of them is counted against the cap, and a request of all of it
/// fits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_graph_pools_release_the_whole_cap_is_free_again() {
    for conf in [
        "expandable_segments:False",
        "expandable_segments:False,thread_cache:False",
    ] {
        let sim = sim(1 << 30);
        let alloc = build(sim.clone(), &format!("{conf},{CAP}"));
        let s = alloc.new_stream(D0).unwrap();
        let pool = alloc.graph_pool(D0).await.unwrap();
        let capture = pool
            .begin_capture(&s, CaptureMode::ThreadLocal)
            .await
            .unwrap();
        drop(alloc.malloc(60 * MIB, &s).await.unwrap());
        let graph = capture.end().await.unwrap();
        assert_eq!(sim.used_bytes(D0).unwrap(), 60 * MIB, "{conf}");
        drop((graph, pool));
        for _ in 0..5000 {
            if sim.used_bytes(D0).unwrap() == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        assert_eq!(sim.used_bytes(D0).unwrap(), 0, "{conf}: the pool's release");
        let all = alloc.malloc(100 * MIB, &s).await.unwrap();
        assert_eq!(all.len(), 100 * MIB, "{conf}");
        drop(all);
        alloc.shutdown().await.unwrap();
    }
}
