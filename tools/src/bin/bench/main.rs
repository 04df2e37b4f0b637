//! `bench`: the allocator's latency and throughput figures, each printed with its ratio to a
//! reference measured in the same run (`--json`: one JSON object per figure with name, value,
//! unit, reference, ratio).
//!
//! - `hit_pair_median_ns` / `hit_pair_p99_ns`: cache-hit malloc + drop through the allocator
//!   vs a direct call of the same core (must: median <= 1 us and <= 3x direct).
//! - `throughput_64_tasks`: aggregate hit pairs/s of 64 concurrent tasks vs one task, best
//!   of three runs each (must not fall below one task's).
//!
//! Every figure is measured twice: with the default configuration, where a hit that a
//! thread's own cache can serve skips the actor's gate (`thread_cache`), and with
//! `thread_cache:False`, where every request goes through the gate (names ending `_gate`).
//! - `hit_p99_during_slow_miss_us`: p99 of hits while another task's miss waits on a 10 ms
//!   device malloc (sim latency model), vs the p99 without it (target <= 100 us).
//! - `hit_p99_during_expandable_growth_us` / `hit_p99_during_gc_pass_us` (section
//!   `slowcalls`, sim only): p99 of the hits that start while another task's miss is in a
//!   slow call (`sim::sleeping_now`): growing an expandable segment (one 20 MiB page per miss, 10 ms per map) or runs a garbage-collection
//!   pass (10 ms per segment freed), vs the p99 of hits without misses (target <= 2x). With garbage
//!   collection the thread cache is off on both paths (it ages blocks by the core's lookups).
//! - `others_p99_one_device_flooded_us`: p99 of hits on 7 devices while the 8th is flooded
//!   with 10 ms misses (sim) by 16 tasks, vs the same without the flood.
//!
//! - `core_behind_mutex_2_threads_pairs_per_s`: the device core's hit pairs/s from two threads
//!   behind one mutex vs one thread (section `contention`): the ceiling of any design with one
//!   serialized core per device, the reason for the thread cache; and
//!   `varying_sizes_pairs_per_s`: one task whose sizes never repeat, default vs
//!   `thread_cache:False` (what the cache costs where it cannot help).
//! - the pinned-host figures (section `host`): see `host.rs`.
//! - sleep and wake of a 1 GiB pool, and other pools' hits meanwhile (section `sleep`): see
//!   `sleep.rs`.
//! - hits while the history is recorded (section `history`): see `history.rs`.
//!
//! Sections can be picked by name: `bench hit throughput miss flood slowcalls contention host
//! pool sleep history`
//! (default: all).
//!
//! `GPUALLOC_BACKEND=cuda` runs them on the GPU (scripts/gpu-check.sh): hits and throughput
//! on CUDA instead of the accounting backend (the direct reference too), misses with the
//! real device malloc instead of the sim's 10 ms one, and the flood only with 2+ GPUs.

mod history;
mod host;
mod sleep;

use std::sync::Arc;
use std::time::{Duration, Instant};

use gpualloc::devices::DeviceCore;
use gpualloc::runtime::accounting::AccountingBackend;
use gpualloc::runtime::sim::{LatencyModel, SimBackend, SimConfig};
use gpualloc::{Allocator, AllocatorConfig, Backend, BackendKind, DeviceId, Stream};

const HIT_SIZE: u64 = 4096;
const MIB: u64 = 1 << 20;

struct Figure {
    name: &'static str,
    value: f64,
    unit: &'static str,
    reference: f64,
}

impl Figure {
    fn ratio(&self) -> f64 {
        if self.reference > 0.0 {
            self.value / self.reference
        } else {
            0.0
        }
    }

    fn print(&self, json: bool) {
        if json {
            println!(
                "{{\"name\":\"{}\",\"value\":{:.4},\"unit\":\"{}\",\"reference\":{:.4},\"ratio\":{:.4}}}",
                self.name,
                self.value,
                self.unit,
                self.reference,
                self.ratio()
            );
        } else {
            println!(
                "{:<36} {:>12.3} {:<8} reference {:>12.3}   ratio {:>6.2}",
                self.name,
                self.value,
                self.unit,
                self.reference,
                self.ratio()
            );
        }
    }
}

