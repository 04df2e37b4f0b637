//! Sleep and wake of a pool through the public API: 1,000 buffers keep
//! their bytes at the same addresses, the device has the memory back while the pool sleeps,
//! other pools keep serving, a wake without memory keeps the pool asleep with its data, a
//! waiting malloc resumes at the wake, and dropped sleep and wake futures still finish.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{build, sim, wait_in_flight, MIB};
use gpualloc::{
    AllocError, Allocator, DeviceBuffer, DeviceId, Error, MallocOptions, PoolOptions, PoolState,
    SleepMode, Stream,
};

const D0: DeviceId = DeviceId(0);

const CONFIGS: [&str; 3] = [
    "expandable_segments:True",
    "expandable_segments:True,thread_cache:False",
    "expandable_segments:True,garbage_collection_threshold:0.8,per_process_memory_fraction:0.9",
];

fn pattern(ptr: u64, len: u64, salt: u8) -> Vec<u8> {
    (0..len)
        .map(|i| ((ptr >> 12) as u8) ^ (i as u8).wrapping_mul(31) ^ (i >> 8) as u8 ^ salt)
        .collect()
}

fn write(alloc: &Allocator, s: &Stream, b: &DeviceBuffer, salt: u8) {
    alloc
        .backend()
        .copy_to_device(s.handle(), b.ptr(), &pattern(b.ptr().0, b.len(), salt))
        .unwrap();
}

fn holds(alloc: &Allocator, s: &Stream, b: &DeviceBuffer, salt: u8) -> bool {
    let mut v = vec![0u8; b.len() as usize];
    alloc
        .backend()
        .copy_from_device(s.handle(), &mut v, b.ptr())
        .unwrap();
    v == pattern(b.ptr().0, b.len(), salt)
}

fn free_bytes(alloc: &Allocator) -> u64 {
    alloc.backend().mem_info(D0).unwrap().free
}

