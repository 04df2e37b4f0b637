//! An inference-server-like workload, with no setup:
//! `cargo run --release --example serve [-- --requests N --concurrency C --pools --history F]`.
//!
//! Concurrent requests of varying sizes (input activations, outputs, scratch) run on two
//! simulated devices with four streams each. Every request's kernels write a pattern of its
//! own into its buffers and verify it later on the stream; some hand their output to a
//! second stream (`record_stream`) for post-processing. Any memory handed out while another
//! stream still uses it shows up as a mismatch. The devices are small, so requests also wait
//! for memory (`MallocOptions::wait_for`) instead of failing.
//!
//! On a driver (feature `cuda`, with `GPUALLOC_BACKEND=cuda`, or a GPU present): every GPU the
//! driver shows, four streams each, with their own memory. There are no kernels of ours
//! there: a write is a memset, and a check copies the bytes to the host in stream order
//! (blocking the task's worker thread for the copy) and compares them there. CI runs it this
//! way on the emulated driver.
//!
//! `--pools` (with `expandable_segments:True`): two memory pools per device, as a server with
//! two models has. Requests allocate from a `kv_cache` pool; a second model's `weights` pool
//! (written with a pattern at the start) is put to sleep a third of the way through the run,
//! offloaded to pinned host memory while the requests go on, and woken two thirds of the way
//! through; its bytes are then checked at the same addresses.
//!
//! `--history out.pickle`: records the allocator's history during the run
//! (`Allocator::record_history`) and writes it with the segments at the end
//! (`Allocator::dump_snapshot`), a file PyTorch's memory viewer opens; the file is read back
//! and its segments checked against `stats()`.
//!
//! Prints malloc and request latency percentiles and the PyTorch-style memory summary;
//! exits non-zero on any data mismatch, failed kernel, error or leak.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpualloc::runtime::sim::{KernelMemory, SimBackend, SimConfig};
use gpualloc::runtime::{Backend, BackendError};
use gpualloc::{
    Allocator, AllocatorConfig, DeviceBuffer, DeviceId, DevicePtr, Error, HistoryOptions,
    MallocOptions, Pool, PoolOptions, SleepMode, Stream,
};

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
/// Simulated devices.
const SIM_DEVICES: u32 = 2;
const STREAMS_PER_DEVICE: usize = 4;
/// A simulated device's memory: small on purpose, requests sometimes wait for memory.
const SIM_CAPACITY: u64 = 320 * MIB;

struct Args {
    requests: u64,
    concurrency: usize,
    /// Two pools per device, one put to sleep and woken mid-run.
    pools: bool,
    /// Record the history and write it here at the end.
    history: Option<std::path::PathBuf>,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        requests: 20_000,
        concurrency: 48,
        pools: false,
        history: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "--pools" {
            args.pools = true;
            continue;
        }
        let value = it.next().ok_or_else(|| format!("{flag} needs a value"))?;
        let parse = |v: &str| v.parse::<u64>().map_err(|e| format!("{flag} {v}: {e}"));
        match flag.as_str() {
            "--requests" => args.requests = parse(&value)?,
            "--concurrency" => args.concurrency = parse(&value)?.max(1) as usize,
            "--history" => args.history = Some(value.into()),
            other => {
                return Err(format!(
                    "unknown flag {other} (use --requests N --concurrency C --pools --history F)"
                ))
            }
        }
    }
    Ok(args)
}

