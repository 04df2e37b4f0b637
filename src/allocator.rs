//! [`Allocator`]: the handle a service holds. Cheap to clone, `Send + Sync`; every clone
//! talks to the same per-device actors.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use gpualloc_devices::{AllocError, AllocatorConfig, CrossStreamFree, DeviceSnapshot, DeviceStats};
use gpualloc_runtime::{Backend, DeviceId, Stream};
use tokio::task::JoinHandle;

use crate::actor::{Attempt, DeviceActor};
use crate::buffer::DeviceBuffer;
use crate::builder::AllocatorBuilder;
use crate::error::Error;
use crate::fork::ProcessGuard;
use crate::oom::OomObservers;
use crate::options::MallocOptions;
use crate::pinned::{HostActor, HostAllocator};
use gpualloc_devices::memory_summary;

struct Inner {
    backend: Arc<dyn Backend>,
    devices: Vec<Arc<DeviceActor>>,
    host: Arc<HostActor>,
    process: ProcessGuard,
    shut_down: AtomicBool,
    tasks: Mutex<Vec<JoinHandle<()>>>,
    config: AllocatorConfig,
    oom: OomObservers,
    /// Snapshots written on out-of-memory go one at a time (`oom.rs`).
    oom_dump: tokio::sync::Mutex<()>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        // The last handle is gone: stop the actor tasks, and close the thread caches (their
        // lanes point back at the actors; parked blocks go back to the cores). The cores
        // live on while buffers do, and return every segment when the last one is dropped.
        for d in &self.devices {
            d.close_thread_cache();
            d.stop.trigger();
        }
        self.host.stop.trigger();
    }
}

/// The allocator. See the module docs and the crate docs for an example.
#[derive(Clone)]
pub struct Allocator {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Allocator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Allocator")
            .field("backend", &self.inner.backend.name())
            .field("devices", &self.inner.devices.len())
            .finish()
    }
}

impl Allocator {
    /// A builder (configuration, backend choice).
    pub fn builder() -> AllocatorBuilder {
        AllocatorBuilder::new()
    }

    pub(crate) fn from_parts(
        backend: Arc<dyn Backend>,
        devices: Vec<Arc<DeviceActor>>,
        host: Arc<HostActor>,
        process: ProcessGuard,
        tasks: Vec<JoinHandle<()>>,
        config: AllocatorConfig,
        oom: OomObservers,
    ) -> Self {
        Allocator {
            inner: Arc::new(Inner {
                backend,
                devices,
                host,
                process,
                shut_down: AtomicBool::new(false),
                tasks: Mutex::new(tasks),
                config,
                oom,
                oom_dump: tokio::sync::Mutex::new(()),
            }),
        }
    }

    /// The pinned-host allocator: `alloc.host().malloc(size).await` for page-locked host
    /// memory, and copies between it and device buffers (see [`HostAllocator`]).
    pub fn host(&self) -> HostAllocator {
        HostAllocator::new(self.inner.host.clone())
    }