/// Pushes the median and p99 (in ns) of `measured` against those of `reference`.
fn push_median_p99(
    figures: &mut Vec<Figure>,
    names: [&'static str; 2],
    measured: &mut [u64],
    reference: &mut [u64],
) {
    for (name, p) in names.into_iter().zip([0.5, 0.99]) {
        figures.push(Figure {
            name,
            value: percentile(measured, p),
            unit: "ns",
            reference: percentile(reference, p),
        });
    }
}

fn percentile(samples: &mut [u64], p: f64) -> f64 {
    if samples.is_empty() {
        return 0.0;
    }
    samples.sort_unstable();
    let idx = ((samples.len() - 1) as f64 * p).round() as usize;
    samples[idx] as f64
}

/// Accounting devices of 8 GiB. With expandable segments (the default) each stream's first
/// segment reserves 9/8 of the device's memory as address space, and the accounting backend
/// hands out addresses from a 1 TiB window per device: a device as large as the window ran
/// out of addresses at its first stream (`bench throughput` makes 65 streams).
fn accounting(devices: u32) -> Arc<AccountingBackend> {
    Arc::new(AccountingBackend::new(devices, 8 << 30))
}

/// True when `GPUALLOC_BACKEND=cuda` asks for the GPU.
fn on_cuda() -> bool {
    match BackendKind::from_env() {
        Ok(kind) => matches!(kind, BackendKind::Cuda),
        Err(e) => {
            eprintln!("bench: {e}");
            std::process::exit(2);
        }
    }
}

/// The CUDA backend (exits if unavailable: no silent fallback).
fn cuda() -> Arc<dyn Backend> {
    match gpualloc::cuda_backend() {
        Ok(b) => b,
        Err(e) => {
            eprintln!("bench: GPUALLOC_BACKEND=cuda but {e}");
            std::process::exit(2);
        }
    }
}

/// The backend for hit figures: CUDA when asked for, else addresses only.
fn hit_backend() -> Arc<dyn Backend> {
    if on_cuda() {
        cuda()
    } else {
        accounting(1)
    }
}

/// The simulated GPU where a device malloc takes 10 ms and every other call is free.
fn slow_malloc_sim(devices: u32) -> Arc<dyn Backend> {
    let latency = LatencyModel {
        malloc: Duration::from_millis(10),
        ..LatencyModel::zero()
    };
    let config = SimConfig {
        devices,
        capacity_per_device: 64 << 30,
        latency,
        ..SimConfig::fast(devices)
    };
    match SimBackend::new(config) {
        Ok(sim) => sim,
        Err(e) => {
            eprintln!("bench: cannot build the sim: {e}");
            std::process::exit(2);
        }
    }
}

/// Which path a figure measures: the default configuration (the thread cache in front of
/// the actor), or every request through the actor's gate (`thread_cache:False`).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Path {
    ThreadCache,
    Gate,
}

impl Path {
    /// The figure's name on this path.
    fn name(self, cached: &'static str, gate: &'static str) -> &'static str {
        match self {
            Path::ThreadCache => cached,
            Path::Gate => gate,
        }
    }
}

fn build(backend: Arc<dyn Backend>, path: Path) -> Allocator {
    match Allocator::builder()
        .config(AllocatorConfig::default().with_thread_cache(path == Path::ThreadCache))
        .backend_instance(backend)
        .build()
    {
        Ok(a) => a,
        Err(e) => {
            eprintln!("bench: cannot build the allocator: {e}");
            std::process::exit(2);
        }
    }
}

