//! Named memory pools: what an inference server keeps apart (model weights, the KV cache), each
//! with its own quota, on every device of the allocator.
//!
//! - [`Allocator::pool`] creates one; [`Pool::malloc`] allocates from it. A pool's blocks
//!   serve only its own requests and its segments are its own, so nothing done to one pool
//!   (releasing it, later putting it to sleep) can touch memory of another: the
//!   torch_memory_saver#85 bug (KV-cache memory reused by another model's weights) cannot
//!   happen by construction. The exception is PyTorch's `use_on_oom`
//!   ([`PoolOptions::use_on_oom`]): such a pool lends its free blocks to requests of the device
//!   that would otherwise fail; they return to the pool when freed.
//! - [`PoolOptions::quota`] caps the bytes the pool reserves on each device (its segments, or
//!   under `expandable_segments:True` the pages mapped into its own expandable segments). A
//!   request past it first returns the pool's own cached memory to the device, then fails
//!   with [`AllocError::PoolQuota`] (the pool's name, quota and usage; [`Error::is_oom`] is
//!   true for it), or, with [`MallocOptions::wait_for`], waits for frees like a request on a
//!   full device. Waiting is first come, first served across all pools of a device: a waiter
//!   whose pool is still at its quota after a free passes its turn to the next.
//! - [`Pool::usage`]: the pool's reserved and allocated bytes (current and peak) and segments
//!   on a device; [`Pool::stats`], [`Pool::snapshot`] and [`Pool::memory_summary`] show it as
//!   the allocator's do for a device. [`Allocator::stats`] counts every pool, so the device's
//!   figures are the sum of the default pools and these.
//! - A stream dropped by its users does not strand the pool's memory: its free segments serve
//!   the pool's requests on other streams.
//! - Pool blocks bypass the thread cache (a block parked there could be handed to a request
//!   of another pool); a pool's hits take the actor's gate, as `thread_cache:False` does.
//! - [`PoolOptions::unsplit`]`: Some(g)` (with `expandable_segments:True`) gives every block of
//!   the pool a range of its own, aligned to `g` and a multiple of it, never split: what
//!   NCCL's NVLS registration needs (pytorch#148374). [`Allocator::watch_segments`] announces
//!   each such range with the buffer's own address and size.
//! - Dropping the last handle of a pool releases it, as PyTorch's `MemPool` does: its live
//!   buffers stay valid, and its cached segments go back to the device on the next
//!   [`Allocator::empty_cache`] once they are free.

use std::sync::Arc;

use gpualloc_devices::{
    memory_summary, AllocError, DeviceCore, DeviceSnapshot, DeviceStats, MemPoolId,
};
use gpualloc_runtime::{DeviceId, Stream};

pub use gpualloc_devices::{PoolOptions, PoolUsage};

use crate::pool_sleep::{HostCopies, HostSlot};
use crate::{Allocator, DeviceBuffer, Error, MallocOptions};

/// A named memory pool on every device of an [`Allocator`]. Cheap to clone; see the module
/// docs.
///
/// ```no_run
/// # async fn demo(alloc: gpualloc::Allocator, stream: gpualloc::Stream) -> Result<(), gpualloc::Error> {
/// use gpualloc::{MallocOptions, PoolOptions};
/// let weights = alloc.pool("weights", PoolOptions::default()).await?;
/// let kv = alloc
///     .pool("kv_cache", PoolOptions { quota: Some(8 << 30), ..Default::default() })
///     .await?;
/// let w = weights.malloc(1 << 30, &stream).await?;
/// // Past 8 GiB reserved: Error::Alloc(AllocError::PoolQuota { pool, quota, reserved, .. }),
/// // or wait for a free in the pool:
/// let page = kv
///     .malloc_with(64 << 20, &stream, MallocOptions::wait_for(std::time::Duration::from_secs(1)))
///     .await?;
/// let usage = kv.usage(stream.device()).await?; // reserved / allocated, current and peak
/// # drop((w, page, usage));
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct Pool {
    inner: Arc<PoolInner>,
}

#[derive(Debug)]
struct PoolInner {
    name: String,
    alloc: Allocator,
    /// The pool's id on each device, by device index.
    ids: Vec<MemPoolId>,
    /// Its data while asleep, per device (`pool_sleep.rs`).
    host_copies: HostCopies,
}

impl Drop for PoolInner {
    fn drop(&mut self) {
        for (device, id) in self.ids.iter().enumerate() {
            if let Ok(actor) = self.alloc.device_actor(DeviceId(device as u32)) {
                actor.release_pool(*id);
            }
        }
    }
}

