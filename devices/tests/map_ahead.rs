//! The `gpualloc` policy's pages for the large pool of expandable segments (`map_ahead.rs`):
//! 2 MiB pages; the pages wholly inside the request in physical handles of up to 20 MiB and
//! each page after them (the one the request ends in, the pages ahead) a handle of its own;
//! growth ahead of the request by 1/8 of what is mapped (PyTorch's 20 MiB steps once that
//! reaches 20 MiB), handles released only whole, and the pages ahead dropped where the device
//! or the memory-fraction cap has no room for them. Concrete addresses, reserved bytes and
//! driver calls.

mod common;

use std::sync::Arc;

use gpualloc_devices::{
    map_growth, AllocatorConfig, CachedOutcome, DeviceCore, Growth, SegmentRequest, StatType,
};
use gpualloc_runtime::{Backend, DeviceId, StreamHandle};

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const ALL: usize = StatType::All as usize;

use common::rig;

/// The request's miss (it must not hit the cache).
fn miss(core: &mut DeviceCore, size: u64, s: StreamHandle) -> SegmentRequest {
    match core.try_cached(size, s).unwrap() {
        CachedOutcome::Miss(req) => req,
        CachedOutcome::Hit(h) => panic!("expected a miss for {size} bytes, got {h:?}"),
    }
}

#[test]
fn growth_maps_2_mib_pages_ahead_in_handles_that_end_where_the_request_ends() {
    let (backend, mut core, s) = rig(1 << 30, "expandable_segments:True");
    let maps = || backend.counts().maps;
    // Nothing mapped yet: exactly the request, in 2 MiB pages: [0, 4) MiB wholly inside it
    // as one handle, the page it ends in as another.
    let a = core.malloc(5 * MIB, s).unwrap();
    assert_eq!((core.reserved_bytes(), maps()), (6 * MIB, 2));
    // 29 MiB more needed: 30 MiB (more than 1/8 of 6 MiB ahead): the 28 MiB wholly inside
    // the request as handles of 20 and 8 MiB, the page it ends in as a third.
    let b = core.malloc(30 * MIB, s).unwrap();
    assert_eq!(b.ptr.0, a.ptr.0 + 5 * MIB, "the segment grew in place");
    assert_eq!((core.reserved_bytes(), maps()), (36 * MIB, 5));
    // 1 MiB more needed: 36 / 8 = 4.5 MiB ahead, rounded to pages: 6 MiB, but never past
    // the 20 MiB boundary PyTorch's page would end at: 4 MiB, to 40 MiB. No page is wholly
    // inside the request: two handles of a page.
    let c = core.malloc(2 * MIB, s).unwrap();
    assert_eq!((core.reserved_bytes(), maps()), (40 * MIB, 7));
    // 147 MiB more needed (148 MiB of pages): the 146 MiB wholly inside the request as seven
    // handles of 20 MiB and one of 6, the page it ends in as a ninth.
    let d = core.malloc(150 * MIB, s).unwrap();
    assert_eq!((core.reserved_bytes(), maps()), (188 * MIB, 16));
    // 1/8 of 188 MiB is over 20 MiB: from now on the segment grows as with PyTorch's pages, to
    // the next multiple of 20 MiB from its base: 2 MiB needed, 12 MiB mapped (to 200 MiB):
    // one page wholly inside the request, then two of their own (the page it ends in, the
    // first page ahead), then the other three pages ahead as one handle.
    let e = core.malloc(3 * MIB, s).unwrap();
    assert_eq!((core.reserved_bytes(), maps()), (200 * MIB, 20));
    // 15 MiB more needed: the 14 MiB wholly inside the request as one handle, then three
    // pages of their own (two, and the one page left ahead), to 220 MiB.
    let f = core.malloc(25 * MIB, s).unwrap();
    assert_eq!((core.reserved_bytes(), maps()), (220 * MIB, 24));
    assert_eq!(backend.counts().mallocs, 0, "no cuMemAlloc-style segment");
    core.check_invariants().unwrap();
    for p in [a.ptr, b.ptr, c.ptr, d.ptr, e.ptr, f.ptr] {
        core.free(p).unwrap();
    }
    core.empty_cache().unwrap();
    assert_eq!(core.reserved_bytes(), 0);
    assert_eq!(backend.used(DeviceId(0)), 0);
    assert_eq!(backend.counts().unmaps, 24, "one unmap per handle");
    core.check_invariants().unwrap();
}

