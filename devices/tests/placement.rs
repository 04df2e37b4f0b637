//! The `gpualloc` policy's placement rule for expandable segments (`placement.rs`): a large
//! request passes over a best fit that would leave a dead remainder (under 512 KiB) and goes to
//! the segment's tail; where the tail cannot grow it takes the passed-over block after all; a
//! repeated step after warm-up makes no backend call beyond events and no synchronization.

mod common;

use std::sync::Arc;

use gpualloc_accounting::AccountingBackend;
use gpualloc_devices::{
    map_growth, Allocation, AllocatorConfig, CachedOutcome, DeviceCore, Growth, Miss, MissStep,
    Policy,
};
use gpualloc_runtime::{Backend, DeviceId, StreamHandle};
use gpualloc_sim::{Op, SimBackend, SimConfig};

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;

fn rig(capacity: u64, conf: &str, policy: Policy) -> (DeviceCore, StreamHandle) {
    let backend: Arc<dyn Backend> = Arc::new(AccountingBackend::new(1, capacity));
    let s = backend.stream_create(DeviceId(0)).unwrap();
    let config = AllocatorConfig::parse(conf).unwrap().with_policy(policy);
    (DeviceCore::new(backend, DeviceId(0), config).unwrap(), s)
}

/// Sizes of the free (inactive, mapped) blocks of the large pool, in address order.
fn large_free_blocks(core: &DeviceCore) -> Vec<u64> {
    core.snapshot()
        .segments
        .iter()
        .filter(|s| !s.is_small)
        .flat_map(|s| s.blocks.iter())
        .filter(|b| b.mapped && b.state.as_str() == "inactive")
        .map(|b| b.size)
        .collect()
}

/// A freed 1.5 MiB hole between kept blocks, then a 1.125 MiB request and a 1.5 MiB one (the
/// pattern of a forward pass: kept activations land in the holes of freed temporaries).
#[test]
fn a_dead_remainder_is_avoided_under_the_gpualloc_policy_only() {
    for policy in Policy::ALL {
        let (mut core, s) = rig(1 << 30, "expandable_segments:True", policy);
        let a = core.malloc(1536 * KIB, s).unwrap();
        let b = core.malloc(1536 * KIB, s).unwrap();
        core.free(a.ptr).unwrap();
        let kept = core.malloc(1152 * KIB, s).unwrap();
        let next = core.malloc(1536 * KIB, s).unwrap();
        let tail = b.ptr.0 + 1536 * KIB;
        match policy {
            Policy::Pytorch => {
                // Best fit: the hole, leaving 384 KiB nothing in the large pool can use; the
                // 1.5 MiB request then goes to the tail.
                assert_eq!(kept.ptr, a.ptr);
                assert_eq!(next.ptr.0, tail);
                assert_eq!(large_free_blocks(&core), [384 * KIB, 20 * MIB - 4608 * KIB]);
            }
            Policy::Gpualloc => {
                // The 1.125 MiB block goes to the tail; the hole is there for the 1.5 MiB.
                // (2 MiB pages: 2 for `a`, 2 more for `b`, 2 more for `kept`.)
                assert_eq!(kept.ptr.0, tail);
                assert_eq!(next.ptr, a.ptr);
                assert_eq!(large_free_blocks(&core), [6 * MIB - 4224 * KIB]);
            }
        }
        let pages = match policy {
            Policy::Pytorch => 20 * MIB,
            Policy::Gpualloc => 6 * MIB,
        };
        assert_eq!(core.reserved_bytes(), pages, "{policy}");
        for p in [b.ptr, kept.ptr, next.ptr] {
            core.free(p).unwrap();
        }
        core.empty_cache().unwrap();
        assert_eq!(core.reserved_bytes(), 0);
    }
}