fn direct_pairs(n: usize) -> Vec<u64> {
    let backend: Arc<dyn Backend> = hit_backend();
    let mut core = match DeviceCore::new(backend.clone(), DeviceId(0), AllocatorConfig::default()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("bench: {e}");
            std::process::exit(2);
        }
    };
    let stream = Stream::new(&backend, DeviceId(0)).expect("stream");
    let h = stream.handle();
    let mut samples = Vec::with_capacity(n);
    for i in 0..n + 1000 {
        let t = Instant::now();
        let a = core.malloc(HIT_SIZE, h).expect("malloc");
        core.free(a.ptr).expect("free");
        if i >= 1000 {
            samples.push(t.elapsed().as_nanos() as u64);
        }
    }
    samples
}

async fn actor_pairs(alloc: &Allocator, stream: &Stream, n: usize) -> Vec<u64> {
    timed_pairs(n, || alloc.malloc(HIT_SIZE, stream)).await
}

/// Hit pairs (malloc + drop) from a named pool; in ns.
async fn pool_pairs(pool: &gpualloc::Pool, stream: &Stream, n: usize) -> Vec<u64> {
    timed_pairs(n, || pool.malloc(HIT_SIZE, stream)).await
}

/// `n` pairs of `malloc()` and drop after 1,000 warm-up pairs: each pair's latency in ns.
async fn timed_pairs<F, Fut>(n: usize, malloc: F) -> Vec<u64>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<gpualloc::DeviceBuffer, gpualloc::Error>>,
{
    let mut samples = Vec::with_capacity(n);
    for i in 0..n + 1000 {
        let t = Instant::now();
        let b = malloc().await.expect("malloc");
        drop(b);
        if i >= 1000 {
            samples.push(t.elapsed().as_nanos() as u64);
        }
    }
    samples
}

/// A named pool's hit pair against the default pools' through the gate (`thread_cache:False`),
/// in one allocator: pool blocks bypass the thread cache, so this is the path they take.
async fn pool_hit_latency(figures: &mut Vec<Figure>) {
    const N: usize = 200_000;
    let alloc = build(hit_backend(), Path::Gate);
    let stream = alloc.new_stream(DeviceId(0)).expect("stream");
    let pool = alloc
        .pool("bench", gpualloc::PoolOptions::default())
        .await
        .expect("pool");
    let mut default = actor_pairs(&alloc, &stream, N).await;
    let mut pooled = pool_pairs(&pool, &stream, N).await;
    push_median_p99(
        figures,
        ["pool_hit_pair_median_ns", "pool_hit_pair_p99_ns"],
        &mut pooled,
        &mut default,
    );
    drop(pool);
    let _ = alloc.shutdown().await;
}

/// Hit pairs on `stream` for `dur`; per-pair latencies in ns.
async fn hits_for(alloc: &Allocator, stream: &Stream, dur: Duration) -> Vec<u64> {
    hits_kept(alloc, stream, dur, || true).await
}

/// Hit pairs on `stream` for `dur`, keeping only those that started while a sim call was
/// paying its latency (the slow call of another task's miss): a hit stuck behind that call is
/// one sample among the few that overlap it, not one among a million. In ns.
async fn hits_during_slow_calls(alloc: &Allocator, stream: &Stream, dur: Duration) -> Vec<u64> {
    hits_kept(alloc, stream, dur, || {
        gpualloc::runtime::sim::sleeping_now() > 0
    })
    .await
}

/// Hit pairs on `stream` for `dur`; the latencies (ns) of those for which `keep()` held when
/// they started.
async fn hits_kept(
    alloc: &Allocator,
    stream: &Stream,
    dur: Duration,
    keep: impl Fn() -> bool,
) -> Vec<u64> {
    let mut samples = Vec::with_capacity(1 << 20);
    let end = Instant::now() + dur;
    let mut i = 0u64;
    loop {
        let kept = keep();
        let t = Instant::now();
        let b = alloc.malloc(HIT_SIZE, stream).await.expect("malloc");
        drop(b);
        if kept {
            samples.push(t.elapsed().as_nanos() as u64);
        }
        i += 1;
        if i % 256 == 0 {
            if Instant::now() >= end {
                break;
            }
            // Let other tasks on this worker run, as a service's tasks would.
            tokio::task::yield_now().await;
        }
    }
    samples
}

