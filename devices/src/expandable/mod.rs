//! The core's side of expandable segments (`segment.rs`: the segment itself, its runs
//! of physical memory, mapping and unmapping): finding a run of free and unmapped blocks for a
//! request, mapping what it lacks, booking mapped and released pages, releasing free pages.

pub(crate) mod growth;
pub(crate) mod pages;
pub(crate) mod segment;
pub(crate) mod segments;
pub(crate) mod shrink;

use std::collections::BTreeMap;

use gpualloc_runtime::{BackendError, DeviceId, DevicePtr, StreamHandle};

use crate::blocks::block::{Block, BlockId, BlockState};
use crate::blocks::segment_table::SegmentMeta;
use crate::core::DeviceCore;
use crate::error::AllocError;
use crate::expandable::segment::{Booking, ExpandableSegment};
use crate::ledger::trace::TraceAction;

impl DeviceCore {
    /// Gives `peer` access to this device's expandable-segment memory, mapped now and mapped
    /// from now on (PyTorch's `ExpandableSegment::addPeer`, called once the user has enabled
    /// peer access between the two devices). Ordinary segments need nothing: the driver's
    /// peer access covers them. One driver call per run of mapped pages, made here, under the
    /// owner's lock: a setup step, not a hot path. Adding the device itself or a peer twice
    /// does nothing; an unknown device is an error and changes nothing.
    pub fn add_peer(&mut self, peer: DeviceId) -> Result<(), AllocError> {
        if peer == self.device || self.expandable.peers().contains(&peer) {
            return Ok(());
        }
        if peer.0 >= self.backend.device_count()? {
            return Err(AllocError::Backend(BackendError::InvalidDevice(peer.0)));
        }
        for es in self.expandable.values() {
            for (first, pages) in es.mapped_stretches() {
                let len = pages as u64 * es.page;
                self.backend
                    .set_access(peer, DevicePtr(es.page_addr(first)), len)?;
            }
        }
        self.expandable.add_peer(peer);
        Ok(())
    }

    /// Unmaps the runs of pages lying wholly inside `[addr, addr + len)`, after the segment's
    /// stream finished its work. Returns the unmapped range (length 0 when no run is inside).
    pub(crate) fn es_unmap(
        &mut self,
        seg: u64,
        addr: u64,
        len: u64,
    ) -> Result<(u64, u64), AllocError> {
        let backend = self.backend.clone();
        // An unmap waits for the segment's stream, which a capture forbids: the pages stay.
        let capturing = self
            .expandable
            .get(seg)
            .is_some_and(|es| self.stream_captures(es.stream));
        if capturing {
            return Ok((addr, 0));
        }
        let es = self
            .expandable
            .get_mut(seg)
            .ok_or(AllocError::UnknownPointer(DevicePtr(seg)))?;
        let inside = es
            .pages_inside(addr, addr + len)
            .map(|(first, last)| es.runs_inside(first, last))
            .unwrap_or_default();
        let Some(&start) = inside.first() else {
            return Ok((addr, 0));
        };
        backend.stream_synchronize(es.stream)?;
        let mut pages = 0;
        for s in inside {
            let Some(&(h, n)) = es.runs.get(&s) else {
                continue;
            };
            backend.unmap(DevicePtr(es.page_addr(s)), n as u64 * es.page)?;
            es.take_run(s);
            pages += n;
            backend.phys_release(h)?;
        }
        Ok((es.page_addr(start), pages as u64 * es.page))
    }

    /// Reserves a new expandable segment for `stream` in `pool`; returns its one unmapped block.
    /// For a pool of unsplit blocks (`unsplit.rs`) the reservation is `exact` bytes aligned to
    /// the pool's granularity; else 9/8 of the device.
    fn new_expandable_segment(
        &mut self,
        stream: StreamHandle,
        pool: usize,
        exact: Option<u64>,
    ) -> Result<BlockId, AllocError> {
        let page = self.segment_page_size(pool);
        let total = self.budget.device_total();
        let pages = match exact {
            Some(bytes) => bytes.div_ceil(page),
            None => (total + total / 8).div_ceil(page),
        };
        let granularity = self.backend.vmm_granularity(self.device)?;
        let alignment = if exact.is_some() {
            granularity.max(page)
        } else {
            granularity
        };
        self.reserve_expandable(stream, pool, pages, alignment)
    }

