//! The malloc path through the cache, PyTorch's step for step (see `core.rs`'s module docs):
//! the request's rounded size, segment size and pool (`params_for`), best fit in the pool for
//! its stream (`get_free_block`, with the `gpualloc` policy's rules from `placement.rs`),
//! and the split of the block it found (`alloc_found_block`). A miss leaves here as a
//! [`SegmentRequest`] (`segment_request.rs`, `miss/`).

pub(crate) mod callbacks;
pub mod map_ahead;
pub(crate) mod oom;
pub mod placement;
pub(crate) mod segment_request;
pub mod spill;
pub(crate) mod spill_state;

use gpualloc_runtime::{DevicePtr, StreamHandle};

use crate::blocks::block::{Block, BlockId};
use crate::blocks::pool::FreeKey;
use crate::config::sizes::{allocation_size, is_small, round_size, MIN_BLOCK_SIZE, SMALL_SIZE};
use crate::core::{AllocParams, Allocation, DeviceCore, LARGE_POOL, SMALL_POOL};
use crate::error::AllocError;
use crate::ledger::trace::TraceAction;
use crate::malloc::segment_request::SegmentRequest;

impl DeviceCore {
    /// The block pool of a request: the private pool it names (`route`), else the one its
    /// stream is routed to, else the default pools.
    fn pool_for(&self, rounded: u64, stream: StreamHandle, route: Option<u64>) -> usize {
        let small = is_small(rounded);
        match route
            .or_else(|| self.private.routed(stream.raw))
            .and_then(|id| self.private.get(id))
        {
            Some(p) => {
                if small {
                    p.small
                } else {
                    p.large
                }
            }
            None => {
                if small {
                    SMALL_POOL
                } else {
                    LARGE_POOL
                }
            }
        }
    }

    /// Allocates `size` bytes for use on `stream`. Size 0 returns a null allocation, as
    /// PyTorch does (freeing it is a no-op).
    pub fn malloc(&mut self, size: u64, stream: StreamHandle) -> Result<Allocation, AllocError> {
        match self.try_cached(size, stream)? {
            CachedOutcome::Hit(a) => Ok(a),
            CachedOutcome::Miss(request) => self.malloc_after_miss(request),
        }
    }

    /// The cache-only half of [`DeviceCore::malloc`]: steps 1–3. On a miss it returns the
    /// parameters for a segment allocation, which the caller runs through the miss chain step
    /// by step ([`crate::Miss`], each driver call made by the caller: off this core where a
    /// device malloc is slow), or continues in place with [`DeviceCore::malloc_after_miss`].
    pub fn try_cached(
        &mut self,
        size: u64,
        stream: StreamHandle,
    ) -> Result<CachedOutcome, AllocError> {
        self.try_cached_routed(size, stream, None)
    }

    /// [`DeviceCore::try_cached`] for the private pool `route` names, if any.
    pub(crate) fn try_cached_routed(
        &mut self,
        size: u64,
        stream: StreamHandle,
        route: Option<u64>,
    ) -> Result<CachedOutcome, AllocError> {
        self.check_stream(stream)?;
        if size == 0 {
            return Ok(CachedOutcome::Hit(Allocation {
                ptr: DevicePtr(0),
                size: 0,
                block_size: 0,
                stream,
                small_pool: true,
                oversize: false,
                pool: None,
            }));
        }
        self.process_events()?;
        if !self.captures.is_quiet() {
            self.join_if_capturing(stream);
        }
        let mut params = self.params_for(size, stream, route)?;
        if self.get_free_block(&mut params)
            || (self.trigger_free_memory_callbacks()? && self.get_free_block(&mut params))
        {
            return self.finish(&params, size).map(CachedOutcome::Hit);
        }
        Ok(CachedOutcome::Miss(SegmentRequest { params, size }))
    }

    /// The parameters of a request for `size` bytes on `stream`: its rounded size, segment
    /// size and pool, after the pool's own rules.
    pub(crate) fn params_for(
        &self,
        size: u64,
        stream: StreamHandle,
        route: Option<u64>,
    ) -> Result<AllocParams, AllocError> {
        // `let else`, not `ok_or`: an error built eagerly is dropped on every hit.
        let overflows = || AllocError::InvalidSize {
            size,
            reason: "overflows when rounded",
        };
        let Some(rounded) = round_size(size, &self.config) else {
            return Err(overflows());
        };
        let Some(alloc_size) = allocation_size(rounded, &self.config) else {
            return Err(overflows());
        };
        let mut params = AllocParams {
            stream,
            size: rounded,
            alloc_size,
            pool: self.pool_for(rounded, stream, route),
            block: None,
            any_fit: false,
            quiet_oom: false,
            exact_growth: false,
        };
        self.apply_pool_rules(&mut params)?;
        Ok(params)
    }

