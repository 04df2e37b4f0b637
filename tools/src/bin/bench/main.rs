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

mod graphs;
mod history;
mod host;
mod misses;
mod sleep;
mod throughput;

use misses::{flooded_device, slow_miss, slow_work, SlowWork};
use throughput::{core_contention, throughput};

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
        if run("graphs") {
            graphs::graph_figures(&mut figures).await;
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
