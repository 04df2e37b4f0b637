//! The `gpualloc` policy's spill (`malloc/spill.rs`): a small request that misses the default
//! small pool, where a new small page would pass the most that pool ever held, takes a free
//! block of the default large pool's expandable segment, when its size's last block lived at
//! most `SPILL_LIFETIME` allocations; a size never freed yet, once a small block has been freed
//! and where a new small page would make the small pool more than 1 / `UNKNOWN_SPILL_SHARE` of
//! the large pool, takes a free block at the end of the large pool's mapped pages; never under
//! PyTorch's policy.

mod common;

use std::sync::Arc;

use common::rig;
use gpualloc_accounting::AccountingBackend;
use gpualloc_devices::snapshot::BlockStateName;
use gpualloc_devices::spill::{SPILL_LIFETIME, UNKNOWN_SPILL_SHARE};
use gpualloc_devices::DeviceCore;
use gpualloc_runtime::StreamHandle;

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const EXPANDABLE: &str = "expandable_segments:True";

type Rig = (Arc<AccountingBackend>, DeviceCore, StreamHandle);

/// A live large block beside which the small pool stays under 1 / `UNKNOWN_SPILL_SHARE` of the
/// large pool up to two pages: only the known short-lived spill applies there.
const HELD_LARGE: u64 = 100 * MIB;

/// A core whose large pool holds a live `held` block (none for 0) and after it a free 10 MiB
/// block (and more mapped ahead), whose small pool's one 2 MiB page is full (two live 1 MiB
/// blocks, returned), and which has seen a 1 MiB block live for no other allocation.
fn small_pool_full_beside(conf: &str, held: u64) -> (Rig, Vec<u64>) {
    let (backend, mut core, s) = rig(1 << 40, conf);
    if held > 0 {
        core.malloc(held, s).unwrap(); // kept to the end
    }
    let big = core.malloc(10 * MIB, s).unwrap();
    core.free(big.ptr).unwrap();
    let once = core.malloc(MIB, s).unwrap();
    core.free(once.ptr).unwrap();
    let live = [core.malloc(MIB, s).unwrap(), core.malloc(MIB, s).unwrap()];
    assert!(live.iter().all(|a| a.small_pool));
    let ptrs = live.iter().map(|a| a.ptr.0).collect();
    ((backend, core, s), ptrs)
}

/// [`small_pool_full_beside`] a live 100 MiB block.
fn small_pool_full(conf: &str) -> (Rig, Vec<u64>) {
    small_pool_full_beside(conf, HELD_LARGE)
}

fn calls(b: &AccountingBackend) -> (u64, u64, u64) {
    let c = b.counts();
    (c.mallocs, c.maps, c.unmaps)
}

#[test]
fn a_short_lived_small_size_past_the_small_pools_mark_takes_large_pool_memory() {
    let ((backend, mut core, s), _live) = small_pool_full(EXPANDABLE);
    let (before, reserved) = (calls(&backend), core.reserved_bytes());
    let large_free = core.stats().inactive_split_bytes.large().current;
    let spilled = core.malloc(MIB, s).unwrap();
    assert!(!spilled.small_pool, "a large-pool block");
    assert_eq!(spilled.block_size, MIB, "split to its size");
    assert_eq!(calls(&backend), before, "no driver call");
    assert_eq!(core.reserved_bytes(), reserved);
    assert_eq!(
        core.stats().allocated_bytes.large().current,
        HELD_LARGE + MIB
    );
    core.check_invariants().unwrap();
    // Freed, it merges back: the large pool's 10 MiB serve a 10 MiB request with no call.
    core.free(spilled.ptr).unwrap();
    assert_eq!(
        core.stats().inactive_split_bytes.large().current,
        large_free
    );
    let big = core.malloc(10 * MIB, s).unwrap();
    assert_eq!(calls(&backend), before);
    core.free(big.ptr).unwrap();
    core.check_invariants().unwrap();
}

#[test]
fn a_size_never_freed_beside_a_large_pool_many_times_the_small_one_grows_the_small_pool() {
    let ((backend, mut core, s), _live) = small_pool_full(EXPANDABLE);
    let maps = backend.counts().maps;
    let a = core.malloc(768 * KIB, s).unwrap();
    assert!(a.small_pool);
    assert_eq!(backend.counts().maps, maps + 1, "a new small page");
}

const SMALL_PAGE: u64 = 2 * MIB;

