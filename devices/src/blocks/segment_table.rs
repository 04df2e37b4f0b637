//! The segments of a device, as one component the core keeps: what the core remembers of each
//! segment (its size, block pool and stream) by base address, an ordinary segment and an
//! expandable segment's whole reservation alike. A leaf: booking a segment's bytes and
//! statistics is the core's (`core.rs`'s `book_segment`, the ledger's books).

use std::collections::{btree_map, BTreeMap};

use gpualloc_runtime::StreamHandle;

/// What the core remembers of a segment.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SegmentMeta {
    pub size: u64,
    pub pool: usize,
    pub stream: StreamHandle,
}

/// The device's segments by base address (see the module docs).
#[derive(Default)]
pub(crate) struct SegmentTable {
    by_base: BTreeMap<u64, SegmentMeta>,
}

impl SegmentTable {
    pub(crate) fn get(&self, base: u64) -> Option<&SegmentMeta> {
        self.by_base.get(&base)
    }

    pub(crate) fn get_mut(&mut self, base: u64) -> Option<&mut SegmentMeta> {
        self.by_base.get_mut(&base)
    }

    /// The block pool of the segment at `base`.
    pub(crate) fn pool_of(&self, base: u64) -> Option<usize> {
        self.get(base).map(|m| m.pool)
    }

    /// The segment holding `addr`, if any: the one with the highest base at or below it that
    /// reaches past it.
    pub(crate) fn holding(&self, addr: u64) -> Option<(u64, &SegmentMeta)> {
        self.by_base
            .range(..=addr)
            .next_back()
            .filter(|(base, meta)| addr < *base + meta.size)
            .map(|(&base, meta)| (base, meta))
    }

    pub(crate) fn insert(&mut self, base: u64, meta: SegmentMeta) {
        self.by_base.insert(base, meta);
    }

    pub(crate) fn remove(&mut self, base: u64) -> Option<SegmentMeta> {
        self.by_base.remove(&base)
    }

    /// True when a segment is filed under `stream`.
    pub(crate) fn names_stream(&self, stream: StreamHandle) -> bool {
        self.by_base.values().any(|m| m.stream == stream)
    }

    /// The bases, in order.
    pub(crate) fn bases(&self) -> Vec<u64> {
        self.by_base.keys().copied().collect()
    }

    pub(crate) fn iter(&self) -> btree_map::Iter<'_, u64, SegmentMeta> {
        self.by_base.iter()
    }

    pub(crate) fn values(&self) -> btree_map::Values<'_, u64, SegmentMeta> {
        self.by_base.values()
    }

    pub(crate) fn len(&self) -> usize {
        self.by_base.len()
    }

    /// Forgets every segment (a shutdown).
    pub(crate) fn clear(&mut self) {
        self.by_base.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpualloc_runtime::DeviceId;

    #[test]
    fn the_segment_holding_an_address_is_the_one_that_reaches_past_it() {
        let s = |raw| StreamHandle {
            device: DeviceId(0),
            raw,
        };
        let mut table = SegmentTable::default();
        table.insert(
            0x1000,
            SegmentMeta {
                size: 0x1000,
                pool: 1,
                stream: s(7),
            },
        );
        table.insert(
            0x4000,
            SegmentMeta {
                size: 0x800,
                pool: 0,
                stream: s(8),
            },
        );
        assert_eq!(table.holding(0x1fff).map(|(b, _)| b), Some(0x1000));
        assert!(
            table.holding(0x2000).is_none(),
            "past the first, before the second"
        );
        assert!(table.holding(0x0fff).is_none());
        assert_eq!(
            table.holding(0x4000).map(|(b, m)| (b, m.pool)),
            Some((0x4000, 0))
        );
        assert!(table.holding(0x4800).is_none());
        assert_eq!(table.pool_of(0x1000), Some(1));
        assert_eq!(table.pool_of(0x1800), None, "only bases are looked up");
        assert!(table.names_stream(s(8)) && !table.names_stream(s(9)));
        assert_eq!(table.bases(), [0x1000, 0x4000]);
        assert!(table.remove(0x1000).is_some() && table.remove(0x1000).is_none());
        assert_eq!(table.len(), 1);
        table.clear();
        assert_eq!((table.len(), table.values().count()), (0, 0));
    }
}
