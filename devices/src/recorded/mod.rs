//! Following a history recorded by an owner that serves misses off the core (the facade's
//! actor does: a device malloc or a page map is slow, so it runs off the gate while other
//! requests go on). Two of its steps happen in an order a sequential `malloc` cannot repeat,
//! and a replay that wants the recorded addresses (`gpualloc replay --warm`) makes them
//! itself:
//!
//! - An ordinary segment allocated off the core is adopted by the request that asked for it,
//!   even when a block freed meanwhile would serve it by now (an off-core [`crate::Miss`]).
//!   In the history the `segment_alloc` comes right before that request's `alloc`, after the
//!   frees; a sequential `malloc` would take the freed block. [`DeviceCore::segment_request`]
//!   makes the request without looking in the cache, and the replay drives its miss (the
//!   chain's third driver, the replay's `recorded_miss.rs`).
//! - Pages of an expandable segment mapped off the core join the cache before the request
//!   that wanted them looks in it again, so it takes the best fit among the new pages and the
//!   blocks freed meanwhile. In the history the `segment_map` comes before that `alloc`, after
//!   the frees. [`DeviceCore::map_recorded_pages`] maps the recorded range at its
//!   `segment_map`; the `malloc` that follows then finds what the live request found.
//!
//! - A release that returned some cached segments and kept others (the owner's release off
//!   the core, an out-of-memory step or garbage collection, none of which waits for the
//!   stream events of pending frees) shows as the `segment_free`s of exactly those segments.
//!   [`DeviceCore::release_recorded_segment`] releases the one a `segment_free` names; an
//!   `empty_cache` in its place would wait for pending frees and release segments the owner
//!   kept. [`DeviceCore::unmap_recorded_pages`] does the same for the pages of expandable
//!   segments a `segment_unmap` names.
//!
//! A recorded map or unmap takes the steps a growth or a page release of the miss chain takes
//! (`expandable/growth.rs`, `expandable/shrink.rs`): [`DeviceCore::plan_recorded_map`] and
//! [`DeviceCore::detach_recorded_pages`] change the books only, and the driver calls are made
//! by the caller between them and the commit ([`DeviceCore::map_recorded_pages`] and
//! [`DeviceCore::unmap_recorded_pages`] make them in place).
//!
//! And where recording began after the allocator had started, the expandable segments it held
//! then: [`DeviceCore::restore_expandable`] reserves one with its mapped runs and live blocks,
//! so the pages the history maps later grow the same segment, as they did live.

pub(crate) mod restore;

use gpualloc_runtime::{DevicePtr, StreamHandle};

use crate::blocks::block::{BlockId, BlockState};
use crate::blocks::pool::key;
use crate::core::{DeviceCore, MemPoolId};
use crate::error::AllocError;
use crate::expandable::growth::{map_growth, release_reservation, GrowthPlan};
use crate::expandable::shrink::{release_pages, PageRelease};
use crate::malloc::segment_request::SegmentRequest;
use crate::recorded::restore::{RestorePool, RestoredBlock};

/// How a recorded `segment_map` grouped its pages into physical handles (the history's
/// `TraceEntry::grouped_pages` and `TraceEntry::single_pages`). The default, neither set:
/// every page grouped, as PyTorch's maps and every map that did not split are recorded.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RecordedHandles {
    /// The first pages, sharing handles of up to `large_segment_size`; `None`: all of them.
    pub grouped_pages: Option<u64>,
    /// The pages after those that are a handle each, the rest sharing handles again; `None`:
    /// every page after the grouped ones (histories recorded before the pages ahead shared
    /// handles). Read only with `grouped_pages`.
    pub single_pages: Option<u64>,
}

/// A recorded map or unmap's range inside an expandable segment (`recorded_range`).
#[derive(Clone, Copy)]
struct RecordedRange {
    seg: u64,
    pool: usize,
    end: u64,
}

