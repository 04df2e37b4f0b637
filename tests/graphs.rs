//! CUDA graphs through the public API, on the simulated GPU: a captured step replays with its
//! pointers and correct data, graph pools share memory, the allocator never invalidates a
//! capture, and nothing leaks whatever is dropped first.

use std::sync::Arc;
use std::time::Duration;

use gpualloc::{AllocError, Allocator, CaptureError, CaptureMode, DeviceBuffer, Error, Stream};
use gpualloc_runtime::{Backend, DeviceId, DevicePtr};
use gpualloc_sim::{Op, SimBackend, SimConfig};

const MIB: u64 = 1 << 20;
const D0: DeviceId = DeviceId(0);

const CONFIGS: [&str; 3] = [
    "expandable_segments:True",
    "expandable_segments:False,garbage_collection_threshold:0.6",
    "thread_cache:False",
];

fn build(conf: &str) -> (Arc<SimBackend>, Allocator) {
    let sim = SimBackend::new(SimConfig {
        capacity_per_device: 1 << 30,
        ..SimConfig::fast(1)
    })
    .unwrap();
    let alloc = Allocator::builder()
        .backend_instance(sim.clone() as Arc<dyn Backend>)
        .config_str(conf)
        .build()
        .unwrap();
    (sim, alloc)
}

fn read(sim: &SimBackend, s: &Stream, p: DevicePtr, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    sim.copy_from_device(s.handle(), &mut v, p).unwrap();
    v
}

/// A kernel on `s`: `dst[i] = src[i] + 1` over `len` bytes.
fn add_one(sim: &SimBackend, s: &Stream, src: DevicePtr, dst: DevicePtr, len: u64) {
    sim.launch_kernel_touching(
        s.handle(),
        Duration::ZERO,
        &[(src, len), (dst, len)],
        move |m| {
            let v: Vec<u8> = m
                .read(src, len)?
                .iter()
                .map(|b| b.wrapping_add(1))
                .collect();
            m.write(dst, &v)
        },
    )
    .unwrap();
}

