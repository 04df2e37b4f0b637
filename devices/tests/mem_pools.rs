//! Named private pools (`devices/src/pools/`): a pool's blocks serve only its own requests, its
//! quota is enforced with a typed error after its own cache (and only its own) is returned,
//! its usage adds up to the device's statistics, and the owners' off-core path claims
//! against the quota.

mod common;

use gpualloc_devices::{
    AllocError, CachedOutcome, DeviceCore, Growth, MemPoolId, Miss, MissIo, MissStep, PoolOptions,
    SegmentRequest, StatType,
};
use gpualloc_runtime::{DeviceId, StreamHandle};

const MIB: u64 = 1 << 20;
const ALL: usize = StatType::All as usize;

use common::{drive, drive_miss, oom, quota, rig, segment_malloc};

/// The miss of a request of `pool` (it must not hit the cache).
fn miss_in(core: &mut DeviceCore, pool: MemPoolId, size: u64, s: StreamHandle) -> SegmentRequest {
    match core.try_cached_in(pool, size, s).unwrap() {
        CachedOutcome::Miss(req) => req,
        CachedOutcome::Hit(h) => panic!("expected a miss for {size} bytes, got {h:?}"),
    }
}

/// The torch_memory_saver#85 pattern: the KV cache frees its memory, another model's weights
/// allocate; the weights must not land in the KV pool's memory, so releasing the KV pool
/// cannot release any of them.
#[test]
fn a_pools_blocks_serve_only_its_own_requests() {
    for conf in ["", "expandable_segments:True"] {
        let (backend, mut core, s) = rig(1 << 30, conf);
        let kv = core.create_named_pool("kv_cache", PoolOptions::default());
        let weights = core.create_named_pool("weights", PoolOptions::default());
        let k = core.malloc_in(kv, 8 * MIB, s).unwrap();
        assert_eq!(k.pool, Some(kv));
        assert_eq!(core.allocation(k.ptr).unwrap().pool, Some(kv));
        core.free(k.ptr).unwrap();
        // Same size, other pools: never the KV block.
        let w = core.malloc_in(weights, 8 * MIB, s).unwrap();
        let d = core.malloc(8 * MIB, s).unwrap();
        assert_ne!(w.ptr, k.ptr, "{conf}");
        assert_ne!(d.ptr, k.ptr, "{conf}");
        assert_eq!((w.pool, d.pool), (Some(weights), None));
        // Its own next request gets it back.
        let k2 = core.malloc_in(kv, 8 * MIB, s).unwrap();
        assert_eq!(k2.ptr, k.ptr, "{conf}");
        core.free(k2.ptr).unwrap();
        // Releasing the KV pool returns its memory and nothing else.
        core.release_pool(kv).unwrap();
        core.empty_cache().unwrap();
        let left = core.pool_usage(weights).unwrap();
        assert_eq!(left.allocated.all().current, 8 * MIB);
        // 1–10 MiB requests take 20 MiB segments; with expandable segments, 8 MiB of 2 MiB
        // pages (the named pool's own segment and the default pool's alike).
        let one = if conf.is_empty() { 20 * MIB } else { 8 * MIB };
        assert_eq!(left.reserved.all().current, one);
        assert!(core.pool_usage(kv).is_none(), "released and emptied");
        assert_eq!(
            core.reserved_bytes(),
            2 * one,
            "{conf}: weights and the default"
        );
        assert_eq!(backend.used(DeviceId(0)), 2 * one);
        core.check_invariants().unwrap();
        // A released pool takes no requests.
        assert_eq!(
            core.malloc_in(kv, MIB, s).unwrap_err(),
            AllocError::UnknownPool(kv.0)
        );
        let unknown = core.malloc_in(MemPoolId(99), MIB, s).unwrap_err();
        assert_eq!(unknown, AllocError::UnknownPool(99));
        assert!(!unknown.is_oom());
        // Released with a live buffer: the pool still exists, and takes no requests.
        core.release_pool(weights).unwrap();
        assert!(core.pool_usage(weights).is_some());
        assert_eq!(
            core.malloc_in(weights, MIB, s).unwrap_err(),
            AllocError::UnknownPool(weights.0)
        );
        core.free(w.ptr).unwrap();
        core.free(d.ptr).unwrap();
    }
}

