//! Freeing an allocation (PyTorch's `free`: at once, or once the events of the other streams
//! that used it complete), `record_stream`, the export marks, and the live allocation at a
//! pointer. The block's merge and release are `release.rs`'s.

pub(crate) mod beside;
pub(crate) mod detached;
pub(crate) mod events;
pub(crate) mod pending;
pub(crate) mod release;

use gpualloc_runtime::{DevicePtr, StreamHandle};

use crate::core::{Allocation, DeviceCore, LARGE_POOL};
use crate::error::AllocError;
use crate::ledger::books::Counted;
use crate::ledger::trace::TraceAction;

impl DeviceCore {
    /// Marks live allocation `ptr` as exported to another process (the facade's
    /// `export_region` does, for every region it describes) until it is freed: a named pool
    /// holding one cannot sleep ([`AllocError::PoolExported`]), since the importer maps the
    /// pool's physical pages, which a sleep releases and a wake replaces with others.
    pub fn mark_exported(&mut self, ptr: DevicePtr) -> Result<(), AllocError> {
        if !self.active.mark_exported(ptr.0) {
            return Err(AllocError::UnknownPointer(ptr));
        }
        Ok(())
    }

    /// Undoes [`DeviceCore::mark_exported`] for live allocation `ptr` (a region described but
    /// never shared): its pool may sleep again. False when it was not marked.
    pub fn unmark_exported(&mut self, ptr: DevicePtr) -> Result<bool, AllocError> {
        self.active
            .unmark_exported(ptr.0)
            .ok_or(AllocError::UnknownPointer(ptr))
    }

    /// Frees an allocation. If other streams used it (`record_stream`), it returns to the pool
    /// only once events recorded on those streams now have completed. Freeing null is a no-op.
    pub fn free(&mut self, ptr: DevicePtr) -> Result<(), AllocError> {
        if ptr.0 == 0 {
            return Ok(());
        }
        let Some(id) = self.active.remove(ptr.0) else {
            return Err(AllocError::UnknownPointer(ptr));
        };
        let block = self.blocks.get_mut(id);
        block.begin_free();
        let (size, requested, stream, pool) = (
            block.size(),
            block.requested(),
            block.stream(),
            block.pool(),
        );
        let has_uses = !block.stream_uses().is_empty();
        let born = block.born();
        let small = self.pools[pool].is_small;
        // The default pools' blocks teach the spill (`malloc/spill.rs`); `learn` keeps small
        // sizes only (its bounds check is the size test).
        if pool <= LARGE_POOL {
            self.spill.learn(size, born);
        }
        self.book_freed(pool, small, size);
        self.record(TraceAction::FreeRequested, ptr.0, requested, stream.raw);
        if self.config.debug_cross_stream_frees
            && self
                .cross_stream
                .check_free(self.backend.as_ref(), self.blocks.get(id))
        {
            self.count(Counted::CrossStreamFree);
        }
        if has_uses {
            // A lent block (it has uses) is freed by its borrower, as it was allocated.
            self.restream_if_lent(TraceAction::FreeRequested, ptr.0);
            self.free_with_uses(id);
        } else if !self.captures.is_quiet() && self.eager_free_into_capture(id) {
            // Its stream's work is not the graph's: held back until the capture ends
            // (`DeviceCore::streams_before_capture`).
            self.captures.defer(id);
        } else {
            self.free_block(id);
        }
        Ok(())
    }

    /// Marks `ptr` as used on `stream` (PyTorch's `recordStream`): its free will wait for
    /// the work queued on `stream` at free time. Uses on the allocation stream are ignored.
    pub fn record_stream(
        &mut self,
        ptr: DevicePtr,
        stream: StreamHandle,
    ) -> Result<(), AllocError> {
        if self.shut_down {
            return Err(AllocError::Shutdown);
        }
        let Some(id) = self.active.get(ptr.0) else {
            return Err(AllocError::UnknownPointer(ptr));
        };
        if self.blocks.get_mut(id).record_use(stream) {
            self.note_capture_use(id, stream);
        }
        Ok(())
    }

    /// The allocation at `ptr`, if it is live.
    pub fn allocation(&self, ptr: DevicePtr) -> Option<Allocation> {
        self.active.get(ptr.0).map(|id| {
            let b = self.blocks.get(id);
            Allocation {
                ptr,
                size: b.requested(),
                block_size: b.size(),
                stream: self.user_stream(ptr.0, b.stream()),
                small_pool: self.pools[b.pool()].is_small,
                oversize: b.size() >= self.config.max_split_size,
                pool: self.owner_of(b.pool()),
            }
        })
    }
}