impl DeviceCore {
    /// The request a miss of `size` bytes on `stream` makes (its rounded size, segment size
    /// and pool), made without looking in the cache or processing events. Finish it like a
    /// miss from [`DeviceCore::try_cached`]: through the miss chain ([`crate::Miss`],
    /// [`DeviceCore::advance_miss`]), or [`DeviceCore::malloc_after_miss`].
    pub fn segment_request(
        &mut self,
        size: u64,
        stream: StreamHandle,
    ) -> Result<SegmentRequest, AllocError> {
        self.segment_request_in(None, size, stream)
    }

    /// [`DeviceCore::segment_request`] for a request of private pool `pool` (`None`: the
    /// default pools, or where PyTorch's stream routing sends it).
    pub fn segment_request_in(
        &mut self,
        pool: Option<MemPoolId>,
        size: u64,
        stream: StreamHandle,
    ) -> Result<SegmentRequest, AllocError> {
        if let Some(id) = pool {
            if self.private.live(id.0).is_none() {
                return Err(AllocError::UnknownPool(id.0));
            }
        }
        // Refuses a core that shut down, too.
        self.check_stream(stream)?;
        if size == 0 {
            return Err(AllocError::InvalidSize {
                size,
                reason: "a request of 0 bytes takes no segment",
            });
        }
        let params = self.params_for(size, stream, pool.map(|p| p.0))?;
        Ok(SegmentRequest { params, size })
    }

    /// Releases the ordinary segment at `base` to the backend, as a `segment_free` of the
    /// history shows it released (see the module docs). `Ok(false)`, changing nothing,
    /// unless `base` starts an ordinary (not expandable) segment that is one free block:
    /// nothing allocated in it and no free pending on stream events.
    pub fn release_recorded_segment(&mut self, base: u64) -> Result<bool, AllocError> {
        if self.shut_down {
            return Err(AllocError::Shutdown);
        }
        if self.expandable.contains(base) {
            return Ok(false);
        }
        let Some(meta) = self.segments.get(base) else {
            return Ok(false);
        };
        // A free block as large as its segment, at its base, is the whole segment.
        let whole = key(meta.stream.raw, meta.size, base);
        let Some(id) = self.pools[meta.pool].free_at(&whole) else {
            return Ok(false);
        };
        self.release_block(id)?;
        Ok(true)
    }

    /// The expandable segment holding `[addr, addr + len)` as whole pages, in a pool that is
    /// awake: its base and block pool, and the range's end. `Err(Shutdown)` on a core that
    /// shut down; `Ok(None)` for anything else (a recorded map or unmap of it changes
    /// nothing).
    fn recorded_range(&self, addr: u64, len: u64) -> Result<Option<RecordedRange>, AllocError> {
        if self.shut_down {
            return Err(AllocError::Shutdown);
        }
        let Some(end) = addr.checked_add(len).filter(|_| len > 0) else {
            return Ok(None);
        };
        let Some((seg, es)) = self
            .expandable
            .at_or_below(addr)
            .filter(|(base, es)| end <= base + es.size() && es.slept.is_none())
        else {
            return Ok(None);
        };
        let whole_pages = (addr - seg) % es.page == 0 && len % es.page == 0;
        let pool = self.segments.pool_of(seg);
        Ok(pool
            .filter(|_| whole_pages)
            .map(|pool| RecordedRange { seg, pool, end }))
    }

    /// The free block of `rec`'s pool and segment, mapped or not as `mapped` says, that holds
    /// `[addr, rec.end)`.
    fn recorded_holder(&self, rec: RecordedRange, addr: u64, mapped: bool) -> Option<BlockId> {
        let holds = |&id: &BlockId| {
            let b = self.blocks.get(id);
            b.segment() == rec.seg
                && b.state() == BlockState::Free
                && b.mapped() == mapped
                && b.addr() <= addr
                && rec.end <= b.end()
        };
        let pool = &self.pools[rec.pool];
        if mapped {
            pool.free_ids().find(holds)
        } else {
            pool.unmapped_ids().find(holds)
        }
    }

