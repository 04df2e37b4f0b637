//! Block sizes: how a request is rounded and which cached blocks may serve it.
//!
//! Below the rounding threshold a request is rounded to the next power of two, and only a
//! block of exactly that size serves it: the power-of-two size classes of PyTorch's
//! `CachingHostAllocator` (1 KiB stays 1 KiB, 1025 B becomes 2 KiB). Blocks are never split.
//!
//! Above the threshold (`pinned_max_round_threshold_mb`) a request is rounded up to a multiple
//! of [`FINE_GRANULARITY`] (2 MiB) instead, so a 1.1 GiB request holds at most 1.1 GiB + 2 MiB
//! rather than 2 GiB. A cached block serves it if it is at most [`FINE_SLACK_DIVISOR`]⁻¹
//! (1/16) larger than the rounded request: slightly different large sizes still reuse each
//! other, and no request holds more than 1/16 over its rounded size.

use crate::error::{HostError, Result};

/// Granularity of sizes above the rounding threshold: 2 MiB, the huge-page size, so large
/// buffers stay huge-page friendly.
pub const FINE_GRANULARITY: u64 = 2 << 20;

/// A cached block of size `b` serves a fine-rounded request `r` when `r <= b <= r + r / 16`.
pub const FINE_SLACK_DIVISOR: u64 = 16;

/// Alignment (and carving unit) of blocks inside the reserve segment.
pub const RESERVE_ALIGN: u64 = 4096;

/// How a request is served: the size of a fresh block for it, and the largest cached block
/// that may serve it instead.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SizeClass {
    /// Size of a fresh block for the request.
    pub rounded: u64,
    /// Largest cached block size that may serve it (equal to `rounded` below the threshold).
    pub max_fit: u64,
}

/// The size class of a request of `size` bytes, given the rounding threshold in bytes
/// (`None`: power-of-two classes for every size).
pub fn size_class(size: u64, threshold: Option<u64>) -> Result<SizeClass> {
    if size == 0 {
        return Err(HostError::ZeroSize);
    }
    let fine = threshold.is_some_and(|t| size > t);
    let rounded = if fine {
        size.checked_next_multiple_of(FINE_GRANULARITY)
    } else {
        size.checked_next_power_of_two()
    };
    let rounded = rounded
        .filter(|r| usize::try_from(*r).is_ok() && *r <= i64::MAX as u64)
        .ok_or(HostError::TooLarge { requested: size })?;
    let max_fit = if fine {
        rounded + rounded / FINE_SLACK_DIVISOR
    } else {
        rounded
    };
    Ok(SizeClass { rounded, max_fit })
}

#[cfg(test)]
mod tests {
    use super::*;

    const KIB: u64 = 1 << 10;
    const MIB: u64 = 1 << 20;
    const GIB: u64 = 1 << 30;

    #[test]
    fn power_of_two_classes_below_the_threshold() {
        let t = Some(64 * MIB);
        assert_eq!(
            size_class(KIB, t).unwrap(),
            SizeClass {
                rounded: KIB,
                max_fit: KIB
            }
        );
        assert_eq!(size_class(KIB + 1, t).unwrap().rounded, 2 * KIB);
        assert_eq!(size_class(1, t).unwrap().rounded, 1);
        assert_eq!(size_class(3, t).unwrap().rounded, 4);
        assert_eq!(
            size_class(64 * MIB, t).unwrap().rounded,
            64 * MIB,
            "at the threshold"
        );
        assert_eq!(size_class(40 * MIB, None).unwrap().max_fit, 64 * MIB);
    }

    #[test]
    fn fine_rounding_above_the_threshold_holds_at_most_1_1x() {
        let request = GIB + GIB / 10; // 1.1 GiB
        let fine = size_class(request, Some(64 * MIB)).unwrap();
        assert_eq!(fine.rounded % FINE_GRANULARITY, 0);
        assert!(fine.rounded >= request && fine.rounded - request < FINE_GRANULARITY);
        assert!(fine.rounded as f64 <= 1.1 * request as f64 + FINE_GRANULARITY as f64);
        assert!((fine.rounded as f64) / (request as f64) < 1.002);
        assert_eq!(fine.max_fit, fine.rounded + fine.rounded / 16);
        let pow2 = size_class(request, None).unwrap();
        assert_eq!(pow2.rounded, 2 * GIB, "PyTorch's behaviour doubles it");
        assert_eq!(
            size_class(64 * MIB + 1, Some(64 * MIB)).unwrap().rounded,
            66 * MIB
        );
    }

    #[test]
    fn bad_sizes_are_typed() {
        assert_eq!(size_class(0, None), Err(HostError::ZeroSize));
        let huge = u64::MAX - 100;
        assert_eq!(
            size_class(huge, None),
            Err(HostError::TooLarge { requested: huge })
        );
        assert_eq!(
            size_class(huge, Some(MIB)),
            Err(HostError::TooLarge { requested: huge })
        );
        assert!(size_class((1 << 63) + 1, None).is_err());
    }
}