/// Remainders of 512 KiB and more, the tail itself, and exact fits are taken as best fit.
#[test]
fn only_remainders_under_512_kib_are_passed_over() {
    for (hole, want_hole) in [
        (1152 * KIB + 511 * KIB, false),
        (1152 * KIB + 512 * KIB, true),
        (1152 * KIB, true),
    ] {
        let (mut core, s) = rig(1 << 30, "expandable_segments:True", Policy::Gpualloc);
        let a = core.malloc(hole, s).unwrap();
        let b = core.malloc(2 * MIB, s).unwrap();
        core.free(a.ptr).unwrap();
        let c = core.malloc(1152 * KIB, s).unwrap();
        assert_eq!(c.ptr == a.ptr, want_hole, "hole of {} KiB", hole / KIB);
        core.free(b.ptr).unwrap();
        core.free(c.ptr).unwrap();
    }
    // The best fit is the tail (the block the segment grows from): taken, whatever remains.
    let (mut core, s) = rig(1 << 30, "expandable_segments:True", Policy::Gpualloc);
    let a = core.malloc(2 * MIB, s).unwrap();
    let rest = core.malloc(20 * MIB - 2 * MIB - 1536 * KIB, s).unwrap();
    let c = core.malloc(1152 * KIB, s).unwrap();
    assert_eq!(c.ptr.0, rest.ptr.0 + rest.size, "the tail's 1.5 MiB");
    assert_eq!(core.reserved_bytes(), 20 * MIB);
    for p in [a.ptr, rest.ptr, c.ptr] {
        core.free(p).unwrap();
    }
}

/// A freed 1.5 MiB hole (`a`), a kept 2 MiB block (`b`) and 4.5 MiB of free mapped room at
/// the tail after it: 8 MiB mapped.
fn hole_and_tail(core: &mut DeviceCore, s: StreamHandle) -> (Allocation, Allocation) {
    let a = core.malloc(1536 * KIB, s).unwrap();
    let b = core.malloc(2 * MIB, s).unwrap();
    let z = core.malloc(4 * MIB, s).unwrap();
    core.free(z.ptr).unwrap();
    core.free(a.ptr).unwrap();
    (a, b)
}

/// The path of owners that grow segments off the core (the allocator's actors): the cached
/// step goes to the tail when it holds the request, and says "miss" when the tail must grow;
/// when it cannot, `malloc_passed_over` serves the request from the passed-over block.
#[test]
fn owners_that_grow_off_the_core_get_the_tail_or_the_passed_over_block() {
    let (mut core, s) = rig(20 * MIB, "expandable_segments:True", Policy::Gpualloc);
    let (a, b) = hole_and_tail(&mut core, s);
    let tail = b.ptr.0 + 2 * MIB;
    let mapped = core.reserved_bytes();
    assert_eq!(mapped, 8 * MIB);
    let c = match core.try_cached(1152 * KIB, s).unwrap() {
        CachedOutcome::Hit(c) => c,
        CachedOutcome::Miss(_) => panic!("the tail holds the request: a hit"),
    };
    assert_eq!(c.ptr.0, tail);
    // Fill the mapped pages but 512 KiB: the tail cannot hold the next 1.125 MiB request.
    let fill = core
        .malloc(mapped - (tail + 1152 * KIB - a.ptr.0) - 512 * KIB, s)
        .unwrap();
    let req = match core.try_cached(1152 * KIB, s).unwrap() {
        CachedOutcome::Miss(req) => req,
        CachedOutcome::Hit(h) => panic!("the hole was taken at {:#x}", h.ptr.0),
    };
    // (The owner would grow the segment now; where it cannot, it asks for the passed-over
    // block.)
    let d = match core.malloc_passed_over(req) {
        Ok(d) => d,
        Err(_) => panic!("the passed-over hole serves the request"),
    };
    assert_eq!(d.ptr, a.ptr);
    assert_eq!(large_free_blocks(&core), [384 * KIB, 512 * KIB]);
    // A request nothing holds is given back.
    let req = match core.try_cached(4 * MIB, s).unwrap() {
        CachedOutcome::Miss(req) => req,
        CachedOutcome::Hit(_) => panic!("nothing holds 4 MiB"),
    };
    assert!(core.malloc_passed_over(req).is_err());
    for p in [b.ptr, c.ptr, fill.ptr, d.ptr] {
        core.free(p).unwrap();
    }
}

