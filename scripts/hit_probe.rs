//! A hit-pair loop for `scripts/hit-probe.sh`: `hit_probe MODE N` runs N malloc/free pairs of
//! 4 KiB on one stream, all cache hits after the first, on the accounting backend (addresses
//! only), and prints the mean ns per pair. MODE is `core` (the device core alone, no actor),
//! `tc` (the allocator, thread cache on) or `gate` (the allocator, `thread_cache:False`).
//!
//! It uses only API that every revision since the thread cache has (the script copies it into
//! the revision's `examples/` to build it there), so a revision and the working tree run the
//! same loop. Not part of the library: it lives in `scripts/` and is built only by the script.

use std::sync::Arc;
use std::time::Instant;

use gpualloc::devices::DeviceCore;
use gpualloc::runtime::accounting::AccountingBackend;
use gpualloc::{Allocator, AllocatorConfig, Backend, DeviceId, Stream};

const SIZE: u64 = 4096;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let mode = args.get(1).map_or("tc", String::as_str);
    let n: u32 = args
        .get(2)
        .and_then(|s| s.parse().ok())
        .unwrap_or(1_000_000);
    let backend: Arc<dyn Backend> = Arc::new(AccountingBackend::new(1, 8 << 30));
    let ns = match mode {
        "core" => core_pairs(&backend, n),
        "tc" | "gate" => allocator_pairs(backend, mode == "tc", n),
        other => {
            eprintln!("hit_probe: unknown mode {other} (core, tc or gate)");
            std::process::exit(2);
        }
    };
    println!("{mode} {:.1}", ns / f64::from(n));
}

/// ns for `n` pairs on the device core alone.
fn core_pairs(backend: &Arc<dyn Backend>, n: u32) -> f64 {
    let mut core = DeviceCore::new(backend.clone(), DeviceId(0), AllocatorConfig::default())
        .expect("device core");
    let stream = Stream::new(backend, DeviceId(0)).expect("stream");
    let h = stream.handle();
    let start = Instant::now();
    for _ in 0..n {
        let a = core.malloc(SIZE, h).expect("malloc");
        core.free(a.ptr).expect("free");
    }
    start.elapsed().as_nanos() as f64
}

/// ns for `n` pairs through the allocator (malloc, then drop the buffer).
fn allocator_pairs(backend: Arc<dyn Backend>, thread_cache: bool, n: u32) -> f64 {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let alloc = Allocator::builder()
            .config(AllocatorConfig::default().with_thread_cache(thread_cache))
            .backend_instance(backend)
            .build()
            .expect("allocator");
        let stream = alloc.new_stream(DeviceId(0)).expect("stream");
        let start = Instant::now();
        for _ in 0..n {
            drop(alloc.malloc(SIZE, &stream).await.expect("malloc"));
        }
        let ns = start.elapsed().as_nanos() as f64;
        let _ = alloc.shutdown().await;
        ns
    })
}