/// Why a growth's handles end where its request ends: free pages between live blocks are
/// whole handles, so a release (`empty_cache`, the page move before a growth) can unmap
/// them. With one handle per growth, as before, each of these releases freed nothing.
#[test]
fn free_pages_between_live_blocks_are_whole_handles() {
    // The pages ahead: a 2 MiB request after 64 MiB maps 8 MiB, a handle per page; a 4 MiB
    // block placed in them and freed between two live ones gives back its two pages.
    let (backend, mut core, s) = rig(1 << 30, "expandable_segments:True");
    let a = core.malloc(64 * MIB, s).unwrap();
    let k = core.malloc(2 * MIB, s).unwrap();
    assert_eq!(
        (core.reserved_bytes(), backend.counts().maps),
        (72 * MIB, 8)
    );
    let t = core.malloc(4 * MIB, s).unwrap();
    let k2 = core.malloc(2 * MIB, s).unwrap();
    assert_eq!(
        [k.ptr.0, t.ptr.0, k2.ptr.0].map(|p| p - a.ptr.0),
        [64 * MIB, 66 * MIB, 70 * MIB]
    );
    core.free(t.ptr).unwrap();
    core.empty_cache().unwrap();
    assert_eq!(
        (core.reserved_bytes(), backend.counts().unmaps),
        (68 * MIB, 2)
    );
    core.check_invariants().unwrap();
    // The request's last page: 5 MiB maps [0, 4) as one handle and [4, 6) as another; a
    // block beside it keeps that page, and freeing the 5 MiB gives back [0, 4).
    let (backend, mut core, s) = rig(1 << 30, "expandable_segments:True");
    let x = core.malloc(5 * MIB, s).unwrap();
    let y = core.malloc(1536 * KIB, s).unwrap();
    assert_eq!(y.ptr.0, x.ptr.0 + 5 * MIB);
    assert_eq!(core.reserved_bytes(), 8 * MIB);
    core.free(x.ptr).unwrap();
    core.empty_cache().unwrap();
    assert_eq!(
        (core.reserved_bytes(), backend.counts().unmaps),
        (4 * MIB, 1)
    );
    core.check_invariants().unwrap();
    core.free(y.ptr).unwrap();
    core.empty_cache().unwrap();
    assert_eq!(core.reserved_bytes(), 0);
}

/// The history's `segment_map` records how the growth split its handles, so a replay maps
/// the same ones (`TraceEntry::grouped_pages`, `TraceEntry::single_pages`): the first 2 pages
/// of a 5 MiB request's 6 MiB share a handle, the third is its own (of at most two single
/// pages); a map that groups every page (a 4 MiB request's two pages; PyTorch's one page per
/// handle) records nothing.
#[test]
fn the_history_records_where_a_growths_shared_handles_end() {
    use gpualloc_devices::{Policy, TraceAction};
    for (policy, size, expected) in [
        (Policy::Gpualloc, 5 * MIB, (Some(2), Some(2))),
        (Policy::Gpualloc, 4 * MIB, (None, None)),
        (Policy::Pytorch, 5 * MIB, (None, None)),
    ] {
        let config = AllocatorConfig::parse("expandable_segments:True")
            .unwrap()
            .with_policy(policy);
        let backend = Arc::new(gpualloc_accounting::AccountingBackend::new(1, 1 << 30));
        let s = backend.stream_create(DeviceId(0)).unwrap();
        let mut core = DeviceCore::new(backend.clone(), DeviceId(0), config).unwrap();
        core.record_history(Some(100));
        let a = core.malloc(size, s).unwrap();
        let maps: Vec<_> = core
            .snapshot()
            .trace
            .iter()
            .filter(|e| e.action == TraceAction::SegmentMap)
            .map(|e| (e.addr, (e.grouped_pages, e.single_pages)))
            .collect();
        assert_eq!(maps, [(a.ptr.0, expected)], "{policy} {size}");
    }
}

