//! How expandable segments grow: the page size per pool, how many pages share one physical
//! handle, and how far a growth maps ahead of the request.
//!
//! PyTorch (`policy:pytorch`): the small pool's pages are 2 MiB and the large pool's are
//! `large_segment_size` (20 MiB); each page is its own physical handle (one `cuMemCreate` and
//! one `cuMemMap` per page), and a growth maps exactly the pages the request needs. On a small
//! model the 20 MiB page is most of the waste: up to 20 MiB mapped and unused at the peak.
//!
//! gpualloc (the default): the large pool's pages are 2 MiB too, so a growth maps at most
//! 2 MiB more than the request needs; and
//! - a growth's physical handles in the default large pool end where its request ends: the pages
//!   wholly inside the request share handles of up to `large_segment_size` (10 pages of
//!   2 MiB: one `cuMemCreate` and one `cuMemMap` for up to 20 MiB of the request instead of
//!   one per page); the next [`AHEAD_SINGLE_PAGES`] pages (the page the request ends in,
//!   shared with the next block, and the first page ahead) are a handle each; the rest of the
//!   pages ahead share handles of up to `large_segment_size` again. A handle is unmapped and
//!   released only whole (CUDA cannot release part of one), so a handle that reaches past its
//!   request keeps free pages between live blocks mapped: a release, or the page move before
//!   a growth (`miss/chain.rs`), cannot give them back. The pages where a request ends and
//!   the next begins are where the holes of the page move were measured to be (a handle each
//!   keeps that move possible); a handle per page ahead too (as before) cost up to ten
//!   driver calls per growth for three pages moved on transformer-lm-forward. A private
//!   pool's growth stays one handle of up to `large_segment_size` (see `handles_for`);
//! - a growth of the large pool maps ahead: at least 1/8 of what the segment has mapped, at
//!   most `large_segment_size`, so a segment that keeps growing grows as often as with
//!   20 MiB pages; but never past the next multiple of `large_segment_size` from the
//!   segment's base that holds the request, where PyTorch's page would end, so a growth never
//!   maps more than PyTorch's would. Without room on the device for the pages ahead it maps
//!   only what the request needs; the pages ahead never push reserved memory past
//!   `per_process_memory_fraction`. Nor does a growth for which free pages were just moved
//!   (`miss/chain.rs`, `ReleaseBeforeGrowth`) map ahead: the move is made to keep reserved
//!   memory near the most it ever held, which pages ahead would pass. And once such a move
//!   was made, no later growth maps ahead: a move is made when free memory strands in holes
//!   as reserved memory passes the most it ever held, so the job is at its peak, where pages
//!   ahead are held unused (PyTorch's `ExpandableSegment` never maps ahead; a job whose
//!   segments still grow after that pays a growth per request, in its first pass only).
//!
//! Measured (`gpualloc replay --policy both`, `expandable_segments:True`; BENCHMARKS.md): see
//! the policy's [`DEVIATIONS`](crate::config::policy::DEVIATIONS) entry.

use crate::config::sizes::SMALL_BUFFER;
use crate::core::{DeviceCore, LARGE_POOL};
use crate::expandable::segment::Handles;

/// The large pool's page under the `gpualloc` policy.
pub const LARGE_POOL_PAGE: u64 = SMALL_BUFFER;

/// Pages after a large-pool growth's request's whole pages that are a physical handle each
/// (the page the request ends in, and the first page ahead); the pages ahead after them share
/// handles. Measured (`gpualloc replay --policy gpualloc`, default config, with no pages
/// ahead after a page move), transformer-lm-forward-bf16 peak reserved / driver maps: 1 page,
/// 760 MiB (2.14%) / 107; 2 pages, 758 MiB (1.89%) / 141; 3 pages, 758 / 174; every page
/// ahead a handle, 754 / 323. PyTorch maps 42 with `expandable_segments:True`.
pub const AHEAD_SINGLE_PAGES: usize = 2;

