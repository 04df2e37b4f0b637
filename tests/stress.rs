//! The public API under random use, as a service would misuse it: four tasks on two workers
//! malloc (some waiting for memory, some dropped mid-flight by a timeout), free, use buffers
//! on other streams (`record_stream`, ordered by an event), copy them to and from pinned host
//! buffers (the copies awaited, or dropped unawaited), drop and replace streams while
//! their buffers live, empty the cache, and capture graphs (into graph pools, or the task's
//! named pool) that they launch on any of their streams and drop with their buffers in any
//! order, export buffers to an importer in the same process (on the sim) that checks them
//! and lets go by a release message or a silent drop, on a device small enough to run out of
//! memory often; in the second test each task
//! also allocates from a named pool of its own (half of them under a quota) and puts it to
//! sleep with its data offloaded and wakes it. Checked
//! throughout and at the end, in every config:
//! - no two live buffers overlap;
//! - every buffer holds the byte a kernel of its stream (or a pinned copy from the host) wrote
//!   until it is freed, an importer's mapping of it too, until the importer lets go, and a
//!   pinned copy to the host holds it too (a check
//!   kernel on its stream, or on the stream it was used on, fails otherwise), across a sleep
//!   and a wake of its pool too;
//! - after the tasks end: nothing allocated, nothing reserved after `empty_cache`, no kernel
//!   failure, and no backend call that named a stream or event the allocator had let go of.
//!
//! With `GPUALLOC_BACKEND=cuda` it runs on the CUDA backend's device 0 (CI: on the emulated
//! driver), capped at 256 MiB by `per_process_memory_fraction`, and checks the bytes by
//! memsets and stream-ordered copies to the host.
//!
//! `GPUALLOC_STRESS_OPS` (operations per task, default 1000) and `GPUALLOC_STRESS_SEEDS`
//! (default 1) make it longer, and `GPUALLOC_STRESS_CONFIG` runs only the config it names
//! (`""` is the default config): `GPUALLOC_STRESS_OPS=3000 GPUALLOC_STRESS_SEEDS=3 cargo test
//! --release --test stress` found the two stream-lifetime races `stream_lifetime.rs` pins,
//! and the named-pool run the race of a miss with its pool's sleep that `pool_sleep.rs` pins
//! (`a_miss_that_waited_in_the_oom_chain_does_not_grow_a_pool_that_fell_asleep`); with
//! graphs, three capture bugs that `devices/tests/capture.rs` and `graph_launches.rs` pin (a
//! use on another task's stream dropped by a free held back for a capture, a page release
//! synchronizing a stream that had begun capturing, a block freed on the capture stream
//! reused by a graph launched elsewhere while the stream's work still read it).

mod common;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{build, MIB};
use gpualloc::devices::AllocError;
use gpualloc::ipc::{
    AsyncExportConn, AsyncImportConn, ExportId, ImportedBuffer, PeerPolicy, Received,
};
use gpualloc::runtime::sim::{KernelMemory, SimBackend, SimConfig};
use gpualloc::runtime::{Backend, DevicePtr};
use gpualloc::{
    Allocator, BackendKind, CaptureMode, DeviceBuffer, DeviceId, Error, Graph, GraphPool,
    MallocOptions, Pool, PoolOptions, SleepMode, Stream,
};

const CONFIGS: &[&str] = &[
    "",
    "thread_cache:False",
    "expandable_segments:False",
    "garbage_collection_threshold:0.6,per_process_memory_fraction:0.8",
    "policy:pytorch",
    "expandable_segments:True,policy:pytorch",
    "max_split_size_mb:32",
    "roundup_power2_divisions:4,thread_cache:False",
];

/// Bytes of a buffer its kernels write and check (the head of a large one).
const CHECKED: u64 = 256 << 10;

/// The longest a task waits for room to wake its pool: until the other tasks have ended, at
/// the latest (see the wake loop).
const WAKE_WAIT: Duration = Duration::from_secs(120);

/// xorshift64: the same operations for a seed, whatever the platform.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }

    /// Sizes from a byte to 48 MiB, most of them small.
    fn size(&mut self) -> u64 {
        match self.below(10) {
            0..=4 => 1 + self.below(64 << 10),
            5..=6 => 1 + self.below(MIB),
            7..=8 => MIB + self.below(12 * MIB),
            _ => 8 * MIB + self.below(40 * MIB),
        }
    }

    fn micros(&mut self, max: u64) -> Duration {
        Duration::from_micros(self.below(max))
    }
}

