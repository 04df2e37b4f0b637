//! Blocks and the arena that owns them.
//!
//! A block is a contiguous range of one segment: allocated to a user, waiting for stream
//! events after a free (pending), or free (cached in a pool). Blocks of a segment form a
//! doubly linked list in address order (`prev`/`next`), which is how splits and merges find
//! their neighbours. Blocks live in a slab ([`BlockArena`]) and refer to each other by
//! [`BlockId`], so the core has no pointers and no unsafe code.

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
    pub prev: Option<BlockId>,
    pub next: Option<BlockId>,
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

    pub fn clear(&mut self) {
        self.slots.clear();
        self.vacant.clear();
    }
}