    /// Unmaps the pages `[addr, addr + len)` of an expandable segment, as a `segment_unmap` of
    /// the history shows them unmapped (see the module docs), after the segment's stream
    /// finished its work (as every unmap), and frees the reservation if nothing in it is
    /// mapped any more. `Ok(false)`, changing nothing, unless the range is whole pages inside
    /// one free mapped block (of a pool that is awake) that physical handles cover exactly: a
    /// handle reaching out of the range cannot be released in part. The in-place driver of
    /// [`DeviceCore::detach_recorded_pages`]: the release's own three steps (`shrink.rs`),
    /// the driver calls made here.
    pub fn unmap_recorded_pages(&mut self, addr: u64, len: u64) -> Result<bool, AllocError> {
        let Some(release) = self.detach_recorded_pages(addr, len)? else {
            return Ok(false);
        };
        let backend = self.backend.clone();
        let released = release_pages(backend.as_ref(), std::slice::from_ref(&release));
        if let Some(reservation) = self.finish_page_release(release)? {
            release_reservation(backend.as_ref(), self.device, reservation);
        }
        released?;
        Ok(true)
    }

    /// Step 1 of a recorded `segment_unmap` for an owner that unmaps off the core, as it
    /// releases free pages: takes the pages `[addr, addr + len)` out of the books
    /// (`shrink.rs`: release them with [`release_pages`](crate::release_pages), then
    /// [`DeviceCore::finish_page_release`]). `Ok(None)`, changing nothing, in the cases
    /// [`DeviceCore::unmap_recorded_pages`] lists.
    pub fn detach_recorded_pages(
        &mut self,
        addr: u64,
        len: u64,
    ) -> Result<Option<PageRelease>, AllocError> {
        let Some(rec) = self.recorded_range(addr, len)? else {
            return Ok(None);
        };
        let RecordedRange { seg, end, .. } = rec;
        let Some(es) = self.expandable.get(seg) else {
            return Ok(None);
        };
        let (first, last) = (es.page_left(addr), es.page_left(end));
        let covered: usize = es
            .runs_inside(first, last)
            .iter()
            .filter_map(|&s| es.run_at(s))
            .map(|(_, _, n)| n)
            .sum();
        if covered != last - first {
            return Ok(None);
        }
        let Some(id) = self.recorded_holder(rec, addr, true) else {
            return Ok(None);
        };
        let release = self.detach_runs(id, first, last);
        debug_assert!(release
            .as_ref()
            .is_some_and(|r| r.bytes() == len && self.blocks.get(id).addr() == addr));
        Ok(release)
    }

    /// Maps the pages `[addr, addr + len)` of an expandable segment as one free block, merged
    /// with its free neighbours, as a growth made off the core for another request does
    /// (one `segment_map` in the history). `Ok(false)`, changing nothing, when the range is
    /// not whole pages inside one free unmapped block (of a pool that is awake), when mapping it would pass
    /// `per_process_memory_fraction` or a pool's quota, or when the device has no memory for
    /// it. The in-place driver of [`DeviceCore::plan_recorded_map`]: the map is the growth's
    /// own three steps, the driver call made here.
    pub fn map_recorded_pages(&mut self, addr: u64, len: u64) -> Result<bool, AllocError> {
        self.map_recorded_growth(addr, len, RecordedHandles::default())
    }

    /// [`DeviceCore::map_recorded_pages`] for a `segment_map` whose pages were grouped into
    /// physical handles as `handles` says, mapped the same way, so that a later release
    /// unmaps the same pages.
    pub fn map_recorded_growth(
        &mut self,
        addr: u64,
        len: u64,
        handles: RecordedHandles,
    ) -> Result<bool, AllocError> {
        let Some(plan) = self.plan_recorded_growth(addr, len, handles)? else {
            return Ok(false);
        };
        let backend = self.backend.clone();
        match map_growth(backend.as_ref(), &plan) {
            Ok(mapped) => match self.commit_growth(plan, mapped) {
                Ok(()) => Ok(true),
                Err(refused) => {
                    // Only a shutdown refuses a commit made right after its plan.
                    refused.release(backend.as_ref());
                    Err(AllocError::Shutdown)
                }
            },
            Err(e) => {
                // `map_growth` released what it created: the range is unmapped again.
                if let Some(reservation) = self.abort_growth(plan) {
                    release_reservation(backend.as_ref(), self.device, reservation);
                }
                if e.is_oom() {
                    Ok(false)
                } else {
                    Err(e.into())
                }
            }
        }
    }