#[test]
fn a_size_never_freed_where_the_small_pool_is_a_large_share_takes_the_large_pools_end() {
    // Beside a large pool of 10 MiB (and pages ahead): the second small page would be more
    // than 1/16 of it.
    let ((backend, mut core, s), _live) = small_pool_full_beside(EXPANDABLE, 0);
    let (before, reserved) = (calls(&backend), core.reserved_bytes());
    let a = core.malloc(768 * KIB, s).unwrap();
    assert!(!a.small_pool, "spilled");
    assert_eq!(calls(&backend), before, "no driver call");
    assert_eq!(core.reserved_bytes(), reserved);
    // Into the free block at the end of the large pool's mapped pages.
    let end = core
        .snapshot()
        .segments
        .iter()
        .filter(|seg| !seg.is_small)
        .flat_map(|seg| seg.blocks.iter())
        .filter(|b| b.mapped)
        .map(|b| b.address + b.size)
        .max()
        .unwrap();
    assert!(a.ptr.0 < end);
    core.free(a.ptr).unwrap();
    core.check_invariants().unwrap();
    // Around the share: it spills exactly where the second page (4 MiB) would be more than
    // 1/16 of what the large pool has mapped (64 MiB).
    let mut seen = [false, false];
    for held in (30..=70).step_by(2) {
        let ((_backend, mut core, s), _live) = small_pool_full_beside(EXPANDABLE, held * MIB);
        let mapped = core.stats().reserved_bytes.large().current;
        let a = core.malloc(768 * KIB, s).unwrap();
        let over = 2 * SMALL_PAGE * UNKNOWN_SPILL_SHARE > mapped;
        assert_eq!(!a.small_pool, over, "beside {} MiB mapped", mapped >> 20);
        seen[usize::from(over)] = true;
    }
    assert_eq!(seen, [true, true], "both sides of the share");
}

#[test]
fn before_any_small_block_is_freed_a_size_never_freed_grows_the_small_pool() {
    // A job loading what it keeps: no small block freed yet, only a large one.
    let (backend, mut core, s) = rig(1 << 40, EXPANDABLE);
    let big = core.malloc(10 * MIB, s).unwrap();
    core.free(big.ptr).unwrap();
    let kept: Vec<_> = (0..4).map(|_| core.malloc(512 * KIB, s).unwrap()).collect();
    let maps = backend.counts().maps;
    let a = core.malloc(768 * KIB, s).unwrap();
    assert!(a.small_pool, "loading: the small pool grows");
    assert_eq!(backend.counts().maps, maps + 1);
    // One small block freed: a new size spills (the small pool at 4 MiB, 1/16 of 64 MiB).
    let (x, y) = (
        core.malloc(640 * KIB, s).unwrap(),
        core.malloc(4 * KIB, s).unwrap(),
    );
    assert!(x.small_pool && y.small_pool, "the second page's rest");
    core.free(y.ptr).unwrap();
    let b = core.malloc(896 * KIB, s).unwrap();
    assert!(!b.small_pool, "spilled");
    assert_eq!(backend.counts().maps, maps + 1, "no driver call");
    drop(kept);
}

#[test]
fn a_size_never_freed_takes_no_hole_between_live_blocks() {
    // The large pool's free 10 MiB lies between two live blocks, with no free memory mapped
    // after the second: the request grows the small pool.
    let (backend, mut core, s) = rig(1 << 40, EXPANDABLE);
    let hole = core.malloc(10 * MIB, s).unwrap();
    let after = core.malloc(4 * MIB, s).unwrap();
    // Fill what the growth mapped ahead of `after`.
    let tail: Vec<u64> = core
        .snapshot()
        .segments
        .iter()
        .filter(|seg| !seg.is_small)
        .flat_map(|seg| seg.blocks.iter())
        .filter(|b| b.mapped && b.state == BlockStateName::Inactive)
        .map(|b| b.size)
        .collect();
    assert!(
        tail.iter().all(|&n| n > MIB),
        "large requests fill it: {tail:?}"
    );
    let maps = backend.counts().maps;
    let ahead: Vec<_> = tail.iter().map(|&n| core.malloc(n, s).unwrap()).collect();
    assert_eq!(backend.counts().maps, maps, "only what was mapped");
    core.free(hole.ptr).unwrap();
    let once = core.malloc(MIB, s).unwrap();
    core.free(once.ptr).unwrap();
    let live = [core.malloc(MIB, s).unwrap(), core.malloc(MIB, s).unwrap()];
    assert!(live.iter().all(|a| a.small_pool));
    let maps = backend.counts().maps;
    let a = core.malloc(768 * KIB, s).unwrap();
    assert!(a.small_pool, "the hole is not the large pool's end");
    assert_eq!(backend.counts().maps, maps + 1, "a new small page");
    // A size known short-lived takes the hole (past the small pool's mark).
    core.free(a.ptr).unwrap();
    let (x, y) = (core.malloc(MIB, s).unwrap(), core.malloc(MIB, s).unwrap());
    assert!(x.small_pool && y.small_pool, "the small pool's second page");
    let spilled = core.malloc(MIB, s).unwrap();
    assert_eq!(spilled.ptr, hole.ptr);
    drop((after, ahead));
}

