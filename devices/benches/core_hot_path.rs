//! Criterion bench of the core's hot path: a cache-hit malloc + free on one stream, with
//! and without a split, called directly on the core (no actor).

// criterion's macros generate undocumented functions.
#![allow(missing_docs)]

use std::hint::black_box;
use std::sync::Arc;

use criterion::{criterion_group, criterion_main, Criterion};
use gpualloc_accounting::AccountingBackend;
use gpualloc_devices::{AllocatorConfig, DeviceCore};
use gpualloc_runtime::{Backend, DeviceId};

fn hot_path(c: &mut Criterion) {
    let backend: Arc<dyn Backend> = Arc::new(AccountingBackend::new(1, 64 << 30));
    let stream = backend.stream_create(DeviceId(0)).expect("stream");
    let mut core = DeviceCore::new(backend, DeviceId(0), AllocatorConfig::default()).expect("core");
    // Warm the cache with a spread of sizes so lookups walk a realistic tree.
    let warm: Vec<_> = (1..200u64)
        .map(|i| core.malloc(i * 4096, stream).expect("warm"))
        .collect();
    for a in &warm {
        core.free(a.ptr).expect("free");
    }
    c.bench_function("core_hit_malloc_free_small_split", |b| {
        b.iter(|| {
            let a = core.malloc(black_box(4096), stream).expect("hit");
            core.free(a.ptr).expect("free");
        })
    });
    let big = core.malloc(64 << 20, stream).expect("big");
    core.free(big.ptr).expect("free");
    c.bench_function("core_hit_malloc_free_large_whole", |b| {
        b.iter(|| {
            let a = core.malloc(black_box(64 << 20), stream).expect("hit");
            core.free(a.ptr).expect("free");
        })
    });
}

criterion_group!(benches, hot_path);
criterion_main!(benches);