#[test]
fn a_quota_fails_with_the_pools_name_and_usage() {
    let (_, mut core, s) = rig(1 << 30, "");
    let kv = core.create_named_pool("kv_cache", quota(40 * MIB));
    let a = core.malloc_in(kv, 20 * MIB, s).unwrap();
    let b = core.malloc_in(kv, 20 * MIB, s).unwrap();
    let err = core.malloc_in(kv, 20 * MIB, s).unwrap_err();
    assert_eq!(
        err,
        AllocError::PoolQuota {
            pool: "kv_cache".into(),
            quota: 40 * MIB,
            reserved: 40 * MIB,
            in_flight: 0,
            requested: 20 * MIB,
        }
    );
    assert!(err.is_oom());
    assert_eq!(
        err.to_string(),
        "memory pool \"kv_cache\" is at its quota: tried to allocate 20.00 MiB with 40.00 MiB \
         of 40.00 MiB reserved"
    );
    assert_eq!(core.stats().num_ooms, 1);
    // The default pools are not limited by it.
    let d = core.malloc(20 * MIB, s).unwrap();
    // A free in the pool makes room (from its cache).
    core.free(a.ptr).unwrap();
    let c = core.malloc_in(kv, 20 * MIB, s).unwrap();
    assert_eq!(c.ptr, a.ptr);
    for p in [b.ptr, c.ptr, d.ptr] {
        core.free(p).unwrap();
    }
    core.check_invariants().unwrap();
}

/// At its quota a pool returns its own cached segments to the device first (two 12 MiB
/// segments for a 16 MiB request under a 30 MiB quota), and never the default pools' cache.
#[test]
fn at_its_quota_a_pool_releases_its_own_cache_only() {
    let (_, mut core, s) = rig(1 << 30, "");
    let kv = core.create_named_pool("kv_cache", quota(30 * MIB));
    let other = core.malloc(12 * MIB, s).unwrap();
    core.free(other.ptr).unwrap();
    let a = core.malloc_in(kv, 12 * MIB, s).unwrap();
    let b = core.malloc_in(kv, 12 * MIB, s).unwrap();
    core.free(a.ptr).unwrap();
    core.free(b.ptr).unwrap();
    assert_eq!(
        core.pool_usage(kv).unwrap().reserved.all().current,
        24 * MIB
    );
    let c = core.malloc_in(kv, 16 * MIB, s).unwrap();
    let usage = core.pool_usage(kv).unwrap();
    assert_eq!(usage.reserved.all().current, 16 * MIB);
    assert_eq!(usage.reserved.all().peak, 24 * MIB);
    assert_eq!(usage.segments.all().current, 1);
    assert_eq!(
        core.reserved_bytes(),
        28 * MIB,
        "the default pool's cached 12 MiB segment stays"
    );
    assert_eq!(core.stats().num_ooms, 0);
    core.free(c.ptr).unwrap();
    core.check_invariants().unwrap();
}

