//! CUDA graphs (section `graphs`), on the sim (zero latency) or on the GPU with
//! `GPUALLOC_BACKEND=cuda`:
//!
//! - `graphs_8_shared_pool_reserved_mib`: memory reserved by 8 decode-step graphs (batch
//!   buckets 1 to 128, as a serving engine captures them, largest first) captured into one
//!   graph pool, vs one pool each (the reference). Each step runs 4 layers; a layer
//!   allocates two temporaries and an activation (`batch` x 512 KiB, 1 MiB and 256 KiB),
//!   frees the first temporary, then the previous activation and the second temporary.
//! - `graph_launch_ns`: one launch of the batch-8 graph (the step's 12 allocations and frees
//!   captured, 12 memsets of 16 bytes), vs the same step run eagerly through the allocator
//!   (its allocations all cache hits); `graph_launch_allocations`: allocator requests during
//!   1,000 launches (0), vs the eager steps' (12,000).

use std::sync::Arc;
use std::time::Instant;

use gpualloc::runtime::sim::{SimBackend, SimConfig};
use gpualloc::{Allocator, AllocatorConfig, Backend, CaptureMode, DeviceId, GraphPool, Stream};

use super::{cuda, on_cuda, Figure, MIB};

const KIB: u64 = 1 << 10;
const BATCHES: [u64; 8] = [128, 64, 32, 16, 8, 4, 2, 1];
const LAYERS: usize = 4;
const LAUNCHES: u64 = 1000;

fn backend() -> Arc<dyn Backend> {
    if on_cuda() {
        return cuda();
    }
    match SimBackend::new(SimConfig::fast(1)) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("bench: {e}");
            std::process::exit(2);
        }
    }
}

/// One decode step of `batch` (see the module docs): 12 allocations, each touched.
async fn step(alloc: &Allocator, s: &Stream, batch: u64) {
    let touch = |p: gpualloc::DevicePtr| {
        alloc
            .backend()
            .memset_async(s.handle(), p, 1, 16)
            .expect("memset");
    };
    let mut act: Option<gpualloc::DeviceBuffer> = None;
    for _ in 0..LAYERS {
        let t1 = alloc.malloc(batch * 512 * KIB, s).await.expect("malloc");
        touch(t1.ptr());
        let t2 = alloc.malloc(batch * MIB, s).await.expect("malloc");
        touch(t2.ptr());
        drop(t1);
        let h = alloc.malloc(batch * 256 * KIB, s).await.expect("malloc");
        touch(h.ptr());
        drop(act.replace(h));
        drop(t2);
    }
}

async fn capture(alloc: &Allocator, pool: &GraphPool, s: &Stream, batch: u64) -> gpualloc::Graph {
    let c = pool
        .begin_capture(s, CaptureMode::Relaxed)
        .await
        .expect("begin_capture");
    step(alloc, s, batch).await;
    c.end().await.expect("end of capture")
}

fn build(backend: Arc<dyn Backend>) -> Allocator {
    match Allocator::builder()
        .config(AllocatorConfig::default())
        .backend_instance(backend)
        .build()
    {
        Ok(a) => a,
        Err(e) => {
            eprintln!("bench: {e}");
            std::process::exit(2);
        }
    }
}

async fn reserved(alloc: &Allocator) -> f64 {
    let st = alloc.stats(DeviceId(0)).await.expect("stats");
    st.reserved_bytes[0].current as f64 / MIB as f64
}

pub(crate) async fn graph_figures(figures: &mut Vec<Figure>) {
    // One pool for all eight graphs, then one pool each, each on an allocator of its own.
    let shared = {
        let alloc = build(backend());
        let s = alloc.new_stream(DeviceId(0)).expect("stream");
        let pool = alloc.graph_pool(DeviceId(0)).await.expect("graph pool");
        let mut graphs = Vec::new();
        for b in BATCHES {
            graphs.push(capture(&alloc, &pool, &s, b).await);
        }
        let r = reserved(&alloc).await;
        drop((graphs, pool));
        let _ = alloc.shutdown().await;
        r
    };
    let separate = {
        let alloc = build(backend());
        let s = alloc.new_stream(DeviceId(0)).expect("stream");
        let mut graphs = Vec::new();
        for b in BATCHES {
            let pool = alloc.graph_pool(DeviceId(0)).await.expect("graph pool");
            graphs.push(capture(&alloc, &pool, &s, b).await);
        }
        let r = reserved(&alloc).await;
        drop(graphs);
        let _ = alloc.shutdown().await;
        r
    };
    figures.push(Figure {
        name: "graphs_8_shared_pool_reserved_mib",
        value: shared,
        unit: "MiB",
        reference: separate,
    });

    // The replay: launches of the batch-8 graph against eager steps.
    let alloc = build(backend());
    let s = alloc.new_stream(DeviceId(0)).expect("stream");
    let pool = alloc.graph_pool(DeviceId(0)).await.expect("graph pool");
    let graph = capture(&alloc, &pool, &s, 8).await;
    let requests = |st: &gpualloc::DeviceStats| st.allocation[0].allocated;
    step(&alloc, &s, 8).await; // warm the default pools
    s.synchronize().expect("sync");
    let before = requests(&alloc.stats(DeviceId(0)).await.expect("stats"));
    let t = Instant::now();
    for _ in 0..LAUNCHES {
        step(&alloc, &s, 8).await;
    }
    s.synchronize().expect("sync");
    let eager = t.elapsed().as_secs_f64() * 1e9 / LAUNCHES as f64;
    let mid = requests(&alloc.stats(DeviceId(0)).await.expect("stats"));
    let t = Instant::now();
    for _ in 0..LAUNCHES {
        graph.launch(&s).expect("launch");
    }
    s.synchronize().expect("sync");
    let launch = t.elapsed().as_secs_f64() * 1e9 / LAUNCHES as f64;
    let after = requests(&alloc.stats(DeviceId(0)).await.expect("stats"));
    figures.push(Figure {
        name: "graph_launch_ns",
        value: launch,
        unit: "ns",
        reference: eager,
    });
    figures.push(Figure {
        name: "graph_launch_allocations",
        value: (after - mid) as f64,
        unit: "requests",
        reference: (mid - before) as f64,
    });
    drop((graph, pool));
    let _ = alloc.shutdown().await;
}
