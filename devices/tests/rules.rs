//! PyTorch's allocation rules, each pinned with concrete sizes, on the accounting backend.

use std::sync::Arc;

use gpualloc_accounting::AccountingBackend;
use gpualloc_devices::{AllocError, AllocatorConfig, DeviceCore, StatType};
use gpualloc_runtime::{Backend, DeviceId, DevicePtr, StreamHandle};

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
const ALL: usize = StatType::All as usize;
const SMALL: usize = StatType::Small as usize;
const LARGE: usize = StatType::Large as usize;

struct Rig {
    backend: Arc<AccountingBackend>,
    core: DeviceCore,
    s0: StreamHandle,
    s1: StreamHandle,
}

fn rig_with(capacity: u64, conf: &str, manual_events: bool) -> Rig {
    let backend = Arc::new(if manual_events {
        AccountingBackend::manual_events(2, capacity)
    } else {
        AccountingBackend::new(2, capacity)
    });
    let dynb: Arc<dyn Backend> = backend.clone();
    let s0 = dynb.stream_create(DeviceId(0)).unwrap();
    let s1 = dynb.stream_create(DeviceId(0)).unwrap();
    let core = DeviceCore::new(dynb, DeviceId(0), AllocatorConfig::parse(conf).unwrap()).unwrap();
    Rig {
        backend,
        core,
        s0,
        s1,
    }
}

fn rig() -> Rig {
    rig_with(64 * GIB, "", false)
}

impl Rig {
    fn check(&self) {
        self.core.check_invariants().unwrap();
    }
}

#[test]
fn small_request_packs_into_a_2mib_segment() {
    let mut r = rig();
    let a = r.core.malloc(600 * KIB, r.s0).unwrap();
    let b = r.core.malloc(600 * KIB, r.s0).unwrap();
    assert_eq!(a.block_size, 600 * KIB);
    assert_eq!(
        b.ptr.0,
        a.ptr.0 + 600 * KIB,
        "second request carved from the same segment"
    );
    let st = r.core.stats();
    assert_eq!(st.reserved_bytes[SMALL].current, 2 * MIB);
    assert_eq!(st.reserved_bytes[LARGE].current, 0);
    assert_eq!(st.allocated_bytes[ALL].current, 1200 * KIB);
    assert_eq!(st.inactive_split[SMALL].current, 1);
    assert_eq!(st.inactive_split_bytes[SMALL].current, 2 * MIB - 1200 * KIB);
    assert_eq!(st.num_device_alloc, 1);
    assert_eq!(r.backend.counts().mallocs, 1);
    r.check();
}

#[test]
fn midsize_request_gets_a_20mib_segment_and_splits() {
    let mut r = rig();
    let a = r.core.malloc(5 * MIB, r.s0).unwrap();
    let b = r.core.malloc(5 * MIB, r.s0).unwrap();
    assert_eq!(b.ptr.0, a.ptr.0 + 5 * MIB);
    assert_eq!(r.core.stats().reserved_bytes[LARGE].current, 20 * MIB);
    assert_eq!(r.backend.counts().mallocs, 1);
    // 12 MiB: at least 10 MiB, so its own segment rounded to 2 MiB, not the 10 MiB left.
    let c = r.core.malloc(11 * MIB + 1, r.s0).unwrap();
    // 11 MiB + 512 in a 12 MiB segment: the rest is under 1 MiB, so no split.
    assert_eq!(c.block_size, 12 * MIB);
    assert_eq!(
        r.core.stats().reserved_bytes[LARGE].current,
        20 * MIB + 12 * MIB
    );
    r.check();
}

#[test]
fn large_pool_remainder_of_1mib_or_less_is_not_split() {
    let mut r = rig();
    let a = r.core.malloc(19 * MIB + 512 * KIB, r.s0).unwrap();
    assert_eq!(a.size, 19 * MIB + 512 * KIB);
    assert_eq!(a.block_size, 20 * MIB, "whole segment handed out");
    assert_eq!(r.core.stats().active_bytes[LARGE].current, 20 * MIB);
    assert_eq!(r.core.stats().inactive_split[LARGE].current, 0);
    r.check();
}

