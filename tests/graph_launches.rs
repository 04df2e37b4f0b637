//! A graph's memory stays where its work can reach it while the graph lives and while its
//! launches run, on whichever stream they were launched: dropping the graph, its pool or its
//! capture stream, putting a named pool to sleep, a request at the pool's quota and a
//! `use_on_oom` loan never take it from under a launch.
//!
//! The allocator never sees a launch (it makes no allocator call), and the pool's segments
//! belong to the capture's streams: a release that synchronizes those streams alone (an
//! unmap) would free memory a launch on another stream still writes. On the sim such a write
//! is a kernel failure (`kernel_failures`); on a GPU, an illegal address or a write into memory
//! mapped again for someone else.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{build, sim, MIB};
use gpualloc::runtime::sim::{Op, SimBackend};
use gpualloc::{
    AllocError, Allocator, Backend, Capture, CaptureMode, DeviceId, DevicePtr, Error, Graph, Pool,
    PoolOptions, SleepMode, Stream,
};

const D0: DeviceId = DeviceId(0);

const CONFIGS: [&str; 3] = [
    "expandable_segments:True",
    "expandable_segments:False,garbage_collection_threshold:0.6",
    "thread_cache:False",
];

/// A kernel on `s` that takes `dur`, then writes `v` over `len` bytes at `p`.
fn slow_fill(sim: &SimBackend, s: &Stream, p: DevicePtr, len: u64, v: u8, dur: Duration) {
    sim.launch_kernel_touching(s.handle(), dur, &[(p, len)], move |m| {
        m.write(p, &vec![v; len as usize])
    })
    .unwrap();
}

/// Fills `len` bytes at `p` with 5 on `s`, then reads them back in a 300 ms kernel there
/// that fails (`kernel_failures`) if they changed meanwhile.
fn fill_then_read_slowly(sim: &SimBackend, s: &Stream, p: DevicePtr, len: u64) {
    slow_fill(sim, s, p, len, 5, Duration::ZERO);
    sim.launch_kernel_touching(
        s.handle(),
        Duration::from_millis(300),
        &[(p, len)],
        move |m| {
            assert!(m.check(p, len, 5)?, "overwritten before it was read");
            Ok(())
        },
    )
    .unwrap();
}

/// What holds the pool a graph was captured into, for the test to drop.
enum Holder {
    Graph(gpualloc::GraphPool),
    Named(gpualloc::Pool),
}

impl Holder {
    fn id(&self) -> gpualloc::MemPoolId {
        match self {
            Holder::Graph(g) => g.id(),
            Holder::Named(p) => p.id(D0).unwrap(),
        }
    }
}

/// Captures on `s`, into a graph pool (`named`: false) or a named pool, a step that allocates
/// `len` bytes, fills them with 7 in a kernel of `dur`, and frees them (the graph keeps the
/// memory: its pointer is baked in). Returns the graph, the pool's holder and the pointer.
async fn capture_fill(
    sim: &SimBackend,
    alloc: &Allocator,
    named: Option<PoolOptions>,
    s: &Stream,
    len: u64,
    dur: Duration,
) -> (Graph, Holder, DevicePtr) {
    let (holder, capture) = match named {
        None => {
            let pool = alloc.graph_pool(D0).await.unwrap();
            let c = pool.begin_capture(s, CaptureMode::Relaxed).await.unwrap();
            (Holder::Graph(pool), c)
        }
        Some(options) => {
            let pool = alloc.pool("graphs", options).await.unwrap();
            let c = pool.begin_capture(s, CaptureMode::Relaxed).await.unwrap();
            (Holder::Named(pool), c)
        }
    };
    let buf = alloc.malloc(len, s).await.unwrap();
    let p = buf.ptr();
    slow_fill(sim, s, p, len, 7, dur);
    drop(buf);
    let graph = capture.end().await.unwrap();
    (graph, holder, p)
}

/// The first 16 bytes at `p`, read in `s`'s order.
fn head(sim: &SimBackend, s: &Stream, p: DevicePtr) -> [u8; 16] {
    let mut got = [0u8; 16];
    sim.copy_from_device(s.handle(), &mut got, p).unwrap();
    got
}

/// True when the `len` bytes at `a` and at `b` do not overlap.
fn apart(a: DevicePtr, b: DevicePtr, len: u64) -> bool {
    a.0 + len <= b.0 || b.0 + len <= a.0
}