/// A growth of the large pool maps ahead at least this share of what its segment has mapped
/// (under the `gpualloc` policy).
pub const MAP_AHEAD_DIVISOR: u64 = 8;

impl DeviceCore {
    /// The page size of `pool`'s expandable segments.
    pub(crate) fn segment_page_size(&self, pool: usize) -> u64 {
        if let Some(g) = self.unsplit_of(pool) {
            g
        } else if self.pools[pool].is_small {
            SMALL_BUFFER
        } else if self.config.policy.fine_large_pages() {
            LARGE_POOL_PAGE
        } else {
            self.config.large_segment_size
        }
    }

    /// How a growth of `pool` for a request needing `need` bytes past the mapped pages
    /// groups its pages into physical handles (see the module docs).
    pub(crate) fn handles_for(&self, pool: usize, need: u64) -> Handles {
        if self.unsplit_of(pool).is_some() {
            return Handles::of(usize::MAX); // one handle for a block's whole range
        }
        if !self.config.policy.fine_large_pages() {
            return Handles::of(1);
        }
        let page = self.segment_page_size(pool);
        let per_handle = (self.config.large_segment_size / page).max(1) as usize;
        if pool != LARGE_POOL {
            // A small-pool growth is one 2 MiB page: nothing to split (and so nothing for the
            // history to record). A private pool's memory is released only by its owner,
            // whole (the page move takes the default pools' pages only), and a registrar
            // (NCCL) registers its ranges: a growth in several handles would be deregistered
            // and registered again piece by piece as its handles are unmapped.
            return Handles::of(per_handle);
        }
        Handles {
            per_handle,
            grouped: (need / page) as usize,
            singles: AHEAD_SINGLE_PAGES,
        }
    }

    /// Bytes to map in segment `seg` of `pool` from `addr` (the start of an unmapped block of
    /// `avail` bytes) for a request needing `need` more bytes: (what the request needs,
    /// rounded to pages; that and the pages ahead, none without `ahead`). See the module docs.
    pub(crate) fn growth_len(
        &self,
        seg: u64,
        pool: usize,
        addr: u64,
        need: u64,
        avail: u64,
        ahead: bool,
    ) -> (u64, u64) {
        let Some(es) = self.expandable.get(seg) else {
            return (need, need);
        };
        let want = need.div_ceil(es.page).saturating_mul(es.page).min(avail);
        // (A pool of unsplit blocks needs no rule here: its segment is exactly the block.)
        if !ahead
            || self.pools[pool].is_small
            || !self.config.policy.fine_large_pages()
            || self.budget.pages_moved()
        {
            return (want, want);
        }
        let big = self.config.large_segment_size;
        // Mapped bytes past `MAP_AHEAD_DIVISOR * big` all give `ahead >= big`.
        let mapped = es.mapped_bytes_capped(big.saturating_mul(MAP_AHEAD_DIVISOR));
        let ahead = (mapped / MAP_AHEAD_DIVISOR).div_ceil(es.page) * es.page;
        // Where PyTorch's `large_segment_size` pages would end: the next multiple of it from
        // the segment's base that holds the request. The pages ahead never go past it, so a
        // growth never maps more than PyTorch's would (a segment of 90 MiB needing 2 MiB
        // more maps 10 MiB, to 100 MiB, not 1/8 of 90 = 12 MiB, to 102 MiB).
        let at = addr - es.base;
        let boundary = (at + want).div_ceil(big) * big - at;
        let len = if ahead >= big {
            // A large segment grows as with PyTorch's pages: to that boundary.
            boundary
        } else {
            want.max(ahead).min(boundary)
        };
        let len = len.min(avail);
        if self.pool_room(pool).is_some_and(|room| len > room) {
            return (want, want);
        }
        if self.budget.fits(len) {
            (want, len)
        } else {
            (want, want)
        }
    }
}
