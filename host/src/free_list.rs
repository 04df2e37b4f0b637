//! [`FreeList`]: the cached free blocks, by size (for lookups) and by age (for the cache cap).
//!
//! Among blocks of one size the most recently freed is handed out first (as PyTorch's
//! per-class stacks do: its pages are the likeliest to be warm). The age order, kept only when
//! a cache cap needs it, holds the blocks that may be released to the backend;
//! reserve-segment blocks are never released.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet};

/// Cached free blocks. Pure bookkeeping over addresses and sizes.
#[derive(Debug, Default)]
pub struct FreeList {
    /// (size, newest first, address, releasable).
    by_size: BTreeSet<(u64, Reverse<u64>, u64, bool)>,
    /// Releasable blocks, oldest first: seq → (size, address); kept only if `track_age`.
    by_age: BTreeMap<u64, (u64, u64)>,
    track_age: bool,
    next_seq: u64,
    bytes: u64,
    releasable_bytes: u64,
}

/// A cached block as [`FreeList`] knows it; `seq` identifies its insertion.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry {
    /// Block start.
    pub addr: u64,
    /// Block size.
    pub size: u64,
    /// Insertion number (larger is newer).
    pub seq: u64,
    /// Whether it counts against the cache cap and may be released.
    pub releasable: bool,
}

impl FreeList {
    /// An empty list; `track_age` keeps the age order [`FreeList::oldest_releasable`] needs.
    pub fn new(track_age: bool) -> Self {
        FreeList {
            track_age,
            ..FreeList::default()
        }
    }

    /// Adds a block; returns its entry.
    pub fn insert(&mut self, addr: u64, size: u64, releasable: bool) -> Entry {
        self.next_seq += 1;
        let seq = self.next_seq;
        self.by_size.insert((size, Reverse(seq), addr, releasable));
        if releasable {
            if self.track_age {
                self.by_age.insert(seq, (size, addr));
            }
            self.releasable_bytes += size;
        }
        self.bytes += size;
        Entry {
            addr,
            size,
            seq,
            releasable,
        }
    }

    /// Removes and returns the smallest block with `min <= size <= max` (newest among equals).
    pub fn take(&mut self, min: u64, max: u64) -> Option<Entry> {
        let &(size, Reverse(seq), addr, releasable) = self
            .by_size
            .range((min, Reverse(u64::MAX), 0, false)..)
            .next()?;
        if size > max {
            return None;
        }
        let e = Entry {
            addr,
            size,
            seq,
            releasable,
        };
        self.remove(e);
        Some(e)
    }

    /// Removes `e` (as returned by `insert`); false when it is not cached.
    pub fn remove(&mut self, e: Entry) -> bool {
        if !self
            .by_size
            .remove(&(e.size, Reverse(e.seq), e.addr, e.releasable))
        {
            return false;
        }
        if e.releasable {
            self.by_age.remove(&e.seq);
            self.releasable_bytes -= e.size;
        }
        self.bytes -= e.size;
        true
    }

    /// The least recently inserted releasable block (`None` unless tracking age).
    pub fn oldest_releasable(&self) -> Option<Entry> {
        self.by_age
            .iter()
            .next()
            .map(|(&seq, &(size, addr))| Entry {
                addr,
                size,
                seq,
                releasable: true,
            })
    }

    /// Every cached block (any order).
    pub fn entries(&self) -> Vec<Entry> {
        self.by_size
            .iter()
            .map(|&(size, Reverse(seq), addr, releasable)| Entry {
                addr,
                size,
                seq,
                releasable,
            })
            .collect()
    }

    /// Bytes of all cached blocks.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Bytes of releasable cached blocks (what the cache cap limits).
    pub fn releasable_bytes(&self) -> u64 {
        self.releasable_bytes
    }

    /// Number of cached blocks.
    pub fn len(&self) -> usize {
        self.by_size.len()
    }

    /// True when nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.by_size.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smallest_fit_newest_first_and_age_order() {
        let mut f = FreeList::new(true);
        f.insert(0x1000, 4096, true);
        f.insert(0x2000, 4096, true);
        f.insert(0x9000, 8192, false);
        assert_eq!((f.bytes(), f.releasable_bytes(), f.len()), (16384, 8192, 3));
        assert_eq!(f.take(2048, 2048), None, "exact class only");
        assert_eq!(
            f.take(4096, 4096).map(|e| e.addr),
            Some(0x2000),
            "newest first"
        );
        assert_eq!(f.oldest_releasable().map(|e| e.addr), Some(0x1000));
        assert_eq!(
            f.take(5000, 9000).map(|e| (e.addr, e.releasable)),
            Some((0x9000, false))
        );
        let e = f.oldest_releasable().unwrap();
        assert!(f.remove(e) && !f.remove(e));
        assert!(f.is_empty() && f.bytes() == 0 && f.releasable_bytes() == 0);
        let mut untracked = FreeList::new(false);
        untracked.insert(0x1000, 4096, true);
        assert_eq!(
            (untracked.oldest_releasable(), untracked.releasable_bytes()),
            (None, 4096)
        );
        assert!(untracked.entries()[0].releasable);
    }
}
