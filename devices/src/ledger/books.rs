//! The statistics' side of each event, one call per event: what a block becoming allocated,
//! freed or inactive, a segment or pages booked or released, a split, and each counted
//! occurrence (a device malloc or free, a retry, a synchronization of every stream, a
//! cross-stream free, an out-of-memory error) change in PyTorch's `DeviceStats` and in the
//! usage of the private pool they belong to. Nothing outside `ledger/` writes the statistics
//! (`devices/tests/module_arrows.rs` checks): a counter PyTorch keeps is changed in one place.

use crate::core::{DeviceCore, LARGE_POOL, SMALL_POOL};
use crate::expandable::segment::Booking;
use crate::ledger::stats::{for_pool, Stat, StatArray};

/// An occurrence the statistics count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Counted {
    /// A device malloc, or pages mapped (`num_device_alloc`).
    DeviceAlloc,
    /// A device free, or pages unmapped (`num_device_free`).
    DeviceFree,
    /// A retry of the allocation after a release (`num_alloc_retries`).
    Retry,
    /// Every pending event synchronized (`num_sync_all_streams`).
    SyncAllStreams,
    /// A free on a stream the block was not allocated on (`num_cross_stream_frees`).
    CrossStreamFree,
    /// An out-of-memory error its user sees (`num_ooms`).
    Oom,
}

impl DeviceCore {
    /// One more `what`.
    pub(crate) fn count(&mut self, what: Counted) {
        let s = &mut self.stats;
        match what {
            Counted::DeviceAlloc => s.num_device_alloc += 1,
            Counted::DeviceFree => s.num_device_free += 1,
            Counted::Retry => s.num_alloc_retries += 1,
            Counted::SyncAllStreams => s.num_sync_all_streams += 1,
            Counted::CrossStreamFree => s.num_cross_stream_frees += 1,
            Counted::Oom => s.num_ooms += 1,
        }
    }

    /// A block of `bsize` bytes of block pool `pool` (`small`: its small pool) made allocated
    /// for `requested` bytes: in its private pool's usage and in the device's statistics (an
    /// oversize allocation too, at `max_split_size` or more). Every way a block becomes
    /// allocated (a malloc, a recorded block adopted, a restored one) counts it here. Returns
    /// whether it is an oversize allocation.
    pub(crate) fn book_allocated(
        &mut self,
        pool: usize,
        small: bool,
        bsize: u64,
        requested: u64,
    ) -> bool {
        if let Some(u) = self.usage_mut(pool) {
            for_pool(&mut u.allocated, small, |s| s.increase(bsize));
        }
        let s = &mut self.stats;
        for_pool(&mut s.allocation, small, |s| s.increase(1));
        for_pool(&mut s.allocated_bytes, small, |s| s.increase(bsize));
        for_pool(&mut s.active, small, |s| s.increase(1));
        for_pool(&mut s.active_bytes, small, |s| s.increase(bsize));
        for_pool(&mut s.requested_bytes, small, |s| s.increase(requested));
        let oversize = bsize >= self.config.max_split_size;
        if oversize {
            self.stats.oversize_allocations.increase(1);
        }
        oversize
    }

    /// An allocated block of `size` bytes of block pool `pool` freed by its user: no longer
    /// allocated (it stays active until its stream events complete: [`DeviceCore::book_inactive`]).
    pub(crate) fn book_freed(&mut self, pool: usize, small: bool, size: u64) {
        for_pool(&mut self.stats.allocation, small, |s| s.decrease(1));
        for_pool(&mut self.stats.allocated_bytes, small, |s| s.decrease(size));
        if let Some(u) = self.usage_mut(pool) {
            for_pool(&mut u.allocated, small, |s| s.decrease(size));
        }
        if size >= self.config.max_split_size {
            self.stats.oversize_allocations.decrease(1);
        }
    }

    /// A freed block of `size` bytes (asked for as `requested`) back in its pool: no longer
    /// active.
    pub(crate) fn book_inactive(&mut self, small: bool, size: u64, requested: u64) {
        let s = &mut self.stats;
        for_pool(&mut s.active, small, |s| s.decrease(1));
        for_pool(&mut s.active_bytes, small, |s| s.decrease(size));
        for_pool(&mut s.requested_bytes, small, |s| s.decrease(requested));
    }

