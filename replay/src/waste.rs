//! Where a replay's reserved memory that no allocation uses sits at the peak
//! (`replay --waste`): the measure that says which rule to change to bring fragmentation
//! down toward the floor.
//!
//! At the event where reserved memory first reaches its peak, the core's segments are read
//! and their free mapped bytes sorted by where they are: in small-pool segments, in ordinary
//! large segments, in expandable segments; between two live blocks of one segment (a hole
//! that only a neighbour's free can widen) or at a segment's edge; and by stream (each
//! stream's free memory serves only its own requests).

use std::collections::BTreeMap;

use gpualloc_devices::{BlockStateName, DeviceSnapshot};
use serde_json::{json, Value};

/// The page the floors round to: the small pool's, and the large pool's under the `gpualloc`
/// policy (`map_ahead.rs`).
pub const FLOOR_PAGE: u64 = gpualloc_devices::map_ahead::LARGE_POOL_PAGE;

/// Free memory at the peak, by place. Bytes throughout.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Waste {
    /// Index of the trace event after which reserved memory first reached its peak.
    pub event: u64,
    /// Reserved then (segments' mapped bytes).
    pub reserved: u64,
    /// Held by live or pending-free blocks then.
    pub active: u64,
    /// Asked for by the live blocks (below `active`: rounding).
    pub requested: u64,
    /// Free in small-pool segments.
    pub free_small: u64,
    /// Free in ordinary large-pool segments.
    pub free_large: u64,
    /// Free and mapped in expandable segments.
    pub free_expandable: u64,
    /// Free blocks with a live block on both sides in their segment.
    pub free_holes: u64,
    /// The largest of those holes, largest first (at most [`LARGEST_HOLES`]), each with the
    /// sizes of the live blocks on its two sides: what keeps it open.
    pub largest_holes: Vec<Hole>,
    /// Streams with free memory.
    pub streams_with_free: u64,
    /// The most free memory one stream has.
    pub most_free_on_a_stream: u64,
    /// The floor: the run's peak allocated bytes rounded up to the 2 MiB page (what a perfect
    /// layout would reserve at the peak). Set at the end of the run ([`Waste::set_floors`]).
    pub floor: u64,
    /// The floor when small and large blocks never share a page and no page moves between the
    /// two pools: each pool's own peak allocated bytes rounded up to the page, summed. In a
    /// run that releases no page (no `empty_cache`), each pool holds at least its own peak's
    /// pages at the end, so no such layout reserves less; where this is above the 2% target,
    /// only pages shared or moved between the pools can reach it.
    pub floor_pools_apart: u64,
}

/// How many holes [`Waste::largest_holes`] lists.
pub const LARGEST_HOLES: usize = 8;

/// A free block between two live blocks of one segment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Hole {
    /// Its size.
    pub bytes: u64,
    /// The live block before it.
    pub before: u64,
    /// The live block after it.
    pub after: u64,
}

impl Waste {
    /// Free bytes at the peak (`reserved − active`).
    pub fn free(&self) -> u64 {
        self.free_small + self.free_large + self.free_expandable
    }

    /// The breakdown of `snap`, taken after event `event`.
    pub fn of(snap: &DeviceSnapshot, event: u64) -> Waste {
        let mut w = Waste {
            event,
            ..Waste::default()
        };
        let mut by_stream: BTreeMap<u64, u64> = BTreeMap::new();
        for seg in &snap.segments {
            let blocks: Vec<_> = seg.blocks.iter().filter(|b| b.mapped).collect();
            for (i, b) in blocks.iter().enumerate() {
                w.reserved += b.size;
                if b.state != BlockStateName::Inactive {
                    w.active += b.size;
                    w.requested += b.requested_size;
                    continue;
                }
                if seg.is_small {
                    w.free_small += b.size;
                } else if seg.is_expandable {
                    w.free_expandable += b.size;
                } else {
                    w.free_large += b.size;
                }
                let live = |j: Option<usize>| {
                    j.and_then(|j| blocks.get(j))
                        .filter(|n| n.state != BlockStateName::Inactive)
                        .map(|n| n.size)
                };
                if let (Some(before), Some(after)) = (live(i.checked_sub(1)), live(Some(i + 1))) {
                    w.free_holes += b.size;
                    w.largest_holes.push(Hole {
                        bytes: b.size,
                        before,
                        after,
                    });
                }
                *by_stream.entry(seg.stream).or_default() += b.size;
            }
        }
        w.largest_holes.sort_by_key(|h| std::cmp::Reverse(h.bytes));
        w.largest_holes.truncate(LARGEST_HOLES);
        w.streams_with_free = by_stream.len() as u64;
        w.most_free_on_a_stream = by_stream.values().copied().max().unwrap_or(0);
        w
    }

    /// Sets the two floors from the run's peak allocated bytes: all blocks, the small pool's,
    /// the large pool's.
    pub fn set_floors(&mut self, peak_all: u64, peak_small: u64, peak_large: u64) {
        let page = |b: u64| b.div_ceil(FLOOR_PAGE) * FLOOR_PAGE;
        self.floor = page(peak_all);
        self.floor_pools_apart = page(peak_small) + page(peak_large);
    }

