//! The live allocations of a device, as one component the core keeps: each allocated block
//! by its address, and those described for export to another process (a named pool holding
//! one cannot sleep). A leaf; an allocation leaves both at its free.

use gpualloc_runtime::addr_map::{AddrMap, AddrSet};

use crate::blocks::block::BlockId;

/// The device's live allocations (see the module docs).
#[derive(Default)]
pub(crate) struct LiveBlocks {
    by_addr: AddrMap<BlockId>,
    /// Addresses of live allocations marked exported (`DeviceCore::mark_exported`).
    exported: AddrSet,
}

impl LiveBlocks {
    pub(crate) fn insert(&mut self, addr: u64, id: BlockId) {
        self.by_addr.insert(addr, id);
    }

    /// Takes the allocation at `addr` out (its export mark too), if it is live.
    pub(crate) fn remove(&mut self, addr: u64) -> Option<BlockId> {
        let id = self.by_addr.remove(&addr)?;
        // Checked first: the hit path's free pays one load when nothing is exported.
        if !self.exported.is_empty() {
            self.exported.remove(&addr);
        }
        Some(id)
    }

    pub(crate) fn get(&self, addr: u64) -> Option<BlockId> {
        self.by_addr.get(&addr).copied()
    }

    pub(crate) fn contains(&self, addr: u64) -> bool {
        self.by_addr.contains_key(&addr)
    }

    pub(crate) fn len(&self) -> usize {
        self.by_addr.len()
    }

    /// Forgets every allocation (a shutdown).
    pub(crate) fn clear(&mut self) {
        self.by_addr.clear();
        self.exported.clear();
    }

    /// Marks live allocation `addr` exported; false (nothing marked) if it is not live.
    pub(crate) fn mark_exported(&mut self, addr: u64) -> bool {
        let live = self.contains(addr);
        if live {
            self.exported.insert(addr);
        }
        live
    }

    /// Takes the mark off `addr`: `None` if it is not live, else whether it was marked.
    pub(crate) fn unmark_exported(&mut self, addr: u64) -> Option<bool> {
        self.contains(addr).then(|| self.exported.remove(&addr))
    }

    /// The blocks of the live allocations marked exported.
    pub(crate) fn exported(&self) -> impl Iterator<Item = BlockId> + '_ {
        self.exported.iter().filter_map(|a| self.get(*a))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::blocks::block::{Block, BlockArena};
    use gpualloc_runtime::{DeviceId, StreamHandle};

    #[test]
    fn an_export_mark_lives_as_long_as_its_allocation() {
        let mut arena = BlockArena::default();
        let s = StreamHandle {
            device: DeviceId(0),
            raw: 1,
        };
        let (a, b) = (
            arena.insert(Block::whole_segment(0x1000, 512, s, 0)),
            arena.insert(Block::whole_segment(0x2000, 512, s, 0)),
        );
        let mut live = LiveBlocks::default();
        assert!(!live.mark_exported(0x1000), "not live yet");
        live.insert(0x1000, a);
        live.insert(0x2000, b);
        assert!(live.mark_exported(0x1000));
        assert_eq!(live.exported().collect::<Vec<_>>(), [a]);
        assert_eq!(live.unmark_exported(0x2000), Some(false));
        assert_eq!(live.unmark_exported(0x3000), None);
        assert_eq!(live.remove(0x1000), Some(a));
        assert_eq!(live.exported().count(), 0);
        // Live again at the same address: not marked.
        live.insert(0x1000, a);
        assert_eq!(live.exported().count(), 0);
        assert_eq!((live.len(), live.get(0x2000)), (2, Some(b)));
        live.clear();
        assert!(!live.contains(0x1000) && live.remove(0x2000).is_none());
    }
}
