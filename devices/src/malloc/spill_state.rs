//! What the `gpualloc` policy's spill (`spill.rs`) decides by: how long the last block of each
//! small size lived, counted in allocations (and whether any was freed yet), and the bytes the
//! default small pool holds against the most it ever held and against what the default large
//! pool holds.

use crate::config::sizes::{MIN_BLOCK_SIZE, SMALL_SIZE};

/// A size whose last block has not been freed yet.
const UNKNOWN: u32 = u32::MAX;

/// See the module docs (leaf).
#[derive(Debug)]
pub(crate) struct SpillState {
    /// Allocations handed out so far.
    clock: u64,
    /// The last lifetime by block size, in `MIN_BLOCK_SIZE` steps up to `SMALL_SIZE`.
    last: Vec<u32>,
    /// Bytes the default small pool has mapped (its expandable segment's pages).
    small_held: u64,
    /// The most it ever held (no statistics reset lowers it).
    small_most: u64,
    /// Bytes the default large pool has mapped.
    large_held: u64,
    /// A small block of the default pools has been freed (found once, then kept).
    freed_small: bool,
    /// A replay follows a history's spills (`DeviceCore::spill_as_recorded`): the miss
    /// chain spills nothing by itself.
    pub as_recorded: bool,
}

impl Default for SpillState {
    fn default() -> Self {
        SpillState {
            clock: 0,
            last: vec![UNKNOWN; (SMALL_SIZE / MIN_BLOCK_SIZE) as usize + 1],
            small_held: 0,
            small_most: 0,
            large_held: 0,
            freed_small: false,
            as_recorded: false,
        }
    }
}

impl SpillState {
    /// The birth stamp the next allocation will get: a block handed out before now has a
    /// lower one. Captures stamp their streams' joins with it (`pools/capture.rs`).
    pub fn next_stamp(&self) -> u64 {
        self.clock + 1
    }

    /// One more allocation: its birth stamp.
    #[inline]
    pub fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// A block of `size` bytes born at `born` is freed now (sizes over `SMALL_SIZE` are not
    /// kept). On the hit path: the lifetime is taken modulo 2^32 (one subtraction), so a
    /// block that lived 4 billion allocations or more may read as short-lived, or as unknown
    /// (`u32::MAX`): the spill only places blocks, and either answer is safe.
    #[inline]
    pub fn learn(&mut self, size: u64, born: u64) {
        if let Some(slot) = self.last.get_mut((size / MIN_BLOCK_SIZE) as usize) {
            *slot = (self.clock as u32).wrapping_sub(born as u32);
        }
    }

    /// How many allocations the last freed block of `size` bytes lived; `None` before one was
    /// freed.
    pub fn last(&self, size: u64) -> Option<u64> {
        match self.last.get((size / MIN_BLOCK_SIZE) as usize) {
            Some(&l) if l != UNKNOWN => Some(u64::from(l)),
            _ => None,
        }
    }

    /// The default small pool (`small`) or large pool now holds `bytes` more (`added`) or
    /// fewer.
    pub fn pages_changed(&mut self, small: bool, bytes: u64, added: bool) {
        let held = if small {
            &mut self.small_held
        } else {
            &mut self.large_held
        };
        *held = if added {
            *held + bytes
        } else {
            held.saturating_sub(bytes)
        };
        self.small_most = self.small_most.max(self.small_held);
    }

    /// Whether `bytes` more in the default small pool would make it hold more than 1 / `share`
    /// of what the default large pool holds.
    pub fn small_pool_outgrows_share(&self, bytes: u64, share: u64) -> bool {
        self.small_held.saturating_add(bytes).saturating_mul(share) > self.large_held
    }

    /// Whether a small block of the default pools has been freed yet. Off the hit path: the
    /// lifetimes are looked through until the first is found (a free only stores one), then
    /// the answer is kept.
    pub fn freed_small(&mut self) -> bool {
        if !self.freed_small {
            self.freed_small = self.last.iter().any(|&l| l != UNKNOWN);
        }
        self.freed_small
    }

    /// Whether `bytes` more in the default small pool would pass the most it ever held.
    pub fn small_pool_passes_most(&self, bytes: u64) -> bool {
        self.small_held + bytes > self.small_most
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lifetime_is_the_allocations_between_birth_and_free() {
        let mut s = SpillState::default();
        assert_eq!(s.last(512), None);
        assert_eq!(s.next_stamp(), 1);
        let born = s.tick();
        assert!(born < s.next_stamp());
        s.tick();
        s.tick();
        s.learn(512, born);
        assert_eq!(s.last(512), Some(2));
        assert_eq!(s.last(1024), None, "each size its own");
        let now = s.tick();
        s.learn(SMALL_SIZE, now);
        assert_eq!(s.last(SMALL_SIZE), Some(0));
        s.learn(SMALL_SIZE + MIN_BLOCK_SIZE, born);
        assert_eq!(s.last(SMALL_SIZE + MIN_BLOCK_SIZE), None, "not kept");
    }

    #[test]
    fn a_small_free_is_found_once_and_kept() {
        let mut s = SpillState::default();
        assert!(!s.freed_small());
        let born = s.tick();
        s.learn(SMALL_SIZE + MIN_BLOCK_SIZE, born);
        assert!(!s.freed_small(), "a large block is not kept");
        s.learn(MIN_BLOCK_SIZE, born);
        assert!(s.freed_small());
        s.last[1] = UNKNOWN;
        assert!(s.freed_small(), "kept once found");
    }

    #[test]
    fn the_share_compares_the_small_pool_with_the_large_pools_mapped_bytes() {
        let mut s = SpillState::default();
        s.pages_changed(true, 2 << 20, true);
        s.pages_changed(false, 64 << 20, true);
        // (2 + 2) MiB * 16 = 64 MiB: not more than the large pool.
        assert!(!s.small_pool_outgrows_share(2 << 20, 16));
        assert!(s.small_pool_outgrows_share((2 << 20) + 1, 16));
        s.pages_changed(false, 2 << 20, false);
        assert!(s.small_pool_outgrows_share(2 << 20, 16), "62 MiB left");
        s.pages_changed(false, 4 << 20, true);
        assert!(
            !s.small_pool_outgrows_share(2 << 20, 16),
            "66 MiB: 64 is not more"
        );
        assert!(s.small_pool_outgrows_share(2 << 20, 17), "66 MiB: 68 is");
        s.pages_changed(false, u64::MAX, false);
        assert!(s.small_pool_outgrows_share(0, 1), "never below zero");
        assert!(
            s.small_pool_outgrows_share(u64::MAX, u64::MAX),
            "no overflow"
        );
    }

    #[test]
    fn the_small_pools_mark_is_the_most_it_ever_held() {
        let mut s = SpillState::default();
        s.pages_changed(true, 4 << 20, true);
        assert!(!s.small_pool_passes_most(0));
        assert!(s.small_pool_passes_most(1));
        s.pages_changed(true, 2 << 20, false);
        assert!(!s.small_pool_passes_most(2 << 20));
        assert!(s.small_pool_passes_most((2 << 20) + 1));
        s.pages_changed(true, 2 << 20, true);
        assert!(s.small_pool_passes_most(1));
    }
}
