//! Sleep and wake of a pool (section `sleep`), on the sim with its default
//! latency model (real-hardware driver latencies; copies at 40 ms/GiB plus this machine's
//! memcpy) or on the GPU with `GPUALLOC_BACKEND=cuda`:
//!
//! - `sleep_offload_1gib_ms` / `wake_offload_1gib_ms`: a pool holding 1 GiB (64 written
//!   buffers of 16 MiB) sleeps with [`SleepMode::Offload`] and wakes (best of 3; the first,
//!   with the pinned memory still to be made, is printed too), vs the floor of the same work
//!   done by hand: a 1 GiB copy into fresh pinned memory plus releasing 1 GiB of written
//!   memory, and a fresh 1 GiB malloc plus a copy into it.
//! - `sleep_discard_1gib_ms` / `wake_discard_1gib_ms`: the same with [`SleepMode::Discard`],
//!   vs releasing 1 GiB of written memory, and a fresh 1 GiB malloc.
//!
//! On the sim, device memory is this machine's RAM: releasing it and touching it for the
//! first time cost what the kernel charges for 1 GiB of pages, which a GPU does not.
//! - `pool_hit_p99_during_sleep_wake_ns` / `pool_hit_max_during_sleep_wake_ns`: hit pairs of
//!   another pool that start while the 1 GiB pool sleeps or wakes, vs that pool's hit p99
//!   without them (target: the p99 at most 2x).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpualloc::runtime::sim::{SimBackend, SimConfig};
use gpualloc::{Allocator, AllocatorConfig, Backend, DeviceId, PoolOptions, SleepMode};

use super::{cuda, on_cuda, percentile, Figure, HIT_SIZE, MIB};

const GIB: u64 = 1 << 30;
const BUFFERS: u64 = 64;

fn backend() -> Arc<dyn Backend> {
    if on_cuda() {
        return cuda();
    }
    match SimBackend::new(SimConfig {
        capacity_per_device: 8 * GIB,
        ..SimConfig::default()
    }) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("bench: {e}");
            std::process::exit(2);
        }
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

