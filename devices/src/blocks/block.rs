//! Blocks and the arena that owns them.
//!
//! A block is a contiguous range of one segment: allocated to a user, waiting for stream
//! events after a free (pending), or free (cached in a pool). Blocks of a segment form a
//! doubly linked list in address order (`prev`/`next`), which is how splits and merges find
//! their neighbours. Blocks live in a slab ([`BlockArena`]) and refer to each other by
//! [`BlockId`], so the core has no pointers and no unsafe code.
//!
//! The record is the block's own: every field is private, read through a getter of the same
//! name and changed only by the operations below, each a step of a block's life, with the
//! state it may start from checked in debug builds ([`Block::allocate`], [`Block::begin_free`],
//! [`Block::cache`], [`Block::begin_mapping`], ...). The links and the range are the arena's:
//! `prev`/`next`, `addr` and `size` change only in its list operations
//! ([`BlockArena::split_front`], [`BlockArena::split_back`], [`BlockArena::carve`],
//! [`BlockArena::insert_before`], [`BlockArena::insert_after`], [`BlockArena::absorb`]), so a
//! split or a merge cannot leave a one-sided link or a gap between neighbours.

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
    addr: u64,
    size: u64,
    /// What the user asked for (0 when free).
    requested: u64,
    /// The stream the segment was allocated for; the block is only reused on it.
    stream: StreamHandle,
    /// Index of the pool the block belongs to (see `core::PoolIndex`).
    pool: usize,
    prev: Option<BlockId>,
    next: Option<BlockId>,
    state: BlockState,
    /// Outstanding stream events while `Pending`.
    event_count: u32,
    /// Streams other than `stream` that used the block (`record_stream`).
    stream_uses: Vec<StreamHandle>,
    /// Base address of the block's segment.
    segment: u64,
    /// The pool's `get_free_block` call count when the block was cached (garbage collection age).
    gc_base: u64,
    /// False for the unmapped parts of an expandable segment.
    mapped: bool,
    /// Part of an expandable segment.
    expandable: bool,
    /// Mapped by a growth, and no request has taken from it since: a tail for the placement
    /// rule (`placement.rs`) even where the growth filled the gap behind it.
    fresh: bool,
    /// The allocation count when the block was last handed out (`malloc/spill_state.rs`).
    born: u64,
}

impl Block {
    /// A fresh free block covering a whole segment.
    pub fn whole_segment(addr: u64, size: u64, stream: StreamHandle, pool: usize) -> Block {
        Block::in_segment(addr, addr, size, stream, pool)
    }

