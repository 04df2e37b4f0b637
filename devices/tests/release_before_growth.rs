//! The `gpualloc` policy's release before a growth (`miss/chain.rs`, `ReleaseBeforeGrowth`):
//! a growth of an expandable segment that would pass the most the core ever held first
//! releases what is cached, a bounded number of times per `empty_cache` of the user's
//! (`budget.rs`), and otherwise unmaps the default large pool's free pages when they come to
//! 3/4 of the request, once per rise of that mark (the page move); never under PyTorch's
//! policy.

use std::sync::Arc;

use gpualloc_accounting::AccountingBackend;
use gpualloc_devices::{AllocatorConfig, DeviceCore};
use gpualloc_runtime::{Backend, DeviceId, StreamHandle};

const MIB: u64 = 1 << 20;
const D0: DeviceId = DeviceId(0);
/// The `gpualloc` policy with expandable segments (the facade resolves the default to them
/// where the backend maps pages; a bare core takes the config as written).
const GPUALLOC: &str = "expandable_segments:True";

fn rig(conf: &str) -> (Arc<AccountingBackend>, DeviceCore, StreamHandle) {
    let backend = Arc::new(AccountingBackend::new(1, 1 << 40));
    let dynb: Arc<dyn Backend> = backend.clone();
    let s = dynb.stream_create(D0).unwrap();
    let core = DeviceCore::new(dynb, D0, AllocatorConfig::parse(conf).unwrap()).unwrap();
    (backend, core, s)
}

/// 100 MiB and 100 MiB, the first freed (a 100 MiB hole before a live block), then 150 MiB,
/// which the hole cannot hold: the most reserved during the step.
fn step_with_a_hole(core: &mut DeviceCore, s: StreamHandle) -> u64 {
    step_with_a_hole_then(core, s, 150 * MIB)
}

/// [`step_with_a_hole`] with a last request of `last` bytes.
fn step_with_a_hole_then(core: &mut DeviceCore, s: StreamHandle, last: u64) -> u64 {
    step_sized(core, s, [100 * MIB, 100 * MIB, last])
}

/// `first` and `second` bytes, the first freed, then `last`: the most reserved during the
/// step, whose blocks are all freed at its end.
fn step_sized(core: &mut DeviceCore, s: StreamHandle, [first, second, last]: [u64; 3]) -> u64 {
    let a = core.malloc(first, s).unwrap();
    let b = core.malloc(second, s).unwrap();
    core.free(a.ptr).unwrap();
    let c = core.malloc(last, s).unwrap();
    let peak = core.reserved_bytes();
    core.free(b.ptr).unwrap();
    core.free(c.ptr).unwrap();
    core.check_invariants().unwrap();
    peak
}

/// A first step that sets the high-water mark at 200 MiB (100 and 100 MiB), then the user's
/// `empty_cache`, as a layer-by-layer job does between layers.
fn first_step_then_empty_cache(core: &mut DeviceCore, s: StreamHandle) {
    let a = core.malloc(100 * MIB, s).unwrap();
    let b = core.malloc(100 * MIB, s).unwrap();
    core.free(a.ptr).unwrap();
    core.free(b.ptr).unwrap();
    core.empty_cache().unwrap();
    assert_eq!(core.reserved_bytes(), 0);
}

#[test]
fn after_an_empty_cache_a_growth_past_the_high_water_mark_releases_the_hole_first() {
    for (conf, armed_peak) in [
        (GPUALLOC, 250 * MIB),
        // PyTorch's 20 MiB pages: 100 + 100 + 160.
        ("policy:pytorch,expandable_segments:True", 360 * MIB),
        // Ordinary segments: nothing to grow, nothing released for.
        ("expandable_segments:False", 350 * MIB),
    ] {
        let (_b, mut core, s) = rig(conf);
        first_step_then_empty_cache(&mut core, s);
        // gpualloc: the 150 MiB growth would pass 200 MiB, so the hole goes back first:
        // 100 (b) + 150 (c). PyTorch's policy maps the 150 beside the hole.
        assert_eq!(step_with_a_hole(&mut core, s), armed_peak, "[{conf}]");
    }
}

/// Without an `empty_cache`, a growth past the most ever held first unmaps the free pages of
/// the default large pool (the page move), once per rise of that mark, when they come to at
/// least 3/4 of the request: the 120 MiB request maps where the 100 MiB hole's pages were given
/// up, and no pages ahead. The rise that growth made allows one more move (the second step's);
/// then the mark stays, and a repeated step makes no driver call.
#[test]
fn a_growth_past_the_high_water_mark_moves_free_pages_once_per_rise_of_the_mark() {
    let (backend, mut core, s) = rig(GPUALLOC);
    // 100 (b) + 120 (c): the hole went back before c's growth.
    assert_eq!(step_with_a_hole_then(&mut core, s, 120 * MIB), 220 * MIB);
    // The hole's 100 MiB were mapped by growths of at most 20 MiB, a handle each.
    assert_eq!(backend.counts().unmaps, 5, "the hole's pages, once");
    assert_eq!(step_with_a_hole_then(&mut core, s, 120 * MIB), 220 * MIB);
    let warm = backend.counts();
    let mut peaks = Vec::new();
    for _ in 0..5 {
        peaks.push(step_with_a_hole_then(&mut core, s, 120 * MIB) / MIB);
    }
    let after = backend.counts();
    assert_eq!(peaks, [220; 5]);
    assert_eq!(
        (after.maps, after.unmaps, after.mallocs),
        (warm.maps, warm.unmaps, warm.mallocs),
        "no driver call in a repeated step"
    );
    assert_eq!(
        core.stats().num_sync_all_streams,
        0,
        "a move synchronizes nothing"
    );
}

