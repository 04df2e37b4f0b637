//! Graph pools on the backend `GPUALLOC_BACKEND` names (the emulated driver in CI, a GPU in
//! scripts/gpu-check.sh, the sim by default), through the public API and the `Backend`
//! trait's copies alone (no kernels): a step with allocations, frees and a second stream
//! joined by an event replays 100 times with its pointers and correct data; a second graph
//! captured into the pool reuses its memory; another task's misses during a global capture
//! leave it valid. `GPUALLOC_TEST_DEVICE=N` runs on device N.

use std::sync::Arc;

use gpualloc::runtime::sim::{SimBackend, SimConfig};
use gpualloc::{
    Allocator, AllocatorConfig, BackendKind, CaptureMode, DeviceBuffer, DeviceId, GraphPool, Stream,
};
use gpualloc_runtime::{Backend, DevicePtr};

const MIB: u64 = 1 << 20;

fn dev() -> DeviceId {
    DeviceId(std::env::var("GPUALLOC_TEST_DEVICE").map_or(0, |d| d.parse().expect("an ordinal")))
}

fn alloc_from_env(conf: &str) -> Allocator {
    let kind = BackendKind::from_env().expect("GPUALLOC_BACKEND");
    let builder = Allocator::builder().config(AllocatorConfig::parse(conf).unwrap());
    let builder = match kind {
        BackendKind::Cuda => builder.backend(BackendKind::Cuda),
        _ => builder.backend_instance(SimBackend::new(SimConfig::fast(dev().0 + 1)).expect("sim")),
    };
    builder
        .build()
        .unwrap_or_else(|e| panic!("GPUALLOC_BACKEND={kind:?}: cannot build the allocator: {e}"))
}

fn copy(b: &Arc<dyn Backend>, s: &Stream, dst: DevicePtr, src: DevicePtr, len: u64) {
    // SAFETY: both sides are device memory of live buffers of this allocator.
    unsafe { b.memcpy_async(s.handle(), dst.0, src.0, len) }.unwrap();
}

fn read(b: &Arc<dyn Backend>, s: &Stream, p: DevicePtr, len: u64) -> Vec<u8> {
    let mut v = vec![0u8; len as usize];
    b.copy_from_device(s.handle(), &mut v, p).unwrap();
    v
}

/// Captures `out = inp` through two buffers allocated and freed in the capture, the second
/// on `s2` (forked and joined by events), and a memset of `mark`'s first 16 bytes.
async fn capture_step(
    alloc: &Allocator,
    pool: &GraphPool,
    (s, s2): (&Stream, &Stream),
    (inp, out, mark): (&DeviceBuffer, &DeviceBuffer, &DeviceBuffer),
) -> (gpualloc::Graph, DevicePtr, DevicePtr) {
    let b = alloc.backend().clone();
    let len = inp.len();
    let capture = pool
        .begin_capture(s, CaptureMode::ThreadLocal)
        .await
        .unwrap();
    let x = alloc.malloc(len, s).await.unwrap();
    copy(&b, s, x.ptr(), inp.ptr(), len);
    let fork = b.event_create(dev()).unwrap();
    b.event_record(fork, s.handle()).unwrap();
    b.stream_wait_event(s2.handle(), fork).unwrap();
    let y = alloc.malloc(len, s2).await.unwrap();
    copy(&b, s2, y.ptr(), x.ptr(), len);
    x.record_stream(s2).unwrap();
    b.memset_async(s2.handle(), mark.ptr(), 0x5A, 16).unwrap();
    let join = b.event_create(dev()).unwrap();
    b.event_record(join, s2.handle()).unwrap();
    b.stream_wait_event(s.handle(), join).unwrap();
    copy(&b, s, out.ptr(), y.ptr(), len);
    y.record_stream(s).unwrap();
    let (px, py) = (x.ptr(), y.ptr());
    drop((x, y));
    let graph = capture.end().await.unwrap();
    b.event_destroy(fork).unwrap();
    b.event_destroy(join).unwrap();
    (graph, px, py)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graph_pools_replay_share_and_survive_other_tasks() {
    for conf in ["expandable_segments:True", "expandable_segments:False"] {
        let alloc = alloc_from_env(conf);
        let b = alloc.backend().clone();
        let (s, s2, other) = (
            alloc.new_stream(dev()).unwrap(),
            alloc.new_stream(dev()).unwrap(),
            alloc.new_stream(dev()).unwrap(),
        );
        let len = 2 * MIB + 4096;
        let inp = alloc.malloc(len, &s).await.unwrap();
        let out = alloc.malloc(len, &s).await.unwrap();
        let mark = alloc.malloc(4096, &s).await.unwrap();
        let pool = alloc.graph_pool(dev()).await.unwrap();
        let bufs = (&inp, &out, &mark);
        let (g1, x1, y1) = capture_step(&alloc, &pool, (&s, &s2), bufs).await;
        for round in 0..100u8 {
            b.copy_to_device(s.handle(), inp.ptr(), &vec![round; len as usize])
                .unwrap();
            b.memset_async(s.handle(), mark.ptr(), 0, 16).unwrap();
            g1.launch(&s).unwrap();
            s.synchronize().unwrap();
            let got = read(&b, &s, out.ptr(), len);
            assert!(got.iter().all(|v| *v == round), "{conf}: launch {round}");
            assert_eq!(read(&b, &s, mark.ptr(), 16), vec![0x5A; 16], "{conf}");
        }
        // A second graph into the same pool: the same memory, none new.
        let reserved = alloc.stats(dev()).await.unwrap().reserved_bytes[0].current;
        let (g2, x2, y2) = capture_step(&alloc, &pool, (&s, &s2), bufs).await;
        assert_eq!((x2, y2), (x1, y1), "{conf}");
        assert_eq!(
            alloc.stats(dev()).await.unwrap().reserved_bytes[0].current,
            reserved
        );
        // Other tasks miss on another stream during a global capture: it stays valid.
        let capture = pool.begin_capture(&s, CaptureMode::Global).await.unwrap();
        b.memset_async(s.handle(), mark.ptr(), 0x33, 16).unwrap();
        let tasks: Vec<_> = (0..3u64)
            .map(|i| {
                let (alloc, other) = (alloc.clone(), other.clone());
                tokio::spawn(
                    async move { drop(alloc.malloc((24 + i) * MIB, &other).await.unwrap()) },
                )
            })
            .collect();
        for t in tasks {
            t.await.unwrap();
        }
        let g3 = capture.end().await.expect("the capture stayed valid");
        g3.launch(&s).unwrap();
        s.synchronize().unwrap();
        assert_eq!(read(&b, &s, mark.ptr(), 16), vec![0x33; 16], "{conf}");
        drop((g1, g2, g3, pool, inp, out, mark));
        alloc.shutdown().await.unwrap();
    }
}