    /// A fresh free mapped block `[addr, addr + size)` of the segment at `segment`, unlinked.
    pub fn in_segment(
        segment: u64,
        addr: u64,
        size: u64,
        stream: StreamHandle,
        pool: usize,
    ) -> Block {
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
            segment,
            gc_base: 0,
            mapped: true,
            expandable: false,
            fresh: false,
            born: 0,
        }
    }

    /// The block covering a whole reserved expandable segment: free, its pages not mapped.
    pub fn reserved_range(addr: u64, size: u64, stream: StreamHandle, pool: usize) -> Block {
        Block {
            mapped: false,
            expandable: true,
            ..Block::whole_segment(addr, size, stream, pool)
        }
    }

    /// A fresh free block `[addr, addr + size)` of this block's segment, stream and pool,
    /// mapped as this one is, unlinked (the arena links it).
    fn piece(&self, addr: u64, size: u64) -> Block {
        Block {
            mapped: self.mapped,
            expandable: self.expandable,
            ..Block::in_segment(self.segment, addr, size, self.stream, self.pool)
        }
    }

    /// Whether the block's pages were mapped by a growth that no request has taken from yet.
    #[inline]
    pub fn fresh(&self) -> bool {
        self.fresh
    }

    /// A request takes from the block (the rest of it stays free): its pages are not fresh
    /// any more.
    #[inline]
    pub fn end_fresh(&mut self) {
        self.fresh = false;
    }

    /// Start address.
    #[inline]
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// Length in bytes.
    #[inline]
    pub fn size(&self) -> u64 {
        self.size
    }

    /// What the user asked for (0 when not allocated).
    #[inline]
    pub fn requested(&self) -> u64 {
        self.requested
    }

    /// The stream the block is reused on (its segment's, or the one it was handed to).
    #[inline]
    pub fn stream(&self) -> StreamHandle {
        self.stream
    }

    /// Index of the block pool it belongs to.
    #[inline]
    pub fn pool(&self) -> usize {
        self.pool
    }

    /// Where the block is in its life.
    #[inline]
    pub fn state(&self) -> BlockState {
        self.state
    }

    /// Outstanding stream events while `Pending`.
    #[inline]
    pub fn event_count(&self) -> u32 {
        self.event_count
    }

    /// Streams other than [`Block::stream`] that used the block (`record_stream`).
    #[inline]
    pub fn stream_uses(&self) -> &[StreamHandle] {
        &self.stream_uses
    }

    /// Base address of the block's segment.
    #[inline]
    pub fn segment(&self) -> u64 {
        self.segment
    }

    /// The pool's `get_free_block` call count when the block was last freed (its garbage
    /// collection age; read for whole cached segments only, which only a free's merge
    /// makes, so only [`Block::cache`] sets it).
    #[inline]
    pub fn gc_base(&self) -> u64 {
        self.gc_base
    }

    /// False for the unmapped parts of an expandable segment.
    #[inline]
    pub fn mapped(&self) -> bool {
        self.mapped
    }

    /// Part of an expandable segment.
    #[inline]
    pub fn expandable(&self) -> bool {
        self.expandable
    }

    /// Hands the free block to a user who asked for `requested` bytes.
    #[inline]
    pub fn allocate(&mut self, requested: u64, born: u64) {
        debug_assert_eq!(
            self.state,
            BlockState::Free,
            "only a free block is handed out"
        );
        self.state = BlockState::Allocated;
        self.requested = requested;
        self.fresh = false;
        self.born = born;
    }

    /// The allocation count when the block was last handed out.
    #[inline]
    pub fn born(&self) -> u64 {
        self.born
    }

    /// The user freed the block: it waits for its streams' events before it is cached.
    #[inline]
    pub fn begin_free(&mut self) {
        debug_assert_eq!(
            self.state,
            BlockState::Allocated,
            "only a live block is freed"
        );
        self.state = BlockState::Pending;
    }

    /// The block is cached (free, nothing requested) at garbage collection age `gc_base`.
    #[inline]
    pub fn cache(&mut self, gc_base: u64) {
        self.state = BlockState::Free;
        self.requested = 0;
        self.gc_base = gc_base;
    }

    /// Sets the garbage collection age of a split's remainder. Never read while it is split
    /// (garbage collection ages whole segments only, and a free's merge makes one whole again
    /// with [`Block::cache`]); the hit path keeps the store because dropping it measured 20 ns
    /// slower through the gate (code layout, BENCHMARKS.md).
    #[inline]
    pub fn set_gc_base(&mut self, gc_base: u64) {
        self.gc_base = gc_base;
    }

    /// Notes a use on `stream` (`record_stream`); a use on the block's own stream, or one
    /// already noted, changes nothing. True when the use is new.
    pub fn record_use(&mut self, stream: StreamHandle) -> bool {
        if stream == self.stream || self.stream_uses.contains(&stream) {
            return false;
        }
        self.stream_uses.push(stream);
        true
    }

    /// Takes the uses noted, to record an event on each at free time.
    pub fn take_uses(&mut self) -> Vec<StreamHandle> {
        std::mem::take(&mut self.stream_uses)
    }

    /// Forgets the uses on the streams `forget` picks (uses recorded during a capture: the
    /// graph's replays order them, no event is recorded for them).
    pub fn forget_uses(&mut self, forget: impl Fn(&StreamHandle) -> bool) {
        self.stream_uses.retain(|s| !forget(s));
    }

    /// One more stream event to wait for before the block is cached.
    #[inline]
    pub fn add_event(&mut self) {
        debug_assert_eq!(
            self.state,
            BlockState::Pending,
            "events wait on a freed block"
        );
        self.event_count += 1;
    }

    /// One of the block's stream events completed; true when it was the last.
    #[inline]
    pub fn complete_event(&mut self) -> bool {
        debug_assert!(self.event_count > 0, "an event the block waits for");
        self.event_count -= 1;
        self.event_count == 0
    }

    /// The block is reused on `stream` from now on (a dropped stream's segment handed on).
    /// The caller has taken it out of its pool's sets: a filed block's key holds its stream.
    pub fn move_to_stream(&mut self, stream: StreamHandle) {
        self.stream = stream;
    }

    /// Unmapped pages about to be mapped off the core: in no pool until committed or aborted.
    pub fn begin_mapping(&mut self) {
        debug_assert!(
            self.state == BlockState::Free && !self.mapped,
            "only unmapped free pages are mapped"
        );
        self.state = BlockState::Mapping;
    }

    /// Pages planned for mapping, or being unmapped, are free again (the plan aborted, the
    /// unmap finished), still unmapped.
    pub fn end_page_work(&mut self) {
        debug_assert!(
            matches!(self.state, BlockState::Mapping | BlockState::Unmapping),
            "page work under way"
        );
        self.state = BlockState::Free;
    }

    /// The block's pages are mapped now: a free mapped block, fresh until a request takes
    /// from it.
    pub fn mark_mapped(&mut self) {
        self.mapped = true;
        self.fresh = true;
        self.state = BlockState::Free;
    }

    /// The block's pages are unmapped now; `in_flight`: still being unmapped off the core
    /// (state `Unmapping` until that finishes).
    pub fn mark_unmapped(&mut self, in_flight: bool) {
        self.mapped = false;
        if in_flight {
            self.state = BlockState::Unmapping;
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
    #[inline]
    pub fn insert(&mut self, block: Block) -> BlockId {
        if let Some(id) = self.vacant.pop() {
            self.slots[id as usize] = Some(block);
            id
        } else {
            self.slots.push(Some(block));
            (self.slots.len() - 1) as BlockId
        }
    }

    #[inline]
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
    #[inline]
    pub fn get(&self, id: BlockId) -> &Block {
        self.slots[id as usize].as_ref().expect("live block id")
    }

    #[inline]
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
            fresh: false,
            born: 0,
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

    /// Cuts block `id` to its front `len` bytes; the rest becomes a new free block of the same
    /// segment, stream, pool and mapping, linked after it. Returns the rest's id.
    pub fn split_back(&mut self, id: BlockId, len: u64) -> BlockId {
        let b = self.get(id);
        debug_assert!(len < b.size, "a split leaves a remainder");
        let rest = b.piece(b.addr + len, b.size - len);
        let rest_id = self.insert_after(id, rest);
        self.get_mut(id).size = len;
        rest_id
    }

    /// Narrows block `id` to `[start, start + len)`, inside it: the parts before and after
    /// become new free blocks of the same segment, stream, pool and mapping, linked on each
    /// side. Returns their ids (`None` where the range starts at the block's start, or ends
    /// at its end).
    pub fn carve(
        &mut self,
        id: BlockId,
        start: u64,
        len: u64,
    ) -> (Option<BlockId>, Option<BlockId>) {
        let b = self.get(id).clone();
        debug_assert!(
            start >= b.addr && start + len <= b.end(),
            "carved only inside the block"
        );
        let before = (start > b.addr).then(|| {
            let piece = b.piece(b.addr, start - b.addr);
            self.insert_before(id, piece)
        });
        let after = (start + len < b.end()).then(|| {
            let piece = b.piece(start + len, b.end() - start - len);
            self.insert_after(id, piece)
        });
        let blk = self.get_mut(id);
        blk.addr = start;
        blk.size = len;
        (before, after)
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
mod tests;
