//! A miss waiting for a segment: [`SegmentRequest`], what an owner that allocates off the
//! core does with it (claims it against the memory-fraction cap, allocates the segment, hands
//! it back), and how the core finishes it (`malloc_with_segment`, or the miss chain: `miss/`).

use gpualloc_runtime::DevicePtr;

use crate::block::Block;
use crate::core::{AllocParams, Allocation, DeviceCore, SegmentMeta};
use crate::error::AllocError;
use crate::trace::TraceAction;

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

    /// True when a segment of this size fits under `per_process_memory_fraction` right now,
    /// counting memory being obtained off the core (`budget.rs`).
    pub fn fits_fraction(&self, core: &DeviceCore) -> bool {
        core.budget.fits(self.params.alloc_size)
            && core.quota_error(&self.params, self.size).is_none()
    }

    /// True when the request is served by mapping pages of an expandable segment (the
    /// default pools and named pools with `expandable_segments`); false when it needs a whole
    /// segment from the device's malloc (ordinary segments, and PyTorch's unnamed private
    /// pools, which never expand).
    pub fn maps_pages(&self, core: &DeviceCore) -> bool {
        core.pool_expands(self.params.pool)
    }

    /// [`SegmentRequest::fits_fraction`], and if it fits, counts the segment as being
    /// allocated off the core until [`DeviceCore::malloc_with_segment`] adopts it or
    /// [`DeviceCore::segment_not_obtained`] says it failed: every check (this one, the core's
    /// own chain, expandable growth) counts it against `per_process_memory_fraction`, so
    /// concurrent misses off the core cannot overshoot the cap together.
    pub fn claim_fraction(&self, core: &mut DeviceCore) -> bool {
        let fits = self.fits_fraction(core);
        if fits {
            core.budget.claim(self.params.alloc_size);
            core.claim_for_pool(self.params.pool, self.params.alloc_size, true);
        }
        fits
    }
}

impl DeviceCore {
    /// Finishes a miss with a segment the caller allocated from the backend itself (`ptr`,
    /// `request.alloc_size()` bytes), claimed beforehand with
    /// [`SegmentRequest::claim_fraction`] (the claim ends here). The segment is adopted even
    /// if the cache could serve the request by now, so nothing leaks.
    pub fn malloc_with_segment(
        &mut self,
        request: SegmentRequest,
        ptr: DevicePtr,
    ) -> Result<Allocation, AllocError> {
        let SegmentRequest { mut params, size } = request;
        self.budget.unclaim(params.alloc_size);
        self.claim_for_pool(params.pool, params.alloc_size, false);
        self.adopt_segment(&mut params, ptr);
        self.finish(&params, size)
    }

    /// A segment claimed with [`SegmentRequest::claim_fraction`] was not obtained (the device
    /// malloc failed, or the core shut down and it went back): it no longer counts.
    pub fn segment_not_obtained(&mut self, request: &SegmentRequest) {
        self.budget.unclaim(request.params.alloc_size);
        self.claim_for_pool(request.params.pool, request.params.alloc_size, false);
    }

    /// For a miss an owner handles off the core: `take` looks for a block for the request in
    /// the cache (into its params); `Err` gives the request back when it finds none.
    pub(crate) fn serve_from_cache(
        &mut self,
        mut request: SegmentRequest,
        take: impl FnOnce(&mut Self, &mut AllocParams) -> bool,
    ) -> Result<Allocation, SegmentRequest> {
        if !take(self, &mut request.params) {
            return Err(request);
        }
        let size = request.size;
        self.finish(&request.params, size).map_err(|_| request)
    }

    /// Takes a freshly allocated segment of `params.alloc_size` bytes into the books.
    pub(crate) fn adopt_segment(&mut self, params: &mut AllocParams, ptr: DevicePtr) {
        let size = params.alloc_size;
        let id = self
            .blocks
            .insert(Block::segment(ptr.0, size, params.stream, params.pool));
        self.book_segment(
            ptr.0,
            SegmentMeta {
                size,
                pool: params.pool,
                stream: params.stream,
            },
        );
        self.stats.num_device_alloc += 1;
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
