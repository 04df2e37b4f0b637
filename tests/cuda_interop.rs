//! cudarc interop on a real GPU (feature `cuda`): cudarc's memcpy and memset take a
//! `DeviceBuffer`, streams convert both ways, and a buffer used on a wrapped cudarc stream
//! with `record_stream` keeps its data. Skips with a printed reason where there is no GPU,
//! unless `GPUALLOC_REQUIRE_GPU=1` (scripts/gpu-check.sh), where that is a failure.
#![cfg(feature = "cuda")]

use std::sync::Arc;

use gpualloc::cudarc::driver::DevicePtr as _;
use gpualloc::{Allocator, AllocatorConfig, BackendKind, DeviceId};

const DEV: DeviceId = DeviceId(0);

fn cuda_alloc() -> Option<Allocator> {
    match Allocator::builder()
        .config(AllocatorConfig::default())
        .backend(BackendKind::Cuda)
        .build()
    {
        Ok(a) => Some(a),
        Err(e) if std::env::var("GPUALLOC_REQUIRE_GPU").is_ok_and(|v| v == "1") => {
            panic!("GPUALLOC_REQUIRE_GPU=1 but CUDA is unavailable: {e}")
        }
        Err(e) => {
            println!("skipped: no GPU ({e})");
            None
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cudarc_copies_into_and_out_of_device_buffers() {
    let Some(alloc) = cuda_alloc() else {
        return;
    };
    let s = alloc.new_stream(DEV).unwrap();
    let cu = alloc.to_cudarc_stream(&s).unwrap();
    assert_eq!(
        alloc
            .cuda()
            .unwrap()
            .cudarc_stream(s.handle())
            .unwrap()
            .cu_stream(),
        cu.cu_stream()
    );
    let data: Vec<u8> = (0..8192u32).map(|i| (i * 7 % 251) as u8).collect();
    let mut buf = alloc.malloc(data.len() as u64, &s).await.unwrap();
    assert!(Arc::ptr_eq(buf.cudarc_stream().unwrap(), &cu));
    cu.memcpy_htod(&data, &mut buf).unwrap();
    assert_eq!(cu.clone_dtoh(&buf).unwrap(), data);
    let (ptr, _sync) = buf.device_ptr(&cu);
    assert_eq!(ptr, buf.ptr().0);
    drop(_sync);
    cu.memset_zeros(&mut buf).unwrap();
    assert_eq!(cu.clone_dtoh(&buf).unwrap(), vec![0u8; data.len()]);

    // A cudarc stream of the same context, wrapped: allocate on it, copy across streams,
    // record the cross-stream use.
    let ctx = alloc.cudarc_context(DEV).unwrap();
    let theirs = ctx.new_stream().unwrap();
    let wrapped = alloc.wrap_cudarc_stream(&theirs).unwrap();
    assert!(Arc::ptr_eq(
        &alloc.to_cudarc_stream(&wrapped).unwrap(),
        &theirs
    ));
    cu.memcpy_htod(&data, &mut buf).unwrap();
    let mut copy = alloc.malloc(data.len() as u64, &wrapped).await.unwrap();
    theirs.memcpy_dtod(&buf, &mut copy).unwrap();
    buf.record_stream(&wrapped).unwrap();
    drop(buf);
    assert_eq!(theirs.clone_dtoh(&copy).unwrap(), data);
    drop(copy);
    drop(wrapped);
    alloc.empty_cache().await.unwrap();
    assert_eq!(alloc.stats(DEV).await.unwrap().reserved_bytes[0].current, 0);
    alloc.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graphs_captured_through_a_graph_pool_or_cudarc_run_on_allocator_buffers() {
    use gpualloc::cudarc::driver::sys;
    use gpualloc::CaptureMode;
    let Some(alloc) = cuda_alloc() else {
        return;
    };
    let s = alloc.new_stream(DEV).unwrap();
    let cu = alloc.to_cudarc_stream(&s).unwrap();
    let data: Vec<u8> = (0..4096u32).map(|i| (i * 13 % 251) as u8).collect();
    let mut src = alloc.malloc(4096, &s).await.unwrap();
    cu.memcpy_htod(&data, &mut src).unwrap();
    cu.synchronize().unwrap();

    // Our capture API, cudarc's work inside it: the buffer comes from the graph pool.
    let pool = alloc.graph_pool(DEV).await.unwrap();
    let capture = pool
        .begin_capture(&s, CaptureMode::ThreadLocal)
        .await
        .unwrap();
    let mut dst = alloc.malloc(4096, &s).await.unwrap();
    cu.memcpy_dtod(&src, &mut dst).unwrap();
    let graph = capture.end().await.unwrap();
    graph.launch(&s).unwrap();
    s.synchronize().unwrap();
    assert_eq!(cu.clone_dtoh(&dst).unwrap(), data);

    // cudarc's own capture with the allocator's buffers (one the allocator is not told of):
    // a miss during it leaves it valid; the graph runs. Thread-local: the other test of this
    // binary runs beside it on the same driver, and its synchronous copies would invalidate
    // a global capture, as they would on a GPU (the allocator's own calls during a global
    // capture are tested where nothing else runs: tests/graphs_env.rs, tests/graphs.rs).
    cu.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .unwrap();
    cu.memset_zeros(&mut dst).unwrap();
    let big = alloc.malloc(48 << 20, &s).await.unwrap();
    let g = cu
        .end_capture(sys::CUgraphInstantiate_flags(0))
        .expect("the capture stayed valid")
        .expect("a graph");
    assert_eq!(
        cu.clone_dtoh(&dst).unwrap(),
        data,
        "captured work ran early"
    );
    g.launch().unwrap();
    cu.synchronize().unwrap();
    assert_eq!(cu.clone_dtoh(&dst).unwrap(), vec![0u8; 4096]);
    drop((g, graph, big, dst, src, pool));
    alloc.shutdown().await.unwrap();
}