async fn hit_latency(figures: &mut Vec<Figure>, path: Path) {
    const N: usize = 200_000;
    let mut direct = direct_pairs(N);
    let alloc = build(hit_backend(), path);
    let stream = alloc.new_stream(DeviceId(0)).expect("stream");
    let mut actor = actor_pairs(&alloc, &stream, N).await;
    push_median_p99(
        figures,
        [
            path.name("hit_pair_median_ns", "hit_pair_median_ns_gate"),
            path.name("hit_pair_p99_ns", "hit_pair_p99_ns_gate"),
        ],
        &mut actor,
        &mut direct,
    );
    let _ = alloc.shutdown().await;
}

/// The core's hit pairs/s from `threads` OS threads, each on its own stream, behind one
/// mutex: what any design with one serialized core per device can hope for, and why the
/// thread cache exists (two CPUs taking turns on one core move its cache lines back and forth).
fn core_behind_mutex(threads: usize) -> f64 {
    const PAIRS: u64 = 1_000_000;
    let backend: Arc<dyn Backend> = accounting(1);
    let core = match DeviceCore::new(backend.clone(), DeviceId(0), AllocatorConfig::default()) {
        Ok(c) => Arc::new(std::sync::Mutex::new(c)),
        Err(e) => {
            eprintln!("bench: {e}");
            std::process::exit(2);
        }
    };
    let start = Instant::now();
    let workers: Vec<_> = (0..threads)
        .map(|_| {
            let (core, backend) = (core.clone(), backend.clone());
            std::thread::spawn(move || {
                let stream = Stream::new(&backend, DeviceId(0)).expect("stream");
                let h = stream.handle();
                let lock = || core.lock().unwrap_or_else(|p| p.into_inner());
                for _ in 0..PAIRS {
                    let a = lock().malloc(HIT_SIZE, h).expect("malloc");
                    lock().free(a.ptr).expect("free");
                }
            })
        })
        .collect();
    for w in workers {
        let _ = w.join();
    }
    (PAIRS * threads as u64) as f64 / start.elapsed().as_secs_f64()
}

/// Pairs/s of one task whose sizes never repeat within 997 requests, so the thread cache
/// never serves one: its overhead when it does not help.
async fn varying_sizes(path: Path) -> f64 {
    const PAIRS: u64 = 400_000;
    let alloc = build(hit_backend(), path);
    let stream = alloc.new_stream(DeviceId(0)).expect("stream");
    let size = |i: u64| HIT_SIZE + (i % 997) * 512;
    for i in 0..2_000 {
        drop(alloc.malloc(size(i), &stream).await.expect("warm"));
    }
    let start = Instant::now();
    for i in 0..PAIRS {
        drop(alloc.malloc(size(i), &stream).await.expect("malloc"));
    }
    let rate = PAIRS as f64 / start.elapsed().as_secs_f64();
    let _ = alloc.shutdown().await;
    rate
}

async fn core_contention(figures: &mut Vec<Figure>) {
    let gate = varying_sizes(Path::Gate).await;
    let cached = varying_sizes(Path::ThreadCache).await;
    figures.push(Figure {
        name: "varying_sizes_pairs_per_s",
        value: cached,
        unit: "pairs/s",
        reference: gate,
    });
    let one = core_behind_mutex(1);
    let two = core_behind_mutex(2);
    figures.push(Figure {
        name: "core_behind_mutex_2_threads_pairs_per_s",
        value: two,
        unit: "pairs/s",
        reference: one,
    });
}

