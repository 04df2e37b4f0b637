//! Expandable growth split into plan (under the core), map (off it) and commit: the same
//! addresses and statistics as the in-place chain, rollback on a failed map, concurrent plans
//! that never overlap, and a shutdown between plan and commit that leaks nothing.
//!
//! Page counts are pinned with PyTorch's pages (`policy:pytorch`, 20 MiB each); the equivalence
//! with the in-place chain runs under both policies.

use std::sync::Arc;

use gpualloc_accounting::AccountingBackend;
use gpualloc_devices::{
    map_growth, release_reservation, AllocatorConfig, CachedOutcome, DeviceCore, Growth,
    GrowthPlan, SegmentRequest,
};
use gpualloc_runtime::{Backend, BackendError, DeviceId, StreamHandle};
use gpualloc_sim::{Fault, Op, SimBackend, SimConfig};

const MIB: u64 = 1 << 20;

fn core(backend: &Arc<dyn Backend>, conf: &str) -> DeviceCore {
    DeviceCore::new(
        backend.clone(),
        DeviceId(0),
        AllocatorConfig::parse(conf).unwrap(),
    )
    .unwrap()
}

fn miss(core: &mut DeviceCore, size: u64, s: StreamHandle) -> SegmentRequest {
    match core.try_cached(size, s).unwrap() {
        CachedOutcome::Miss(req) => req,
        CachedOutcome::Hit(a) => panic!("expected a miss, got {a:?}"),
    }
}

fn plan(core: &mut DeviceCore, req: &SegmentRequest) -> GrowthPlan {
    match core.plan_growth(req).unwrap() {
        Growth::Map(p) => p,
        Growth::InPlace => panic!("expected pages to map"),
    }
}

/// The split-phase malloc the device actor runs.
fn split_malloc(core: &mut DeviceCore, size: u64, s: StreamHandle) -> gpualloc_devices::Allocation {
    let backend = core.backend().clone();
    loop {
        let req = match core.try_cached(size, s).unwrap() {
            CachedOutcome::Hit(a) => return a,
            CachedOutcome::Miss(req) => req,
        };
        match core.plan_growth(&req).unwrap() {
            Growth::Map(p) => {
                let handles = map_growth(backend.as_ref(), &p).unwrap();
                core.commit_growth(p, handles).unwrap();
            }
            Growth::InPlace => return core.malloc_after_miss(req).unwrap(),
        }
    }
}

/// A mapped run: its size, whether small, and its blocks as (offset, size, state).
type Run = (u64, bool, Vec<(u64, u64, String)>);

/// Every mapped run (a segment as the snapshot shows it), so two cores with different
/// addresses compare.
fn layout(core: &DeviceCore) -> Vec<Run> {
    core.snapshot()
        .segments
        .iter()
        .map(|s| {
            let blocks = s
                .blocks
                .iter()
                .map(|b| (b.address - s.address, b.size, format!("{:?}", b.state)))
                .collect();
            (s.total_size, s.is_small, blocks)
        })
        .collect()
}

/// Which run `ptr` lies in (by index) and its offset there.
fn place(core: &DeviceCore, ptr: u64) -> (usize, u64) {
    let segs = core.snapshot().segments;
    let (i, s) = segs
        .iter()
        .enumerate()
        .find(|(_, s)| (s.address..s.address + s.total_size).contains(&ptr))
        .expect("inside a run");
    (i, ptr - s.address)
}

#[test]
fn split_growth_matches_the_in_place_chain() {
    for conf in [
        "expandable_segments:True",
        "expandable_segments:True,policy:pytorch",
    ] {
        split_growth_matches_the_in_place_chain_under(conf);
    }
}

fn split_growth_matches_the_in_place_chain_under(conf: &str) {
    let sizes = [
        5 * MIB,
        30 * MIB,
        4096,
        700 << 10,
        64 * MIB,
        3 * MIB,
        100 * MIB,
    ];
    let a: Arc<dyn Backend> = Arc::new(AccountingBackend::new(1, 1 << 30));
    let b: Arc<dyn Backend> = Arc::new(AccountingBackend::new(1, 1 << 30));
    let (mut in_place, mut split) = (core(&a, conf), core(&b, conf));
    let (sa, sb) = (
        a.stream_create(DeviceId(0)).unwrap(),
        b.stream_create(DeviceId(0)).unwrap(),
    );
    let mut live = Vec::new();
    for round in 0..3 {
        for (i, &size) in sizes.iter().enumerate() {
            let x = in_place.malloc(size, sa).unwrap();
            let y = split_malloc(&mut split, size, sb);
            assert_eq!(
                place(&in_place, x.ptr.0),
                place(&split, y.ptr.0),
                "{conf}: round {round}, request {i}: same place in the same mapped run"
            );
            assert_eq!(
                layout(&in_place),
                layout(&split),
                "{conf}: round {round}, request {i}: same runs and blocks"
            );
            assert_eq!(x.block_size, y.block_size);
            live.push((x.ptr, y.ptr));
            if i % 2 == 1 {
                let (p, q) = live.remove(0);
                in_place.free(p).unwrap();
                split.free(q).unwrap();
            }
            split.check_invariants().unwrap();
        }
    }
    assert_eq!(in_place.stats(), split.stats(), "identical statistics");
    assert_eq!(in_place.reserved_bytes(), split.reserved_bytes());
}

