//! The allocator's public behaviour on the backend `GPUALLOC_BACKEND` names: `cuda` on the
//! GPU run of scripts/gpu-check.sh (an error, not a skip, if CUDA is unavailable then), the
//! simulated GPU when unset or `sim`. Only what holds on every backend with real memory:
//! data survives, concurrent buffers never overlap, hits reuse blocks, out of memory is
//! typed, expandable segments grow and give memory back, named pools keep their memory apart,
//! empty_cache and shutdown return everything.
//!
//! `GPUALLOC_TEST_DEVICE=N` runs them on device N (default 0; the sim then has N + 1 devices):
//! CI runs them on device 3 of 4 emulated GPUs too, and scripts/gpu-check.sh on every GPU.

use gpualloc::runtime::sim::{SimBackend, SimConfig};
use gpualloc::{Allocator, AllocatorConfig, BackendKind, DeviceBuffer, DeviceId, Stream};

/// On CUDA every test of this binary shares the device: a test that reads the device's free
/// memory holds this for writing, every other test for reading.
static DEVICE: tokio::sync::RwLock<()> = tokio::sync::RwLock::const_new(());

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
/// The device under test (`GPUALLOC_TEST_DEVICE`, default 0).
fn dev() -> DeviceId {
    DeviceId(std::env::var("GPUALLOC_TEST_DEVICE").map_or(0, |d| {
        d.parse()
            .unwrap_or_else(|_| panic!("GPUALLOC_TEST_DEVICE={d}: not a device ordinal"))
    }))
}

/// The allocator on the backend the environment names (the fast sim by default).
fn alloc_from_env(config: AllocatorConfig) -> Allocator {
    let kind = BackendKind::from_env().expect("GPUALLOC_BACKEND");
    let builder = Allocator::builder().config(config);
    let builder = match kind {
        BackendKind::Cuda => builder.backend(BackendKind::Cuda),
        _ => builder.backend_instance(SimBackend::new(SimConfig::fast(dev().0 + 1)).expect("sim")),
    };
    let alloc = builder
        .build()
        .unwrap_or_else(|e| panic!("GPUALLOC_BACKEND={kind:?}: cannot build the allocator: {e}"));
    println!("backend: {}", alloc.backend().name());
    alloc
}

fn pattern(len: u64, seed: u64) -> Vec<u8> {
    (0..len)
        .map(|i| ((i.wrapping_mul(31) ^ seed.wrapping_mul(2654435761)) % 251) as u8)
        .collect()
}

/// A cheap per-buffer fill (debug builds generate patterns slowly): one byte per seed.
fn fill(len: u64, seed: u64) -> Vec<u8> {
    vec![(seed % 251) as u8 + 1; len as usize]
}

fn write(alloc: &Allocator, s: &Stream, buf: &DeviceBuffer, data: &[u8]) {
    alloc
        .backend()
        .copy_to_device(s.handle(), buf.ptr(), data)
        .expect("copy to device");
}

