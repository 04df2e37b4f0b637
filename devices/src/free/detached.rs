//! Split-phase operations for an owner that must not make slow driver calls while it holds
//! the core (the device actor): take the work out under the lock, do the driver calls
//! elsewhere, and bring the results back.
//!
//! - [`DeviceCore::pending_events`]: the events pending frees wait on, to synchronize them
//!   off the core; afterwards `process_events` completes those frees without blocking.
//! - [`DeviceCore::detach_free_segments`]: takes every whole cached segment out of the books
//!   (as `release_block` does, minus the driver free) and returns them for the caller to free
//!   with [`free_detached`] off the core, then hand back to
//!   [`DeviceCore::finish_segment_frees`]. The books drop them at once (the history shows
//!   the `segment_free` before the driver call, as PyTorch's does, so a watcher lets go of
//!   the range before it goes), but they count against `per_process_memory_fraction` until
//!   `finish_segment_frees` (`budget.rs`): the device has them until the free returns, and a
//!   request made meanwhile must not take the room twice.
//! - [`DeviceCore::detach_gc_victims`]: the same for the segments a garbage-collection pass
//!   reclaims.
//! - [`DeviceCore::is_shut_down`]: an owner finishing a segment allocation made off the core
//!   must not hand it to a core that already shut down (it frees it instead).

use gpualloc_runtime::{Backend, DeviceId, DevicePtr, EventHandle};

use crate::blocks::block::BlockId;
use crate::core::{DeviceCore, MemPoolId};
use crate::error::AllocError;
use crate::ledger::books::Counted;
use crate::ledger::trace::TraceAction;

/// A segment taken out of a core's books, still held from the backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DetachedSegment {
    /// Base address.
    pub ptr: DevicePtr,
    /// Bytes.
    pub size: u64,
    /// The block pool it left, for one the books let go of (it counts against the cap and
    /// the pool's quota until its free returns); `None` for one that never entered them (a
    /// segment a shutdown or a mix-up sends back).
    pub(crate) pool: Option<usize>,
}

impl DetachedSegment {
    /// A segment that never entered the books, to free.
    pub(crate) fn unbooked(ptr: DevicePtr, size: u64) -> Self {
        DetachedSegment {
            ptr,
            size,
            pool: None,
        }
    }
}

impl DeviceCore {
    /// True once [`DeviceCore::shutdown`] has run.
    pub fn is_shut_down(&self) -> bool {
        self.shut_down
    }

    /// The events that pending cross-stream frees wait on (one per pending free and stream).
    pub fn pending_events(&self) -> Vec<EventHandle> {
        self.pending.events()
    }

    /// The garbage-collection pass of a miss, split: takes the cached segments it would
    /// release out of the books (the same ones, chosen by age) and returns them for the caller
    /// to free with [`free_detached`] off the core (then [`DeviceCore::finish_segment_frees`]).
    /// Empty unless `garbage_collection_threshold`
    /// and `per_process_memory_fraction` are set and reserved memory is above the threshold.
    pub fn detach_gc_victims(&mut self) -> Result<Vec<DetachedSegment>, AllocError> {
        if self.shut_down {
            return Err(AllocError::Shutdown);
        }
        let victims = self.gc_victims();
        Ok(victims
            .into_iter()
            .map(|id| self.detach_block(id))
            .collect())
    }

    /// Takes every whole free segment of the default pools (and of released private pools)
    /// out of the books and returns them; the caller must free each with [`free_detached`],
    /// then hand them to [`DeviceCore::finish_segment_frees`].
    /// Does not wait for pending frees (synchronize [`DeviceCore::pending_events`] and call
    /// `process_events` first to include them). Expandable segments are not detached.
    pub fn detach_free_segments(&mut self) -> Result<Vec<DetachedSegment>, AllocError> {
        if self.shut_down {
            return Err(AllocError::Shutdown);
        }
        self.process_events()?;
        let mut out = Vec::new();
        for pool in self.release_scope() {
            out.extend(self.detach_whole_segments(pool));
        }
        Ok(out)
    }

    /// Takes the whole free segments of released private pool `pool` out of the books (a
    /// graph pool whose last holder went: its memory goes back now, not at the next
    /// `empty_cache`); the caller frees each with [`free_detached`], then hands them to
    /// [`DeviceCore::finish_segment_frees`]. A pool that is not
    /// released keeps its segments (an empty list).
    pub fn detach_pool_segments(
        &mut self,
        pool: MemPoolId,
    ) -> Result<Vec<DetachedSegment>, AllocError> {
        if self.shut_down {
            return Err(AllocError::Shutdown);
        }
        let Some(p) = self.private.get(pool.0) else {
            return Err(AllocError::UnknownPool(pool.0));
        };
        if !p.released {
            return Ok(Vec::new());
        }
        let (small, large) = (p.small, p.large);
        let mut out = self.detach_whole_segments(small);
        out.extend(self.detach_whole_segments(large));
        self.forget_released_private_pools();
        Ok(out)
    }

    /// Takes every free block of block pool `pool` that is a whole ordinary segment out of
    /// the books (in the pool's order, as PyTorch's `release_blocks` frees them).
    pub(crate) fn detach_whole_segments(&mut self, pool: usize) -> Vec<DetachedSegment> {
        let whole: Vec<BlockId> = self.pools[pool]
            .free_ids()
            .filter(|&id| {
                let b = self.blocks.get(id);
                !b.is_split() && !b.expandable()
            })
            .collect();
        whole.into_iter().map(|id| self.detach_block(id)).collect()
    }

