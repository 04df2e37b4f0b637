//! The two steps a replay of a history recorded off the core makes itself (`devices/src/recorded/`):
//! mapping a recorded page range, and a segment request made without a cache lookup. Pinned
//! with PyTorch's 20 MiB pages, one physical handle each.

mod common;

use std::sync::Arc;

use gpualloc_accounting::AccountingBackend;
use gpualloc_devices::{
    release_slept_pages, wait_for_pool_streams, AllocError, CachedOutcome, DeviceCore,
    DeviceSnapshot, Growth, MemPoolId, Miss, MissStep, PoolOptions, RestorePool, RestoredBlock,
    SleepMode, StatType, TraceAction,
};
use gpualloc_runtime::{Backend, DeviceId, DevicePtr, StreamHandle};

const MIB: u64 = 1 << 20;
const ALL: usize = StatType::All as usize;

/// [`common::rig`], recording history.
fn rig(capacity: u64, conf: &str) -> (Arc<AccountingBackend>, DeviceCore, StreamHandle) {
    let (backend, mut core, s) = common::rig(capacity, conf);
    core.record_history(Some(1000));
    (backend, core, s)
}

const PAGES: &str = "expandable_segments:True,policy:pytorch";

/// The free blocks of `snap` (offset from `base`, size), in MiB, in address order.
fn free_mib(snap: &DeviceSnapshot, base: u64) -> Vec<(u64, u64)> {
    snap.segments
        .iter()
        .flat_map(|seg| seg.blocks.iter())
        .filter(|b| b.requested_size == 0)
        .map(|b| ((b.address - base) / MIB, b.size / MIB))
        .collect()
}

#[test]
fn a_recorded_range_is_mapped_as_one_free_block_where_it_was() {
    let (backend, mut core, s) = rig(1 << 30, PAGES);
    let a = core.malloc(20 * MIB, s).unwrap();
    let base = a.ptr.0;
    // Pages 3 and 4, past an unmapped hole (pages 1 and 2).
    assert!(core.map_recorded_pages(base + 60 * MIB, 40 * MIB).unwrap());
    assert_eq!(core.reserved_bytes(), 60 * MIB);
    assert_eq!(backend.counts().maps, 3, "one handle per 20 MiB page");
    core.check_invariants().unwrap();
    let last = core.snapshot().trace.last().cloned().unwrap();
    assert_eq!(
        (last.action, last.addr, last.size),
        (TraceAction::SegmentMap, base + 60 * MIB, 40 * MIB)
    );
    // Page 1, inside the hole: the part after it stays unmapped.
    assert!(core.map_recorded_pages(base + 20 * MIB, 20 * MIB).unwrap());
    assert_eq!(core.reserved_bytes(), 80 * MIB);
    core.check_invariants().unwrap();
    // A snapshot shows each mapped stretch as a segment (as PyTorch's do).
    let snap = core.snapshot();
    assert_eq!(snap.segments.len(), 2);
    assert_eq!(free_mib(&snap, base), vec![(20, 20), (60, 40)]);
    // The mapped pages serve requests: best fit takes the 20 MiB block for 15 MiB.
    let b = core.malloc(15 * MIB, s).unwrap();
    assert_eq!(b.ptr.0, base + 20 * MIB);
    assert_eq!(backend.counts().maps, 4, "no new page for it");
    // Page 2 joins its free neighbours on both sides into one block.
    core.free(b.ptr).unwrap();
    assert!(core.map_recorded_pages(base + 40 * MIB, 20 * MIB).unwrap());
    core.check_invariants().unwrap();
    let big = core.malloc(80 * MIB, s).unwrap();
    assert_eq!(big.ptr.0, base + 20 * MIB);
    core.free(big.ptr).unwrap();
    core.free(a.ptr).unwrap();
    core.empty_cache().unwrap();
    assert_eq!(backend.used(DeviceId(0)), 0);
}