/// Writes the snapshot with the recorded history to `path`, reads it back and checks its
/// segments against `stats()`. False on a mismatch.
async fn write_history(
    alloc: &Allocator,
    devices: u32,
    path: &std::path::Path,
) -> Result<bool, Error> {
    alloc.dump_snapshot(path).await?;
    let bytes = std::fs::read(path).map_err(|e| Error::Internal(format!("{e}")))?;
    let snap = gpualloc::trace::Snapshot::from_pickle(&bytes)
        .map_err(|e| Error::Internal(format!("reading {}: {e}", path.display())))?;
    let mut ok = true;
    for d in 0..devices {
        let reserved: u64 = snap
            .segments
            .iter()
            .filter(|s| s.device == i64::from(d))
            .map(|s| s.total_size)
            .sum();
        let stats = alloc.stats(DeviceId(d)).await?;
        if reserved != stats.reserved_bytes[0].current {
            eprintln!(
                "history: device {d}: the snapshot's segments hold {reserved} bytes, stats() {}",
                stats.reserved_bytes[0].current
            );
            ok = false;
        }
    }
    let entries: Vec<usize> = snap.device_traces.iter().map(Vec::len).collect();
    println!(
        "history: {} bytes written to {} (entries per device: {entries:?}); open it in PyTorch's memory viewer",
        bytes.len(),
        path.display()
    );
    Ok(ok)
}

/// A small deterministic generator (xorshift), one per request.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

#[derive(Default)]
struct Counters {
    mismatches: AtomicU64,
    waited: AtomicU64,
}

/// The parts of a buffer the kernels write and check: all of a small buffer, the first and
/// last 64 KiB of a large one (a reused block starts at a block boundary, so a head always
/// overlaps; this keeps the simulated kernels' CPU work, which competes with the allocator
/// for this machine's cores, small).
fn regions(ptr: DevicePtr, len: u64) -> Vec<(DevicePtr, u64)> {
    const EDGE: u64 = 64 * KIB;
    if len <= 4 * EDGE {
        vec![(ptr, len)]
    } else {
        vec![(ptr, EDGE), (DevicePtr(ptr.0 + len - EDGE), EDGE)]
    }
}

fn fill_regions(
    m: &mut KernelMemory,
    ptr: DevicePtr,
    len: u64,
    byte: u8,
) -> Result<(), BackendError> {
    for (p, l) in regions(ptr, len) {
        m.fill(p, l, byte)?;
    }
    Ok(())
}

fn check_regions(
    m: &mut KernelMemory,
    ptr: DevicePtr,
    len: u64,
    byte: u8,
) -> Result<bool, BackendError> {
    for (p, l) in regions(ptr, len) {
        if !m.check(p, l, byte)? {
            return Ok(false);
        }
    }
    Ok(true)
}

/// What runs the requests' kernels (see the module docs).
#[derive(Clone)]
enum Gpu {
    /// The simulated GPU: its kernels write and check the bytes on the device.
    Sim(Arc<SimBackend>),
    /// A driver: memsets, and checks by a stream-ordered copy to the host (made only in a
    /// build with feature `cuda`).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    Driver(Arc<dyn Backend>),
}

impl Gpu {
    /// A driver when `GPUALLOC_BACKEND` says `cuda` (an error if there is none), or when it
    /// says nothing and a GPU is present; else the simulated GPU.
    fn choose() -> Result<Gpu, Error> {
        let sim = || -> Result<Gpu, Error> {
            Ok(Gpu::Sim(SimBackend::new(SimConfig {
                devices: SIM_DEVICES,
                capacity_per_device: SIM_CAPACITY,
                ..SimConfig::default()
            })?))
        };
        match gpualloc::BackendKind::from_env()? {
            gpualloc::BackendKind::Cuda => Gpu::driver(),
            gpualloc::BackendKind::Sim => sim(),
            _ => Gpu::driver().or_else(|_| sim()),
        }
    }

    #[cfg(feature = "cuda")]
    fn driver() -> Result<Gpu, Error> {
        let backend: Arc<dyn Backend> = gpualloc::runtime::cuda::CudaBackend::new()?;
        Ok(Gpu::Driver(backend))
    }

    #[cfg(not(feature = "cuda"))]
    fn driver() -> Result<Gpu, Error> {
        Err(
            BackendError::Unavailable("this build has no CUDA backend (feature `cuda`)".into())
                .into(),
        )
    }

    fn backend(&self) -> Arc<dyn Backend> {
        match self {
            Gpu::Sim(sim) => sim.clone(),
            Gpu::Driver(b) => b.clone(),
        }
    }