#[test]
fn a_failed_map_aborts_and_the_pages_can_be_planned_again() {
    let simb: Arc<SimBackend> = SimBackend::new(SimConfig::fast(1)).unwrap();
    let sim: Arc<dyn Backend> = simb.clone();
    let mut c = core(&sim, "expandable_segments:True,policy:pytorch");
    let s = sim.stream_create(DeviceId(0)).unwrap();
    let req = miss(&mut c, 50 * MIB, s);
    let p = plan(&mut c, &req);
    assert_eq!(p.bytes(), 60 * MIB, "three 20 MiB pages");
    simb.inject(
        Op::Map,
        Fault::FailNext {
            skip: 1,
            count: 1,
            error: BackendError::OutOfMemory {
                requested: 20 * MIB,
                what: "injected".into(),
            },
        },
    );
    assert!(map_growth(sim.as_ref(), &p).is_err());
    assert_eq!(c.abort_growth(p), None);
    c.check_invariants().unwrap();
    assert_eq!(c.reserved_bytes(), 0);
    assert_eq!(c.growing_bytes(), 0);
    simb.clear_faults();
    let a = split_malloc(&mut c, 50 * MIB, s);
    assert_eq!(c.reserved_bytes(), 60 * MIB);
    assert_eq!(c.snapshot().segments.len(), 1, "no second segment");
    c.free(a.ptr).unwrap();
    c.shutdown().unwrap();
    assert_eq!(simb.used_bytes(DeviceId(0)).unwrap(), 0);
}

#[test]
fn concurrent_plans_take_disjoint_pages_of_one_segment() {
    let acc: Arc<dyn Backend> = Arc::new(AccountingBackend::new(1, 1 << 30));
    let mut c = core(&acc, "expandable_segments:True,policy:pytorch");
    let s = acc.stream_create(DeviceId(0)).unwrap();
    let (r1, r2) = (miss(&mut c, 30 * MIB, s), miss(&mut c, 30 * MIB, s));
    let (p1, p2) = (plan(&mut c, &r1), plan(&mut c, &r2));
    assert_eq!(c.growing_bytes(), 80 * MIB);
    c.check_invariants().unwrap();
    // Commit in the other order.
    let h2 = map_growth(acc.as_ref(), &p2).unwrap();
    let h1 = map_growth(acc.as_ref(), &p1).unwrap();
    c.commit_growth(p2, h2).unwrap();
    c.commit_growth(p1, h1).unwrap();
    c.check_invariants().unwrap();
    assert_eq!(c.reserved_bytes(), 80 * MIB);
    let snap = c.snapshot();
    assert_eq!(
        snap.segments.len(),
        1,
        "one contiguous mapped run, one reservation"
    );
    let a = match c.try_cached(30 * MIB, s).unwrap() {
        CachedOutcome::Hit(a) => a,
        CachedOutcome::Miss(_) => panic!("the committed pages serve the request"),
    };
    let b = match c.try_cached(30 * MIB, s).unwrap() {
        CachedOutcome::Hit(b) => b,
        CachedOutcome::Miss(_) => panic!("and the second"),
    };
    assert_ne!(a.ptr, b.ptr);
    c.free(a.ptr).unwrap();
    c.free(b.ptr).unwrap();
    c.empty_cache().unwrap();
    assert_eq!(c.reserved_bytes(), 0);
}