/// One decode step captured on `s` with a fork to `s2`: `out = (inp + 1) + 1`, through two
/// buffers allocated (and freed) during the capture. Returns the graph and the captured
/// buffers' pointers.
async fn capture_step(
    sim: &SimBackend,
    alloc: &Allocator,
    pool: &gpualloc::GraphPool,
    s: &Stream,
    s2: &Stream,
    inp: &DeviceBuffer,
    out: &DeviceBuffer,
) -> (gpualloc::Graph, DevicePtr, DevicePtr) {
    let len = inp.len();
    let capture = pool
        .begin_capture(s, CaptureMode::ThreadLocal)
        .await
        .unwrap();
    let a = alloc.malloc(len, s).await.unwrap();
    add_one(sim, s, inp.ptr(), a.ptr(), len);
    let fork = sim.event_create(D0).unwrap();
    sim.event_record(fork, s.handle()).unwrap();
    sim.stream_wait_event(s2.handle(), fork).unwrap();
    let b = alloc.malloc(len, s2).await.unwrap();
    add_one(sim, s2, a.ptr(), b.ptr(), len);
    a.record_stream(s2).unwrap();
    let join = sim.event_create(D0).unwrap();
    sim.event_record(join, s2.handle()).unwrap();
    sim.stream_wait_event(s.handle(), join).unwrap();
    sim.memcpy_async(s.handle(), out.ptr().0, b.ptr().0, len)
        .unwrap();
    b.record_stream(s).unwrap();
    let (pa, pb) = (a.ptr(), b.ptr());
    drop(a);
    drop(b);
    let graph = capture.end().await.unwrap();
    sim.event_destroy(fork).unwrap();
    sim.event_destroy(join).unwrap();
    (graph, pa, pb)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_captured_step_replays_100_times_with_its_pointers_and_correct_data() {
    for conf in CONFIGS {
        let (sim, alloc) = build(conf);
        let s = alloc.new_stream(D0).unwrap();
        let s2 = alloc.new_stream(D0).unwrap();
        let len = 64 * 1024;
        let inp = alloc.malloc(len, &s).await.unwrap();
        let out = alloc.malloc(len, &s).await.unwrap();
        let pool = alloc.graph_pool(D0).await.unwrap();
        let (graph, pa, pb) = capture_step(&sim, &alloc, &pool, &s, &s2, &inp, &out).await;
        assert_ne!(pa, pb, "{conf}");
        // The captured buffers' memory is the pool's: requests outside it never get it.
        let mut outside = Vec::new();
        for _ in 0..8 {
            let x = alloc.malloc(len, &s).await.unwrap();
            let y = alloc.malloc(len, &s2).await.unwrap();
            for p in [x.ptr(), y.ptr()] {
                for captured in [pa, pb] {
                    assert!(
                        p.0 + len <= captured.0 || captured.0 + len <= p.0,
                        "{conf}: {p} overlaps the graph's {captured}"
                    );
                }
            }
            outside.push(x);
            outside.push(y);
        }
        // A replay makes no allocator request and no memory call of the driver.
        let requests = alloc.stats(D0).await.unwrap().allocation[0].allocated;
        sim.reset_counts();
        for round in 0..100u8 {
            let input = vec![round; len as usize];
            sim.copy_to_device(s.handle(), inp.ptr(), &input).unwrap();
            graph.launch(&s).unwrap();
            s.synchronize().unwrap();
            let got = read(&sim, &s, out.ptr(), len as usize);
            assert!(
                got.iter().all(|v| *v == round.wrapping_add(2)),
                "{conf}: launch {round}"
            );
        }
        assert_eq!(
            alloc.stats(D0).await.unwrap().allocation[0].allocated,
            requests,
            "{conf}"
        );
        let calls = sim.counts();
        assert_eq!(
            (
                calls.get(Op::Malloc),
                calls.get(Op::Map),
                calls.get(Op::Free)
            ),
            (0, 0, 0),
            "{conf}"
        );
        assert_eq!(calls.get(Op::GraphLaunch), 100, "{conf}");
        drop((graph, pool, outside, inp, out));
        alloc.shutdown().await.unwrap();
        assert_eq!(sim.live_graphs(), (0, 0), "{conf}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_graph_captured_into_the_same_pool_reuses_its_memory() {
    for conf in CONFIGS {
        let (sim, alloc) = build(conf);
        let s = alloc.new_stream(D0).unwrap();
        let s2 = alloc.new_stream(D0).unwrap();
        let len = 3 * MIB;
        let inp = alloc.malloc(len, &s).await.unwrap();
        let out = alloc.malloc(len, &s).await.unwrap();
        let pool = alloc.graph_pool(D0).await.unwrap();
        let (g1, a1, b1) = capture_step(&sim, &alloc, &pool, &s, &s2, &inp, &out).await;
        let reserved = alloc.stats(D0).await.unwrap().reserved_bytes[0].current;
        let (g2, a2, b2) = capture_step(&sim, &alloc, &pool, &s, &s2, &inp, &out).await;
        assert_eq!(
            (a2, b2),
            (a1, b1),
            "{conf}: the second capture got the first one's memory"
        );
        assert_eq!(
            alloc.stats(D0).await.unwrap().reserved_bytes[0].current,
            reserved,
            "{conf}: no new memory for the second graph"
        );
        // Graphs sharing a pool run one after another.
        for (g, v) in [(&g1, 10u8), (&g2, 20)] {
            sim.copy_to_device(s.handle(), inp.ptr(), &vec![v; len as usize])
                .unwrap();
            g.launch(&s).unwrap();
            s.synchronize().unwrap();
            assert_eq!(read(&sim, &s, out.ptr(), 16), vec![v + 2; 16], "{conf}");
        }
        drop((g1, g2, pool, inp, out));
        alloc.shutdown().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_task_missing_during_a_global_capture_does_not_invalidate_it() {
    for conf in CONFIGS {
        let (sim, alloc) = build(conf);
        let s = alloc.new_stream(D0).unwrap();
        let other = alloc.new_stream(D0).unwrap();
        let pool = alloc.graph_pool(D0).await.unwrap();
        let capture = pool.begin_capture(&s, CaptureMode::Global).await.unwrap();
        let a = alloc.malloc(MIB, &s).await.unwrap();
        sim.memset_async(s.handle(), a.ptr(), 7, MIB).unwrap();
        // Misses on another stream, from other tasks: segment mallocs, maps, frees.
        let tasks: Vec<_> = (0..4u64)
            .map(|i| {
                let (alloc, other) = (alloc.clone(), other.clone());
                tokio::spawn(async move {
                    let big = alloc.malloc((40 + i) * MIB, &other).await.unwrap();
                    drop(big);
                })
            })
            .collect();
        for t in tasks {
            t.await.unwrap();
        }
        let graph = capture.end().await.expect("the capture stayed valid");
        graph.launch(&s).unwrap();
        s.synchronize().unwrap();
        assert_eq!(read(&sim, &s, a.ptr(), 4), vec![7; 4], "{conf}");
        drop((graph, a, pool));
        alloc.shutdown().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_synchronizes_is_refused_during_a_capture_and_a_dropped_capture_ends_it() {
    let (sim, alloc) = build("expandable_segments:True");
    let s = alloc.new_stream(D0).unwrap();
    let pool = alloc.graph_pool(D0).await.unwrap();
    let capture = pool
        .begin_capture(&s, CaptureMode::ThreadLocal)
        .await
        .unwrap();
    assert_eq!(
        alloc.empty_cache().await,
        Err(Error::Alloc(AllocError::CaptureUnderway("empty_cache")))
    );
    // A second capture of the same stream is the driver's error.
    assert!(pool
        .begin_capture(&s, CaptureMode::ThreadLocal)
        .await
        .is_err());
    drop(capture);
    assert!(!sim
        .stream_capture_status(s.handle())
        .unwrap()
        .is_capturing());
    alloc.empty_cache().await.unwrap();
    // The stream works as before, thread cache included.
    let a = alloc.malloc(MIB, &s).await.unwrap();
    let p = a.ptr();
    drop(a);
    assert_eq!(alloc.malloc(MIB, &s).await.unwrap().ptr(), p);
    // A capture the driver invalidated fails at its end with the driver's error.
    let capture = pool.begin_capture(&s, CaptureMode::Global).await.unwrap();
    assert!(sim.stream_synchronize(s.handle()).is_err());
    let err = capture.end().await.unwrap_err();
    assert_eq!(
        err,
        Error::Backend(gpualloc_runtime::BackendError::Capture(
            CaptureError::Invalidated
        ))
    );
    alloc.empty_cache().await.unwrap();
    alloc.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malloc_in_a_capture_of_the_users_own_gets_pytorchs_behaviour() {
    let (sim, alloc) = build("expandable_segments:False");
    let s = alloc.new_stream(D0).unwrap();
    sim.stream_begin_capture(s.handle(), CaptureMode::Global)
        .unwrap();
    // Served from the default pools (a miss: the segment malloc runs relaxed).
    let a = alloc.malloc(5 * MIB, &s).await.unwrap();
    let g = sim
        .stream_end_capture(s.handle())
        .expect("the allocator kept the capture valid");
    sim.graph_destroy(g).unwrap();
    let stats = alloc.stats(D0).await.unwrap();
    assert_eq!(stats.allocated_bytes[0].current, 5 * MIB);
    drop(a);
    alloc.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_leaks_whatever_is_dropped_first() {
    // Pool, graph and buffers dropped in each order; then empty_cache gives everything back.
    for order in 0..3 {
        for conf in CONFIGS {
            let (sim, alloc) = build(conf);
            let s = alloc.new_stream(D0).unwrap();
            let pool = alloc.graph_pool(D0).await.unwrap();
            let capture = pool
                .begin_capture(&s, CaptureMode::ThreadLocal)
                .await
                .unwrap();
            let kept = alloc.malloc(3 * MIB, &s).await.unwrap();
            let temp = alloc.malloc(5 * MIB, &s).await.unwrap();
            sim.memset_async(s.handle(), kept.ptr(), 1, 16).unwrap();
            drop(temp);
            let graph = capture.end().await.unwrap();
            match order {
                0 => drop((pool, graph, kept)),
                1 => drop((kept, graph, pool)),
                _ => {
                    drop(graph);
                    drop(kept);
                    drop(pool);
                }
            }
            // The pool's release runs off the caller's thread: wait for it.
            let mut reserved = u64::MAX;
            for _ in 0..200 {
                alloc.empty_cache().await.unwrap();
                reserved = alloc.stats(D0).await.unwrap().reserved_bytes[0].current;
                if reserved == 0 {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            assert_eq!(reserved, 0, "order {order}, {conf}");
            assert_eq!(sim.live_graphs(), (0, 0), "order {order}, {conf}");
            alloc.shutdown().await.unwrap();
            assert_eq!(sim.used_bytes(D0).unwrap(), 0, "order {order}, {conf}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_named_pool_cannot_sleep_while_a_capture_into_it_or_a_graph_of_it_lives() {
    use gpualloc::{PoolOptions, SleepMode};
    let (sim, alloc) = build("expandable_segments:True");
    let s = alloc.new_stream(D0).unwrap();
    let pool = alloc.pool("decode", PoolOptions::default()).await.unwrap();
    let capture = pool
        .begin_capture(&s, CaptureMode::ThreadLocal)
        .await
        .unwrap();
    let a = alloc.malloc(3 * MIB, &s).await.unwrap();
    assert_eq!(pool.usage(D0).await.unwrap().allocated[0].current, 3 * MIB);
    let in_graph = |graphs, capturing| {
        Err(Error::Alloc(AllocError::PoolInGraph {
            pool: "decode".into(),
            graphs,
            capturing,
        }))
    };
    assert_eq!(pool.sleep(SleepMode::Discard).await, in_graph(0, true));
    sim.memset_async(s.handle(), a.ptr(), 9, 16).unwrap();
    let graph = capture.end().await.unwrap();
    assert_eq!(graph.pool_id(), pool.id(D0).unwrap());
    assert_eq!(pool.sleep(SleepMode::Discard).await, in_graph(1, false));
    graph.launch(&s).unwrap();
    s.synchronize().unwrap();
    drop(graph);
    drop(a);
    pool.sleep(SleepMode::Discard).await.unwrap();
    pool.wake().await.unwrap();
    alloc.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshots_stats_and_the_history_show_a_graph_pool_as_a_pool() {
    use gpualloc::HistoryOptions;
    let (_sim, alloc) = build("expandable_segments:True");
    let s = alloc.new_stream(D0).unwrap();
    alloc
        .record_history(HistoryOptions::default())
        .await
        .unwrap();
    let pool = alloc.graph_pool(D0).await.unwrap();
    let capture = pool
        .begin_capture(&s, CaptureMode::ThreadLocal)
        .await
        .unwrap();
    let a = alloc.malloc(3 * MIB, &s).await.unwrap();
    let graph = capture.end().await.unwrap();
    let snap = &alloc.snapshot().await.unwrap()[0];
    let id = pool.id().0;
    let seg = snap
        .segments
        .iter()
        .find(|seg| seg.address <= a.ptr().0 && a.ptr().0 < seg.address + seg.total_size)
        .expect("the buffer's segment");
    assert_eq!(seg.pool_id, (0, id), "segment_pool_id names the graph pool");
    let alloc_entry = snap
        .trace
        .iter()
        .find(|e| e.addr == a.ptr().0 && e.action == gpualloc::devices::trace::TraceAction::Alloc)
        .expect("the history has the allocation");
    assert_eq!(alloc_entry.pool, id);
    assert_eq!(
        alloc.stats(D0).await.unwrap().allocated_bytes[0].current,
        3 * MIB,
        "the device's statistics count the pool"
    );
    drop((graph, a, pool));
    alloc.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_strict_capture_ended_on_another_thread_is_the_drivers_wrong_thread_error() {
    let (sim, alloc) = build("expandable_segments:True");
    let s = alloc.new_stream(D0).unwrap();
    let pool = alloc.graph_pool(D0).await.unwrap();
    let capture = pool
        .begin_capture(&s, CaptureMode::ThreadLocal)
        .await
        .unwrap();
    // Ended from another OS thread, as a task that moved would.
    let ended = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        rt.block_on(capture.end()).map(drop)
    })
    .join()
    .unwrap();
    assert_eq!(
        ended,
        Err(Error::Backend(gpualloc_runtime::BackendError::Capture(
            CaptureError::WrongThread
        )))
    );
    // The allocator forgot it (empty_cache works again); the stream still captures, until
    // ended on its thread.
    alloc.empty_cache().await.unwrap();
    assert!(sim
        .stream_capture_status(s.handle())
        .unwrap()
        .is_capturing());
    let g = sim.stream_end_capture(s.handle()).unwrap();
    sim.graph_destroy(g).unwrap();
    // A relaxed capture ends from any thread.
    let capture = pool.begin_capture(&s, CaptureMode::Relaxed).await.unwrap();
    let graph = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        rt.block_on(capture.end())
    })
    .join()
    .unwrap()
    .expect("a relaxed capture ends anywhere");
    graph.launch(&s).unwrap();
    s.synchronize().unwrap();
    drop((graph, pool));
    alloc.shutdown().await.unwrap();
}
