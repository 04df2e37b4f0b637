//! Returning memory: a block to its pool (with merges), and segments to the backend — the
//! release steps of the OOM chain, garbage collection, `empty_cache` and shutdown.

use gpualloc_runtime::DevicePtr;

use crate::blocks::block::{BlockId, BlockState};
use crate::core::{AllocParams, DeviceCore, LARGE_POOL, SMALL_POOL};
use crate::error::AllocError;
use crate::ledger::trace::TraceAction;

impl DeviceCore {
    /// Puts a freed block (no events pending) back in its pool, merging free neighbours
    /// (PyTorch's `free_block`).
    pub(crate) fn free_block(&mut self, id: BlockId) {
        let b = self.blocks.get(id);
        let (addr, requested, stream, pool, original_size) =
            (b.addr(), b.requested(), b.stream(), b.pool(), b.size());
        let (prev, next) = (b.prev(), b.next());
        self.record(TraceAction::FreeCompleted, addr, requested, stream.raw);
        let mut inactive_blocks: i64 = 0;
        let mut inactive_bytes: i64 = 0;
        for candidate in [prev, next].into_iter().flatten() {
            let subsumed = self.try_merge_blocks(id, candidate);
            if subsumed > 0 {
                inactive_blocks -= 1;
                inactive_bytes -= subsumed as i64;
            }
        }
        let gc_base = self.pools[pool].get_free_block_calls;
        let b = self.blocks.get_mut(id);
        b.cache(gc_base);
        // A freed block was allocated, so it is mapped.
        let (is_split, size, expandable) = (b.is_split(), b.size(), b.expandable());
        self.pools[pool].file_free(b, id);
        if is_split {
            inactive_blocks += 1;
            inactive_bytes += size as i64;
        }
        let small = self.pools[pool].is_small;
        // As in PyTorch, inactive_split is not tracked for expandable segments (their free
        // pages can always be released).
        if !expandable {
            self.book_inactive_split(small, inactive_blocks, inactive_bytes);
        }
        self.book_inactive(small, original_size, requested);
    }

    /// Merges free `src` into `dst` if it is a free neighbour; returns the bytes subsumed.
    pub(crate) fn try_merge_blocks(&mut self, dst: BlockId, src: BlockId) -> u64 {
        let s = self.blocks.get(src);
        let d = self.blocks.get(dst);
        if s.state() != BlockState::Free || !s.stream_uses().is_empty() || s.mapped() != d.mapped()
        {
            return 0;
        }
        let Some(src_block) = self.blocks.absorb(dst, src) else {
            return 0;
        };
        let pool = &mut self.pools[src_block.pool()];
        if src_block.mapped() {
            pool.unfile_free(&src_block);
        } else {
            pool.unfile_unmapped(&src_block);
        }
        src_block.size()
    }

    /// True for a free block that is a whole ordinary (not expandable) segment.
    fn is_whole_segment(&self, id: BlockId) -> bool {
        let b = self.blocks.get(id);
        !b.is_split() && !b.expandable()
    }

    /// Returns a whole free segment to the backend (PyTorch's `release_block`).
    pub(crate) fn release_block(&mut self, id: BlockId) -> Result<(), AllocError> {
        let b = self.blocks.get(id);
        debug_assert!(!b.is_split() && b.state() == BlockState::Free);
        let (addr, size) = (b.addr(), b.size());
        let _span = tracing::debug_span!("device_free", device = self.device.0, size).entered();
        self.backend.free(self.device, DevicePtr(addr))?;
        // The bookkeeping is the detached path's (`detached.rs`), after the driver call.
        let segment = self.detach_block(id);
        self.finish_segment_frees(&[segment]);
        Ok(())
    }

