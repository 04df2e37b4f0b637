//! Growing an expandable segment in three steps, for an owner that must not make the slow
//! driver calls (create physical memory, map it, set access) while it holds the core (the
//! device actor: cache hits keep flowing meanwhile):
//!
//! 1. [`DeviceCore::plan_growth`], under the core: finds where the request goes
//!    (`find_expandable_block`, as the in-place chain does) and takes the unmapped pages it
//!    needs out of the books as a block in state `Mapping`: no other request, release or
//!    garbage collection touches it, and the segment is not released while it exists.
//! 2. [`map_growth`], off the core: `map_pages` on the planned range (rolled back on
//!    failure).
//! 3. [`DeviceCore::commit_growth`] under the core: installs the pages and books them as a
//!    free mapped block (as every growth does); the owner then retries the cached path, which
//!    finds them. Or [`DeviceCore::abort_growth`] after a failed map: the pages go back to
//!    the unmapped set as they were.
//!
//! A core shut down between plan and commit keeps the reservation of a segment with growth in
//! flight (`release_all_expandable`); the commit then refuses, and the owner unmaps, releases
//! and frees the reservation with [`Refused::release`]. When no growth is planned (over the
//! memory-fraction cap) or it fails for lack of memory, the miss chain (`miss/`) goes on to
//! its next link; PyTorch's unnamed private pools never expand (they take whole segments, see
//! [`SegmentRequest::maps_pages`]). The chain's `MapPages` step is these three steps, with
//! the driver call made by its caller; `plan_growth` is the first on its own, public so the
//! planner's rules (pages ahead, the cap, a pool's quota) are tested without a chain.

use gpualloc_runtime::{Backend, BackendError, DeviceId, DevicePtr};

use crate::blocks::block::{BlockId, BlockState};
use crate::core::{AllocParams, DeviceCore};
use crate::error::AllocError;
use crate::expandable::segment::{map_pages, unmap_pages, Handles, MappedPages};
use crate::malloc::segment_request::SegmentRequest;

/// Pages of one expandable segment to map off the core. See the module docs.
#[derive(Debug)]
#[must_use = "a planned growth must be committed or aborted"]
pub struct GrowthPlan {
    block: BlockId,
    seg: u64,
    addr: u64,
    len: u64,
    /// The part of `len` the request needs (the rest is mapped ahead, `map_ahead.rs`).
    want: u64,
    page: u64,
    /// How the pages are grouped into physical handles.
    handles: Handles,
    device: DeviceId,
    /// Devices given access too (`DeviceCore::add_peer`).
    peers: Vec<DeviceId>,
}

impl GrowthPlan {
    /// Bytes to map.
    pub fn bytes(&self) -> u64 {
        self.len
    }

    /// The block the pages become once committed.
    pub(crate) fn block(&self) -> BlockId {
        self.block
    }

    /// The plan with only its first `grouped` pages grouped into shared handles, the
    /// `singles` pages after them a handle each and the rest shared again (a recorded map's
    /// layout).
    pub(crate) fn grouping_first(mut self, grouped: usize, singles: usize) -> GrowthPlan {
        self.handles.grouped = grouped;
        self.handles.singles = singles;
        self
    }
}

/// What a miss with expandable segments needs.
#[derive(Debug)]
pub enum Growth {
    /// Map these pages off the core, then commit.
    Map(GrowthPlan),
    /// Nothing to map off the core: continue with the in-place chain.
    InPlace,
}

/// A commit the core refused (it shut down meanwhile): what the owner must give back, with
/// [`Refused::release`].
#[derive(Debug)]
#[must_use = "a refused growth holds mapped pages: release them"]
pub struct Refused {
    device: DeviceId,
    mapped: MappedPages,
    /// The segment's reservation, when this was its last growth in flight.
    reservation: Option<(DevicePtr, u64)>,
}