    /// The devices the requests use.
    fn devices(&self) -> Result<u32, Error> {
        match self {
            Gpu::Sim(_) => Ok(SIM_DEVICES),
            Gpu::Driver(b) => Ok(b.device_count()?),
        }
    }

    /// The memory the requests may use on a device (the least free of any device, on a
    /// driver).
    fn capacity(&self) -> Result<u64, Error> {
        match self {
            Gpu::Sim(_) => Ok(SIM_CAPACITY),
            Gpu::Driver(b) => {
                let mut least = u64::MAX;
                for d in 0..b.device_count()? {
                    least = least.min(b.mem_info(DeviceId(d))?.free);
                }
                Ok(least)
            }
        }
    }

    /// What the process holds on the device side: live allocations on the sim, the driver's
    /// used bytes per device on a driver.
    fn held(&self) -> Result<Vec<u64>, Error> {
        match self {
            Gpu::Sim(sim) => Ok(vec![sim.live_allocations() as u64]),
            Gpu::Driver(b) => (0..b.device_count()?)
                .map(|d| {
                    let info = b.mem_info(DeviceId(d))?;
                    Ok(info.total - info.free)
                })
                .collect(),
        }
    }

    /// Kernels that failed (the sim's; a driver runs none of ours).
    fn kernel_failures(&self) -> u64 {
        match self {
            Gpu::Sim(sim) => sim.kernel_failures(),
            Gpu::Driver(_) => 0,
        }
    }

    /// Fills each of `fills` with its byte, after the work before it on `stream`.
    fn fill(
        &self,
        stream: &Stream,
        duration: Duration,
        fills: Vec<(DevicePtr, u64, u8)>,
    ) -> Result<(), BackendError> {
        match self {
            Gpu::Sim(sim) => sim.launch_kernel(stream.handle(), duration, move |m| {
                for (ptr, len, byte) in &fills {
                    fill_regions(m, *ptr, *len, *byte)?;
                }
                Ok(())
            }),
            Gpu::Driver(b) => {
                for (ptr, len, byte) in fills {
                    for (p, l) in regions(ptr, len) {
                        b.memset_async(stream.handle(), p, byte, l)?;
                    }
                }
                Ok(())
            }
        }
    }

    /// Fills every byte of `[ptr, ptr + len)` with `byte`, in stream order.
    fn fill_every_byte(
        &self,
        stream: &Stream,
        (ptr, len, byte): (DevicePtr, u64, u8),
    ) -> Result<(), BackendError> {
        match self {
            Gpu::Sim(sim) => sim.launch_kernel(stream.handle(), Duration::ZERO, move |m| {
                m.fill(ptr, len, byte)
            }),
            Gpu::Driver(b) => b.memset_async(stream.handle(), ptr, byte, len),
        }
    }