async fn reserved(alloc: &Allocator) -> u64 {
    alloc.stats(D0).await.unwrap().reserved_bytes[0].current
}

/// The bytes reserved after `empty_cache`, once a pool's release in flight (off the
/// dropping thread) has had up to 2 s to finish.
async fn emptied(alloc: &Allocator) -> u64 {
    for _ in 0..400 {
        alloc.empty_cache().await.unwrap();
        if reserved(alloc).await == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    reserved(alloc).await
}

/// The sim's device memory in use, once a pool's release in flight (off the caller's thread,
/// booked before its driver calls) has had up to 2 s to finish.
async fn sim_used(sim: &SimBackend) -> u64 {
    for _ in 0..400 {
        if sim.used_bytes(D0).unwrap() == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    sim.used_bytes(D0).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_graph_and_pool_dropped_while_a_launch_runs_on_another_stream_keep_its_memory_until_it_ends(
) {
    for conf in CONFIGS {
        for named in [None, Some(PoolOptions::default())] {
            let case = format!("{conf}, named pool: {}", named.is_some());
            let sim = sim(1 << 30);
            let alloc = build(sim.clone(), conf);
            let s = alloc.new_stream(D0).unwrap();
            let b = alloc.new_stream(D0).unwrap();
            let len = 4 * MIB;
            let (graph, holder, _) =
                capture_fill(&sim, &alloc, named, &s, len, Duration::from_millis(300)).await;
            assert_eq!(graph.pool_id(), holder.id(), "{case}");
            graph.launch(&b).unwrap();
            drop(graph);
            drop(holder);
            tokio::time::sleep(Duration::from_millis(20)).await;
            alloc.empty_cache().await.unwrap();
            let during = reserved(&alloc).await;
            // Still running after the read: the memory was the launch's when it was read.
            if !sim.stream_idle(b.handle()).unwrap() {
                assert!(
                    during >= len,
                    "{case}: {during} bytes reserved under the launch"
                );
            }
            b.synchronize().unwrap();
            assert_eq!(sim.kernel_failures(), 0, "{case}");
            // Once the launch has run, the pool goes back to the device.
            assert_eq!(emptied(&alloc).await, 0, "{case}");
            alloc.shutdown().await.unwrap();
            assert_eq!(sim_used(&sim).await, 0, "{case}");
            assert_eq!(sim.live_graphs(), (0, 0), "{case}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_named_pool_put_to_sleep_just_after_its_graph_is_dropped_waits_for_the_graphs_launch() {
    let sim = sim(1 << 30);
    let alloc = build(sim.clone(), "expandable_segments:True");
    let s = alloc.new_stream(D0).unwrap();
    let b = alloc.new_stream(D0).unwrap();
    let (graph, holder, _) = capture_fill(
        &sim,
        &alloc,
        Some(PoolOptions::default()),
        &s,
        4 * MIB,
        Duration::from_millis(300),
    )
    .await;
    let Holder::Named(pool) = holder else {
        unreachable!()
    };
    graph.launch(&b).unwrap();
    drop(graph);
    pool.sleep(SleepMode::Discard).await.unwrap();
    assert!(
        sim.stream_idle(b.handle()).unwrap(),
        "the sleep began before the launch had run"
    );
    assert_eq!(sim.kernel_failures(), 0);
    pool.wake().await.unwrap();
    alloc.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_capture_stream_of_a_live_graph_neither_unmaps_nor_lends_its_memory() {
    for conf in CONFIGS {
        let sim = sim(1 << 30);
        let alloc = build(sim.clone(), conf);
        let s = alloc.new_stream(D0).unwrap();
        let b = alloc.new_stream(D0).unwrap();
        let len = 4 * MIB;
        let (graph, holder, p) = capture_fill(
            &sim,
            &alloc,
            Some(PoolOptions::default()),
            &s,
            len,
            Duration::ZERO,
        )
        .await;
        let Holder::Named(pool) = holder else {
            unreachable!()
        };
        let before = pool.usage(D0).await.unwrap().reserved[0].current;
        // The capture stream goes: its free segments would serve other streams, or their
        // free pages be unmapped.
        drop(s);
        assert_eq!(
            pool.usage(D0).await.unwrap().reserved[0].current,
            before,
            "{conf}: the graph's memory was released"
        );
        let other = pool.malloc(len, &b).await.unwrap();
        assert!(
            apart(other.ptr(), p, len),
            "{conf}: a request on another stream got the graph's memory"
        );
        graph.launch(&b).unwrap();
        b.synchronize().unwrap();
        assert_eq!(sim.kernel_failures(), 0, "{conf}");
        assert_eq!(head(&sim, &b, p), [7; 16], "{conf}");
        drop((other, graph, pool));
        alloc.shutdown().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_at_its_pools_quota_does_not_release_the_memory_of_a_graph_of_the_pool() {
    for conf in CONFIGS {
        let sim = sim(1 << 30);
        let alloc = build(sim.clone(), conf);
        let s = alloc.new_stream(D0).unwrap();
        let len = 4 * MIB;
        let options = PoolOptions {
            quota: Some(24 * MIB),
            ..Default::default()
        };
        let (graph, holder, p) =
            capture_fill(&sim, &alloc, Some(options), &s, len, Duration::ZERO).await;
        let Holder::Named(pool) = holder else {
            unreachable!()
        };
        // A request past the quota would first release the pool's own free memory: the
        // graph's is not the pool's to give. (On another stream: on the capture stream it
        // may get the graph's free block, as a later capture into the pool would.)
        let c = alloc.new_stream(D0).unwrap();
        let big = pool.malloc(22 * MIB, &c).await;
        assert!(
            matches!(big, Err(Error::Alloc(AllocError::PoolQuota { .. }))),
            "{conf}: {big:?}"
        );
        graph.launch(&s).unwrap();
        s.synchronize().unwrap();
        assert_eq!(sim.kernel_failures(), 0, "{conf}");
        assert_eq!(head(&sim, &s, p), [7; 16], "{conf}");
        drop((graph, pool));
        alloc.shutdown().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_use_on_oom_pool_does_not_lend_the_memory_of_a_live_graph() {
    for conf in CONFIGS {
        let sim = sim(64 * MIB);
        let alloc = build(sim.clone(), conf);
        let s = alloc.new_stream(D0).unwrap();
        let len = 20 * MIB;
        let options = PoolOptions {
            use_on_oom: true,
            ..Default::default()
        };
        let (graph, holder, p) =
            capture_fill(&sim, &alloc, Some(options), &s, len, Duration::ZERO).await;
        // The device has no room for this but the graph's free block.
        let fill = alloc.malloc(40 * MIB, &s).await.unwrap();
        // Before the fix the request got the graph's free block; now there is no room for it.
        match alloc.malloc(len, &s).await {
            Ok(l) => panic!(
                "{conf}: served at {:#x} (the graph's block is at {:#x}, apart: {})",
                l.ptr().0,
                p.0,
                apart(l.ptr(), p, len)
            ),
            Err(e) => assert!(e.is_oom(), "{conf}: {e}"),
        }
        drop((fill, graph, holder));
        alloc.shutdown().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn launching_a_graph_into_a_capture_is_refused() {
    let sim = sim(1 << 30);
    let alloc = build(sim.clone(), "expandable_segments:True");
    let s = alloc.new_stream(D0).unwrap();
    let (graph, holder, _) = capture_fill(&sim, &alloc, None, &s, MIB, Duration::ZERO).await;
    let other = alloc.graph_pool(D0).await.unwrap();
    let capture = other.begin_capture(&s, CaptureMode::Relaxed).await.unwrap();
    assert_eq!(graph.launch(&s), Err(Error::LaunchIntoCapture));
    // A stream that does not capture takes launches meanwhile.
    let b = alloc.new_stream(D0).unwrap();
    graph.launch(&b).unwrap();
    b.synchronize().unwrap();
    drop(capture);
    graph.launch(&s).unwrap();
    s.synchronize().unwrap();
    drop((graph, holder, other));
    alloc.shutdown().await.unwrap();
    assert_eq!(sim_used(&sim).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_launch_stream_has_one_event_and_the_longest_launch_keeps_the_pool() {
    for conf in CONFIGS {
        let sim = sim(1 << 30);
        let alloc = build(sim.clone(), conf);
        let s = alloc.new_stream(D0).unwrap();
        let (b, c) = (alloc.new_stream(D0).unwrap(), alloc.new_stream(D0).unwrap());
        let len = 4 * MIB;
        let (graph, holder, _) =
            capture_fill(&sim, &alloc, None, &s, len, Duration::from_millis(100)).await;
        // One event per stream, recorded again at each launch there.
        sim.reset_counts();
        for _ in 0..3 {
            graph.launch(&b).unwrap();
            graph.launch(&c).unwrap();
        }
        let calls = sim.counts();
        assert_eq!(
            (calls.get(Op::EventCreate), calls.get(Op::EventRecord)),
            (2, 6),
            "{conf}"
        );
        c.synchronize().unwrap();
        // b's last launch ends well after c's: b's own event must keep the pool.
        sim.launch_kernel(b.handle(), Duration::from_millis(300), |_| Ok(()))
            .unwrap();
        graph.launch(&b).unwrap();
        graph.launch(&c).unwrap();
        drop((graph, holder));
        c.synchronize().unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
        alloc.empty_cache().await.unwrap();
        b.synchronize().unwrap();
        assert_eq!(sim.kernel_failures(), 0, "{conf}");
        alloc.shutdown().await.unwrap();
        assert_eq!(sim_used(&sim).await, 0, "{conf}");
    }
}

/// A sim, an allocator under `conf` with a named pool `decode`, and three streams: the one a
/// capture begins on (`s`), one that joins it (`j`), and one the graph is launched on (`b`).
struct JoinRig {
    sim: Arc<SimBackend>,
    alloc: Allocator,
    pool: Pool,
    s: Stream,
    j: Stream,
    b: Stream,
}

impl JoinRig {
    async fn new(conf: &str) -> JoinRig {
        let sim = sim(1 << 30);
        let alloc = build(sim.clone(), conf);
        let pool = alloc.pool("decode", PoolOptions::default()).await.unwrap();
        let [s, j, b] = [(); 3].map(|()| alloc.new_stream(D0).unwrap());
        JoinRig {
            sim,
            alloc,
            pool,
            s,
            j,
            b,
        }
    }

    /// `j` joins back into `capture` (begun on `s`), which ends; the graph is launched on
    /// `b`, and once both streams' work has run no kernel failed.
    async fn end_and_launch(&self, capture: Capture, case: &str) -> Graph {
        self.s.wait_event(&self.j.record_event().unwrap()).unwrap();
        let graph = capture.end().await.unwrap();
        graph.launch(&self.b).unwrap();
        self.b.synchronize().unwrap();
        self.j.synchronize().unwrap();
        assert_eq!(
            self.sim.kernel_failures(),
            0,
            "{case}: the graph wrote under j's read"
        );
        graph
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_capture_begins_after_its_streams_queued_work_so_a_block_freed_there_is_safe_to_reuse() {
    for conf in CONFIGS {
        let JoinRig {
            sim,
            alloc,
            pool,
            s,
            b,
            ..
        } = JoinRig::new(conf).await;
        let len = 4 * MIB;
        // A buffer of the pool, written then read by a slow kernel on s, and freed: its block
        // may serve the next request of the pool on s (stream order) ...
        let used = pool.malloc(len, &s).await.unwrap();
        let p = used.ptr();
        fill_then_read_slowly(&sim, &s, p, len);
        drop(used);
        // ... which a capture on s is, but the graph runs wherever it is launched.
        let capture = pool.begin_capture(&s, CaptureMode::Relaxed).await.unwrap();
        let scratch = alloc.malloc(len, &s).await.unwrap();
        assert_eq!(
            scratch.ptr(),
            p,
            "{conf}: the capture reuses the freed block"
        );
        slow_fill(&sim, &s, p, len, 9, Duration::ZERO);
        let graph = capture.end().await.unwrap();
        graph.launch(&b).unwrap();
        b.synchronize().unwrap();
        s.synchronize().unwrap();
        assert_eq!(sim.kernel_failures(), 0, "{conf}");
        drop((graph, scratch, pool));
        alloc.shutdown().await.unwrap();
    }
}

/// The same for a stream that joins the capture (it waits on an event recorded in it) and
/// allocates there: a block it freed before the capture, with its work still reading it,
/// is not the capture's until that work has run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_block_freed_on_a_stream_that_joins_a_capture_is_reused_only_after_its_work() {
    for conf in CONFIGS {
        let r = JoinRig::new(conf).await;
        let len = 4 * MIB;
        // A buffer of the pool, read by a slow kernel on j, and freed there.
        let used = r.pool.malloc(len, &r.j).await.unwrap();
        fill_then_read_slowly(&r.sim, &r.j, used.ptr(), len);
        drop(used);
        // A capture on s that j joins, and a request of j in it.
        let capture = r
            .pool
            .begin_capture(&r.s, CaptureMode::Relaxed)
            .await
            .unwrap();
        r.j.wait_event(&r.s.record_event().unwrap()).unwrap();
        let scratch = r.alloc.malloc(len, &r.j).await.unwrap();
        slow_fill(&r.sim, &r.j, scratch.ptr(), len, 9, Duration::ZERO);
        let graph = r.end_and_launch(capture, conf).await;
        drop((graph, scratch, r.pool));
        r.alloc.shutdown().await.unwrap();
    }
}

/// And for a block of the pool freed eagerly on another stream while the capture is under
/// way: held back until the capture ends, so the stream that joins it later does not get it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_block_freed_eagerly_during_a_capture_into_its_pool_waits_for_the_captures_end() {
    for conf in CONFIGS {
        let JoinRig {
            sim,
            alloc,
            pool,
            s,
            j,
            ..
        } = JoinRig::new(conf).await;
        let len = 4 * MIB;
        let capture = pool.begin_capture(&s, CaptureMode::Relaxed).await.unwrap();
        // Eager work on j, beside the capture, with a buffer of the pool, freed there.
        let used = pool.malloc(len, &j).await.unwrap();
        let p = used.ptr();
        fill_then_read_slowly(&sim, &j, p, len);
        drop(used);
        // j joins the capture: its request there gets other memory.
        j.wait_event(&s.record_event().unwrap()).unwrap();
        let scratch = alloc.malloc(len, &j).await.unwrap();
        assert!(
            apart(scratch.ptr(), p, len),
            "{conf}: the capture got j's eager block"
        );
        let active = || async { alloc.stats(D0).await.unwrap().active_bytes[0].current };
        assert_eq!(active().await, 2 * len, "{conf}: the free is held back");
        s.wait_event(&j.record_event().unwrap()).unwrap();
        let graph = capture.end().await.unwrap();
        assert_eq!(
            active().await,
            len,
            "{conf}: and made when the capture ended"
        );
        j.synchronize().unwrap();
        assert_eq!(sim.kernel_failures(), 0, "{conf}");
        drop((graph, scratch, pool));
        alloc.shutdown().await.unwrap();
    }
}

/// And for a block of the pool of another stream, allocated before the capture or eagerly
/// while it is under way, used there after the capture began, and freed once that stream has
/// joined the capture: the free is held back until the capture ends (the stream's work from
/// before the join is not the graph's), so the capture's request on that stream gets other
/// memory, and a launch of the graph does not write the block under that work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_block_freed_by_a_stream_after_it_joined_a_capture_waits_for_its_end() {
    for conf in CONFIGS {
        for before_the_capture in [false, true] {
            let r = JoinRig::new(conf).await;
            let len = 4 * MIB;
            let early = match before_the_capture {
                true => Some(r.pool.malloc(len, &r.j).await.unwrap()),
                false => None,
            };
            let capture = r
                .pool
                .begin_capture(&r.s, CaptureMode::Relaxed)
                .await
                .unwrap();
            // Eager work on j, beside the capture, with a buffer of the pool.
            let used = match early {
                Some(buf) => buf,
                None => r.pool.malloc(len, &r.j).await.unwrap(),
            };
            let p = used.ptr();
            fill_then_read_slowly(&r.sim, &r.j, p, len);
            // j joins the capture, then frees the buffer and asks for as much there.
            r.j.wait_event(&r.s.record_event().unwrap()).unwrap();
            drop(used);
            let scratch = r.alloc.malloc(len, &r.j).await.unwrap();
            let q = scratch.ptr();
            let case = format!("{conf}, allocated before the capture: {before_the_capture}");
            assert!(apart(q, p, len), "{case}: the capture got j's eager block");
            slow_fill(&r.sim, &r.j, q, len, 9, Duration::ZERO);
            let graph = r.end_and_launch(capture, &case).await;
            drop((graph, scratch, r.pool));
            r.alloc.shutdown().await.unwrap();
        }
    }
}

/// `shutdown` returns once every segment is back with the device: a graph pool's release
/// frees its segments off the dropping thread, and may still be in a (slow) driver free when
/// the user shuts down.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_waits_for_a_graph_pools_segment_frees() {
    let sim = sim(1 << 30);
    let alloc = build(sim.clone(), "expandable_segments:False");
    let s = alloc.new_stream(D0).unwrap();
    let other = alloc.new_stream(D0).unwrap();
    let pool = alloc.graph_pool(D0).await.unwrap();
    let capture = pool.begin_capture(&s, CaptureMode::Relaxed).await.unwrap();
    drop(alloc.malloc(4 * MIB, &s).await.unwrap());
    let graph = capture.end().await.unwrap();
    // Work on the device for 300 ms: a segment free synchronizes the device first.
    sim.launch_kernel(other.handle(), Duration::from_millis(300), |_| Ok(()))
        .unwrap();
    drop((graph, pool));
    // The release detaches the segment at once (a queued job: waited for, not assumed
    // done after a fixed time) and is then in its free, which waits for the kernel.
    let mut detached = false;
    for _ in 0..2500 {
        if reserved(&alloc).await == 0 {
            detached = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    assert!(
        detached,
        "the graph pool's release never detached its segment"
    );
    // Read before the kernel is checked: while it still runs, the free (which synchronizes
    // the device first) cannot have ended before the read. (A machine so loaded that the
    // kernel ended first has nothing left to show here.)
    let used = sim.used_bytes(D0).unwrap();
    if !sim.stream_idle(other.handle()).unwrap() {
        assert_eq!(used, 20 * MIB, "the free is under way");
    }
    // It waits for that free (about 250 ms more), not for its 10 s limit: the batch
    // counted in flight ends with the free.
    tokio::time::timeout(Duration::from_secs(5), alloc.shutdown())
        .await
        .expect("shutdown waited past the free")
        .unwrap();
    assert_eq!(sim.used_bytes(D0).unwrap(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_capture_begin_leaves_the_streams_free_pages_releasable() {
    let sim = sim(1 << 30);
    let alloc = build(sim.clone(), "expandable_segments:True");
    let s = alloc.new_stream(D0).unwrap();
    let first = alloc.graph_pool(D0).await.unwrap();
    let second = alloc.graph_pool(D0).await.unwrap();
    let capture = first.begin_capture(&s, CaptureMode::Relaxed).await.unwrap();
    // The stream captures already: the backend refuses the second begin.
    assert!(second
        .begin_capture(&s, CaptureMode::Relaxed)
        .await
        .is_err());
    drop(capture);
    // Nothing of the refused begin stays: the stream's free pages go back as always.
    let buf = alloc.malloc(40 * MIB, &s).await.unwrap();
    drop(buf);
    assert_eq!(emptied(&alloc).await, 0);
    drop((first, second));
    alloc.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_whose_stream_captures_into_another_pool_refuses_to_sleep_until_the_capture_ends() {
    let sim = sim(1 << 30);
    let alloc = build(sim.clone(), "expandable_segments:True");
    let s = alloc.new_stream(D0).unwrap();
    let pool = alloc.pool("weights", PoolOptions::default()).await.unwrap();
    let kept = pool.malloc(4 * MIB, &s).await.unwrap();
    let freed = pool.malloc(4 * MIB, &s).await.unwrap();
    drop(freed);
    let graphs = alloc.graph_pool(D0).await.unwrap();
    let capture = graphs
        .begin_capture(&s, CaptureMode::Relaxed)
        .await
        .unwrap();
    let scratch = alloc.malloc(MIB, &s).await.unwrap();
    // The sleep would wait for s, which captures: refused, and the capture is untouched.
    assert_eq!(
        pool.sleep(SleepMode::Discard).await,
        Err(Error::Alloc(AllocError::CaptureUnderway(
            "putting a pool to sleep"
        )))
    );
    let graph = capture.end().await;
    assert!(graph.is_ok(), "the capture was invalidated: {graph:?}");
    assert_eq!(sim.live_graphs(), (0, 1), "one graph instantiated");
    // After the capture the pool sleeps and wakes as always.
    pool.sleep(SleepMode::Discard).await.unwrap();
    pool.wake().await.unwrap();
    drop((graph, scratch, kept, graphs));
    alloc.shutdown().await.unwrap();
}
