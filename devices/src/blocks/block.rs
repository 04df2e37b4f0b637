//! Blocks and the arena that owns them.
//!
//! A block is a contiguous range of one segment: allocated to a user, waiting for stream
//! events after a free (pending), or free (cached in a pool). Blocks of a segment form a
//! doubly linked list in address order (`prev`/`next`), which is how splits and merges find
//! their neighbours. Blocks live in a slab ([`BlockArena`]) and refer to each other by
//! [`BlockId`], so the core has no pointers and no unsafe code.
//!
//! The links are the arena's own: a block's `prev`/`next` are read through
//! [`Block::prev`]/[`Block::next`] and changed only by the arena's list operations
//! ([`BlockArena::insert_before`], [`BlockArena::insert_after`], [`BlockArena::absorb`]), so
//! a split or a merge cannot leave a one-sided link.

use gpualloc_runtime::StreamHandle;

/// Index of a block in the arena.
pub(crate) type BlockId = u32;

/// Where a block is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BlockState {
    /// In a pool's free set (or being moved in or out of it).
    Free,
    /// Handed to a user.
    Allocated,
    /// Freed by the user, waiting for `event_count` stream events to complete.
    Pending,
    /// Unmapped pages of an expandable segment being mapped off the core (`growth.rs`): in no
    /// pool, never merged, allocated or released until committed or aborted.
    Mapping,
    /// Pages of an expandable segment taken out of the books, being unmapped off the core
    /// (`shrink.rs`): in no pool, never merged or mapped until that finishes.
    Unmapping,
}

/// One block. See the module docs.
#[derive(Debug, Clone)]
pub(crate) struct Block {
    pub addr: u64,
    pub size: u64,
    /// What the user asked for (0 when free).
    pub requested: u64,
    /// The stream the segment was allocated for; the block is only reused on it.
    pub stream: StreamHandle,
    /// Index of the pool the block belongs to (see `core::PoolIndex`).
    pub pool: usize,
    prev: Option<BlockId>,
    next: Option<BlockId>,
    pub state: BlockState,
    /// Outstanding stream events while `Pending`.
    pub event_count: u32,
    /// Streams other than `stream` that used the block (`record_stream`).
    pub stream_uses: Vec<StreamHandle>,
    /// Base address of the block's segment.
    pub segment: u64,
    /// The pool's `get_free_block` call count when the block was cached (garbage collection age).
    pub gc_base: u64,
    /// False for the unmapped parts of an expandable segment.
    pub mapped: bool,
    /// Part of an expandable segment.
    pub expandable: bool,
}

impl Block {
    /// A fresh free block covering a whole segment.
    pub fn segment(addr: u64, size: u64, stream: StreamHandle, pool: usize) -> Block {
        Block {
            addr,
            size,
            requested: 0,
            stream,
            pool,
            prev: None,
            next: None,
            state: BlockState::Free,
            event_count: 0,
            stream_uses: Vec::new(),
            segment: addr,
            gc_base: 0,
            mapped: true,
            expandable: false,
        }
    }

    /// The block before this one in its segment.
    #[inline]
    pub fn prev(&self) -> Option<BlockId> {
        self.prev
    }

    /// The block after this one in its segment.
    #[inline]
    pub fn next(&self) -> Option<BlockId> {
        self.next
    }

    /// True when the block shares its segment with other blocks.
    pub fn is_split(&self) -> bool {
        self.prev.is_some() || self.next.is_some()
    }

    /// End address (exclusive).
    pub fn end(&self) -> u64 {
        self.addr + self.size
    }
}

/// Slab of blocks with id reuse.
#[derive(Default)]
pub(crate) struct BlockArena {
    slots: Vec<Option<Block>>,
    vacant: Vec<BlockId>,
}

impl BlockArena {
    pub fn insert(&mut self, block: Block) -> BlockId {
        if let Some(id) = self.vacant.pop() {
            self.slots[id as usize] = Some(block);
            id
        } else {
            self.slots.push(Some(block));
            (self.slots.len() - 1) as BlockId
        }
    }