    /// True when all of `[ptr, ptr + len)` holds `byte` once the work before it on `stream`
    /// is done: a stream-ordered copy to the host (a driver only).
    fn holds_on_driver(
        b: &Arc<dyn Backend>,
        stream: &Stream,
        (ptr, len, byte): (DevicePtr, u64, u8),
        every_byte: bool,
    ) -> Result<bool, BackendError> {
        let parts = match every_byte {
            true => vec![(ptr, len)],
            false => regions(ptr, len),
        };
        for (p, l) in parts {
            let mut host = vec![0u8; l as usize];
            tokio::task::block_in_place(|| b.copy_from_device(stream.handle(), &mut host, p))?;
            if host.iter().any(|x| *x != byte) {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Checks that `check` holds its byte (counting a mismatch, and failing, if not) and then
    /// fills `next` (if any), in stream order.
    fn check_then_fill(
        &self,
        stream: &Stream,
        duration: Duration,
        check: (&DeviceBuffer, u8),
        next: Option<(&DeviceBuffer, u8)>,
        counters: &Arc<Counters>,
    ) -> Result<(), BackendError> {
        let (cptr, clen, cbyte) = (check.0.ptr(), check.0.len(), check.1);
        let next = next.map(|(b, v)| (b.ptr(), b.len(), v));
        let mismatch = |counters: &Counters| {
            counters.mismatches.fetch_add(1, Ordering::Relaxed);
            BackendError::invalid("data mismatch: memory reused while in use")
        };
        match self {
            Gpu::Sim(sim) => {
                let counters = counters.clone();
                sim.launch_kernel(stream.handle(), duration, move |m| {
                    if !check_regions(m, cptr, clen, cbyte)? {
                        return Err(mismatch(&counters));
                    }
                    if let Some((ptr, len, byte)) = next {
                        fill_regions(m, ptr, len, byte)?;
                    }
                    Ok(())
                })
            }
            Gpu::Driver(b) => {
                if !Gpu::holds_on_driver(b, stream, (cptr, clen, cbyte), false)? {
                    return Err(mismatch(counters));
                }
                match next {
                    Some(fill) => self.fill(stream, duration, vec![fill]),
                    None => Ok(()),
                }
            }
        }
    }

    /// Adds to `bad` when `[ptr, ptr + len)` does not hold `byte` once `stream` has run the
    /// work before (every byte).
    fn count_if_changed(
        &self,
        stream: &Stream,
        (ptr, len, byte): (DevicePtr, u64, u8),
        bad: &Arc<AtomicU64>,
    ) -> Result<(), BackendError> {
        match self {
            Gpu::Sim(sim) => {
                let bad = bad.clone();
                sim.launch_kernel(stream.handle(), Duration::ZERO, move |m| {
                    if !m.check(ptr, len, byte)? {
                        bad.fetch_add(1, Ordering::Relaxed);
                    }
                    Ok(())
                })
            }
            Gpu::Driver(b) => {
                if !Gpu::holds_on_driver(b, stream, (ptr, len, byte), true)? {
                    bad.fetch_add(1, Ordering::Relaxed);
                }
                Ok(())
            }
        }
    }
}

struct Timing {
    mallocs_ns: Vec<u64>,
    request_ns: u64,
}

async fn request(
    id: u64,
    alloc: Allocator,
    pool: Option<Pool>,
    gpu: Gpu,
    streams: Arc<Vec<Vec<Stream>>>,
    budgets: Arc<Vec<Arc<tokio::sync::Semaphore>>>,
    counters: Arc<Counters>,
) -> Result<Timing, Error> {
    let start = Instant::now();
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ (id + 1).wrapping_mul(0xD6E8_FEB8_6659_FD93));
    let dev = (id % streams.len() as u64) as usize;
    let stream = &streams[dev][(rng.next() % STREAMS_PER_DEVICE as u64) as usize];
    let tokens = 1 + rng.next() % 1024;
    let sizes = [
        tokens * 16 * KIB,
        tokens * 4 * KIB,
        4 * KIB + rng.next() % (512 * KIB),
    ];
    // Admission by memory budget, as a server does: without it, requests that each hold one
    // buffer while waiting for the next could fill the device and wait on each other.
    let mib = (sizes.iter().sum::<u64>()).div_ceil(MIB) as u32;
    let _budget = budgets[dev]
        .clone()
        .acquire_many_owned(mib)
        .await
        .map_err(|e| Error::Internal(e.to_string()))?;
    // Fragmentation can still leave the device short: wait for frees rather than fail.
    let wait = MallocOptions::wait_for(Duration::from_secs(10));
    let mut mallocs_ns = Vec::with_capacity(3);
    let mut bufs = Vec::with_capacity(3);
    for size in sizes {
        let t = Instant::now();
        let buf = match &pool {
            Some(pool) => pool.malloc_with(size, stream, wait).await?,
            None => alloc.malloc_with(size, stream, wait).await?,
        };
        let ns = t.elapsed().as_nanos() as u64;
        if ns > 1_000_000 {
            counters.waited.fetch_add(1, Ordering::Relaxed);
        }
        mallocs_ns.push(ns);
        bufs.push(buf);
    }
    let scratch = bufs
        .pop()
        .ok_or_else(|| Error::Internal("scratch".into()))?;
    let output = bufs.pop().ok_or_else(|| Error::Internal("output".into()))?;
    let input = bufs.pop().ok_or_else(|| Error::Internal("input".into()))?;
    let p = (id % 250) as u8 + 1;
    let compute = Duration::from_micros(20 + tokens / 8);

    // Load the input and scratch, run the "model", then check everything.
    gpu.fill(
        stream,
        Duration::from_micros(10),
        vec![
            (input.ptr(), input.len(), p),
            (scratch.ptr(), scratch.len(), p ^ 0x33),
        ],
    )?;
    gpu.check_then_fill(
        stream,
        compute,
        (&input, p),
        Some((&output, p ^ 0x5A)),
        &counters,
    )?;
    gpu.check_then_fill(
        stream,
        Duration::ZERO,
        (&scratch, p ^ 0x33),
        None,
        &counters,
    )?;
    // Scratch is done with: free it now (stream-ordered, as in PyTorch).
    drop(scratch);

    if id % 8 == 0 {
        // Post-processing on another stream of the same device.
        let other = &streams[dev][(STREAMS_PER_DEVICE - 1) - (id as usize / 8) % 2];
        if other != stream {
            other.wait_event(&stream.record_event()?)?;
            output.record_stream(other)?;
            gpu.check_then_fill(
                other,
                Duration::from_micros(30),
                (&output, p ^ 0x5A),
                None,
                &counters,
            )?;
            drop(output);
            gpu.check_then_fill(stream, Duration::ZERO, (&input, p), None, &counters)?;
            drop(input);
            stream.completed().await?;
            other.completed().await?;
            return Ok(Timing {
                mallocs_ns,
                request_ns: start.elapsed().as_nanos() as u64,
            });
        }
    }
    gpu.check_then_fill(stream, Duration::ZERO, (&output, p ^ 0x5A), None, &counters)?;
    drop(output);
    drop(input);
    stream.completed().await?;
    Ok(Timing {
        mallocs_ns,
        request_ns: start.elapsed().as_nanos() as u64,
    })
}

fn percentiles(label: &str, unit: &str, scale: f64, samples: &mut [u64]) {
    if samples.is_empty() {
        return;
    }
    samples.sort_unstable();
    let at = |p: f64| samples[((samples.len() - 1) as f64 * p).round() as usize] as f64 / scale;
    println!(
        "{label:<22} n={:<6} p50 {:>9.2} {unit}  p90 {:>9.2} {unit}  p99 {:>9.2} {unit}  p99.9 {:>9.2} {unit}  max {:>9.2} {unit}",
        samples.len(),
        at(0.5),
        at(0.9),
        at(0.99),
        at(0.999),
        at(1.0)
    );
}

async fn run(args: Args) -> Result<bool, Error> {
    let gpu = Gpu::choose()?;
    let devices = gpu.devices()?;
    let capacity = gpu.capacity()?;
    let held_before = gpu.held()?;
    // GPUALLOC_CONF (or PYTORCH_CUDA_ALLOC_CONF) applies if set; `--pools` needs expandable
    // segments (a pool sleeps by unmapping its pages).
    let mut builder = Allocator::builder().backend_instance(gpu.backend());
    if args.pools {
        let config = AllocatorConfig::from_env()
            .map_err(|e| Error::Internal(format!("GPUALLOC_CONF: {e}")))?
            .with_expandable_segments(true);
        builder = builder.config(config);
    }
    let alloc = builder.build()?;
    let streams: Vec<Vec<Stream>> = (0..devices)
        .map(|d| {
            (0..STREAMS_PER_DEVICE)
                .map(|_| alloc.new_stream(DeviceId(d)))
                .collect::<Result<_, _>>()
        })
        .collect::<Result<_, _>>()?;
    let streams = Arc::new(streams);
    let counters = Arc::new(Counters::default());
    let limit = Arc::new(tokio::sync::Semaphore::new(args.concurrency));
    // 3/5 of what the allocator may hold: the device, or its `per_process_memory_fraction`
    // (a budget above the cap lets requests holding buffers wait on each other).
    let allowed = alloc
        .config()
        .per_process_memory_fraction
        .map_or(capacity, |f| (capacity as f64 * f) as u64);
    let weights = if args.pools {
        Some(load_weights(&alloc, &gpu, &streams).await?)
    } else {
        None
    };
    let weight_bytes = weights.as_ref().map_or(0, |w| w.bytes_per_device);
    let budget_mib = ((allowed - weight_bytes) / MIB) as usize * 3 / 5;
    // The KV cache's quota leaves room for the weights to come back: without it, requests
    // could fill the memory the sleep freed and the wake would find none.
    let kv = match &weights {
        Some(w) => {
            let quota = allowed.saturating_sub(w.reserved_per_device + 16 * MIB);
            let options = PoolOptions {
                quota: Some(quota),
                ..PoolOptions::default()
            };
            Some(alloc.pool("kv_cache", options).await?)
        }
        None => None,
    };
    let budgets: Arc<Vec<_>> = Arc::new(
        (0..devices)
            .map(|_| Arc::new(tokio::sync::Semaphore::new(budget_mib)))
            .collect(),
    );
    let kind = match &gpu {
        Gpu::Sim(_) => "simulated devices",
        Gpu::Driver(_) => "devices of the CUDA driver",
    };
    println!(
        "serve: {} requests, {} in flight, {devices} {kind} x {STREAMS_PER_DEVICE} streams, {} MiB each",
        args.requests,
        args.concurrency,
        capacity / MIB
    );

    let done = Arc::new(AtomicU64::new(0));
    let watchdog = {
        let (alloc, done) = (alloc.clone(), done.clone());
        tokio::spawn(async move {
            let mut last = 0;
            loop {
                tokio::time::sleep(Duration::from_secs(5)).await;
                let now = done.load(Ordering::Relaxed);
                if now == last {
                    eprintln!("serve: no request finished in 5 s ({now} done)");
                    for d in 0..devices {
                        if let Ok(a) = alloc.device_actor(DeviceId(d)) {
                            eprintln!("  {}", a.describe());
                        }
                    }
                }
                last = now;
            }
        })
    };
    if args.history.is_some() {
        alloc.record_history(HistoryOptions::default()).await?;
    }
    let started = Instant::now();
    let sleeper = weights.map(|w| {
        let (done, requests) = (done.clone(), args.requests);
        tokio::spawn(sleep_and_wake(w, done, requests))
    });
    let mut handles = Vec::with_capacity(args.requests as usize);
    for id in 0..args.requests {
        let permit = limit
            .clone()
            .acquire_owned()
            .await
            .map_err(|e| Error::Internal(e.to_string()))?;
        let (alloc, gpu, streams, budgets, counters, kv) = (
            alloc.clone(),
            gpu.clone(),
            streams.clone(),
            budgets.clone(),
            counters.clone(),
            kv.clone(),
        );
        let done = done.clone();
        handles.push(tokio::spawn(async move {
            let r = request(id, alloc, kv, gpu, streams, budgets, counters).await;
            done.fetch_add(1, Ordering::Relaxed);
            drop(permit);
            r
        }));
    }
    let mut mallocs = Vec::new();
    let mut requests = Vec::new();
    let mut errors = 0u64;
    for h in handles {
        match h.await {
            Ok(Ok(t)) => {
                mallocs.extend(t.mallocs_ns);
                requests.push(t.request_ns);
            }
            Ok(Err(e)) => {
                errors += 1;
                eprintln!("request failed: {e}");
            }
            Err(e) => {
                errors += 1;
                eprintln!("request task failed: {e}");
            }
        }
    }
    let wall = started.elapsed();
    watchdog.abort();
    let slept = match sleeper {
        Some(task) => match task.await {
            Ok(Ok(w)) => Some(w),
            Ok(Err(e)) => {
                errors += 1;
                eprintln!("sleep and wake failed: {e}");
                None
            }
            Err(e) => {
                errors += 1;
                eprintln!("sleep task failed: {e}");
                None
            }
        },
        None => None,
    };

    println!(
        "done in {:.2} s: {:.0} requests/s, {} mallocs",
        wall.as_secs_f64(),
        requests.len() as f64 / wall.as_secs_f64(),
        mallocs.len()
    );
    percentiles("malloc latency", "us", 1e3, &mut mallocs);
    percentiles("request latency", "ms", 1e6, &mut requests);
    let mut device_mallocs = 0;
    for d in 0..devices {
        let st = alloc.stats(DeviceId(d)).await?;
        device_mallocs += st.num_device_alloc;
        println!(
            "device {d}: {} device mallocs, {} device frees, {} OOM retries, peak reserved {:.1} MiB, {} served by the thread cache",
            st.num_device_alloc,
            st.num_device_free,
            st.num_alloc_retries,
            st.reserved_bytes[0].peak as f64 / MIB as f64,
            alloc.device_actor(DeviceId(d))?.thread_cache_revivals()
        );
    }
    println!(
        "cache hit rate {:.2}%, {} mallocs took over 1 ms (device mallocs, waits for memory)",
        100.0 * (1.0 - device_mallocs as f64 / mallocs.len().max(1) as f64),
        counters.waited.load(Ordering::Relaxed)
    );
    if let Some(w) = &slept {
        let r = &w.report;
        println!(
            "weights pool ({:.1} MiB per device): slept at request {} ({:.1} ms, MiB freed per device {:?}), woken at request {} ({:.1} ms, {} retries for memory); {} requests finished while it slept",
            w.bytes_per_device as f64 / MIB as f64,
            r.slept_at,
            r.sleep_ms,
            r.freed.iter().map(|b| b / MIB).collect::<Vec<_>>(),
            r.woken_at,
            r.wake_ms,
            r.wake_retries,
            r.woken_at - r.slept_at
        );
        if let Some(kv) = &kv {
            for d in 0..devices {
                let u = kv.usage(DeviceId(d)).await?;
                println!(
                    "kv_cache pool, device {d}: peak reserved {:.1} MiB, peak allocated {:.1} MiB",
                    u.reserved.all().peak as f64 / MIB as f64,
                    u.allocated.all().peak as f64 / MIB as f64
                );
            }
        }
        let bad = check_weights(&gpu, w).await?;
        if bad > 0 {
            counters.mismatches.fetch_add(bad, Ordering::Relaxed);
            eprintln!("weights: {bad} buffers changed across the sleep");
        } else {
            println!("weights: every byte back at the same address after the wake");
        }
    }
    println!();
    print!("{}", alloc.memory_summary().await?);
    if let Some(path) = &args.history {
        if !write_history(&alloc, devices, path).await? {
            errors += 1;
        }
    }
    drop((slept, kv));

    let mismatches = counters.mismatches.load(Ordering::Relaxed);
    let failures = gpu.kernel_failures();
    alloc.shutdown().await?;
    drop(streams);
    // What is held beyond what was before the allocator: allocations on the sim, devices
    // whose used memory grew on a driver.
    let leaked = gpu
        .held()?
        .iter()
        .zip(&held_before)
        .filter(|(now, before)| now > before)
        .map(|(now, before)| match &gpu {
            Gpu::Sim(_) => now - before,
            Gpu::Driver(_) => 1,
        })
        .sum::<u64>();
    println!("data mismatches: {mismatches}, failed kernels: {failures}, errors: {errors}, leaked allocations: {leaked}");
    Ok(mismatches == 0 && failures == 0 && errors == 0 && leaked == 0)
}

/// A second model's weights: a pool per device of buffers written with a pattern.
struct Weights {
    pool: Pool,
    devices: u32,
    /// (buffer, its stream, the byte it holds).
    buffers: Vec<(DeviceBuffer, Stream, u8)>,
    bytes_per_device: u64,
    /// Memory the pool reserves on a device (the most of any device).
    reserved_per_device: u64,
    report: SleepReport,
}

#[derive(Default)]
struct SleepReport {
    slept_at: u64,
    woken_at: u64,
    sleep_ms: f64,
    wake_ms: f64,
    /// Physical memory the sleep gave back, per device.
    freed: Vec<u64>,
    /// Wakes that found too little memory and were tried again.
    wake_retries: u64,
}

const WEIGHT_BUFFERS: u64 = 8;

async fn load_weights(
    alloc: &Allocator,
    gpu: &Gpu,
    streams: &[Vec<Stream>],
) -> Result<Weights, Error> {
    let pool = alloc.pool("weights", PoolOptions::default()).await?;
    let mut buffers = Vec::new();
    let mut bytes_per_device = 0;
    for (d, device_streams) in streams.iter().enumerate() {
        let stream = &device_streams[0];
        bytes_per_device = 0;
        for i in 0..WEIGHT_BUFFERS {
            let buf = pool.malloc(6 * MIB + i * 4097, stream).await?;
            bytes_per_device += buf.len();
            let byte = (d as u64 * 16 + i + 1) as u8;
            gpu.fill_every_byte(stream, (buf.ptr(), buf.len(), byte))?;
            buffers.push((buf, stream.clone(), byte));
        }
        stream.completed().await?;
    }
    let mut reserved_per_device = 0;
    for d in 0..streams.len() as u32 {
        let reserved = pool.usage(DeviceId(d)).await?.reserved.all().current;
        reserved_per_device = reserved_per_device.max(reserved);
    }
    Ok(Weights {
        pool,
        devices: streams.len() as u32,
        buffers,
        bytes_per_device,
        reserved_per_device,
        report: SleepReport::default(),
    })
}

/// Puts the weights to sleep once a third of the requests are done and wakes them at two
/// thirds, while the requests go on.
async fn sleep_and_wake(
    mut w: Weights,
    done: Arc<AtomicU64>,
    requests: u64,
) -> Result<Weights, Error> {
    let until = |n: u64| {
        let done = done.clone();
        async move {
            while done.load(Ordering::Relaxed) < n {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            done.load(Ordering::Relaxed)
        }
    };
    w.report.slept_at = until(requests / 3).await;
    let t = Instant::now();
    w.pool.sleep(SleepMode::Offload).await?;
    w.report.sleep_ms = t.elapsed().as_secs_f64() * 1e3;
    for d in 0..w.devices {
        w.report
            .freed
            .push(w.pool.usage(DeviceId(d)).await?.asleep_bytes);
    }
    w.report.woken_at = until(requests * 2 / 3).await;
    let t = Instant::now();
    // A wake that finds too little memory leaves the pool asleep with its data: try again
    // while requests free theirs (bounded).
    loop {
        match w.pool.wake().await {
            Err(e) if e.is_oom() && t.elapsed() < Duration::from_secs(10) => {
                w.report.wake_retries += 1;
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            r => break r?,
        }
    }
    w.report.wake_ms = t.elapsed().as_secs_f64() * 1e3;
    Ok(w)
}

/// Checks every byte of the weights on the device; returns how many buffers changed.
async fn check_weights(gpu: &Gpu, w: &Weights) -> Result<u64, Error> {
    let bad = Arc::new(AtomicU64::new(0));
    for (buf, stream, byte) in &w.buffers {
        gpu.count_if_changed(stream, (buf.ptr(), buf.len(), *byte), &bad)?;
    }
    for (_, stream, _) in &w.buffers {
        stream.completed().await?;
    }
    Ok(bad.load(Ordering::Relaxed))
}

fn main() {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("serve: {e}");
            std::process::exit(2);
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("serve: cannot start tokio: {e}");
            std::process::exit(2);
        }
    };
    match runtime.block_on(run(args)) {
        Ok(true) => println!("OK: every buffer held its data"),
        Ok(false) => {
            eprintln!("FAILED: data mismatch, kernel failure, error or leak");
            std::process::exit(1);
        }
        Err(e) => {
            eprintln!("serve: {e}");
            std::process::exit(1);
        }
    }
}