    /// The backend the allocator runs on.
    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.inner.backend
    }

    /// The configuration in force.
    pub fn config(&self) -> &AllocatorConfig {
        &self.inner.config
    }

    pub(crate) fn oom_observers(&self) -> &OomObservers {
        &self.inner.oom
    }

    pub(crate) fn oom_dump_lock(&self) -> &tokio::sync::Mutex<()> {
        &self.inner.oom_dump
    }

    /// Number of devices.
    pub fn device_count(&self) -> u32 {
        self.inner.devices.len() as u32
    }

    /// A new stream on `device` of this allocator's backend.
    pub fn new_stream(&self, device: DeviceId) -> Result<Stream, Error> {
        self.actor(device)?;
        Ok(Stream::new(&self.inner.backend, device)?)
    }

    /// The actor of `device`.
    pub fn device_actor(&self, device: DeviceId) -> Result<&Arc<DeviceActor>, Error> {
        self.actor(device)
    }

    fn actor(&self, device: DeviceId) -> Result<&Arc<DeviceActor>, Error> {
        // `let else`, not `ok_or`: an error built eagerly is dropped on every request.
        let Some(actor) = self.inner.devices.get(device.0 as usize) else {
            return Err(Error::InvalidDevice {
                device: device.0,
                count: self.inner.devices.len() as u32,
            });
        };
        Ok(actor)
    }

    #[inline]
    pub(crate) fn check(&self) -> Result<(), Error> {
        self.inner.process.check()?;
        if self.inner.shut_down.load(Ordering::Acquire) {
            return Err(AllocError::Shutdown.into());
        }
        Ok(())
    }

    pub(crate) fn actor_for(&self, stream: &Stream) -> Result<&Arc<DeviceActor>, Error> {
        if !Arc::ptr_eq(stream.backend(), &self.inner.backend) {
            return Err(Error::ForeignStream);
        }
        self.actor(stream.device())
    }

    /// Allocates `size` bytes for use on `stream` (whose device it picks). A cache hit is
    /// served inline; a miss allocates from the device on the blocking pool while other
    /// requests keep being served. Size 0 gives an empty buffer with a null pointer.
    ///
    /// When the device is full (after the cache was released) the error is an out-of-memory
    /// error: test it with [`Error::is_oom`], and read PyTorch's report (requested, free,
    /// allocated, reserved) from [`Error::oom_report`] or its `Display`. To wait for memory
    /// instead of failing, use [`Allocator::malloc_with`] and [`MallocOptions::wait_for`].
    pub async fn malloc(&self, size: u64, stream: &Stream) -> Result<DeviceBuffer, Error> {
        self.check()?;
        let actor = self.actor_for(stream)?;
        // A thread-cache hit first: it needs no follow-up (its frames, when recorded, went
        // into its slot's entry), so it returns before anything else is built.
        if let Some(buf) = actor.revive(size, stream, None) {
            return Ok(buf);
        }
        // Then the gate's hit, also without a future of its own: this future holds nothing
        // but the box of the rest, so a hit neither builds nor drops a larger one.
        let first = match actor.try_malloc(size, stream, None) {
            Attempt::Hit(buf) if !Self::buffer_follow_up(actor, &buf) => return Ok(buf),
            first => first,
        };
        Box::pin(self.malloc_rest(actor, first, size, stream)).await
    }

    /// [`Allocator::malloc`] after its first attempt at the gate: the rest of the device's
    /// malloc, then the follow-up its result needs.
    async fn malloc_rest(
        &self,
        actor: &Arc<DeviceActor>,
        first: Attempt,
        size: u64,
        stream: &Stream,
    ) -> Result<DeviceBuffer, Error> {
        let r = actor.malloc_from(first, size, stream, None).await;
        if self.malloc_follow_up(actor, &r) {
            return Box::pin(self.follow_up(actor, stream, size, r)).await;
        }
        r
    }

    /// [`Allocator::malloc`] with options (e.g. wait for memory instead of failing).
    pub async fn malloc_with(
        &self,
        size: u64,
        stream: &Stream,
        options: MallocOptions,
    ) -> Result<DeviceBuffer, Error> {
        self.check()?;
        let actor = self.actor_for(stream)?;
        let r = actor.malloc_with(size, stream, None, options).await;
        if self.malloc_follow_up(actor, &r) {
            return Box::pin(self.follow_up(actor, stream, size, r)).await;
        }
        r
    }

    /// Marks `buffer` as used on `stream` (see [`DeviceBuffer::record_stream`]).
    pub fn record_stream(&self, buffer: &DeviceBuffer, stream: &Stream) -> Result<(), Error> {
        buffer.record_stream(stream)
    }

    /// Returns every unused cached segment of every device to the backend, after waiting
    /// (off the async runtime) for pending cross-stream frees. Live buffers are untouched.
    pub async fn empty_cache(&self) -> Result<(), Error> {
        self.check()?;
        for actor in &self.inner.devices {
            let actor = actor.clone();
            actor
                .runtime
                .clone()
                .spawn_blocking(move || actor.empty_cache_blocking())
                .await
                .map_err(|e| Error::Internal(format!("empty_cache task failed: {e}")))??;
        }
        Ok(())
    }

    /// Statistics of `device` (PyTorch's `memory_stats`).
    pub async fn stats(&self, device: DeviceId) -> Result<DeviceStats, Error> {
        self.inner.process.check()?;
        self.actor(device)?.stats().await
    }

    /// Lets work on `device` use memory allocated on `peer` (PyTorch's peer access between two
    /// GPUs): enables the driver's peer access, then gives `device` access to `peer`'s
    /// expandable-segment memory, mapped now and from now on (ordinary segments need only
    /// the driver's peer access). Without it, a buffer from an expandable segment of `peer`
    /// used by a kernel or copy on `device` faults, while one from an ordinary segment works.
    /// Enabling it twice is not an error; `device == peer` is.
    pub async fn enable_peer_access(&self, device: DeviceId, peer: DeviceId) -> Result<(), Error> {
        self.inner.process.check()?;
        self.actor(device)?;
        let owner = self.actor(peer)?;
        self.inner.backend.enable_peer_access(device, peer)?;
        owner.add_peer(device).await
    }

    /// Resets the peaks of `device`'s statistics to their current values (PyTorch's
    /// `reset_peak_memory_stats`): later [`Allocator::stats`] report peaks from now on.
    pub async fn reset_peak_stats(&self, device: DeviceId) -> Result<(), Error> {
        self.inner.process.check()?;
        self.actor(device)?.reset_peak_stats().await
    }

    /// Resets the allocated/freed sums and the counters (`num_ooms`, `num_alloc_retries`,
    /// ...) of `device`'s statistics (PyTorch's `reset_accumulated_memory_stats`).
    pub async fn reset_accumulated_stats(&self, device: DeviceId) -> Result<(), Error> {
        self.inner.process.check()?;
        self.actor(device)?.reset_accumulated_stats().await
    }

    /// The last frees on `device` that the `debug_cross_stream_frees` config key's check
    /// reported (oldest first, at most [`CROSS_STREAM_LOG`](crate::devices::CROSS_STREAM_LOG)):
    /// buffers dropped while another stream, neither `record_stream`ed nor waited for, still
    /// had queued work on them. Empty with the key off, or on a backend that cannot tell (a
    /// real GPU). Each report is also a `tracing` warning, and counted in
    /// [`DeviceStats::num_cross_stream_frees`](crate::DeviceStats). A free is checked when
    /// the device actor processes it: after a buffer's drop, call this (or any other call
    /// through the actor, such as [`Allocator::stats`]) to see it.
    pub async fn cross_stream_frees(
        &self,
        device: DeviceId,
    ) -> Result<Vec<CrossStreamFree>, Error> {
        self.inner.process.check()?;
        self.actor(device)?.cross_stream_frees().await
    }

    /// Segments and blocks of every device (PyTorch's `memory_snapshot`).
    pub async fn snapshot(&self) -> Result<Vec<DeviceSnapshot>, Error> {
        self.inner.process.check()?;
        let mut out = Vec::with_capacity(self.inner.devices.len());
        for actor in &self.inner.devices {
            out.push(actor.snapshot().await?);
        }
        Ok(out)
    }

    /// A PyTorch-style `memory_summary()` table for every device.
    pub async fn memory_summary(&self) -> Result<String, Error> {
        self.inner.process.check()?;
        let mut out = String::new();
        for actor in &self.inner.devices {
            let stats = actor.stats().await?;
            out.push_str(&memory_summary(actor.device(), &stats));
        }
        Ok(out)
    }

    /// Shuts down: every device returns every segment to the backend (also those of live
    /// buffers, which must not be used any more; dropping them later is harmless); the
    /// pinned-host allocator waits for pending copies and releases its cache (live pinned
    /// buffers keep their memory until dropped: it is CPU memory), waiting
    /// requests fail, later calls get `AllocError::Shutdown`, and the actor tasks stop.
    /// Idempotent: later calls return `Ok`.
    pub async fn shutdown(&self) -> Result<(), Error> {
        self.inner.process.check()?;
        if self.inner.shut_down.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        tracing::info!(devices = self.inner.devices.len(), "shutting down");
        let mut first_err = None;
        for actor in &self.inner.devices {
            let a = actor.clone();
            let r = a
                .runtime
                .clone()
                .spawn_blocking(move || a.shutdown_blocking())
                .await
                .map_err(|e| Error::Internal(format!("shutdown task failed: {e}")))
                .and_then(|r| r);
            if let Err(e) = r {
                first_err.get_or_insert(e);
            }
            actor.stop.trigger();
        }
        // The pinned-host actor: pending copies finish, cached blocks go back.
        let host = self.inner.host.clone();
        let r = tokio::task::spawn_blocking(move || host.shutdown_blocking())
            .await
            .map_err(|e| Error::Internal(format!("pinned shutdown task failed: {e}")))
            .and_then(|r| r);
        if let Err(e) = r {
            first_err.get_or_insert(e);
        }
        self.inner.host.stop.trigger();
        let tasks =
            std::mem::take(&mut *self.inner.tasks.lock().unwrap_or_else(|p| p.into_inner()));
        for t in tasks {
            let _ = t.await;
        }
        first_err.map_or(Ok(()), Err)
    }
}
