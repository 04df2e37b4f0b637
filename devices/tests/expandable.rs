//! Expandable segments: growth by mapping pages, release by unmapping them, rollback of a
//! failed map, page-level invariants, and the two workloads expandable segments are for (batch
//! growth, and PyTorch's max_split_size + expandable cycle).
//!
//! The page mechanics are pinned with PyTorch's pages (`policy:pytorch`: 20 MiB large-pool
//! pages, one physical handle each); the `gpualloc` policy's 2 MiB pages, handles of several
//! pages and growth ahead are pinned in `map_ahead.rs`.

mod common;

use std::sync::Arc;

use gpualloc_accounting::AccountingBackend;
use gpualloc_devices::{AllocatorConfig, DeviceCore, Policy, StatType, TraceAction};
use gpualloc_runtime::{Backend, DeviceId, DevicePtr, StreamHandle};

const MIB: u64 = 1 << 20;
const ALL: usize = StatType::All as usize;

/// [`common::rig`], recording history.
fn rig(capacity: u64, conf: &str) -> (Arc<AccountingBackend>, DeviceCore, StreamHandle) {
    let (backend, mut core, s) = common::rig(capacity, conf);
    core.record_history(Some(10_000));
    (backend, core, s)
}

#[test]
fn segments_grow_by_pages_and_stay_contiguous() {
    let (backend, mut core, s) = rig(1 << 30, "expandable_segments:True,policy:pytorch");
    let a = core.malloc(5 * MIB, s).unwrap();
    assert_eq!(core.reserved_bytes(), 20 * MIB, "one 20 MiB page mapped");
    assert_eq!(
        core.stats().segment[ALL].current,
        0,
        "expandable segments are not counted as segments"
    );
    assert_eq!(core.stats().num_device_alloc, 1);
    // 30 MiB does not fit in the 15 MiB left: one more page is mapped right after.
    let b = core.malloc(30 * MIB, s).unwrap();
    assert_eq!(b.ptr.0, a.ptr.0 + 5 * MIB, "the segment grew in place");
    assert_eq!(core.reserved_bytes(), 40 * MIB);
    assert_eq!(backend.counts().mallocs, 0, "no cuMemAlloc-style segment");
    assert_eq!(backend.counts().maps, 2);
    core.check_invariants().unwrap();
    let snap = core.snapshot();
    assert_eq!(snap.segments.len(), 1);
    assert!(snap.segments[0].is_expandable);
    assert_eq!(snap.segments[0].total_size, 40 * MIB);
    // Small requests use their own segment with 2 MiB pages.
    let c = core.malloc(4096, s).unwrap();
    assert_eq!(core.reserved_bytes(), 42 * MIB);
    core.free(a.ptr).unwrap();
    core.free(b.ptr).unwrap();
    core.free(c.ptr).unwrap();
    core.check_invariants().unwrap();
    core.empty_cache().unwrap();
    assert_eq!(core.reserved_bytes(), 0);
    assert_eq!(backend.used(DeviceId(0)), 0);
    assert_eq!(backend.counts().unmaps, 3);
    let actions: Vec<TraceAction> = core.snapshot().trace.iter().map(|e| e.action).collect();
    assert_eq!(
        actions
            .iter()
            .filter(|a| **a == TraceAction::SegmentMap)
            .count(),
        3
    );
    assert_eq!(
        actions
            .iter()
            .filter(|a| **a == TraceAction::SegmentUnmap)
            .count(),
        2,
        "large: one run of 2 pages"
    );
    core.check_invariants().unwrap();
}

#[test]
fn release_unmaps_only_whole_pages_inside_free_blocks() {
    let (_, mut core, s) = rig(1 << 30, "expandable_segments:True,policy:pytorch");
    let a = core.malloc(10 * MIB, s).unwrap(); // [0, 10)
    let b = core.malloc(50 * MIB, s).unwrap(); // [10, 60): pages 0..3 mapped
    let c = core.malloc(5 * MIB, s).unwrap(); // [60, 65): page 3
    assert_eq!(core.reserved_bytes(), 80 * MIB);
    core.free(b.ptr).unwrap();
    core.empty_cache().unwrap();
    // Only page 1 ([20, 40)) and page 2 ([40, 60)) lie wholly inside b: 40 MiB unmapped.
    assert_eq!(core.reserved_bytes(), 40 * MIB);
    core.check_invariants().unwrap();
    // 15 MiB fits exactly in the mapped rest of page 3, after c.
    let e = core.malloc(15 * MIB, s).unwrap();
    assert_eq!(e.ptr.0, c.ptr.0 + 5 * MIB);
    // 18 MiB fits in no mapped free block: it takes the 10 MiB left mapped before the hole
    // and maps page 1 again behind it.
    let d = core.malloc(18 * MIB, s).unwrap();
    assert_eq!(d.ptr, b.ptr);
    assert_eq!(core.reserved_bytes(), 60 * MIB);
    core.check_invariants().unwrap();
    for p in [a.ptr, c.ptr, d.ptr, e.ptr] {
        core.free(p).unwrap();
    }
    core.empty_cache().unwrap();
    assert_eq!(core.reserved_bytes(), 0);
    core.check_invariants().unwrap();
}

