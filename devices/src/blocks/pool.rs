//! A block pool: the free blocks of one size class (small or large) of one owner (the default
//! pools, or a private memory pool), ordered as PyTorch orders them.
//!
//! The order is (stream, size, address): a lookup for (stream, size) finds the smallest free
//! block of that stream that fits, and among equal sizes the lowest address. That tie-break is
//! part of PyTorch's behaviour and replays depend on it.

use std::collections::btree_map::Range;
use std::collections::BTreeMap;
use std::ops::RangeBounds;

use crate::blocks::block::{Block, BlockId};

/// Sort key of a free block.
pub(crate) type FreeKey = (u64, u64, u64);

/// Who owns a pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PoolOwner {
    /// The device's default pools.
    Default,
    /// A private memory pool (`MemPool`).
    Private(u64),
}

/// Free blocks of one pool. The trees are the pool's own: blocks go in and out by the file
/// and take calls below, so every key is built here.
pub(crate) struct BlockPool {
    free: BTreeMap<FreeKey, BlockId>,
    /// Unmapped ranges of expandable segments, ordered by (stream, address): see
    /// [`unmapped_key`].
    unmapped: BTreeMap<FreeKey, BlockId>,
    pub is_small: bool,
    pub owner: PoolOwner,
    /// Calls of `get_free_block` on this pool (garbage collection ages blocks by it).
    pub get_free_block_calls: u64,
}

impl BlockPool {
    pub fn new(is_small: bool, owner: PoolOwner) -> Self {
        BlockPool {
            free: BTreeMap::new(),
            unmapped: BTreeMap::new(),
            is_small,
            owner,
            get_free_block_calls: 0,
        }
    }

    /// Files free mapped block `b` (id `id`) under its key: (stream, size, address) as it is
    /// now. Every change of a filed block's stream, size or address is an unfile before and a
    /// file after, so the keys are computed here only.
    pub fn file_free(&mut self, b: &Block, id: BlockId) {
        self.free
            .insert(key(b.stream().raw, b.size(), b.addr()), id);
    }

    /// Takes free mapped block `b` out of the pool; its id if it was filed.
    pub fn unfile_free(&mut self, b: &Block) -> Option<BlockId> {
        self.free.remove(&key(b.stream().raw, b.size(), b.addr()))
    }

    /// Files unmapped block `b` (id `id`) under its key ([`unmapped_key`]).
    pub fn file_unmapped(&mut self, b: &Block, id: BlockId) {
        self.unmapped
            .insert(unmapped_key(b.stream().raw, b.addr(), b.size()), id);
    }

    /// Takes unmapped block `b` out of the pool; its id if it was filed.
    pub fn unfile_unmapped(&mut self, b: &Block) -> Option<BlockId> {
        self.unmapped
            .remove(&unmapped_key(b.stream().raw, b.addr(), b.size()))
    }

    /// Takes the free mapped block filed under `k` out of the pool; its id if there was one.
    #[inline]
    pub fn take_free(&mut self, k: &FreeKey) -> Option<BlockId> {
        self.free.remove(k)
    }

    /// The free mapped block filed under `k`, left in the pool.
    pub fn free_at(&self, k: &FreeKey) -> Option<BlockId> {
        self.free.get(k).copied()
    }