    /// Free blocks of split segments (PyTorch's `inactive_split`, not kept for expandable
    /// segments: the caller does not call for them) changed by `blocks` and `bytes` (a free
    /// block merging with its neighbours, either sign).
    pub(crate) fn book_inactive_split(&mut self, small: bool, blocks: i64, bytes: i64) {
        apply_delta(&mut self.stats.inactive_split, small, blocks);
        apply_delta(&mut self.stats.inactive_split_bytes, small, bytes);
    }

    /// `blocks` more free blocks of split segments, of `bytes` (a split leaving a remainder,
    /// a restored free block): [`DeviceCore::book_inactive_split`] where the sign is known,
    /// as on the hit path, so no branch on it is taken.
    pub(crate) fn book_inactive_split_grew(&mut self, small: bool, blocks: u64, bytes: u64) {
        if blocks > 0 {
            for_pool(&mut self.stats.inactive_split, small, |s| {
                s.increase(blocks)
            });
        }
        for_pool(&mut self.stats.inactive_split_bytes, small, |s| {
            s.increase(bytes)
        });
    }

    /// `blocks` fewer free blocks of split segments, of `bytes` (a malloc taking one, or part
    /// of one).
    pub(crate) fn book_inactive_split_shrank(&mut self, small: bool, blocks: u64, bytes: u64) {
        if blocks > 0 {
            for_pool(&mut self.stats.inactive_split, small, |s| {
                s.decrease(blocks)
            });
        }
        for_pool(&mut self.stats.inactive_split_bytes, small, |s| {
            s.decrease(bytes)
        });
    }

    /// A segment of `size` bytes of block pool `pool` booked (`added`) or released: the
    /// segment and its bytes in the device's statistics and its private pool's usage.
    pub(crate) fn book_segment_stats(&mut self, pool: usize, small: bool, size: u64, added: bool) {
        let change = |s: &mut Stat, n: u64| {
            if added {
                s.increase(n)
            } else {
                s.decrease(n)
            }
        };
        for_pool(&mut self.stats.segment, small, |s| change(s, 1));
        for_pool(&mut self.stats.reserved_bytes, small, |s| change(s, size));
        if let Some(u) = self.usage_mut(pool) {
            for_pool(&mut u.segments, small, |s| change(s, 1));
            for_pool(&mut u.reserved, small, |s| change(s, size));
        }
        if size >= self.config.max_split_size {
            change(&mut self.stats.oversize_segments, 1);
        }
    }

    /// `len` bytes of pages of block pool `pool` mapped, released, or a release taken back:
    /// reserved bytes of the device and of the pool, and the driver call counted.
    pub(crate) fn book_page_stats(&mut self, pool: usize, small: bool, len: u64, booking: Booking) {
        let change = |s: &mut Stat| match booking {
            Booking::Mapped => s.increase(len),
            Booking::Released => s.decrease(len),
            Booking::Restored => s.undo_decrease(len),
        };
        for_pool(&mut self.stats.reserved_bytes, small, change);
        // The small pool's mark for the spill (`malloc/spill.rs`): it counts mapped pages
        // only, since the spill needs expandable segments, and a config has them in both
        // default pools or in neither.
        if pool <= LARGE_POOL {
            self.spill.pages_changed(
                pool == SMALL_POOL,
                len,
                !matches!(booking, Booking::Released),
            );
        }
        if let Some(u) = self.usage_mut(pool) {
            for_pool(&mut u.reserved, small, change);
        }
        match booking {
            Booking::Mapped => self.stats.num_device_alloc += 1,
            Booking::Released => self.stats.num_device_free += 1,
            Booking::Restored => self.stats.num_device_free -= 1,
        }
    }
}

/// Adds `delta` (of either sign) to `arr`'s entries for the pool.
fn apply_delta(arr: &mut StatArray, small: bool, delta: i64) {
    if delta > 0 {
        for_pool(arr, small, |s| s.increase(delta as u64));
    } else if delta < 0 {
        for_pool(arr, small, |s| s.decrease(delta.unsigned_abs()));
    }
}