impl Allocator {
    /// Creates a memory pool called `name` on every device (see [`Pool`]).
    pub async fn pool(&self, name: &str, options: PoolOptions) -> Result<Pool, Error> {
        self.check()?;
        // Refused before any device has it (e.g. `unsplit` without expandable segments).
        for device in 0..self.device_count() {
            let options = options.clone();
            self.device_actor(DeviceId(device))?
                .call(move |st| st.core.check_pool_options(&options))
                .await??;
        }
        let mut ids = Vec::new();
        for device in 0..self.device_count() {
            let actor = self.device_actor(DeviceId(device))?;
            let (name, options) = (name.to_string(), options.clone());
            ids.push(
                actor
                    .call(move |st| st.core.create_named_pool(&name, options))
                    .await?,
            );
        }
        Ok(Pool {
            inner: Arc::new(PoolInner {
                name: name.to_string(),
                alloc: self.clone(),
                host_copies: ids.iter().map(|_| Arc::default()).collect(),
                ids,
            }),
        })
    }
}

impl Pool {
    /// The pool's name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// Allocates `size` bytes from this pool for use on `stream` (on `stream`'s device).
    pub async fn malloc(&self, size: u64, stream: &Stream) -> Result<DeviceBuffer, Error> {
        self.malloc_with(size, stream, MallocOptions::default())
            .await
    }

    /// [`Pool::malloc`] with options (e.g. wait for memory when the pool is at its quota).
    pub async fn malloc_with(
        &self,
        size: u64,
        stream: &Stream,
        options: MallocOptions,
    ) -> Result<DeviceBuffer, Error> {
        let alloc = &self.inner.alloc;
        alloc.check()?;
        let id = self.id(stream.device())?;
        let actor = alloc.actor_for(stream)?;
        let r = actor.malloc_with(size, stream, Some(id), options).await;
        if alloc.malloc_follow_up(actor, &r) {
            return Box::pin(alloc.follow_up(actor, stream, size, r)).await;
        }
        r
    }

    /// What the pool holds on `device`.
    pub async fn usage(&self, device: DeviceId) -> Result<PoolUsage, Error> {
        self.ask(device, DeviceCore::pool_usage).await
    }

    /// The pool's statistics on `device`, in the device's terms: see
    /// `DeviceCore::pool_stats` (current values from its blocks; peaks of allocated and
    /// reserved bytes and segments tracked per pool, other peaks are the current values).
    pub async fn stats(&self, device: DeviceId) -> Result<DeviceStats, Error> {
        self.ask(device, DeviceCore::pool_stats).await
    }

    /// The pool's segments on `device`, as [`Allocator::snapshot`] shows them.
    pub async fn snapshot(&self, device: DeviceId) -> Result<DeviceSnapshot, Error> {
        self.ask(device, DeviceCore::pool_snapshot).await
    }

    /// Asks `device`'s core `query` about this pool; `UnknownPool` when the core no longer
    /// has it.
    async fn ask<R: Send + 'static>(
        &self,
        device: DeviceId,
        query: fn(&DeviceCore, MemPoolId) -> Option<R>,
    ) -> Result<R, Error> {
        let id = self.id(device)?;
        let actor = self.inner.alloc.device_actor(device)?;
        actor
            .call(move |st| query(&st.core, id))
            .await?
            .ok_or(Error::Alloc(AllocError::UnknownPool(id.0)))
    }

    /// PyTorch's `memory_summary()` table of the pool, one per device, each under a line
    /// naming the pool.
    pub async fn memory_summary(&self) -> Result<String, Error> {
        let mut out = String::new();
        for device in 0..self.inner.ids.len() as u32 {
            let stats = self.stats(DeviceId(device)).await?;
            out.push_str(&format!("memory pool {:?}\n", self.inner.name));
            out.push_str(&memory_summary(DeviceId(device), &stats));
        }
        Ok(out)
    }

    pub(crate) fn allocator(&self) -> &Allocator {
        &self.inner.alloc
    }

    /// Devices the pool is on.
    pub(crate) fn devices(&self) -> u32 {
        self.inner.ids.len() as u32
    }

    pub(crate) fn host_copy(&self, device: DeviceId) -> HostSlot {
        self.inner.host_copies[device.0 as usize].clone()
    }

    /// The pool's id on `device` (what [`SegmentEvent::pool`](crate::SegmentEvent) names).
    pub fn id(&self, device: DeviceId) -> Result<MemPoolId, Error> {
        self.inner
            .ids
            .get(device.0 as usize)
            .copied()
            .ok_or(Error::InvalidDevice {
                device: device.0,
                count: self.inner.ids.len() as u32,
            })
    }
}
