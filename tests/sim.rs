//! The allocator on the simulated GPU, with real memory: simulated kernels write a
//! per-request pattern into each buffer and verify it later on the stream, so handing out
//! memory that another stream still uses shows up as a kernel failure (corruption).
//! Also: cancellation, shutdown with live buffers, drops after shutdown, empty_cache.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use gpualloc::runtime::sim::{SimBackend, SimConfig};
use gpualloc::runtime::BackendError;
use gpualloc::{Allocator, AllocatorConfig, DeviceBuffer, DeviceId, Stream};

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;

fn sim(devices: u32, capacity: u64) -> Arc<SimBackend> {
    SimBackend::new(SimConfig {
        capacity_per_device: capacity,
        ..SimConfig::fast(devices)
    })
    .expect("sim")
}

fn build(sim: &Arc<SimBackend>) -> Allocator {
    Allocator::builder()
        .config(AllocatorConfig::default())
        .backend_instance(sim.clone())
        .build()
        .expect("build")
}

/// Fills `buf` with `byte` on `stream`, waits `hold` on the stream, then checks the bytes
/// are still `byte` (a kernel error, counted by the sim, if not).
fn fill_then_check(
    sim: &SimBackend,
    stream: &Stream,
    buf: &DeviceBuffer,
    byte: u8,
    hold: Duration,
    mismatches: &Arc<AtomicU64>,
) {
    let (ptr, len) = (buf.ptr(), buf.len());
    sim.launch_kernel(stream.handle(), Duration::ZERO, move |m| {
        m.fill(ptr, len, byte)
    })
    .expect("fill");
    let bad = mismatches.clone();
    sim.launch_kernel(stream.handle(), hold, move |m| {
        if m.check(ptr, len, byte)? {
            Ok(())
        } else {
            bad.fetch_add(1, Ordering::Relaxed);
            Err(BackendError::invalid(
                "pattern overwritten: memory reused while in use",
            ))
        }
    })
    .expect("check");
}

/// Negative control: using a buffer on another stream *without* `record_stream` lets the
/// allocator hand the block out again while that stream still uses it, and the pattern
/// check catches it. This proves the detector used by the other tests works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pattern_check_catches_early_reuse() {
    let sim = sim(1, 1 << 30);
    let alloc = build(&sim);
    let a = alloc.new_stream(DeviceId(0)).unwrap();
    let b = alloc.new_stream(DeviceId(0)).unwrap();
    let bad = Arc::new(AtomicU64::new(0));
    let buf = alloc.malloc(64 * KIB, &a).await.unwrap();
    let ptr = buf.ptr();
    sim.launch_kernel(b.handle(), Duration::ZERO, move |m| {
        m.fill(ptr, 64 * KIB, 0xAB)
    })
    .unwrap();
    b.record_event().unwrap().completed().await.unwrap();
    let flag = bad.clone();
    sim.launch_kernel(b.handle(), Duration::from_millis(50), move |m| {
        if !m.check(ptr, 64 * KIB, 0xAB)? {
            flag.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    })
    .unwrap();
    drop(buf); // wrong on purpose: no record_stream(b)
    let again = alloc.malloc(64 * KIB, &a).await.unwrap();
    assert_eq!(again.ptr(), ptr, "the block was reused at once");
    sim.launch_kernel(a.handle(), Duration::ZERO, move |m| {
        m.fill(ptr, 64 * KIB, 0x11)
    })
    .unwrap();
    a.completed().await.unwrap();
    let _ = b.completed().await;
    assert_eq!(bad.load(Ordering::Relaxed), 1, "the overwrite was detected");
    drop(again);
    alloc.shutdown().await.unwrap();
}