/// Free pages under 3/4 of the request are not moved: the 100 MiB hole stays for a 150 MiB
/// request, which maps ahead to 160 (`map_ahead.rs`): 100 + 100 + 160, every step, and no
/// unmap ever.
#[test]
fn free_pages_short_of_three_quarters_of_the_request_are_not_moved() {
    let (backend, mut core, s) = rig(GPUALLOC);
    assert_eq!(step_with_a_hole(&mut core, s), 360 * MIB);
    let first = backend.counts();
    for _ in 0..5 {
        assert_eq!(step_with_a_hole(&mut core, s), 360 * MIB);
    }
    let after = backend.counts();
    assert_eq!(after.unmaps, 0);
    assert_eq!((after.maps, after.mallocs), (first.maps, first.mallocs));
}

/// PyTorch's policy moves no page: 100 + 100 + 120 (its 20 MiB pages) in every step.
#[test]
fn pytorchs_policy_moves_no_page() {
    let (backend, mut core, s) = rig("policy:pytorch,expandable_segments:True");
    for _ in 0..3 {
        assert_eq!(step_with_a_hole_then(&mut core, s, 120 * MIB), 320 * MIB);
    }
    assert_eq!(backend.counts().unmaps, 0);
}

/// Nor does a private pool's growth, nor a small one (`miss/chain.rs`): a named pool gets the
/// same step as PyTorch's pool would.
#[test]
fn a_private_pools_growth_moves_no_page() {
    use gpualloc_devices::PoolOptions;
    let (backend, mut core, s) = rig(GPUALLOC);
    let pool = core.create_named_pool("p", PoolOptions::default());
    for _ in 0..3 {
        let a = core.malloc_in(pool, 100 * MIB, s).unwrap();
        let b = core.malloc_in(pool, 100 * MIB, s).unwrap();
        core.free(a.ptr).unwrap();
        let c = core.malloc_in(pool, 120 * MIB, s).unwrap();
        assert_eq!(core.reserved_bytes(), 320 * MIB);
        core.free(b.ptr).unwrap();
        core.free(c.ptr).unwrap();
    }
    assert_eq!(backend.counts().unmaps, 0);
}

/// A job that empties its cache once and then repeats a step: it releases at most
/// `RELEASES_PER_EMPTY_CACHE` (4) times (`budget.rs`'s unit test pins that the allowance runs
/// out), and after that the step maps, unmaps and synchronizes nothing.
#[test]
fn after_the_allowance_a_repeated_step_makes_no_driver_call() {
    let (backend, mut core, s) = rig(GPUALLOC);
    first_step_then_empty_cache(&mut core, s);
    let synced = core.stats().num_sync_all_streams;
    let mut peaks = Vec::new();
    for _ in 0..6 {
        peaks.push(step_with_a_hole(&mut core, s) / MIB);
    }
    let releases = core.stats().num_sync_all_streams - synced;
    assert!(
        (1..=4).contains(&releases),
        "{releases} releases, peaks {peaks:?}"
    );
    let before = (backend.counts(), core.stats().num_sync_all_streams);
    for _ in 0..5 {
        step_with_a_hole(&mut core, s);
    }
    let after = (backend.counts(), core.stats().num_sync_all_streams);
    assert_eq!(
        (after.0.maps, after.0.unmaps, after.0.mallocs, after.1),
        (before.0.maps, before.0.unmaps, before.0.mallocs, before.1),
        "peaks {peaks:?}"
    );
}

/// After a move the growth maps no pages ahead: with 200 MiB live, a segment grows to the next
/// 20 MiB boundary (1/8 of what it maps is past 20 MiB, `map_ahead.rs`); the 210 MiB request
/// that took the 200 MiB hole's pages maps 210 MiB, not 220.
#[test]
fn a_growth_after_a_move_maps_no_pages_ahead() {
    let (_b, mut core, s) = rig(GPUALLOC);
    let a = core.malloc(200 * MIB, s).unwrap();
    let b = core.malloc(200 * MIB, s).unwrap();
    core.free(a.ptr).unwrap();
    let c = core.malloc(210 * MIB, s).unwrap();
    assert_eq!(core.reserved_bytes(), 410 * MIB);
    core.free(b.ptr).unwrap();
    core.free(c.ptr).unwrap();
    core.check_invariants().unwrap();
}