/// With handles that end where requests end (and the page move before a growth, both on under
/// the default policy), a forward pass's step of kept activations among temporaries, repeated
/// after two warm-up steps, makes no backend call and reserves nothing more: the handles
/// matter only when the segment grows or memory is released.
#[test]
fn a_repeated_step_after_warm_up_maps_and_unmaps_nothing() {
    let (backend, mut core, s) = rig(1 << 30, "expandable_segments:True");
    let weights = core.malloc(30 * MIB, s).unwrap();
    let step = |core: &mut DeviceCore| {
        let mut kept = Vec::new();
        for layer in 0..8u64 {
            kept.push(core.malloc(4608 * KIB, s).unwrap());
            let t1 = core.malloc(3 * MIB, s).unwrap();
            kept.push(core.malloc(4608 * KIB, s).unwrap());
            let t2 = core.malloc(1536 * KIB + layer * 64 * KIB, s).unwrap();
            core.free(t1.ptr).unwrap();
            kept.push(core.malloc(1152 * KIB, s).unwrap());
            core.free(t2.ptr).unwrap();
        }
        let logits = core.malloc(15 * MIB, s).unwrap();
        core.free(logits.ptr).unwrap();
        for k in kept {
            core.free(k.ptr).unwrap();
        }
    };
    step(&mut core);
    step(&mut core);
    let (warm, reserved) = (backend.counts(), core.reserved_bytes());
    assert!(warm.maps > 0 && warm.mallocs == 0);
    for _ in 0..5 {
        step(&mut core);
    }
    assert_eq!(backend.counts(), warm, "no backend call in a repeated step");
    assert_eq!(core.reserved_bytes(), reserved);
    core.free(weights.ptr).unwrap();
    core.check_invariants().unwrap();
}

/// A private pool's growth stays one handle (its memory is released whole by its owner, and
/// a registrar registers its ranges): 5 MiB in a named pool maps one handle where the default
/// pool maps two.
#[test]
fn a_private_pools_growth_is_one_handle() {
    let (backend, mut core, s) = rig(1 << 30, "expandable_segments:True");
    let pool = core.create_named_pool("weights", gpualloc_devices::PoolOptions::default());
    let a = core.malloc_in(pool, 5 * MIB, s).unwrap();
    assert_eq!((core.reserved_bytes(), backend.counts().maps), (6 * MIB, 1));
    let b = core.malloc(5 * MIB, s).unwrap();
    assert_eq!(
        (core.reserved_bytes(), backend.counts().maps),
        (12 * MIB, 3)
    );
    core.free(a.ptr).unwrap();
    core.free(b.ptr).unwrap();
    core.check_invariants().unwrap();
}

