//! The pinned-host figures of `bench` (section `host`):
//!
//! - `host_hit_pair_median_ns` / `host_hit_pair_p99_ns`: `alloc.host().malloc(4 KiB)` + drop
//!   (a cache hit) vs the same pair called directly on a `HostCore`.
//! - `pinned_1gib_host_alloc_ms`: (best of 3) a fresh 1 GiB pinned malloc through `host_alloc` (the sim's
//!   cudaHostAlloc latency model: 10 us + 0.3 ms/MiB, nothing touched) vs the register path
//!   with N prefault threads (real page faults + the sim's host_register model, 60 ms/GiB).
//! - `pinned_1gib_register_nt_ms`: the register path with N threads vs 1 thread.
//! - `prefault_1gib_nt_ms`: real page faults of 1 GiB of fresh memory on N threads vs 1
//!   (best of 3; the ratio is 1/speed-up); `prefault_1gib_speedup_nt`: that speed-up vs N.
//! - `host_hit_p99_during_miss_us` / `host_hit_max_during_miss_ms`: 4 KiB hits while another
//!   task's fresh 256 MiB malloc pays the sim's host_alloc model (~77 ms), vs that malloc's own
//!   time (the fresh memory is allocated outside the actor's gate, so hits need not wait).
//! - `pinned_held_1_1gib_ratio`: bytes held / bytes requested for a 1.1 GiB request with the
//!   rounding threshold (default 64 MiB) vs without it (PyTorch's power of two).
//!
//! `GPUALLOC_BENCH_HOST_MIB` changes the 1 GiB; N is the available parallelism (a power of
//! two, at least 2).

use std::sync::Arc;
use std::time::{Duration, Instant};

use gpualloc::host::mapping::PageMapping;
use gpualloc::host::{prefault, HostConfig, HostCore, MonotonicClock};
use gpualloc::runtime::accounting::AccountingBackend;
use gpualloc::runtime::sim::{LatencyModel, SimBackend, SimConfig};
use gpualloc::{Allocator, Backend, BackendKind};

use super::{percentile, push_median_p99, Figure, HIT_SIZE, MIB};

const GIB: u64 = 1 << 30;

fn sim(latency: LatencyModel) -> Arc<dyn Backend> {
    SimBackend::new(SimConfig {
        latency,
        ..SimConfig::fast(1)
    })
    .expect("sim")
}

fn build(backend: Arc<dyn Backend>, conf: &str) -> Allocator {
    Allocator::builder()
        .config_str(conf)
        .backend(BackendKind::Custom(backend))
        .build()
        .expect("allocator")
}

fn threads() -> usize {
    let n = std::thread::available_parallelism().map_or(2, |n| n.get());
    let n = 1usize << (usize::BITS - 1 - n.leading_zeros());
    n.clamp(2, 128)
}

fn big_bytes() -> u64 {
    std::env::var("GPUALLOC_BENCH_HOST_MIB")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(1024)
        * MIB
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// All the pinned-host figures.
pub async fn host_figures(figures: &mut Vec<Figure>) {
    hit_latency(figures).await;
    hit_during_miss(figures).await;
    large(figures).await;
    rounding(figures).await;
}

async fn hit_latency(figures: &mut Vec<Figure>) {
    const N: usize = 200_000;
    let backend = sim(LatencyModel::zero());
    let mut core = HostCore::new(
        backend.clone(),
        HostConfig::default(),
        Arc::new(MonotonicClock::new()),
    )
    .expect("core");
    let mut direct = Vec::with_capacity(N);
    for i in 0..N + 1000 {
        let t = Instant::now();
        let b = core.malloc(HIT_SIZE).expect("malloc");
        core.free(b.ptr).expect("free");
        if i >= 1000 {
            direct.push(t.elapsed().as_nanos() as u64);
        }
    }
    let alloc = build(backend, "");
    let host = alloc.host();
    let mut actor = Vec::with_capacity(N);
    for i in 0..N + 1000 {
        let t = Instant::now();
        drop(host.malloc(HIT_SIZE).await.expect("malloc"));
        if i >= 1000 {
            actor.push(t.elapsed().as_nanos() as u64);
        }
    }
    push_median_p99(
        figures,
        ["host_hit_pair_median_ns", "host_hit_pair_p99_ns"],
        &mut actor,
        &mut direct,
    );
    let _ = alloc.shutdown().await;
}

async fn hit_during_miss(figures: &mut Vec<Figure>) {
    let alloc = build(sim(LatencyModel::default()), "");
    let host = alloc.host();
    drop(host.malloc(HIT_SIZE).await.expect("warm"));
    let miss_host = host.clone();
    let miss = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(10)).await;
        let t = Instant::now();
        let b = miss_host.malloc(256 * MIB).await.expect("miss");
        let d = t.elapsed();
        drop(b);
        d
    });
    let mut samples = Vec::new();
    let end = Instant::now() + Duration::from_millis(100);
    while Instant::now() < end {
        let t = Instant::now();
        drop(host.malloc(HIT_SIZE).await.expect("hit"));
        samples.push(t.elapsed().as_nanos() as u64);
        tokio::task::yield_now().await;
    }
    let slowest = Duration::from_nanos(samples.iter().copied().max().unwrap_or(0));
    let miss = miss.await.expect("miss task");
    figures.push(Figure {
        name: "host_hit_p99_during_miss_us",
        value: percentile(&mut samples, 0.99) / 1e3,
        unit: "us",
        reference: ms(miss) * 1e3,
    });
    figures.push(Figure {
        name: "host_hit_max_during_miss_ms",
        value: ms(slowest),
        unit: "ms",
        reference: ms(miss),
    });
    let _ = alloc.shutdown().await;
}