#[test]
fn oversize_blocks_are_never_split_nor_given_to_small_requests() {
    let mut r = rig_with(64 * GIB, "max_split_size_mb:512", false);
    let big = r.core.malloc(GIB, r.s0).unwrap();
    assert_eq!(r.core.stats().oversize_allocations.current, 1);
    assert_eq!(r.core.stats().oversize_segments.current, 1);
    assert!(big.oversize && r.core.allocation(big.ptr).is_some_and(|a| a.oversize));
    r.core.free(big.ptr).unwrap();
    // A 100 MiB request must not take the cached 1 GiB block.
    let small = r.core.malloc(100 * MIB, r.s0).unwrap();
    assert_ne!(small.ptr, big.ptr);
    assert!(!small.oversize && r.core.allocation(small.ptr).is_some_and(|a| !a.oversize));
    // Exactly `max_split_size` is oversize.
    let edge = r.core.malloc(512 * MIB, r.s0).unwrap();
    assert!(r.core.allocation(edge.ptr).is_some_and(|a| a.oversize));
    r.core.free(edge.ptr).unwrap();
    // 600 MiB >= max_split, but 1 GiB >= 600 MiB + 20 MiB: too much waste, new segment.
    let mid = r.core.malloc(600 * MIB, r.s0).unwrap();
    assert_ne!(mid.ptr, big.ptr);
    // 1010 MiB: within max_non_split_rounding (20 MiB) of 1 GiB, reused whole, not split.
    let near = r.core.malloc(1010 * MIB, r.s0).unwrap();
    assert_eq!(near.ptr, big.ptr);
    assert_eq!(near.block_size, GIB, "handed out whole");
    assert_eq!(
        r.core.stats().active_bytes[LARGE].current,
        100 * MIB + 600 * MIB + GIB
    );
    assert_eq!(
        r.core.stats().inactive_split[LARGE].current,
        0,
        "each request filled its own segment"
    );
    r.check();
}

/// A request of exactly `max_split_size` is a large request (PyTorch's `p.size() <
/// max_split_size` is strict): it may take a cached oversize block within
/// `max_non_split_rounding` of its size, not a new segment.
#[test]
fn a_request_of_exactly_max_split_size_may_take_an_oversize_block() {
    let mut r = rig_with(64 * GIB, "max_split_size_mb:512", false);
    let big = r.core.malloc(520 * MIB, r.s0).unwrap();
    r.core.free(big.ptr).unwrap();
    let exact = r.core.malloc(512 * MIB, r.s0).unwrap();
    assert_eq!(
        exact.ptr, big.ptr,
        "the cached 520 MiB block, 8 MiB of waste"
    );
    assert_eq!(exact.block_size, 520 * MIB, "handed out whole");
    assert_eq!(r.core.reserved_bytes(), 520 * MIB, "no new segment");
    r.core.free(exact.ptr).unwrap();
    r.check();
}

#[test]
fn max_non_split_rounding_is_configurable() {
    let mut r = rig_with(
        64 * GIB,
        "max_split_size_mb:512,max_non_split_rounding_mb:500",
        false,
    );
    let big = r.core.malloc(GIB, r.s0).unwrap();
    r.core.free(big.ptr).unwrap();
    assert_eq!(r.core.malloc(600 * MIB, r.s0).unwrap().ptr, big.ptr);
    r.check();
}

