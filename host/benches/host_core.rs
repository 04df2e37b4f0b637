//! Benchmarks of the pinned-host core: the cache-hit malloc + free round trip, and the
//! register path's parallel prefault of 256 MiB of fresh pages with 1 thread vs N.
//!
//! `GPUALLOC_PREFAULT_THREADS` (default: the available parallelism, at least 2) sets N.

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{criterion_main, BenchmarkId, Criterion, Throughput};
use gpualloc_accounting::AccountingBackend;
use gpualloc_host::mapping::PageMapping;
use gpualloc_host::{prefault, HostConfig, HostCore, MonotonicClock};

fn cache_hit(c: &mut Criterion) {
    let backend = Arc::new(AccountingBackend::new(1, 1 << 30));
    let mut core = HostCore::new(
        backend,
        HostConfig::default(),
        Arc::new(MonotonicClock::new()),
    )
    .unwrap();
    let mut g = c.benchmark_group("host_core");
    for size in [4096u64, 1 << 20] {
        let warm = core.malloc(size).unwrap();
        core.free(warm.ptr).unwrap();
        g.bench_with_input(
            BenchmarkId::new("cache_hit_malloc_free", size),
            &size,
            |b, &size| {
                b.iter(|| {
                    let blk = core.malloc(black_box(size)).unwrap();
                    core.free(black_box(blk.ptr)).unwrap();
                })
            },
        );
    }
    g.finish();
}

fn prefault_threads() -> usize {
    std::env::var("GPUALLOC_PREFAULT_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| {
            std::thread::available_parallelism()
                .map_or(2, |n| n.get())
                .max(2)
        })
}

fn prefault_256mib(c: &mut Criterion) {
    const LEN: usize = 256 << 20;
    let mut g = c.benchmark_group("prefault_256MiB");
    g.sample_size(10)
        .measurement_time(Duration::from_secs(8))
        .throughput(Throughput::Bytes(LEN as u64));
    for threads in [1, prefault_threads()] {
        g.bench_with_input(
            BenchmarkId::from_parameter(threads),
            &threads,
            |b, &threads| {
                // Each iteration faults fresh pages: map, time only the prefault, unmap.
                b.iter_custom(|iters| {
                    let mut total = Duration::ZERO;
                    for _ in 0..iters {
                        let mut m = PageMapping::new(LEN).unwrap();
                        let t0 = Instant::now();
                        black_box(prefault(m.as_mut_slice(), threads));
                        total += t0.elapsed();
                    }
                    total
                })
            },
        );
    }
    g.finish();
}

mod group {
    use super::{cache_hit, prefault_256mib};
    criterion::criterion_group!(benches, cache_hit, prefault_256mib);
}
criterion_main!(group::benches);
