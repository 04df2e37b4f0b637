//! One request: its buffers, its kernels, a hand-over to a second stream; and the figures.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpualloc::{Allocator, Error, MallocOptions, Pool, Stream};

use crate::gpu::Gpu;
use crate::{KIB, MIB, STREAMS_PER_DEVICE};

/// A small deterministic generator (xorshift), one per request.
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

#[derive(Default)]
pub(crate) struct Counters {
    pub(crate) mismatches: AtomicU64,
    pub(crate) waited: AtomicU64,
}

pub(crate) struct Timing {
    pub(crate) mallocs_ns: Vec<u64>,
    pub(crate) request_ns: u64,
}

pub(crate) async fn request(
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

pub(crate) fn percentiles(label: &str, unit: &str, scale: f64, samples: &mut [u64]) {
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