/// The live buffers' ranges, shared by the tasks: start -> length.
#[derive(Clone, Default)]
struct Live(Arc<Mutex<BTreeMap<u64, u64>>>);

impl Live {
    fn claim(&self, buf: &DeviceBuffer) {
        let (p, l) = (buf.ptr().0, buf.len());
        if l == 0 {
            return;
        }
        let mut ranges = self.0.lock().unwrap();
        if let Some((&q, &ql)) = ranges.range(..p + l).next_back() {
            assert!(
                q + ql <= p,
                "[{p:#x}, +{l}) overlaps the live [{q:#x}, +{ql})"
            );
        }
        ranges.insert(p, l);
    }

    fn release(&self, buf: &DeviceBuffer) {
        self.release_at(buf.ptr());
    }

    fn release_at(&self, p: DevicePtr) {
        self.0.lock().unwrap().remove(&p.0);
    }
}

/// What writes and checks the buffers: the sim's kernels (stream-ordered, the check fails the
/// kernel), or a driver's memsets and stream-ordered copies to the host (the check waits).
enum Gpu {
    Sim(Arc<SimBackend>),
    Driver(Arc<dyn Backend>),
}

impl Gpu {
    /// Fills `buf`'s head with `byte` on `stream`, after `d` on the sim.
    fn fill(&self, stream: &Stream, buf: &DeviceBuffer, byte: u8, d: Duration) {
        let (p, l) = (buf.ptr(), buf.len().min(CHECKED));
        match self {
            Gpu::Sim(sim) => sim
                .launch_kernel(stream.handle(), d, move |m| m.fill(p, l, byte))
                .unwrap(),
            Gpu::Driver(b) => b.memset_async(stream.handle(), p, byte, l).unwrap(),
        }
    }

    /// Checks on `stream` that `buf`'s head holds `byte`.
    fn check(&self, stream: &Stream, buf: &DeviceBuffer, byte: u8, d: Duration) {
        let (p, l) = (buf.ptr(), buf.len().min(CHECKED));
        match self {
            Gpu::Sim(sim) => sim
                .launch_kernel(stream.handle(), d, move |m: &mut KernelMemory| {
                    assert!(
                        m.check(p, l, byte)?,
                        "[{:#x}, +{l}) was written while in use",
                        p.0
                    );
                    Ok(())
                })
                .unwrap(),
            Gpu::Driver(b) => {
                let mut host = vec![0u8; l as usize];
                b.copy_from_device(stream.handle(), &mut host, p).unwrap();
                assert!(
                    host.iter().all(|&x| x == byte),
                    "[{:#x}, +{l}) was written while in use",
                    p.0
                );
            }
        }
    }
}

struct Held {
    buf: DeviceBuffer,
    stream: Stream,
    byte: u8,
    /// From the task's pool.
    pooled: bool,
}

/// A graph a task captured: a fill of `byte` into `scratch`, a buffer allocated in the
/// capture and kept alive beside the graph (a buffer freed in a capture is the graph's
/// scratch memory, and a later request of the same pool and stream may get it, as in
/// PyTorch: that is the user's to order, not the allocator's).
struct Captured {
    graph: Graph,
    scratch: DeviceBuffer,
    byte: u8,
    /// The streams it was launched on.
    launched_on: Vec<Stream>,
    /// Its graph pool, when not captured into the task's named pool.
    pool: Option<GraphPool>,
}

impl Captured {
    /// Drops the graph, its scratch buffer (used on every stream the graph was launched on)
    /// and its pool in an order `order` picks; the allocator keeps the memory until the
    /// launches have run.
    fn drop_in_order(self, live: &Live, order: u64) {
        let Captured {
            graph,
            scratch,
            launched_on,
            pool,
            ..
        } = self;
        for s in &launched_on {
            scratch.record_stream(s).unwrap();
        }
        live.release(&scratch);
        match order % 3 {
            0 => drop((graph, scratch, pool)),
            1 => drop((scratch, pool, graph)),
            _ => drop((pool, graph, scratch)),
        }
    }
}

