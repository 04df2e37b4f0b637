//! The block record's steps and the arena's list operations.

use gpualloc_runtime::{DeviceId, StreamHandle};

use super::*;

fn block(addr: u64, size: u64) -> Block {
    let stream = StreamHandle {
        device: DeviceId(0),
        raw: 1,
    };
    Block::whole_segment(addr, size, stream, 1)
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

#[test]
fn split_back_and_carve_keep_the_segment_and_its_links() {
    let mut arena = BlockArena::default();
    let id = arena.insert(Block::reserved_range(
        0x1000,
        0x800,
        block(0, 1).stream(),
        3,
    ));
    let rest = arena.split_back(id, 0x200);
    assert_eq!(walk(&arena, id), [id, rest]);
    let r = arena.get(rest);
    assert_eq!(
        (r.addr(), r.size(), r.segment(), r.pool()),
        (0x1200, 0x600, 0x1000, 3)
    );
    assert!(!r.mapped() && r.expandable() && r.state() == BlockState::Free);
    assert_eq!(arena.get(id).size(), 0x200);
    // Both sides, one side, none.
    let (before, after) = arena.carve(rest, 0x1300, 0x100);
    let (before, after) = (before.expect("a part before"), after.expect("a part after"));
    assert_eq!(walk(&arena, id), [id, before, rest, after]);
    let sizes: Vec<_> = [before, rest, after]
        .iter()
        .map(|b| (arena.get(*b).addr(), arena.get(*b).size()))
        .collect();
    assert_eq!(sizes, [(0x1200, 0x100), (0x1300, 0x100), (0x1400, 0x400)]);
    assert!(!arena.get(after).mapped() && arena.get(after).segment() == 0x1000);
    assert_eq!(arena.carve(after, 0x1400, 0x200).0, None);
    assert_eq!(arena.carve(before, 0x1200, 0x100), (None, None));
    assert_eq!(walk(&arena, id).len(), 5);
}

#[test]
fn a_blocks_life_steps() {
    let mut b = block(0x1000, 0x100);
    let (own, other) = (
        b.stream(),
        StreamHandle {
            raw: 9,
            ..b.stream()
        },
    );
    b.allocate(0xf0, 1);
    assert_eq!((b.state(), b.requested()), (BlockState::Allocated, 0xf0));
    assert!(!b.record_use(own), "the block's own stream is no use");
    assert!(b.record_use(other));
    assert!(!b.record_use(other), "noted once");
    assert_eq!(b.stream_uses(), [other]);
    b.begin_free();
    assert_eq!(b.state(), BlockState::Pending);
    assert_eq!(b.take_uses(), [other]);
    assert!(b.stream_uses().is_empty());
    b.add_event();
    b.add_event();
    assert!(!b.complete_event());
    assert!(b.complete_event(), "the last event");
    b.cache(7);
    assert_eq!(
        (b.state(), b.requested(), b.gc_base()),
        (BlockState::Free, 0, 7)
    );
    b.record_use(other);
    b.forget_uses(|s| *s == other);
    assert!(b.stream_uses().is_empty());
    b.move_to_stream(other);
    assert_eq!(b.stream(), other);
    b.mark_unmapped(true);
    assert_eq!((b.mapped(), b.state()), (false, BlockState::Unmapping));
    b.end_page_work();
    b.begin_mapping();
    assert_eq!(b.state(), BlockState::Mapping);
    b.mark_mapped();
    assert_eq!((b.mapped(), b.state()), (true, BlockState::Free));
}
