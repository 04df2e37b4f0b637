//! The links of the miss chain that need driver calls, each split where the call goes: the
//! part before it returns the call ([`Flow::Wait`]), the part after it takes the outcome
//! (`resume_op`).

use gpualloc_runtime::{BackendError, DevicePtr};

use crate::blocks::block::BlockId;
use crate::core::{AllocParams, DeviceCore};
use crate::error::AllocError;
use crate::expandable::shrink::PageRelease;
use crate::free::detached::DetachedSegment;
use crate::ledger::books::Counted;

use super::{IoDone, Leftover, MissIo, Outcome};

/// What a link (or a resumed operation) comes to.
pub(crate) enum Flow {
    /// The request's block is in its params.
    Found,
    /// Nothing found: the next link.
    Next,
    /// The miss fails.
    Fail(AllocError),
    /// Wait for a driver call.
    Wait(Op, MissIo),
}

/// An operation waiting for a driver call.
pub(crate) enum Op {
    /// A new segment is being allocated.
    Segment,
    /// Pages are being mapped for the growth of an expandable segment; the request's block
    /// starts at the mapped block once they are in.
    Growth,
    /// Segments are being freed; then the next link.
    Free,
    /// A release of cached memory, between its driver calls.
    Release(Release),
    /// A leftover is being given back after a shutdown; then the miss fails.
    GiveBack,
    /// A segment from a mixed-up outcome is being freed; then the miss fails.
    Mismatch,
}

/// A release of cached memory over several block pools: for each pool, free its whole cached
/// segments, then unmap the whole pages of its free blocks of expandable segments (PyTorch's
/// `release_blocks`); `ReleaseCached` synchronizes pending events first and forgets released
/// private pools left empty after. [`Release::pages`] unmaps free pages only.
pub(crate) struct Release {
    pools: Vec<usize>,
    next: usize,
    phase: Phase,
    /// The cache's full release (`release_cached_blocks`), not a pool's own.
    cached: bool,
    /// Whole cached segments are freed too (all but [`Release::pages`]).
    segments: bool,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Phase {
    Synchronize,
    Segments,
    Pages,
}

impl Release {
    pub(crate) fn own(pools: Vec<usize>) -> Self {
        Release {
            pools,
            next: 0,
            phase: Phase::Segments,
            cached: false,
            segments: true,
        }
    }

    /// The whole pages of the free blocks of expandable segments of each of `pools`, and
    /// nothing else: no segment is freed (a segment free synchronizes the device on CUDA), no
    /// event waited for. The free block a growth would extend gives up its pages too:
    /// measured, keeping them left qwen2-7b-layerwise-calib at 6.20% fragmentation instead of
    /// 1.71% (the growth then places differently).
    pub(crate) fn pages(pools: Vec<usize>) -> Self {
        Release {
            pools,
            next: 0,
            phase: Phase::Pages,
            cached: false,
            segments: false,
        }
    }

    pub(crate) fn cached(pools: Vec<usize>) -> Self {
        Release {
            pools,
            next: 0,
            phase: Phase::Synchronize,
            cached: true,
            segments: true,
        }
    }
}

impl DeviceCore {
    /// PyTorch's `alloc_block`: a segment of `params.alloc_size`, or pages of an expandable
    /// segment; `Next` when the memory fraction has no room.
    pub(super) fn alloc_block_step(&mut self, params: &mut AllocParams, off_core: bool) -> Flow {
        let size = params.alloc_size;
        let expandable = self.pool_expands(params.pool);
        // Memory being obtained off the core counts against the cap too. Growth in 2 MiB
        // pages checks the bytes it maps instead (`plan_pages`).
        let by_pages = expandable && self.config.policy.fine_large_pages();
        if !by_pages && !self.budget.fits(size) {
            return Flow::Next;
        }
        if expandable && off_core {
            // The first unmapped stretch of the run the request goes in; after its pages are
            // in, the request looks in the cache again (`resume_op`).
            return match self.plan_growth_for(params) {
                Ok(Some(plan)) => Flow::Wait(Op::Growth, MissIo::MapPages(plan)),
                Ok(None) => Flow::Next,
                Err(e) => Flow::Fail(e),
            };
        }
        if expandable {
            return match self.find_expandable_block(params.stream, params.pool, params.size) {
                Ok(c) => self.growth_step(params, c),
                Err(e) => Flow::Fail(e),
            };
        }
        tracing::debug!(device = self.device.0, size, "device_malloc");
        // Counted against the memory fraction and the pool's quota until it lands, so misses
        // in flight together cannot pass them (`Budget::claim`, the pool's `claimed`).
        self.budget.claim(size);
        self.claim_for_pool(params.pool, size, true);
        Flow::Wait(
            Op::Segment,
            MissIo::AllocSegment {
                device: self.device,
                size,
            },
        )
    }