/// Buffers a task exported to an importer in the same process (on the sim, which opens its
/// own IPC handles): both ends of the connection and what the importer holds, each with the
/// exporter's pointer (its live range until the importer lets go) and the byte it holds.
struct Exports {
    exp: AsyncExportConn,
    imp: AsyncImportConn,
    imported: Vec<(ImportedBuffer, DevicePtr, u8)>,
}

impl Exports {
    async fn new(alloc: &Allocator) -> Exports {
        let (a, b) = tokio::net::UnixStream::pair().unwrap();
        let backend = alloc.backend().clone();
        let policy = PeerPolicy::default();
        let exp = AsyncExportConn::new(a, &policy, backend.clone())
            .await
            .unwrap();
        let imp = AsyncImportConn::new(b, &policy, backend, DeviceId(0))
            .await
            .unwrap();
        Exports {
            exp,
            imp,
            imported: Vec::new(),
        }
    }

    /// Exports `h`'s buffer (it stays allocated while imported) and imports it: the importer's
    /// mapping holds the byte (the exporter synchronized the buffer's stream before sending).
    async fn export(&mut self, alloc: &Allocator, sim: &SimBackend, h: Held, stream: &Stream) {
        let (p, byte) = (h.buf.ptr(), h.byte);
        alloc.export(&mut self.exp, h.buf).await.unwrap();
        let Received::Device(buf) = self.imp.recv().await.unwrap() else {
            panic!("expected a device buffer");
        };
        check_at(sim, stream, buf.ptr(), buf.len(), byte);
        self.imported.push((buf, p, byte));
    }

    /// The importer lets go of one buffer (after checking its byte once more): a release
    /// message, or, with `silent`, a drop the exporter finds by its shared counter. The
    /// exporter's buffer is freed then; its range leaves `live` just before.
    async fn finish_one(
        &mut self,
        live: &Live,
        sim: &SimBackend,
        stream: &Stream,
        k: usize,
        silent: bool,
    ) {
        let (buf, p, byte) = self.imported.swap_remove(k);
        check_at(sim, stream, buf.ptr(), buf.len(), byte);
        let id: ExportId = buf.id();
        live.release_at(p);
        if silent {
            // The check above ran to completion (`check_at` synchronizes).
            drop(buf);
            assert_eq!(self.exp.collect(), vec![id]);
        } else {
            self.imp.release(buf, &[stream.handle()]).await.unwrap();
            self.exp.wait_returned(id).await.unwrap();
        }
    }
}

/// Checks on `stream` that the head of the `len` bytes at `p` (an imported mapping) holds
/// `byte`, and waits for it.
fn check_at(sim: &SimBackend, stream: &Stream, p: DevicePtr, len: u64, byte: u8) {
    let l = len.min(CHECKED);
    sim.launch_kernel(
        stream.handle(),
        Duration::ZERO,
        move |m: &mut KernelMemory| {
            assert!(
                m.check(p, l, byte)?,
                "the import of [{:#x}, +{l}) does not hold its byte",
                p.0
            );
            Ok(())
        },
    )
    .unwrap();
    stream.synchronize().unwrap();
}