#[test]
fn a_map_that_fails_half_way_rolls_back() {
    // 50 MiB of device memory: a 100 MiB request needs 5 pages of 20 MiB; the third fails.
    let (backend, mut core, s) = rig(50 * MIB, "expandable_segments:True,policy:pytorch");
    let err = core.malloc(100 * MIB, s).unwrap_err();
    assert!(err.is_oom(), "{err}");
    assert_eq!(
        backend.used(DeviceId(0)),
        0,
        "pages created before the failure were released"
    );
    assert_eq!(backend.counts().maps, backend.counts().unmaps);
    assert_eq!(core.reserved_bytes(), 0);
    core.check_invariants().unwrap();
    // The allocator still works afterwards.
    let a = core.malloc(30 * MIB, s).unwrap();
    assert_eq!(core.reserved_bytes(), 40 * MIB);
    core.free(a.ptr).unwrap();
}

/// A core with expandable segments on device 0 of a sim with `devices` devices, and a stream.
fn sim_rig(
    devices: u32,
) -> (
    Arc<gpualloc_sim::SimBackend>,
    Arc<dyn Backend>,
    DeviceCore,
    StreamHandle,
) {
    use gpualloc_sim::{SimBackend, SimConfig};
    let sim = SimBackend::new(SimConfig::fast(devices)).unwrap();
    let dynb: Arc<dyn Backend> = sim.clone();
    let s = dynb.stream_create(DeviceId(0)).unwrap();
    let core = DeviceCore::new(
        dynb.clone(),
        DeviceId(0),
        AllocatorConfig::parse("expandable_segments:True").unwrap(),
    )
    .unwrap();
    (sim, dynb, core, s)
}

#[test]
fn a_failed_map_on_the_sim_rolls_back_too() {
    use gpualloc_runtime::BackendError;
    use gpualloc_sim::{Fault, Op};
    let (sim, dynb, mut core, s) = sim_rig(1);
    let oom = BackendError::OutOfMemory {
        requested: 20 * MIB,
        what: "injected".into(),
    };
    // The third page fails, and so does every later one (the OOM chain's retry too).
    sim.inject(
        Op::PhysCreate,
        Fault::FailNext {
            skip: 2,
            count: u64::MAX,
            error: oom,
        },
    );
    assert!(core.malloc(100 * MIB, s).unwrap_err().is_oom());
    assert_eq!(
        sim.live_phys(),
        0,
        "the two pages made before the failure are gone"
    );
    assert_eq!(sim.counts().get(Op::PhysRelease), 2);
    assert_eq!(sim.counts().get(Op::Map), sim.counts().get(Op::Unmap));
    sim.clear_faults();
    assert_eq!(sim.used_bytes(DeviceId(0)).unwrap(), 0);
    core.check_invariants().unwrap();
    // Data written before a segment grows is still there after it grows (real mappings).
    let a = core.malloc(5 * MIB, s).unwrap();
    dynb.copy_to_device(s, a.ptr, &[0xAB; 4096]).unwrap();
    let b = core.malloc(40 * MIB, s).unwrap();
    assert_eq!(b.ptr.0, a.ptr.0 + 5 * MIB);
    let mut back = vec![0u8; 4096];
    dynb.copy_from_device(s, &mut back, a.ptr).unwrap();
    assert!(back.iter().all(|&x| x == 0xAB));
    dynb.copy_to_device(s, DevicePtr(b.ptr.0 + 40 * MIB - 4096), &[7; 4096])
        .unwrap();
    core.free(a.ptr).unwrap();
    core.free(b.ptr).unwrap();
    core.empty_cache().unwrap();
    assert_eq!(sim.live_phys(), 0);
}

/// Per-layer buffers of N×A and N×B bytes for 50 layers, then N+1, N+2, ... (the seed's
/// batch-growth workload). Returns (peak reserved, peak allocated).
fn batch_growth(conf: &str) -> (u64, u64) {
    let (_, mut core, s) = rig(64 << 30, conf);
    let (a, b) = (3 * MIB + 100 * 1024, 5 * MIB / 2);
    for n in 1..=8u64 {
        let mut held = Vec::new();
        for _layer in 0..50 {
            held.push(core.malloc(n * a, s).unwrap().ptr);
            held.push(core.malloc(n * b, s).unwrap().ptr);
        }
        for p in held {
            core.free(p).unwrap();
        }
        core.check_invariants().unwrap();
    }
    (
        core.stats().reserved_bytes[ALL].peak,
        core.stats().allocated_bytes[ALL].peak,
    )
}

