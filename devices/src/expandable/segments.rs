//! The expandable segments of a device, as one component the core keeps: the segments by
//! base address, the off-core operations under way on each (a growth mapping pages, a release
//! unmapping them), the reservations a shutdown left to the last of those operations, and the
//! peer devices given access to every page mapped. A leaf: mapping, booking and releasing
//! pages is `impl DeviceCore` in `expandable/mod.rs` and its neighbours.

use std::collections::{btree_map, BTreeMap};

use gpualloc_runtime::{DeviceId, DevicePtr};

use crate::expandable::segment::ExpandableSegment;

/// The device's expandable segments (see the module docs).
#[derive(Default)]
pub(crate) struct ExpandableSegments {
    by_base: BTreeMap<u64, ExpandableSegment>,
    /// Segments with operations off the core under way, and how many.
    busy: BTreeMap<u64, u32>,
    /// Reservations (base, bytes) whose pages a shutdown released while operations on them
    /// were under way: the last of those operations frees the reservation.
    orphaned: BTreeMap<u64, u64>,
    /// Devices given access to every page mapped (`DeviceCore::add_peer`).
    peers: Vec<DeviceId>,
}

impl ExpandableSegments {
    pub(crate) fn get(&self, base: u64) -> Option<&ExpandableSegment> {
        self.by_base.get(&base)
    }

    pub(crate) fn get_mut(&mut self, base: u64) -> Option<&mut ExpandableSegment> {
        self.by_base.get_mut(&base)
    }

    pub(crate) fn contains(&self, base: u64) -> bool {
        self.by_base.contains_key(&base)
    }

    /// The segment with the highest base at or below `addr` (the one holding `addr`, if any
    /// does: the caller checks its end).
    pub(crate) fn at_or_below(&self, addr: u64) -> Option<(u64, &ExpandableSegment)> {
        self.by_base
            .range(..=addr)
            .next_back()
            .map(|(&base, es)| (base, es))
    }

    pub(crate) fn insert(&mut self, base: u64, es: ExpandableSegment) {
        self.by_base.insert(base, es);
    }

    pub(crate) fn remove(&mut self, base: u64) -> Option<ExpandableSegment> {
        self.by_base.remove(&base)
    }

    /// The bases, in order.
    pub(crate) fn bases(&self) -> Vec<u64> {
        self.by_base.keys().copied().collect()
    }

    pub(crate) fn iter(&self) -> btree_map::Iter<'_, u64, ExpandableSegment> {
        self.by_base.iter()
    }

    pub(crate) fn values(&self) -> btree_map::Values<'_, u64, ExpandableSegment> {
        self.by_base.values()
    }

    /// An off-core operation on segment `seg` starts: its reservation stays until it ends.
    pub(crate) fn begin_work(&mut self, seg: u64) {
        *self.busy.entry(seg).or_insert(0) += 1;
    }

    /// An off-core operation on `seg` ended; the reservation to free if a shutdown orphaned
    /// it and this was the last.
    pub(crate) fn end_work(&mut self, seg: u64) -> Option<(DevicePtr, u64)> {
        let left = self.busy.get_mut(&seg).map(|n| {
            *n -= 1;
            *n
        });
        if left == Some(0) {
            self.busy.remove(&seg);
            return self
                .orphaned
                .remove(&seg)
                .map(|size| (DevicePtr(seg), size));
        }
        None
    }

    /// True while an off-core operation on `seg` is under way.
    pub(crate) fn is_busy(&self, seg: u64) -> bool {
        self.busy.contains_key(&seg)
    }

    /// The reservation of `seg` (`size` bytes) is left to the last operation under way on it.
    pub(crate) fn orphan(&mut self, seg: u64, size: u64) {
        self.orphaned.insert(seg, size);
    }

    /// The devices given access to every page mapped.
    pub(crate) fn peers(&self) -> &[DeviceId] {
        &self.peers
    }

    /// Adds `peer`; false (nothing changes) if it is there already.
    pub(crate) fn add_peer(&mut self, peer: DeviceId) -> bool {
        if self.peers.contains(&peer) {
            return false;
        }
        self.peers.push(peer);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_last_operation_on_an_orphaned_segment_frees_its_reservation() {
        let mut segs = ExpandableSegments::default();
        segs.begin_work(0x1000);
        segs.begin_work(0x1000);
        segs.begin_work(0x9000);
        assert!(segs.is_busy(0x1000));
        segs.orphan(0x1000, 64);
        assert_eq!(
            segs.end_work(0x1000),
            None,
            "one operation is still under way"
        );
        assert_eq!(segs.end_work(0x1000), Some((DevicePtr(0x1000), 64)));
        assert!(!segs.is_busy(0x1000));
        assert_eq!(segs.end_work(0x9000), None, "not orphaned: nothing to free");
        assert_eq!(segs.end_work(0x9000), None, "no operation under way");
        assert!(segs.add_peer(DeviceId(1)));
        assert!(!segs.add_peer(DeviceId(1)));
        assert_eq!(segs.peers(), [DeviceId(1)]);
    }
}