    /// Releases every free block of `pool` that is a whole segment.
    /// Releases every free block of `pool` that is a whole segment, and unmaps the whole pages
    /// of every free block of an expandable segment (then frees reservations left empty).
    pub(crate) fn release_blocks(&mut self, pool: usize) -> Result<(), AllocError> {
        let (mut whole, mut to_unmap) = (Vec::new(), Vec::new());
        for id in self.pools[pool].free_ids() {
            let b = self.blocks.get(id);
            if b.expandable() {
                to_unmap.push(id);
            } else if !b.is_split() {
                whole.push(id);
            }
        }
        for id in whole {
            self.release_block(id)?;
        }
        let mut segments: Vec<u64> = Vec::new();
        for id in to_unmap {
            // Unmapping merges neighbours: skip blocks merged away by an earlier unmap.
            if self.blocks.contains(id)
                && self.blocks.get(id).state() == BlockState::Free
                && self.blocks.get(id).mapped()
            {
                segments.push(self.blocks.get(id).segment());
                self.unmap_block(id)?;
            }
        }
        segments.dedup();
        for seg in segments {
            self.release_expandable_segment_if_empty(seg)?;
        }
        Ok(())
    }

    /// The OOM chain's first release, chosen: the cached oversize blocks of the request's
    /// stream to free, one that fits or else the largest ones until enough is released, and
    /// whether they are enough (PyTorch's `release_available_cached_blocks`). Only whole
    /// segments are released. Choosing does not depend on releasing: the miss chain
    /// (`miss/`) detaches them and has the caller free them.
    pub(crate) fn oversize_victims(&self, params: &AllocParams) -> (Vec<BlockId>, bool) {
        let max_split = self.config.max_split_size;
        if max_split == u64::MAX {
            return (Vec::new(), false);
        }
        let target = params.size.max(max_split);
        let stream = params.stream.raw;
        let pool = &self.pools[params.pool];
        if let Some(((s, _, _), id)) = pool.lower_bound(stream, target) {
            if s == stream && self.is_whole_segment(id) {
                return (vec![id], true);
            }
        }
        // No single block is large enough: release oversize blocks from the largest down.
        let candidates: Vec<(u64, BlockId)> = pool
            .free_range(..(stream, target, 0))
            .rev()
            .take_while(|((s, size, _), _)| *s == stream && *size >= max_split)
            .map(|((_, size, _), id)| (*size, *id))
            .collect();
        let (mut victims, mut released) = (Vec::new(), 0u64);
        for (size, id) in candidates {
            if released >= target {
                break;
            }
            if self.is_whole_segment(id) {
                victims.push(id);
                released += size;
            }
        }
        (victims, released >= target)
    }

    /// The OOM chain's last release (and `empty_cache`): wait for every pending free, then
    /// return every cached whole segment of the default pools and of released private pools
    /// (PyTorch's `release_cached_blocks`).
    pub(crate) fn release_cached_blocks(&mut self) -> Result<bool, AllocError> {
        self.synchronize_and_free_events()?;
        self.release_blocks(LARGE_POOL)?;
        self.release_blocks(SMALL_POOL)?;
        let released: Vec<(u64, usize, usize)> = self
            .private
            .iter()
            .filter(|(_, p)| p.released)
            .map(|(id, p)| (*id, p.small, p.large))
            .collect();
        for (_, small, large) in released {
            self.release_blocks(large)?;
            self.release_blocks(small)?;
        }
        self.forget_released_private_pools();
        Ok(true)
    }

    /// Forgets the private pools released by their users that hold no segment any more and
    /// have none on its way (a cancelled request's segment malloc in flight lands in its pool,
    /// where the next release finds it).
    pub(crate) fn forget_released_private_pools(&mut self) {
        let empty: Vec<u64> = self
            .private
            .iter()
            .filter(|(_, p)| {
                p.released
                    && p.claimed == 0
                    && !self
                        .segments
                        .values()
                        .any(|s| s.pool == p.small || s.pool == p.large)
            })
            .map(|(id, _)| *id)
            .collect();
        for id in empty {
            self.private.remove(id);
        }
    }

