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

mod gpu;
mod history;
mod request;
mod weights;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpualloc::{Allocator, AllocatorConfig, DeviceId, Error, HistoryOptions, PoolOptions, Stream};

use gpu::Gpu;
use history::write_history;
use request::{percentiles, request, Counters};
use weights::{check_weights, load_weights, sleep_and_wake};

pub(crate) const KIB: u64 = 1 << 10;
pub(crate) const MIB: u64 = 1 << 20;
pub(crate) const STREAMS_PER_DEVICE: usize = 4;

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