#[test]
fn pool_usage_adds_up_to_the_device_statistics() {
    let (_, mut core, s) = rig(1 << 30, "");
    let weights = core.create_named_pool("weights", PoolOptions::default());
    let kv = core.create_named_pool("kv_cache", quota(64 * MIB));
    let w = core.malloc_in(weights, 30 * MIB, s).unwrap();
    let k: Vec<_> = (0..3)
        .map(|_| core.malloc_in(kv, 4 * MIB, s).unwrap())
        .collect();
    let small = core.malloc_in(kv, 4096, s).unwrap();
    let d = core.malloc(6 * MIB, s).unwrap();
    let (uw, uk) = (
        core.pool_usage(weights).unwrap(),
        core.pool_usage(kv).unwrap(),
    );
    assert_eq!(uw.name, "weights");
    // PyTorch's unnamed pools are named by their id.
    let plain = core.create_pool(false);
    assert_eq!(
        core.pool_usage(plain).unwrap().name,
        format!("pool {}", plain.0)
    );
    assert_eq!((uk.name.as_str(), uk.quota), ("kv_cache", Some(64 * MIB)));
    assert_eq!(uw.allocated.all().current, 30 * MIB);
    // 4 MiB requests take 20 MiB large segments; 4 KiB a 2 MiB small one.
    assert_eq!(uk.allocated.all().current, 12 * MIB + 4096);
    assert_eq!(uk.reserved.all().current, 22 * MIB);
    assert_eq!(uk.segments.all().current, 2);
    let st = core.stats();
    let default_alloc = 6 * MIB;
    assert_eq!(
        st.allocated_bytes[ALL].current,
        uw.allocated.all().current + uk.allocated.all().current + default_alloc
    );
    assert_eq!(
        st.reserved_bytes[ALL].current,
        uw.reserved.all().current + uk.reserved.all().current + 20 * MIB
    );
    for a in k {
        core.free(a.ptr).unwrap();
    }
    core.free(small.ptr).unwrap();
    let uk = core.pool_usage(kv).unwrap();
    assert_eq!(
        (uk.allocated.all().current, uk.allocated.all().peak),
        (0, 12 * MIB + 4096)
    );
    core.free(w.ptr).unwrap();
    core.free(d.ptr).unwrap();
    core.check_invariants().unwrap();
}

/// PyTorch's `use_on_oom`: the device borrows the pool's free blocks when it is full; the
/// block returns to the pool. A pool without it lends nothing.
#[test]
fn use_on_oom_lends_free_blocks_and_they_return() {
    for lend in [true, false] {
        let (_, mut core, s) = rig(40 * MIB, "");
        let spare = core.create_named_pool(
            "spare",
            PoolOptions {
                quota: None,
                use_on_oom: lend,
                unsplit: None,
            },
        );
        let p = core.malloc_in(spare, 20 * MIB, s).unwrap();
        core.free(p.ptr).unwrap();
        let d = core.malloc(20 * MIB, s).unwrap();
        let e = core.malloc(20 * MIB, s);
        match (lend, e) {
            (true, Ok(e)) => {
                assert_eq!(e.ptr, p.ptr);
                assert_eq!(e.pool, Some(spare));
                core.free(e.ptr).unwrap();
                assert_eq!(core.pool_usage(spare).unwrap().allocated.all().current, 0);
                let again = core.malloc_in(spare, 20 * MIB, s).unwrap();
                assert_eq!(again.ptr, p.ptr, "back in its pool");
                core.free(again.ptr).unwrap();
            }
            (false, Err(err)) => assert!(err.is_oom(), "{err}"),
            (lend, other) => panic!("use_on_oom {lend}: {other:?}"),
        }
        core.free(d.ptr).unwrap();
        core.check_invariants().unwrap();
    }
}