    pub fn contains(&self, id: BlockId) -> bool {
        self.slots.get(id as usize).is_some_and(Option::is_some)
    }

    pub fn remove(&mut self, id: BlockId) -> Option<Block> {
        let b = self.slots.get_mut(id as usize)?.take();
        if b.is_some() {
            self.vacant.push(id);
        }
        b
    }

    /// The block `id`. Ids come only from this arena and are removed exactly once, so a
    /// missing id is a bug in the core: it panics in debug builds via the index.
    pub fn get(&self, id: BlockId) -> &Block {
        self.slots[id as usize].as_ref().expect("live block id")
    }

    pub fn get_mut(&mut self, id: BlockId) -> &mut Block {
        self.slots[id as usize].as_mut().expect("live block id")
    }

    pub fn iter(&self) -> impl Iterator<Item = (BlockId, &Block)> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, b)| b.as_ref().map(|b| (i as BlockId, b)))
    }

    /// Splits block `id`: its front `size` bytes become a new free block, of the same segment,
    /// stream, pool and mapping, linked before it; `id` keeps the rest. Returns the new id.
    /// (The hit path's split: the new block is built in place, as the arena's only literal,
    /// and linked here rather than through [`BlockArena::insert_before`]: building it first
    /// and inserting it cost 11 to 24 more instructions per hit pair, `scripts/hit-probe.sh`.)
    #[inline]
    pub fn split_front(&mut self, id: BlockId, size: u64) -> BlockId {
        let found = self.get(id);
        debug_assert!(size < found.size, "a split leaves a remainder");
        let front = Block {
            addr: found.addr,
            size,
            requested: 0,
            stream: found.stream,
            pool: found.pool,
            prev: found.prev,
            next: Some(id),
            state: BlockState::Free,
            event_count: 0,
            stream_uses: Vec::new(),
            segment: found.segment,
            gc_base: 0,
            mapped: found.mapped,
            expandable: found.expandable,
        };
        let prev = found.prev;
        let front_id = self.insert(front);
        if let Some(p) = prev {
            self.get_mut(p).next = Some(front_id);
        }
        let rest = self.get_mut(id);
        rest.prev = Some(front_id);
        rest.addr += size;
        rest.size -= size;
        front_id
    }

    /// Inserts `block` into the list just before block `at`; returns its id. The caller has
    /// made `block`'s range end where `at`'s begins.
    pub fn insert_before(&mut self, at: BlockId, mut block: Block) -> BlockId {
        let prev = self.get(at).prev;
        block.prev = prev;
        block.next = Some(at);
        let id = self.insert(block);
        if let Some(p) = prev {
            self.get_mut(p).next = Some(id);
        }
        self.get_mut(at).prev = Some(id);
        id
    }

    /// Inserts `block` into the list just after block `at`; returns its id. The caller has
    /// made `block`'s range begin where `at`'s ends.
    pub fn insert_after(&mut self, at: BlockId, mut block: Block) -> BlockId {
        let next = self.get(at).next;
        block.prev = Some(at);
        block.next = next;
        let id = self.insert(block);
        if let Some(n) = next {
            self.get_mut(n).prev = Some(id);
        }
        self.get_mut(at).next = Some(id);
        id
    }

    /// Merges block `src`, a neighbour of `dst` in its segment, into `dst`: `dst` then covers
    /// both ranges and takes `src`'s place in the list; `src` leaves the arena and is
    /// returned. `None`, changing nothing, when `src` is not next to `dst`.
    #[inline]
    pub fn absorb(&mut self, dst: BlockId, src: BlockId) -> Option<Block> {
        let d = self.get(dst);
        let before = if d.prev == Some(src) {
            true
        } else if d.next == Some(src) {
            false
        } else {
            return None;
        };
        let s = self.remove(src)?;
        let d = self.get_mut(dst);
        d.size += s.size;
        if before {
            // [src dst]
            d.addr = s.addr;
            d.prev = s.prev;
            if let Some(p) = s.prev {
                self.get_mut(p).next = Some(dst);
            }
        } else {
            // [dst src]
            d.next = s.next;
            if let Some(n) = s.next {
                self.get_mut(n).prev = Some(dst);
            }
        }
        Some(s)
    }

    pub fn clear(&mut self) {
        self.slots.clear();
        self.vacant.clear();
    }
}