#[test]
fn a_shutdown_between_plan_and_commit_leaks_nothing() {
    let simb: Arc<SimBackend> = SimBackend::new(SimConfig::fast(1)).unwrap();
    let sim: Arc<dyn Backend> = simb.clone();
    let mut c = core(&sim, "expandable_segments:True");
    let s = sim.stream_create(DeviceId(0)).unwrap();
    let req = miss(&mut c, 30 * MIB, s);
    let p = plan(&mut c, &req);
    let handles = map_growth(sim.as_ref(), &p).unwrap();
    c.shutdown().unwrap();
    assert!(
        simb.used_bytes(DeviceId(0)).unwrap() > 0,
        "the growth's pages"
    );
    let refused = c.commit_growth(p, handles).unwrap_err();
    refused.release(sim.as_ref());
    assert_eq!(simb.used_bytes(DeviceId(0)).unwrap(), 0);
    let counts = simb.counts();
    assert_eq!(
        counts.get(Op::VaFree),
        counts.get(Op::VaReserve),
        "every reservation freed"
    );
    assert_eq!(counts.get(Op::PhysRelease), counts.get(Op::PhysCreate));

    // The same when the map fails after the shutdown: abort hands the reservation back.
    let mut c = core(&sim, "expandable_segments:True");
    let req = miss(&mut c, 30 * MIB, s);
    let p = plan(&mut c, &req);
    c.shutdown().unwrap();
    let reservation = c.abort_growth(p).expect("the orphaned reservation");
    release_reservation(sim.as_ref(), DeviceId(0), reservation);
    let counts = simb.counts();
    assert_eq!(counts.get(Op::VaFree), counts.get(Op::VaReserve));
}

/// Free pages released in three steps end where the in-place release ends.
#[test]
fn released_pages_match_the_in_place_release_and_survive_a_shutdown() {
    let simb: Arc<SimBackend> = SimBackend::new(SimConfig::fast(1)).unwrap();
    let sim: Arc<dyn Backend> = simb.clone();
    let mut c = core(&sim, "expandable_segments:True,policy:pytorch");
    let s = sim.stream_create(DeviceId(0)).unwrap();
    let a = c.malloc(50 * MIB, s).unwrap();
    let b = c.malloc(30 * MIB, s).unwrap();
    let small = c.malloc(4096, s).unwrap();
    c.free(a.ptr).unwrap();
    c.free(small.ptr).unwrap();
    let reserved = c.reserved_bytes();
    let releases = c.detach_free_pages().unwrap();
    assert_eq!(releases.len(), 2, "a large and a small block gave up pages");
    let bytes: u64 = releases.iter().map(|r| r.bytes()).sum();
    assert_eq!(
        c.reserved_bytes(),
        reserved - bytes,
        "booked as released at once"
    );
    c.check_invariants().unwrap();
    // Pages being unmapped are nobody's: a growth plans other pages.
    let req = miss(&mut c, 60 * MIB, s);
    let p = plan(&mut c, &req);
    let h = map_growth(sim.as_ref(), &p).unwrap();
    simb.reset_counts();
    gpualloc_devices::release_pages(sim.as_ref(), &releases).unwrap();
    let counts = simb.counts();
    assert_eq!(
        (counts.get(Op::StreamSynchronize), counts.get(Op::Unmap)),
        (1, 3),
        "one synchronization of their stream before the unmaps"
    );
    for r in releases {
        assert_eq!(c.finish_page_release(r).unwrap(), None);
    }
    c.commit_growth(p, h).unwrap();
    c.check_invariants().unwrap();
    c.free(b.ptr).unwrap();
    let releases = c.detach_free_pages().unwrap();
    gpualloc_devices::release_pages(sim.as_ref(), &releases).unwrap();
    for r in releases {
        assert_eq!(c.finish_page_release(r).unwrap(), None);
    }
    c.check_invariants().unwrap();
    assert_eq!(c.reserved_bytes(), 0);
    assert_eq!(simb.used_bytes(DeviceId(0)).unwrap(), 0);
    let counts = simb.counts();
    assert_eq!(
        counts.get(Op::VaFree),
        2,
        "both reservations (large and small pages) freed once empty"
    );

    // A shutdown between detach and finish: the last release frees the reservation.
    simb.reset_counts();
    let x = c.malloc(30 * MIB, s).unwrap();
    c.free(x.ptr).unwrap();
    let releases = c.detach_free_pages().unwrap();
    assert_eq!(releases.len(), 1);
    c.shutdown().unwrap();
    gpualloc_devices::release_pages(sim.as_ref(), &releases).unwrap();
    let mut freed = 0;
    for r in releases {
        if let Some(res) = c.finish_page_release(r).unwrap() {
            release_reservation(sim.as_ref(), DeviceId(0), res);
            freed += 1;
        }
    }
    assert_eq!(freed, 1);
    assert_eq!(simb.used_bytes(DeviceId(0)).unwrap(), 0);
    let counts = simb.counts();
    assert_eq!((counts.get(Op::VaReserve), counts.get(Op::VaFree)), (1, 1));
    assert_eq!(
        (counts.get(Op::PhysCreate), counts.get(Op::PhysRelease)),
        (2, 2)
    );
}