pub(crate) async fn sleep_figures(figures: &mut Vec<Figure>) {
    let backend = backend();
    let alloc = match Allocator::builder()
        .config(AllocatorConfig::default().with_expandable_segments(true))
        .backend_instance(backend.clone())
        .build()
    {
        Ok(a) => a,
        Err(e) => {
            eprintln!("bench: {e}");
            std::process::exit(2);
        }
    };
    let stream = alloc.new_stream(DeviceId(0)).expect("stream");

    // The references, each the floor of what a sleep or wake must do, in the same run:
    // mapping 1 GiB, releasing 1 GiB that was written, copying 1 GiB out into fresh pinned
    // memory, and into freshly mapped memory.
    let h = stream.handle();
    let fresh = alloc
        .pool("fresh", PoolOptions::default())
        .await
        .expect("pool");
    let t = Instant::now();
    let one = fresh.malloc(GIB, &stream).await.expect("malloc");
    let map_ref = t.elapsed();
    backend.memset_async(h, one.ptr(), 1, GIB).expect("memset");
    backend.stream_synchronize(h).expect("sync");
    let t = Instant::now();
    let host = alloc.host().malloc(GIB).await.expect("pinned");
    // SAFETY: `host` is a live pinned buffer of GIB bytes, untouched until the synchronize.
    unsafe { backend.memcpy_async(h, host.ptr().0, one.ptr().0, GIB) }.expect("copy");
    backend.stream_synchronize(h).expect("sync");
    let out_ref = t.elapsed();
    let t = Instant::now();
    drop((one, fresh));
    alloc.empty_cache().await.expect("empty_cache");
    let release_ref = t.elapsed();
    let again = alloc
        .pool("again", PoolOptions::default())
        .await
        .expect("pool");
    let t = Instant::now();
    let two = again.malloc(GIB, &stream).await.expect("malloc");
    // SAFETY: as above; `host` is dropped only after the synchronize.
    unsafe { backend.memcpy_async(h, two.ptr().0, host.ptr().0, GIB) }.expect("copy");
    backend.stream_synchronize(h).expect("sync");
    let in_ref = t.elapsed();
    drop((two, again, host));
    alloc.empty_cache().await.expect("empty_cache");
    // The first sleep makes its pinned memory; the later ones reuse it from the pinned pool.
    alloc.host().empty_cache().await.expect("host empty_cache");

    let weights = alloc
        .pool("weights", PoolOptions::default())
        .await
        .expect("pool");
    let mut held = Vec::new();
    for _ in 0..BUFFERS {
        let b = weights
            .malloc(GIB / BUFFERS, &stream)
            .await
            .expect("malloc");
        backend
            .memset_async(h, b.ptr(), 7, b.len())
            .expect("memset");
        held.push(b);
    }
    backend.stream_synchronize(h).expect("sync");
    let kv = alloc
        .pool("kv", PoolOptions::default())
        .await
        .expect("pool");
    let mut baseline = Vec::with_capacity(200_000);
    for i in 0..201_000 {
        let t = Instant::now();
        drop(kv.malloc(HIT_SIZE, &stream).await.expect("hit"));
        if i >= 1000 {
            baseline.push(t.elapsed().as_nanos() as u64);
        }
    }

    // Hits of the other pool, kept while a sleep or wake is in progress.
    let busy = Arc::new(AtomicBool::new(false));
    let stop = Arc::new(AtomicBool::new(false));
    let hitter = {
        let (kv, stream, busy, stop) = (kv.clone(), stream.clone(), busy.clone(), stop.clone());
        tokio::spawn(async move {
            let mut kept = Vec::with_capacity(1 << 20);
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let during = busy.load(Ordering::Relaxed);
                let t = Instant::now();
                drop(kv.malloc(HIT_SIZE, &stream).await.expect("hit"));
                if during {
                    kept.push(t.elapsed().as_nanos() as u64);
                }
                i += 1;
                if i % 64 == 0 {
                    tokio::task::yield_now().await;
                }
            }
            kept
        })
    };
    let mut best = [Duration::MAX; 4];
    let mut first = [Duration::ZERO; 4];
    // Three cycles of each mode in a row: from the second on, an offload finds its pinned
    // memory in the pinned pool.
    for (k, mode) in [SleepMode::Offload, SleepMode::Discard]
        .into_iter()
        .enumerate()
    {
        for round in 0..3 {
            // Weights written before each sleep (outside the timing).
            for b in &held {
                backend
                    .memset_async(h, b.ptr(), round as u8, b.len())
                    .expect("memset");
            }
            backend.stream_synchronize(h).expect("sync");
            busy.store(true, Ordering::Relaxed);
            let t = Instant::now();
            weights.sleep(mode).await.expect("sleep");
            let slept = t.elapsed();
            let t = Instant::now();
            weights.wake().await.expect("wake");
            let woken = t.elapsed();
            busy.store(false, Ordering::Relaxed);
            for (i, d) in [(2 * k, slept), (2 * k + 1, woken)] {
                best[i] = best[i].min(d);
                if round == 0 {
                    first[i] = d;
                }
            }
        }
    }
    stop.store(true, Ordering::Relaxed);
    let mut during = hitter.await.expect("hits");
    let names = [
        "sleep_offload_1gib_ms",
        "wake_offload_1gib_ms",
        "sleep_discard_1gib_ms",
        "wake_discard_1gib_ms",
    ];
    let references = [out_ref + release_ref, in_ref, release_ref, map_ref];
    for (i, name) in names.into_iter().enumerate() {
        let reference = references[i];
        eprintln!("bench: {name}: first of 3 {:.1} ms", ms(first[i]));
        figures.push(Figure {
            name,
            value: ms(best[i]),
            unit: "ms",
            reference: ms(reference),
        });
    }
    let p99 = percentile(&mut baseline, 0.99);
    figures.push(Figure {
        name: "pool_hit_p99_during_sleep_wake_ns",
        value: percentile(&mut during, 0.99),
        unit: "ns",
        reference: p99,
    });
    figures.push(Figure {
        name: "pool_hit_max_during_sleep_wake_ns",
        value: percentile(&mut during, 1.0),
        unit: "ns",
        reference: p99,
    });
    eprintln!(
        "bench: {} hits during sleeps and wakes, {} MiB slept each time",
        during.len(),
        GIB / MIB
    );
    drop((held, kv, weights));
    let _ = alloc.shutdown().await;
}