#[test]
fn a_range_that_is_not_whole_free_unmapped_pages_changes_nothing() {
    let (backend, mut core, s) = rig(1 << 30, PAGES);
    let a = core.malloc(20 * MIB, s).unwrap();
    let base = a.ptr.0;
    let refused = [
        (base + 20 * MIB, 0),                   // nothing
        (base + 21 * MIB, 20 * MIB),            // not at a page
        (base + 20 * MIB, 10 * MIB),            // part of a page
        (base, 20 * MIB),                       // mapped already
        (base, 40 * MIB),                       // mapped and unmapped pages
        (0x1000, 20 * MIB),                     // in no reservation
        (u64::MAX - 10 * MIB, 20 * MIB),        // past the address space
        (base + 20 * MIB, u64::MAX - 20 * MIB), // past the reservation
    ];
    for (addr, len) in refused {
        assert_eq!(
            core.map_recorded_pages(addr, len),
            Ok(false),
            "{addr:#x} {len}"
        );
        assert_eq!(core.reserved_bytes(), 20 * MIB);
        assert_eq!(backend.counts().maps, 1);
        core.check_invariants().unwrap();
    }
    core.free(a.ptr).unwrap();
}

#[test]
fn a_range_the_device_has_no_memory_for_changes_nothing() {
    let (backend, mut core, s) = rig(100 * MIB, PAGES);
    let a = core.malloc(20 * MIB, s).unwrap();
    let base = a.ptr.0;
    // Four pages fit in the 80 MiB left, five do not: the pages made are released again.
    assert_eq!(
        core.map_recorded_pages(base + 20 * MIB, 100 * MIB),
        Ok(false)
    );
    assert_eq!(core.reserved_bytes(), 20 * MIB);
    assert_eq!(backend.used(DeviceId(0)), 20 * MIB);
    core.check_invariants().unwrap();
    assert!(core.map_recorded_pages(base + 20 * MIB, 80 * MIB).unwrap());
    assert_eq!(backend.used(DeviceId(0)), 100 * MIB);
    core.check_invariants().unwrap();
    core.free(a.ptr).unwrap();
    core.shutdown().unwrap();
    assert_eq!(
        core.map_recorded_pages(base + 20 * MIB, 20 * MIB),
        Err(AllocError::Shutdown)
    );
}

#[test]
fn a_segment_request_skips_the_cache_and_takes_a_new_segment() {
    let (_, mut core, s) = rig(1 << 30, "expandable_segments:False");
    let a = core.malloc(8 * MIB, s).unwrap();
    core.free(a.ptr).unwrap();
    // The 20 MiB segment cached would serve 6 MiB; the request asks for a new one.
    let request = core.segment_request(6 * MIB, s).unwrap();
    assert_eq!(request.alloc_size(), 20 * MIB);
    assert_eq!(request.requested(), 6 * MIB);
    assert!(!request.maps_pages(&core));
    let MissStep::Done(b) = common::drive_miss(&mut core, Miss::off_core(request), |_| false)
    else {
        panic!("expected a new segment's block");
    };
    assert_ne!(b.ptr, a.ptr);
    assert_eq!(core.reserved_bytes(), 40 * MIB);
    assert_eq!(core.growing_bytes(), 0);
    core.check_invariants().unwrap();
    // Small requests get the small pool's 2 MiB segment, large ones their rounded size.
    assert_eq!(core.segment_request(4096, s).unwrap().alloc_size(), 2 * MIB);
    assert_eq!(
        core.segment_request(13 * MIB + 1, s).unwrap().alloc_size(),
        14 * MIB
    );
    // Bad input is an error and changes nothing.
    assert!(matches!(
        core.segment_request(0, s),
        Err(AllocError::InvalidSize { size: 0, .. })
    ));
    assert!(matches!(
        core.segment_request(u64::MAX, s),
        Err(AllocError::InvalidSize { .. })
    ));
    let other = StreamHandle {
        device: DeviceId(1),
        raw: s.raw,
    };
    assert!(matches!(
        core.segment_request(MIB, other),
        Err(AllocError::WrongDevice { .. })
    ));
    assert_eq!(core.reserved_bytes(), 40 * MIB);
    core.free(b.ptr).unwrap();
    core.shutdown().unwrap();
    assert_eq!(
        core.segment_request(MIB, s).err(),
        Some(AllocError::Shutdown)
    );
}