    /// The whole cached segments garbage collection reclaims now (PyTorch's
    /// `garbage_collect_cached_blocks`): none while reserved memory is at most the threshold's
    /// share of the allowed memory; else, round by round, the blocks at least as old as the
    /// average (in `get_free_block` calls since they were freed) until enough is reclaimed.
    /// Choosing does not depend on releasing: the miss chain (`miss/`) and the owner's
    /// off-core pass (`detach_gc_victims`) detach them and have the caller free them.
    pub(crate) fn gc_victims(&self) -> Vec<BlockId> {
        let mut victims = Vec::new();
        let Some(allowed) = self.budget.allowed() else {
            return victims;
        };
        if self.config.garbage_collection_threshold <= 0.0 {
            return victims;
        }
        let threshold = (self.config.garbage_collection_threshold * allowed as f64) as u64;
        if self.budget.reserved() <= threshold {
            return victims;
        }
        let target = self.budget.reserved() - threshold;
        let calls = self.pools[LARGE_POOL].get_free_block_calls;
        let age = |id: BlockId| calls - self.blocks.get(id).gc_base();
        let mut freeable: Vec<BlockId> = self.pools[LARGE_POOL]
            .free_ids()
            .filter(|&id| self.is_whole_segment(id))
            .collect();
        let mut total_age: u64 = freeable.iter().map(|&id| age(id)).sum();
        let mut reclaimed = 0u64;
        while reclaimed < target && !freeable.is_empty() {
            let threshold_age = total_age as f64 / freeable.len() as f64;
            let (old, young): (Vec<BlockId>, Vec<BlockId>) = freeable
                .iter()
                .partition(|&&id| age(id) as f64 >= threshold_age);
            if old.is_empty() {
                break;
            }
            for id in old {
                total_age -= age(id);
                reclaimed += self.blocks.get(id).size();
                victims.push(id);
            }
            freeable = young;
        }
        victims
    }

    /// Returns every unused cached segment to the backend, after waiting for pending
    /// cross-stream frees (`torch.cuda.empty_cache`).
    pub fn empty_cache(&mut self) -> Result<(), AllocError> {
        if self.shut_down {
            return Err(AllocError::Shutdown);
        }
        if !self.captures.is_quiet() {
            return Err(AllocError::CaptureUnderway("empty_cache"));
        }
        // A job that empties its cache pays for releases already: the `gpualloc` policy's
        // chain may then release before a growth past the high-water mark (`miss/chain.rs`).
        self.budget.user_released();
        self.release_cached_blocks().map(|_| ())
    }

    /// Shuts the core down: waits for pending frees and returns *every* segment to the
    /// backend, including those of allocations still alive (their owners must not use them
    /// any more; later frees of them are ignored by the actor). Idempotent. Returns the first
    /// backend error, after trying everything.
    pub fn shutdown(&mut self) -> Result<(), AllocError> {
        if self.shut_down {
            return Ok(());
        }
        self.shut_down = true;
        let mut first_err = self.synchronize_and_free_events().err();
        if let Some(e) = self.release_all_expandable() {
            first_err.get_or_insert(e);
        }
        let segments: Vec<u64> = self.segments.bases();
        for addr in segments {
            if let Err(e) = self.backend.free(self.device, DevicePtr(addr)) {
                first_err.get_or_insert(AllocError::Backend(e));
            }
        }
        let retiring = self.retiring.drain_events();
        self.pending.give_back(retiring);
        for ev in self.pending.drain_spare() {
            let _ = self.backend.event_destroy(ev);
        }
        self.segments.clear();
        self.blocks.clear();
        self.active.clear();
        for pool in &mut self.pools {
            pool.clear();
        }
        self.budget.release_all();
        first_err.map_or(Ok(()), Err)
    }
}

impl Drop for DeviceCore {
    fn drop(&mut self) {
        if let Err(e) = self.shutdown() {
            tracing::warn!(device = self.device.0, error = %e, "device core shutdown failed");
        }
    }
}