/// The pages ahead stop at the 20 MiB boundary PyTorch's page would end at, so a growth never
/// maps more than PyTorch's (cnn-counterfactual-small with expandable segments reserved
/// 110 MiB against PyTorch's 108 MiB before: its 90 MiB segment grew by 12 MiB, to 102).
#[test]
fn the_pages_ahead_stop_at_pytorchs_page_boundary() {
    let (backend, mut core, s) = rig(1 << 30, "expandable_segments:True");
    let a = core.malloc(90 * MIB, s).unwrap();
    assert_eq!(core.reserved_bytes(), 90 * MIB);
    // 2 MiB needed; 1/8 of 90 MiB ahead would be 12 MiB (to 102 MiB): 10 MiB, to 100 MiB.
    let b = core.malloc(2 * MIB, s).unwrap();
    assert_eq!(core.reserved_bytes(), 100 * MIB);
    assert_eq!(b.ptr.0, a.ptr.0 + 90 * MIB);
    // The boundary holds the next growth too: 8 MiB free ahead serve 8 MiB without a map.
    let maps = backend.counts().maps;
    let c = core.malloc(8 * MIB, s).unwrap();
    assert_eq!(
        (core.reserved_bytes(), backend.counts().maps),
        (100 * MIB, maps)
    );
    // Short of a boundary the pages ahead are 1/8 as before: a second stream's segment of
    // 30 MiB, 2 MiB more needed: 4 MiB (30 / 8 = 3.75, in pages), to 34 MiB of 40.
    let s2 = backend.stream_create(DeviceId(0)).unwrap();
    let d = core.malloc(30 * MIB, s2).unwrap();
    let e = core.malloc(2 * MIB, s2).unwrap();
    assert_eq!(core.reserved_bytes(), 134 * MIB);
    core.check_invariants().unwrap();
    for p in [a.ptr, b.ptr, c.ptr, d.ptr, e.ptr] {
        core.free(p).unwrap();
    }
    core.empty_cache().unwrap();
    assert_eq!(core.reserved_bytes(), 0);
}

#[test]
fn a_handle_is_released_only_whole() {
    let (backend, mut core, s) = rig(1 << 30, "expandable_segments:True");
    let a = core.malloc(20 * MIB, s).unwrap(); // [0, 20): one handle
    let b = core.malloc(10 * MIB, s).unwrap(); // [20, 30): another
    assert_eq!(core.reserved_bytes(), 30 * MIB);
    core.free(a.ptr).unwrap();
    // 4 MiB of a's handle in use again: the 16 MiB free behind it stay mapped.
    let x = core.malloc(4 * MIB, s).unwrap();
    assert_eq!(x.ptr, a.ptr);
    core.empty_cache().unwrap();
    assert_eq!(core.reserved_bytes(), 30 * MIB);
    assert_eq!(backend.counts().unmaps, 0);
    core.check_invariants().unwrap();
    // The whole handle free: released with one unmap; b's handle stays.
    core.free(x.ptr).unwrap();
    core.empty_cache().unwrap();
    assert_eq!(core.reserved_bytes(), 10 * MIB);
    assert_eq!(backend.counts().unmaps, 1);
    assert_eq!(core.stats().reserved_bytes[ALL].current, 10 * MIB);
    core.check_invariants().unwrap();
    // Mapped again where it was, as one handle.
    let y = core.malloc(20 * MIB, s).unwrap();
    assert_eq!(y.ptr, a.ptr);
    assert_eq!(core.reserved_bytes(), 30 * MIB);
    core.free(y.ptr).unwrap();
    core.free(b.ptr).unwrap();
    core.empty_cache().unwrap();
    assert_eq!(core.reserved_bytes(), 0);
    assert_eq!(backend.used(DeviceId(0)), 0);
    core.check_invariants().unwrap();
}