#[test]
fn a_recorded_range_stays_under_the_memory_fraction_and_a_pools_quota() {
    // 25% of 400 MiB: 100 MiB. A page planned for another request counts too.
    let conf = format!("{PAGES},per_process_memory_fraction:0.25");
    let (_backend, mut core, s) = rig(400 * MIB, &conf);
    let a = core.malloc(20 * MIB, s).unwrap();
    let base = a.ptr.0;
    let CachedOutcome::Miss(request) = core.try_cached(20 * MIB, s).unwrap() else {
        panic!("expected a miss");
    };
    let Growth::Map(plan) = core.plan_growth(&request).unwrap() else {
        panic!("expected a growth");
    };
    assert_eq!(core.growing_bytes(), 20 * MIB);
    // 20 mapped + 20 planned + 60: exactly the cap.
    assert!(core.map_recorded_pages(base + 40 * MIB, 60 * MIB).unwrap());
    assert_eq!(
        core.map_recorded_pages(base + 100 * MIB, 20 * MIB),
        Ok(false)
    );
    assert_eq!(core.reserved_bytes(), 80 * MIB);
    assert!(core.abort_growth(plan).is_none());
    core.check_invariants().unwrap();

    // A pool's quota counts its own pages.
    let (_backend, mut core, s) = rig(1 << 30, PAGES);
    let kv = core.create_named_pool("kv", common::quota(60 * MIB));
    let a = core.malloc_in(kv, 20 * MIB, s).unwrap();
    let base = a.ptr.0;
    // Past the quota: refused before anything is cut (the unmapped pages from 20 MiB stay one
    // block, so a range across 40 MiB maps next).
    assert_eq!(
        core.map_recorded_pages(base + 40 * MIB, 60 * MIB),
        Ok(false)
    );
    assert!(core.map_recorded_pages(base + 20 * MIB, 40 * MIB).unwrap());
    assert_eq!(
        core.map_recorded_pages(base + 60 * MIB, 20 * MIB),
        Ok(false)
    );
    assert_eq!(core.pool_usage(kv).unwrap().reserved[ALL].current, 60 * MIB);
    core.check_invariants().unwrap();
}

#[test]
fn a_sleeping_pools_range_is_not_mapped() {
    let (backend, mut core, s) = rig(1 << 30, PAGES);
    let w = core.create_named_pool("weights", PoolOptions::default());
    let a = core.malloc_in(w, 20 * MIB, s).unwrap();
    let base = a.ptr.0;
    let plan = core.begin_sleep(w, SleepMode::Discard).unwrap();
    wait_for_pool_streams(backend.as_ref(), &plan).unwrap();
    release_slept_pages(backend.as_ref(), &plan);
    assert!(core.finish_sleep(plan).is_empty());
    let maps = backend.counts().maps;
    assert_eq!(
        core.map_recorded_pages(base + 20 * MIB, 20 * MIB),
        Ok(false)
    );
    assert_eq!(backend.counts().maps, maps);
    core.check_invariants().unwrap();
}

