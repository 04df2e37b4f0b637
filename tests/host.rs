//! The pinned-host allocator through the facade, on the simulated GPU with real memory:
//! a pinned buffer freed while a copy still reads it is not handed out again (checked by
//! data), copies both ways, the `pinned_*` config keys, bad input, PyTorch's host stats keys,
//! the background reaper, and drops after shutdown on a plain thread.

use std::sync::Arc;
use std::time::Duration;

use gpualloc::host::config::ConfigError as HostConfigError;
use gpualloc::runtime::sim::{Op, SimBackend, SimConfig};
use gpualloc::{Allocator, DeviceBuffer, DeviceId, Error, HostError, Stream};

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;

fn sim() -> Arc<SimBackend> {
    SimBackend::new(SimConfig::fast(1)).expect("sim")
}

/// A sim whose every pinned host allocation costs `cost` (nothing else costs time).
fn sim_with_slow_host_alloc(cost: Duration) -> Arc<SimBackend> {
    let latency = gpualloc::runtime::sim::LatencyModel {
        host_alloc_base: cost,
        ..gpualloc::runtime::sim::LatencyModel::zero()
    };
    SimBackend::new(SimConfig {
        latency,
        ..SimConfig::fast(1)
    })
    .expect("sim")
}

fn build(sim: &Arc<SimBackend>, conf: &str) -> Allocator {
    Allocator::builder()
        .config_str(conf)
        .backend_instance(sim.clone())
        .reaper_interval(Duration::from_millis(1))
        .build()
        .expect("build")
}

/// The bytes of a device buffer, read after the stream's work.
fn device_bytes(sim: &SimBackend, stream: &Stream, buf: &DeviceBuffer) -> Vec<u8> {
    let mut out = vec![0u8; buf.len() as usize];
    gpualloc::Backend::copy_from_device(sim, stream.handle(), &mut out, buf.ptr()).expect("read");
    out
}