    /// Grows the run of free and unmapped blocks from `c` until it holds the request (PyTorch's
    /// `try_allocate_expandable_block`): maps the first unmapped block of the run, then the
    /// next, one driver call each; when the run is mapped and large enough, takes it out of
    /// the pool as the request's block.
    fn growth_step(&mut self, params: &mut AllocParams, c: BlockId) -> Flow {
        let size = params.size;
        let b = self.blocks.get(c);
        let (to_map, need) = if !b.mapped() {
            (c, b.size().min(size))
        } else if b.size() < size {
            let Some(next) = b.next() else {
                return Flow::Fail(AllocError::InvalidSize {
                    size,
                    reason: "expandable segment exhausted (internal)",
                });
            };
            (next, (size - b.size()).min(self.blocks.get(next).size()))
        } else {
            self.pools[params.pool].unfile_free(b);
            params.block = Some(c);
            return Flow::Found;
        };
        let avail = self.blocks.get(to_map).size();
        // The memory fraction counts the pages to map where growth is in 2 MiB pages (the
        // check in `alloc_block_step` counted PyTorch's segment size, which such a growth is
        // not).
        let check_fraction = self.config.policy.fine_large_pages();
        match self.plan_pages(to_map, need, avail, check_fraction, !params.exact_growth) {
            Some(plan) => Flow::Wait(Op::Growth, MissIo::MapPages(plan)),
            None => Flow::Next,
        }
    }

    /// Frees `segments` (already out of the books) through the caller, then `then`.
    pub(super) fn free_segments(&mut self, segments: Vec<DetachedSegment>, then: Op) -> Flow {
        if segments.is_empty() {
            return self.after_op(then);
        }
        Flow::Wait(
            then,
            MissIo::FreeSegments {
                device: self.device,
                segments,
            },
        )
    }

    /// Where an operation goes once its driver call is done and it has nothing left to call.
    fn after_op(&mut self, op: Op) -> Flow {
        match op {
            Op::Release(r) => self.release_step(r),
            Op::GiveBack => Flow::Fail(AllocError::Shutdown),
            Op::Mismatch => Flow::Fail(mismatch()),
            Op::Free | Op::Segment | Op::Growth => Flow::Next,
        }
    }

    /// The next driver call of a release, or `Next` when it is over.
    pub(super) fn release_step(&mut self, mut r: Release) -> Flow {
        loop {
            match r.phase {
                Phase::Synchronize => {
                    self.count(Counted::SyncAllStreams);
                    r.phase = Phase::Segments;
                    let events = self.pending_events();
                    if !events.is_empty() {
                        return Flow::Wait(Op::Release(r), MissIo::SynchronizeEvents(events));
                    }
                }
                Phase::Segments => {
                    let Some(&pool) = r.pools.get(r.next) else {
                        if r.cached {
                            self.forget_released_private_pools();
                        }
                        return Flow::Next;
                    };
                    r.phase = Phase::Pages;
                    let segments = self.detach_whole_segments(pool);
                    if !segments.is_empty() {
                        return self.free_segments(segments, Op::Release(r));
                    }
                }
                Phase::Pages => {
                    // Past the last pool only without segments: the segments' phase ends the
                    // others.
                    let Some(&pool) = r.pools.get(r.next) else {
                        return Flow::Next;
                    };
                    r.next += 1;
                    if r.segments {
                        r.phase = Phase::Segments;
                    }
                    let releases = self.detach_pages_of(pool);
                    if !releases.is_empty() {
                        return Flow::Wait(Op::Release(r), MissIo::UnmapPages(releases));
                    }
                }
            }
        }
    }

    /// Takes in the outcome of `op`'s driver call.
    pub(super) fn resume_op(&mut self, miss: &mut super::Miss, op: Op, done: IoDone) -> Flow {
        let params = &mut miss.request.params;
        match (op, done.0) {
            (Op::Segment, Outcome::Segment(size, result)) => {
                self.budget.unclaim(size);
                self.claim_for_pool(params.pool, size, false);
                self.segment_landed(params, size, result)
            }
            (Op::Growth, Outcome::Mapped(plan, result)) => match result {
                Ok(mapped) => {
                    let block = plan.block();
                    match self.commit_growth(plan, mapped) {
                        Ok(()) if miss.off_core => self.after_growth_off_core(miss),
                        Ok(()) => self.growth_step(params, block),
                        Err(refused) => {
                            Flow::Wait(Op::GiveBack, MissIo::GiveBack(Leftover::Pages(refused)))
                        }
                    }
                }
                Err(e) => {
                    if let Some((ptr, size)) = self.abort_growth(plan) {
                        return self.give_back_reservation(ptr, size);
                    }
                    if e.is_oom() {
                        Flow::Next
                    } else {
                        Flow::Fail(AllocError::Backend(e))
                    }
                }
            },

            (
                op @ (Op::Free | Op::Release(_) | Op::Mismatch | Op::GiveBack),
                Outcome::Freed(segments, result),
            ) => {
                // Segments the chain took out of the books count against the cap and their
                // pool's quota until their frees return (`budget.rs`).
                self.finish_segment_frees(&segments);
                match result {
                    Ok(()) => self.after_op(op),
                    Err(e) => Flow::Fail(e),
                }
            }
            (Op::Release(r), Outcome::Synced(n, error)) => {
                if miss.off_core {
                    // Others ran meanwhile: their lookups may have completed some of these
                    // frees and recycled the events, so the pending list is not the one
                    // synchronized. Queries complete exactly the frees whose events are done.
                    if let Err(e) = self.process_events() {
                        return Flow::Fail(e);
                    }
                } else {
                    self.complete_synchronized(n);
                }
                match error {
                    Some(e) => Flow::Fail(AllocError::Backend(e)),
                    None => self.release_step(r),
                }
            }
            (Op::Release(r), Outcome::Unmapped(releases, error)) => {
                if let Some(flow) = self.finish_releases(releases) {
                    return flow;
                }
                match error {
                    Some(e) => Flow::Fail(AllocError::Backend(e)),
                    None => self.release_step(r),
                }
            }
            (Op::GiveBack, Outcome::GaveBack) => Flow::Fail(AllocError::Shutdown),
            (_, outcome) => self.salvage(outcome),
        }
    }