#[test]
fn an_expandable_segment_is_restored_with_its_runs_and_live_blocks() {
    let (backend, mut core, s) = rig(1 << 30, PAGES);
    let base = 0x7100_0000_0000;
    backend.place_next(DeviceId(0), base);
    let block = |at: u64, size: u64| RestoredBlock {
        addr: base + at * MIB,
        size: size * MIB,
        requested: size * MIB - 100,
    };
    // A block crossing from one run to the one beside it; two blocks side by side at the
    // start of a run, one at its end; a run reaching the segment's end.
    let live = [
        block(25, 5),
        block(35, 20),
        block(100, 4),
        block(104, 2),
        block(114, 6),
    ];
    let runs = [
        (base + 20 * MIB, 20 * MIB),
        (base + 40 * MIB, 20 * MIB),
        (base + 100 * MIB, 20 * MIB),
        (base + 180 * MIB, 20 * MIB),
    ];
    let placed = core
        .restore_expandable(
            base,
            200 * MIB,
            s,
            RestorePool::default_pool(false),
            &runs,
            &live,
        )
        .unwrap();
    assert_eq!(placed.0, base);
    core.check_invariants().unwrap();
    assert_eq!(core.reserved_bytes(), 80 * MIB);
    assert_eq!(core.stats().allocated_bytes[ALL].current, 37 * MIB);
    assert_eq!(core.stats().requested_bytes[ALL].current, 37 * MIB - 500);
    let a = core.allocation(DevicePtr(base + 35 * MIB)).unwrap();
    assert_eq!((a.block_size, a.size), (20 * MIB, 20 * MIB - 100));
    assert_eq!(
        free_mib(&core.snapshot(), base),
        vec![(20, 5), (30, 5), (55, 5), (106, 8), (180, 20)]
    );
    // The history's later pages grow the same segment; frees merge across the runs.
    assert!(core.map_recorded_pages(base + 60 * MIB, 20 * MIB).unwrap());
    core.free(DevicePtr(base + 35 * MIB)).unwrap();
    let big = core.malloc(50 * MIB, s).unwrap();
    assert_eq!(big.ptr.0, base + 30 * MIB);
    core.check_invariants().unwrap();
    for at in [30, 25, 100, 104, 114] {
        core.free(DevicePtr(base + at * MIB)).unwrap();
    }
    core.empty_cache().unwrap();
    assert_eq!(backend.used(DeviceId(0)), 0);
}

#[test]
fn a_restore_with_bad_runs_or_blocks_reserves_nothing() {
    let (backend, mut core, s) = rig(1 << 30, PAGES);
    let base = 0x7100_0000_0000;
    let block = |at: u64, size: u64| RestoredBlock {
        addr: base + at,
        size,
        requested: size,
    };
    type Case = (u64, Vec<(u64, u64)>, Vec<RestoredBlock>);
    let cases: [Case; 9] = [
        // empty
        (0, vec![], vec![]),
        // not at a page
        (200 * MIB, vec![(base + MIB, 20 * MIB)], vec![]),
        // no pages
        (200 * MIB, vec![(base, 0)], vec![]),
        // overlapping runs
        (
            200 * MIB,
            vec![(base, 40 * MIB), (base + 20 * MIB, 20 * MIB)],
            vec![],
        ),
        // past the end
        (200 * MIB, vec![(base + 180 * MIB, 40 * MIB)], vec![]),
        // a block past its run, or before the first
        (
            200 * MIB,
            vec![(base, 20 * MIB)],
            vec![block(10 * MIB, 20 * MIB)],
        ),
        (
            200 * MIB,
            vec![(base + 20 * MIB, 20 * MIB)],
            vec![block(0, MIB)],
        ),
        // a block across unmapped pages between two runs
        (
            200 * MIB,
            vec![(base, 20 * MIB), (base + 40 * MIB, 20 * MIB)],
            vec![block(10 * MIB, 40 * MIB)],
        ),
        // overlapping blocks
        (
            200 * MIB,
            vec![(base, 20 * MIB)],
            vec![block(0, 8 * MIB), block(4 * MIB, MIB)],
        ),
    ];
    for (size, runs, live) in cases {
        let r = core.restore_expandable(
            base,
            size,
            s,
            RestorePool::default_pool(false),
            &runs,
            &live,
        );
        assert!(
            matches!(r, Err(AllocError::InvalidSize { .. })),
            "{runs:?} {live:?}: {r:?}"
        );
        assert_eq!(backend.counts().maps, 0);
        assert_eq!(core.snapshot().segments.len(), 0);
        core.check_invariants().unwrap();
    }
    let (_backend, mut core, s) = rig(1 << 30, "expandable_segments:False");
    assert!(matches!(
        core.restore_expandable(
            base,
            200 * MIB,
            s,
            RestorePool::default_pool(false),
            &[],
            &[]
        ),
        Err(AllocError::NotSupported(_))
    ));
}