/// The device has room for 20 MiB, all mapped: the tail cannot grow, so the request takes the
/// passed-over hole, with no out-of-memory error and no cache released.
#[test]
fn where_the_segment_cannot_grow_the_passed_over_block_serves_the_request() {
    let (mut core, s) = rig(20 * MIB, "expandable_segments:True", Policy::Gpualloc);
    let a = core.malloc(1536 * KIB, s).unwrap();
    let b = core.malloc(20 * MIB - 1536 * KIB - 512 * KIB, s).unwrap();
    core.free(a.ptr).unwrap();
    let c = core.malloc(1152 * KIB, s).unwrap();
    assert_eq!(c.ptr, a.ptr);
    let st = core.stats();
    assert_eq!(
        (st.num_ooms, st.num_alloc_retries, st.num_device_free),
        (0, 0, 0)
    );
    assert_eq!(core.reserved_bytes(), 20 * MIB);
    assert_eq!(large_free_blocks(&core), [384 * KIB, 512 * KIB]);
    core.free(b.ptr).unwrap();
    core.free(c.ptr).unwrap();
}

/// A training-like step: weights kept, activations of mixed sizes (the 1.125 / 1.5 MiB pattern
/// among them) allocated and freed. After the first step, later steps make no backend call
/// but stream-event bookkeeping, and synchronize nothing, under both policies.
#[test]
fn a_repeated_step_after_warm_up_makes_no_driver_call_and_no_synchronization() {
    for policy in Policy::ALL {
        let sim = SimBackend::new(SimConfig::fast(1)).unwrap();
        let backend: Arc<dyn Backend> = sim.clone();
        let s = backend.stream_create(DeviceId(0)).unwrap();
        let config = AllocatorConfig::parse("expandable_segments:True,large_segment_size_mb:2")
            .unwrap()
            .with_policy(policy);
        let mut core = DeviceCore::new(backend, DeviceId(0), config).unwrap();
        let weights: Vec<_> = [9 * MIB, 9 * MIB, 2304 * KIB, 30 * MIB]
            .iter()
            .map(|&n| core.malloc(n, s).unwrap())
            .collect();
        let step = |core: &mut DeviceCore| {
            let mut kept = Vec::new();
            for layer in 0..6u64 {
                let t1 = core.malloc(1536 * KIB, s).unwrap();
                let t2 = core.malloc(3 * MIB + layer * 64 * KIB, s).unwrap();
                core.free(t1.ptr).unwrap();
                kept.push(core.malloc(1152 * KIB, s).unwrap());
                let small = core.malloc(768 * KIB, s).unwrap();
                kept.push(core.malloc(4608 * KIB, s).unwrap());
                core.free(t2.ptr).unwrap();
                core.free(small.ptr).unwrap();
            }
            for k in kept {
                core.free(k.ptr).unwrap();
            }
        };
        step(&mut core);
        step(&mut core);
        let before = sim.counts();
        let reserved = core.reserved_bytes();
        for _ in 0..5 {
            step(&mut core);
        }
        let after = sim.counts();
        let new: Vec<(Op, u64)> = Op::ALL
            .iter()
            .map(|op| (*op, after.get(*op) - before.get(*op)))
            .filter(|(_, n)| *n > 0)
            .collect();
        assert!(
            new.is_empty(),
            "{policy}: backend calls in steady state: {new:?}"
        );
        assert_eq!(core.reserved_bytes(), reserved, "{policy}");
        for w in weights {
            core.free(w.ptr).unwrap();
        }
    }
}