fn read(alloc: &Allocator, s: &Stream, buf: &DeviceBuffer) -> Vec<u8> {
    let mut v = vec![0u8; buf.len() as usize];
    alloc
        .backend()
        .copy_from_device(s.handle(), &mut v, buf.ptr())
        .expect("copy from device");
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hits_reuse_blocks_and_data_survives() {
    let _device = DEVICE.read().await;
    let alloc = alloc_from_env(AllocatorConfig::default());
    let s = alloc.new_stream(dev()).unwrap();
    let a = alloc.malloc(3000, &s).await.unwrap();
    write(&alloc, &s, &a, &pattern(3000, 1));
    assert_eq!(read(&alloc, &s, &a), pattern(3000, 1));
    let p = a.ptr();
    drop(a);
    let b = alloc.malloc(3000, &s).await.unwrap();
    assert_eq!(b.ptr(), p, "a hit reuses the cached block");
    let st = alloc.stats(dev()).await.unwrap();
    assert_eq!(st.allocated_bytes[0].current, 3072);
    assert_eq!(st.reserved_bytes[0].current, 2 * MIB);
    assert_eq!(st.num_device_alloc, 1);
    drop(b);
    alloc.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_buffers_never_overlap() {
    let _device = DEVICE.read().await;
    let alloc = alloc_from_env(AllocatorConfig::default());
    let tasks: Vec<_> = (0..8u64)
        .map(|t| {
            let alloc = alloc.clone();
            tokio::spawn(async move {
                let s = alloc.new_stream(dev()).unwrap();
                let mut kept: Vec<(DeviceBuffer, u64)> = Vec::new();
                for i in 0..40u64 {
                    let size = [KIB, 7 * KIB, 300 * KIB, MIB + 5, 3 * MIB][(i % 5) as usize];
                    let seed = t * 1000 + i;
                    let buf = alloc.malloc(size, &s).await.unwrap();
                    write(&alloc, &s, &buf, &fill(size, seed));
                    kept.push((buf, seed));
                    if kept.len() > 6 {
                        let (old, seed) = kept.remove((i % 3) as usize);
                        assert_eq!(read(&alloc, &s, &old), fill(old.len(), seed));
                    }
                    tokio::task::yield_now().await;
                }
                for (buf, seed) in &kept {
                    assert_eq!(read(&alloc, &s, buf), fill(buf.len(), *seed));
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    let st = alloc.stats(dev()).await.unwrap();
    assert_eq!(st.allocation[0].current, 0, "every buffer came back");
    alloc.empty_cache().await.unwrap();
    assert_eq!(
        alloc.stats(dev()).await.unwrap().reserved_bytes[0].current,
        0
    );
    alloc.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_memory_is_a_typed_error() {
    let _device = DEVICE.read().await;
    let alloc = alloc_from_env(AllocatorConfig::default());
    let s = alloc.new_stream(dev()).unwrap();
    let keep = alloc.malloc(MIB, &s).await.unwrap();
    let err = alloc.malloc(1 << 50, &s).await.unwrap_err();
    assert!(err.is_oom(), "{err}");
    // The allocator is still fine afterwards.
    let again = alloc.malloc(MIB, &s).await.unwrap();
    assert_ne!(again.ptr(), keep.ptr());
    drop((keep, again));
    alloc.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expandable_segments_grow_and_give_memory_back() {
    let _device = DEVICE.read().await;
    let alloc = alloc_from_env(AllocatorConfig::default().with_expandable_segments(true));
    let s = alloc.new_stream(dev()).unwrap();
    let mut bufs = Vec::new();
    for i in 0..4u64 {
        let size = 5 * MIB + i * 333;
        let b = alloc.malloc(size, &s).await.unwrap();
        write(&alloc, &s, &b, &pattern(size, 40 + i));
        bufs.push((b, 40 + i));
    }
    for (b, seed) in &bufs {
        assert_eq!(read(&alloc, &s, b), pattern(b.len(), *seed));
    }
    let reserved = alloc.stats(dev()).await.unwrap().reserved_bytes[0].current;
    assert!(reserved >= 20 * MIB, "{reserved}");
    drop(bufs);
    alloc.empty_cache().await.unwrap();
    assert_eq!(
        alloc.stats(dev()).await.unwrap().reserved_bytes[0].current,
        0
    );
    alloc.shutdown().await.unwrap();
}

/// Named pools (with and without expandable segments): data survives, a pool's freed block
/// never serves the default pools or another pool, the quota is a typed error, and a dropped
/// pool's memory goes back on empty_cache.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pools_keep_their_memory_apart() {
    let _device = DEVICE.read().await;
    use gpualloc::{AllocError, Error, PoolOptions};
    for expandable in [false, true] {
        let alloc = alloc_from_env(AllocatorConfig::default().with_expandable_segments(expandable));
        let s = alloc.new_stream(dev()).unwrap();
        let kv = alloc
            .pool(
                "kv_cache",
                PoolOptions {
                    quota: Some(40 * MIB),
                    use_on_oom: false,
                    unsplit: None,
                },
            )
            .await
            .unwrap();
        let weights = alloc.pool("weights", PoolOptions::default()).await.unwrap();
        let w = weights.malloc(6 * MIB + 77, &s).await.unwrap();
        write(&alloc, &s, &w, &pattern(w.len(), 7));
        let k = kv.malloc(6 * MIB + 77, &s).await.unwrap();
        write(&alloc, &s, &k, &pattern(k.len(), 8));
        let at = k.ptr();
        drop(k);
        let d = alloc.malloc(6 * MIB + 77, &s).await.unwrap();
        let w2 = weights.malloc(6 * MIB + 77, &s).await.unwrap();
        assert!(d.ptr() != at && w2.ptr() != at, "expandable {expandable}");
        let k = kv.malloc(6 * MIB + 77, &s).await.unwrap();
        assert_eq!(k.ptr(), at);
        assert_eq!(read(&alloc, &s, &w), pattern(w.len(), 7));
        let big = kv.malloc(36 * MIB, &s).await.unwrap_err();
        assert!(
            matches!(big, Error::Alloc(AllocError::PoolQuota { .. })),
            "expandable {expandable}: {big}"
        );
        drop((w, w2, d, k));
        drop((kv, weights));
        alloc.empty_cache().await.unwrap();
        assert_eq!(
            alloc.stats(dev()).await.unwrap().reserved_bytes[0].current,
            0,
            "expandable {expandable}"
        );
        alloc.shutdown().await.unwrap();
    }
}

/// A pool sleeps and wakes: its memory goes back to the device while it
/// sleeps and its data is back at the same addresses after the wake, on this backend's
/// virtual memory (the CUDA driver's `cuMemUnmap` / `cuMemMap` under the emulator).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_sleeps_and_wakes_at_the_same_addresses() {
    // Reads the device's free memory: no other test may use the device meanwhile.
    let _device = DEVICE.write().await;
    use gpualloc::{PoolOptions, PoolState, SleepMode};
    let alloc = alloc_from_env(AllocatorConfig::default().with_expandable_segments(true));
    let s = alloc.new_stream(dev()).unwrap();
    let kv = alloc
        .pool("kv_cache", PoolOptions::default())
        .await
        .unwrap();
    let bufs: Vec<DeviceBuffer> = {
        let mut v = Vec::new();
        for i in 0..40u64 {
            let b = kv.malloc((i % 7) * MIB + i * 1000 + 1, &s).await.unwrap();
            write(&alloc, &s, &b, &pattern(b.len(), i));
            v.push(b);
        }
        v
    };
    let addrs: Vec<_> = bufs.iter().map(DeviceBuffer::ptr).collect();
    let reserved = kv.usage(dev()).await.unwrap().reserved.all().current;
    let free = alloc.backend().mem_info(dev()).unwrap().free;
    kv.sleep(SleepMode::Offload).await.unwrap();
    assert_eq!(kv.state(dev()).await.unwrap(), PoolState::Asleep);
    assert!(alloc.backend().mem_info(dev()).unwrap().free >= free + reserved);
    kv.wake().await.unwrap();
    for (i, b) in bufs.iter().enumerate() {
        assert_eq!(b.ptr(), addrs[i]);
        assert_eq!(
            read(&alloc, &s, b),
            pattern(b.len(), i as u64),
            "buffer {i}"
        );
    }
    drop(bufs);
    alloc.shutdown().await.unwrap();
}

/// A pool of unsplit blocks: each buffer a range of its own, aligned to
/// the pool's granularity, announced to a segment watcher with the buffer's address and size,
/// and its data intact, on this backend's virtual memory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unsplit_pool_ranges_are_aligned_and_announced() {
    let _device = DEVICE.read().await;
    use gpualloc::{PoolOptions, SegmentAction};
    let g = 8 * MIB;
    let alloc = alloc_from_env(AllocatorConfig::default().with_expandable_segments(true));
    let s = alloc.new_stream(dev()).unwrap();
    let nvls = alloc
        .pool(
            "nvls",
            PoolOptions {
                unsplit: Some(g),
                ..PoolOptions::default()
            },
        )
        .await
        .unwrap();
    let mut watch = alloc.watch_segments(dev()).await.unwrap();
    let mut bufs = Vec::new();
    for (i, size) in [1000, 3 * MIB, g, g + 1].into_iter().enumerate() {
        let b = nvls.malloc(size, &s).await.unwrap();
        assert_eq!(b.ptr().0 % g, 0, "{size}");
        write(&alloc, &s, &b, &pattern(b.len(), i as u64));
        bufs.push(b);
    }
    for (i, b) in bufs.iter().enumerate() {
        assert_eq!(read(&alloc, &s, b), pattern(b.len(), i as u64));
        let e = watch.events.try_recv().unwrap();
        assert_eq!(e.action, SegmentAction::Map);
        assert_eq!((e.addr, e.size), (b.ptr().0, b.len().div_ceil(g) * g));
    }
    drop(bufs);
    alloc.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_with_live_buffers_returns_everything() {
    let _device = DEVICE.read().await;
    let alloc = alloc_from_env(AllocatorConfig::default());
    let s = alloc.new_stream(dev()).unwrap();
    let bufs: Vec<DeviceBuffer> = futures::future::join_all((1..=16).map(|i| {
        let (alloc, s) = (alloc.clone(), s.clone());
        async move { alloc.malloc(i * 100 * KIB, &s).await.unwrap() }
    }))
    .await;
    assert!(alloc.stats(dev()).await.unwrap().reserved_bytes[0].current > 0);
    alloc.shutdown().await.unwrap();
    let err = alloc.malloc(10, &s).await.unwrap_err();
    assert!(err.is_shutdown(), "{err}");
    std::thread::spawn(move || drop(bufs)).join().unwrap();
    assert!(alloc.shutdown().await.is_ok(), "idempotent");
}

/// Segment registration (what the NCCL adapter is built on) on this
/// backend's unmap and free: a fake registrar follows a pool's ranges, and a second release
/// hook finds no registration left on memory at the moment it is unmapped or freed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registrations_are_dropped_before_the_backend_releases_their_memory() {
    let _device = DEVICE.read().await;
    use gpualloc::runtime::release_hooks::{Release, ReleaseHook};
    use gpualloc::{PoolOptions, SegmentRegistrar, SleepMode};
    use std::collections::BTreeMap;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::{Arc, Mutex};

    type Books = Arc<Mutex<BTreeMap<u64, u64>>>;
    struct Fake(Books);
    impl SegmentRegistrar for Fake {
        type Handle = ();
        fn register(&mut self, addr: u64, size: u64) -> Result<(), String> {
            self.0.lock().unwrap().insert(addr, size);
            Ok(())
        }
        fn deregister(&mut self, addr: u64, _: u64, _: ()) -> Result<(), String> {
            self.0
                .lock()
                .unwrap()
                .remove(&addr)
                .map(|_| ())
                .ok_or("unknown".into())
        }
    }
    struct Checker(Books, AtomicU64, AtomicU64);
    impl ReleaseHook for Checker {
        fn before_release(&self, r: Release) {
            self.1.fetch_add(1, Ordering::SeqCst);
            if self
                .0
                .lock()
                .unwrap()
                .iter()
                .any(|(&a, &s)| r.touches(a, s))
            {
                self.2.fetch_add(1, Ordering::SeqCst);
            }
        }
    }

    for expandable in [true, false] {
        let alloc = alloc_from_env(AllocatorConfig::default().with_expandable_segments(expandable));
        let s = alloc.new_stream(dev()).unwrap();
        let pool = alloc.pool("comm", PoolOptions::default()).await.unwrap();
        let books = Books::default();
        let reg = alloc
            .register_segments(dev(), Some(&pool), Fake(books.clone()))
            .await
            .unwrap();
        let checker = Arc::new(Checker(books.clone(), AtomicU64::new(0), AtomicU64::new(0)));
        let hooks = alloc.backend().release_hooks().expect("release hooks");
        let id = hooks.add(checker.clone());
        let mut bufs = Vec::new();
        for i in 0..12u64 {
            bufs.push(pool.malloc((i % 5) * 3 * MIB + 1, &s).await.unwrap());
        }
        let reserved = pool.usage(dev()).await.unwrap().reserved.all().current;
        for _ in 0..1000 {
            if reg.stats().live_bytes == reserved {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        assert_eq!(reg.stats().live_bytes, reserved, "expandable={expandable}");
        if expandable {
            pool.sleep(SleepMode::Discard).await.unwrap();
            assert!(books.lock().unwrap().is_empty());
            pool.wake().await.unwrap();
        }
        drop((bufs, pool));
        alloc.empty_cache().await.unwrap();
        assert!(books.lock().unwrap().is_empty(), "expandable={expandable}");
        assert!(checker.1.load(Ordering::SeqCst) > 0);
        assert_eq!(
            checker.2.load(Ordering::SeqCst),
            0,
            "expandable={expandable}"
        );
        let st = reg.close();
        assert_eq!((st.live, st.failures), (0, 0), "{st:?}");
        assert!(hooks.remove(id));
        alloc.shutdown().await.unwrap();
    }
}