/// The owners' path (device actors): a miss off the core at its pool's quota releases that
/// pool's own cached segments (and the default pools'), never another pool's, and fails with
/// the quota error when nothing of its own helps; a claim respects the quota and counts until
/// its segment is adopted or not obtained.
#[test]
fn the_off_core_path_claims_against_the_quota() {
    let (_, mut core, s) = rig(1 << 30, "");
    let kv = core.create_named_pool("kv_cache", quota(30 * MIB));
    let other = core.create_named_pool("other", PoolOptions::default());
    let o = core.malloc_in(other, 12 * MIB, s).unwrap();
    core.free(o.ptr).unwrap();
    let a = core.malloc_in(kv, 12 * MIB, s).unwrap();
    let b = core.malloc_in(kv, 12 * MIB, s).unwrap();
    core.free(a.ptr).unwrap();
    let req = miss_in(&mut core, kv, 16 * MIB, s);
    let mut freed = Vec::new();
    let mut calls = Vec::new();
    let step = drive_miss(&mut core, Miss::off_core(req), |io| {
        calls.push(segment_malloc(io));
        if let MissIo::FreeSegments { segments, .. } = io {
            freed.extend(segments.iter().map(|seg| seg.size));
        }
        false
    });
    let MissStep::Done(c) = step else {
        panic!("expected the request served after the release");
    };
    assert_eq!(
        calls,
        [false, true],
        "24 + 16 MiB is past 30: a release first, then the segment malloc"
    );
    assert_eq!(freed, [12 * MIB], "kv's free 12 MiB segment only");
    assert_eq!(
        core.pool_usage(other).unwrap().reserved.all().current,
        12 * MIB
    );
    assert_eq!(
        core.pool_usage(kv).unwrap().reserved.all().current,
        28 * MIB
    );
    // At the quota with nothing of its own to release: the typed error, counted once.
    let req2 = miss_in(&mut core, kv, 16 * MIB, s);
    let oom_before = core.stats().num_ooms;
    let MissStep::Failed(err) = drive_miss(&mut core, Miss::off_core(req2), |_| false) else {
        panic!("16 more MiB pass the quota");
    };
    assert!(matches!(err, AllocError::PoolQuota { .. }), "{err}");
    assert_eq!(core.stats().num_ooms, oom_before + 1);
    core.free(b.ptr).unwrap();
    core.free(c.ptr).unwrap();
    core.check_invariants().unwrap();
    // Claims, on a core of their own: 12 MiB held, 16 claimed; a second claim counts the
    // first.
    let (_, mut core, s) = rig(1 << 30, "");
    let kv = core.create_named_pool("kv_cache", quota(30 * MIB));
    let b = core.malloc_in(kv, 12 * MIB, s).unwrap();
    let mut first = Miss::off_core(miss_in(&mut core, kv, 16 * MIB, s));
    let step = core.advance_miss(&mut first, None);
    let MissStep::Io(io @ MissIo::AllocSegment { .. }) = step else {
        panic!("12 + 16 MiB fits: expected a segment malloc");
    };
    assert_eq!(core.growing_bytes(), 16 * MIB);
    for size in [16 * MIB, 12 * MIB] {
        let req = miss_in(&mut core, kv, size, s);
        let MissStep::Failed(err) = drive_miss(&mut core, Miss::off_core(req), |_| false) else {
            panic!("12 + 16 + {} MiB passes the quota", size / MIB);
        };
        assert!(matches!(err, AllocError::PoolQuota { .. }), "{err}");
    }
    // A claim whose device malloc failed no longer counts.
    let end = drive(&mut core, &mut first, Some(io.fail(oom())), |_, io| {
        io.fail(oom())
    });
    assert!(matches!(end.1, MissStep::Failed(ref e) if e.is_oom()));
    assert_eq!(core.growing_bytes(), 0);
    let req = miss_in(&mut core, kv, 16 * MIB, s);
    let MissStep::Done(c) = drive_miss(&mut core, Miss::off_core(req), |_| false) else {
        panic!("12 + 16 MiB: the failed claim is gone");
    };
    assert_eq!(c.pool, Some(kv));
    assert_eq!(
        core.pool_usage(kv).unwrap().reserved.all().current,
        28 * MIB
    );
    core.free(b.ptr).unwrap();
    core.free(c.ptr).unwrap();
    core.check_invariants().unwrap();
}