impl Refused {
    /// Unmaps and releases the pages, then frees the segment's reservation if this was its
    /// last growth in flight. Off the core: these are driver calls.
    pub fn release(self, backend: &dyn Backend) {
        unmap_pages(backend, &self.mapped);
        if let Some(r) = self.reservation {
            release_reservation(backend, self.device, r);
        }
    }
}

impl DeviceCore {
    /// Step 1: plans the mapping a miss needs (see the module docs).
    pub fn plan_growth(&mut self, req: &SegmentRequest) -> Result<Growth, AllocError> {
        if self.shut_down {
            return Err(AllocError::Shutdown);
        }
        Ok(match self.plan_growth_for(&req.params)? {
            Some(plan) => Growth::Map(plan),
            None => Growth::InPlace,
        })
    }

    /// [`DeviceCore::plan_growth`] for the request `params` describes: `None` when nothing is
    /// to be mapped.
    pub(crate) fn plan_growth_for(
        &mut self,
        params: &AllocParams,
    ) -> Result<Option<GrowthPlan>, AllocError> {
        if !self.pool_expands(params.pool) {
            return Ok(None);
        }
        let size = params.size;
        let mut at = Some(self.find_expandable_block(params.stream, params.pool, size)?);
        let mut bytes = 0u64;
        while let Some(id) = at {
            let b = self.blocks.get(id);
            if b.state() != BlockState::Free {
                break;
            }
            if !b.mapped() {
                let (need, avail) = ((size - bytes).min(b.size()), b.size());
                return Ok(self.plan_pages(id, need, avail, true, !params.exact_growth));
            }
            bytes += b.size();
            if bytes >= size {
                break;
            }
            at = b.next();
        }
        Ok(None)
    }

    /// Plans mapping the front `need` bytes (at least; pages ahead as `map_ahead.rs` says) of
    /// free unmapped block `id`, of `avail` bytes; `None` when the pages would pass a named
    /// pool's quota or, with `check_fraction`, `per_process_memory_fraction`. Without `ahead`,
    /// no pages ahead.
    pub(crate) fn plan_pages(
        &mut self,
        id: BlockId,
        need: u64,
        avail: u64,
        check_fraction: bool,
        ahead: bool,
    ) -> Option<GrowthPlan> {
        let (seg, pool, addr) = {
            let b = self.blocks.get(id);
            (b.segment(), b.pool(), b.addr())
        };
        let page = self.segment_page_size(pool);
        let (want, len) = self.growth_len(seg, pool, addr, need, avail, ahead);
        if check_fraction && !self.budget.fits(want) {
            return None;
        }
        if self.pool_room(pool).is_some_and(|room| want > room) {
            return None;
        }
        self.split_unmapped_front(id, len);
        self.blocks.get_mut(id).begin_mapping();
        self.budget.claim(len);
        self.claim_for_pool(pool, len, true);
        self.expandable.begin_work(seg);
        Some(GrowthPlan {
            block: id,
            seg,
            addr,
            len,
            want,
            page,
            handles: self.handles_for(pool, need),
            device: self.device,
            peers: self.expandable.peers().to_vec(),
        })
    }

    /// The planned block, if the core still has it as planned.
    fn planned(&self, plan: &GrowthPlan) -> bool {
        !self.shut_down
            && self.expandable.contains(plan.seg)
            && self.blocks.contains(plan.block)
            && {
                let b = self.blocks.get(plan.block);
                b.state() == BlockState::Mapping && b.addr() == plan.addr && b.size() == plan.len
            }
    }

    /// Ends a growth in flight; the segment's reservation to free if it was orphaned by a
    /// shutdown and this was its last off-core operation.
    fn end_growth(&mut self, plan: &GrowthPlan) -> Option<(DevicePtr, u64)> {
        self.budget.unclaim(plan.len);
        if let Some(pool) = self.segments.pool_of(plan.seg) {
            self.claim_for_pool(pool, plan.len, false);
        }
        self.expandable.end_work(plan.seg)
    }