/// One task's random operations. With `pool`, half its mallocs come from that pool (the
/// task's own: nothing else uses it), and now and then the pool sleeps with its data offloaded
/// and wakes, after which every buffer must still hold its byte; without expandable segments
/// the sleep is refused with a typed error.
async fn task(
    alloc: Allocator,
    gpu: Arc<Gpu>,
    live: Live,
    seed: u64,
    ops: usize,
    pool: Option<Pool>,
) {
    let mut rng = Rng(seed);
    let mut streams: Vec<Stream> = (0..3)
        .map(|_| alloc.new_stream(DeviceId(0)).unwrap())
        .collect();
    let mut held: Vec<Held> = Vec::new();
    let mut graphs: Vec<Captured> = Vec::new();
    let mut exports = match &*gpu {
        Gpu::Sim(sim) => Some((Exports::new(&alloc).await, sim.clone())),
        Gpu::Driver(_) => None,
    };
    for i in 0..ops {
        let pick = |rng: &mut Rng, n: usize| rng.below(n as u64) as usize;
        match rng.below(20) {
            0..=8 => {
                let stream = streams[pick(&mut rng, streams.len())].clone();
                let size = rng.size();
                let from = pool.as_ref().filter(|_| rng.below(2) == 0);
                let result = if rng.below(4) == 0 {
                    let wait = MallocOptions::wait_for(Duration::from_millis(rng.below(20)));
                    let timeout = rng.micros(3000);
                    let r = match from {
                        Some(p) => {
                            tokio::time::timeout(timeout, p.malloc_with(size, &stream, wait)).await
                        }
                        None => {
                            tokio::time::timeout(timeout, alloc.malloc_with(size, &stream, wait))
                                .await
                        }
                    };
                    match r {
                        Ok(r) => r,
                        Err(_) => continue, // dropped mid-flight
                    }
                } else {
                    match from {
                        Some(p) => p.malloc(size, &stream).await,
                        None => alloc.malloc(size, &stream).await,
                    }
                };
                let Ok(buf) = result else {
                    continue; // out of memory: the device is small on purpose
                };
                live.claim(&buf);
                let byte = 1 + rng.below(250) as u8;
                gpu.fill(&stream, &buf, byte, rng.micros(300));
                let pooled = from.is_some();
                held.push(Held {
                    buf,
                    stream,
                    byte,
                    pooled,
                });
            }
            9..=13 if !held.is_empty() => {
                let Held {
                    buf, stream, byte, ..
                } = held.swap_remove(pick(&mut rng, held.len()));
                gpu.check(&stream, &buf, byte, rng.micros(300));
                live.release(&buf);
                drop(buf);
            }
            14..=15 if !held.is_empty() => {
                // Read on another stream after its fill, then freed: its block waits for it.
                let Held {
                    buf, stream, byte, ..
                } = held.swap_remove(pick(&mut rng, held.len()));
                let other = streams[pick(&mut rng, streams.len())].clone();
                other.wait_event(&stream.record_event().unwrap()).unwrap();
                gpu.check(&other, &buf, byte, rng.micros(1000));
                alloc.record_stream(&buf, &other).unwrap();
                live.release(&buf);
                drop(buf);
            }
            16 => {
                // The task's handle goes (its buffers keep theirs); a new stream replaces it.
                streams.swap_remove(pick(&mut rng, streams.len()));
                streams.push(alloc.new_stream(DeviceId(0)).unwrap());
            }
            // Refused while another task captures.
            17 if i % 50 == 0 => match alloc.empty_cache().await {
                Ok(()) | Err(Error::Alloc(AllocError::CaptureUnderway(_))) => {}
                Err(e) => panic!("empty_cache: {e}"),
            },
            17 if graphs.len() < 2 && rng.below(3) == 0 => {
                // A graph captured on one of the task's streams, into a graph pool of its own
                // or the task's named pool.
                let stream = streams[pick(&mut rng, streams.len())].clone();
                let mode = CaptureMode::Relaxed;
                let (capture, own) = match pool.as_ref().filter(|_| rng.below(2) == 0) {
                    Some(p) => (p.begin_capture(&stream, mode).await.unwrap(), None),
                    None => {
                        let g = alloc.graph_pool(DeviceId(0)).await.unwrap();
                        (g.begin_capture(&stream, mode).await.unwrap(), Some(g))
                    }
                };
                let max = if rng.below(4) == 0 { 4 * MIB } else { MIB };
                let size = 1 + rng.below(max);
                let Ok(scratch) = alloc.malloc(size, &stream).await else {
                    continue; // out of memory: the capture is dropped, its graph discarded
                };
                live.claim(&scratch);
                let byte = 1 + rng.below(250) as u8;
                gpu.fill(&stream, &scratch, byte, rng.micros(300));
                let graph = capture.end().await.unwrap();
                graphs.push(Captured {
                    graph,
                    scratch,
                    byte,
                    launched_on: Vec::new(),
                    pool: own,
                });
            }
            17 if !graphs.is_empty() && rng.below(2) == 0 => {
                // Launched on any of the task's streams; checked there now and then.
                let k = pick(&mut rng, graphs.len());
                let stream = streams[pick(&mut rng, streams.len())].clone();
                let g = &mut graphs[k];
                g.graph.launch(&stream).unwrap();
                if rng.below(2) == 0 {
                    gpu.check(&stream, &g.scratch, g.byte, rng.micros(300));
                }
                if !g.launched_on.contains(&stream) {
                    g.launched_on.push(stream);
                }
            }
            17 if !graphs.is_empty() => {
                let g = graphs.swap_remove(pick(&mut rng, graphs.len()));
                g.drop_in_order(&live, rng.below(3));
            }
            19 => {
                // A pinned copy of a buffer of at most 4 MiB, to the host or from it, awaited
                // or dropped unawaited (its pinned block must not be reused before the stream
                // passed the copy).
                let Some(k) = (0..held.len()).find(|&k| held[k].buf.len() <= 4 * MIB) else {
                    continue;
                };
                let host = alloc.host();
                let len = held[k].buf.len();
                let Ok(mut pinned) = host.malloc(len).await else {
                    continue;
                };
                let h = &mut held[k];
                let copy = if rng.below(2) == 0 {
                    host.copy_d2h(&h.buf, pinned, &h.stream).unwrap()
                } else {
                    let byte = 1 + rng.below(250) as u8;
                    pinned.fill(byte);
                    h.byte = byte;
                    host.copy_h2d(pinned, &h.buf, &h.stream).unwrap()
                };
                if rng.below(2) == 0 {
                    let back = copy.finish().await.unwrap();
                    let head = &back[..len.min(CHECKED) as usize];
                    assert!(
                        head.iter().all(|&x| x == h.byte),
                        "a pinned copy of [{:#x}, +{len}) does not hold its bytes",
                        h.buf.ptr().0
                    );
                }
            }
            18 if exports.is_some() && (i % 2 == 1 || pool.is_none()) => {
                // Export a buffer to an importer of this process, or let go of an import.
                let (ex, sim) = exports.as_mut().unwrap();
                let stream = streams[pick(&mut rng, streams.len())].clone();
                if !ex.imported.is_empty() && (held.is_empty() || rng.below(2) == 0) {
                    let k = pick(&mut rng, ex.imported.len());
                    let silent = rng.below(2) == 0;
                    ex.finish_one(&live, sim, &stream, k, silent).await;
                } else if !held.is_empty() && ex.imported.len() < 4 {
                    let h = held.swap_remove(pick(&mut rng, held.len()));
                    ex.export(&alloc, sim, h, &stream).await;
                }
            }
            18 if i % 2 == 0 && pool.is_some() => {
                let p = pool.as_ref().unwrap();
                match p.sleep(SleepMode::Offload).await {
                    Ok(()) => {
                        // The memory was taken meanwhile (by the other tasks, or by this
                        // one's own buffers of the default pools): the pool stays asleep,
                        // with its copy, until a wake finds room. As a user would, free this
                        // task's other buffers, then wait for the others' frees. A task
                        // waiting here holds no device memory, so the wait ends at the
                        // latest when the other tasks have ended (a pool of a task without
                        // quota can need most of the device, and another task's pool, awake
                        // meanwhile, keeps it from fitting until that task ends or sleeps it).
                        let started = Instant::now();
                        while let Err(e) = p.wake().await {
                            assert!(
                                matches!(e, Error::Alloc(AllocError::WakeOutOfMemory { .. })),
                                "wake: {e}"
                            );
                            let (mine, others): (Vec<Held>, Vec<Held>) =
                                held.drain(..).partition(|h| h.pooled);
                            held = mine;
                            for h in others {
                                gpu.check(&h.stream, &h.buf, h.byte, Duration::ZERO);
                                live.release(&h.buf);
                            }
                            if started.elapsed() > WAKE_WAIT {
                                let summary = alloc.memory_summary().await.unwrap();
                                let usage = p.usage(DeviceId(0)).await;
                                let layout = layout(&alloc).await;
                                let own = p.snapshot(DeviceId(0)).await.map(|s| s.segments);
                                let sim = match &*gpu {
                                    Gpu::Sim(sim) => format!(
                                        "sim: {:?} bytes used, {} allocations",
                                        sim.used_bytes(DeviceId(0)),
                                        sim.live_allocations()
                                    ),
                                    Gpu::Driver(_) => String::new(),
                                };
                                panic!(
                                    "no room to wake in {WAKE_WAIT:?}: {e}\n{summary}\n\
                                     own pool: {usage:?}\n{layout}{sim}\nown segments: {own:#?}"
                                );
                            }
                            tokio::time::sleep(Duration::from_millis(1)).await;
                        }
                        // The offload brought every byte back: check them all now.
                        for h in &held {
                            gpu.check(&h.stream, &h.buf, h.byte, Duration::ZERO);
                        }
                    }
                    Err(e) => assert!(
                        matches!(
                            e,
                            Error::Alloc(
                                AllocError::NotSupported(_)
                                    | AllocError::PoolInGraph { .. }
                                    | AllocError::CaptureUnderway(_)
                                    | AllocError::PoolExported { .. }
                            )
                        ),
                        "sleep: {e}"
                    ),
                }
            }
            _ => tokio::task::yield_now().await,
        }
    }
    for Held {
        buf, stream, byte, ..
    } in held.drain(..)
    {
        gpu.check(&stream, &buf, byte, Duration::ZERO);
        live.release(&buf);
        drop(buf);
    }
    if let Some((mut ex, sim)) = exports {
        let stream = streams[0].clone();
        while !ex.imported.is_empty() {
            let silent = ex.imported.len() % 2 == 0;
            ex.finish_one(&live, &sim, &stream, 0, silent).await;
        }
        assert_eq!(ex.exp.outstanding(), 0);
    }
    let mut launched = Vec::new();
    for (k, g) in graphs.drain(..).enumerate() {
        launched.extend(g.launched_on.iter().cloned());
        g.drop_in_order(&live, k as u64);
    }
    for s in streams.iter().chain(&launched) {
        s.synchronize().unwrap();
    }
}