/// A pool's snapshot holds its segments only; its statistics count its blocks, with the
/// peaks of its usage, and render as PyTorch's summary table.
#[test]
fn a_pools_snapshot_and_statistics_cover_it_alone() {
    let (_, mut core, s) = rig(1 << 30, "");
    let kv = core.create_named_pool("kv_cache", PoolOptions::default());
    let d = core.malloc(30 * MIB, s).unwrap();
    let a = core.malloc_in(kv, 4 * MIB, s).unwrap();
    let b = core.malloc_in(kv, 4 * MIB, s).unwrap();
    let small = core.malloc_in(kv, 1000, s).unwrap();
    core.free(b.ptr).unwrap();
    // A whole free segment is cached, not an inactive split.
    let whole = core.malloc_in(kv, 24 * MIB, s).unwrap();
    core.free(whole.ptr).unwrap();
    let snap = core.pool_snapshot(kv).unwrap();
    assert_eq!(snap.segments.len(), 3, "two large, one small segment");
    assert!(snap.segments.iter().all(|seg| seg.pool_id == (0, kv.0)));
    let st = core.pool_stats(kv).unwrap();
    let (all, small_i, large_i) = (ALL, StatType::Small as usize, StatType::Large as usize);
    assert_eq!(st.segment[all].current, 3);
    assert_eq!(
        (st.segment[small_i].current, st.segment[large_i].current),
        (1, 2)
    );
    assert_eq!(st.reserved_bytes[all].current, 46 * MIB);
    assert_eq!(st.max_split_size, core.stats().max_split_size);
    assert_eq!(st.allocated_bytes[all].current, 4 * MIB + 1024);
    assert_eq!(st.allocated_bytes[all].peak, 28 * MIB + 1024);
    assert_eq!(st.allocation[all].current, 2);
    assert_eq!(st.requested_bytes[all].current, 4 * MIB + 1000);
    assert_eq!(st.active_bytes[large_i].current, 4 * MIB);
    assert_eq!(st.inactive_split_bytes[large_i].current, 16 * MIB);
    let table = gpualloc_devices::memory_summary(DeviceId(0), &st);
    assert!(table.contains("Allocated memory"), "{table}");
    // The device counts both.
    assert_eq!(
        core.stats().reserved_bytes[ALL].current,
        30 * MIB + 46 * MIB
    );
    assert!(core.pool_snapshot(MemPoolId(42)).is_none());
    assert!(core.pool_stats(MemPoolId(42)).is_none());
    for p in [a.ptr, small.ptr, d.ptr] {
        core.free(p).unwrap();
    }
}

/// Under `expandable_segments` a named pool grows its own expandable segments, and its quota
/// counts the pages it maps: at the quota it first unmaps its own wholly free handles, then
/// fails with the typed error.
#[test]
fn named_pools_grow_expandable_segments_under_their_quota() {
    let (backend, mut core, s) = rig(1 << 30, "expandable_segments:True");
    let kv = core.create_named_pool("kv_cache", quota(40 * MIB));
    let a = core.malloc_in(kv, 12 * MIB, s).unwrap(); // [0, 12)
    let b = core.malloc_in(kv, 12 * MIB, s).unwrap(); // [12, 24)
    let c = core.malloc_in(kv, 14 * MIB, s).unwrap(); // [24, 38)
    assert_eq!((b.ptr.0, c.ptr.0), (a.ptr.0 + 12 * MIB, a.ptr.0 + 24 * MIB));
    assert_eq!(
        core.pool_usage(kv).unwrap().reserved.all().current,
        38 * MIB
    );
    let snap = core.pool_snapshot(kv).unwrap();
    assert!(snap.segments.iter().all(|seg| seg.is_expandable));
    // The default pools have segments of their own.
    let d0 = core.malloc(12 * MIB, s).unwrap();
    assert!(d0.ptr.0 < a.ptr.0 || d0.ptr.0 >= a.ptr.0 + (1 << 30));
    // 4 MiB more would pass 40.
    let err = core.malloc_in(kv, 4 * MIB, s).unwrap_err();
    assert_eq!(
        err,
        AllocError::PoolQuota {
            pool: "kv_cache".into(),
            quota: 40 * MIB,
            reserved: 38 * MIB,
            in_flight: 0,
            requested: 4 * MIB,
        }
    );
    // b's handle freed whole: at the quota it is unmapped, and the tail grows by 14 MiB.
    core.free(b.ptr).unwrap();
    let unmaps = backend.counts().unmaps;
    let e = core.malloc_in(kv, 14 * MIB, s).unwrap();
    assert_eq!(e.ptr.0, a.ptr.0 + 38 * MIB);
    assert_eq!(backend.counts().unmaps, unmaps + 1);
    let usage = core.pool_usage(kv).unwrap();
    assert_eq!(usage.reserved.all().current, 40 * MIB);
    assert_eq!(usage.reserved.all().peak, 40 * MIB);
    core.check_invariants().unwrap();
    // empty_cache keeps a pool's pages (PyTorch's pools); releasing the pool returns them.
    for p in [a.ptr, c.ptr, e.ptr] {
        core.free(p).unwrap();
    }
    core.empty_cache().unwrap();
    assert_eq!(
        core.pool_usage(kv).unwrap().reserved.all().current,
        40 * MIB
    );
    // The actors' release (off the core) leaves them too.
    assert!(core.detach_free_pages().unwrap().is_empty());
    core.release_pool(kv).unwrap();
    core.empty_cache().unwrap();
    assert!(core.pool_usage(kv).is_none());
    core.free(d0.ptr).unwrap();
    core.empty_cache().unwrap();
    assert_eq!(core.reserved_bytes(), 0);
    assert_eq!(backend.used(DeviceId(0)), 0);
    core.check_invariants().unwrap();
}

