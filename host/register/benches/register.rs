//! Tail latency of 64 concurrent registrations: backend calls on tokio's blocking pool
//! (`AsyncRegistry`, the default) vs inline on the caller's task (`RegistrationMode::Inline`),
//! on the sim with real-hardware latencies (a 64 MiB `host_register` costs ~3.8 ms there).
//!
//! Two workloads, each round spawning 64 tasks at once on a 4-worker runtime; a task's latency
//! runs from its spawn to its registration being usable:
//! - *distinct*: every task registers its own 64 MiB range (64 backend calls a round);
//! - *mixed*: 8 tasks register new 64 MiB ranges, 56 re-register a range registered before
//!   the round (cache hits, no backend call: the "register the same buffer per task" pattern
//!   of the seed's §3.1), so the hits' latency shows whether slow calls stall them.
//!
//! Prints p50/p99 per mode and the p99 ratio (the seed, §3.2, reports about 4x lower tail
//! latency). The sim reads `/proc/self/maps` in every `host_register` (CPU work that does not
//! parallelize on a small, busy machine), so the numbers depend on the core count.
//! `cargo bench -p gpualloc-host-register --bench register`; under `cargo test` it runs one round.

use std::sync::Arc;
use std::time::{Duration, Instant};

use gpualloc_host::mapping::PageMapping;
use gpualloc_host_register::{AsyncOptions, AsyncRegistry, RegistrationMode};
use gpualloc_runtime::{Backend, HostRegisterFlags};
use gpualloc_sim::{SimBackend, SimConfig};

const TASKS: usize = 64;
const RANGE: usize = 64 << 20;

fn percentile(sorted: &[Duration], q: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * q).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// Latencies of `rounds` rounds of 64 concurrent registrations; in the mixed workload only
/// tasks `0..8` make new registrations and the rest re-register the range at index 63.
/// Returns `(latency, was a cache hit)` per task.
fn run(
    mode: RegistrationMode,
    mixed: bool,
    rounds: usize,
    mem: &Arc<PageMapping>,
) -> Vec<(Duration, bool)> {
    let sim = SimBackend::new(SimConfig::default()).expect("sim");
    let backend: Arc<dyn Backend> = sim;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .build()
        .expect("runtime");
    let flags = HostRegisterFlags::default();
    rt.block_on(async {
        let options = AsyncOptions {
            mode,
            slow_threshold: Duration::from_secs(10),
        };
        let reg = AsyncRegistry::with_options(backend, options).expect("registry");
        let hot = mem.as_ptr().wrapping_add((TASKS - 1) * RANGE);
        let hot_id = if mixed {
            // SAFETY: the bench's own mapped memory, which outlives the registration; no copy is
            // queued on it.
            Some(
                unsafe { reg.register(hot, RANGE as u64, flags) }
                    .expect("hot")
                    .await
                    .expect("hot"),
            )
        } else {
            None
        };
        let mut all = Vec::new();
        for _ in 0..rounds {
            let mut tasks = Vec::new();
            for t in 0..TASKS {
                let reg = reg.clone();
                let addr = if mixed && t >= 8 {
                    hot as usize
                } else {
                    mem.addr() as usize + t * RANGE
                };
                let start = Instant::now();
                tasks.push(tokio::spawn(async move {
                    // SAFETY: a range of the bench's own mapping, which outlives the registry; no
                    // copy is queued on it.
                    let id = unsafe { reg.register(addr as *const u8, RANGE as u64, flags) }
                        .expect("register")
                        .await
                        .expect("registered");
                    (start.elapsed(), id)
                }));
            }
            let mut ids = Vec::new();
            for task in tasks {
                let (latency, id) = task.await.expect("task");
                all.push((latency, mixed && all.len() % TASKS >= 8));
                ids.push(id);
            }
            for id in ids {
                reg.release(id).expect("release").await.expect("released");
            }
        }
        if let Some(id) = hot_id {
            reg.release(id).expect("release").await.expect("released");
        }
        all
    })
}

fn main() {
    let bench = std::env::args().any(|a| a == "--bench");
    let rounds = if bench { 20 } else { 1 };
    let mem = Arc::new(PageMapping::new(TASKS * RANGE).expect("4 GiB mapping (untouched)"));
    let started = Instant::now();
    for (workload, mixed) in [("distinct", false), ("mixed   ", true)] {
        let mut p99s = Vec::new();
        for (name, mode) in [
            ("async ", RegistrationMode::Background),
            ("inline", RegistrationMode::Inline),
        ] {
            let samples = run(mode, mixed, rounds, &mem);
            let mut lat: Vec<Duration> = samples.iter().map(|s| s.0).collect();
            lat.sort();
            let (p50, p99) = (percentile(&lat, 0.5), percentile(&lat, 0.99));
            let mut hits: Vec<Duration> = samples.iter().filter(|s| s.1).map(|s| s.0).collect();
            hits.sort();
            let hits_p99 = if hits.is_empty() {
                String::new()
            } else {
                let h = percentile(&hits, 0.99).as_secs_f64() * 1e3;
                format!("  cache hits p99 {h:>7.2} ms")
            };
            println!(
                "{workload} x{TASKS} {name}: p50 {:>7.2} ms  p99 {:>7.2} ms{hits_p99}  ({} samples)",
                p50.as_secs_f64() * 1e3,
                p99.as_secs_f64() * 1e3,
                lat.len()
            );
            p99s.push((p99, hits.last().map(|_| percentile(&hits, 0.99))));
        }
        let ratio = |a: Duration, b: Duration| a.as_secs_f64() / b.as_secs_f64().max(1e-9);
        println!(
            "{workload} p99 ratio inline / async: {:.1}x",
            ratio(p99s[1].0, p99s[0].0)
        );
        if let (Some(inline), Some(async_)) = (p99s[1].1, p99s[0].1) {
            println!(
                "{workload} cache-hit p99 ratio inline / async: {:.1}x",
                ratio(inline, async_)
            );
        }
    }
    println!("total {:.1} s", started.elapsed().as_secs_f64());
}