    /// Step 1 of a recorded `segment_map` for an owner that maps off the core, as it grows
    /// segments: takes the pages `[addr, addr + len)` out of the unmapped set as a planned
    /// growth (`growth.rs`: map them with [`map_growth`](crate::map_growth), then
    /// [`DeviceCore::commit_growth`] or [`DeviceCore::abort_growth`]). `Ok(None)`, changing
    /// nothing, in the cases [`DeviceCore::map_recorded_pages`] lists, but the device's lack
    /// of memory, which the map finds.
    pub fn plan_recorded_map(
        &mut self,
        addr: u64,
        len: u64,
    ) -> Result<Option<GrowthPlan>, AllocError> {
        self.plan_recorded_growth(addr, len, RecordedHandles::default())
    }

    /// [`DeviceCore::plan_recorded_map`] with the handles of
    /// [`DeviceCore::map_recorded_growth`].
    pub fn plan_recorded_growth(
        &mut self,
        addr: u64,
        len: u64,
        handles: RecordedHandles,
    ) -> Result<Option<GrowthPlan>, AllocError> {
        let Some(rec) = self.recorded_range(addr, len)? else {
            return Ok(None);
        };
        let pool = rec.pool;
        let Some(id) = self.recorded_holder(rec, addr, false) else {
            return Ok(None);
        };
        let over_fraction = !self.budget.fits(len);
        if over_fraction || self.pool_room(pool).is_some_and(|room| len > room) {
            return Ok(None);
        }
        // The part before the range stays an unmapped block; the plan cuts off the part after.
        let mut range = id;
        if self.blocks.get(id).addr() < addr {
            let b = self.blocks.get(id).clone();
            self.pools[pool].unfile_unmapped(&b);
            range = self.blocks.split_back(id, addr - b.addr());
            self.pools[pool].file_unmapped(self.blocks.get(id), id);
            self.pools[pool].file_unmapped(self.blocks.get(range), range);
        }
        let avail = self.blocks.get(range).size();
        let plan = self.plan_pages(range, len, avail, false, false);
        // A count past `usize` (or none: every later page single) groups without bound.
        let pages = |n: Option<u64>| {
            n.and_then(|n| usize::try_from(n).ok())
                .unwrap_or(usize::MAX)
        };
        Ok(plan.map(|p| match handles.grouped_pages {
            Some(g) => p.grouping_first(pages(Some(g)), pages(handles.single_pages)),
            None => p,
        }))
    }