/// Many tasks on two devices and three streams each: every request writes its own pattern,
/// sometimes hands the buffer to another stream (with `record_stream`), and verifies it
/// after a delay. No pattern is ever overwritten.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_tasks_streams_and_devices_never_share_live_memory() {
    let sim = sim(2, 1 << 30);
    let alloc = build(&sim);
    let bad = Arc::new(AtomicU64::new(0));
    let streams: Vec<Vec<Stream>> = (0..2)
        .map(|d| {
            (0..3)
                .map(|_| alloc.new_stream(DeviceId(d)).unwrap())
                .collect()
        })
        .collect();
    let mut tasks = Vec::new();
    for t in 0..24u64 {
        let (alloc, sim, bad, streams) = (alloc.clone(), sim.clone(), bad.clone(), streams.clone());
        tasks.push(tokio::spawn(async move {
            let dev = (t % 2) as usize;
            for i in 0..25u64 {
                let seed = t * 1000 + i;
                let own = &streams[dev][(seed % 3) as usize];
                let size = KIB + (seed * 7919) % (3 * MIB);
                let buf = alloc.malloc(size, own).await.unwrap();
                assert_eq!(buf.device(), DeviceId(dev as u32));
                let byte = (seed % 251) as u8 + 1;
                if seed % 4 == 0 {
                    // Cross-stream use: the free must wait for the other stream.
                    // As in CUDA, the other stream first waits for the allocation stream
                    // (the block may still be in use by earlier work queued there).
                    let other = &streams[dev][((seed + 1) % 3) as usize];
                    other.wait_event(&own.record_event().unwrap()).unwrap();
                    buf.record_stream(other).unwrap();
                    fill_then_check(&sim, other, &buf, byte, Duration::from_micros(300), &bad);
                } else {
                    fill_then_check(&sim, own, &buf, byte, Duration::from_micros(50), &bad);
                }
                drop(buf);
                if i % 5 == 0 {
                    tokio::task::yield_now().await;
                }
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    for per_dev in &streams {
        for s in per_dev {
            s.completed().await.unwrap();
        }
    }
    assert_eq!(bad.load(Ordering::Relaxed), 0, "a pattern was overwritten");
    assert_eq!(sim.kernel_failures(), 0);
    alloc.empty_cache().await.unwrap();
    for d in 0..2 {
        let st = alloc.stats(DeviceId(d)).await.unwrap();
        assert_eq!(st.allocation[0].current, 0);
        assert_eq!(
            st.reserved_bytes[0].current, 0,
            "empty_cache returns every segment"
        );
        assert_eq!(sim.used_bytes(DeviceId(d)).unwrap(), 0);
    }
    alloc.shutdown().await.unwrap();
    assert_eq!(sim.live_allocations(), 0);
}

/// Malloc futures cancelled at random points (tiny timeouts, losing `select!` branches)
/// leak nothing: every block comes back and the cache empties to zero.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_cancellation_leaks_nothing() {
    // Device mallocs take 20 ms: far longer than any spin on the caller's side, so a miss
    // polled once is always still in flight when it is dropped.
    let sim = SimBackend::new(SimConfig {
        latency: gpualloc::runtime::sim::LatencyModel {
            malloc: Duration::from_millis(20),
            ..gpualloc::runtime::sim::LatencyModel::zero()
        },
        ..SimConfig::fast(1)
    })
    .unwrap();
    let alloc = build(&sim);
    let s = alloc.new_stream(DeviceId(0)).unwrap();
    let mut kept = Vec::new();
    let mut cancelled = 0;
    for i in 0..300u64 {
        let size = KIB + (i * 104_729) % (12 * MIB);
        if i % 10 == 0 {
            // A fresh size: a miss (a 20 ms device malloc on the blocking pool), polled
            // once and dropped while it is in flight.
            let fresh = 40 * MIB + i * 2 * MIB;
            if futures::FutureExt::now_or_never(alloc.malloc(fresh, &s)).is_none() {
                cancelled += 1;
            }
        } else if i % 2 == 0 {
            match tokio::time::timeout(Duration::from_micros(i % 300), alloc.malloc(size, &s)).await
            {
                Ok(r) => kept.push(r.unwrap()),
                Err(_) => cancelled += 1,
            }
        } else {
            tokio::select! {
                r = alloc.malloc(size, &s) => kept.push(r.unwrap()),
                _ = tokio::time::sleep(Duration::from_micros(i % 150)) => cancelled += 1,
            }
        }
        if kept.len() > 8 {
            kept.clear();
        }
    }
    assert!(cancelled > 0, "some mallocs were cancelled");
    drop(kept);
    // Misses cancelled mid-flight finish on the blocking pool, then return their blocks.
    let actor = alloc.device_actor(DeviceId(0)).unwrap().clone();
    for _ in 0..400 {
        if actor.misses_in_flight() == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(actor.misses_in_flight(), 0);
    assert_eq!(
        alloc.stats(DeviceId(0)).await.unwrap().allocation[0].current,
        0,
        "every block came back"
    );
    alloc.empty_cache().await.unwrap();
    assert_eq!(sim.used_bytes(DeviceId(0)).unwrap(), 0);
    alloc.shutdown().await.unwrap();
}

/// Shutdown with buffers alive returns every segment; dropping the buffers afterwards, on
/// other threads and outside the runtime, is harmless; new requests get `Shutdown`.
#[test]
fn shutdown_with_live_buffers_then_drop_anywhere() {
    let sim = sim(2, 1 << 30);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let (alloc, bufs, stream) = rt.block_on(async {
        let alloc = build(&sim);
        let s0 = alloc.new_stream(DeviceId(0)).unwrap();
        let s1 = alloc.new_stream(DeviceId(1)).unwrap();
        let mut bufs = Vec::new();
        for i in 0..20u64 {
            let s = if i % 2 == 0 { &s0 } else { &s1 };
            bufs.push(alloc.malloc(100 * KIB * (i + 1), s).await.unwrap());
        }
        alloc.shutdown().await.unwrap();
        assert!(alloc.malloc(10, &s0).await.unwrap_err().is_shutdown());
        (alloc, bufs, s0)
    });
    assert_eq!(sim.live_allocations(), 0, "shutdown returned every segment");
    let (left, right): (Vec<_>, Vec<_>) =
        bufs.into_iter().enumerate().partition(|(i, _)| i % 2 == 0);
    std::thread::spawn(move || drop(left)).join().unwrap();
    drop(rt);
    drop(right);
    drop(stream);
    drop(alloc);
    assert_eq!(sim.live_allocations(), 0);
}

/// `Stream::completed()` and event futures let a task await GPU work without blocking.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn awaiting_gpu_work_does_not_block_the_runtime() {
    let sim = sim(1, 1 << 30);
    let alloc = build(&sim);
    let s = alloc.new_stream(DeviceId(0)).unwrap();
    let buf = alloc.malloc(MIB, &s).await.unwrap();
    let ptr = buf.ptr();
    sim.launch_kernel(s.handle(), Duration::from_millis(30), move |m| {
        m.fill(ptr, MIB, 7)
    })
    .unwrap();
    let event = s.record_event().unwrap();
    let ticker = tokio::spawn(async {
        let mut ticks = 0;
        for _ in 0..10 {
            tokio::time::sleep(Duration::from_millis(1)).await;
            ticks += 1;
        }
        ticks
    });
    event.completed().await.unwrap();
    assert_eq!(
        ticker.await.unwrap(),
        10,
        "the runtime kept running other tasks"
    );
    s.completed().await.unwrap();
    drop(buf);
    alloc.shutdown().await.unwrap();
}

/// Shutdown while a miss's device calls are in flight on the blocking pool (an ordinary
/// segment's malloc; an expandable segment's physical pages, the default config on the sim):
/// the late memory is not adopted by the shut-down core but goes back, so nothing leaks, and
/// the request gets the shutdown error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_racing_an_in_flight_miss_leaks_nothing() {
    let slow = Duration::from_millis(50);
    for (conf, latency) in [
        (
            "expandable_segments:False",
            gpualloc::runtime::sim::LatencyModel {
                malloc: slow,
                ..gpualloc::runtime::sim::LatencyModel::zero()
            },
        ),
        (
            "",
            gpualloc::runtime::sim::LatencyModel {
                phys: slow,
                ..gpualloc::runtime::sim::LatencyModel::zero()
            },
        ),
    ] {
        let sim = SimBackend::new(SimConfig {
            latency,
            ..SimConfig::fast(1)
        })
        .unwrap();
        let alloc = Allocator::builder()
            .config_str(conf)
            .backend_instance(sim.clone())
            .build()
            .expect("build");
        let s = alloc.new_stream(DeviceId(0)).unwrap();
        let (a2, s2) = (alloc.clone(), s.clone());
        let request = tokio::spawn(async move { a2.malloc(8 * MIB, &s2).await });
        let actor = alloc.device_actor(DeviceId(0)).unwrap().clone();
        while actor.misses_in_flight() == 0 {
            tokio::task::yield_now().await;
        }
        alloc.shutdown().await.unwrap();
        let result = request.await.unwrap();
        assert!(result.unwrap_err().is_shutdown(), "[{conf}]");
        assert_eq!(actor.misses_in_flight(), 0, "[{conf}]");
        assert_eq!(
            sim.live_allocations(),
            0,
            "[{conf}]: the late segment went back to the device"
        );
        assert_eq!(
            sim.used_bytes(DeviceId(0)).unwrap(),
            0,
            "[{conf}]: no page left"
        );
    }
}