/// The quota of a pool of expandable segments, edge by edge: a growth that reaches it exactly
/// is planned (off the core) and mapped (in place), the pages ahead are kept when they reach
/// it exactly and dropped when they would pass it, and one byte more fails with the typed
/// error (counted as an OOM).
#[test]
fn an_expandable_pools_quota_is_reached_exactly_and_not_passed() {
    // Off the core: 30 MiB mapped, room for 10 MiB.
    let (_, mut core, s) = rig(1 << 30, "expandable_segments:True");
    let kv = core.create_named_pool("kv_cache", quota(40 * MIB));
    let a = core.malloc_in(kv, 30 * MIB, s).unwrap();
    for (size, planned) in [(12 * MIB, None), (10 * MIB, Some(10 * MIB))] {
        let req = miss_in(&mut core, kv, size, s);
        match (core.plan_growth(&req).unwrap(), planned) {
            (Growth::InPlace, None) => {}
            (Growth::Map(p), Some(bytes)) => {
                assert_eq!(p.bytes(), bytes);
                let _ = core.abort_growth(p);
            }
            (g, want) => panic!("{size}: {g:?}, expected {want:?}"),
        }
    }
    core.free(a.ptr).unwrap();
    core.check_invariants().unwrap();
    // In place, a 46 MiB quota (off PyTorch's 20 MiB page boundaries, where the pages ahead
    // stop anyway): 40 MiB mapped; 1/8 ahead is 5 MiB, 6 in pages, exactly the room: kept.
    let (_, mut core, s) = rig(1 << 30, "expandable_segments:True");
    let kv = core.create_named_pool("kv_cache", quota(46 * MIB));
    let a = core.malloc_in(kv, 40 * MIB, s).unwrap();
    let b = core.malloc_in(kv, 2 * MIB, s).unwrap();
    assert_eq!(
        core.pool_usage(kv).unwrap().reserved.all().current,
        46 * MIB
    );
    core.free(b.ptr).unwrap();
    core.free(a.ptr).unwrap();
    // 42 MiB mapped: 6 MiB ahead would pass 46: only the request's 2 MiB.
    let (_, mut core, s) = rig(1 << 30, "expandable_segments:True");
    let kv = core.create_named_pool("kv_cache", quota(46 * MIB));
    let a = core.malloc_in(kv, 42 * MIB, s).unwrap();
    let b = core.malloc_in(kv, 2 * MIB, s).unwrap();
    assert_eq!(
        core.pool_usage(kv).unwrap().reserved.all().current,
        44 * MIB
    );
    let c = core.malloc_in(kv, 2 * MIB, s).unwrap();
    assert_eq!(
        core.pool_usage(kv).unwrap().reserved.all().current,
        46 * MIB
    );
    let err = core.malloc_in(kv, 2 * MIB, s).unwrap_err();
    assert!(matches!(err, AllocError::PoolQuota { .. }), "{err}");
    assert_eq!(core.stats().num_ooms, 1);
    for p in [a.ptr, b.ptr, c.ptr] {
        core.free(p).unwrap();
    }
    core.check_invariants().unwrap();
}