/// A free block followed by pages being mapped off the core for another request is a tail
/// too: its remainder joins those pages when they land. So the choice does not depend on
/// whether a map in flight has landed yet, and a replay of the history, which maps the pages
/// where the history shows them (`devices/src/recorded/`), makes the same choice as the live allocator.
#[test]
fn a_block_before_pages_being_mapped_is_a_tail() {
    let (mut core, s) = rig(1 << 30, "expandable_segments:True", Policy::Gpualloc);
    let (_hole, b) = hole_and_tail(&mut core, s);
    let tail = b.ptr.0 + 2 * MIB;
    assert_eq!(core.reserved_bytes(), 8 * MIB);
    // 6 MiB does not fit in the 4.5 MiB tail: the segment grows after it, off the core.
    let CachedOutcome::Miss(grower) = core.try_cached(6 * MIB, s).unwrap() else {
        panic!("6 MiB fits nowhere");
    };
    let Growth::Map(plan) = core.plan_growth(&grower).unwrap() else {
        panic!("expected a growth");
    };
    // Meanwhile 1.125 MiB passes over the 1.5 MiB hole and takes the tail.
    let c = match core.try_cached(1152 * KIB, s).unwrap() {
        CachedOutcome::Hit(c) => c,
        CachedOutcome::Miss(_) => panic!("the tail before the pages being mapped holds it"),
    };
    assert_eq!(c.ptr.0, tail);
    let mapped = map_growth(core.backend().as_ref(), &plan).unwrap();
    core.commit_growth(plan, mapped).map_err(|_| ()).unwrap();
    assert!(
        core.reserved_bytes() > 8 * MIB,
        "the pages landed after the tail"
    );
    core.check_invariants().unwrap();
    for p in [b.ptr, c.ptr] {
        core.free(p).unwrap();
    }
}

/// Where a 1.125-unit request goes after: a free 6.5-unit block `X` at the segment's base
/// (followed by a kept block), a 2-unit request that grew the segment off the core and left
/// 1.5 units of its pages free (`T`), and, when `in_flight`, a 4-unit request whose pages
/// after `T` are still being mapped. A unit is 1 MiB under the `gpualloc` policy (2 MiB
/// pages) and 10 MiB under PyTorch's (20 MiB pages). Returns (X, T, where the request went).
fn choice_beside_pages_in_flight(policy: Policy, in_flight: bool) -> (u64, u64, u64) {
    let u = match policy {
        Policy::Pytorch => 10 * MIB,
        Policy::Gpualloc => MIB,
    };
    let (mut core, s) = rig(1 << 30, "expandable_segments:True", policy);
    let x = core.malloc(13 * u / 2, s).unwrap();
    let _k = core.malloc(2 * u, s).unwrap();
    let grow = |core: &mut DeviceCore, size: u64| {
        let CachedOutcome::Miss(req) = core.try_cached(size, s).unwrap() else {
            panic!("{size} bytes fit in the cache");
        };
        let Growth::Map(plan) = core.plan_growth(&req).unwrap() else {
            panic!("expected a growth for {size} bytes");
        };
        plan
    };
    let first = grow(&mut core, 2 * u);
    let second = in_flight.then(|| grow(&mut core, 4 * u));
    let mapped = map_growth(core.backend().as_ref(), &first).unwrap();
    core.commit_growth(first, mapped).map_err(|_| ()).unwrap();
    // The owner looks in the cache again once its pages have landed.
    let CachedOutcome::Hit(a) = core.try_cached(2 * u, s).unwrap() else {
        panic!("the pages mapped for 2 units hold them");
    };
    core.free(x.ptr).unwrap();
    let t = a.ptr.0 + 2 * u;
    let c = match core.try_cached(9 * u / 8, s).unwrap() {
        CachedOutcome::Hit(c) => c,
        CachedOutcome::Miss(_) => panic!("the free blocks hold 1.125 units"),
    };
    if let Some(plan) = second {
        let mapped = map_growth(core.backend().as_ref(), &plan).unwrap();
        core.commit_growth(plan, mapped).map_err(|_| ()).unwrap();
    }
    core.check_invariants().unwrap();
    (x.ptr.0, t, c.ptr.0)
}

