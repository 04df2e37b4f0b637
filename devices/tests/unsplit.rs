//! Pools of unsplit blocks (`unsplit.rs`): every block a range of its own, aligned to the
//! pool's granularity and a multiple of it, never split, reused only at its exact size.

use std::sync::{Arc, Mutex};

use gpualloc_accounting::AccountingBackend;
use gpualloc_devices::{
    AllocError, AllocatorConfig, CachedOutcome, DeviceCore, Growth, PoolOptions, SegmentAction,
    SegmentEvent, SleepMode,
};
use gpualloc_runtime::{Backend, DeviceId, StreamHandle};

const MIB: u64 = 1 << 20;
const G: u64 = 8 * MIB;

fn rig(conf: &str) -> (Arc<AccountingBackend>, DeviceCore, StreamHandle) {
    let backend = Arc::new(AccountingBackend::new(1, 16 << 30));
    let dynb: Arc<dyn Backend> = backend.clone();
    let s = dynb.stream_create(DeviceId(0)).unwrap();
    let core = DeviceCore::new(dynb, DeviceId(0), AllocatorConfig::parse(conf).unwrap()).unwrap();
    (backend, core, s)
}

fn unsplit(g: u64) -> PoolOptions {
    PoolOptions {
        unsplit: Some(g),
        ..PoolOptions::default()
    }
}

#[test]
fn every_block_is_an_aligned_range_of_its_own() {
    let (_b, mut core, s) = rig("expandable_segments:True");
    let log: Arc<Mutex<Vec<SegmentEvent>>> = Arc::default();
    let sink = log.clone();
    core.set_segment_sink(Some(Box::new(move |e| sink.lock().unwrap().push(e))));
    let nvls = core.create_named_pool("nvls", unsplit(G));
    let sizes = [1, 4096, MIB, G, G + 1, 3 * G - 5];
    let mut got = Vec::new();
    for size in sizes {
        let a = core.malloc_in(nvls, size, s).unwrap();
        assert_eq!(a.ptr.0 % G, 0, "{size}: aligned");
        assert_eq!(
            a.block_size,
            size.div_ceil(G) * G,
            "{size}: rounded to the granularity"
        );
        assert!(!a.small_pool);
        got.push(a);
    }
    // Each is one mapped range, announced with the buffer's own address and size.
    let maps: Vec<(u64, u64)> = log
        .lock()
        .unwrap()
        .iter()
        .filter(|e| e.action == SegmentAction::Map)
        .map(|e| (e.addr, e.size))
        .collect();
    let want: Vec<(u64, u64)> = got.iter().map(|a| (a.ptr.0, a.block_size)).collect();
    assert_eq!(maps, want);
    let snap = core.pool_snapshot(nvls).unwrap();
    assert_eq!(snap.segments.len(), sizes.len());
    for seg in &snap.segments {
        assert_eq!(seg.blocks.len(), 1, "never split");
    }
    core.check_invariants().unwrap();
}

#[test]
fn a_freed_block_serves_only_its_exact_size() {
    let (_b, mut core, s) = rig("expandable_segments:True");
    let nvls = core.create_named_pool("nvls", unsplit(G));
    let a = core.malloc_in(nvls, 2 * G, s).unwrap();
    core.free(a.ptr).unwrap();
    let smaller = core.malloc_in(nvls, G, s).unwrap();
    assert_ne!(
        smaller.ptr, a.ptr,
        "a 2G block is not split for a G request"
    );
    let same = core.malloc_in(nvls, 2 * G - 100, s).unwrap();
    assert_eq!(same.ptr, a.ptr, "the same rounded size reuses it");
    core.free(smaller.ptr).unwrap();
    let bigger = core.malloc_in(nvls, 2 * G, s).unwrap();
    assert_ne!(bigger.ptr, smaller.ptr, "two free G blocks never merge");
    core.check_invariants().unwrap();
    // Released with the pool: every range unmapped and its reservation freed.
    for p in [same.ptr, bigger.ptr] {
        core.free(p).unwrap();
    }
    core.release_pool(nvls).unwrap();
    core.empty_cache().unwrap();
    assert_eq!(core.reserved_bytes(), 0);
    core.check_invariants().unwrap();
}