    /// An outcome of a call the miss did not ask for (a caller's mix-up): whatever it holds
    /// goes back to the books or the device, then the miss fails with an internal error.
    pub(super) fn salvage(&mut self, outcome: Outcome) -> Flow {
        let flow = match outcome {
            Outcome::Segment(size, Ok(ptr)) => Some(Flow::Wait(
                Op::Mismatch,
                MissIo::FreeSegments {
                    device: self.device,
                    segments: vec![DetachedSegment::unbooked(ptr, size)],
                },
            )),
            Outcome::Mapped(plan, Ok(mapped)) => match self.commit_growth(plan, mapped) {
                Ok(()) => None,
                Err(refused) => Some(Flow::Wait(
                    Op::GiveBack,
                    MissIo::GiveBack(Leftover::Pages(refused)),
                )),
            },
            Outcome::Mapped(plan, Err(_)) => self
                .abort_growth(plan)
                .map(|(ptr, size)| self.give_back_reservation(ptr, size)),
            Outcome::Unmapped(releases, _) => self.finish_releases(releases),
            // Frees made: what left the books is the device's no more.
            Outcome::Freed(segments, _) => {
                self.finish_segment_frees(&segments);
                None
            }
            Outcome::Segment(_, Err(_)) | Outcome::Synced(..) | Outcome::GaveBack => None,
        };
        flow.unwrap_or(Flow::Fail(mismatch()))
    }

    /// A segment malloc's outcome: the request's block, or the next link.
    fn segment_landed(
        &mut self,
        params: &mut AllocParams,
        size: u64,
        result: Result<DevicePtr, BackendError>,
    ) -> Flow {
        match result {
            // The core shut down while the segment was being allocated: it goes back.
            Ok(ptr) if self.shut_down => Flow::Wait(
                Op::GiveBack,
                MissIo::FreeSegments {
                    device: self.device,
                    segments: vec![DetachedSegment::unbooked(ptr, size)],
                },
            ),
            Ok(ptr) => {
                self.adopt_segment(params, ptr);
                Flow::Found
            }
            Err(e) if e.is_oom() => Flow::Next,
            Err(e) => Flow::Fail(AllocError::Backend(e)),
        }
    }

    /// An off-core miss whose pages are in: they joined the cache as a free block, and the
    /// request takes its best fit there (another request may have taken them first: then it
    /// grows again, a few times, before the chain goes on).
    fn after_growth_off_core(&mut self, miss: &mut super::Miss) -> Flow {
        match self.look_again(&mut miss.request.params) {
            Ok(true) => Flow::Found,
            Ok(false) if miss.regrowths < super::REGROWTHS => {
                miss.regrowths += 1;
                self.alloc_block_step(&mut miss.request.params, true)
            }
            Ok(false) => Flow::Next,
            Err(e) => Flow::Fail(e),
        }
    }

    /// An off-core miss looks in the cache again: frees completed meanwhile, best fit.
    pub(super) fn look_again(&mut self, params: &mut AllocParams) -> Result<bool, AllocError> {
        self.process_events()?;
        Ok(self.get_free_block(params))
    }

    /// Books pages unmapped by the caller; a reservation a shutdown left to them goes back.
    fn finish_releases(&mut self, releases: Vec<PageRelease>) -> Option<Flow> {
        let mut orphaned = None;
        for r in releases {
            match self.finish_page_release(r) {
                Ok(Some(reservation)) => orphaned = Some(reservation),
                Ok(None) => {}
                Err(e) => return Some(Flow::Fail(e)),
            }
        }
        orphaned.map(|(ptr, size)| self.give_back_reservation(ptr, size))
    }

    fn give_back_reservation(&mut self, ptr: DevicePtr, size: u64) -> Flow {
        Flow::Wait(
            Op::GiveBack,
            MissIo::GiveBack(Leftover::Reservation(self.device, ptr, size)),
        )
    }
}

pub(super) fn mismatch() -> AllocError {
    AllocError::InvalidSize {
        size: 0,
        reason: "a miss advanced with an outcome it did not ask for (internal)",
    }
}