/// 64 MiB mapped, then a 2 MiB request: 8 MiB would be mapped (1/8 ahead), but only `room`
/// is left on the device. Returns reserved bytes after, for the in-place chain and for the
/// off-core growth of the device actors.
fn grow_with_room(capacity: u64, off_core: bool) -> u64 {
    let (backend, mut core, s) = rig(capacity, "expandable_segments:True");
    let a = core.malloc(64 * MIB, s).unwrap();
    let b = if off_core {
        let req = miss(&mut core, 2 * MIB, s);
        let Growth::Map(plan) = core.plan_growth(&req).unwrap() else {
            panic!("expected pages to map");
        };
        assert_eq!(plan.bytes(), 8 * MIB, "planned with the pages ahead");
        let dynb: Arc<dyn Backend> = backend.clone();
        let mapped = map_growth(dynb.as_ref(), &plan).unwrap();
        // The request fills its one page: it and each page ahead are a handle of their own
        // (the request's page alone where the device had no room for the pages ahead).
        let pages = if capacity > 72 * MIB { 4 } else { 1 };
        assert_eq!(
            (mapped.bytes(), mapped.handles()),
            (pages * 2 * MIB, pages as usize)
        );
        core.commit_growth(plan, mapped).unwrap();
        match core.try_cached(2 * MIB, s).unwrap() {
            CachedOutcome::Hit(b) => b,
            CachedOutcome::Miss(_) => panic!("the committed pages hold the request"),
        }
    } else {
        core.malloc(2 * MIB, s).unwrap()
    };
    assert_eq!(b.ptr.0, a.ptr.0 + 64 * MIB);
    let st = core.stats();
    assert_eq!((st.num_ooms, st.num_alloc_retries), (0, 0));
    core.check_invariants().unwrap();
    let reserved = core.reserved_bytes();
    core.free(a.ptr).unwrap();
    core.free(b.ptr).unwrap();
    core.empty_cache().unwrap();
    assert_eq!(backend.used(DeviceId(0)), 0);
    reserved
}

#[test]
fn the_pages_ahead_are_dropped_when_the_device_has_no_room_for_them() {
    for off_core in [false, true] {
        assert_eq!(grow_with_room(1 << 30, off_core), 72 * MIB, "{off_core}");
        assert_eq!(grow_with_room(70 * MIB, off_core), 66 * MIB, "{off_core}");
    }
}

/// Reserved bytes after `first` then 2 MiB on a 108 MiB device of which half (54 MiB) is
/// allowed.
fn under_half(first: u64) -> u64 {
    let (_, mut core, s) = rig(
        108 * MIB,
        "expandable_segments:True,per_process_memory_fraction:0.5",
    );
    let a = core.malloc(first, s).unwrap();
    let b = core.malloc(2 * MIB, s).unwrap();
    let reserved = core.reserved_bytes();
    core.free(a.ptr).unwrap();
    core.free(b.ptr).unwrap();
    core.check_invariants().unwrap();
    reserved
}

#[test]
fn the_pages_ahead_fill_the_memory_fraction_up_to_its_edge() {
    // 40 MiB mapped: 5 MiB ahead, rounded to 6 MiB, fits.
    assert_eq!(under_half(40 * MIB), 46 * MIB);
    // 48 MiB mapped: 6 MiB ahead reaches the cap exactly: allowed.
    assert_eq!(under_half(48 * MIB), 54 * MIB);
    // 50 MiB mapped: 6.25 MiB ahead, rounded to 8 MiB, would pass it: only the request's page.
    assert_eq!(under_half(50 * MIB), 52 * MIB);
}

/// In place, the fraction counts the pages a growth needs: up to the cap exactly, not past it.
#[test]
fn a_growth_reaches_the_memory_fraction_exactly_and_no_further() {
    let (_, mut core, s) = rig(
        128 * MIB,
        "expandable_segments:True,per_process_memory_fraction:0.5",
    );
    let a = core.malloc(60 * MIB, s).unwrap();
    let b = core.malloc(2 * MIB, s).unwrap();
    let c = core.malloc(2 * MIB, s).unwrap();
    assert_eq!(core.reserved_bytes(), 64 * MIB);
    let err = core.malloc(2 * MIB, s).unwrap_err();
    assert!(err.is_oom(), "{err}");
    assert_eq!(core.reserved_bytes(), 64 * MIB);
    for p in [a.ptr, b.ptr, c.ptr] {
        core.free(p).unwrap();
    }
    core.check_invariants().unwrap();
}