/// A pool of whole segments under its quota keeps its cache on a miss (only a request at
/// the quota returns the pool's cached segments).
#[test]
fn under_its_quota_a_pool_keeps_its_cache() {
    let (_, mut core, s) = rig(1 << 30, "");
    let kv = core.create_named_pool("kv_cache", quota(100 * MIB));
    let a = core.malloc_in(kv, 12 * MIB, s).unwrap();
    core.free(a.ptr).unwrap();
    let b = core.malloc_in(kv, 16 * MIB, s).unwrap();
    assert_eq!(
        core.pool_usage(kv).unwrap().reserved.all().current,
        28 * MIB
    );
    core.free(b.ptr).unwrap();
}

/// A pool of expandable segments at its quota touches no other pool's memory: the default
/// pools' cached pages stay mapped (nothing is unmapped or synchronized for it).
#[test]
fn at_its_quota_an_expandable_pool_leaves_other_pools_cache_alone() {
    let (backend, mut core, s) = rig(1 << 30, "expandable_segments:True");
    let cached = core.malloc(20 * MIB, s).unwrap();
    core.free(cached.ptr).unwrap();
    let kv = core.create_named_pool("kv_cache", quota(20 * MIB));
    let a = core.malloc_in(kv, 20 * MIB, s).unwrap();
    let err = core.malloc_in(kv, 4 * MIB, s).unwrap_err();
    assert!(matches!(err, AllocError::PoolQuota { .. }), "{err}");
    assert_eq!(
        core.reserved_bytes(),
        40 * MIB,
        "the default pool's 20 MiB stay"
    );
    assert_eq!(backend.counts().unmaps, 0);
    assert_eq!(backend.counts().device_syncs, 0);
    core.free(a.ptr).unwrap();
    core.check_invariants().unwrap();
}

/// The history names a private pool on the entries of its blocks and segments (`alloc`,
/// `segment_alloc` / `segment_free`, `segment_map` / `segment_unmap`), so a replay can serve
/// each request from its pool; entries of the default pools, frees and the rest name none.
#[test]
fn history_entries_name_the_pool_of_their_block_or_segment() {
    use gpualloc_devices::TraceAction::*;
    for conf in ["expandable_segments:False", "expandable_segments:True"] {
        let (_, mut core, s) = rig(1 << 30, conf);
        let kv = core.create_named_pool("kv", PoolOptions::default());
        core.record_history(Some(100));
        let a = core.malloc_in(kv, 3 * MIB, s).unwrap();
        let b = core.malloc(3 * MIB, s).unwrap();
        core.free(a.ptr).unwrap();
        core.free(b.ptr).unwrap();
        core.release_pool(kv).unwrap();
        core.empty_cache().unwrap();
        let got: Vec<(_, u64)> = core
            .snapshot()
            .trace
            .iter()
            .map(|e| (e.action, e.pool))
            .collect();
        let (grow, shrink) = if conf.ends_with("True") {
            (SegmentMap, SegmentUnmap)
        } else {
            (SegmentAlloc, SegmentFree)
        };
        assert_eq!(
            got,
            vec![
                (grow, kv.0),
                (Alloc, kv.0),
                (grow, 0),
                (Alloc, 0),
                (FreeRequested, 0),
                (FreeCompleted, 0),
                (FreeRequested, 0),
                (FreeCompleted, 0),
                (shrink, 0),
                (shrink, kv.0),
            ],
            "[{conf}]"
        );
        assert_ne!(kv.0, 0);
    }
}

