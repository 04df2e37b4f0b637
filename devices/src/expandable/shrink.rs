//! Releasing the free pages of expandable segments in three steps, for an owner that must not
//! synchronize streams or unmap pages while it holds the core (the device actor):
//!
//! 1. [`DeviceCore::detach_free_pages`], under the core: every free mapped block of an
//!    expandable segment gives up its whole pages. They are booked as released at once
//!    (reserved memory goes down, `segment_unmap` is traced) and become a block in state
//!    `Unmapping`: out of every set, so nothing maps, merges or allocates them meanwhile.
//!    Until step 3 they still count against `per_process_memory_fraction` (`budget.rs`)
//!    and their pool's quota: the device has them until the unmap returns.
//! 2. [`release_pages`], off the core: waits for each segment's stream (unlike a segment free,
//!    an unmap does not synchronize), then unmaps and releases the pages.
//! 3. [`DeviceCore::finish_page_release`], under the core: the block joins the unmapped set
//!    (merged with its unmapped neighbours), and a reservation left with nothing mapped is
//!    freed, as the in-place release does (`release_blocks`).
//!
//! A shutdown in between leaves the reservation to the last off-core operation on it
//! (`growth.rs` shares that rule): `finish_page_release` returns it for
//! [`release_reservation`](crate::release_reservation).

use gpualloc_runtime::{Backend, BackendError, DevicePtr, StreamHandle};

use crate::blocks::block::{BlockId, BlockState};
use crate::core::DeviceCore;
use crate::error::AllocError;
use crate::expandable::segment::{unmap_pages, MappedPages};

/// Pages of one free block taken out of the books, to unmap off the core.
#[derive(Debug)]
#[must_use = "detached pages must be released and the release finished"]
pub struct PageRelease {
    block: BlockId,
    /// The block pool the pages left (they count against its quota until released).
    pool: usize,
    seg: u64,
    stream: StreamHandle,
    mapped: MappedPages,
}

impl PageRelease {
    /// Bytes of the pages.
    pub fn bytes(&self) -> u64 {
        self.mapped.bytes()
    }
}

impl DeviceCore {
    /// Step 1: takes the whole pages of every free block of an expandable segment out of the
    /// books (see the module docs). Call after pending frees were completed, as
    /// `detach_free_segments` is.
    pub fn detach_free_pages(&mut self) -> Result<Vec<PageRelease>, AllocError> {
        if self.shut_down {
            return Err(AllocError::Shutdown);
        }
        let mut out = Vec::new();
        for pool in self.release_scope() {
            out.extend(self.detach_pages_of(pool));
        }
        Ok(out)
    }

    /// Bytes of the whole pages inside `pool`'s free blocks of expandable segments: at most
    /// what [`DeviceCore::detach_pages_of`] would release (a physical handle that reaches
    /// past its block stays).
    pub(crate) fn free_whole_pages(&self, pool: usize) -> u64 {
        self.pools[pool]
            .free_ids()
            .map(|id| self.blocks.get(id))
            .filter(|b| b.expandable())
            .filter_map(|b| {
                let es = self.expandable.get(b.segment())?;
                let (first, last) = es.pages_inside(b.addr(), b.end())?;
                Some((last - first) as u64 * es.page)
            })
            .sum()
    }

    /// Step 1 for block pool `pool` alone: the whole pages of each of its free blocks of an
    /// expandable segment, in the pool's order.
    pub(crate) fn detach_pages_of(&mut self, pool: usize) -> Vec<PageRelease> {
        // The free sets hold mapped blocks only (unmapped ones have sets of their own).
        let ids: Vec<BlockId> = self.pools[pool]
            .free_ids()
            .filter(|&id| self.blocks.get(id).expandable())
            .collect();
        let mut out = Vec::new();
        for id in ids {
            let b = self.blocks.get(id);
            let (seg, addr, end) = (b.segment(), b.addr(), b.end());
            let Some(es) = self.expandable.get(seg) else {
                continue;
            };
            let Some((first, last)) = es.pages_inside(addr, end) else {
                continue;
            };
            out.extend(self.detach_runs(id, first, last));
        }
        out
    }

    /// Takes the runs of pages `[first, last)` of free mapped block `id`'s expandable segment
    /// that lie wholly inside that range (a physical handle is released whole) out of the
    /// books, as pages to release off the core; `None` when no run is inside.
    pub(crate) fn detach_runs(
        &mut self,
        id: BlockId,
        first: usize,
        last: usize,
    ) -> Option<PageRelease> {
        let b = self.blocks.get(id);
        let (seg, stream, pool) = (b.segment(), b.stream(), b.pool());
        // The release waits for this stream (`release_pages`), which a capture forbids: the
        // pages stay.
        if self.stream_captures(stream) {
            return None;
        }
        let mapped = self.expandable.get_mut(seg)?.take_runs_inside(first, last);
        if mapped.pieces.is_empty() {
            return None;
        }
        self.book_unmapped(id, mapped.start, mapped.bytes(), true);
        // The device has them until the unmap returns (`finish_page_release`): they count
        // against the cap and the pool's quota until then.
        self.budget.releasing_begins(mapped.bytes());
        self.claim_for_pool(pool, mapped.bytes(), true);
        self.expandable.begin_work(seg);
        Some(PageRelease {
            block: id,
            pool,
            seg,
            stream,
            mapped,
        })
    }

    /// Step 3: the released pages join the unmapped set; a reservation with nothing mapped
    /// left is freed. Returns a reservation a shutdown orphaned meanwhile, for
    /// [`release_reservation`](crate::release_reservation).
    pub fn finish_page_release(
        &mut self,
        release: PageRelease,
    ) -> Result<Option<(DevicePtr, u64)>, AllocError> {
        let reservation = self.expandable.end_work(release.seg);
        self.budget.released(release.bytes());
        self.claim_for_pool(release.pool, release.bytes(), false);
        let id = release.block;
        let live = !self.shut_down
            && self.blocks.contains(id)
            && self.blocks.get(id).state() == BlockState::Unmapping
            && self.blocks.get(id).addr() == release.mapped.start;
        if live {
            self.blocks.get_mut(id).end_page_work();
            self.file_unmapped(id);
            if !self.expandable.is_busy(release.seg) {
                self.release_expandable_segment_if_empty(release.seg)?;
            }
        }
        Ok(reservation)
    }
}

/// Step 2: waits for each segment's stream, then unmaps and releases the pages, off the core.
/// Best effort: every page is tried, a failure is logged (the pages stay out of the books);
/// returns the first failed stream synchronization (the miss chain fails its miss with it).
pub fn release_pages(backend: &dyn Backend, releases: &[PageRelease]) -> Result<(), BackendError> {
    let mut synced: Vec<StreamHandle> = Vec::new();
    let mut first = None;
    for r in releases {
        if !synced.contains(&r.stream) {
            if let Err(e) = backend.stream_synchronize(r.stream) {
                tracing::warn!(stream = ?r.stream, error = %e, "synchronizing before an unmap failed");
                first.get_or_insert(e);
            }
            synced.push(r.stream);
        }
    }
    for r in releases {
        unmap_pages(backend, &r.mapped);
    }
    first.map_or(Ok(()), Err)
}
