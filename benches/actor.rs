//! Criterion benchmark of the cache-hit fast path: malloc + drop through the allocator (the
//! default, whose thread cache serves this loop, and `thread_cache:False`, through the
//! actor's gate) vs a direct call of the same core (accounting backend: no memory behind
//! addresses).
//! The `bench` binary prints the same figures with their ratios, plus the contention ones.

// criterion's macros generate undocumented items.
#![allow(missing_docs)]

use std::sync::Arc;
use std::time::Instant;

use criterion::{criterion_group, criterion_main, Criterion};
use gpualloc::devices::DeviceCore;
use gpualloc::runtime::accounting::AccountingBackend;
use gpualloc::{Allocator, AllocatorConfig, Backend, DeviceId, Stream};

const SIZE: u64 = 4096;

fn hit_pair(c: &mut Criterion) {
    let mut group = c.benchmark_group("hit_pair");

    let backend: Arc<dyn Backend> = Arc::new(AccountingBackend::new(1, 1 << 40));
    let mut core =
        DeviceCore::new(backend.clone(), DeviceId(0), AllocatorConfig::default()).unwrap();
    let stream = Stream::new(&backend, DeviceId(0)).unwrap();
    let h = stream.handle();
    group.bench_function("direct_core", |b| {
        b.iter(|| {
            let a = core.malloc(SIZE, h).unwrap();
            core.free(a.ptr).unwrap();
        })
    });

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    for (name, thread_cache) in [("thread_cache", true), ("gate", false)] {
        let alloc = rt.block_on(async {
            Allocator::builder()
                .config(AllocatorConfig::default().with_thread_cache(thread_cache))
                .backend_instance(Arc::new(AccountingBackend::new(1, 1 << 40)))
                .build()
                .unwrap()
        });
        let stream = alloc.new_stream(DeviceId(0)).unwrap();
        group.bench_function(name, |b| {
            b.iter_custom(|iters| {
                rt.block_on(async {
                    let t = Instant::now();
                    for _ in 0..iters {
                        drop(alloc.malloc(SIZE, &stream).await.unwrap());
                    }
                    t.elapsed()
                })
            })
        });
        rt.block_on(alloc.shutdown()).unwrap();
    }
    group.finish();
}

criterion_group!(benches, hit_pair);
criterion_main!(benches);