/// PyTorch's check (policy:pytorch) counts a segment's size, and a request that reaches the
/// cap exactly is allowed: 20 + 20 MiB under a 40 MiB cap, with ordinary and expandable
/// segments.
#[test]
fn pytorchs_fraction_check_allows_reaching_the_cap() {
    for conf in ["", "expandable_segments:True,"] {
        let (_, mut core, s) = rig(
            128 * MIB,
            &format!("{conf}policy:pytorch,per_process_memory_fraction:0.3125"),
        );
        let a = core.malloc(20 * MIB, s).unwrap();
        let b = core.malloc(20 * MIB, s).unwrap();
        assert_eq!(core.reserved_bytes(), 40 * MIB, "{conf}");
        let err = core.malloc(20 * MIB, s).unwrap_err();
        assert!(err.is_oom(), "{conf}: {err}");
        core.free(a.ptr).unwrap();
        core.free(b.ptr).unwrap();
    }
}

#[test]
fn the_pages_ahead_stay_under_the_memory_fraction() {
    // 128 MiB device, half of it allowed.
    let (_, mut core, s) = rig(
        128 * MIB,
        "expandable_segments:True,per_process_memory_fraction:0.5",
    );
    let a = core.malloc(60 * MIB, s).unwrap();
    let b = core.malloc(2 * MIB, s).unwrap();
    assert_eq!(
        core.reserved_bytes(),
        62 * MIB,
        "8 MiB ahead would pass 64 MiB"
    );
    core.free(b.ptr).unwrap();
    core.check_invariants().unwrap();
    // The owners' path plans the same: 2 MiB (free again, so the request hits the cache),
    // then a request beyond the cap plans nothing.
    let b = match core.try_cached(2 * MIB, s).unwrap() {
        CachedOutcome::Hit(b) => b,
        CachedOutcome::Miss(_) => panic!("the freed 2 MiB hold the request"),
    };
    let req = miss(&mut core, 4 * MIB, s);
    assert!(matches!(core.plan_growth(&req).unwrap(), Growth::InPlace));
    core.free(a.ptr).unwrap();
    core.free(b.ptr).unwrap();
    core.check_invariants().unwrap();
}

#[test]
fn the_small_pool_and_pytorch_policy_map_exactly_what_is_needed() {
    let (backend, mut core, s) = rig(1 << 30, "expandable_segments:True,policy:pytorch");
    let a = core.malloc(64 * MIB, s).unwrap();
    let b = core.malloc(2 * MIB, s).unwrap();
    // 20 MiB pages, one handle each: 80 MiB for 64 (4 maps), b fits in the last page.
    assert_eq!(
        (core.reserved_bytes(), backend.counts().maps),
        (80 * MIB, 4)
    );
    core.free(a.ptr).unwrap();
    core.free(b.ptr).unwrap();
    let (_, mut core, s) = rig(1 << 30, "expandable_segments:True");
    let small: Vec<_> = (0..5).map(|_| core.malloc(512 << 10, s).unwrap()).collect();
    // The small pool: 2 MiB pages, nothing ahead (4 blocks a page: 2 pages).
    assert_eq!(core.reserved_bytes(), 4 * MIB);
    // Nothing ahead however much is mapped: 37 blocks of 1 MiB more, 39.5 MiB in all, on
    // 20 pages (with 1/8 ahead it would be 8 MiB more).
    let more: Vec<_> = (0..37).map(|_| core.malloc(MIB, s).unwrap()).collect();
    assert_eq!(core.reserved_bytes(), 40 * MIB);
    for x in more {
        core.free(x.ptr).unwrap();
    }
    for x in small {
        core.free(x.ptr).unwrap();
    }
    core.check_invariants().unwrap();
}