    pub(crate) fn finish(
        &mut self,
        params: &AllocParams,
        size: u64,
    ) -> Result<Allocation, AllocError> {
        match params.block {
            Some(id) => {
                // A block the policy passes over, taken because the segment could not grow:
                // the history says so (`TraceEntry::passed_over`).
                let passed_over = params.any_fit && self.passes_over(id, params);
                let a = self.alloc_found_block(id, params.size, size);
                if passed_over {
                    self.mark_passed_over(a.ptr.0);
                }
                Ok(a)
            }
            None => Err(AllocError::InvalidSize {
                size,
                reason: "no block found (internal)",
            }),
        }
    }

    /// Serves `request` from free block `id` (free key `k`) of `pool`, taken out of it: a link
    /// of the miss chain a replay applies where the history names the block (a loan, a spill).
    /// `Err` gives the request back, the block free again.
    pub(crate) fn finish_from_free(
        &mut self,
        mut request: SegmentRequest,
        pool: usize,
        k: &FreeKey,
        id: BlockId,
    ) -> Result<Allocation, SegmentRequest> {
        let own = request.params.pool;
        self.pools[pool].take_free(k);
        request.params.pool = pool;
        request.params.block = Some(id);
        match self.finish(&request.params, request.size) {
            Ok(a) => Ok(a),
            Err(_) => {
                // `finish` fails only without a block; the block goes back all the same.
                self.pools[pool].file_free(self.blocks.get(id), id);
                request.params.pool = own;
                request.params.block = None;
                Err(request)
            }
        }
    }

    /// Best fit for `params` in its pool (PyTorch's `get_free_block`).
    pub(crate) fn get_free_block(&mut self, params: &mut AllocParams) -> bool {
        let gc_on =
            self.config.garbage_collection_threshold > 0.0 && self.budget.allowed().is_some();
        if gc_on {
            self.pools[params.pool].get_free_block_calls += 1;
        }
        let pool = &self.pools[params.pool];
        let stream = params.stream.raw;
        // One walk of the free tree: its first entry is the best fit by size, and the best
        // fit by growth below goes on from there (a second search cost a tenth of a hit).
        let mut walk = pool.free_range((stream, params.size, 0)..);
        let Some((&first_key, &first_id)) = walk.next() else {
            return false;
        };
        let (mut k, mut id) = (first_key, first_id);
        if k.0 != stream {
            return false;
        }
        if self.unsplit_of(params.pool).is_some() {
            // A block of its own: only one of exactly the rounded size serves the request.
            if k.1 != params.size {
                return false;
            }
            self.pools[params.pool].take_free(&k);
            params.block = Some(id);
            return true;
        }
        #[cfg(feature = "rule-knobs")]
        if self.knobs.tie_break_high_address {
            if let Some((hk, high)) = pool
                .free_range((stream, k.1, 0)..=(stream, k.1, u64::MAX))
                .next_back()
            {
                (k, id) = (*hk, *high);
                walk = pool.free_range((std::ops::Bound::Excluded(k), std::ops::Bound::Unbounded));
            }
        }
        if self.blocks.get(id).expandable() {
            // Best fit by the size a block can grow to (its size plus the pages after it that
            // are not mapped), so address space stays free for growth. Pages being mapped or
            // unmapped off the core count as not mapped, up to the next mapped page: the
            // choice must not depend on whether another request's map has landed (a replay
            // of the history maps them where the history shows them). Without pages in
            // flight this is PyTorch's rule: its unmapped neighbours are one block.
            let grow = |id: BlockId| {
                let mut size = self.blocks.get(id).size();
                let mut next = self.blocks.get(id).next();
                while let Some(n) = next.map(|n| self.blocks.get(n)).filter(|n| !n.mapped()) {
                    size += n.size();
                    next = n.next();
                }
                size
            };
            let mut best = grow(id);
            for (nk, nid) in walk {
                if !self.blocks.get(id).expandable() || nk.0 != stream {
                    break;
                }
                let candidate = grow(*nid);
                if candidate >= best {
                    break;
                }
                (k, id, best) = (*nk, *nid, candidate);
            }
        }
        if !params.any_fit && self.passes_over(id, params) {
            return self.take_tail(params);
        }
        if !self.size_rules_allow(k.1, params.size, self.blocks.get(id).expandable()) {
            return false;
        }
        self.pools[params.pool].take_free(&k);
        params.block = Some(id);
        true
    }