    /// Reserves an expandable segment of `pages` pages (at least one) of `pool`, aligned to
    /// `alignment`, for `stream`; returns its one unmapped block.
    pub(crate) fn reserve_expandable(
        &mut self,
        stream: StreamHandle,
        pool: usize,
        pages: u64,
        alignment: u64,
    ) -> Result<BlockId, AllocError> {
        let page = self.segment_page_size(pool);
        let pages = pages.max(1);
        let size = pages * page;
        let base = self.backend.va_reserve(self.device, size, alignment)?;
        self.expandable.insert(
            base.0,
            ExpandableSegment {
                base: base.0,
                page,
                pages: pages as usize,
                runs: BTreeMap::new(),
                stream,
                slept: None,
            },
        );
        self.segments
            .insert(base.0, SegmentMeta { size, pool, stream });
        let id = self
            .blocks
            .insert(Block::reserved_range(base.0, size, stream, pool));
        self.pools[pool].file_unmapped(self.blocks.get(id), id);
        tracing::debug!(
            device = self.device.0,
            addr = base.0,
            size,
            page,
            "expandable segment reserved"
        );
        Ok(id)
    }

    fn allocatable(&self, id: Option<BlockId>) -> bool {
        id.is_some_and(|id| self.blocks.get(id).state() == BlockState::Free)
    }

    /// First block (lowest address) of `stream` in `pool` from which free and unmapped blocks
    /// add up to `size`; reserves a new segment when none has room (`find_expandable_block`).
    pub(crate) fn find_expandable_block(
        &mut self,
        stream: StreamHandle,
        pool: usize,
        size: u64,
    ) -> Result<BlockId, AllocError> {
        if self.unsplit_of(pool).is_some() {
            // A range of its own for every block.
            return self.new_expandable_segment(stream, pool, Some(size));
        }
        let candidates: Vec<BlockId> = self.pools[pool]
            .unmapped_range((stream.raw, 0, 0)..)
            .take_while(|(k, _)| k.0 == stream.raw)
            .map(|(_, id)| *id)
            .collect();
        for mut c in candidates {
            let prev = self.blocks.get(c).prev();
            if self.allocatable(prev) {
                c = prev.unwrap_or(c);
            }
            let (mut bytes, mut b) = (0u64, Some(c));
            while bytes < size && self.allocatable(b) {
                let blk = self.blocks.get(b.unwrap_or(c));
                bytes += blk.size();
                b = blk.next();
            }
            if bytes >= size {
                return Ok(c);
            }
        }
        self.new_expandable_segment(stream, pool, None)
    }

    /// Takes unmapped block `id` out of its pool's unmapped set and cuts it to its front `len`
    /// bytes (whole pages); the rest stays an unmapped block in the set.
    pub(crate) fn split_unmapped_front(&mut self, id: BlockId, len: u64) {
        let b = self.blocks.get(id).clone();
        debug_assert!(!b.mapped() && len <= b.size());
        let pool = b.pool();
        self.pools[pool].unfile_unmapped(&b);
        if len < b.size() {
            let rest_id = self.blocks.split_back(id, len);
            self.pools[pool].file_unmapped(self.blocks.get(rest_id), rest_id);
        }
    }

    /// Books block `id` (out of every set, its pages just mapped) as a free mapped block:
    /// merged with free neighbours, in its pool, counted as reserved.
    pub(crate) fn book_mapped(&mut self, id: BlockId) {
        let b = self.blocks.get(id).clone();
        let (start, len, pool) = (b.addr(), b.size(), b.pool());
        debug_assert!(self
            .expandable
            .get(b.segment())
            .is_some_and(|es| es.pages_are(start, len, true)));
        let blk = self.blocks.get_mut(id);
        blk.mark_mapped();
        let (prev, next) = (blk.prev(), blk.next());
        for n in [prev, next].into_iter().flatten() {
            self.try_merge_blocks(id, n);
        }
        self.pools[pool].file_free(self.blocks.get(id), id);
        self.book_pages(pool, b.stream().raw, start, len, Booking::Mapped);
    }

    /// Unmaps the whole pages of free block `id` (PyTorch's `unmap_block`).
    pub(crate) fn unmap_block(&mut self, id: BlockId) -> Result<(), AllocError> {
        let b = self.blocks.get(id).clone();
        let (start, len) = self.es_unmap(b.segment(), b.addr(), b.size())?;
        if len == 0 {
            return Ok(());
        }
        self.book_unmapped(id, start, len, false);
        Ok(())
    }