/// Best time of 3 fresh pinned mallocs of `bytes`, each on a new allocator with `conf`.
async fn fresh_malloc(bytes: u64, conf: &str) -> Duration {
    let mut best = Duration::MAX;
    for _ in 0..3 {
        let alloc = build(sim(LatencyModel::default()), conf);
        let t = Instant::now();
        let buf = alloc.host().malloc(bytes).await.expect("pinned malloc");
        best = best.min(t.elapsed());
        drop(buf);
        let _ = alloc.shutdown().await;
    }
    best
}

fn best_prefault(bytes: usize, threads: usize) -> Duration {
    let mut best = Duration::MAX;
    for _ in 0..3 {
        let mut m = PageMapping::new(bytes).expect("mapping");
        let t = Instant::now();
        prefault(m.as_mut_slice(), threads);
        best = best.min(t.elapsed());
    }
    best
}

async fn large(figures: &mut Vec<Figure>) {
    let bytes = big_bytes();
    let n = threads();
    let host_alloc = fresh_malloc(bytes, "").await;
    let reg =
        |t: usize| format!("pinned_use_cuda_host_register:True,pinned_num_register_threads:{t}");
    let reg_1 = fresh_malloc(bytes, &reg(1)).await;
    let reg_n = fresh_malloc(bytes, &reg(n)).await;
    figures.push(Figure {
        name: "pinned_1gib_host_alloc_ms",
        value: ms(host_alloc),
        unit: "ms",
        reference: ms(reg_n),
    });
    figures.push(Figure {
        name: "pinned_1gib_register_nt_ms",
        value: ms(reg_n),
        unit: "ms",
        reference: ms(reg_1),
    });
    let len = usize::try_from(bytes).expect("size");
    let one = best_prefault(len, 1);
    let many = best_prefault(len, n);
    figures.push(Figure {
        name: "prefault_1gib_nt_ms",
        value: ms(many),
        unit: "ms",
        reference: ms(one),
    });
    figures.push(Figure {
        name: "prefault_1gib_speedup_nt",
        value: one.as_secs_f64() / many.as_secs_f64().max(1e-9),
        unit: "x",
        reference: n as f64,
    });
}

/// Bytes held for one request of `bytes` with `conf` (addresses only: nothing is touched).
async fn held(bytes: u64, conf: &str) -> u64 {
    let backend = Arc::new(AccountingBackend::new(1, GIB).with_host_capacity(8 * GIB));
    let alloc = build(backend, conf);
    let host = alloc.host();
    let buf = host.malloc(bytes).await.expect("pinned malloc");
    let held = host.stats().await.expect("stats").reserved_bytes.current;
    drop(buf);
    let _ = alloc.shutdown().await;
    held
}

async fn rounding(figures: &mut Vec<Figure>) {
    let request = GIB + GIB / 10;
    let with = held(request, "").await;
    let without = held(request, "pinned_max_round_threshold_mb:0").await;
    figures.push(Figure {
        name: "pinned_held_1_1gib_ratio",
        value: with as f64 / request as f64,
        unit: "x",
        reference: without as f64 / request as f64,
    });
}