/// Best of `ROUNDS` runs for both figures: other processes on this shared machine only ever
/// slow a run down, so the best run is the one closest to what the allocator can do.
async fn throughput(figures: &mut Vec<Figure>, path: Path) {
    const PAIRS: u64 = 200_000;
    const TASKS: u64 = 64;
    const ROUNDS: usize = 3;
    let alloc = build(hit_backend(), path);
    let stream = alloc.new_stream(DeviceId(0)).expect("stream");
    let per_task = PAIRS * 2 / TASKS;
    let mut streams = Vec::new();
    for _ in 0..TASKS {
        let s = alloc.new_stream(DeviceId(0)).expect("stream");
        drop(alloc.malloc(HIT_SIZE, &s).await.expect("warm"));
        streams.push(s);
    }
    let (mut single, mut aggregate) = (0f64, 0f64);
    for _ in 0..ROUNDS {
        let t = Instant::now();
        for _ in 0..PAIRS {
            drop(alloc.malloc(HIT_SIZE, &stream).await.expect("malloc"));
        }
        single = single.max(PAIRS as f64 / t.elapsed().as_secs_f64());
        let t = Instant::now();
        let handles: Vec<_> = streams
            .iter()
            .cloned()
            .map(|s| {
                let alloc = alloc.clone();
                tokio::spawn(async move {
                    for i in 0..per_task {
                        drop(alloc.malloc(HIT_SIZE, &s).await.expect("malloc"));
                        if i % 256 == 0 {
                            tokio::task::yield_now().await;
                        }
                    }
                })
            })
            .collect();
        for h in handles {
            let _ = h.await;
        }
        aggregate = aggregate.max((per_task * TASKS) as f64 / t.elapsed().as_secs_f64());
    }
    figures.push(Figure {
        name: path.name(
            "throughput_64_tasks_pairs_per_s",
            "throughput_64_tasks_gate_pairs_per_s",
        ),
        value: aggregate,
        unit: "pairs/s",
        reference: single,
    });
    let _ = alloc.shutdown().await;
}

async fn slow_miss(figures: &mut Vec<Figure>, path: Path) {
    let alloc = build(
        if on_cuda() {
            cuda()
        } else {
            slow_malloc_sim(1)
        },
        path,
    );
    let stream = alloc.new_stream(DeviceId(0)).expect("stream");
    drop(alloc.malloc(HIT_SIZE, &stream).await.expect("warm"));
    let mut quiet = hits_for(&alloc, &stream, Duration::from_millis(200)).await;
    let miss_alloc = alloc.clone();
    let miss_stream = alloc.new_stream(DeviceId(0)).expect("stream");
    let misser = tokio::spawn(async move {
        let mut kept = Vec::new();
        let end = Instant::now() + Duration::from_millis(400);
        let mut i = 0;
        while Instant::now() < end {
            // A full device (a real GPU is quick to fill) ends the misses.
            match miss_alloc
                .malloc(64 * MIB + i * 2 * MIB, &miss_stream)
                .await
            {
                Ok(b) => kept.push(b),
                Err(_) => break,
            }
            i += 1;
        }
        kept.len()
    });
    tokio::time::sleep(Duration::from_millis(5)).await;
    let mut busy = hits_for(&alloc, &stream, Duration::from_millis(300)).await;
    let misses = misser.await.unwrap_or(0);
    if misses == 0 {
        eprintln!("bench: the miss task made no progress");
    }
    figures.push(Figure {
        name: path.name(
            "hit_p99_during_slow_miss_us",
            "hit_p99_during_slow_miss_gate_us",
        ),
        value: percentile(&mut busy, 0.99) / 1000.0,
        unit: "us",
        reference: percentile(&mut quiet, 0.99) / 1000.0,
    });
    let _ = alloc.shutdown().await;
}

/// The slow backend work a miss can do besides a device malloc (section `slowcalls`).
#[derive(Clone, Copy, PartialEq, Eq)]
enum SlowWork {
    /// Growing an expandable segment: one 20 MiB page per miss, its map costing 10 ms.
    ExpandableGrowth,
    /// A garbage-collection pass: cached segments freed at 10 ms each before the malloc.
    GarbageCollection,
}

