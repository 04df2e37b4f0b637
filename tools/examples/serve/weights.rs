//! `--pools`: a second model's weights in a pool of their own, put to sleep and woken while
//! the requests go on, then checked byte for byte.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpualloc::{Allocator, DeviceBuffer, DeviceId, Error, Pool, PoolOptions, SleepMode, Stream};

use crate::gpu::Gpu;
use crate::MIB;

/// A second model's weights: a pool per device of buffers written with a pattern.
pub(crate) struct Weights {
    pub(crate) pool: Pool,
    pub(crate) devices: u32,
    /// (buffer, its stream, the byte it holds).
    pub(crate) buffers: Vec<(DeviceBuffer, Stream, u8)>,
    pub(crate) bytes_per_device: u64,
    /// Memory the pool reserves on a device (the most of any device).
    pub(crate) reserved_per_device: u64,
    pub(crate) report: SleepReport,
}

#[derive(Default)]
pub(crate) struct SleepReport {
    pub(crate) slept_at: u64,
    pub(crate) woken_at: u64,
    pub(crate) sleep_ms: f64,
    pub(crate) wake_ms: f64,
    /// Physical memory the sleep gave back, per device.
    pub(crate) freed: Vec<u64>,
    /// Wakes that found too little memory and were tried again.
    pub(crate) wake_retries: u64,
}

pub(crate) const WEIGHT_BUFFERS: u64 = 8;

pub(crate) async fn load_weights(
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
pub(crate) async fn sleep_and_wake(
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
pub(crate) async fn check_weights(gpu: &Gpu, w: &Weights) -> Result<u64, Error> {
    let bad = Arc::new(AtomicU64::new(0));
    for (buf, stream, byte) in &w.buffers {
        gpu.count_if_changed(stream, (buf.ptr(), buf.len(), *byte), &bad)?;
    }
    for (_, stream, _) in &w.buffers {
        stream.completed().await?;
    }
    Ok(bad.load(Ordering::Relaxed))
}