#[test]
fn frees_merge_neighbours_and_empty_cache_returns_everything() {
    let mut r = rig();
    let a = r.core.malloc(5 * MIB, r.s0).unwrap();
    let b = r.core.malloc(5 * MIB, r.s0).unwrap();
    let c = r.core.malloc(5 * MIB, r.s0).unwrap();
    r.core.free(b.ptr).unwrap();
    r.check();
    assert_eq!(
        r.core.stats().inactive_split[LARGE].current,
        2,
        "b and the tail"
    );
    r.core.free(a.ptr).unwrap();
    assert_eq!(
        r.core.stats().inactive_split[LARGE].current,
        2,
        "a merged into b"
    );
    assert_eq!(r.core.stats().inactive_split_bytes[LARGE].current, 15 * MIB);
    r.core.free(c.ptr).unwrap();
    assert_eq!(
        r.core.stats().inactive_split[LARGE].current,
        0,
        "one whole free segment"
    );
    r.check();
    r.core.empty_cache().unwrap();
    assert_eq!(r.core.stats().reserved_bytes[ALL].current, 0);
    assert_eq!(r.core.stats().num_device_free, 1);
    assert_eq!(r.backend.used(DeviceId(0)), 0);
    r.check();
}

#[test]
fn best_fit_prefers_the_smallest_then_the_lowest_address() {
    let mut r = rig();
    // Three segments' worth of 12 MiB blocks; free two of equal size and one larger.
    let x = r.core.malloc(12 * MIB, r.s0).unwrap();
    let y = r.core.malloc(12 * MIB, r.s0).unwrap();
    let z = r.core.malloc(14 * MIB, r.s0).unwrap();
    r.core.free(z.ptr).unwrap();
    r.core.free(y.ptr).unwrap();
    r.core.free(x.ptr).unwrap();
    let got = r.core.malloc(11 * MIB, r.s0).unwrap();
    assert_eq!(
        got.ptr,
        x.ptr.min(y.ptr),
        "lowest address among the 12 MiB blocks"
    );
    let got2 = r.core.malloc(11 * MIB, r.s0).unwrap();
    assert_eq!(got2.ptr, x.ptr.max(y.ptr));
    let got3 = r.core.malloc(11 * MIB, r.s0).unwrap();
    assert_eq!(got3.ptr, z.ptr);
    r.check();
}

/// PyTorch's rule; the `gpualloc` policy lends another stream's free block instead of a new
/// segment (`loans.rs`).
#[test]
fn blocks_are_reused_only_on_their_own_stream() {
    let mut r = rig_with(64 * GIB, "policy:pytorch", false);
    let a = r.core.malloc(MIB, r.s0).unwrap();
    r.core.free(a.ptr).unwrap();
    let b = r.core.malloc(MIB, r.s1).unwrap();
    assert_ne!(b.ptr, a.ptr);
    assert_eq!(r.backend.counts().mallocs, 2);
    let c = r.core.malloc(MIB, r.s0).unwrap();
    assert_eq!(c.ptr, a.ptr);
    r.check();
}

#[test]
fn record_stream_defers_reuse_until_the_event_completes() {
    let mut r = rig_with(64 * GIB, "", true);
    let a = r.core.malloc(MIB, r.s0).unwrap();
    r.core.record_stream(a.ptr, r.s1).unwrap();
    r.core.record_stream(a.ptr, r.s0).unwrap(); // own stream: ignored
    r.core.free(a.ptr).unwrap();
    assert_eq!(r.core.pending_frees(), 1);
    assert_eq!(
        r.core.stats().active_bytes[ALL].current,
        MIB,
        "pending is still active"
    );
    r.check();
    let b = r.core.malloc(MIB, r.s0).unwrap();
    assert_ne!(b.ptr, a.ptr, "must not reuse while s1 may still read it");
    r.backend.complete_all_events();
    assert_eq!(r.core.process_events().unwrap(), 1);
    let c = r.core.malloc(MIB, r.s0).unwrap();
    assert_eq!(c.ptr, a.ptr);
    r.check();
}

