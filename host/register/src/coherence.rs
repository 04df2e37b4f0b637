//! [`CoherenceGuard`]: the two boundaries where CPU and device views of registered host
//! memory must be made to agree (seed §2.2 and §3.3).
//!
//! A registration only makes memory *accessible* to the device; it does not order the CPU's
//! writes against device work, or the device's writes against the CPU's reads. Two moments
//! need explicit ordering:
//!
//! - **CPU writes, then the device reads** (e.g. the CPU fills an input buffer, then a copy
//!   or kernel on a stream reads it): call [`CoherenceGuard::before_device_read`] after the
//!   last CPU write and before enqueueing the device work. It issues a CPU fence (`SeqCst`:
//!   the writes are globally visible before anything after it, including the enqueue) and
//!   then a stream-ordered marker (a host function on the stream that runs its own fence), so
//!   every piece of device work enqueued afterwards on that stream runs after the point the
//!   CPU reached. Work enqueued on the stream *before* the call may still see old data.
//! - **The device writes, then the CPU reads** (e.g. a kernel or copy writes results into
//!   the registered buffer): call [`CoherenceGuard::after_device_write`] (blocking) or
//!   [`CoherenceGuard::after_device_write_async`] after enqueueing that work and before the
//!   first CPU read. It records an event on the stream, waits for it, then issues an
//!   acquire fence so the CPU's reads cannot be satisfied from before the device finished.
//!
//! Neither is needed for stream-ordered work that only touches device memory, nor when the
//! CPU already synchronized the stream and fenced by other means (a `stream_synchronize`
//! followed by a mutex acquire, for instance).

use std::ops::Range;
use std::sync::atomic::{fence, Ordering};

use gpualloc_runtime::{Result, Stream};

/// Marks a registered host range whose CPU/device hand-overs need ordering (see the module
/// docs for when to call what).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CoherenceGuard {
    range: Range<u64>,
}

impl CoherenceGuard {
    /// A guard for the registered range `range` (e.g. a [`super::RegistrationInfo`]'s
    /// `user_range`).
    pub fn new(range: Range<u64>) -> Self {
        CoherenceGuard { range }
    }

    /// The range the guard covers.
    pub fn range(&self) -> Range<u64> {
        self.range.clone()
    }

    /// After the CPU's last write, before enqueueing device work that reads the range on
    /// `stream`: CPU write fence, then a stream-ordered fence marker. Errors when the stream
    /// refuses the marker.
    pub fn before_device_read(&self, stream: &Stream) -> Result<()> {
        fence(Ordering::SeqCst);
        tracing::trace!(start = self.range.start, stream = ?stream.handle(), "before_device_read");
        stream
            .backend()
            .launch_host_func(stream.handle(), Box::new(|_| fence(Ordering::SeqCst)))
    }

    /// After enqueueing device work that writes the range on `stream`, before the CPU reads
    /// it: waits (blocking this thread) for an event recorded now on `stream`, then an
    /// acquire fence.
    pub fn after_device_write(&self, stream: &Stream) -> Result<()> {
        let event = stream.record_event()?;
        event.synchronize()?;
        fence(Ordering::Acquire);
        Ok(())
    }

    /// [`CoherenceGuard::after_device_write`] without blocking: awaits the event's
    /// completion (a host callback wakes it), then an acquire fence.
    pub async fn after_device_write_async(&self, stream: &Stream) -> Result<()> {
        let event = stream.record_event()?;
        event.completed().await?;
        fence(Ordering::Acquire);
        Ok(())
    }
}