#[test]
fn plans_start_from_a_free_mapped_neighbour_and_only_for_expandable_segments() {
    let acc: Arc<dyn Backend> = Arc::new(AccountingBackend::new(1, 1 << 30));
    let s = acc.stream_create(DeviceId(0)).unwrap();
    let mut plain = core(&acc, "");
    let req = miss(&mut plain, 30 * MIB, s);
    assert!(matches!(plain.plan_growth(&req).unwrap(), Growth::InPlace));
    assert!(plain.snapshot().segments.is_empty(), "nothing reserved");

    let mut c = core(&acc, "expandable_segments:True,policy:pytorch");
    let a = split_malloc(&mut c, 10 * MIB, s);
    // 10 MiB of the first page are free and mapped: 25 MiB more needs one page, not two.
    let req = miss(&mut c, 25 * MIB, s);
    let p = plan(&mut c, &req);
    assert_eq!(p.bytes(), 20 * MIB);
    let h = map_growth(acc.as_ref(), &p).unwrap();
    c.commit_growth(p, h).unwrap();
    let b = match c.try_cached(25 * MIB, s).unwrap() {
        CachedOutcome::Hit(b) => b,
        CachedOutcome::Miss(_) => panic!("served by the run"),
    };
    assert_eq!(b.ptr.0, a.ptr.0 + 10 * MIB, "right after the first request");
    c.check_invariants().unwrap();
}

#[test]
fn plans_respect_the_memory_fraction_with_growths_in_flight() {
    // 1000 MiB device, half allowed: 500 MiB, 25 pages.
    let acc: Arc<dyn Backend> = Arc::new(AccountingBackend::new(1, 1000 * MIB));
    let s = acc.stream_create(DeviceId(0)).unwrap();
    let mut c = core(
        &acc,
        "expandable_segments:True,per_process_memory_fraction:0.5",
    );
    let whole = miss(&mut c, 500 * MIB, s);
    let p = plan(&mut c, &whole);
    assert_eq!(p.bytes(), 500 * MIB, "exactly the allowed memory");
    assert_eq!(c.abort_growth(p), None);
    let (r1, r2, r3) = (
        miss(&mut c, 200 * MIB, s),
        miss(&mut c, 300 * MIB, s),
        miss(&mut c, 20 * MIB, s),
    );
    let p1 = plan(&mut c, &r1);
    let p2 = plan(&mut c, &r2);
    assert_eq!(c.growing_bytes(), 500 * MIB);
    assert!(
        matches!(c.plan_growth(&r3).unwrap(), Growth::InPlace),
        "planned growths count against the cap"
    );
    for p in [p1, p2] {
        let h = map_growth(acc.as_ref(), &p).unwrap();
        c.commit_growth(p, h).unwrap();
    }
    assert_eq!((c.reserved_bytes(), c.growing_bytes()), (500 * MIB, 0));
    let x = c.malloc(500 * MIB, s).unwrap();
    let r4 = miss(&mut c, 20 * MIB, s);
    assert!(
        matches!(c.plan_growth(&r4).unwrap(), Growth::InPlace),
        "reserved memory counts against the cap"
    );
    c.free(x.ptr).unwrap();
    c.check_invariants().unwrap();
}

#[test]
fn only_default_pool_requests_of_expandable_segments_map_pages() {
    for (conf, default_pool) in [("expandable_segments:True", true), ("", false)] {
        let backend: Arc<dyn Backend> = Arc::new(AccountingBackend::new(1, 1 << 30));
        let s = backend.stream_create(DeviceId(0)).unwrap();
        let p = backend.stream_create(DeviceId(0)).unwrap();
        let mut core =
            DeviceCore::new(backend, DeviceId(0), AllocatorConfig::parse(conf).unwrap()).unwrap();
        let CachedOutcome::Miss(req) = core.try_cached(4 << 20, s).unwrap() else {
            panic!("empty cache");
        };
        assert_eq!(req.maps_pages(&core), default_pool, "{conf:?}");
        // A private pool never expands: it takes whole segments.
        let pool = core.create_pool(false);
        core.begin_allocate_to_pool(pool, p).unwrap();
        let CachedOutcome::Miss(req) = core.try_cached(4 << 20, p).unwrap() else {
            panic!("empty pool");
        };
        assert!(!req.maps_pages(&core), "{conf:?}: private pool");
    }
}