#[test]
fn bad_input_is_typed() {
    let mut r = rig();
    let z = r.core.malloc(0, r.s0).unwrap();
    assert_eq!((z.ptr, z.size), (DevicePtr(0), 0));
    r.core.free(z.ptr).unwrap();
    assert!(matches!(
        r.core.malloc(u64::MAX - 100, r.s0),
        Err(AllocError::InvalidSize { .. })
    ));
    assert!(matches!(
        r.core.malloc(u64::MAX, r.s0),
        Err(AllocError::InvalidSize { .. })
    ));
    // Enormous but representable: the device says no, after the whole chain.
    assert!(r.core.malloc(1 << 62, r.s0).unwrap_err().is_oom());
    assert!(matches!(
        r.core.free(DevicePtr(0x1234)),
        Err(AllocError::UnknownPointer(_))
    ));
    let a = r.core.malloc(100, r.s0).unwrap();
    r.core.free(a.ptr).unwrap();
    assert!(
        matches!(r.core.free(a.ptr), Err(AllocError::UnknownPointer(_))),
        "double free"
    );
    assert!(matches!(
        r.core.record_stream(a.ptr, r.s1),
        Err(AllocError::UnknownPointer(_))
    ));
    let other = r.backend.stream_create(DeviceId(1)).unwrap();
    assert!(matches!(
        r.core.malloc(100, other),
        Err(AllocError::WrongDevice { .. })
    ));
    r.check();
}

#[test]
fn shutdown_returns_every_segment_even_with_live_allocations() {
    let mut r = rig_with(64 * GIB, "", true);
    let a = r.core.malloc(5 * MIB, r.s0).unwrap();
    let _b = r.core.malloc(300, r.s0).unwrap();
    r.core.record_stream(a.ptr, r.s1).unwrap();
    r.core.free(a.ptr).unwrap();
    r.core.shutdown().unwrap();
    assert_eq!(r.backend.used(DeviceId(0)), 0);
    assert_eq!(r.backend.counts().frees, 2);
    assert!(matches!(r.core.malloc(1, r.s0), Err(AllocError::Shutdown)));
}

#[test]
fn power2_divisions_change_reuse() {
    let mut r = rig_with(64 * GIB, "roundup_power2_divisions:4", false);
    let a = r.core.malloc(5 * MIB + 1, r.s0).unwrap();
    assert_eq!(a.block_size, 6 * MIB);
    r.core.free(a.ptr).unwrap();
    // 5.5 MiB also rounds to 6 MiB and takes the same block without a split.
    let b = r.core.malloc(5 * MIB + 512 * KIB, r.s0).unwrap();
    assert_eq!(b.ptr, a.ptr);
    r.check();
}

#[test]
fn trace_and_snapshot_follow_pytorch_shapes() {
    let mut r = rig_with(64 * GIB, "", true);
    r.core.record_history(Some(100));
    r.core.set_time_us(7);
    let a = r.core.malloc(1000, r.s0).unwrap();
    r.core.record_stream(a.ptr, r.s1).unwrap();
    r.core.free(a.ptr).unwrap();
    let snap = r.core.snapshot();
    assert_eq!(snap.segments.len(), 1);
    let seg = &snap.segments[0];
    assert_eq!(
        (
            seg.total_size,
            seg.active_size,
            seg.allocated_size,
            seg.requested_size
        ),
        (2 * MIB, 1024, 0, 1000)
    );
    assert_eq!(seg.blocks[0].state.as_str(), "active_pending_free");
    assert_eq!(seg.blocks[1].state.as_str(), "inactive");
    r.backend.complete_all_events();
    r.core.process_events().unwrap();
    r.core.empty_cache().unwrap();
    let actions: Vec<&str> = r
        .core
        .snapshot()
        .trace
        .iter()
        .map(|e| e.action.as_str())
        .collect();
    assert_eq!(
        actions,
        [
            "segment_alloc",
            "alloc",
            "free_requested",
            "free_completed",
            "segment_free"
        ]
    );
    let t = &r.core.snapshot().trace[1];
    assert_eq!(
        (t.addr, t.size, t.stream, t.time_us),
        (a.ptr.0, 1000, r.s0.raw, 7)
    );
}