#[test]
fn batch_growth_stays_within_5_percent_with_expandable_segments() {
    let (resv, alloc) = batch_growth("expandable_segments:True");
    let (resv_plain, alloc_plain) = batch_growth("");
    eprintln!(
        "expandable: reserved {} MiB / allocated {} MiB = {:.3}; plain: reserved {} MiB / allocated {} MiB = {:.3}",
        resv / MIB,
        alloc / MIB,
        resv as f64 / alloc as f64,
        resv_plain / MIB,
        alloc_plain / MIB,
        resv_plain as f64 / alloc_plain as f64
    );
    assert!(resv as f64 <= alloc as f64 * 1.05, "{resv} vs {alloc}");
    assert!(
        resv_plain as f64 > alloc_plain as f64 * 1.5,
        "plain segments need much more: {resv_plain} vs {alloc_plain}"
    );
}

/// The cycle behind PyTorch PR #193400: two 40 MiB buffers (under max_split_size) freed next
/// to each other merge into an 80 MiB free block, which PyTorch's rule then refuses to give to
/// the next 40 MiB requests, so they map fresh pages; a small buffer kept each cycle stops the
/// merged block from joining the unmapped tail. Returns (final reserved, peak allocated).
fn max_split_cycle(policy: Policy) -> (u64, u64) {
    let (_, mut core, s) = rig(
        1 << 40,
        &format!("expandable_segments:True,max_split_size_mb:64,policy:{policy}"),
    );
    let mut kept = Vec::new();
    for _cycle in 0..100 {
        let a = core.malloc(40 * MIB, s).unwrap();
        let b = core.malloc(40 * MIB, s).unwrap();
        kept.push(core.malloc(2 * MIB, s).unwrap().ptr);
        core.free(a.ptr).unwrap();
        core.free(b.ptr).unwrap();
    }
    core.check_invariants().unwrap();
    (
        core.stats().reserved_bytes[ALL].current,
        core.stats().allocated_bytes[ALL].peak,
    )
}

#[test]
fn max_split_size_with_expandable_segments_does_not_grow_without_bound() {
    let (ours, ours_alloc) = max_split_cycle(Policy::Gpualloc);
    let (torch, torch_alloc) = max_split_cycle(Policy::Pytorch);
    eprintln!(
        "after 100 cycles: reserved {} MiB (allocated peak {} MiB); with PyTorch's rule {} MiB (allocated peak {} MiB)",
        ours / MIB,
        ours_alloc / MIB,
        torch / MIB,
        torch_alloc / MIB
    );
    assert!(
        ours <= 2 * ours_alloc,
        "reserved {ours} vs allocated peak {ours_alloc}"
    );
    assert!(
        torch >= 5 * ours,
        "the cycle reproduces the growth under PyTorch's rule: {torch} vs {ours}"
    );
}

/// The rule itself, once: a freed 80 MiB expandable block with a live block after it (so it
/// cannot serve as the start of the segment's growth, PyTorch's `find_expandable_block`), and
/// a 40 MiB request under `max_split_size_mb:64`. PyTorch's policy refuses the oversize block
/// and maps 40 MiB more (large-pool pages are 20 MiB: 80 + 20 + 40); gpualloc's splits it
/// (its pages are 2 MiB, and the kept block's growth maps 1/8 of the 80 MiB mapped: 80 + 10).
#[test]
fn max_split_size_limits_expandable_blocks_only_under_pytorch_policy() {
    for (policy, reserved, same_address) in [
        (Policy::Pytorch, 140 * MIB, false),
        (Policy::Gpualloc, 90 * MIB, true),
    ] {
        let (_, mut core, s) = rig(
            1 << 40,
            &format!("expandable_segments:True,max_split_size_mb:64,policy:{policy}"),
        );
        let big = core.malloc(80 * MIB, s).unwrap();
        let _kept = core.malloc(2 * MIB, s).unwrap();
        core.free(big.ptr).unwrap();
        let small = core.malloc(40 * MIB, s).unwrap();
        assert_eq!(small.ptr == big.ptr, same_address, "{policy}");
        assert_eq!(
            core.stats().reserved_bytes[ALL].current,
            reserved,
            "{policy}"
        );
        core.check_invariants().unwrap();
    }
}