/// Device 0's segments and pools in a line each, for a failure's message: what holds memory.
async fn layout(alloc: &Allocator) -> String {
    let Ok(snapshot) = alloc.snapshot().await else {
        return "no snapshot".into();
    };
    let mut out = String::new();
    for seg in &snapshot[0].segments {
        let live = seg.blocks.iter().filter(|b| b.requested_size > 0).count();
        out += &format!(
            "segment {:#x} pool {:?} stream {} expandable {} total {} allocated {} active {} \
             blocks {} (active {live})\n",
            seg.address,
            seg.pool_id,
            seg.stream,
            seg.is_expandable,
            seg.total_size,
            seg.allocated_size,
            seg.active_size,
            seg.blocks.len(),
        );
    }
    for pool in &snapshot[0].pools {
        out += &format!("pool {} {:?}\n", pool.id, pool.name);
    }
    out
}

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The device the tasks share: a fresh 256 MiB sim, or with `GPUALLOC_BACKEND=cuda` the CUDA
/// backend's device 0 with `per_process_memory_fraction` capping it at 256 MiB (a
/// fraction in `conf` is taken of that).
fn device(conf: &str) -> (Arc<Gpu>, Allocator) {
    const CAPACITY: u64 = 256 * MIB;
    match BackendKind::from_env().expect("GPUALLOC_BACKEND") {
        BackendKind::Cuda => {
            let backend = gpualloc::cuda_backend().expect("the CUDA backend");
            let total = backend.mem_info(DeviceId(0)).unwrap().total;
            let share = CAPACITY as f64 / total as f64;
            let key = "per_process_memory_fraction:";
            let conf = match conf.find(key) {
                Some(at) => {
                    let rest = &conf[at + key.len()..];
                    let end = rest.find(',').unwrap_or(rest.len());
                    let f: f64 = rest[..end].parse().unwrap();
                    format!("{}{key}{}{}", &conf[..at], f * share, &rest[end..])
                }
                None if conf.is_empty() => format!("{key}{share}"),
                None => format!("{conf},{key}{share}"),
            };
            let alloc = build(backend.clone(), &conf);
            (Arc::new(Gpu::Driver(backend)), alloc)
        }
        _ => {
            let sim = SimBackend::new(SimConfig {
                capacity_per_device: CAPACITY,
                ..SimConfig::fast(1)
            })
            .unwrap();
            let alloc = build(sim.clone(), conf);
            (Arc::new(Gpu::Sim(sim)), alloc)
        }
    }
}