    /// The driver frees of `segments` (detached by this core, freed with [`free_detached`])
    /// returned, or failed: the memory no longer counts against
    /// `per_process_memory_fraction` and its pool's quota (a segment whose free failed stays
    /// out of the books, as before). Every batch a `detach_*` call returned must come back here once, or the cap
    /// stays lowered by it until the core shuts down.
    pub fn finish_segment_frees(&mut self, segments: &[DetachedSegment]) {
        let mut forget = false;
        for s in segments {
            if let Some(pool) = s.pool {
                self.budget.released(s.size);
                self.claim_for_pool(pool, s.size, false);
                // A released private pool is forgotten once nothing of it is left, frees in
                // flight included (`forget_released_private_pools` checks which).
                forget |= self.owner_of(pool).is_some();
            }
        }
        if forget {
            self.forget_released_private_pools();
        }
    }

    /// Bytes out of the books whose driver release has not returned yet: segments being
    /// freed and pages being unmapped off the core. They count against
    /// `per_process_memory_fraction` until it has.
    pub fn releasing_bytes(&self) -> u64 {
        self.budget.releasing()
    }

    /// `release_block` without the driver call: the segment leaves the books, and counts
    /// against the cap and its pool's quota until [`DeviceCore::finish_segment_frees`].
    pub(crate) fn detach_block(&mut self, id: BlockId) -> DetachedSegment {
        let b = self.blocks.get(id);
        let (addr, size, stream, pool) = (b.addr(), b.size(), b.stream(), b.pool());
        self.record_in(TraceAction::SegmentFree, addr, size, stream.raw, Some(pool));
        tracing::debug!(device = self.device.0, addr, size, "segment_free");
        self.pools[pool].unfile_free(self.blocks.get(id));
        self.blocks.remove(id);
        self.segments.remove(addr);
        self.budget.unreserve(size);
        self.budget.releasing_begins(size);
        self.claim_for_pool(pool, size, true);
        let small = self.pools[pool].is_small;
        self.book_segment_stats(pool, small, size, false);
        self.count(Counted::DeviceFree);
        DetachedSegment {
            ptr: DevicePtr(addr),
            size,
            pool: Some(pool),
        }
    }
}

/// Frees detached segments with the backend (a slow call: it synchronizes the device).
/// Tries them all; returns the first error.
pub fn free_detached(
    backend: &dyn Backend,
    device: DeviceId,
    segments: &[DetachedSegment],
) -> Result<(), AllocError> {
    let mut first = None;
    for s in segments {
        let _span = tracing::debug_span!("device_free", device = device.0, size = s.size).entered();
        if let Err(e) = backend.free(device, s.ptr) {
            first.get_or_insert(AllocError::Backend(e));
        } else {
            tracing::debug!(
                device = device.0,
                addr = s.ptr.0,
                size = s.size,
                "segment_free"
            );
        }
    }
    first.map_or(Ok(()), Err)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use gpualloc_accounting::AccountingBackend;
    use gpualloc_runtime::Backend;

    use super::*;
    use crate::config::AllocatorConfig;

    #[test]
    fn detached_segments_leave_the_books_and_go_back_to_the_backend() {
        let acc = Arc::new(AccountingBackend::manual_events(1, 1 << 30));
        let backend: Arc<dyn Backend> = acc.clone();
        let dev = DeviceId(0);
        let mut core = DeviceCore::new(backend.clone(), dev, AllocatorConfig::default()).unwrap();
        let s = backend.stream_create(dev).unwrap();
        let other = backend.stream_create(dev).unwrap();
        let a = core.malloc(12 << 20, s).unwrap();
        let b = core.malloc(100, s).unwrap();
        let c = core.malloc(16 << 20, s).unwrap();
        core.record_stream(c.ptr, other).unwrap();
        core.free(a.ptr).unwrap();
        core.free(c.ptr).unwrap();
        assert_eq!(core.pending_events().len(), 1);
        let segs = core.detach_free_segments().unwrap();
        assert_eq!(
            segs,
            vec![DetachedSegment {
                ptr: a.ptr,
                size: 12 << 20,
                pool: Some(crate::core::LARGE_POOL),
            }]
        );
        assert_eq!(core.reserved_bytes(), (16 << 20) + (2 << 20));
        core.check_invariants().unwrap();
        assert_eq!(core.releasing_bytes(), 12 << 20);
        free_detached(backend.as_ref(), dev, &segs).unwrap();
        core.finish_segment_frees(&segs);
        assert_eq!(core.releasing_bytes(), 0);
        assert_eq!(acc.used(dev), (16 << 20) + (2 << 20));
        for e in core.pending_events() {
            backend.event_synchronize(e).unwrap();
        }
        core.free(b.ptr).unwrap();
        let segs = core.detach_free_segments().unwrap();
        assert_eq!(segs.len(), 2);
        assert_eq!(core.releasing_bytes(), (16 << 20) + (2 << 20));
        free_detached(backend.as_ref(), dev, &segs).unwrap();
        core.finish_segment_frees(&segs);
        assert_eq!((core.reserved_bytes(), acc.used(dev)), (0, 0));
        assert_eq!(core.releasing_bytes(), 0);
        assert_eq!(core.stats().reserved_bytes[0].current, 0);
        core.check_invariants().unwrap();
        assert!(!core.is_shut_down());
        core.shutdown().unwrap();
        assert!(core.is_shut_down());
        assert_eq!(core.detach_free_segments(), Err(AllocError::Shutdown));
    }
}