/// Only a lack of memory drops the pages ahead: any other driver error is the growth's
/// error, whether pages were planned ahead (64 MiB mapped, 8 MiB for a 2 MiB request) or
/// not (the first growth), in place and off the core.
#[test]
fn other_driver_errors_are_not_retried_without_the_pages_ahead() {
    use gpualloc_runtime::BackendError;
    use gpualloc_sim::{Fault, Op, SimBackend, SimConfig};
    for (first, off_core) in [(0, false), (64 * MIB, false), (0, true), (64 * MIB, true)] {
        let simb = SimBackend::new(SimConfig::fast(1)).unwrap();
        let sim: Arc<dyn Backend> = simb.clone();
        let s = sim.stream_create(DeviceId(0)).unwrap();
        let config = AllocatorConfig::parse("expandable_segments:True").unwrap();
        let mut core = DeviceCore::new(sim.clone(), DeviceId(0), config).unwrap();
        let kept = (first > 0).then(|| core.malloc(first, s).unwrap());
        let size = if first > 0 { 2 * MIB } else { 5 * MIB };
        simb.inject(
            Op::Map,
            Fault::FailNext {
                skip: 0,
                count: 1,
                error: BackendError::invalid("injected"),
            },
        );
        let failed = if off_core {
            let req = miss(&mut core, size, s);
            let Growth::Map(plan) = core.plan_growth(&req).unwrap() else {
                panic!("expected pages to map");
            };
            let r = map_growth(sim.as_ref(), &plan);
            let _ = core.abort_growth(plan);
            r.map(|_| ()).map_err(|e| e.to_string())
        } else {
            core.malloc(size, s).map(|_| ()).map_err(|e| e.to_string())
        };
        let err = failed.expect_err("the injected error is the growth's error");
        assert!(err.contains("injected"), "{first} {off_core}: {err}");
        assert_eq!(core.reserved_bytes(), first);
        core.check_invariants().unwrap();
        if let Some(k) = kept {
            core.free(k.ptr).unwrap();
        }
    }
}

/// A growth with nothing planned ahead is tried once per attempt of the out-of-memory chain
/// (before and after releasing the cache), not again without pages it did not plan.
#[test]
fn a_growth_without_pages_ahead_is_not_tried_twice() {
    let (backend, mut core, s) = rig(4 * MIB, "expandable_segments:True");
    let err = core.malloc(5 * MIB, s).unwrap_err();
    assert!(err.is_oom(), "{err}");
    assert_eq!(backend.counts().failed_mallocs, 2);
    assert_eq!(core.reserved_bytes(), 0);
}

/// Off the core a growth is cut into handles the same way: 30 MiB is two (20 + 10 MiB).
#[test]
fn an_off_core_growth_maps_one_handle_per_20_mib() {
    let (backend, mut core, s) = rig(1 << 30, "expandable_segments:True");
    let req = miss(&mut core, 30 * MIB, s);
    let Growth::Map(plan) = core.plan_growth(&req).unwrap() else {
        panic!("expected pages to map");
    };
    let dynb: Arc<dyn Backend> = backend.clone();
    let mapped = map_growth(dynb.as_ref(), &plan).unwrap();
    assert_eq!((mapped.handles(), mapped.bytes()), (2, 30 * MIB));
    core.commit_growth(plan, mapped).unwrap();
    assert_eq!(backend.counts().maps, 2);
    let a = match core.try_cached(30 * MIB, s).unwrap() {
        CachedOutcome::Hit(a) => a,
        CachedOutcome::Miss(_) => panic!("the new pages hold it"),
    };
    core.free(a.ptr).unwrap();
    core.check_invariants().unwrap();
}

/// The small pool never maps ahead: 24 blocks of 1 MiB (two to a 2 MiB page) map 12 pages,
/// one growth each, however much the small pool holds already (1/8 of 16 MiB would be a page
/// ahead).
#[test]
fn the_small_pool_maps_no_pages_ahead() {
    let (backend, mut core, s) = rig(1 << 30, "expandable_segments:True");
    let mut live = Vec::new();
    for i in 1..=24u64 {
        live.push(core.malloc(MIB, s).unwrap());
        assert_eq!(core.reserved_bytes(), i.div_ceil(2) * 2 * MIB, "block {i}");
    }
    assert_eq!(backend.counts().maps, 12);
    for b in live {
        core.free(b.ptr).unwrap();
    }
    core.check_invariants().unwrap();
}
