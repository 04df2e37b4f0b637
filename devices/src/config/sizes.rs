//! Size rounding and pool choice: PyTorch's `round_size`, `get_pool` and
//! `get_allocation_size`, as pure functions of a request and the config.
//!
//! - every request is rounded up to a multiple of 512 B (at least 512 B), or, where
//!   `roundup_power2_divisions` asks for it, to the next of N equal divisions of its power-of-two
//!   band;
//! - requests of at most 1 MiB go to the small pool, whose segments are 2 MiB;
//! - larger requests under 10 MiB get a `large_segment_size` (20 MiB) segment; 10 MiB and above
//!   get a segment of the request rounded up to 2 MiB.
//!
//! The sizes and bands themselves, which the config's parser needs too, are in
//! `size_classes.rs` (re-exported here).

use crate::config::AllocatorConfig;

pub use crate::config::size_classes::{
    is_small, roundup_band, LARGE_BUFFER, MIN_BLOCK_SIZE, MIN_LARGE_ALLOC, ROUNDUP_BANDS,
    ROUND_LARGE, SMALL_BUFFER, SMALL_SIZE,
};

/// Rounds a request as PyTorch's `round_size` does. `None` when the result would overflow.
pub fn round_size(size: u64, config: &AllocatorConfig) -> Option<u64> {
    if size < MIN_BLOCK_SIZE {
        return Some(MIN_BLOCK_SIZE);
    }
    let divisions = config.roundup_divisions_for(size);
    if divisions > 1 && size > MIN_BLOCK_SIZE * divisions {
        roundup_power2_next_division(size, divisions)
    } else {
        size.checked_next_multiple_of(MIN_BLOCK_SIZE)
    }
}

/// Rounds `size` up to the next of `divisions` equal steps between its power-of-two floor and
/// the next power of two (a power of two is returned unchanged).
fn roundup_power2_next_division(size: u64, divisions: u64) -> Option<u64> {
    if size.is_power_of_two() {
        return Some(size);
    }
    let floor = 1u64 << (63 - size.leading_zeros());
    // PyTorch divides by the largest power of two not above `divisions`.
    let step = floor >> (63 - divisions.leading_zeros());
    if step == 0 {
        return floor.checked_shl(1);
    }
    let rounded_down = size & !(step - 1);
    if rounded_down == size {
        Some(size)
    } else {
        rounded_down.checked_add(step)
    }
}

/// Size of the segment to allocate for a rounded request. `None` on overflow.
pub fn allocation_size(rounded: u64, config: &AllocatorConfig) -> Option<u64> {
    if rounded <= SMALL_SIZE {
        Some(SMALL_BUFFER)
    } else if rounded < MIN_LARGE_ALLOC {
        Some(config.large_segment_size)
    } else {
        rounded.checked_next_multiple_of(ROUND_LARGE)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KIB: u64 = 1 << 10;
    const MIB: u64 = 1 << 20;

    #[test]
    fn rounds_to_512_bytes() {
        let c = AllocatorConfig::default();
        assert_eq!(round_size(1, &c), Some(512));
        assert_eq!(round_size(512, &c), Some(512));
        assert_eq!(round_size(513, &c), Some(1024));
        assert_eq!(round_size(600 * KIB + 1, &c), Some(600 * KIB + 512));
        assert_eq!(round_size(u64::MAX - 100, &c), None);
    }

    #[test]
    fn power2_divisions_per_band() {
        // [64:8,256:4,1024:4,>:1]: bands below 64 MiB take 8, the 64 MiB band 8, 256 MiB 4;
        // PyTorch fills '>' from the last named band on, so the 1 GiB band ends up 1 too; the
        // bands it leaves unset (128 MiB, 512 MiB) round to 512 B.
        let c = AllocatorConfig::parse("roundup_power2_divisions:[64:8,256:4,1024:4,>:1]").unwrap();
        // 1 MiB + 1 in the first band: steps of 1 MiB / 8 = 128 KiB.
        assert_eq!(round_size(MIB + 1, &c), Some(MIB + 128 * KIB));
        // 70 MiB: floor 64 MiB, steps of 8 MiB -> 72 MiB.
        assert_eq!(round_size(70 * MIB, &c), Some(72 * MIB));
        // 130 MiB: band 7 unset -> plain 512 B rounding.
        assert_eq!(round_size(130 * MIB + 1, &c), Some(130 * MIB + 512));
        // 300 MiB: floor 256 MiB, steps of 64 MiB -> 320 MiB.
        assert_eq!(round_size(300 * MIB, &c), Some(320 * MIB));
        // 1.5 GiB + 1: band 10 was overwritten by '>:1' -> 512 B rounding.
        assert_eq!(round_size(1536 * MIB + 1, &c), Some(1536 * MIB + 512));
        // With the 1 GiB band named last-but-not-overwritten it rounds to quarters.
        let c2 = AllocatorConfig::parse("roundup_power2_divisions:[1024:4]").unwrap();
        assert_eq!(round_size(1536 * MIB + 1, &c2), Some(1792 * MIB));
        // 3 GiB + 1: '>' filled 1 -> 512 B rounding.
        assert_eq!(round_size(3072 * MIB + 1, &c), Some(3072 * MIB + 512));
        // Powers of two are kept.
        assert_eq!(round_size(256 * MIB, &c), Some(256 * MIB));
    }

    #[test]
    fn single_division_value_applies_everywhere() {
        let c = AllocatorConfig::parse("roundup_power2_divisions:4").unwrap();
        assert_eq!(round_size(5 * MIB, &c), Some(5 * MIB)); // floor 4 MiB, step 1 MiB
        assert_eq!(round_size(5 * MIB + 1, &c), Some(6 * MIB));
        assert_eq!(round_size(600 * KIB + 1, &c), Some(640 * KIB)); // floor 512 KiB, step 128 KiB
        assert_eq!(round_size(1500, &c), Some(1536)); // 1500 > 512*4: floor 1024, step 256
        assert_eq!(round_size(1000, &c), Some(1024)); // 1000 <= 2048: plain 512 B rounding
    }

    #[test]
    fn pools_and_segment_sizes() {
        let c = AllocatorConfig::default();
        assert!(is_small(600 * KIB));
        assert!(is_small(MIB));
        assert!(!is_small(MIB + 512));
        assert_eq!(allocation_size(600 * KIB, &c), Some(2 * MIB));
        assert_eq!(allocation_size(5 * MIB, &c), Some(20 * MIB));
        assert_eq!(allocation_size(10 * MIB - 512, &c), Some(20 * MIB));
        assert_eq!(allocation_size(10 * MIB, &c), Some(10 * MIB));
        assert_eq!(allocation_size(11 * MIB, &c), Some(12 * MIB));
        assert_eq!(allocation_size(1 << 30, &c), Some(1 << 30));
        let c = AllocatorConfig::parse("large_segment_size_mb:64").unwrap();
        assert_eq!(allocation_size(5 * MIB, &c), Some(64 * MIB));
    }

    #[test]
    fn bands() {
        assert_eq!(roundup_band(1), 0);
        assert_eq!(roundup_band(2 * MIB - 1), 0);
        assert_eq!(roundup_band(2 * MIB), 1);
        assert_eq!(roundup_band(64 * MIB), 6);
        assert_eq!(roundup_band(u64::MAX), ROUNDUP_BANDS - 1);
    }
}
