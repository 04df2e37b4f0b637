//! [`PinnedBuffer`]: page-locked host memory from the pinned-host allocator, returned when
//! dropped.
//!
//! It is CPU memory: it derefs to `[u8]` (see `slice`). `Drop` works on any thread, inside or
//! outside an async runtime, before or after the allocator shut down, and never blocks or
//! panics: it posts a free to the host actor's mailbox. A buffer used by a stream (copies
//! from [`HostAllocator`](crate::HostAllocator) record it automatically; other uses call
//! [`PinnedBuffer::record_stream`]) is reused only after that stream passed the free.

use std::fmt;
use std::sync::Arc;

use gpualloc_host::{HostBlock, HostPtr};
use gpualloc_runtime::Stream;

use crate::error::Error;
use crate::pinned::actor::HostActor;
use crate::pinned::state::HostMsg;

/// Pinned host memory owned by the holder. See the module docs.
pub struct PinnedBuffer {
    ptr: HostPtr,
    len: u64,
    capacity: u64,
    actor: Arc<HostActor>,
}

impl fmt::Debug for PinnedBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PinnedBuffer")
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .field("capacity", &self.capacity)
            .finish()
    }
}

impl PinnedBuffer {
    pub(crate) fn new(block: HostBlock, actor: Arc<HostActor>) -> Self {
        PinnedBuffer {
            ptr: block.ptr,
            len: block.requested,
            capacity: block.size,
            actor,
        }
    }

    /// An empty buffer (`malloc(0)`, as PyTorch's empty allocation): no block behind it, a
    /// null pointer, an empty slice; dropping it does nothing.
    pub(crate) fn empty(actor: Arc<HostActor>) -> Self {
        PinnedBuffer {
            ptr: HostPtr(0),
            len: 0,
            capacity: 0,
            actor,
        }
    }

    /// The host address (null for an empty buffer).
    pub fn ptr(&self) -> HostPtr {
        self.ptr
    }

    /// Bytes requested; what `Deref` exposes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// True for the empty buffer of `malloc(0)`.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes of the block behind it (the request rounded to its size class).
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    pub(crate) fn actor(&self) -> &Arc<HostActor> {
        &self.actor
    }

    /// Marks the buffer as used on `stream` (PyTorch's `record_event` on free): when it is
    /// dropped, its memory is reused only after the work queued on `stream` by then. The
    /// copies of [`HostAllocator`](crate::HostAllocator) call this themselves. Errors for a
    /// stream of another backend, and in a forked child.
    pub fn record_stream(&self, stream: &Stream) -> Result<(), Error> {
        self.actor.process.check()?;
        if !Arc::ptr_eq(stream.backend(), &self.actor.backend) {
            return Err(Error::ForeignStream);
        }
        if self.ptr.0 != 0 {
            self.actor
                .mailbox
                .post(HostMsg::RecordStream(self.ptr, stream.clone()));
        }
        Ok(())
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        // In a forked child the allocator's state is a dead copy: leave it alone. An empty
        // buffer has no block.
        if self.ptr.0 == 0 || self.actor.process.forked() {
            return;
        }
        self.actor.mailbox.post(HostMsg::Free(self.ptr));
    }
}