/// Best fit in an expandable segment counts a free block's size plus the pages after it that
/// are not mapped (PyTorch: "the size it can expand to"), and pages being mapped off the core
/// for another request count as not mapped, all of them up to the next mapped page. Before,
/// only the next block counted: a block before 4 units in flight could grow to 5.5 units and
/// beat a 6.5-unit block, the same block before unmapped pages could not, so the choice
/// depended on whether another request's map had landed, and a replay of the history, which
/// maps the pages where the history shows them, chose otherwise (a `serve` history under
/// concurrency). Under both policies the request now goes to `X` whether or not pages are in
/// flight.
#[test]
fn pages_being_mapped_do_not_change_best_fit() {
    for policy in [Policy::Pytorch, Policy::Gpualloc] {
        for in_flight in [false, true] {
            let (x, t, c) = choice_beside_pages_in_flight(policy, in_flight);
            assert_eq!(
                c,
                x,
                "{policy:?}, pages in flight {in_flight}: 1.125 units went to {:#x} (T = {:#x})",
                c - x,
                t - x
            );
        }
    }
}

/// The `passed_over` marks of the history's `alloc` entries, in order.
fn passed_over_marks(core: &DeviceCore) -> Vec<bool> {
    core.snapshot()
        .trace
        .iter()
        .filter(|e| e.action == gpualloc_devices::TraceAction::Alloc)
        .map(|e| e.passed_over)
        .collect()
}

/// At a named pool's quota, the tail cannot grow: the passed-over block is taken, as where
/// the device is full, with no out-of-memory error and nothing released. (The pool's quota
/// path went from the failed growth to releasing the pool's cache and failing with its
/// quota error, never taking the passed-over block.) The history marks that allocation, and
/// only that one (`TraceEntry::passed_over`).
#[test]
fn at_a_pools_quota_the_passed_over_block_is_taken() {
    use gpualloc_devices::PoolOptions;
    // The gpualloc policy's 2 MiB pages (PyTorch's 20 MiB pages would not fit the quota).
    let policy = Policy::Gpualloc;
    let (mut core, s) = rig(1 << 30, "expandable_segments:True", policy);
    core.record_history(Some(100));
    let kv = core.create_named_pool(
        "kv",
        PoolOptions {
            quota: Some(6 * MIB),
            ..PoolOptions::default()
        },
    );
    let a = core.malloc_in(kv, 1536 * KIB, s).unwrap();
    let b = core.malloc_in(kv, 1536 * KIB, s).unwrap();
    let c = core.malloc_in(kv, 2560 * KIB, s).unwrap();
    let reserved = core.reserved_bytes();
    core.free(a.ptr).unwrap();
    // The 1.5 MiB hole would leave 384 KiB; the tail's 512 KiB cannot hold 1.125 MiB and
    // growing it would pass the quota.
    let kept = core.malloc_in(kv, 1152 * KIB, s).unwrap();
    assert_eq!(kept.ptr, a.ptr, "{policy}");
    assert_eq!(core.reserved_bytes(), reserved, "{policy}");
    assert_eq!(core.stats().num_ooms, 0, "{policy}");
    assert_eq!(passed_over_marks(&core), [false, false, false, true]);
    for p in [b.ptr, c.ptr, kept.ptr] {
        core.free(p).unwrap();
    }
    core.check_invariants().unwrap();
}

/// An allocation served with any remainder from a block that is not one the policy passes
/// over (ordinary segments, the last step of a miss) is not marked in the history.
#[test]
fn an_any_fit_allocation_of_a_block_not_passed_over_is_not_marked() {
    let (mut core, s) = rig(1 << 30, "expandable_segments:False", Policy::Gpualloc);
    core.record_history(Some(100));
    let whole = core.malloc(20 * MIB, s).unwrap();
    let CachedOutcome::Miss(request) = core.try_cached(8 * MIB, s).unwrap() else {
        panic!("expected a miss");
    };
    core.free(whole.ptr).unwrap();
    // Off the core: the device has no room for a new segment; the lookup after that call
    // takes the block freed meanwhile, with any remainder.
    let step = common::drive_miss(&mut core, Miss::off_core(request), common::segment_malloc);
    let MissStep::Done(last_step) = step else {
        panic!("expected the freed block to serve the request");
    };
    assert_eq!(last_step.ptr, whole.ptr);
    assert_eq!(passed_over_marks(&core), [false, false]);
    core.free(last_step.ptr).unwrap();
}

