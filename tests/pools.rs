//! Named memory pools through the public API: a pool's blocks never
//! serve another pool's requests (thread cache on or off, expandable segments or not), a quota
//! fails with a typed error naming the pool or waits for a free in the pool, usage adds up to
//! the device's statistics, and dropping the last handle releases the pool.

mod common;

use std::time::Duration;

use common::{build, sim, until_waiting, MIB};
use gpualloc::{AllocError, DeviceId, Error, MallocOptions, PoolOptions};

const CONFIGS: [&str; 4] = [
    "",
    "thread_cache:False",
    "expandable_segments:True",
    "expandable_segments:True,thread_cache:False,garbage_collection_threshold:0.8",
];

/// A pool called "kv_cache" with a quota of `quota` bytes.
async fn kv_pool(alloc: &gpualloc::Allocator, quota: u64) -> gpualloc::Pool {
    let options = PoolOptions {
        quota: Some(quota),
        use_on_oom: false,
        unsplit: None,
    };
    alloc.pool("kv_cache", options).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pools_freed_block_never_serves_another_pool() {
    for conf in CONFIGS {
        let alloc = build(sim(4 << 30), conf);
        let stream = alloc.new_stream(DeviceId(0)).unwrap();
        let kv = alloc
            .pool("kv_cache", PoolOptions::default())
            .await
            .unwrap();
        let weights = alloc.pool("weights", PoolOptions::default()).await.unwrap();
        assert_eq!(kv.name(), "kv_cache");
        for size in [4096, 512 << 10, 8 * MIB] {
            let k = kv.malloc(size, &stream).await.unwrap();
            let at = k.ptr();
            drop(k);
            // Same size, same stream, same thread: the thread cache would hand it back to the
            // next request of the default pools; a pool's block is never parked there.
            let d = alloc.malloc(size, &stream).await.unwrap();
            let w = weights.malloc(size, &stream).await.unwrap();
            assert_ne!(d.ptr(), at, "[{conf}] {size}: default request");
            assert_ne!(w.ptr(), at, "[{conf}] {size}: other pool");
            let again = kv.malloc(size, &stream).await.unwrap();
            assert_eq!(again.ptr(), at, "[{conf}] {size}: its own pool");
            // The default pool's block does not go to a pool either.
            let dp = d.ptr();
            drop(d);
            let w2 = weights.malloc(size, &stream).await.unwrap();
            assert_ne!(w2.ptr(), dp, "[{conf}] {size}");
        }
        alloc.shutdown().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quota_fails_with_a_typed_error_or_waits_for_a_free_in_the_pool() {
    for conf in CONFIGS {
        let alloc = build(sim(4 << 30), conf);
        let stream = alloc.new_stream(DeviceId(0)).unwrap();
        let kv = kv_pool(&alloc, 40 * MIB).await;
        let a = kv.malloc(20 * MIB, &stream).await.unwrap();
        let b = kv.malloc(20 * MIB, &stream).await.unwrap();
        let err = kv.malloc(20 * MIB, &stream).await.unwrap_err();
        assert!(err.is_oom(), "[{conf}] {err}");
        match &err {
            Error::Alloc(AllocError::PoolQuota {
                pool,
                quota,
                reserved,
                requested,
                in_flight,
            }) => {
                assert_eq!(*in_flight, 0, "[{conf}]");
                assert_eq!(
                    (pool.as_str(), *quota, *reserved, *requested),
                    ("kv_cache", 40 * MIB, 40 * MIB, 20 * MIB)
                );
            }
            other => panic!("[{conf}] {other:?}"),
        }
        assert!(err.to_string().contains("\"kv_cache\""), "{err}");
        // The default pools are not limited by it.
        let d = alloc.malloc(20 * MIB, &stream).await.unwrap();
        // Waiting: a free in the pool lets the request through.
        let waiter = {
            let (kv, stream) = (kv.clone(), stream.clone());
            tokio::spawn(async move {
                kv.malloc_with(
                    20 * MIB,
                    &stream,
                    MallocOptions::wait_for(Duration::from_secs(10)),
                )
                .await
            })
        };
        until_waiting(&alloc, 1).await;
        let at = a.ptr();
        drop(a);
        let c = waiter.await.unwrap().unwrap();
        // Usually `a`'s block; a wake-up that raced the free may have returned the pool's free
        // segment to the device and taken a new one instead: either way within the quota.
        let usage = kv.usage(DeviceId(0)).await.unwrap();
        if c.ptr() != at {
            eprintln!("[{conf}] the waiter got a new segment");
        }
        assert_eq!(usage.reserved.all().current, 40 * MIB);
        assert_eq!(usage.allocated.all().current, 40 * MIB);
        drop((b, c, d));
        alloc.shutdown().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_adds_up_and_dropping_the_pool_releases_it() {
    for conf in CONFIGS {
        let alloc = build(sim(4 << 30), conf);
        let stream = alloc.new_stream(DeviceId(0)).unwrap();
        let kv = alloc
            .pool("kv_cache", PoolOptions::default())
            .await
            .unwrap();
        let k: Vec<_> = {
            let mut v = Vec::new();
            for _ in 0..3 {
                v.push(kv.malloc(6 * MIB, &stream).await.unwrap());
            }
            v
        };
        let d = alloc.malloc(30 * MIB, &stream).await.unwrap();
        let usage = kv.usage(DeviceId(0)).await.unwrap();
        assert_eq!(usage.name, "kv_cache");
        assert_eq!(usage.allocated.all().current, 18 * MIB);
        let st = alloc.stats(DeviceId(0)).await.unwrap();
        assert_eq!(st.allocated_bytes[0].current, 48 * MIB);
        assert!(st.reserved_bytes[0].current >= usage.reserved.all().current + 30 * MIB);
        let pst = kv.stats(DeviceId(0)).await.unwrap();
        assert_eq!(pst.allocated_bytes[0].current, 18 * MIB);
        assert_eq!(pst.reserved_bytes[0].current, usage.reserved.all().current);
        let snap = kv.snapshot(DeviceId(0)).await.unwrap();
        assert_eq!(
            snap.segments.iter().map(|s| s.total_size).sum::<u64>(),
            usage.reserved.all().current
        );
        let table = kv.memory_summary().await.unwrap();
        if conf.is_empty() {
            println!("{table}");
        }
        assert!(table.starts_with("memory pool \"kv_cache\""), "{table}");
        assert!(table.contains("Allocated memory"), "{table}");
        // Bad input: a device the pool is not on.
        assert!(matches!(
            kv.usage(DeviceId(7)).await,
            Err(Error::InvalidDevice { device: 7, .. })
        ));
        // The last handle goes while its buffers live: they stay valid and return to the
        // device on empty_cache once dropped.
        let clone = kv.clone();
        drop(kv);
        assert_eq!(
            clone
                .usage(DeviceId(0))
                .await
                .unwrap()
                .allocated
                .all()
                .current,
            18 * MIB
        );
        drop(clone);
        drop(k);
        drop(d);
        alloc.empty_cache().await.unwrap();
        let st = alloc.stats(DeviceId(0)).await.unwrap();
        assert_eq!(st.reserved_bytes[0].current, 0, "[{conf}]");
        alloc.shutdown().await.unwrap();
    }
}

/// With expandable segments a pool at its quota unmaps its own wholly free pages (off the
/// actor's gate) and grows again, instead of failing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_its_quota_a_pool_of_expandable_segments_unmaps_its_own_free_pages() {
    for conf in [
        "expandable_segments:True",
        "expandable_segments:True,thread_cache:False",
    ] {
        let alloc = build(sim(4 << 30), conf);
        let stream = alloc.new_stream(DeviceId(0)).unwrap();
        let kv = kv_pool(&alloc, 40 * MIB).await;
        let a = kv.malloc(12 * MIB, &stream).await.unwrap();
        let b = kv.malloc(12 * MIB, &stream).await.unwrap();
        let c = kv.malloc(14 * MIB, &stream).await.unwrap();
        assert_eq!(
            kv.usage(DeviceId(0)).await.unwrap().reserved.all().current,
            38 * MIB
        );
        drop(b);
        let e = kv.malloc(14 * MIB, &stream).await.unwrap();
        assert_eq!(e.ptr().0, a.ptr().0 + 38 * MIB, "[{conf}]");
        assert_eq!(
            kv.usage(DeviceId(0)).await.unwrap().reserved.all().current,
            40 * MIB
        );
        let err = kv.malloc(4 * MIB, &stream).await.unwrap_err();
        assert!(
            matches!(err, Error::Alloc(AllocError::PoolQuota { .. })),
            "[{conf}] {err}"
        );
        drop((a, c, e));
        alloc.shutdown().await.unwrap();
    }
}

/// Used as a user would, with things dropped at awkward moments: a request waiting at the
/// quota is cancelled (nothing leaks, the next one is served), the allocator shuts down while
/// a pool handle and its buffers are alive (later calls get a typed error, dropping them is
/// harmless), a stream of another allocator is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pools_survive_cancellation_shutdown_and_foreign_streams() {
    for conf in CONFIGS {
        let sim = sim(4 << 30);
        let alloc = build(sim.clone(), conf);
        let stream = alloc.new_stream(DeviceId(0)).unwrap();
        let kv = kv_pool(&alloc, 20 * MIB).await;
        let a = kv.malloc(20 * MIB, &stream).await.unwrap();
        let waiting = {
            let (kv, stream) = (kv.clone(), stream.clone());
            tokio::spawn(async move {
                kv.malloc_with(
                    20 * MIB,
                    &stream,
                    MallocOptions::wait_for(Duration::from_secs(30)),
                )
                .await
            })
        };
        until_waiting(&alloc, 1).await;
        waiting.abort();
        assert!(waiting.await.unwrap_err().is_cancelled());
        until_waiting(&alloc, 0).await;
        drop(a);
        let b = kv.malloc(20 * MIB, &stream).await.unwrap();
        let usage = kv.usage(DeviceId(0)).await.unwrap();
        assert_eq!(usage.allocated.all().current, 20 * MIB, "[{conf}]");
        assert_eq!(usage.reserved.all().current, 20 * MIB, "[{conf}]");
        // A stream of another allocator (on another backend).
        let other = build(common::sim(1 << 30), conf);
        let foreign = other.new_stream(DeviceId(0)).unwrap();
        assert!(matches!(
            kv.malloc(MIB, &foreign).await,
            Err(Error::ForeignStream)
        ));
        other.shutdown().await.unwrap();
        // Shut down with the pool and a buffer alive.
        alloc.shutdown().await.unwrap();
        let err = kv.malloc(MIB, &stream).await.unwrap_err();
        assert!(
            matches!(err, Error::Alloc(AllocError::Shutdown)),
            "[{conf}] {err}"
        );
        drop(b);
        drop(kv);
        assert_eq!(sim.used_bytes(DeviceId(0)).unwrap(), 0, "[{conf}]");
    }
}

/// The vllm#52951 pattern in a named pool: 100 rounds of "new stream, allocate 64 MiB from
/// the pool, free, drop the stream" stay within one round's memory, and never take memory of
/// the default pools.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pools_dropped_streams_do_not_strand_its_memory() {
    for conf in CONFIGS {
        let alloc = build(sim(16 << 30), conf);
        let kv = alloc
            .pool("kv_cache", PoolOptions::default())
            .await
            .unwrap();
        let mut one_round = 0;
        for round in 0..100 {
            let stream = alloc.new_stream(DeviceId(0)).unwrap();
            let buf = kv.malloc(64 * MIB, &stream).await.unwrap();
            drop(buf);
            drop(stream);
            let reserved = kv.usage(DeviceId(0)).await.unwrap().reserved.all().current;
            if round == 0 {
                one_round = reserved;
            }
            assert!(
                reserved <= one_round,
                "[{conf}] round {round}: {} MiB reserved, one round holds {} MiB",
                reserved / MIB,
                one_round / MIB
            );
        }
        let st = alloc.stats(DeviceId(0)).await.unwrap();
        assert_eq!(
            st.reserved_bytes[0].current, one_round,
            "[{conf}]: the pool's only"
        );
        alloc.shutdown().await.unwrap();
    }
}

/// A pool at its quota touches no other pool's memory on the actors' path either: the
/// default pools' cached memory stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_its_quota_a_pool_leaves_other_pools_cache_alone() {
    for conf in CONFIGS {
        let alloc = build(sim(4 << 30), conf);
        let stream = alloc.new_stream(DeviceId(0)).unwrap();
        drop(alloc.malloc(20 * MIB, &stream).await.unwrap());
        let before = alloc.stats(DeviceId(0)).await.unwrap().reserved_bytes[0].current;
        let kv = kv_pool(&alloc, 20 * MIB).await;
        let a = kv.malloc(20 * MIB, &stream).await.unwrap();
        let err = kv.malloc(4 * MIB, &stream).await.unwrap_err();
        assert!(
            matches!(err, Error::Alloc(AllocError::PoolQuota { .. })),
            "[{conf}] {err}"
        );
        let after = alloc.stats(DeviceId(0)).await.unwrap().reserved_bytes[0].current;
        assert_eq!(
            after,
            before + 20 * MIB,
            "[{conf}]: the default pool's cache stays"
        );
        drop(a);
        alloc.shutdown().await.unwrap();
    }
}