/// A `segment_free` of the history releases exactly the segment it names, if it is one free
/// block: not its neighbours, not a segment with a block allocated or a free pending on
/// stream events, not an expandable segment or an address inside a segment.
#[test]
fn a_recorded_segment_free_releases_that_segment_only() {
    let (backend, mut core, s) = rig(1 << 30, "expandable_segments:False");
    let other = backend.stream_create(DeviceId(0)).unwrap();
    let a = core.malloc(20 * MIB, s).unwrap();
    let b = core.malloc(20 * MIB, s).unwrap();
    let c = core.malloc(8 * MIB, s).unwrap();
    let d = core.malloc(20 * MIB, s).unwrap();
    for p in [a.ptr, b.ptr] {
        core.free(p).unwrap();
    }
    // `d` was used on another stream: its free waits for that stream's event.
    core.record_stream(d.ptr, other).unwrap();
    core.free(d.ptr).unwrap();
    assert_eq!(core.reserved_bytes(), 80 * MIB);
    let frees = core.stats().num_device_free;
    assert!(core.release_recorded_segment(a.ptr.0).unwrap());
    assert_eq!(core.reserved_bytes(), 60 * MIB, "a's segment, not b's");
    assert_eq!(core.stats().num_device_free, frees + 1);
    assert!(
        !core.release_recorded_segment(a.ptr.0).unwrap(),
        "released once"
    );
    assert!(
        !core.release_recorded_segment(c.ptr.0).unwrap(),
        "a block is allocated in c's segment"
    );
    assert!(
        !core.release_recorded_segment(d.ptr.0).unwrap(),
        "d's free is pending"
    );
    assert!(!core.release_recorded_segment(b.ptr.0 + MIB).unwrap());
    assert!(!core.release_recorded_segment(0).unwrap());
    assert_eq!(core.reserved_bytes(), 60 * MIB);
    core.free(c.ptr).unwrap();
    assert!(core.release_recorded_segment(c.ptr.0).unwrap(), "free now");
    assert_eq!(core.reserved_bytes(), 40 * MIB);
    let released: Vec<u64> = core
        .snapshot()
        .trace
        .iter()
        .filter(|e| e.action == TraceAction::SegmentFree)
        .map(|e| e.addr)
        .collect();
    assert_eq!(released, [a.ptr.0, c.ptr.0]);
    core.check_invariants().unwrap();
    core.shutdown().unwrap();
    assert!(matches!(
        core.release_recorded_segment(b.ptr.0),
        Err(AllocError::Shutdown)
    ));

    // An expandable segment is not released this way (its pages go by `segment_unmap`).
    let (_backend, mut core, s) = rig(1 << 30, PAGES);
    let e = core.malloc(20 * MIB, s).unwrap();
    core.free(e.ptr).unwrap();
    assert!(!core.release_recorded_segment(e.ptr.0).unwrap());
    assert_eq!(core.reserved_bytes(), 20 * MIB);
}

/// The gpualloc policy's pages (2 MiB, one physical handle per growth).
const FINE: &str = "expandable_segments:True,policy:gpualloc";