/// A growth that fills an unmapped gap for a request that passed over a block: its pages
/// hold the request whoever drives the miss. The segment: `a` [0, 5) MiB, a free 1 MiB tail
/// [5, 6), a 4 MiB gap [6, 10) left by `empty_cache`, `c` [10, 16), a 3.75 MiB hole
/// [16, 19.75) freed after it, `d` [19.75, 21.75) and a 256 KiB tail [21.75, 22) (the page
/// after it released too). A 3.5 MiB request would
/// leave 256 KiB of the hole, so it passes over it; neither tail holds it; the segment grows
/// the 1 MiB tail into the gap, which the 4 MiB it maps fill. In place the request takes those
/// pages. Off the core (the device actor; and the replay, which maps the pages at the
/// history's `segment_map` and then serves the request) it looked in the cache again, where
/// the grown block was no tail any more (a live block follows it): it passed over the hole
/// again, missed, and grew the segment a second time, at its end.
#[test]
fn pages_that_fill_a_gap_hold_the_request_that_grew_them() {
    let layout = |core: &mut DeviceCore, s: StreamHandle| {
        let a = core.malloc(5 * MIB, s).unwrap();
        let b = core.malloc(5 * MIB, s).unwrap();
        let c = core.malloc(6 * MIB, s).unwrap();
        let hole = core.malloc(3840 * KIB, s).unwrap();
        let d = core.malloc(2 * MIB, s).unwrap();
        let base = a.ptr.0;
        assert_eq!(
            [b.ptr.0, c.ptr.0, hole.ptr.0, d.ptr.0].map(|p| p - base),
            [5 * MIB, 10 * MIB, 16 * MIB, 19 * MIB + 768 * KIB]
        );
        core.free(b.ptr).unwrap();
        core.empty_cache().unwrap();
        core.free(hole.ptr).unwrap();
        assert_eq!(
            core.reserved_bytes(),
            18 * MIB,
            "b's 4 MiB and d's last page released"
        );
        assert_eq!(large_free_blocks(core), [MIB, 3840 * KIB, 256 * KIB]);
        base
    };
    // In place.
    let (mut core, s) = rig(1 << 30, "expandable_segments:True", Policy::Gpualloc);
    let base = layout(&mut core, s);
    let r = core.malloc(3584 * KIB, s).unwrap();
    assert_eq!(r.ptr.0 - base, 5 * MIB);
    // The chain released the cache before growing (the first growths after the user's
    // `empty_cache` do): the hole's whole page [16, 18) went, then the gap's 4 MiB came.
    assert_eq!(core.reserved_bytes(), 20 * MIB);
    // What the request left of those pages, [8.5, 10) before `c`, is no tail: the pages are
    // not fresh once a request took from them, so 1.25 MiB, which would leave 256 KiB of it,
    // passes over it and goes where the segment grows: the page [16, 18) the release
    // unmapped, before the rest of the hole.
    let later = core.malloc(1280 * KIB, s).unwrap();
    assert_eq!(later.ptr.0 - base, 16 * MIB);
    core.check_invariants().unwrap();
    // Off the core, the growth step alone: the same pages, the same block.
    let (mut core, s) = rig(1 << 30, "expandable_segments:True", Policy::Gpualloc);
    let base = layout(&mut core, s);
    let CachedOutcome::Miss(req) = core.try_cached(3584 * KIB, s).unwrap() else {
        panic!("3.5 MiB passes over the hole and fits no tail");
    };
    let Growth::Map(plan) = core.plan_growth(&req).unwrap() else {
        panic!("expected a growth");
    };
    assert_eq!(plan.bytes(), 4 * MIB, "the gap, filled");
    let mapped = map_growth(core.backend().as_ref(), &plan).unwrap();
    core.commit_growth(plan, mapped).map_err(|_| ()).unwrap();
    let r = match core.try_cached(3584 * KIB, s).unwrap() {
        CachedOutcome::Hit(r) => r,
        CachedOutcome::Miss(_) => panic!("the pages just mapped hold the request"),
    };
    assert_eq!(r.ptr.0 - base, 5 * MIB);
    assert_eq!(core.reserved_bytes(), 22 * MIB);
    core.check_invariants().unwrap();
}
