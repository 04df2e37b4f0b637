//! A miss waiting for a segment: [`SegmentRequest`], what a cache lookup that found nothing
//! returns. Its owner runs it through the miss chain (`miss/`: in place, off the core, or as a
//! recorded history shows it); the chain adopts a new segment here (`adopt_segment`).

use gpualloc_runtime::DevicePtr;

use crate::blocks::block::Block;
use crate::blocks::segment_table::SegmentMeta;
use crate::core::{AllocParams, DeviceCore};
use crate::ledger::books::Counted;
use crate::ledger::trace::TraceAction;

/// A miss waiting for a segment (see [`DeviceCore::try_cached`]).
pub struct SegmentRequest {
    pub(crate) params: AllocParams,
    pub(crate) size: u64,
}

impl SegmentRequest {
    /// Marks the request as one its owner retries: an out-of-memory error it ends in is
    /// returned but not counted (`num_ooms`), recorded (`oom` history entry) or logged; the
    /// owner calls [`DeviceCore::count_oom`] for the failure its user sees. The chain's own
    /// retries keep the mark.
    pub fn quiet_oom(&mut self) {
        self.params.quiet_oom = true;
    }

    /// Bytes of the segment to allocate.
    pub fn alloc_size(&self) -> u64 {
        self.params.alloc_size
    }

    /// Bytes the user asked for.
    pub fn requested(&self) -> u64 {
        self.size
    }

    /// True when the request is served by mapping pages of an expandable segment (the
    /// default pools and named pools with `expandable_segments`); false when it needs a whole
    /// segment from the device's malloc (ordinary segments, and PyTorch's unnamed private
    /// pools, which never expand).
    pub fn maps_pages(&self, core: &DeviceCore) -> bool {
        core.pool_expands(self.params.pool)
    }
}

impl DeviceCore {
    /// Takes a freshly allocated segment of `params.alloc_size` bytes into the books.
    pub(crate) fn adopt_segment(&mut self, params: &mut AllocParams, ptr: DevicePtr) {
        let size = params.alloc_size;
        let id = self.blocks.insert(Block::whole_segment(
            ptr.0,
            size,
            params.stream,
            params.pool,
        ));
        self.book_segment(
            ptr.0,
            SegmentMeta {
                size,
                pool: params.pool,
                stream: params.stream,
            },
        );
        self.count(Counted::DeviceAlloc);
        self.record_in(
            TraceAction::SegmentAlloc,
            ptr.0,
            size,
            params.stream.raw,
            Some(params.pool),
        );
        tracing::debug!(device = self.device.0, addr = ptr.0, size, "segment_alloc");
        params.block = Some(id);
    }
}