#[cfg(test)]
mod tests {
    use gpualloc_runtime::{DeviceId, StreamHandle};

    use super::*;

    fn block(addr: u64, size: u64) -> Block {
        let stream = StreamHandle {
            device: DeviceId(0),
            raw: 1,
        };
        Block::segment(addr, size, stream, 1)
    }

    /// The ids in list order from `first`, checking each back link on the way.
    fn walk(arena: &BlockArena, first: BlockId) -> Vec<BlockId> {
        assert_eq!(arena.get(first).prev(), None, "the walk starts at the head");
        let (mut out, mut at) = (vec![first], first);
        while let Some(n) = arena.get(at).next() {
            assert_eq!(arena.get(n).prev(), Some(at), "{n}'s back link");
            assert_eq!(arena.get(at).end(), arena.get(n).addr, "{at} and {n} touch");
            out.push(n);
            at = n;
        }
        out
    }

    #[test]
    fn inserts_link_both_sides_and_absorb_unlinks() {
        let mut arena = BlockArena::default();
        let mid = arena.insert(block(0x300, 0x100));
        assert!(!arena.get(mid).is_split());
        let head = arena.insert_before(mid, block(0x100, 0x100));
        let tail = arena.insert_after(mid, block(0x400, 0x100));
        let inner = arena.insert_after(head, block(0x200, 0x100));
        assert!(arena.get(mid).is_split());
        assert_eq!(walk(&arena, head), [head, inner, mid, tail]);
        // Not neighbours, or itself: nothing changes.
        assert!(arena.absorb(head, tail).is_none());
        assert!(arena.absorb(mid, mid).is_none());
        assert_eq!(walk(&arena, head), [head, inner, mid, tail]);
        // [src dst]: the block before takes dst's start and dst its place.
        let gone = arena.absorb(mid, inner).expect("inner is before mid");
        assert_eq!((gone.addr, gone.size), (0x200, 0x100));
        assert!(!arena.contains(inner));
        assert_eq!((arena.get(mid).addr, arena.get(mid).size), (0x200, 0x200));
        assert_eq!(walk(&arena, head), [head, mid, tail]);
        // [dst src]: the block after.
        let gone = arena.absorb(mid, tail).expect("tail is after mid");
        assert_eq!((gone.addr, gone.size), (0x400, 0x100));
        assert_eq!((arena.get(mid).addr, arena.get(mid).end()), (0x200, 0x500));
        assert_eq!(walk(&arena, head), [head, mid]);
        arena.absorb(mid, head).expect("head is before mid");
        assert_eq!(walk(&arena, mid), [mid]);
        assert!(!arena.get(mid).is_split());
        assert_eq!((arena.get(mid).addr, arena.get(mid).size), (0x100, 0x400));
        // The hit path's split: the front before, the rest keeps the id.
        arena.get_mut(mid).mapped = false;
        let front = arena.split_front(mid, 0x80);
        assert_eq!(walk(&arena, front), [front, mid]);
        let (f, r) = (arena.get(front), arena.get(mid));
        assert_eq!(
            (f.addr, f.size, r.addr, r.size),
            (0x100, 0x80, 0x180, 0x380)
        );
        assert!(!f.mapped && f.segment == r.segment && f.stream == r.stream);
        let second = arena.split_front(mid, 0x80);
        assert_eq!(walk(&arena, front), [front, second, mid]);
    }
}