    /// The free mapped blocks with keys in `range`, in key order.
    #[inline]
    pub fn free_range<R: RangeBounds<FreeKey>>(&self, range: R) -> Range<'_, FreeKey, BlockId> {
        self.free.range(range)
    }

    /// Every free mapped block, in key order.
    pub fn free_ids(&self) -> impl Iterator<Item = BlockId> + '_ {
        self.free.values().copied()
    }

    /// The unmapped blocks with keys in `range`, in key order.
    pub fn unmapped_range<R: RangeBounds<FreeKey>>(&self, range: R) -> Range<'_, FreeKey, BlockId> {
        self.unmapped.range(range)
    }

    /// Whether block `b` (id `id`) is filed here under its key as it is now: in the free
    /// tree if it is mapped, else in the unmapped one.
    pub fn holds(&self, b: &Block, id: BlockId) -> bool {
        let filed = if b.mapped() {
            self.free.get(&key(b.stream().raw, b.size(), b.addr()))
        } else {
            self.unmapped
                .get(&unmapped_key(b.stream().raw, b.addr(), b.size()))
        };
        filed == Some(&id)
    }

    /// Every unmapped block, in key order.
    pub fn unmapped_ids(&self) -> impl Iterator<Item = BlockId> + '_ {
        self.unmapped.values().copied()
    }

    /// Blocks filed, mapped and unmapped.
    pub fn len(&self) -> usize {
        self.free.len() + self.unmapped.len()
    }

    /// Forgets every block (the arena is cleared with it: a shutdown).
    pub fn clear(&mut self) {
        self.free.clear();
        self.unmapped.clear();
    }

    /// First free block of `stream` with size ≥ `size` (lowest address among equals).
    pub fn lower_bound(&self, stream: u64, size: u64) -> Option<(FreeKey, BlockId)> {
        self.free
            .range((stream, size, 0)..)
            .next()
            .map(|(k, id)| (*k, *id))
    }
}

/// The key an unmapped block is stored under: (stream, address, size), so blocks of one
/// stream are visited in address order (PyTorch's `BlockComparatorAddress`).
fn unmapped_key(stream: u64, addr: u64, size: u64) -> FreeKey {
    (stream, addr, size)
}

/// The key a free block is stored under.
pub(crate) fn key(stream: u64, size: u64, addr: u64) -> FreeKey {
    (stream, size, addr)
}

#[cfg(test)]
mod tests {
    use gpualloc_runtime::{DeviceId, StreamHandle};

    use super::*;

    fn block(raw: u64, addr: u64, size: u64, mapped: bool) -> Block {
        let stream = StreamHandle {
            device: DeviceId(0),
            raw,
        };
        if mapped {
            Block::whole_segment(addr, size, stream, 1)
        } else {
            Block::reserved_range(addr, size, stream, 1)
        }
    }

    #[test]
    fn a_block_is_held_only_under_its_key_as_it_is_now() {
        let mut pool = BlockPool::new(false, PoolOwner::Default);
        let (free, unmapped) = (
            block(7, 0x1000, 0x400, true),
            block(7, 0x2000, 0x800, false),
        );
        assert!(!pool.holds(&free, 3));
        pool.file_free(&free, 3);
        pool.file_unmapped(&unmapped, 4);
        assert!(pool.holds(&free, 3));
        assert!(pool.holds(&unmapped, 4));
        assert!(!pool.holds(&free, 4), "another id under the key");
        let grown = block(7, 0x1000, 0x600, true);
        assert!(!pool.holds(&grown, 3), "the size changed without a refile");
        let now_unmapped = block(7, 0x1000, 0x400, false);
        assert!(!pool.holds(&now_unmapped, 3), "looked up in the other tree");
        assert_eq!(pool.len(), 2);
        assert_eq!(pool.free_ids().collect::<Vec<_>>(), [3]);
        assert_eq!(pool.unmapped_ids().collect::<Vec<_>>(), [4]);
        assert_eq!(pool.take_free(&key(7, 0x400, 0x1000)), Some(3));
        assert!(!pool.holds(&free, 3));
    }

    #[test]
    fn clear_forgets_both_trees() {
        let mut pool = BlockPool::new(true, PoolOwner::Default);
        pool.file_free(&block(1, 0x1000, 0x200, true), 0);
        pool.file_unmapped(&block(1, 0x3000, 0x200, false), 1);
        pool.clear();
        assert_eq!(pool.len(), 0);
        assert_eq!(pool.free_ids().count() + pool.unmapped_ids().count(), 0);
        assert_eq!(pool.lower_bound(1, 0), None);
    }
}