/// A `segment_unmap` of the history unmaps exactly the pages it names, when they are whole
/// handles of one free mapped block; a range that is not (part of a handle, a block in use,
/// pages not mapped, not page-aligned, outside any segment) changes nothing. The reservation
/// goes when nothing in it is mapped.
#[test]
fn a_recorded_unmap_unmaps_whole_handles_of_a_free_block_only() {
    let (_backend, mut core, s) = rig(1 << 30, FINE);
    // Two growths: 6 MiB (one handle) for a, 4 MiB (one handle) for b.
    let a = core.malloc(6 * MIB, s).unwrap();
    let b = core.malloc(4 * MIB, s).unwrap();
    let base = a.ptr.0;
    assert_eq!(b.ptr.0, base + 6 * MIB);
    assert_eq!(core.reserved_bytes(), 10 * MIB);
    core.free(a.ptr).unwrap();
    assert!(
        !core.unmap_recorded_pages(base, 2 * MIB).unwrap(),
        "part of a's handle"
    );
    assert!(
        !core.unmap_recorded_pages(base, 10 * MIB).unwrap(),
        "b is allocated"
    );
    for (addr, len) in [
        (base + 1, 6 * MIB),
        (base, 0),
        (base, MIB),
        (0x1000, 2 * MIB),
    ] {
        assert!(!core.unmap_recorded_pages(addr, len).unwrap());
    }
    assert_eq!(core.reserved_bytes(), 10 * MIB);
    let frees = core.stats().num_device_free;
    assert!(core.unmap_recorded_pages(base, 6 * MIB).unwrap());
    assert_eq!(core.reserved_bytes(), 4 * MIB);
    assert_eq!(core.stats().num_device_free, frees + 1);
    assert!(
        !core.unmap_recorded_pages(base, 6 * MIB).unwrap(),
        "not mapped any more"
    );
    core.check_invariants().unwrap();
    core.free(b.ptr).unwrap();
    assert!(core.unmap_recorded_pages(base + 6 * MIB, 4 * MIB).unwrap());
    assert_eq!(core.reserved_bytes(), 0);
    assert!(
        core.snapshot().segments.is_empty(),
        "the reservation went with the last pages"
    );
    let unmaps: Vec<(u64, u64)> = core
        .snapshot()
        .trace
        .iter()
        .filter(|e| e.action == TraceAction::SegmentUnmap)
        .map(|e| ((e.addr - base) / MIB, e.size / MIB))
        .collect();
    assert_eq!(unmaps, [(0, 6), (6, 4)]);
    core.shutdown().unwrap();
    assert!(matches!(
        core.unmap_recorded_pages(base, 2 * MIB),
        Err(AllocError::Shutdown)
    ));

    // PyTorch's 20 MiB pages, from a reservation that is 2 MiB aligned only.
    let (_backend, mut core, s) = rig(1 << 30, PAGES);
    let a = core.malloc(20 * MIB, s).unwrap();
    let b = core.malloc(20 * MIB, s).unwrap();
    core.free(a.ptr).unwrap();
    assert!(!core
        .unmap_recorded_pages(a.ptr.0 + 2 * MIB, 20 * MIB)
        .unwrap());
    assert!(core.unmap_recorded_pages(a.ptr.0, 20 * MIB).unwrap());
    assert_eq!(core.reserved_bytes(), 20 * MIB);
    core.free(b.ptr).unwrap();
}

/// Pages restored from a recorded state get one physical handle each (where the live
/// handles started and ended is not recorded), so any whole pages of a free block can be
/// unmapped as the history says, even under the gpualloc policy, whose growths map one handle
/// for up to 20 MiB.
#[test]
fn restored_pages_are_one_handle_each() {
    let (backend, mut core, s) = rig(1 << 30, FINE);
    let base = 0x7100_0000_0000;
    backend.place_next(DeviceId(0), base);
    let live = [RestoredBlock {
        addr: base + 6 * MIB,
        size: 4 * MIB,
        requested: 4 * MIB,
    }];
    let placed = core
        .restore_expandable(
            base,
            100 * MIB,
            s,
            RestorePool::default_pool(false),
            &[(base, 10 * MIB)],
            &live,
        )
        .unwrap();
    assert_eq!(placed.0, base);
    assert!(core.unmap_recorded_pages(base + 2 * MIB, 2 * MIB).unwrap());
    assert!(core.unmap_recorded_pages(base, 2 * MIB).unwrap());
    assert_eq!(core.reserved_bytes(), 6 * MIB);
    core.check_invariants().unwrap();
    core.free(DevicePtr(base + 6 * MIB)).unwrap();
    assert!(core.unmap_recorded_pages(base + 4 * MIB, 6 * MIB).unwrap());
    assert_eq!(backend.used(DeviceId(0)), 0);
}