/// At a named pool's quota, a growth that maps only what the free tail lacks, and fits, comes
/// before releasing the pool's cache: a wholly free page of the pool stays mapped.
#[test]
fn at_the_quota_a_growth_that_fits_comes_before_a_release() {
    // The gpualloc policy's 2 MiB pages.
    let (_, mut core, s) = rig(1 << 30, "expandable_segments:True");
    let kv = core.create_named_pool("kv", quota(8 * MIB));
    let x = core.malloc_in(kv, 2 * MIB, s).unwrap();
    let a = core.malloc_in(kv, 3584 << 10, s).unwrap();
    assert_eq!(a.ptr.0, x.ptr.0 + 2 * MIB);
    core.free(x.ptr).unwrap();
    assert_eq!(core.reserved_bytes(), 6 * MIB);
    // 2.5 MiB: counted as new memory it would pass the quota (6 + 2.5 > 8), but the tail's
    // 512 KiB plus one more page holds it.
    let b = core.malloc_in(kv, 2560 << 10, s).unwrap();
    assert_eq!(b.ptr.0, a.ptr.0 + (3584 << 10));
    assert_eq!(core.reserved_bytes(), 8 * MIB, "x's page was not released");
    core.check_invariants().unwrap();
}

/// A snapshot lists the private pools not released, with their rules (a replay makes them
/// again from it); a pool's own snapshot lists that pool only.
#[test]
fn snapshots_list_the_pools_with_their_rules() {
    use gpualloc_devices::PoolInfo;
    let (_, mut core, _) = rig(1 << 30, "expandable_segments:True");
    let kv = core.create_named_pool("kv", quota(64 * MIB));
    let unnamed = core.create_pool(true);
    let gone = core.create_named_pool("gone", PoolOptions::default());
    core.release_pool(gone).unwrap();
    let info = |id: MemPoolId, name: &str, named: bool, options: PoolOptions| PoolInfo {
        id: id.0,
        name: name.to_string(),
        named,
        options,
    };
    let kv_info = info(kv, "kv", true, quota(64 * MIB));
    let unnamed_info = info(
        unnamed,
        &format!("pool {}", unnamed.0),
        false,
        PoolOptions {
            use_on_oom: true,
            ..PoolOptions::default()
        },
    );
    assert_eq!(core.snapshot().pools, [kv_info.clone(), unnamed_info]);
    assert_eq!(core.pool_snapshot(kv).unwrap().pools, [kv_info]);
}

/// A request a pool's quota refuses is an out-of-memory error for its user: the history
/// records it as `oom`, with the bytes the pool had left in place of the device's free bytes.
#[test]
fn a_quota_failure_is_an_oom_entry_of_the_history() {
    use gpualloc_devices::TraceAction;
    let (_, mut core, s) = rig(1 << 30, "");
    let kv = core.create_named_pool("kv_cache", quota(50 * MIB));
    let a = core.malloc_in(kv, 20 * MIB, s).unwrap();
    let b = core.malloc_in(kv, 20 * MIB, s).unwrap();
    core.record_history(Some(10));
    assert!(core.malloc_in(kv, 20 * MIB, s).unwrap_err().is_oom());
    let got: Vec<_> = core
        .snapshot()
        .trace
        .iter()
        .map(|e| (e.action, e.addr, e.size, e.stream))
        .collect();
    assert_eq!(got, [(TraceAction::Oom, 10 * MIB, 20 * MIB, s.raw)]);
    core.free(a.ptr).unwrap();
    core.free(b.ptr).unwrap();
}