    /// PyTorch's size rules for a free block of `block_size` serving a request of `size`
    /// (its `get_free_block`): never an oversize block (`max_split_size` or more) to a small
    /// request, and to a large one only if the waste stays under `max_non_split_rounding`.
    /// `max_split_size` limits blocks of expandable segments only under PyTorch's policy.
    /// Best fit, orphan adoption and loans all ask here.
    #[inline]
    pub(crate) fn size_rules_allow(&self, block_size: u64, size: u64, expandable: bool) -> bool {
        if expandable && !self.config.policy.max_split_limits_expandable() {
            return true;
        }
        let max_split = self.config.max_split_size;
        let oversize_for_small = size < max_split && block_size >= max_split;
        let too_big = size >= max_split
            && block_size >= size.saturating_add(self.config.max_non_split_rounding);
        !oversize_for_small && !too_big
    }

    fn trigger_free_memory_callbacks(&mut self) -> Result<bool, AllocError> {
        if self.callbacks.is_empty() {
            return Ok(false);
        }
        let to_free = self.callbacks.collect();
        let mut freed = false;
        for ptr in to_free {
            match self.free(ptr) {
                Ok(()) => freed = true,
                Err(e) => {
                    tracing::warn!(%ptr, error = %e, "free-memory callback returned a bad pointer")
                }
            }
        }
        if freed {
            self.process_events()?;
        }
        Ok(freed)
    }

    /// PyTorch's `should_split`.
    fn should_split(&self, block: &Block, size: u64) -> bool {
        let remaining = block.size() - size;
        if self.pools[block.pool()].is_small || self.config.expandable_segments {
            remaining >= MIN_BLOCK_SIZE
        } else {
            size < self.config.max_split_size && remaining > SMALL_SIZE
        }
    }

    /// Hands out the found block, splitting off the remainder when the rules allow
    /// (PyTorch's `alloc_found_block`).
    fn alloc_found_block(&mut self, mut id: BlockId, size: u64, requested: u64) -> Allocation {
        let found = self.blocks.get(id).clone();
        let small = self.pools[found.pool()].is_small;
        let already_split = found.is_split();
        if self.should_split(&found, size) {
            // The front `size` bytes become a new block; the remainder keeps the old id.
            let front_id = self.blocks.split_front(id, size);
            let gc_base = self.pools[found.pool()].get_free_block_calls;
            let rest = self.blocks.get_mut(id);
            rest.set_gc_base(gc_base);
            // A request took from it (the front, now allocated, is never fresh).
            rest.end_fresh();
            let rest_size = rest.size();
            self.pools[found.pool()].file_free(rest, id);
            if found.expandable() {
                // inactive_split is not tracked for expandable segments (as in PyTorch).
            } else if already_split {
                self.book_inactive_split_shrank(small, 0, size);
            } else {
                self.book_inactive_split_grew(small, 1, rest_size);
            }
            id = front_id;
        } else if already_split && !found.expandable() {
            self.book_inactive_split_shrank(small, 1, found.size());
        }
        let block = self.blocks.get_mut(id);
        block.allocate(requested, self.spill.tick());
        let (addr, bsize, stream, pool) =
            (block.addr(), block.size(), block.stream(), block.pool());
        self.active.insert(addr, id);
        let owner = self.owner_of(pool);
        let oversize = self.book_allocated(pool, small, bsize, requested);
        self.record_in(TraceAction::Alloc, addr, requested, stream.raw, Some(pool));
        Allocation {
            ptr: DevicePtr(addr),
            size: requested,
            block_size: bsize,
            stream,
            small_pool: small,
            oversize,
            pool: owner,
        }
    }
}

/// Result of the cache-only half of malloc.
pub enum CachedOutcome {
    /// Served from the cache.
    Hit(Allocation),
    /// A segment must be allocated.
    Miss(SegmentRequest),
}