/// Learns 512 KiB with a lifetime of `lived` allocations in a core from `small_pool_full`,
/// fills the small pool's second page, then asks for 512 KiB again: whether it spilled.
fn spills_after_living(lived: u64) -> bool {
    let ((backend, mut core, s), _live) = small_pool_full(EXPANDABLE);
    let long = core.malloc(512 * KIB, s).unwrap();
    assert!(long.small_pool, "the small pool's second page");
    for _ in 0..lived {
        let t = core.malloc(4 * KIB, s).unwrap();
        core.free(t.ptr).unwrap();
    }
    core.free(long.ptr).unwrap();
    let fill = [core.malloc(MIB, s).unwrap(), core.malloc(MIB, s).unwrap()];
    assert!(fill.iter().all(|a| a.small_pool));
    let maps = backend.counts().maps;
    let a = core.malloc(512 * KIB, s).unwrap();
    assert_eq!(backend.counts().maps, maps + u64::from(a.small_pool));
    !a.small_pool
}

#[test]
fn a_size_that_lived_long_grows_the_small_pool() {
    assert!(spills_after_living(SPILL_LIFETIME), "at the bound");
    assert!(!spills_after_living(SPILL_LIFETIME + 1), "past it");
}

#[test]
fn within_the_small_pools_mark_the_small_pool_grows_back() {
    let ((backend, mut core, s), live) = small_pool_full_beside(EXPANDABLE, 0);
    for p in live {
        core.free(gpualloc_runtime::DevicePtr(p)).unwrap();
    }
    core.empty_cache().unwrap();
    assert_eq!(core.reserved_bytes(), 0);
    let big = core.malloc(10 * MIB, s).unwrap();
    core.free(big.ptr).unwrap();
    let maps = backend.counts().maps;
    // The small pool held 2 MiB once: its page comes back.
    let a = core.malloc(MIB, s).unwrap();
    assert!(a.small_pool);
    assert_eq!(backend.counts().maps, maps + 1);
}

#[test]
fn pytorchs_policy_and_ordinary_segments_never_spill() {
    for conf in [
        "policy:pytorch,expandable_segments:True",
        "expandable_segments:False",
    ] {
        let ((_backend, mut core, s), _live) = small_pool_full(conf);
        let a = core.malloc(MIB, s).unwrap();
        assert!(a.small_pool, "[{conf}]");
    }
}

/// One step of a CNN-like job: a large activation with small workspaces beside it, the
/// workspaces freed, then the large peak with one workspace. The first step has one workspace
/// (the small pool holds one page, room for two); from the second on, three at once.
fn step(core: &mut DeviceCore, s: StreamHandle, workspaces: usize) -> Vec<bool> {
    let act = core.malloc(12 * MIB, s).unwrap();
    let ws: Vec<_> = (0..workspaces)
        .map(|_| core.malloc(MIB, s).unwrap())
        .collect();
    let pools = ws.iter().map(|a| a.small_pool).collect();
    for w in ws {
        core.free(w.ptr).unwrap();
    }
    core.free(act.ptr).unwrap();
    let peak = core.malloc(16 * MIB, s).unwrap();
    let w = core.malloc(MIB, s).unwrap();
    core.free(w.ptr).unwrap();
    core.free(peak.ptr).unwrap();
    core.check_invariants().unwrap();
    pools
}

#[test]
fn a_repeated_step_with_spills_makes_no_driver_call() {
    let (backend, mut core, s) = rig(1 << 40, EXPANDABLE);
    assert_eq!(step(&mut core, s, 1), [true]);
    // Past the small pool's one page: the third workspace spills.
    assert_eq!(step(&mut core, s, 3), [true, true, false]);
    repeat_steps(&backend, &mut core, s);
}

