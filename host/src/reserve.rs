//! [`ReserveSegment`]: the bump allocator over the one reserved pinned segment
//! (`pinned_reserve_segment_size_mb`).
//!
//! The segment is allocated once, on the first allocation that misses the cache, and carved
//! front to back in 4 KiB-aligned pieces before the core asks the backend for fresh memory.
//! Carved blocks are cached like any other when freed, but never returned to the backend one by
//! one: PyTorch never releases them at all (and loses the carved space on `empty_cache`); here
//! `empty_cache` rewinds the bump pointer when no carved block is in use, so the space is
//! carved again.

use crate::size_class::RESERVE_ALIGN;

/// Bump state over `[base, base + size)`. Pure bookkeeping: the memory is the core's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReserveSegment {
    base: u64,
    size: u64,
    /// Offset of the first uncarved byte (a multiple of 4 KiB).
    bump: u64,
}

impl ReserveSegment {
    /// A segment of `size` bytes at `base` (page aligned), nothing carved.
    pub fn new(base: u64, size: u64) -> Self {
        ReserveSegment {
            base,
            size,
            bump: 0,
        }
    }

    /// Start address.
    pub fn base(&self) -> u64 {
        self.base
    }

    /// Size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Bytes carved so far (4 KiB multiples, including padding).
    pub fn carved(&self) -> u64 {
        self.bump
    }

    /// Carves `bytes` rounded up to 4 KiB; `None` when the rest of the segment is too small.
    pub fn carve(&mut self, bytes: u64) -> Option<u64> {
        let rounded = bytes.checked_next_multiple_of(RESERVE_ALIGN)?;
        let end = self.bump.checked_add(rounded).filter(|e| *e <= self.size)?;
        let addr = self.base + self.bump;
        self.bump = end;
        Some(addr)
    }

    /// True when `addr` lies inside the segment.
    pub fn owns(&self, addr: u64) -> bool {
        addr >= self.base && addr - self.base < self.size
    }

    /// Forgets every carved block (the caller guarantees none is in use).
    pub fn rewind(&mut self) {
        self.bump = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn carves_at_4k_alignment_until_full() {
        let mut r = ReserveSegment::new(0x10_0000, 16 * 4096);
        assert_eq!(r.carve(1), Some(0x10_0000));
        assert_eq!(
            r.carve(1024),
            Some(0x10_0000 + 4096),
            "a 1 KiB block still takes 4 KiB"
        );
        assert_eq!(r.carve(4097), Some(0x10_0000 + 2 * 4096));
        assert_eq!(r.carved(), 4 * 4096);
        assert_eq!(r.carve(13 * 4096), None, "only 12 pages left");
        assert_eq!(r.carve(12 * 4096), Some(0x10_0000 + 4 * 4096));
        assert_eq!(r.carve(1), None);
        assert!(r.owns(0x10_0000 + 16 * 4096 - 1) && !r.owns(0x10_0000 + 16 * 4096));
        assert_eq!(r.carve(u64::MAX), None);
        r.rewind();
        assert_eq!(r.carve(8192), Some(0x10_0000));
    }
}