/// `add_peer`: the pages mapped so far get one access grant per run of mapped pages, every
/// later map grants the device and the peer, a growth planned off the core before the peer
/// was added grants it at commit, and the device itself, a repeat or an unknown device
/// grant nothing.
#[test]
fn a_peer_gets_access_to_mapped_and_later_pages() {
    use gpualloc_devices::{map_growth, Growth, SegmentRequest};
    use gpualloc_sim::Op;
    let (sim, dynb, mut core, s) = sim_rig(4);
    let grants = || sim.counts().get(Op::SetAccess);
    // Two runs of mapped pages: two segments (two streams), 40 MiB each.
    let s2 = dynb.stream_create(DeviceId(0)).unwrap();
    let a = core.malloc(40 * MIB, s).unwrap();
    let b = core.malloc(40 * MIB, s2).unwrap();
    let before = grants();
    core.add_peer(DeviceId(1)).unwrap();
    assert_eq!(grants() - before, 2, "one grant per run of mapped pages");
    // The device itself and a repeat: nothing.
    core.add_peer(DeviceId(0)).unwrap();
    core.add_peer(DeviceId(1)).unwrap();
    assert_eq!(grants() - before, 2);
    // An unknown device: an error, nothing granted, nothing recorded.
    assert!(core.add_peer(DeviceId(7)).is_err());
    assert!(core.add_peer(DeviceId(4)).is_err(), "4 devices: 0 to 3");
    assert_eq!(grants() - before, 2);
    // A later map: the device and the peer.
    let before = grants();
    let c = core.malloc(40 * MIB, s).unwrap();
    assert_eq!(grants() - before, 2, "device and peer");
    // A growth planned before a peer is added gets it at commit (and only it: the peers
    // known at planning were granted by the map).
    core.add_peer(DeviceId(2)).unwrap();
    core.free(c.ptr).unwrap();
    core.empty_cache().unwrap();
    let Ok(gpualloc_devices::CachedOutcome::Miss(req)) = core.try_cached(40 * MIB, s) else {
        panic!("expected a miss");
    };
    let req: SegmentRequest = req;
    let Growth::Map(plan) = core.plan_growth(&req).unwrap() else {
        panic!("expected pages to map");
    };
    core.add_peer(DeviceId(3)).unwrap();
    let before = grants();
    let handles = map_growth(dynb.as_ref(), &plan).unwrap();
    assert_eq!(
        grants() - before,
        3,
        "device and the peers known at planning"
    );
    core.commit_growth(plan, handles).unwrap();
    assert_eq!(grants() - before, 4, "the peer added meanwhile, at commit");
    core.check_invariants().unwrap();
    core.free(a.ptr).unwrap();
    core.free(b.ptr).unwrap();
    core.empty_cache().unwrap();
}

/// A segment reserves 9/8 of the device's memory (PyTorch's rule): the next segment's
/// reservation starts right after it.
#[test]
fn a_segment_reserves_nine_eighths_of_the_device() {
    let (_b, mut core, s) = rig(16 << 30, "expandable_segments:True");
    let s2 = core.backend().stream_create(DeviceId(0)).unwrap();
    core.malloc(3 * MIB, s).unwrap();
    core.malloc(3 * MIB, s2).unwrap();
    let starts: Vec<u64> = core
        .snapshot()
        .segments
        .iter()
        .filter(|seg| !seg.is_small)
        .map(|seg| seg.address)
        .collect();
    assert_eq!(starts.len(), 2, "{starts:?}");
    assert_eq!(starts[1] - starts[0], 18 << 30);
}

/// Best fit by growable size looks only at the request's stream: a smaller block of another
/// stream that comes after in the free set is never taken.
#[test]
fn best_fit_by_growable_size_stays_on_the_requests_stream() {
    let (backend, mut core, s1) = rig(1 << 30, "expandable_segments:True,policy:pytorch");
    let s2 = backend.stream_create(DeviceId(0)).unwrap();
    assert!(
        s2.raw > s1.raw,
        "s2's blocks come after s1's in the free set"
    );
    // On s2: a free 4 MiB block followed by a live one. On s1: 18 MiB free at the tail.
    let a = core.malloc(4 * MIB, s2).unwrap();
    let b = core.malloc(2 * MIB, s2).unwrap();
    core.free(a.ptr).unwrap();
    let c = core.malloc(2 * MIB, s1).unwrap();
    let d = core.malloc(3 * MIB, s1).unwrap();
    assert_eq!(d.ptr.0, c.ptr.0 + 2 * MIB, "s1's tail, not s2's block");
    core.check_invariants().unwrap();
    for p in [b.ptr, c.ptr, d.ptr] {
        core.free(p).unwrap();
    }
}