/// Five more steps of three workspaces: each spills its third, with no driver call, and the
/// small pool never grows past its one page.
fn repeat_steps(backend: &AccountingBackend, core: &mut DeviceCore, s: StreamHandle) {
    let (before, reserved) = (calls(backend), core.reserved_bytes());
    for _ in 0..5 {
        assert_eq!(step(core, s, 3), [true, true, false]);
    }
    assert_eq!(calls(backend), before, "no driver call in a repeated step");
    assert_eq!(core.reserved_bytes(), reserved);
    assert_eq!(core.stats().reserved_bytes.small().current, 2 * MIB);
}

/// The sixth rule's case, repeated: the first step's three workspaces are of a size never
/// freed, after a small input was freed; the third goes to the large pool's mapped end instead
/// of a second small page, and every later step (the size now known short-lived) spills its
/// third workspace too. After the first step no driver call, and the small pool keeps its one
/// page.
#[test]
fn a_repeated_step_whose_first_spill_was_of_an_unknown_size_makes_no_driver_call() {
    let (backend, mut core, s) = rig(1 << 40, EXPANDABLE);
    // The large pool's 16 MiB mapped and free (the step's activation leaves 4 MiB at its end),
    // and a small input freed.
    let peak = core.malloc(16 * MIB, s).unwrap();
    core.free(peak.ptr).unwrap();
    let input = core.malloc(4 * KIB, s).unwrap();
    core.free(input.ptr).unwrap();
    assert_eq!(step(&mut core, s, 3), [true, true, false]);
    repeat_steps(&backend, &mut core, s);
}

/// The history marks a spilled `alloc` (`TraceEntry::spilled`), and only that one, with the
/// block's address: a replay follows the mark.
#[test]
fn the_history_marks_a_spill() {
    let ((_backend, mut core, s), _live) = small_pool_full(EXPANDABLE);
    core.record_history(Some(100));
    let spilled = core.malloc(MIB, s).unwrap();
    let large = core.malloc(4 * MIB, s).unwrap();
    assert!(!spilled.small_pool);
    let marks: Vec<(u64, bool)> = core
        .snapshot()
        .trace
        .iter()
        .filter(|e| e.action == gpualloc_devices::TraceAction::Alloc)
        .map(|e| (e.addr, e.spilled))
        .collect();
    assert_eq!(marks, [(spilled.ptr.0, true), (large.ptr.0, false)]);
}

/// A replay following a history (`TraceEntry::spilled`): the spill where the history names
/// it, into the block at its address, and none of the chain's own.
#[test]
fn a_replay_spills_where_the_history_says_and_nowhere_else() {
    let ((backend, mut core, s), _live) = small_pool_full(EXPANDABLE);
    core.spill_as_recorded(true);
    let large = core.stats().allocated_bytes.large().current;
    // The chain spills nothing: the 1 MiB known short-lived grows the small pool.
    let maps = backend.counts().maps;
    let grown = core.malloc(MIB, s).unwrap();
    assert!(grown.small_pool);
    assert_eq!(backend.counts().maps, maps + 1, "a new small page");
    // The history's spill: into the large pool's free block at its address, split.
    let at = core
        .snapshot()
        .segments
        .iter()
        .filter(|seg| !seg.is_small)
        .flat_map(|seg| seg.blocks.iter())
        .find(|b| b.state == BlockStateName::Inactive && b.mapped && b.size >= MIB)
        .map(|b| b.address)
        .expect("a free large block");
    let request = core.segment_request_in(None, 512 * KIB, s).unwrap();
    let Ok(spilled) = core.malloc_spilled(request, at) else {
        panic!("the named block serves it");
    };
    assert_eq!(spilled.ptr.0, at);
    assert!(!spilled.small_pool);
    assert_eq!(spilled.block_size, 512 * KIB);
    assert_eq!(
        core.stats().allocated_bytes.large().current,
        large + 512 * KIB
    );
    // No free block there now: the request comes back for an ordinary malloc.
    let request = core.segment_request_in(None, 512 * KIB, s).unwrap();
    assert!(core.malloc_spilled(request, at).is_err());
    // A large request is no spill.
    let request = core.segment_request_in(None, 2 * MIB, s).unwrap();
    assert!(core.malloc_spilled(request, at + 512 * KIB).is_err());
    core.check_invariants().unwrap();
}

#[test]
fn a_replay_under_pytorchs_policy_spills_nothing() {
    let ((_backend, mut core, s), _live) =
        small_pool_full("expandable_segments:True,policy:pytorch");
    let big = core.malloc(12 * MIB, s).unwrap();
    let at = big.ptr.0;
    core.free(big.ptr).unwrap();
    let request = core.segment_request_in(None, 512 * KIB, s).unwrap();
    assert!(core.malloc_spilled(request, at).is_err());
}