/// p99 of the hits that start while another task's miss is in a slow call of `work` (sim,
/// 10 ms per call), vs the p99 of hits without misses (target: <= 2x).
async fn slow_work(figures: &mut Vec<Figure>, path: Path, work: SlowWork) {
    let (conf, latency) = match work {
        SlowWork::ExpandableGrowth => (
            "expandable_segments:True",
            LatencyModel {
                map: Duration::from_millis(10),
                ..LatencyModel::zero()
            },
        ),
        SlowWork::GarbageCollection => (
            // Garbage collection frees whole ordinary segments (expandable ones, the default
            // under the gpualloc policy, give pages back through `empty_cache` only).
            "garbage_collection_threshold:0.5,per_process_memory_fraction:1.0,expandable_segments:False",
            LatencyModel {
                free: Duration::from_millis(10),
                ..LatencyModel::zero()
            },
        ),
    };
    let sim = match SimBackend::new(SimConfig {
        capacity_per_device: 1 << 30,
        latency,
        ..SimConfig::fast(1)
    }) {
        Ok(sim) => sim,
        Err(e) => {
            eprintln!("bench: cannot build the sim: {e}");
            std::process::exit(2);
        }
    };
    let mut config = AllocatorConfig::parse(conf).expect("config");
    config.thread_cache = path == Path::ThreadCache;
    let alloc = match Allocator::builder()
        .config(config)
        .backend_instance(sim.clone())
        .build()
    {
        Ok(a) => a,
        Err(e) => {
            eprintln!("bench: cannot build the allocator: {e}");
            std::process::exit(2);
        }
    };
    let stream = alloc.new_stream(DeviceId(0)).expect("stream");
    drop(alloc.malloc(HIT_SIZE, &stream).await.expect("warm"));
    let mut quiet = hits_for(&alloc, &stream, Duration::from_millis(200)).await;
    let (miss_alloc, miss_stream) = (
        alloc.clone(),
        alloc.new_stream(DeviceId(0)).expect("stream"),
    );
    let slow_calls = move || {
        let c = sim.counts();
        c.get(gpualloc::runtime::sim::Op::Map) + c.get(gpualloc::runtime::sim::Op::Free)
    };
    let before = slow_calls();
    let misser = tokio::spawn(async move {
        let mut kept = Vec::new();
        let end = Instant::now() + Duration::from_millis(400);
        let mut i = 0;
        while Instant::now() < end {
            let size = match work {
                // Each request needs one more page.
                SlowWork::ExpandableGrowth => 20 * MIB,
                // Sizes never repeat: each is a miss, freed at once into the cache, which
                // stays above the 512 MiB threshold, so every miss runs a pass.
                SlowWork::GarbageCollection => 64 * MIB + (i % 64) * 2 * MIB,
            };
            match miss_alloc.malloc(size, &miss_stream).await {
                Ok(b) if work == SlowWork::ExpandableGrowth => kept.push(b),
                Ok(b) => drop(b),
                Err(_) => break,
            }
            i += 1;
        }
        i
    });
    tokio::time::sleep(Duration::from_millis(5)).await;
    let mut busy = hits_during_slow_calls(&alloc, &stream, Duration::from_millis(300)).await;
    let misses = misser.await.unwrap_or(0);
    eprintln!(
        "bench: {} misses, {} slow calls (maps + frees); {} hits started during them, slowest {} us",
        misses,
        slow_calls() - before,
        busy.len(),
        busy.iter().max().copied().unwrap_or(0) / 1000
    );
    let name = match work {
        SlowWork::ExpandableGrowth => path.name(
            "hit_p99_during_expandable_growth_us",
            "hit_p99_during_expandable_growth_gate_us",
        ),
        SlowWork::GarbageCollection => path.name(
            "hit_p99_during_gc_pass_us",
            "hit_p99_during_gc_pass_gate_us",
        ),
    };
    figures.push(Figure {
        name,
        value: percentile(&mut busy, 0.99) / 1000.0,
        unit: "us",
        reference: percentile(&mut quiet, 0.99) / 1000.0,
    });
    let _ = alloc.shutdown().await;
}