#[test]
fn the_off_core_path_maps_one_range_per_block() {
    let (_b, mut core, s) = rig("expandable_segments:True");
    let nvls = core.create_named_pool("nvls", unsplit(G));
    let req = match core.try_cached_in(nvls, 3 * MIB, s).unwrap() {
        CachedOutcome::Miss(r) => r,
        CachedOutcome::Hit(_) => panic!("hit"),
    };
    let Growth::Map(plan) = core.plan_growth(&req).unwrap() else {
        panic!("expected a growth");
    };
    assert_eq!(plan.bytes(), G);
    let mapped = gpualloc_devices::map_growth(core.backend().as_ref(), &plan).unwrap();
    assert_eq!(mapped.handles(), 1);
    core.commit_growth(plan, mapped).unwrap();
    let a = match core.try_cached_in(nvls, 3 * MIB, s).unwrap() {
        CachedOutcome::Hit(a) => a,
        CachedOutcome::Miss(_) => panic!("miss after the growth"),
    };
    assert_eq!((a.ptr.0 % G, a.block_size), (0, G));
    core.check_invariants().unwrap();
}

#[test]
fn an_unsplit_pool_sleeps_and_counts_against_its_quota() {
    let (_b, mut core, s) = rig("expandable_segments:True");
    let nvls = core.create_named_pool(
        "nvls",
        PoolOptions {
            quota: Some(3 * G),
            ..unsplit(G)
        },
    );
    let a = core.malloc_in(nvls, G, s).unwrap();
    core.malloc_in(nvls, 2 * G, s).unwrap();
    assert!(matches!(
        core.malloc_in(nvls, 1, s),
        Err(AllocError::PoolQuota { .. })
    ));
    let plan = core.begin_sleep(nvls, SleepMode::Discard).unwrap();
    assert_eq!(plan.bytes(), 3 * G);
    let backend = core.backend().clone();
    gpualloc_devices::wait_for_pool_streams(backend.as_ref(), &plan).unwrap();
    gpualloc_devices::release_slept_pages(backend.as_ref(), &plan);
    assert!(core.finish_sleep(plan).is_empty());
    let wake = core.begin_wake(nvls).unwrap().unwrap();
    let woken = gpualloc_devices::map_wake(backend.as_ref(), &wake).unwrap();
    assert!(core.finish_wake(wake, woken).is_empty());
    assert_eq!(core.allocation(a.ptr).unwrap().block_size, G);
    core.check_invariants().unwrap();
}

#[test]
fn a_granularity_that_cannot_be_is_a_typed_error() {
    for (conf, g) in [
        ("", G),
        ("expandable_segments:True", 3 * MIB),
        ("expandable_segments:True", MIB),
        ("expandable_segments:True", 0),
    ] {
        let (_b, mut core, s) = rig(conf);
        let options = unsplit(g);
        assert!(
            matches!(
                core.check_pool_options(&options),
                Err(AllocError::NotSupported(_))
            ),
            "[{conf}] {g}"
        );
        let p = core.create_named_pool("bad", options);
        assert!(
            matches!(core.malloc_in(p, 1, s), Err(AllocError::NotSupported(_))),
            "[{conf}] {g}"
        );
        assert_eq!(core.reserved_bytes(), 0);
    }
    let (_b, core, _s) = rig("expandable_segments:True");
    assert!(core.check_pool_options(&unsplit(2 * MIB)).is_ok());
    assert!(core.check_pool_options(&PoolOptions::default()).is_ok());
    let (_b, mut core, s) = rig("expandable_segments:True");
    let p = core.create_named_pool("huge", unsplit(1 << 62));
    assert!(matches!(
        core.malloc_in(p, u64::MAX - (1 << 40), s),
        Err(AllocError::InvalidSize { .. })
    ));
}

/// A device that cannot answer its granularity (lost, or held by another process) is not
/// reported as one without virtual memory.
#[test]
fn a_device_that_cannot_answer_is_not_called_one_without_virtual_memory() {
    use gpualloc_runtime::{Backend, BackendError, DeviceId};
    use gpualloc_sim::{Fault, Op, SimBackend, SimConfig};
    let sim = SimBackend::new(SimConfig::fast(1)).unwrap();
    let backend: Arc<dyn Backend> = sim.clone();
    let config = gpualloc_devices::AllocatorConfig::parse("expandable_segments:True").unwrap();
    let core = DeviceCore::new(backend, DeviceId(0), config).unwrap();
    let lost = |error: BackendError| {
        sim.inject(
            Op::VmmGranularity,
            Fault::FailNext {
                skip: 0,
                count: 1,
                error,
            },
        );
        match core.check_pool_options(&unsplit(2 * MIB)) {
            Err(AllocError::NotSupported(why)) => why,
            other => panic!("{other:?}"),
        }
    };
    let why = lost(BackendError::DeviceLost {
        device: 0,
        cause: "CUDA_ERROR_ASSERT".into(),
    });
    assert!(!why.contains("no virtual memory"), "{why}");
    assert!(why.contains("lost or unavailable"), "{why}");
    let why = lost(BackendError::NotSupported("virtual memory".into()));
    assert!(why.contains("no virtual memory"), "{why}");
}
