//! [`DeviceBuffer`]: device memory from the allocator, returned when dropped.
//!
//! `Drop` works on any thread, inside or outside an async runtime, before or after the
//! allocator shut down, and never blocks or panics: it parks the block in the thread cache
//! (`actor/thread_cache.rs`) or posts a free to the device actor's mailbox (handled inline
//! when the gate is free, else queued for the holder). Memory freed after `record_stream` is
//! reused only once the recorded streams have passed the free.
//!
//! With the `cuda` feature a buffer is also a cudarc device slice of bytes and a kernel
//! argument (see the `cuda` module of this crate: use on another stream needs
//! [`DeviceBuffer::record_stream`], as in PyTorch).

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use gpualloc_devices::{AllocError, Allocation, MemPoolId};
use gpualloc_runtime::{DeviceId, DevicePtr, Stream};

use crate::actor::{DeviceActor, DeviceMsg, Lane};
use crate::error::Error;

/// Device memory owned by the holder. See the module docs.
///
/// Its allocation is kept flat, without the stream handle its `stream` already holds and with
/// the pool as a plain id: a buffer is moved several times on its way out of a `malloc`, and
/// each byte less is one the hit path does not copy (96 -> 64 bytes without the `cuda`
/// feature, whose cudarc stream cell comes on top).
pub struct DeviceBuffer {
    ptr: DevicePtr,
    len: u64,
    /// Bytes of the block behind it (`Allocation::block_size`).
    block_size: u64,
    /// The private pool's id, 0 for the default pools (the core numbers pools from 1).
    pool: u64,
    small_pool: bool,
    oversize: bool,
    stream: Stream,
    /// `record_stream` named another stream: the free waits on events, so the block must go
    /// through the core, not the thread cache.
    used_elsewhere: AtomicBool,
    owner: Owner,
    /// The cudarc stream of `stream`, looked up on first use by the cudarc traits.
    #[cfg(feature = "cuda")]
    pub(crate) cudarc: std::sync::OnceLock<Option<Arc<cudarc::driver::CudaStream>>>,
}

/// What keeps a buffer's device actor alive: the actor itself, or (for a buffer a thread cache
/// handed back) that thread's lane to it, whose reference count only that thread writes.
enum Owner {
    Actor(Arc<DeviceActor>),
    Lane(Arc<Lane<DeviceActor>>),
}

impl fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .field("device", &self.actor().device)
            .finish()
    }
}

impl DeviceBuffer {
    #[inline]
    pub(crate) fn new(a: Allocation, actor: Arc<DeviceActor>, stream: Stream) -> Self {
        Self::with_owner(a, Owner::Actor(actor), stream)
    }

    /// A buffer the thread cache handed back, holding the thread's lane to the actor.
    #[inline]
    pub(crate) fn revived(a: Allocation, lane: Arc<Lane<DeviceActor>>, stream: Stream) -> Self {
        Self::with_owner(a, Owner::Lane(lane), stream)
    }

    #[inline]
    fn with_owner(a: Allocation, owner: Owner, stream: Stream) -> Self {
        debug_assert_eq!(
            a.stream,
            stream.handle(),
            "a buffer's stream is its allocation's"
        );
        debug_assert_ne!(a.pool, Some(MemPoolId(0)), "no private pool has id 0");
        DeviceBuffer {
            ptr: a.ptr,
            len: a.size,
            block_size: a.block_size,
            pool: a.pool.map_or(0, |p| p.0),
            small_pool: a.small_pool,
            oversize: a.oversize,
            stream,
            used_elsewhere: AtomicBool::new(false),
            owner,
            #[cfg(feature = "cuda")]
            cudarc: std::sync::OnceLock::new(),
        }
    }

    /// The allocation behind the buffer, as the core handed it out.
    #[inline]
    fn allocation(&self) -> Allocation {
        Allocation {
            ptr: self.ptr,
            size: self.len,
            block_size: self.block_size,
            stream: self.stream.handle(),
            small_pool: self.small_pool,
            oversize: self.oversize,
            pool: (self.pool != 0).then_some(MemPoolId(self.pool)),
        }
    }

    /// True for a buffer the thread cache handed back.
    pub(crate) fn is_revived(&self) -> bool {
        matches!(self.owner, Owner::Lane(_))
    }

    /// The actor that owns the memory.
    pub(crate) fn actor(&self) -> &Arc<DeviceActor> {
        match &self.owner {
            Owner::Actor(a) => a,
            Owner::Lane(l) => &l.0,
        }
    }

    /// The pointer's address field (kernel arguments are passed by reference).
    #[cfg(feature = "cuda")]
    pub(crate) fn ptr_ref(&self) -> &u64 {
        &self.ptr.0
    }

    /// The device address (null for a zero-length buffer).
    pub fn ptr(&self) -> DevicePtr {
        self.ptr
    }

    /// Bytes requested (the block behind it may be larger).
    pub fn len(&self) -> u64 {
        self.len
    }

    /// True for a zero-length buffer.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device the memory is on.
    pub fn device(&self) -> DeviceId {
        self.actor().device
    }

    /// The stream it was allocated on: freeing it is ordered after that stream's work.
    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    /// Marks the buffer as used on `stream` too (PyTorch's `record_stream`): when it is
    /// dropped, its memory is reused only after the work queued on `stream` by then.
    /// Errors for a stream of another device or another backend, and in a forked child.
    pub fn record_stream(&self, stream: &Stream) -> Result<(), Error> {
        self.actor().process.check()?;
        if !Arc::ptr_eq(stream.backend(), &self.actor().user_backend) {
            return Err(Error::ForeignStream);
        }
        if stream.device() != self.actor().device {
            return Err(AllocError::WrongDevice {
                expected: self.actor().device,
                got: stream.device(),
            }
            .into());
        }
        if self.ptr.0 != 0 && stream.handle() != self.stream.handle() {
            self.used_elsewhere.store(true, Ordering::Relaxed);
            self.actor()
                .mailbox
                .post(DeviceMsg::RecordStream(self.ptr, stream.clone()));
        }
        Ok(())
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if self.ptr.0 == 0 {
            return;
        }
        // In a forked child the allocator's state is a dead copy: leave it alone.
        if self.actor().process.forked() {
            return;
        }
        // Relaxed: `record_stream` took `&self`, and whoever drops the buffer owns it, so the
        // store happened before (any hand-over between threads synchronizes).
        self.actor().release(
            self.allocation(),
            self.used_elsewhere.load(Ordering::Relaxed),
        );
    }
}

#[cfg(test)]
mod tests {
    /// A hit moves the buffer several times on its way out of `malloc` (BENCHMARKS.md, "The hit
    /// pairs below `a3f18be`'s instructions"): a field added here costs every hit. 64 bytes, and
    /// the `cuda` feature's cudarc stream cell on top (the workspace's builds have it on).
    #[test]
    fn a_buffer_stays_64_bytes_besides_the_cudarc_cell() {
        #[cfg(feature = "cuda")]
        let cell = std::mem::size_of::<
            std::sync::OnceLock<Option<std::sync::Arc<cudarc::driver::CudaStream>>>,
        >();
        #[cfg(not(feature = "cuda"))]
        let cell = 0;
        let size = std::mem::size_of::<super::DeviceBuffer>();
        assert!(size <= 64 + cell, "{size} bytes");
    }
}
