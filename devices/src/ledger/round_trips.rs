//! [`RoundTrips`]: frees immediately followed by a reallocation of the same block, done
//! beside the core, to be added to its cumulative statistics.
//!
//! The facade's thread cache hands a block a thread just freed straight back to that thread's
//! next request of the same size on the same stream, without the core. Such a round trip
//! leaves every current value where it was (the block is allocated before and after, for the
//! same requested size), so peaks are untouched too; only the running totals of allocations
//! and frees grow. The cache tallies its round trips here and the core adds them with
//! [`DeviceCore::account_round_trips`] before anyone reads its statistics. The block is
//! neither merged nor split again, so `inactive_split` totals do not move: they count what
//! the allocator did, and it did not split anything.

use crate::core::{Allocation, DeviceCore};
use crate::ledger::stats::for_pool;

/// A tally of round trips, by pool kind (0: small, 1: large). See the module docs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RoundTrips {
    count: [u64; 2],
    bytes: [u64; 2],
    requested: [u64; 2],
    oversize: u64,
}

impl RoundTrips {
    /// Counts one round trip of the live allocation `a` (freed and handed out again as is).
    pub fn record(&mut self, a: &Allocation) {
        let k = usize::from(!a.small_pool);
        self.count[k] += 1;
        self.bytes[k] += a.block_size;
        self.requested[k] += a.size;
        self.oversize += u64::from(a.oversize);
    }

    /// Adds another tally to this one.
    pub fn merge(&mut self, other: &RoundTrips) {
        for k in 0..2 {
            self.count[k] += other.count[k];
            self.bytes[k] += other.bytes[k];
            self.requested[k] += other.requested[k];
        }
        self.oversize += other.oversize;
    }

    /// Round trips counted.
    pub fn len(&self) -> u64 {
        self.count[0] + self.count[1]
    }

    /// True when nothing was counted.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl DeviceCore {
    /// Adds round trips done beside the core to the cumulative statistics: per round trip,
    /// one allocation and one free of its block in `allocation`, `allocated_bytes`,
    /// `active`, `active_bytes`, `requested_bytes` and (for oversize blocks)
    /// `oversize_allocations`. Current values and peaks are unchanged.
    pub fn account_round_trips(&mut self, trips: &RoundTrips) {
        let stats = &mut self.stats;
        for (k, small) in [(0, true), (1, false)] {
            let (n, bytes, requested) = (trips.count[k], trips.bytes[k], trips.requested[k]);
            if n == 0 {
                continue;
            }
            for_pool(&mut stats.allocation, small, |s| s.round_trip(n));
            for_pool(&mut stats.active, small, |s| s.round_trip(n));
            for_pool(&mut stats.allocated_bytes, small, |s| s.round_trip(bytes));
            for_pool(&mut stats.active_bytes, small, |s| s.round_trip(bytes));
            for_pool(&mut stats.requested_bytes, small, |s| {
                s.round_trip(requested)
            });
        }
        stats.oversize_allocations.round_trip(trips.oversize);
    }
}