/// Delays `stream` by `d` (a kernel that only sleeps).
fn stall(sim: &SimBackend, stream: &Stream, d: Duration) {
    sim.launch_kernel(stream.handle(), d, |_| Ok(()))
        .expect("stall");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pinned_buffer_freed_under_a_copy_is_not_handed_to_another_task() {
    let sim = sim();
    let alloc = build(&sim, "");
    let stream = alloc.new_stream(DeviceId(0)).unwrap();
    let dev = alloc.malloc(64 * KIB, &stream).await.unwrap();

    let mut first = alloc.host().malloc(64 * KIB).await.unwrap();
    first.fill(0xA1);
    let first_ptr = first.ptr();
    // The copy sits behind 150 ms of kernel work, so it reads `first` long after the drop.
    stall(&sim, &stream, Duration::from_millis(150));
    // Dropped unawaited: `first` is freed while the copy still reads it.
    drop(alloc.host().copy_h2d(first, &dev, &stream).unwrap());

    // Another task asks for the same size while the copy is still queued.
    let host = alloc.host();
    let second = tokio::spawn(async move {
        let mut b = host.malloc(64 * KIB).await.unwrap();
        b.fill(0xB2);
        b
    })
    .await
    .unwrap();
    assert_ne!(
        second.ptr(),
        first_ptr,
        "the freed block was handed out under a copy"
    );
    assert_eq!(alloc.host().stats().await.unwrap().allocation.current, 2);

    stream.synchronize().unwrap();
    assert!(
        device_bytes(&sim, &stream, &dev).iter().all(|&b| b == 0xA1),
        "the copy read the other task's pattern"
    );
    assert!(second.iter().all(|&b| b == 0xB2));
    assert_eq!(sim.kernel_failures(), 0);

    // Once the stream passed the free, the block is reused.
    let third = alloc.host().malloc(64 * KIB).await.unwrap();
    assert_eq!(third.ptr(), first_ptr);
    assert_eq!(sim.counts().get(Op::HostAlloc), 2);
    drop((second, third, dev));
    alloc.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copies_round_trip_through_the_device() {
    let sim = sim();
    let alloc = build(&sim, "");
    let host = alloc.host();
    let stream = alloc.new_stream(DeviceId(0)).unwrap();
    let other = alloc.new_stream(DeviceId(0)).unwrap();
    let dev = alloc.malloc(10_000, &stream).await.unwrap();
    let mut src = host.malloc(10_000).await.unwrap();
    for (i, b) in src.iter_mut().enumerate() {
        *b = (i % 251) as u8;
    }
    let mut dst = host.malloc(10_000).await.unwrap();
    dst.fill(0);
    // On a stream the device buffer was not allocated on: recorded on it too.
    let src = host.copy_h2d(src, &dev, &other).unwrap();
    let dst = host.copy_d2h(&dev, dst, &other).unwrap();
    let (src, dst) = (src.finish().await.unwrap(), dst.finish().await.unwrap());
    assert_eq!(&dst[..], &src[..]);
    assert_eq!(dst.len(), 10_000);
    assert_eq!(dst.capacity(), 16 * KIB);
    drop((src, dst, dev));
    alloc.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_typed_errors() {
    let sim = sim();
    let alloc = build(&sim, "");
    let host = alloc.host();
    let empty = host.malloc(0).await.unwrap();
    assert!(empty.is_empty() && empty.ptr().0 == 0 && empty[..].is_empty());
    drop(empty);
    assert_eq!(
        host.malloc(u64::MAX - 100).await.unwrap_err(),
        Error::Host(HostError::TooLarge {
            requested: u64::MAX - 100
        })
    );
    let stream = alloc.new_stream(DeviceId(0)).unwrap();
    let small = alloc.malloc(KIB, &stream).await.unwrap();
    let big = host.malloc(4 * KIB).await.unwrap();
    let refused = host.copy_h2d(big, &small, &stream).unwrap_err();
    assert_eq!(
        refused.error,
        Error::CopyLength {
            src: 4 * KIB,
            dst: KIB
        }
    );
    let big = refused.buffer;
    assert_eq!(big.len(), 4 * KIB, "a refused copy hands its buffer back");
    let pinned = host.malloc(KIB).await.unwrap();
    let big_dev = alloc.malloc(4 * KIB, &stream).await.unwrap();
    let refused = host.copy_d2h(&big_dev, pinned, &stream).unwrap_err();
    assert_eq!(
        refused.error,
        Error::CopyLength {
            src: 4 * KIB,
            dst: KIB
        }
    );
    let pinned = refused.buffer;
    // A stream of another backend.
    let foreign_sim = sim_backend_dyn();
    let foreign = Stream::new(&foreign_sim, DeviceId(0)).unwrap();
    let refused = host.copy_h2d(pinned, &big_dev, &foreign).unwrap_err();
    assert_eq!(refused.error, Error::ForeignStream);
    let pinned = refused.buffer;
    assert_eq!(
        pinned.record_stream(&foreign).unwrap_err(),
        Error::ForeignStream
    );
    assert_eq!(sim.counts().get(Op::MemcpyAsync), 0, "nothing was enqueued");
    drop((small, big, pinned, big_dev));
    alloc.shutdown().await.unwrap();
}

fn sim_backend_dyn() -> Arc<dyn gpualloc::Backend> {
    sim()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pinned_config_keys_apply_and_bad_ones_fail_the_build() {
    let sim = sim();
    let alloc = build(
        &sim,
        "max_split_size_mb:64,pinned_use_cuda_host_register:True,pinned_num_register_threads:2,\
         pinned_max_round_threshold_mb:0",
    );
    let config = alloc.host().config().await.unwrap();
    assert!(config.pinned_use_cuda_host_register);
    assert_eq!(config.pinned_num_register_threads, 2);
    assert_eq!(config.pinned_max_round_threshold_mb, None);
    let mut buf = alloc.host().malloc(3 * KIB * KIB).await.unwrap();
    buf.fill(5);
    assert_eq!(
        buf.capacity(),
        4 * KIB * KIB,
        "power-of-two rounding (threshold off)"
    );
    assert_eq!(sim.counts().get(Op::HostRegister), 1);
    assert_eq!(sim.counts().get(Op::HostAlloc), 0);
    drop(buf);
    alloc.shutdown().await.unwrap();
    assert_eq!(sim.counts().get(Op::HostUnregister), 1);

    let err = Allocator::builder()
        .config_str("pinned_bogus_key:1")
        .backend_instance(sim.clone())
        .build()
        .unwrap_err();
    assert_eq!(
        err,
        Error::Host(HostError::Config(HostConfigError::UnknownKey {
            key: "pinned_bogus_key".into()
        }))
    );
    let err = Allocator::builder()
        .config_str("pinned_num_register_threads:3")
        .backend_instance(sim.clone())
        .build()
        .unwrap_err();
    assert!(
        matches!(
            &err,
            Error::Host(HostError::Config(HostConfigError::InvalidValue { key, value, .. }))
                if key == "pinned_num_register_threads" && value == "3"
        ),
        "{err:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stats_use_pytorch_host_keys() {
    let sim = sim();
    let alloc = build(&sim, "");
    let host = alloc.host();
    let a = host.malloc(1000).await.unwrap();
    drop(a);
    let b = host.malloc(1000).await.unwrap(); // a cache hit
    let m = host.stats().await.unwrap().as_map();
    assert_eq!(m["allocation.current"], 1);
    assert_eq!(m["allocation.allocated"], 2);
    assert_eq!(m["segment.current"], 1);
    assert_eq!(m["allocated_bytes.current"], 1024);
    assert_eq!(m["reserved_bytes.current"], 1024);
    assert_eq!(m["num_host_alloc"], 1);
    assert_eq!(m["num_host_free"], 0);
    assert_eq!(m["host_alloc_time.count"], 1);
    assert!(m.contains_key("host_free_time.total"));
    drop(b);
    host.empty_cache().await.unwrap();
    let m = host.stats().await.unwrap().as_map();
    assert_eq!(
        (
            m["segment.current"],
            m["num_host_free"],
            m["reserved_bytes.current"]
        ),
        (0, 1, 0)
    );
    assert_eq!(sim.counts().get(Op::HostFree), 1);
    alloc.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_background_reaper_caches_blocks_without_a_malloc() {
    let sim = sim();
    let alloc = build(&sim, "pinned_use_background_threads:True");
    let host = alloc.host();
    let stream = alloc.new_stream(DeviceId(0)).unwrap();
    let dev = alloc.malloc(8 * KIB, &stream).await.unwrap();
    let buf = host.malloc(8 * KIB).await.unwrap();
    stall(&sim, &stream, Duration::from_millis(30));
    drop(host.copy_h2d(buf, &dev, &stream).unwrap());
    assert_eq!(host.stats().await.unwrap().cached_bytes, 0, "still in use");
    let mut waited = Duration::ZERO;
    while host.stats().await.unwrap().cached_bytes != 8 * KIB {
        assert!(waited < Duration::from_secs(5), "the reaper never ran");
        tokio::time::sleep(Duration::from_millis(5)).await;
        waited += Duration::from_millis(5);
    }
    assert!(
        waited >= Duration::from_millis(10),
        "cached before the copy ran"
    );
    drop(dev);
    alloc.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_waits_for_copies_and_late_drops_on_plain_threads_release() {
    let sim = sim();
    let alloc = build(&sim, "");
    let host = alloc.host();
    let stream = alloc.new_stream(DeviceId(0)).unwrap();
    let dev = alloc.malloc(4 * KIB, &stream).await.unwrap();
    let pending = host.malloc(4 * KIB).await.unwrap();
    let mut live = host.malloc(8 * KIB).await.unwrap();
    stall(&sim, &stream, Duration::from_millis(20));
    drop(host.copy_h2d(pending, &dev, &stream).unwrap());
    alloc.shutdown().await.unwrap();
    let s = host.stats().await.unwrap();
    assert_eq!(
        (s.cached_bytes, s.num_host_free),
        (0, 1),
        "pending block released"
    );
    assert!(host.malloc(KIB).await.unwrap_err().is_shutdown());
    assert!(host.empty_cache().await.unwrap_err().is_shutdown());
    // The live buffer is still CPU memory its owner may use.
    live.fill(9);
    assert!(live.iter().all(|&b| b == 9));
    std::thread::spawn(move || drop(live)).join().unwrap();
    drop(dev);
    let s = host.stats().await.unwrap();
    assert_eq!((s.segment.current, s.reserved_bytes.current), (0, 0));
    assert_eq!(
        sim.counts().get(Op::HostAlloc),
        sim.counts().get(Op::HostFree)
    );
    alloc.shutdown().await.unwrap();
}

#[test]
fn a_buffer_outliving_its_runtime_drops_on_a_plain_thread() {
    let sim = sim();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (alloc, buf) = rt.block_on(async {
        let alloc = build(&sim, "");
        let buf = alloc.host().malloc(KIB).await.unwrap();
        (alloc, buf)
    });
    drop(rt);
    drop(alloc);
    std::thread::spawn(move || drop(buf)).join().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_miss_returns_its_block() {
    let sim = sim_with_slow_host_alloc(Duration::from_millis(50));
    let alloc = build(&sim, "");
    let host = alloc.host();
    let r = tokio::time::timeout(Duration::from_millis(5), host.malloc(4 * KIB)).await;
    assert!(r.is_err(), "the miss should still be allocating");
    // The allocation finishes on the blocking pool and its buffer is dropped there.
    let mut waited = Duration::ZERO;
    loop {
        let s = host.stats().await.unwrap();
        if s.num_host_alloc == 1 && s.allocation.current == 0 {
            assert_eq!(s.cached_bytes, 4 * KIB);
            break;
        }
        assert!(waited < Duration::from_secs(5), "leaked: {s:?}");
        tokio::time::sleep(Duration::from_millis(5)).await;
        waited += Duration::from_millis(5);
    }
    // And the next malloc is a hit on it: no second host allocation.
    drop(host.malloc(4 * KIB).await.unwrap());
    assert_eq!(sim.counts().get(Op::HostAlloc), 1);
    alloc.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_tasks_and_threads_lose_nothing() {
    let sim = sim();
    let alloc = build(&sim, "");
    let mut tasks = Vec::new();
    for t in 0..8u64 {
        let host = alloc.host();
        tasks.push(tokio::spawn(async move {
            let mut held = Vec::new();
            for i in 0..200u64 {
                let size = KIB << ((t + i) % 4);
                let mut b = host.malloc(size).await.unwrap();
                b.fill(t as u8);
                held.push(b);
                if held.len() > 3 {
                    let b = held.remove(0);
                    assert!(b.iter().all(|&x| x == t as u8), "another task wrote here");
                    if i % 2 == 0 {
                        std::thread::spawn(move || drop(b)).join().unwrap();
                    }
                }
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let s = alloc.host().stats().await.unwrap();
    assert_eq!(s.allocation.current, 0);
    assert_eq!(s.allocated_bytes.current, 0);
    assert_eq!(s.cached_bytes, s.reserved_bytes.current);
    alloc.shutdown().await.unwrap();
    assert_eq!(
        sim.counts().get(Op::HostAlloc),
        sim.counts().get(Op::HostFree)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hits_are_served_while_a_slow_miss_allocates() {
    let sim = sim_with_slow_host_alloc(Duration::from_millis(300));
    let alloc = build(&sim, "");
    let host = alloc.host();
    drop(host.malloc(4 * KIB).await.unwrap()); // cached (paid 300 ms once)
    let slow_host = host.clone();
    let slow = tokio::spawn(async move { slow_host.malloc(MIB).await.map(|b| b.len()) });
    tokio::time::sleep(Duration::from_millis(30)).await;
    let t = std::time::Instant::now();
    let hit = host.malloc(4 * KIB).await.unwrap();
    let waited = t.elapsed();
    assert!(!slow.is_finished(), "the miss should still be allocating");
    assert!(
        waited < Duration::from_millis(150),
        "a hit waited {waited:?} behind a 300 ms miss"
    );
    assert_eq!(slow.await.unwrap().unwrap(), MIB);
    assert_eq!(sim.counts().get(Op::HostAlloc), 2);
    drop(hit);
    alloc.shutdown().await.unwrap();
}