    /// As JSON (MiB with two decimals are for the table; JSON keeps bytes).
    pub fn to_json(&self) -> Value {
        json!({
            "event": self.event,
            "reserved_bytes": self.reserved,
            "active_bytes": self.active,
            "requested_bytes": self.requested,
            "free_small_bytes": self.free_small,
            "free_large_bytes": self.free_large,
            "free_expandable_bytes": self.free_expandable,
            "free_hole_bytes": self.free_holes,
            "largest_holes": self.largest_holes.iter().map(|h| json!({
                "bytes": h.bytes,
                "before_bytes": h.before,
                "after_bytes": h.after,
            })).collect::<Vec<_>>(),
            "streams_with_free": self.streams_with_free,
            "most_free_on_a_stream_bytes": self.most_free_on_a_stream,
            "floor_bytes": self.floor,
            "floor_pools_apart_bytes": self.floor_pools_apart,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpualloc_devices::{BlockInfo, SegmentInfo};

    fn block(address: u64, size: u64, live: bool) -> BlockInfo {
        BlockInfo {
            address,
            size,
            requested_size: if live { size - 1 } else { 0 },
            state: if live {
                BlockStateName::ActiveAllocated
            } else {
                BlockStateName::Inactive
            },
            mapped: true,
            frames: None,
        }
    }

    fn segment(stream: u64, small: bool, expandable: bool, blocks: Vec<BlockInfo>) -> SegmentInfo {
        SegmentInfo {
            device: 0,
            address: blocks[0].address,
            total_size: blocks.iter().map(|b| b.size).sum(),
            allocated_size: 0,
            active_size: 0,
            requested_size: 0,
            stream,
            is_small: small,
            pool_id: (0, 0),
            is_expandable: expandable,
            blocks,
        }
    }

    #[test]
    fn free_memory_is_sorted_by_pool_kind_hole_and_stream() {
        let mut unmapped = block(9000, 500, false);
        unmapped.mapped = false;
        let snap = DeviceSnapshot {
            segments: vec![
                // small: live 100, free 50 (edge)
                segment(
                    1,
                    true,
                    false,
                    vec![block(0, 100, true), block(100, 50, false)],
                ),
                // large ordinary: live, hole 200, live, free 300 at the edge
                segment(
                    1,
                    false,
                    false,
                    vec![
                        block(1000, 400, true),
                        block(1400, 200, false),
                        block(1600, 400, true),
                        block(2000, 300, false),
                    ],
                ),
                // expandable on stream 2: free 700 then live, and unmapped pages
                segment(
                    2,
                    false,
                    true,
                    vec![block(8000, 700, false), block(8700, 300, true), unmapped],
                ),
            ],
            ..DeviceSnapshot::default()
        };
        let w = Waste::of(&snap, 42);
        assert_eq!(w.event, 42);
        assert_eq!(w.reserved, 100 + 50 + 400 + 200 + 400 + 300 + 700 + 300);
        assert_eq!(w.active, 100 + 400 + 400 + 300);
        assert_eq!(w.requested, w.active - 4);
        assert_eq!(
            (w.free_small, w.free_large, w.free_expandable),
            (50, 500, 700)
        );
        assert_eq!(w.free_holes, 200);
        assert_eq!(
            w.largest_holes,
            [Hole {
                bytes: 200,
                before: 400,
                after: 400
            }]
        );
        assert_eq!(w.to_json()["largest_holes"][0]["before_bytes"], 400);
        assert_eq!(w.free(), w.reserved - w.active);
        assert_eq!((w.streams_with_free, w.most_free_on_a_stream), (2, 700));
        assert_eq!(w.to_json()["free_hole_bytes"], 200);
    }

    #[test]
    fn the_floors_round_each_peak_up_to_the_page() {
        let mib = 1u64 << 20;
        let mut w = Waste::default();
        // cnn-counterfactual-small's peaks: 103.26 MiB in all, 6.51 small, 97.75 large.
        w.set_floors(108_275_712, 6_826_496, 102_498_304);
        assert_eq!((w.floor, w.floor_pools_apart), (104 * mib, 106 * mib));
        // Exact pages stay as they are; nothing allocated takes no page.
        w.set_floors(4 * mib, 0, 4 * mib);
        assert_eq!((w.floor, w.floor_pools_apart), (4 * mib, 4 * mib));
        assert_eq!(w.to_json()["floor_pools_apart_bytes"], 4 * mib);
    }

    #[test]
    fn the_largest_holes_are_listed_largest_first_and_at_most_eight() {
        // live 10, then ten holes of 1..=10 bytes, each followed by a live block of 20 + k.
        let mut blocks = vec![block(0, 10, true)];
        let mut at = 10;
        for k in 1..=10u64 {
            blocks.push(block(at, k, false));
            at += k;
            blocks.push(block(at, 20 + k, true));
            at += 20 + k;
        }
        // A free block at the edge is no hole.
        blocks.push(block(at, 1000, false));
        let snap = DeviceSnapshot {
            segments: vec![segment(1, false, true, blocks)],
            ..DeviceSnapshot::default()
        };
        let w = Waste::of(&snap, 0);
        assert_eq!(w.free_holes, 55);
        let sizes: Vec<u64> = w.largest_holes.iter().map(|h| h.bytes).collect();
        assert_eq!(sizes, [10, 9, 8, 7, 6, 5, 4, 3]);
        assert_eq!(
            w.largest_holes[0],
            Hole {
                bytes: 10,
                before: 29,
                after: 30
            }
        );
    }
}