async fn flooded_device(figures: &mut Vec<Figure>, path: Path) {
    let alloc = build(
        if on_cuda() {
            cuda()
        } else {
            slow_malloc_sim(8)
        },
        path,
    );
    if alloc.device_count() < 2 {
        eprintln!(
            "bench: flood skipped: it needs 2+ devices, this backend has {}",
            alloc.device_count()
        );
        let _ = alloc.shutdown().await;
        return;
    }
    async fn others(alloc: &Allocator) -> Vec<u64> {
        let handles: Vec<_> = (1..alloc.device_count())
            .map(|d| {
                let alloc = alloc.clone();
                tokio::spawn(async move {
                    let s = alloc.new_stream(DeviceId(d)).expect("stream");
                    drop(alloc.malloc(HIT_SIZE, &s).await.expect("warm"));
                    hits_for(&alloc, &s, Duration::from_millis(200)).await
                })
            })
            .collect();
        let mut all = Vec::new();
        for h in handles {
            all.extend(h.await.unwrap_or_default());
        }
        all
    }
    let mut quiet = others(&alloc).await;
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flood: Vec<_> = (0..16u64)
        .map(|_| {
            let alloc = alloc.clone();
            let stop = stop.clone();
            tokio::spawn(async move {
                let s = alloc.new_stream(DeviceId(0)).expect("stream");
                let mut kept = Vec::new();
                let mut i = 0u64;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    // Misses (10 ms device mallocs; each task on its own stream, so freed
                    // blocks do not serve the others) interleaved with hits. Device-full
                    // errors are part of a flood: ignored.
                    if let Ok(b) = alloc.malloc(32 * MIB + (i % 16) * 2 * MIB, &s).await {
                        kept.push(b);
                    }
                    if kept.len() >= 8 {
                        kept.clear();
                    }
                    for _ in 0..64 {
                        if let Ok(b) = alloc.malloc(HIT_SIZE, &s).await {
                            drop(b);
                        }
                    }
                    i += 1;
                }
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(20)).await;
    let mut busy = others(&alloc).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for h in flood {
        let _ = h.await;
    }
    match alloc.stats(DeviceId(0)).await {
        Ok(st) if st.num_device_alloc > 0 => {}
        _ => eprintln!("bench: the flooded device made no device mallocs"),
    }
    figures.push(Figure {
        name: path.name(
            "others_p99_one_device_flooded_us",
            "others_p99_one_device_flooded_gate_us",
        ),
        value: percentile(&mut busy, 0.99) / 1000.0,
        unit: "us",
        reference: percentile(&mut quiet, 0.99) / 1000.0,
    });
    let _ = alloc.shutdown().await;
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let json = args.iter().any(|a| a == "--json");
    let only: Vec<&str> = args
        .iter()
        .filter(|a| !a.starts_with("--"))
        .map(String::as_str)
        .collect();
    let run = |name: &str| only.is_empty() || only.contains(&name);
    // Two worker threads: this machine's core count (override: GPUALLOC_BENCH_WORKERS).
    let workers = std::env::var("GPUALLOC_BENCH_WORKERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2);
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("bench: cannot start tokio: {e}");
            std::process::exit(2);
        }
    };
    eprintln!(
        "bench: backend {}",
        if on_cuda() {
            "cuda"
        } else {
            "accounting + sim"
        }
    );
    let figures = runtime.block_on(async {
        let mut figures = Vec::new();
        for path in [Path::ThreadCache, Path::Gate] {
            if run("hit") {
                hit_latency(&mut figures, path).await;
            }
            if run("throughput") {
                throughput(&mut figures, path).await;
            }
            if run("miss") {
                slow_miss(&mut figures, path).await;
            }
            if run("flood") {
                flooded_device(&mut figures, path).await;
            }
            if run("slowcalls") && !on_cuda() {
                slow_work(&mut figures, path, SlowWork::ExpandableGrowth).await;
                slow_work(&mut figures, path, SlowWork::GarbageCollection).await;
            }
        }
        if run("host") {
            host::host_figures(&mut figures).await;
        }
        if run("pool") {
            pool_hit_latency(&mut figures).await;
        }
        if run("sleep") {
            sleep::sleep_figures(&mut figures).await;
        }
        if run("history") {
            history::history_figures(&mut figures).await;
        }
        if run("contention") {
            core_contention(&mut figures).await;
        }
        figures
    });
    for f in &figures {
        f.print(json);
    }
}
