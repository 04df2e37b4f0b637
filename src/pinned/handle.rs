//! [`HostAllocator`]: what [`Allocator::host`](crate::Allocator::host) returns, a cheap handle
//! (one `Arc`) on the allocator's pinned-host actor.

use std::sync::Arc;

use gpualloc_host::{HostConfig, HostStats};

use crate::error::Error;
use crate::pinned::actor::HostActor;
use crate::pinned::buffer::PinnedBuffer;

/// The pinned-host allocator of an [`Allocator`](crate::Allocator). Cheap to clone.
///
/// ```no_run
/// # async fn demo(alloc: gpualloc::Allocator) -> Result<(), gpualloc::Error> {
/// let stream = alloc.new_stream(gpualloc::DeviceId(0))?;
/// let mut staging = alloc.host().malloc(1 << 20).await?;
/// staging.fill(7); // it is CPU memory
/// let dev = alloc.malloc(1 << 20, &stream).await?;
/// // The copy takes `staging` and hands it back once the stream has passed the copy.
/// let copy = alloc.host().copy_h2d(staging, &dev, &stream)?;
/// let staging = copy.finish().await?;
/// assert_eq!(staging[0], 7);
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct HostAllocator {
    actor: Arc<HostActor>,
}

impl HostAllocator {
    pub(crate) fn new(actor: Arc<HostActor>) -> Self {
        HostAllocator { actor }
    }

    pub(crate) fn actor(&self) -> &Arc<HostActor> {
        &self.actor
    }

    /// Allocates `size` bytes of pinned host memory. A cache hit is served inline; a miss
    /// allocates on the blocking pool. Size 0 gives an empty buffer with a null pointer, as
    /// the device `malloc` does (and PyTorch both). Errors: too large (`Error::Host`), the
    /// backend's (out of memory after releasing the cache), shutdown, a forked child.
    pub async fn malloc(&self, size: u64) -> Result<PinnedBuffer, Error> {
        if size == 0 {
            self.actor.check()?;
            return Ok(PinnedBuffer::empty(self.actor.clone()));
        }
        self.actor.malloc(size).await
    }

    /// Returns every cached pinned block to the backend (blocks still waiting for streams
    /// stay until those finish). Live buffers are untouched.
    pub async fn empty_cache(&self) -> Result<(), Error> {
        self.actor.empty_cache().await
    }

    /// Statistics with PyTorch's host keys ([`HostStats::as_map`]).
    pub async fn stats(&self) -> Result<HostStats, Error> {
        self.actor.stats().await
    }

    /// The configuration in force (from the `pinned_*` keys of the config string).
    pub async fn config(&self) -> Result<HostConfig, Error> {
        self.actor.call(|st| st.core.config().clone()).await
    }
}