/// A restored segment of a named pool is the pool's: its usage counts it, the pool's
/// requests use its free space, the default pools' do not. A pool that does not exist or was
/// released is refused before anything is reserved.
#[test]
fn a_segment_restored_in_a_named_pool_serves_that_pool_only() {
    for conf in [PAGES, "expandable_segments:False"] {
        let (backend, mut core, s) = rig(1 << 30, conf);
        let kv = core.create_named_pool("kv", PoolOptions::default());
        let gone = core.create_named_pool("gone", PoolOptions::default());
        core.release_pool(gone).unwrap();
        let base = 0x7100_0000_0000;
        let live = [RestoredBlock {
            addr: base,
            size: 4 * MIB,
            requested: 4 * MIB,
        }];
        let expandable = conf == PAGES;
        let restore = |core: &mut DeviceCore, private| {
            let target = RestorePool {
                private,
                small: false,
            };
            backend.place_next(DeviceId(0), base);
            let r = if expandable {
                core.restore_expandable(base, 200 * MIB, s, target, &[(base, 20 * MIB)], &live)
            } else {
                core.restore_segment(base, 20 * MIB, s, target, &live)
            };
            backend.clear_placement(DeviceId(0));
            r
        };
        for bad in [gone, MemPoolId(99)] {
            assert_eq!(
                restore(&mut core, Some(bad)),
                Err(AllocError::UnknownPool(bad.0)),
                "[{conf}]"
            );
            assert_eq!(core.reserved_bytes(), 0, "[{conf}]");
        }
        assert_eq!(
            restore(&mut core, Some(kv)),
            Ok(DevicePtr(base)),
            "[{conf}]"
        );
        let usage = core.pool_usage(kv).unwrap();
        assert_eq!(usage.reserved[ALL].current, 20 * MIB, "[{conf}]");
        assert_eq!(usage.allocated[ALL].current, 4 * MIB, "[{conf}]");
        let other = core.malloc(8 * MIB, s).unwrap();
        assert!(
            other.ptr.0 >= base + 20 * MIB || other.ptr.0 < base,
            "[{conf}] the default pools have no use of it"
        );
        let mine = core.malloc_in(kv, 8 * MIB, s).unwrap();
        assert_eq!(mine.ptr.0, base + 4 * MIB, "[{conf}]");
        core.check_invariants().unwrap();
    }
}

/// A restored live block of an expandable segment at or over `max_split_size` counts as an
/// oversize allocation, as a malloc's does, and its free takes the count back to zero.
#[test]
fn a_restored_oversize_block_counts_as_an_oversize_allocation() {
    let (backend, mut core, s) = rig(1 << 30, "expandable_segments:True,max_split_size_mb:40");
    let base = 0x7200_0000_0000;
    backend.place_next(DeviceId(0), base);
    let live = [RestoredBlock {
        addr: base,
        size: 60 * MIB,
        requested: 60 * MIB - 100,
    }];
    core.restore_expandable(
        base,
        80 * MIB,
        s,
        RestorePool::default_pool(false),
        &[(base, 80 * MIB)],
        &live,
    )
    .unwrap();
    assert_eq!(core.stats().oversize_allocations.current, 1);
    core.free(DevicePtr(base)).unwrap();
    assert_eq!(core.stats().oversize_allocations.current, 0);
    assert_eq!(core.stats().oversize_allocations.peak, 1);
    core.check_invariants().unwrap();
}