    /// Books `[start, start + len)` (whole pages inside free mapped block `id`, whose handles
    /// are gone) as unmapped: the parts before and after stay free mapped blocks, `id` becomes
    /// the unmapped middle, reserved memory goes down. `in_flight`: the pages are still being
    /// unmapped off the core (`shrink.rs`): the block is left out of the unmapped set, unmerged,
    /// in state `Unmapping`, until that finishes.
    pub(crate) fn book_unmapped(&mut self, id: BlockId, start: u64, len: u64, in_flight: bool) {
        let b = self.blocks.get(id).clone();
        debug_assert!(self
            .expandable
            .get(b.segment())
            .is_some_and(|es| es.pages_are(start, len, false)));
        debug_assert!(
            start >= b.addr() && start + len <= b.end(),
            "unmapped only inside the block"
        );
        let pool = b.pool();
        self.pools[pool].unfile_free(&b);
        // The parts before and after stay free mapped blocks of the segment.
        let (before, after) = self.blocks.carve(id, start, len);
        for piece in [before, after].into_iter().flatten() {
            self.pools[pool].file_free(self.blocks.get(piece), piece);
        }
        self.blocks.get_mut(id).mark_unmapped(in_flight);
        if !in_flight {
            self.file_unmapped(id);
        }
        self.book_pages(pool, b.stream().raw, start, len, Booking::Released);
    }

    /// Counts `len` bytes of pages of block pool `pool` from `start` as mapped, released, or
    /// restored (a release rolled back, `sleep.rs`: the counters as before it; the trace
    /// shows the pages mapped again after the unmap it showed): reserved bytes of the device
    /// and of the pool, driver calls, trace and segment events.
    pub(crate) fn book_pages(
        &mut self,
        pool: usize,
        stream: u64,
        start: u64,
        len: u64,
        booking: Booking,
    ) {
        let small = self.pools[pool].is_small;
        self.book_page_stats(pool, small, len, booking);
        if booking == Booking::Released {
            self.budget.unreserve(len);
            self.record_in(TraceAction::SegmentUnmap, start, len, stream, Some(pool));
        } else {
            self.budget.reserve(len);
            self.record_in(TraceAction::SegmentMap, start, len, stream, Some(pool));
        }
    }

    /// Files free unmapped block `id` in its pool's unmapped set, merged with free unmapped
    /// neighbours.
    pub(crate) fn file_unmapped(&mut self, id: BlockId) {
        let blk = self.blocks.get(id);
        let (prev, next, pool) = (blk.prev(), blk.next(), blk.pool());
        for n in [prev, next].into_iter().flatten() {
            self.try_merge_blocks(id, n);
        }
        self.pools[pool].file_unmapped(self.blocks.get(id), id);
    }

    /// Frees the reservation of segment `seg` when nothing in it is mapped any more.
    pub(crate) fn release_expandable_segment_if_empty(
        &mut self,
        seg: u64,
    ) -> Result<(), AllocError> {
        let Some(es) = self.expandable.get(seg) else {
            return Ok(());
        };
        if !es.runs.is_empty() {
            return Ok(());
        }
        let size = es.size();
        let head = self.pools.iter().enumerate().find_map(|(p, pool)| {
            pool.unmapped_ids()
                .find(|&id| self.blocks.get(id).segment() == seg)
                .map(|id| (p, id))
        });
        let Some((pool, id)) = head else {
            return Ok(());
        };
        let b = self.blocks.get(id);
        if b.size() != size {
            return Ok(()); // blocks of the segment are still in use
        }
        self.backend.va_free(self.device, DevicePtr(seg), size)?;
        self.pools[pool].unfile_unmapped(b);
        self.blocks.remove(id);
        self.expandable.remove(seg);
        self.segments.remove(seg);
        Ok(())
    }

    /// Releases every mapped page of every expandable segment and the reservations (shutdown).
    pub(crate) fn release_all_expandable(&mut self) -> Option<AllocError> {
        let mut first_err = None;
        let segs: Vec<u64> = self.expandable.bases();
        for seg in segs {
            let Some(es) = self.expandable.remove(seg) else {
                continue;
            };
            if let Err(e) = self.backend.stream_synchronize(es.stream) {
                first_err.get_or_insert(AllocError::Backend(e));
            }
            for (&first, &(h, n)) in &es.runs {
                let at = DevicePtr(es.page_addr(first));
                if let Err(e) = self.backend.unmap(at, n as u64 * es.page) {
                    first_err.get_or_insert(AllocError::Backend(e));
                } else if let Err(e) = self.backend.phys_release(h) {
                    first_err.get_or_insert(AllocError::Backend(e));
                }
            }
            if self.expandable.is_busy(seg) {
                // Pages are being mapped or unmapped off the core: the last of those
                // operations frees the reservation (`growth.rs`, `shrink.rs`).
                self.expandable.orphan(seg, es.size());
            } else if let Err(e) = self.backend.va_free(self.device, DevicePtr(seg), es.size()) {
                first_err.get_or_insert(AllocError::Backend(e));
            }
            self.segments.remove(seg);
        }
        first_err
    }
}