/// Nor does any later growth (`map_ahead.rs`): a move shows the job at the most memory it
/// needs, where pages ahead are held unused. After the move above, 3 MiB and then 7 MiB map
/// 4 MiB (two handles: a whole page, the page it ends in) and 6 MiB (the 7 MiB block starts
/// in the free MiB of the last page: one handle), not to the next 20 MiB boundary; the same
/// requests without the move (the first 200 MiB kept) fit in the pages mapped ahead of c.
#[test]
fn no_growth_after_a_move_maps_pages_ahead() {
    for moved in [true, false] {
        let (backend, mut core, s) = rig(GPUALLOC);
        let a = core.malloc(200 * MIB, s).unwrap();
        let b = core.malloc(200 * MIB, s).unwrap();
        if moved {
            core.free(a.ptr).unwrap();
        }
        let c = core.malloc(210 * MIB, s).unwrap();
        let (reserved, maps) = (core.reserved_bytes(), backend.counts().maps);
        let d = core.malloc(3 * MIB, s).unwrap();
        let after_d = (
            core.reserved_bytes() - reserved,
            backend.counts().maps - maps,
        );
        let e = core.malloc(7 * MIB, s).unwrap();
        let after_e = (
            core.reserved_bytes() - reserved,
            backend.counts().maps - maps,
        );
        if moved {
            assert_eq!(reserved, 410 * MIB);
            assert_eq!([after_d, after_e], [(4 * MIB, 2), (10 * MIB, 3)]);
        } else {
            // c mapped ahead to 620 MiB; d and e fit there; nothing more is mapped.
            assert_eq!(reserved, 620 * MIB);
            assert_eq!([after_d, after_e], [(0, 0), (0, 0)]);
        }
        for p in [b.ptr, c.ptr, d.ptr, e.ptr] {
            core.free(p).unwrap();
        }
        if !moved {
            core.free(a.ptr).unwrap();
        }
        core.check_invariants().unwrap();
    }
}

/// A move takes the small pool's whole free pages too: a freed 512 KiB block's 2 MiB page goes
/// with the 100 MiB hole, 220 MiB where 222 would stay mapped.
#[test]
fn a_move_takes_the_small_pools_free_pages_too() {
    let (backend, mut core, s) = rig(GPUALLOC);
    let small = core.malloc(512 << 10, s).unwrap();
    assert!(small.small_pool);
    core.free(small.ptr).unwrap();
    assert_eq!(step_with_a_hole_then(&mut core, s, 120 * MIB), 220 * MIB);
    // The hole's five handles and the small page's one.
    assert_eq!(backend.counts().unmaps, 6);
}

/// A step that would release at every turn without the bound: 60 MiB and 40 MiB, the first
/// freed, then 150 MiB, after one `empty_cache`. Unbounded (a scratch build), it releases and
/// maps 8 handles again at every step, forever; the bound stops it after
/// `RELEASES_PER_EMPTY_CACHE` (4) releases, and from then on, with the page move on too, the
/// step makes no driver call and no synchronization.
#[test]
fn the_release_allowance_stops_a_step_that_would_release_at_every_turn() {
    let (backend, mut core, s) = rig(GPUALLOC);
    let warm = core.malloc(100 * MIB, s).unwrap();
    core.free(warm.ptr).unwrap();
    core.empty_cache().unwrap();
    let emptied = core.stats().num_sync_all_streams;
    let step = |core: &mut DeviceCore| {
        step_sized(core, s, [60 * MIB, 40 * MIB, 150 * MIB]);
    };
    for _ in 0..7 {
        step(&mut core);
    }
    assert_eq!(
        core.stats().num_sync_all_streams - emptied,
        4,
        "the allowance, all used"
    );
    let before = (backend.counts(), core.stats().num_sync_all_streams);
    for _ in 0..7 {
        step(&mut core);
    }
    let after = (backend.counts(), core.stats().num_sync_all_streams);
    assert_eq!(
        (after.0.maps, after.0.unmaps, after.0.mallocs, after.1),
        (before.0.maps, before.0.unmaps, before.0.mallocs, before.1)
    );
}

/// A step that would move pages at every turn without the once-per-rise bound: 100 MiB and
/// 20 MiB, the first freed, then 120 MiB, in a job that never empties its cache. Unbounded (a
/// scratch build), it unmaps 6 handles and maps them again at every step, forever; with the
/// bound it moves in the first two steps (5 and 6 handles) and never again.
#[test]
fn the_page_move_bound_stops_a_step_that_would_move_at_every_turn() {
    let (backend, mut core, s) = rig(GPUALLOC);
    let step = |core: &mut DeviceCore| {
        step_sized(core, s, [100 * MIB, 20 * MIB, 120 * MIB]);
    };
    let mut unmaps = Vec::new();
    for _ in 0..3 {
        step(&mut core);
        unmaps.push(backend.counts().unmaps);
    }
    assert_eq!(unmaps, [5, 11, 11]);
    let before = backend.counts();
    for _ in 0..10 {
        step(&mut core);
    }
    let after = backend.counts();
    assert_eq!(
        (after.maps, after.unmaps, after.mallocs),
        (before.maps, before.unmaps, before.mallocs)
    );
    assert_eq!(core.stats().num_sync_all_streams, 0);
}