/// A recorded map and unmap in the off-core owner's steps: planning the map and detaching the
/// pages change the books only (no driver call), the caller makes the calls, and the commit
/// or finish books them; meanwhile the planned pages serve no request and count against the
/// memory-fraction cap as a growth's do.
#[test]
fn a_recorded_map_and_unmap_split_into_the_steps_an_off_core_owner_takes() {
    let (backend, mut core, s) = rig(1 << 30, PAGES);
    let a = core.malloc(20 * MIB, s).unwrap();
    let base = a.ptr.0;
    let maps = backend.counts().maps;
    let plan = core
        .plan_recorded_map(base + 20 * MIB, 40 * MIB)
        .unwrap()
        .expect("pages 1 and 2 are free and unmapped");
    assert_eq!(plan.bytes(), 40 * MIB);
    assert_eq!(backend.counts().maps, maps, "no driver call while planning");
    assert_eq!(core.growing_bytes(), 40 * MIB, "in flight until committed");
    assert_eq!(core.reserved_bytes(), 20 * MIB);
    assert!(
        core.plan_recorded_map(base + 40 * MIB, 20 * MIB)
            .unwrap()
            .is_none(),
        "pages being mapped are planned once"
    );
    let mapped = gpualloc_devices::map_growth(backend.as_ref(), &plan).unwrap();
    core.commit_growth(plan, mapped).unwrap();
    assert_eq!(
        backend.counts().maps,
        maps + 2,
        "one handle per 20 MiB page"
    );
    assert_eq!((core.growing_bytes(), core.reserved_bytes()), (0, 60 * MIB));
    core.check_invariants().unwrap();
    assert_eq!(free_mib(&core.snapshot(), base), vec![(20, 40)]);
    // The unmap of page 2: detached, then released off the core, then finished.
    let unmaps = backend.counts().unmaps;
    let release = core
        .detach_recorded_pages(base + 40 * MIB, 20 * MIB)
        .unwrap()
        .expect("a whole handle of a free block");
    assert_eq!(release.bytes(), 20 * MIB);
    assert_eq!(
        core.reserved_bytes(),
        40 * MIB,
        "booked as released at once"
    );
    assert_eq!(
        backend.counts().unmaps,
        unmaps,
        "no driver call while detaching"
    );
    assert!(
        core.detach_recorded_pages(base + 40 * MIB, 20 * MIB)
            .unwrap()
            .is_none(),
        "pages being unmapped are detached once"
    );
    gpualloc_devices::release_pages(backend.as_ref(), std::slice::from_ref(&release)).unwrap();
    assert_eq!(backend.counts().unmaps, unmaps + 1);
    assert_eq!(core.finish_page_release(release).unwrap(), None);
    core.check_invariants().unwrap();
    assert_eq!(free_mib(&core.snapshot(), base), vec![(20, 20)]);
    // The pages can be mapped again where the history maps them next.
    assert!(core.map_recorded_pages(base + 40 * MIB, 20 * MIB).unwrap());
    assert_eq!(free_mib(&core.snapshot(), base), vec![(20, 40)]);
    core.check_invariants().unwrap();
}

/// Pages restored from a recorded state are not fresh (`Block::fresh`): whether a request
/// took from them before recording began is not in the snapshot, and the live allocator had
/// served requests from them. So a restored free run at the end of the reserved range, with
/// no unmapped page after it, is no tail for the placement rule: a request that would leave a
/// dead remainder in it passes over it and grows the segment into the gap before it.
/// (Restored as fresh, [8, 12) took the request.)
#[test]
fn a_restored_free_run_is_no_tail() {
    let (backend, mut core, s) = rig(1 << 30, FINE);
    let base = 0x7100_0000_0000;
    backend.place_next(DeviceId(0), base);
    let live = [RestoredBlock {
        addr: base,
        size: 4 * MIB,
        requested: 4 * MIB,
    }];
    core.restore_expandable(
        base,
        12 * MIB,
        s,
        RestorePool::default_pool(false),
        &[(base, 4 * MIB), (base + 8 * MIB, 4 * MIB)],
        &live,
    )
    .unwrap();
    // 3.75 MiB would leave 256 KiB of the free [8, 12).
    let a = core.malloc(3840 << 10, s).unwrap();
    assert_eq!(a.ptr.0, base + 4 * MIB);
    core.check_invariants().unwrap();
}