/// Runs four tasks of random operations on a fresh device in each config and seed, then checks
/// that nothing is left behind. With `pools`, each task also has a named pool of its own.
fn run(configs: &[&str], pools: bool) {
    let ops = env("GPUALLOC_STRESS_OPS", 1000) as usize;
    let seeds = env("GPUALLOC_STRESS_SEEDS", 1);
    let only = std::env::var("GPUALLOC_STRESS_CONFIG").ok();
    for conf in configs
        .iter()
        .filter(|c| only.as_ref().is_none_or(|o| c == &o))
    {
        for seed in 1..=seeds {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .unwrap();
            let (gpu, alloc) = {
                let _runtime = rt.enter();
                device(conf)
            };
            rt.block_on(async {
                let live = Live::default();
                let mut tasks = Vec::new();
                for t in 0..4u64 {
                    let pool = if pools {
                        // Every other pool has a quota its requests run into.
                        let quota = (t % 2 == 0).then_some(48 * MIB);
                        let options = PoolOptions {
                            quota,
                            ..PoolOptions::default()
                        };
                        Some(alloc.pool(&format!("task{t}"), options).await.unwrap())
                    } else {
                        None
                    };
                    let seed = seed * 7919 + t * 104_729 + 1;
                    let (alloc, gpu, live) = (alloc.clone(), gpu.clone(), live.clone());
                    tasks.push(tokio::spawn(task(alloc, gpu, live, seed, ops, pool)));
                }
                for t in tasks {
                    t.await
                        .unwrap_or_else(|e| panic!("[{conf}] seed {seed}: {e}"));
                }
                // A miss whose future a timeout dropped finishes on the blocking pool, then
                // returns its block: wait for those before counting.
                let actor = alloc.device_actor(DeviceId(0)).unwrap().clone();
                for _ in 0..2000 {
                    if actor.misses_in_flight() == 0 {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                assert_eq!(actor.misses_in_flight(), 0, "[{conf}] seed {seed}");
                let st = alloc.stats(DeviceId(0)).await.unwrap();
                assert_eq!(st.allocated_bytes[0].current, 0, "[{conf}] seed {seed}");
                // Frees recorded on other streams wait for their events until `empty_cache`
                // synchronizes them (they count as active till then, as in PyTorch); the
                // tasks' pools, dropped, give their segments back there too, and graph pools
                // once their release (off the dropping thread) has run.
                let mut st = alloc.stats(DeviceId(0)).await.unwrap();
                for _ in 0..2000 {
                    alloc.empty_cache().await.unwrap();
                    st = alloc.stats(DeviceId(0)).await.unwrap();
                    if st.reserved_bytes[0].current == 0 {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                assert_eq!(st.active_bytes[0].current, 0, "[{conf}] seed {seed}");
                // Pinned buffers of copies dropped unawaited come back once their streams
                // passed the copies (the tasks synchronized their streams).
                let host = alloc.host();
                let mut hs = host.stats().await.unwrap();
                for _ in 0..2000 {
                    if hs.allocation.current == 0 {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    hs = host.stats().await.unwrap();
                }
                assert_eq!(hs.allocation.current, 0, "[{conf}] seed {seed}: pinned");
                if st.reserved_bytes[0].current != 0 {
                    panic!(
                        "[{conf}] seed {seed}: {} bytes reserved after empty_cache\n{}",
                        st.reserved_bytes[0].current,
                        layout(&alloc).await
                    );
                }
                alloc.shutdown().await.unwrap();
            });
            if let Gpu::Sim(sim) = &*gpu {
                assert_eq!(sim.kernel_failures(), 0, "[{conf}] seed {seed}");
                assert_eq!(sim.live_allocations(), 0, "[{conf}] seed {seed}");
                assert_eq!(
                    sim.unknown_handle_calls(),
                    0,
                    "[{conf}] seed {seed}: a backend call named a destroyed stream or event"
                );
            }
        }
    }
}

#[test]
fn random_use_keeps_every_buffer_whole_and_leaves_nothing_behind() {
    run(CONFIGS, false);
}

/// The same with a named pool per task (half of them with a quota), each put to sleep with
/// its data offloaded and woken now and then.
#[test]
fn random_use_of_named_pools_with_sleep_and_wake_keeps_every_buffer_whole() {
    run(
        &[
            "",
            "thread_cache:False",
            "expandable_segments:False",
            "garbage_collection_threshold:0.6,per_process_memory_fraction:0.8",
            "expandable_segments:True,policy:pytorch",
        ],
        true,
    );
}
