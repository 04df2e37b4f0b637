//! Helpers shared by the facade's integration tests: a one-device simulated GPU, an allocator
//! on a backend, and waiting for requests to queue for memory. (Each test file is its own
//! crate and uses only some of them.)
#![allow(dead_code)]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use gpualloc::devices::{TraceAction, TraceEntry};
use gpualloc::runtime::sim::{LatencyModel, Op, SimBackend, SimConfig};
use gpualloc::{Allocator, Backend, DeviceActor, DeviceId, DevicePtr, HistoryOptions, Stream};

pub const MIB: u64 = 1 << 20;

/// The configs a rule of the `gpualloc` policy is tried in as a user would: the default,
/// expandable segments without the thread cache, garbage collection, and PyTorch's policy
/// (where the rule does not apply: see [`is_pytorch`]).
pub const POLICY_CONFIGS: [&str; 4] = [
    "",
    "expandable_segments:True,thread_cache:False",
    "garbage_collection_threshold:0.8",
    "policy:pytorch,expandable_segments:True",
];

/// Whether `conf` runs PyTorch's policy.
pub fn is_pytorch(conf: &str) -> bool {
    conf.contains("policy:pytorch")
}

/// Waits (up to `ms` milliseconds, polling each one) until `ok` holds of the actor's misses in
/// flight; returns the count then, for the caller's assertion.
pub async fn wait_in_flight(actor: &DeviceActor, ms: u32, ok: impl Fn(usize) -> bool) -> usize {
    for _ in 0..ms {
        if ok(actor.misses_in_flight()) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    actor.misses_in_flight()
}

/// A one-device sim of `capacity` bytes with no latency.
pub fn sim(capacity: u64) -> Arc<SimBackend> {
    sim_with(capacity, LatencyModel::zero())
}

/// A one-device sim of `capacity` bytes whose calls cost `latency`.
pub fn sim_with(capacity: u64, latency: LatencyModel) -> Arc<SimBackend> {
    SimBackend::new(SimConfig {
        capacity_per_device: capacity,
        latency,
        ..SimConfig::fast(1)
    })
    .expect("sim")
}

/// An allocator with config string `conf` on `backend`.
pub fn build(backend: Arc<dyn Backend>, conf: &str) -> Allocator {
    Allocator::builder()
        .config_str(conf)
        .backend_instance(backend)
        .build()
        .expect("build")
}

/// Waits (up to 5 s) until `n` requests wait for memory on device 0.
pub async fn until_waiting(alloc: &Allocator, n: usize) {
    until_waiters(alloc, n, false).await;
}

/// Waits (up to 5 s) until `n` requests wait for memory on device 0, every one of them parked
/// (retried, failed and waiting again: `DeviceActor::parked_waiters`).
pub async fn until_parked(alloc: &Allocator, n: usize) {
    until_waiters(alloc, n, true).await;
}

/// `n` waiters on device 0, all of them parked if `parked`; panics after 5 s.
async fn until_waiters(alloc: &Allocator, n: usize, parked: bool) {
    let actor = alloc.device_actor(DeviceId(0)).unwrap();
    let counts = || (actor.waiting(), actor.parked_waiters());
    let reached = |(waiting, parks): (usize, usize)| waiting == n && (!parked || parks == n);
    for _ in 0..2500 {
        if reached(counts()) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let (waiting, parks) = counts();
    panic!("expected {n} waiters (parked: {parked}), found {waiting} ({parks} parked)");
}

/// Ranges `(addr, size)` in address order with the ones that touch joined into one.
pub fn joined(ranges: impl IntoIterator<Item = (u64, u64)>) -> Vec<(u64, u64)> {
    let mut out: Vec<(u64, u64)> = Vec::new();
    for (a, s) in ranges {
        match out.last_mut() {
            Some(last) if last.0 + last.1 == a => last.1 += s,
            _ => out.push((a, s)),
        }
    }
    out
}

/// Blocks device 0's thread cache handed straight back so far.
pub fn revivals(alloc: &Allocator) -> u64 {
    alloc
        .device_actor(DeviceId(0))
        .unwrap()
        .thread_cache_revivals()
}

/// Device 0's recorded history, less the mark of the snapshot that read it (its last entry).
pub async fn history(alloc: &Allocator) -> Vec<TraceEntry> {
    let mut trace = alloc.snapshot().await.unwrap().remove(0).trace;
    let mark = trace.pop().unwrap();
    assert_eq!(mark.action, TraceAction::Snapshot);
    trace
}

/// An allocator with config `conf` on a 1 GiB sim, a stream of device 0, and the history
/// being recorded with `options`.
pub async fn recording(conf: &str, options: HistoryOptions) -> (Allocator, Stream) {
    let alloc = build(sim(1 << 30), conf);
    let stream = alloc.new_stream(DeviceId(0)).unwrap();
    alloc.record_history(options).await.unwrap();
    (alloc, stream)
}

/// Fills 1 MiB at `ptr` with `byte` by a kernel queued on `stream` (the sim's memory).
pub fn fill_mib(sim: &SimBackend, stream: &Stream, ptr: DevicePtr, byte: u8) {
    sim.launch_kernel(stream.handle(), Duration::ZERO, move |m| {
        m.fill(ptr, MIB, byte)
    })
    .unwrap();
}

/// 1 MiB at `ptr`, read by a kernel on `stream` once its work before is done.
pub fn read_mib(sim: &SimBackend, stream: &Stream, ptr: DevicePtr) -> Vec<u8> {
    let out = Arc::new(Mutex::new(Vec::new()));
    let o = out.clone();
    sim.launch_kernel(stream.handle(), Duration::ZERO, move |m| {
        *o.lock().unwrap() = m.read(ptr, MIB)?;
        Ok(())
    })
    .unwrap();
    stream.synchronize().unwrap();
    let bytes = out.lock().unwrap().clone();
    bytes
}

/// Waits until the sim has started `op` at least `n` times.
pub async fn until_started(sim: &SimBackend, op: Op, n: u64) {
    for _ in 0..5000 {
        if sim.counts().get(op) >= n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    panic!("{op} never started");
}