/// 1,000 buffers of mixed sizes: 100 of about 1 MiB, 200 of about 128 KiB, 700 under 20 KiB.
fn size_of(i: u64) -> u64 {
    match i % 10 {
        0 => MIB + i * 13,
        1 | 2 => (128 << 10) + i,
        _ => (i * 37) % 20_000 + 1,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_buffers_keep_their_bytes_at_the_same_addresses() {
    for conf in CONFIGS {
        let alloc = build(sim(4 << 30), conf);
        let s = alloc.new_stream(D0).unwrap();
        let kv = alloc
            .pool("kv_cache", PoolOptions::default())
            .await
            .unwrap();
        let weights = alloc.pool("weights", PoolOptions::default()).await.unwrap();
        let w = weights.malloc(16 * MIB, &s).await.unwrap();
        write(&alloc, &s, &w, 9);
        let mut bufs = Vec::new();
        for i in 0..1000u64 {
            let b = kv.malloc(size_of(i), &s).await.unwrap();
            write(&alloc, &s, &b, i as u8);
            bufs.push(b);
        }
        let addrs: Vec<u64> = bufs.iter().map(|b| b.ptr().0).collect();
        let reserved = kv.usage(D0).await.unwrap().reserved.all().current;
        let stats = alloc.stats(D0).await.unwrap();
        let free = free_bytes(&alloc);

        let host = alloc.host().stats().await.unwrap().allocated_bytes.current;
        kv.sleep(SleepMode::Offload).await.unwrap();
        assert_eq!(kv.state(D0).await.unwrap(), PoolState::Asleep, "[{conf}]");
        // The host copy holds the bytes asked for, rounded up to 4 KiB in all.
        let data: u64 = bufs.iter().map(|b| b.len()).sum();
        let pinned = alloc.host().stats().await.unwrap().allocated_bytes.current - host;
        assert_eq!(pinned, data.div_ceil(4096) * 4096, "[{conf}] pinned bytes");
        let usage = kv.usage(D0).await.unwrap();
        assert_eq!(
            (usage.reserved.all().current, usage.asleep_bytes),
            (0, reserved)
        );
        assert_eq!(free_bytes(&alloc), free + reserved, "[{conf}] mem_info");
        let now = alloc.stats(D0).await.unwrap();
        assert_eq!(
            now.reserved_bytes.all().current,
            stats.reserved_bytes.all().current - reserved
        );
        match kv.malloc(4096, &s).await {
            Err(Error::Alloc(AllocError::PoolAsleep { pool, state })) => {
                assert_eq!((pool.as_str(), state), ("kv_cache", PoolState::Asleep))
            }
            other => panic!("[{conf}] {other:?}"),
        }
        // Other pools keep serving, and the weights are untouched.
        let w2 = weights.malloc(MIB, &s).await.unwrap();
        let d = alloc.malloc(3 * MIB, &s).await.unwrap();
        assert!(holds(&alloc, &s, &w, 9));
        drop((w2, d));
        // A buffer dropped while asleep is freed like any other.
        let dropped = bufs.pop().unwrap();
        drop(dropped);

        kv.wake().await.unwrap();
        assert_eq!(kv.state(D0).await.unwrap(), PoolState::Awake);
        assert_eq!(kv.usage(D0).await.unwrap().reserved.all().current, reserved);
        let after = alloc.host().stats().await.unwrap().allocated_bytes.current;
        assert_eq!(
            after, host,
            "[{conf}] the host copy went back to the pinned pool"
        );
        for (i, b) in bufs.iter().enumerate() {
            assert_eq!(b.ptr().0, addrs[i]);
            assert!(holds(&alloc, &s, b, i as u8), "[{conf}] buffer {i} changed");
        }
        assert!(holds(&alloc, &s, &w, 9));
        let again = kv.malloc(size_of(999), &s).await.unwrap();
        assert_eq!(
            again.ptr().0,
            addrs[999],
            "[{conf}] the freed block is served again"
        );
        drop((bufs, again, w));
        alloc.shutdown().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sleep_needs_expandable_segments() {
    let alloc = build(sim(1 << 30), "expandable_segments:False");
    let s = alloc.new_stream(D0).unwrap();
    let kv = alloc.pool("kv", PoolOptions::default()).await.unwrap();
    let _b = kv.malloc(MIB, &s).await.unwrap();
    let err = kv.sleep(SleepMode::Offload).await.unwrap_err();
    assert!(
        matches!(err, Error::Alloc(AllocError::NotSupported(_))),
        "{err:?}"
    );
    assert!(
        err.to_string().contains("expandable_segments:True"),
        "{err}"
    );
    assert_eq!(kv.state(D0).await.unwrap(), PoolState::Awake);
    kv.wake().await.unwrap();
}

/// On a 256 MiB device under `conf`: a pool `kv` whose 100 MiB buffer holds the pattern of
/// `salt`, put to sleep with its data offloaded.
async fn asleep_with_100_mib(
    conf: &str,
    salt: u8,
) -> (Allocator, Stream, gpualloc::Pool, DeviceBuffer) {
    let alloc = build(sim(256 * MIB), conf);
    let s = alloc.new_stream(D0).unwrap();
    let kv = alloc.pool("kv", PoolOptions::default()).await.unwrap();
    let b = kv.malloc(100 * MIB, &s).await.unwrap();
    write(&alloc, &s, &b, salt);
    kv.sleep(SleepMode::Offload).await.unwrap();
    (alloc, s, kv, b)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wake_without_memory_keeps_the_pool_asleep_with_its_data() {
    let (alloc, s, kv, b) = asleep_with_100_mib("expandable_segments:True", 3).await;
    let hog = alloc.malloc(200 * MIB, &s).await.unwrap();
    let free = free_bytes(&alloc);
    match kv.wake().await {
        Err(Error::Alloc(AllocError::WakeOutOfMemory {
            pool,
            needed,
            free: f,
        })) => {
            assert_eq!(pool, "kv");
            assert!(needed >= 100 * MIB && f < needed, "{needed} {f}");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(kv.state(D0).await.unwrap(), PoolState::Asleep);
    assert_eq!(free_bytes(&alloc), free, "nothing half-mapped");
    drop(hog);
    alloc.empty_cache().await.unwrap();
    kv.wake().await.unwrap();
    assert!(holds(&alloc, &s, &b, 3));
    drop(b);
    alloc.shutdown().await.unwrap();
}

/// Memory the allocator holds in its cache does not keep a pool asleep: a wake short of
/// memory gives the cache back to the device (as a malloc's out-of-memory path does) and
/// tries again. 200 MiB freed to the cache on a 256 MiB device, then a wake of 100 MiB: by
/// the device's memory, and by the `per_process_memory_fraction` cap (230 MiB). Failed
/// before the fix with `WakeOutOfMemory` in both configs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wake_gives_the_cache_back_before_it_gives_up() {
    for conf in [
        "expandable_segments:True",
        "expandable_segments:True,per_process_memory_fraction:0.9",
    ] {
        let (alloc, s, kv, b) = asleep_with_100_mib(conf, 5).await;
        drop(alloc.malloc(200 * MIB, &s).await.unwrap());
        let cached = alloc.stats(D0).await.unwrap().reserved_bytes[0].current;
        assert!(cached >= 200 * MIB, "{conf}: {cached}");
        kv.wake().await.unwrap_or_else(|e| panic!("{conf}: {e}"));
        assert_eq!(kv.state(D0).await.unwrap(), PoolState::Awake, "{conf}");
        assert!(holds(&alloc, &s, &b, 5), "{conf}");
        let reserved = alloc.stats(D0).await.unwrap().reserved_bytes[0].current;
        assert!(
            reserved < 200 * MIB,
            "{conf}: the cache went back: {reserved}"
        );
        drop(b);
        alloc.shutdown().await.unwrap();
    }
}

/// A pool with a buffer exported to another process does not sleep: the importer maps the
/// pool's physical pages, which a sleep would release and a wake replace, so the two
/// processes would each see different memory at the same buffer afterwards. Failed before
/// the fix: the sleep went ahead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_with_an_exported_buffer_does_not_sleep() {
    let alloc = build(sim(256 * MIB), "expandable_segments:True");
    let s = alloc.new_stream(D0).unwrap();
    let kv = alloc.pool("kv", PoolOptions::default()).await.unwrap();
    let kept = kv.malloc(3 * MIB, &s).await.unwrap();
    let shared = kv.malloc(5 * MIB, &s).await.unwrap();
    alloc.export_region(&shared).await.unwrap();
    match kv.sleep(SleepMode::Offload).await {
        Err(Error::Alloc(AllocError::PoolExported { pool, buffers })) => {
            assert_eq!((pool.as_str(), buffers), ("kv", 1));
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(kv.state(D0).await.unwrap(), PoolState::Awake);
    // A region described but never sent can be unmarked: the pool sleeps and wakes again,
    // and the buffer's bytes are its own; marked again, the pool is refused sleep again.
    assert!(alloc.unexport_region(&shared).await.unwrap());
    assert!(!alloc.unexport_region(&shared).await.unwrap(), "twice");
    kv.sleep(SleepMode::Offload).await.unwrap();
    kv.wake().await.unwrap();
    alloc.export_region(&shared).await.unwrap();
    assert!(matches!(
        kv.sleep(SleepMode::Offload).await,
        Err(Error::Alloc(AllocError::PoolExported { .. }))
    ));
    // Once the exported buffer is freed (its importer let go), the pool sleeps; a block
    // reused at the same address is not exported.
    let at = shared.ptr();
    drop(shared);
    let again = kv.malloc(5 * MIB, &s).await.unwrap();
    assert_eq!(again.ptr(), at);
    kv.sleep(SleepMode::Offload).await.unwrap();
    kv.wake().await.unwrap();
    drop((kept, again));
    alloc.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_malloc_resumes_when_the_pool_wakes() {
    let alloc = build(sim(1 << 30), "expandable_segments:True");
    let s = alloc.new_stream(D0).unwrap();
    let kv = alloc.pool("kv", PoolOptions::default()).await.unwrap();
    let b = kv.malloc(8 * MIB, &s).await.unwrap();
    kv.sleep(SleepMode::Discard).await.unwrap();
    let (kv2, s2) = (kv.clone(), s.clone());
    let waiting = tokio::spawn(async move {
        kv2.malloc_with(MIB, &s2, MallocOptions::wait_for(Duration::from_secs(10)))
            .await
    });
    common::until_waiting(&alloc, 1).await;
    kv.wake().await.unwrap();
    let got = tokio::time::timeout(Duration::from_secs(5), waiting)
        .await
        .expect("woken by the wake")
        .unwrap()
        .unwrap();
    assert_eq!(kv.usage(D0).await.unwrap().allocated.all().current, 9 * MIB);
    drop((b, got));
    // Without waiting long enough it fails with the typed error.
    kv.sleep(SleepMode::Discard).await.unwrap();
    let err = kv
        .malloc_with(MIB, &s, MallocOptions::wait_for(Duration::from_millis(20)))
        .await
        .unwrap_err();
    assert!(
        matches!(err, Error::Alloc(AllocError::PoolAsleep { .. })),
        "{err:?}"
    );
    alloc.shutdown().await.unwrap();
}

/// Sleep and wake futures dropped at awkward moments: whatever began finishes, so the pool
/// ends asleep or awake, never in between, and its data survives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_sleep_and_wake_futures_leave_a_consistent_pool() {
    let alloc = build(sim(1 << 30), "expandable_segments:True");
    let s = alloc.new_stream(D0).unwrap();
    let kv = alloc.pool("kv", PoolOptions::default()).await.unwrap();
    let bufs: Vec<DeviceBuffer> = {
        let mut v = Vec::new();
        for i in 0..50u64 {
            let b = kv.malloc(size_of(i * 3), &s).await.unwrap();
            write(&alloc, &s, &b, i as u8);
            v.push(b);
        }
        v
    };
    let settled = |kv: gpualloc::Pool| async move {
        loop {
            match kv.state(D0).await.unwrap() {
                PoolState::FallingAsleep | PoolState::Waking => {
                    tokio::time::sleep(Duration::from_millis(1)).await
                }
                state => return state,
            }
        }
    };
    for round in 0..6u64 {
        let cut = Duration::from_micros(round * 300);
        let _ = tokio::time::timeout(cut, kv.sleep(SleepMode::Offload)).await;
        let state = settled(kv.clone()).await;
        assert!(
            matches!(state, PoolState::Asleep | PoolState::Awake),
            "{state}"
        );
        let _ = tokio::time::timeout(cut, kv.wake()).await;
        settled(kv.clone()).await;
        kv.wake().await.unwrap();
        assert_eq!(kv.state(D0).await.unwrap(), PoolState::Awake);
        for (i, b) in bufs.iter().enumerate() {
            assert!(holds(&alloc, &s, b, i as u8), "round {round}: buffer {i}");
        }
    }
    drop(bufs);
    alloc.shutdown().await.unwrap();
}

/// Polls `fut` once and drops it, without yielding to the runtime in between.
async fn poll_once_then_drop<F: std::future::Future>(fut: F) {
    let mut fut = std::pin::pin!(fut);
    std::future::poll_fn(|cx| {
        let _ = fut.as_mut().poll(cx);
        std::task::Poll::Ready(())
    })
    .await;
}

/// A sleep or wake future dropped before its work began does nothing, ever: its task was
/// spawned at the first poll, but the pool stays as it was. (Before, the task began later,
/// at any time: the pool fell asleep under a user who had dropped the sleep and seen the
/// pool awake, and reads of its buffers failed, as `dropped_sleep_and_wake_futures_...`
/// did once in a loaded run.)
#[tokio::test(flavor = "current_thread")]
async fn a_sleep_or_wake_dropped_before_it_began_never_happens() {
    let alloc = build(sim(1 << 30), "expandable_segments:True");
    let s = alloc.new_stream(D0).unwrap();
    let kv = alloc.pool("kv", PoolOptions::default()).await.unwrap();
    let b = kv.malloc(3 * MIB, &s).await.unwrap();
    write(&alloc, &s, &b, 7);
    for _ in 0..3 {
        // Polled once (the task is spawned), then dropped before the task runs.
        poll_once_then_drop(kv.sleep(SleepMode::Offload)).await;
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(kv.state(D0).await.unwrap(), PoolState::Awake);
        assert!(holds(&alloc, &s, &b, 7));
    }
    kv.sleep(SleepMode::Offload).await.unwrap();
    for _ in 0..3 {
        poll_once_then_drop(kv.wake()).await;
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(kv.state(D0).await.unwrap(), PoolState::Asleep);
    }
    kv.wake().await.unwrap();
    assert!(holds(&alloc, &s, &b, 7));
    drop(b);
    alloc.shutdown().await.unwrap();
}

/// Hits of another pool keep flowing while a pool of 256 MiB sleeps and wakes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_pools_serve_during_a_sleep_and_a_wake() {
    let alloc = build(sim(2 << 30), "expandable_segments:True");
    let s = alloc.new_stream(D0).unwrap();
    let big = alloc.pool("weights", PoolOptions::default()).await.unwrap();
    let kv = alloc.pool("kv", PoolOptions::default()).await.unwrap();
    let mut held = Vec::new();
    for _ in 0..8 {
        held.push(big.malloc(32 * MIB, &s).await.unwrap());
    }
    drop(kv.malloc(MIB, &s).await.unwrap());
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (kv2, s2, stop2) = (kv.clone(), s.clone(), stop.clone());
    let hits = tokio::spawn(async move {
        let mut n = 0u64;
        while !stop2.load(std::sync::atomic::Ordering::Relaxed) {
            drop(kv2.malloc(MIB, &s2).await.unwrap());
            n += 1;
            tokio::task::yield_now().await;
        }
        n
    });
    big.sleep(SleepMode::Offload).await.unwrap();
    big.wake().await.unwrap();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let n = hits.await.unwrap();
    assert!(n > 0, "no hit served during the sleep and wake");
    assert_eq!(kv.usage(D0).await.unwrap().reserved.all().current, 2 * MIB);
    drop(held);
    alloc.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_dropped_while_asleep_and_shutdown_release_everything() {
    let backend = sim(1 << 30);
    let alloc = build(backend.clone(), "expandable_segments:True");
    let s = alloc.new_stream(D0).unwrap();
    let kv = alloc.pool("kv", PoolOptions::default()).await.unwrap();
    let b = kv.malloc(30 * MIB, &s).await.unwrap();
    kv.sleep(SleepMode::Offload).await.unwrap();
    drop(kv);
    drop(b);
    alloc.empty_cache().await.unwrap();
    alloc.shutdown().await.unwrap();
    assert_eq!(backend.used_bytes(D0).unwrap(), 0);
}

/// Runs a sleep and then a wake of a pool holding `n` written buffers, `fault` (given how
/// many copies to let through) injected into the copies of each: both fail with an error
/// naming `says`, and each is rolled back (a sleep: the pool awake, its memory mapped, its
/// bytes intact; a wake: the pool asleep with its host copy, its pages released again). The
/// next sleep and wake then work and bring the bytes back; each call is bounded in time.
async fn a_fault_in_a_copy_rolls_back(
    conf: &str,
    n: u64,
    fault: impl Fn(u64) -> gpualloc::runtime::sim::Fault,
    skips: (u64, u64),
    says: &str,
) {
    use gpualloc::runtime::sim::Op;
    const WITHIN: Duration = Duration::from_secs(10);
    let backend = sim(1 << 30);
    let alloc = build(backend.clone(), conf);
    let s = alloc.new_stream(D0).unwrap();
    let kv = alloc.pool("kv", PoolOptions::default()).await.unwrap();
    let mut bufs = Vec::new();
    for i in 0..n {
        let b = kv.malloc(size_of(i * 7), &s).await.unwrap();
        write(&alloc, &s, &b, i as u8);
        bufs.push(b);
    }
    let all_hold = |when: &str| {
        for (i, b) in bufs.iter().enumerate() {
            assert!(holds(&alloc, &s, b, i as u8), "[{conf}] {when}: buffer {i}");
        }
    };
    let reserved = kv.usage(D0).await.unwrap().reserved.all().current;

    backend.inject(Op::MemcpyAsync, fault(skips.0));
    let err = tokio::time::timeout(WITHIN, kv.sleep(SleepMode::Offload))
        .await
        .unwrap()
        .unwrap_err();
    assert!(err.to_string().contains(says), "[{conf}] {err}");
    backend.clear_faults();
    assert_eq!(kv.state(D0).await.unwrap(), PoolState::Awake);
    assert_eq!(kv.usage(D0).await.unwrap().reserved.all().current, reserved);
    all_hold("sleep rolled back");

    tokio::time::timeout(WITHIN, kv.sleep(SleepMode::Offload))
        .await
        .unwrap()
        .unwrap();
    let free = free_bytes(&alloc);
    backend.inject(Op::MemcpyAsync, fault(skips.1));
    let err = tokio::time::timeout(WITHIN, kv.wake())
        .await
        .unwrap()
        .unwrap_err();
    assert!(err.to_string().contains(says), "[{conf}] {err}");
    backend.clear_faults();
    assert_eq!(kv.state(D0).await.unwrap(), PoolState::Asleep);
    assert_eq!(
        free_bytes(&alloc),
        free,
        "[{conf}] the wake's pages released again"
    );
    tokio::time::timeout(WITHIN, kv.wake())
        .await
        .unwrap()
        .unwrap();
    all_hold("after the second wake");
    drop(bufs);
    alloc.shutdown().await.unwrap();
}

/// A copy that fails in the middle of a sleep or of a wake rolls it back
/// (`a_fault_in_a_copy_rolls_back`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_copy_rolls_a_sleep_or_a_wake_back() {
    let fail = |skip| gpualloc::runtime::sim::Fault::FailNext {
        skip,
        count: 1,
        error: gpualloc::BackendError::invalid("injected copy failure"),
    };
    a_fault_in_a_copy_rolls_back("expandable_segments:True", 6, fail, (2, 3), "injected").await;
}

/// A backend that panics in the middle of a sleep's or a wake's copies (a custom backend's
/// bug) rolls it back as a failed copy does (before, the pool stayed busy and the next sleep
/// retried forever).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_panicking_in_a_copy_rolls_a_sleep_or_a_wake_back() {
    let panic = |skip| gpualloc::runtime::sim::Fault::PanicNext { skip };
    a_fault_in_a_copy_rolls_back("", 4, panic, (1, 1), "panicked").await;
}

/// A pool's request whose miss is still mapping its new pages when the pool's sleep begins
/// (another task's call): the sleep must not leave those pages mapped in the sleeping pool.
/// Either the request fails (the pool is asleep) and its pages go back, or its buffer sleeps
/// with the rest; the asleep pool holds no reserved memory, and its wake fits the device as
/// before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_miss_in_flight_when_its_pool_sleeps_leaves_no_pages_mapped_in_it() {
    use gpualloc::runtime::sim::LatencyModel;
    for (conf, cancel) in CONFIGS.iter().flat_map(|c| [(*c, false), (*c, true)]) {
        let sim = common::sim_with(1 << 30, LatencyModel::zero());
        let alloc = build(sim.clone(), conf);
        let actor = alloc.device_actor(D0).unwrap().clone();
        let s = alloc.new_stream(D0).unwrap();
        let pool = alloc.pool("p", PoolOptions::default()).await.unwrap();
        let kept = pool.malloc(4 * MIB, &s).await.unwrap();
        write(&alloc, &s, &kept, 3);
        // Slow maps: the next growth is in flight for a while.
        sim.set_latency(LatencyModel {
            map: Duration::from_millis(100),
            ..LatencyModel::zero()
        });
        let request = {
            let (pool, s) = (pool.clone(), s.clone());
            tokio::spawn(async move { pool.malloc(8 * MIB, &s).await })
        };
        assert_eq!(
            wait_in_flight(&actor, 2000, |n| n == 1).await,
            1,
            "[{conf}]"
        );
        if cancel {
            request.abort();
        }
        pool.sleep(SleepMode::Offload).await.unwrap();
        // `None`: cancelled.
        let landed = match request.await {
            Ok(r) => Some(r),
            Err(e) => {
                assert!(e.is_cancelled(), "[{conf}]");
                None
            }
        };
        assert_eq!(
            wait_in_flight(&actor, 2000, |n| n == 0).await,
            0,
            "[{conf}]"
        );
        sim.set_latency(LatencyModel::zero());
        let usage = pool.usage(D0).await.unwrap();
        assert_eq!(usage.state, PoolState::Asleep, "[{conf}]");
        assert_eq!(
            usage.reserved.all().current,
            0,
            "[{conf}] cancelled {cancel}: the asleep pool holds pages mapped by a miss that \
             was in flight (request: {:?})",
            landed.as_ref().map(|r| r.as_ref().map(|b| b.len()))
        );
        pool.wake().await.unwrap();
        assert!(holds(&alloc, &s, &kept, 3), "[{conf}]");
        if let Some(Ok(buf)) = landed {
            write(&alloc, &s, &buf, 5);
            assert!(holds(&alloc, &s, &buf, 5), "[{conf}]");
        }
        drop(kept);
        alloc.shutdown().await.unwrap();
    }
}

/// A pool's request whose miss waits off the gate in the out-of-memory chain (here for the
/// event of another stream's pending free) while another task puts the pool to sleep: when
/// the miss goes on, the pool is asleep, and the miss must not map pages into it (they stayed
/// mapped and counted in the sleeping pool, and its wake then needed that much more room).
/// The request fails as a request of an asleep pool does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_miss_that_waited_in_the_oom_chain_does_not_grow_a_pool_that_fell_asleep() {
    use gpualloc::runtime::sim::{KernelMemory, LatencyModel};
    for conf in CONFIGS {
        let sim = common::sim_with(100 * MIB, LatencyModel::zero());
        let alloc = build(sim.clone(), conf);
        let actor = alloc.device_actor(D0).unwrap().clone();
        let (s, other) = (alloc.new_stream(D0).unwrap(), alloc.new_stream(D0).unwrap());
        let pool = alloc.pool("p", PoolOptions::default()).await.unwrap();
        let kept = pool.malloc(4 * MIB, &s).await.unwrap();
        write(&alloc, &s, &kept, 7);
        // 60 MiB of the default pool, used by a 400 ms kernel on another stream, then freed:
        // its free waits for that kernel's event.
        let big = alloc.malloc(60 * MIB, &s).await.unwrap();
        other.wait_event(&s.record_event().unwrap()).unwrap();
        sim.launch_kernel(
            other.handle(),
            Duration::from_millis(400),
            |_: &mut KernelMemory| Ok(()),
        )
        .unwrap();
        alloc.record_stream(&big, &other).unwrap();
        drop(big);
        // 50 MiB more does not fit beside it: the chain waits for the event, off the gate.
        let request = {
            let (pool, s) = (pool.clone(), s.clone());
            tokio::spawn(async move { pool.malloc(50 * MIB, &s).await })
        };
        assert_eq!(
            wait_in_flight(&actor, 2000, |n| n == 1).await,
            1,
            "[{conf}]"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
        pool.sleep(SleepMode::Offload).await.unwrap();
        let landed = request.await.unwrap();
        let usage = pool.usage(D0).await.unwrap();
        assert_eq!(usage.state, PoolState::Asleep, "[{conf}]");
        assert_eq!(
            usage.reserved.all().current,
            0,
            "[{conf}]: pages mapped into the pool after it fell asleep (request: {:?})",
            landed.as_ref().map(|b| b.len())
        );
        assert!(
            matches!(landed, Err(Error::Alloc(AllocError::PoolAsleep { .. }))),
            "[{conf}]: {:?}",
            landed.map(|b| b.len())
        );
        pool.wake().await.unwrap();
        assert!(holds(&alloc, &s, &kept, 7), "[{conf}]");
        drop(kept);
        alloc.shutdown().await.unwrap();
    }
}