    /// Restores an expandable segment of a recorded state: reserves `size` bytes (rounded up
    /// to whole pages) for `stream` in the pool `target` names (a private pool's must be a
    /// named one: its pools grow expandable segments of their own), maps `runs` (`(addr, len)`:
    /// whole pages from `base`, sorted and disjoint) and places the `live` blocks (sorted,
    /// disjoint, each inside a run) in them as allocated blocks; the rest of each run is free,
    /// the rest of the range unmapped. Addresses are relative to `base`; the segment is where
    /// the backend put it (returned), everything at the same offsets from it. The pages
    /// mapped count as mapped (reserved bytes, driver calls, `segment_map` in the history),
    /// one physical handle per page.
    /// Bad input is an error before anything is reserved; a device without memory for the runs
    /// leaves the segment reserved with the runs mapped so far and returns out-of-memory.
    pub fn restore_expandable(
        &mut self,
        base: u64,
        size: u64,
        stream: StreamHandle,
        target: RestorePool,
        runs: &[(u64, u64)],
        live: &[RestoredBlock],
    ) -> Result<DevicePtr, AllocError> {
        let invalid = |reason: &'static str| AllocError::InvalidSize { size, reason };
        self.check_stream(stream)?;
        let pool = self.restore_pool_index(target)?;
        if !self.pool_expands(pool) {
            return Err(AllocError::NotSupported(
                "restoring an expandable segment needs expandable_segments:True",
            ));
        }
        let page = self.segment_page_size(pool);
        let end = base
            .checked_add(size)
            .filter(|_| size > 0)
            .ok_or(invalid("the segment is empty or overflows"))?;
        let mut cursor = base;
        for &(addr, len) in runs {
            let aligned = addr >= base && (addr - base) % page == 0 && len > 0 && len % page == 0;
            if !aligned || addr < cursor || addr.checked_add(len).is_none_or(|e| e > end) {
                return Err(invalid(
                    "runs must be whole pages inside the segment, sorted and disjoint",
                ));
            }
            cursor = addr + len;
        }
        // Runs side by side are one mapped stretch: a block may cross from one to the next.
        let mut stretches: Vec<(u64, u64)> = Vec::with_capacity(runs.len());
        for &(addr, len) in runs {
            match stretches.last_mut() {
                Some(last) if last.1 == addr => last.1 = addr + len,
                _ => stretches.push((addr, addr + len)),
            }
        }
        let mut cursor = base;
        for b in live {
            let inside = b.addr.checked_add(b.size).is_some_and(|b_end| {
                stretches
                    .iter()
                    .any(|&(start, stop)| b.addr >= start && b_end <= stop)
            });
            if b.size == 0 || b.addr < cursor || !inside {
                return Err(invalid(
                    "restored blocks must be sorted, disjoint and inside the runs",
                ));
            }
            cursor = b.addr + b.size;
        }
        let granularity = self.backend.vmm_granularity(self.device)?;
        let id = self.reserve_expandable(stream, pool, size.div_ceil(page), granularity)?;
        let placed = self.blocks.get(id).addr();
        let shift = |addr: u64| addr - base + placed;
        // One physical handle per page: where the live handles started and ended is not in
        // the snapshot, and a `segment_unmap` of the history (whole live handles) is then
        // whole handles of the restore too (`unmap_recorded_pages`).
        for &(addr, len) in runs {
            for at in (addr..addr + len).step_by(page as usize) {
                if !self.map_recorded_pages(shift(at), page)? {
                    return Err(self.out_of_memory_for(len, pool, stream));
                }
            }
        }
        for b in live {
            self.carve_allocated(pool, shift(b.addr), b.size, b.requested);
        }
        // Pages mapped before recording began are not fresh (`Block::fresh`): whether a
        // request took from them since is not in the snapshot, and the live allocator had
        // served requests from them before it (only a growth's own pages are fresh).
        let restored: Vec<BlockId> = self.pools[pool]
            .free_ids()
            .filter(|&id| {
                let b = self.blocks.get(id);
                b.segment() == placed && b.fresh()
            })
            .collect();
        for id in restored {
            self.blocks.get_mut(id).end_fresh();
        }
        Ok(DevicePtr(placed))
    }

    /// The out-of-memory error of a restore that could not map `len` bytes.
    fn out_of_memory_for(&mut self, len: u64, pool: usize, stream: StreamHandle) -> AllocError {
        let mut params = match self.params_for(len, stream, None) {
            Ok(p) => p,
            Err(e) => return e,
        };
        params.pool = pool;
        params.quiet_oom = true;
        self.out_of_memory(len, &params)
    }

    /// Makes `[addr, addr + size)`, inside a free mapped block of `pool`, an allocated block
    /// of `requested` bytes; the parts of the free block before and after it stay free.
    fn carve_allocated(&mut self, pool: usize, addr: u64, size: u64, requested: u64) {
        let Some(id) = self.pools[pool].free_ids().find(|&id| {
            let b = self.blocks.get(id);
            b.mapped() && b.addr() <= addr && addr + size <= b.addr() + b.size()
        }) else {
            return;
        };
        let b = self.blocks.get(id).clone();
        self.pools[pool].unfile_free(&b);
        let mut range = id;
        if b.addr() < addr {
            range = self.blocks.split_back(id, addr - b.addr());
            self.pools[pool].file_free(self.blocks.get(id), id);
        }
        let end = b.addr() + b.size();
        if addr + size < end {
            let rest = self.blocks.split_back(range, size);
            self.pools[pool].file_free(self.blocks.get(rest), rest);
        }
        let small = self.pools[pool].is_small;
        self.blocks
            .get_mut(range)
            .allocate(requested, self.spill.tick());
        self.active.insert(addr, range);
        self.book_allocated(pool, small, size, requested);
    }
}