    /// Step 3: books the pages [`map_growth`] mapped as a free block of the segment (when it
    /// mapped only what the request needs, the pages planned ahead go back to the unmapped
    /// set). Refused when the core shut down meanwhile, or `mapped` is not what `plan` asked
    /// for: give the result to [`Refused::release`].
    pub fn commit_growth(&mut self, plan: GrowthPlan, mapped: MappedPages) -> Result<(), Refused> {
        let planned = self.planned(&plan)
            && mapped.start == plan.addr
            && mapped.page == plan.page
            && (mapped.bytes() == plan.len || mapped.bytes() == plan.want);
        let reservation = self.end_growth(&plan);
        if !planned {
            return Err(Refused {
                device: plan.device,
                mapped,
                reservation,
            });
        }
        if mapped.bytes() < plan.len {
            // Mapped without the pages ahead: those stay unmapped.
            self.unplan_back(plan.block, mapped.bytes());
        }
        let len = mapped.bytes();
        if let Some(es) = self.expandable.get_mut(plan.seg) {
            let first = es.page_left(plan.addr);
            es.install(first, &mapped);
        }
        // A peer added while these pages were being mapped off the core gets access now.
        for peer in self
            .expandable
            .peers()
            .iter()
            .filter(|p| !plan.peers.contains(p))
        {
            if let Err(e) = self.backend.set_access(*peer, DevicePtr(plan.addr), len) {
                tracing::warn!(peer = peer.0, addr = plan.addr, error = %e, "peer access to new pages failed");
            }
        }
        self.book_mapped(plan.block);
        let pages = (len / plan.page) as usize;
        if plan.handles.grouped < pages {
            self.mark_grouped_pages(
                plan.addr,
                plan.handles.grouped as u64,
                plan.handles.singles as u64,
            );
        }
        Ok(())
    }

    /// Cuts planned block `id` to its front `len` bytes; the rest becomes a free unmapped
    /// block again, filed with its unmapped neighbours.
    fn unplan_back(&mut self, id: BlockId, len: u64) {
        let rest = self.blocks.split_back(id, len);
        self.file_unmapped(rest);
    }

    /// Step 3 after a failed [`map_growth`] (which released what it had made): the pages go
    /// back to the unmapped set. Returns a reservation to free with [`release_reservation`]
    /// when a shutdown orphaned it meanwhile.
    pub fn abort_growth(&mut self, plan: GrowthPlan) -> Option<(DevicePtr, u64)> {
        let planned = self.planned(&plan);
        let reservation = self.end_growth(&plan);
        if planned {
            self.blocks.get_mut(plan.block).end_page_work();
            self.file_unmapped(plan.block);
        }
        reservation
    }

    /// Bytes being obtained off the core right now: pages planned for mapping, and segments
    /// whose malloc a miss asked for and is in flight. They count against
    /// `per_process_memory_fraction`.
    pub fn growing_bytes(&self) -> u64 {
        self.budget.in_flight()
    }
}

/// Step 2: the driver calls of a planned growth, off the core. When the device has no room
/// for the pages planned ahead of the request, maps only those the request needs.
pub fn map_growth(backend: &dyn Backend, plan: &GrowthPlan) -> Result<MappedPages, BackendError> {
    let map = |len: u64| {
        map_pages(
            backend,
            plan.device,
            &plan.peers,
            plan.addr,
            (len / plan.page) as usize,
            plan.page,
            plan.handles,
        )
    };
    match map(plan.len) {
        Err(e) if e.is_oom() && plan.want < plan.len => map(plan.want),
        r => r,
    }
}

/// Frees a reservation orphaned by a shutdown (see the module docs).
pub fn release_reservation(backend: &dyn Backend, device: DeviceId, (ptr, size): (DevicePtr, u64)) {
    if let Err(e) = backend.va_free(device, ptr, size) {
        tracing::warn!(device = device.0, addr = ptr.0, error = %e, "freeing an orphaned reservation failed");
    }
}
