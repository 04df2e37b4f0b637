//! Sleep and wake of a named pool (`sleep.rs`) on the simulated GPU, whose memory is real: the
//! data of live blocks survives at the same addresses, the device gets the memory back while
//! the pool sleeps, a wake without memory rolls back, and nothing else is touched.

use std::sync::Arc;
use std::time::Duration;

use gpualloc_devices::{
    map_wake, release_slept_pages, wait_for_pool_streams, AllocError, AllocatorConfig,
    CachedOutcome, DeviceCore, Growth, MemPoolId, PoolOptions, PoolState, SleepMode, SleepPlan,
    StatType,
};
use gpualloc_runtime::{Backend, DeviceId, DevicePtr, StreamHandle};
use gpualloc_sim::{Op, SimBackend, SimConfig};

const MIB: u64 = 1 << 20;
const ALL: usize = StatType::All as usize;
const ES: &str = "expandable_segments:True";

fn rig(capacity: u64, conf: &str) -> (Arc<SimBackend>, DeviceCore, StreamHandle, StreamHandle) {
    let sim = SimBackend::new(SimConfig {
        capacity_per_device: capacity,
        ..SimConfig::fast(1)
    })
    .unwrap();
    let dynb: Arc<dyn Backend> = sim.clone();
    let s0 = dynb.stream_create(DeviceId(0)).unwrap();
    let s1 = dynb.stream_create(DeviceId(0)).unwrap();
    let mut core =
        DeviceCore::new(dynb, DeviceId(0), AllocatorConfig::parse(conf).unwrap()).unwrap();
    core.record_history(Some(10_000));
    (sim, core, s0, s1)
}

fn pattern(ptr: DevicePtr, len: u64) -> Vec<u8> {
    (0..len)
        .map(|i| (ptr.0 / 4096 + i * 7 + (i >> 9)) as u8)
        .collect()
}

fn used(sim: &SimBackend) -> u64 {
    sim.used_bytes(DeviceId(0)).unwrap()
}

/// Steps 2 and 3 of a sleep done by hand, as an owner does: wait, copy out, release, finish.
fn complete_sleep(core: &mut DeviceCore, plan: SleepPlan, s: StreamHandle) -> Vec<Vec<u8>> {
    let backend = core.backend().clone();
    wait_for_pool_streams(backend.as_ref(), &plan).unwrap();
    let copies: Vec<Vec<u8>> = plan
        .copies()
        .iter()
        .map(|&(ptr, len)| {
            let mut v = vec![0u8; len as usize];
            backend.copy_from_device(s, &mut v, ptr).unwrap();
            v
        })
        .collect();
    release_slept_pages(backend.as_ref(), &plan);
    let left = core.finish_sleep(plan);
    assert!(left.is_empty());
    copies
}

fn sleep(
    core: &mut DeviceCore,
    pool: MemPoolId,
    mode: SleepMode,
    s: StreamHandle,
) -> Vec<(DevicePtr, Vec<u8>)> {
    let plan = core.begin_sleep(pool, mode).unwrap();
    let addrs: Vec<DevicePtr> = plan.copies().iter().map(|c| c.0).collect();
    addrs
        .into_iter()
        .zip(complete_sleep(core, plan, s))
        .collect()
}

fn wake(core: &mut DeviceCore, pool: MemPoolId, data: &[(DevicePtr, Vec<u8>)], s: StreamHandle) {
    let backend = core.backend().clone();
    let plan = core.begin_wake(pool).unwrap().expect("asleep");
    let woken = map_wake(backend.as_ref(), &plan).unwrap();
    for (ptr, bytes) in data {
        backend.copy_to_device(s, *ptr, bytes).unwrap();
    }
    assert!(core.finish_wake(plan, woken).is_empty());
}

#[test]
fn data_survives_sleep_and_wake_at_the_same_addresses() {
    let (sim, mut core, s, _) = rig(1 << 30, ES);
    let kv = core.create_named_pool("kv_cache", PoolOptions::default());
    let other = core.malloc(3 * MIB, s).unwrap();
    let sizes = [
        4096,
        512,
        3 * MIB + 5,
        700 * 1024,
        8 * MIB,
        100,
        MIB + 1,
        2 * MIB,
    ];
    let mut live = Vec::new();
    let mut freed = Vec::new();
    for i in 0..60u64 {
        let a = core
            .malloc_in(kv, sizes[i as usize % sizes.len()] + i, s)
            .unwrap();
        if i % 5 == 4 {
            freed.push(a);
        } else {
            live.push(a);
        }
    }
    for a in &live {
        core.backend()
            .copy_to_device(s, a.ptr, &pattern(a.ptr, a.size))
            .unwrap();
    }
    for a in &freed {
        core.free(a.ptr).unwrap();
    }
    live.sort_by_key(|a| a.ptr.0);
    let reserved = core.pool_usage(kv).unwrap().reserved.all().current;
    let device_reserved = core.stats().reserved_bytes[ALL].current;
    let allocated = core.stats().allocated_bytes[ALL].current;
    let before = used(&sim);

    let plan = core.begin_sleep(kv, SleepMode::Offload).unwrap();
    assert_eq!(plan.bytes(), reserved);
    assert_eq!(
        plan.copies().len(),
        live.len(),
        "every live block, no free one"
    );
    assert!(plan
        .copies()
        .iter()
        .zip(live.iter())
        .all(|(c, a)| c.0 == a.ptr && c.1 == a.size));
    assert_eq!(core.pool_state(kv), Some(PoolState::FallingAsleep));
    let refused = core.malloc_in(kv, MIB, s).unwrap_err();
    assert!(
        matches!(&refused, AllocError::PoolAsleep { pool, state: PoolState::FallingAsleep } if pool == "kv_cache"),
        "{refused:?}"
    );
    assert!(refused.is_retryable() && !refused.is_oom());
    core.check_invariants().unwrap();
    let addrs: Vec<DevicePtr> = plan.copies().iter().map(|c| c.0).collect();
    let data: Vec<(DevicePtr, Vec<u8>)> = addrs
        .into_iter()
        .zip(complete_sleep(&mut core, plan, s))
        .collect();

    // Asleep: the device has the memory back, the books keep every block.
    let usage = core.pool_usage(kv).unwrap();
    assert_eq!(usage.state, PoolState::Asleep);
    assert_eq!(
        (usage.reserved.all().current, usage.asleep_bytes),
        (0, reserved)
    );
    assert_eq!(
        core.stats().reserved_bytes[ALL].current,
        device_reserved - reserved
    );
    assert_eq!(core.stats().allocated_bytes[ALL].current, allocated);
    assert_eq!(used(&sim), before - reserved);
    assert!(
        core.pool_snapshot(kv).unwrap().segments.is_empty(),
        "no memory to show"
    );
    core.check_invariants().unwrap();
    for a in &live {
        assert_eq!(core.allocation(a.ptr).map(|x| x.size), Some(a.size));
        let mut v = vec![0u8; 16];
        assert!(
            core.backend().copy_from_device(s, &mut v, a.ptr).is_err(),
            "unmapped"
        );
    }
    // The default pools keep serving, from the cache and from new pages.
    core.free(other.ptr).unwrap();
    let again = core.malloc(3 * MIB, s).unwrap();
    assert_eq!(again.ptr, other.ptr);
    let grown = core.malloc(64 * MIB, s).unwrap();
    core.free(grown.ptr).unwrap();
    core.empty_cache().unwrap();
    core.check_invariants().unwrap();

    wake(&mut core, kv, &data, s);
    let usage = core.pool_usage(kv).unwrap();
    assert_eq!(usage.state, PoolState::Awake);
    assert_eq!(
        (usage.reserved.all().current, usage.asleep_bytes),
        (reserved, 0)
    );
    core.check_invariants().unwrap();
    for a in &live {
        let mut v = vec![0u8; a.size as usize];
        core.backend().copy_from_device(s, &mut v, a.ptr).unwrap();
        assert!(
            v == pattern(a.ptr, a.size),
            "data of {:#x} changed",
            a.ptr.0
        );
    }
    // Its free blocks came back too: a freed block's size is a hit, no new page.
    let maps = sim.counts().get(Op::Map);
    let hit = core.malloc_in(kv, freed[0].size, s).unwrap();
    assert_eq!(hit.ptr, freed[0].ptr);
    assert_eq!(sim.counts().get(Op::Map), maps);
    let actions: Vec<_> = core.snapshot().trace.iter().map(|e| e.action).collect();
    assert!(actions.contains(&gpualloc_devices::TraceAction::SegmentUnmap));
}

#[test]
fn discard_copies_nothing_and_maps_the_same_runs_back() {
    let (sim, mut core, s, _) = rig(1 << 30, ES);
    let w = core.create_named_pool("weights", PoolOptions::default());
    let a = core.malloc_in(w, 30 * MIB, s).unwrap();
    let b = core.malloc_in(w, 1000, s).unwrap();
    let handles = sim.counts().get(Op::PhysCreate);
    let reserved = core.reserved_bytes();
    let plan = core.begin_sleep(w, SleepMode::Discard).unwrap();
    assert!(plan.copies().is_empty());
    // Out of the books, the device's until the unmap returns.
    assert_eq!(core.releasing_bytes(), plan.bytes());
    assert_eq!(reserved - core.reserved_bytes(), plan.bytes());
    assert!(complete_sleep(&mut core, plan, s).is_empty());
    assert_eq!(core.releasing_bytes(), 0);
    wake(&mut core, w, &[], s);
    // One new handle per handle the pool had, at the same places.
    assert_eq!(sim.counts().get(Op::PhysCreate), 2 * handles);
    assert_eq!(core.allocation(a.ptr).unwrap().size, 30 * MIB);
    core.backend().copy_to_device(s, b.ptr, &[7; 1000]).unwrap();
    core.check_invariants().unwrap();
}

/// A live block keeps its frames through its pool's sleep and wake: the pages under it are
/// unmapped and mapped again at its address (history entries at that address that are not
/// its free), and it stays allocated.
#[test]
fn a_live_blocks_frames_survive_its_pools_sleep() {
    use gpualloc_devices::{Frame, TraceAction};
    let (_sim, mut core, s, _) = rig(1 << 30, ES);
    let w = core.create_named_pool("weights", PoolOptions::default());
    let a = core.malloc_in(w, 30 * MIB, s).unwrap();
    let frames = vec![Frame {
        name: "load_weights".into(),
        filename: "model.py".into(),
        line: 12,
    }];
    core.attach_frames(a.ptr.0, frames.into());
    let plan = core.begin_sleep(w, SleepMode::Discard).unwrap();
    assert!(complete_sleep(&mut core, plan, s).is_empty());
    wake(&mut core, w, &[], s);
    let snap = core.snapshot();
    let at_a: Vec<TraceAction> = snap
        .trace
        .iter()
        .filter(|e| e.addr == a.ptr.0)
        .map(|e| e.action)
        .collect();
    assert!(
        at_a.ends_with(&[
            TraceAction::Alloc,
            TraceAction::SegmentUnmap,
            TraceAction::SegmentMap
        ]),
        "{at_a:?}"
    );
    let kept = snap
        .segments
        .iter()
        .flat_map(|seg| seg.blocks.iter())
        .find(|b| b.address == a.ptr.0)
        .and_then(|b| b.frames.clone())
        .map(|f| f[0].name.clone());
    assert_eq!(kept.as_deref(), Some("load_weights"));
    core.free(a.ptr).unwrap();
    core.check_invariants().unwrap();
}

#[test]
fn sleep_is_refused_where_it_cannot_work() {
    let (_sim, mut core, s, _) = rig(1 << 30, "");
    let p = core.create_named_pool("p", PoolOptions::default());
    core.malloc_in(p, MIB, s).unwrap();
    assert!(matches!(
        core.begin_sleep(p, SleepMode::Offload),
        Err(AllocError::NotSupported(_))
    ));
    let unnamed = core.create_pool(false);
    let (_sim, mut core, s, _) = rig(1 << 30, ES);
    let p = core.create_named_pool("p", PoolOptions::default());
    assert!(matches!(
        core.begin_sleep(unnamed, SleepMode::Offload),
        Err(AllocError::UnknownPool(_))
    ));
    let unnamed = core.create_pool(false);
    assert!(matches!(
        core.begin_sleep(unnamed, SleepMode::Offload),
        Err(AllocError::NotSupported(_))
    ));
    assert!(
        core.begin_wake(p).unwrap().is_none(),
        "awake: nothing to do"
    );
    core.malloc_in(p, MIB, s).unwrap();
    sleep(&mut core, p, SleepMode::Offload, s);
    assert!(matches!(
        core.begin_sleep(p, SleepMode::Offload),
        Err(AllocError::PoolAsleep {
            state: PoolState::Asleep,
            ..
        })
    ));
    let plan = core.begin_wake(p).unwrap().unwrap();
    assert!(matches!(
        core.begin_wake(p),
        Err(AllocError::PoolAsleep {
            state: PoolState::Waking,
            ..
        })
    ));
    assert!(matches!(
        core.begin_sleep(p, SleepMode::Offload),
        Err(AllocError::PoolAsleep {
            state: PoolState::Waking,
            ..
        })
    ));
    let woken = map_wake(core.backend().as_ref(), &plan).unwrap();
    assert!(core.finish_wake(plan, woken).is_empty());
    core.release_pool(p).unwrap();
    assert!(matches!(
        core.begin_sleep(p, SleepMode::Offload),
        Err(AllocError::UnknownPool(_))
    ));
}

#[test]
fn a_wake_without_memory_rolls_back_and_succeeds_later() {
    let (sim, mut core, s, _) = rig(256 * MIB, ES);
    let kv = core.create_named_pool("kv", PoolOptions::default());
    let a = core.malloc_in(kv, 100 * MIB, s).unwrap();
    core.backend()
        .copy_to_device(s, a.ptr, &pattern(a.ptr, a.size))
        .unwrap();
    let data = sleep(&mut core, kv, SleepMode::Offload, s);
    let hog = core.malloc(200 * MIB, s).unwrap();
    let before = used(&sim);
    let stats = core.stats().clone();

    let plan = core.begin_wake(kv).unwrap().unwrap();
    let needed = plan.bytes();
    assert!(needed >= 100 * MIB);
    let err = map_wake(core.backend().as_ref(), &plan).unwrap_err();
    assert!(err.is_oom(), "{err:?}");
    assert!(core.abort_wake(plan).is_empty());
    assert_eq!(core.pool_state(kv), Some(PoolState::Asleep));
    assert_eq!(used(&sim), before, "nothing half-mapped");
    assert_eq!(core.stats().reserved_bytes, stats.reserved_bytes);
    assert_eq!(core.growing_bytes(), 0);
    core.check_invariants().unwrap();

    core.free(hog.ptr).unwrap();
    core.empty_cache().unwrap();
    wake(&mut core, kv, &data, s);
    let mut v = vec![0u8; a.size as usize];
    core.backend().copy_from_device(s, &mut v, a.ptr).unwrap();
    assert!(v == pattern(a.ptr, a.size));
    core.check_invariants().unwrap();
}

#[test]
fn a_wake_past_the_memory_fraction_is_refused_with_what_it_needs() {
    let (_sim, mut core, s, _) = rig(
        1 << 30,
        "expandable_segments:True,per_process_memory_fraction:0.25",
    );
    let kv = core.create_named_pool("kv", PoolOptions::default());
    core.malloc_in(kv, 100 * MIB, s).unwrap();
    sleep(&mut core, kv, SleepMode::Discard, s);
    let hog = core.malloc(200 * MIB, s).unwrap();
    let needed = core.pool_usage(kv).unwrap().asleep_bytes;
    match core.begin_wake(kv) {
        Err(AllocError::WakeOutOfMemory {
            pool,
            needed: n,
            free,
        }) => {
            assert_eq!((pool.as_str(), n), ("kv", needed));
            assert_eq!(free, 256 * MIB - core.stats().reserved_bytes[ALL].current);
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(core.pool_state(kv), Some(PoolState::Asleep));
    core.free(hog.ptr).unwrap();
    core.empty_cache().unwrap();
    wake(&mut core, kv, &[], s);
    core.check_invariants().unwrap();
}

/// A block used on another stream (`record_stream`) by a kernel still running: the sleep waits
/// for that stream's work before copying, so the copy holds what the kernel wrote.
#[test]
fn sleep_waits_for_every_stream_that_used_the_pool() {
    let (sim, mut core, s0, s1) = rig(1 << 30, ES);
    let kv = core.create_named_pool("kv", PoolOptions::default());
    let a = core.malloc_in(kv, MIB, s0).unwrap();
    core.record_stream(a.ptr, s1).unwrap();
    let ptr = a.ptr;
    sim.launch_kernel_touching(s1, Duration::from_millis(50), &[(ptr, MIB)], move |m| {
        m.fill(ptr, MIB, 0xAB)
    })
    .unwrap();
    let data = sleep(&mut core, kv, SleepMode::Offload, s0);
    assert_eq!(data.len(), 1);
    assert!(
        data[0].1.iter().all(|&b| b == 0xAB),
        "copied before the kernel ran"
    );
    assert_eq!(
        sim.counts().get(Op::DeviceSynchronize),
        0,
        "events, not the device"
    );
    assert!(sim.counts().get(Op::EventSynchronize) >= 2, "both streams");
    // The events go back to the core's event pool: the next sleep creates none.
    wake(&mut core, kv, &data, s0);
    let created = sim.counts().get(Op::EventCreate);
    sleep(&mut core, kv, SleepMode::Offload, s0);
    assert_eq!(sim.counts().get(Op::EventCreate), created);
}

#[test]
fn frees_while_asleep_are_free_after_the_wake() {
    let (_sim, mut core, s0, s1) = rig(1 << 30, ES);
    let kv = core.create_named_pool("kv", PoolOptions::default());
    let a = core.malloc_in(kv, 4 * MIB, s0).unwrap();
    let b = core.malloc_in(kv, 4 * MIB, s0).unwrap();
    core.record_stream(b.ptr, s1).unwrap();
    let data = sleep(&mut core, kv, SleepMode::Offload, s0);
    core.free(a.ptr).unwrap();
    core.free(b.ptr).unwrap(); // pending on s1's event
    core.check_invariants().unwrap();
    assert_eq!(core.pool_usage(kv).unwrap().allocated.all().current, 0);
    wake(&mut core, kv, &data, s0);
    core.backend().stream_synchronize(s1).unwrap();
    let c = core.malloc_in(kv, 8 * MIB, s0).unwrap();
    assert_eq!(c.ptr, a.ptr, "the two freed blocks merged in place");
    core.check_invariants().unwrap();
}

#[test]
fn a_pool_cannot_sleep_while_its_pages_are_being_mapped() {
    let (_sim, mut core, s, _) = rig(1 << 30, ES);
    let kv = core.create_named_pool("kv", PoolOptions::default());
    core.malloc_in(kv, MIB, s).unwrap();
    let req = match core.try_cached_in(kv, 64 * MIB, s).unwrap() {
        CachedOutcome::Miss(r) => r,
        CachedOutcome::Hit(_) => panic!("hit"),
    };
    let Growth::Map(plan) = core.plan_growth(&req).unwrap() else {
        panic!("expected a growth");
    };
    assert!(matches!(
        core.begin_sleep(kv, SleepMode::Offload),
        Err(AllocError::PoolBusy { pool }) if pool == "kv"
    ));
    assert_eq!(core.pool_state(kv), Some(PoolState::Awake));
    assert!(core.abort_growth(plan).is_none());
    sleep(&mut core, kv, SleepMode::Offload, s);
    core.check_invariants().unwrap();
}

#[test]
fn a_failed_sleep_puts_the_pages_back() {
    let (sim, mut core, s, _) = rig(1 << 30, ES);
    let kv = core.create_named_pool("kv", PoolOptions::default());
    let a = core.malloc_in(kv, 5 * MIB, s).unwrap();
    let stats = core.stats().clone();
    let before = used(&sim);
    let plan = core.begin_sleep(kv, SleepMode::Offload).unwrap();
    assert_eq!(core.stats().num_device_free, stats.num_device_free + 1);
    // The pages are the device's until the unmap: they count against the cap meanwhile.
    assert_eq!(core.releasing_bytes(), 6 * MIB);
    assert!(core.abort_sleep(plan).is_empty());
    assert_eq!(core.releasing_bytes(), 0);
    assert_eq!(core.pool_state(kv), Some(PoolState::Awake));
    assert_eq!(core.stats().reserved_bytes, stats.reserved_bytes);
    assert_eq!(core.stats().num_device_free, stats.num_device_free);
    assert_eq!(core.stats().num_device_alloc, stats.num_device_alloc);
    assert_eq!(used(&sim), before);
    core.check_invariants().unwrap();
    core.backend().copy_to_device(s, a.ptr, &[1; 64]).unwrap();
    core.malloc_in(kv, MIB, s).unwrap();
}

#[test]
fn shutdown_releases_a_sleeping_pool_and_one_falling_asleep() {
    let (sim, mut core, s, _) = rig(1 << 30, ES);
    let kv = core.create_named_pool("kv", PoolOptions::default());
    core.malloc_in(kv, 30 * MIB, s).unwrap();
    sleep(&mut core, kv, SleepMode::Discard, s);
    core.shutdown().unwrap();
    assert_eq!(used(&sim), 0);
    let c = sim.counts();
    assert_eq!(c.get(Op::VaReserve), c.get(Op::VaFree));

    let (sim, mut core, s, _) = rig(1 << 30, ES);
    let kv = core.create_named_pool("kv", PoolOptions::default());
    core.malloc_in(kv, 30 * MIB, s).unwrap();
    let plan = core.begin_sleep(kv, SleepMode::Offload).unwrap();
    core.shutdown().unwrap();
    assert!(
        used(&sim) > 0,
        "the pages in flight are the sleep's to release"
    );
    // Failed after the shutdown: the pages and the reservation are left to release.
    let left = core.abort_sleep(plan);
    assert!(!left.is_empty());
    left.release(core.backend().as_ref());
    assert_eq!(used(&sim), 0);
    let c = sim.counts();
    assert_eq!(c.get(Op::VaReserve), c.get(Op::VaFree));

    // Finished after the shutdown: the pages are gone, the reservation is left to free.
    let (sim, mut core, s, _) = rig(1 << 30, ES);
    let kv = core.create_named_pool("kv", PoolOptions::default());
    core.malloc_in(kv, 30 * MIB, s).unwrap();
    let plan = core.begin_sleep(kv, SleepMode::Discard).unwrap();
    core.shutdown().unwrap();
    release_slept_pages(core.backend().as_ref(), &plan);
    let left = core.finish_sleep(plan);
    assert!(!left.is_empty(), "the reservation");
    left.release(core.backend().as_ref());
    let c = sim.counts();
    assert_eq!(c.get(Op::VaReserve), c.get(Op::VaFree));
    assert_eq!(used(&sim), 0);
}

#[test]
fn a_sleeping_use_on_oom_pool_lends_nothing() {
    let (_sim, mut core, s, _) = rig(128 * MIB, ES);
    let lender = core.create_named_pool(
        "lender",
        PoolOptions {
            quota: None,
            use_on_oom: true,
            unsplit: None,
        },
    );
    let a = core.malloc_in(lender, 100 * MIB, s).unwrap();
    core.free(a.ptr).unwrap();
    sleep(&mut core, lender, SleepMode::Discard, s);
    // Its free 100 MiB block is in the books but has no memory: it must not be lent.
    let b = core.malloc(100 * MIB, s).unwrap();
    assert_eq!(core.allocation(b.ptr).unwrap().pool, None);
    core.check_invariants().unwrap();
}

#[test]
fn errors_say_where_the_pool_is_and_which_may_be_waited_out() {
    let names: Vec<String> = [
        PoolState::Awake,
        PoolState::FallingAsleep,
        PoolState::Asleep,
        PoolState::Waking,
    ]
    .iter()
    .map(ToString::to_string)
    .collect();
    assert_eq!(names, ["awake", "falling asleep", "asleep", "waking"]);
    let asleep = AllocError::PoolAsleep {
        pool: "kv".into(),
        state: PoolState::Asleep,
    };
    assert_eq!(
        asleep.to_string(),
        "memory pool \"kv\" is asleep: it serves no allocations until it is awake"
    );
    let wake = AllocError::WakeOutOfMemory {
        pool: "kv".into(),
        needed: 3 * MIB,
        free: MIB,
    };
    assert!(wake.to_string().contains("needs 3.00 MiB"), "{wake}");
    assert!(wake.is_oom() && !wake.is_retryable());
    assert!(asleep.is_retryable() && !asleep.is_oom());
    for e in [
        AllocError::Shutdown,
        AllocError::UnknownPool(1),
        AllocError::PoolBusy { pool: "kv".into() },
        AllocError::NotSupported("x"),
    ] {
        assert!(!e.is_retryable() && !e.is_oom(), "{e:?}");
    }
    let quota = AllocError::PoolQuota {
        pool: "kv".into(),
        quota: 1,
        reserved: 1,
        requested: 1,
        in_flight: 0,
    };
    assert!(quota.is_retryable());
}

#[test]
fn a_wake_claims_its_bytes_and_fits_the_fraction_exactly() {
    // A cap of 64 MiB: a pool of 40 MiB asleep, 24 MiB held by the default pool.
    let (_sim, mut core, s, _) = rig(
        256 * MIB,
        "expandable_segments:True,per_process_memory_fraction:0.25",
    );
    let kv = core.create_named_pool("kv", PoolOptions::default());
    core.malloc_in(kv, 40 * MIB, s).unwrap();
    let bytes = core.pool_usage(kv).unwrap().reserved.all().current;
    sleep(&mut core, kv, SleepMode::Discard, s);
    let hog = core.malloc(64 * MIB - bytes, s).unwrap();
    let held = core.stats().reserved_bytes[ALL].current;
    assert_eq!(held + bytes, 64 * MIB, "the wake fits the cap exactly");
    let allocs = core.stats().num_device_alloc;
    let plan = core.begin_wake(kv).unwrap().unwrap();
    assert_eq!(core.growing_bytes(), bytes, "claimed while being mapped");
    assert_eq!(
        core.pool_usage(kv).unwrap().asleep_bytes,
        bytes,
        "until it is awake"
    );
    assert_eq!(core.pool_usage(kv).unwrap().name, "kv");
    let woken = map_wake(core.backend().as_ref(), &plan).unwrap();
    assert!(core.finish_wake(plan, woken).is_empty());
    assert_eq!(core.growing_bytes(), 0);
    assert_eq!(core.pool_usage(kv).unwrap().asleep_bytes, 0);
    assert!(
        core.stats().num_device_alloc > allocs,
        "the wake's maps are counted"
    );
    core.free(hog.ptr).unwrap();
    // Released while asleep: no wake.
    sleep(&mut core, kv, SleepMode::Discard, s);
    core.release_pool(kv).unwrap();
    assert!(matches!(
        core.begin_wake(kv),
        Err(AllocError::UnknownPool(_))
    ));
}

#[test]
fn a_wake_finished_after_a_shutdown_leaves_its_pages_to_release() {
    let (sim, mut core, s, _) = rig(1 << 30, ES);
    let kv = core.create_named_pool("kv", PoolOptions::default());
    core.malloc_in(kv, 30 * MIB, s).unwrap();
    sleep(&mut core, kv, SleepMode::Discard, s);
    let log: Arc<std::sync::Mutex<Vec<gpualloc_devices::SegmentEvent>>> = Arc::default();
    let sink = log.clone();
    core.set_segment_sink(Some(Box::new(move |e| sink.lock().unwrap().push(e))));
    let plan = core.begin_wake(kv).unwrap().unwrap();
    let woken = map_wake(core.backend().as_ref(), &plan).unwrap();
    core.shutdown().unwrap();
    let left = core.finish_wake(plan, woken);
    assert!(!left.is_empty());
    assert_ne!(core.pool_state(kv), Some(PoolState::Awake));
    assert!(
        log.lock().unwrap().is_empty(),
        "nothing announced after the shutdown"
    );
    left.release(core.backend().as_ref());
    assert_eq!(used(&sim), 0);
    let c = sim.counts();
    assert_eq!(c.get(Op::VaReserve), c.get(Op::VaFree));
}

#[test]
fn a_peer_added_while_a_pool_wakes_gets_access_to_its_pages() {
    let sim = SimBackend::new(SimConfig {
        capacity_per_device: 1 << 30,
        ..SimConfig::fast(2)
    })
    .unwrap();
    let dynb: Arc<dyn Backend> = sim.clone();
    let s = dynb.stream_create(DeviceId(0)).unwrap();
    let mut core = DeviceCore::new(dynb, DeviceId(0), AllocatorConfig::parse(ES).unwrap()).unwrap();
    let kv = core.create_named_pool("kv", PoolOptions::default());
    core.malloc_in(kv, 30 * MIB, s).unwrap();
    sleep(&mut core, kv, SleepMode::Discard, s);
    let plan = core.begin_wake(kv).unwrap().unwrap();
    let woken = map_wake(core.backend().as_ref(), &plan).unwrap();
    core.add_peer(DeviceId(1)).unwrap();
    let before = sim.counts().get(Op::SetAccess);
    assert!(core.finish_wake(plan, woken).is_empty());
    assert!(
        sim.counts().get(Op::SetAccess) > before,
        "the new peer's access"
    );
}

/// Allocations marked exported keep their named pool from sleeping until they are freed:
/// only the pool's own (a default-pool allocation marked exported does not count), each
/// counted once, and a block reused at a freed exported address is not exported.
#[test]
fn exported_allocations_keep_their_pool_awake_until_freed() {
    let (_sim, mut core, s, _) = rig(1 << 30, ES);
    let kv = core.create_named_pool("kv_cache", PoolOptions::default());
    let a = core.malloc_in(kv, 3 * MIB, s).unwrap();
    let b = core.malloc_in(kv, 5 * MIB, s).unwrap();
    let _c = core.malloc_in(kv, 7 * MIB, s).unwrap();
    let outside = core.malloc(2 * MIB, s).unwrap();
    assert_eq!(
        core.mark_exported(DevicePtr(a.ptr.0 + 1)),
        Err(AllocError::UnknownPointer(DevicePtr(a.ptr.0 + 1)))
    );
    core.mark_exported(outside.ptr).unwrap();
    assert!(
        core.begin_sleep(kv, SleepMode::Discard)
            .map(|p| core.abort_sleep(p))
            .is_ok(),
        "another pool's export does not count"
    );
    core.mark_exported(a.ptr).unwrap();
    core.mark_exported(b.ptr).unwrap();
    core.mark_exported(b.ptr).unwrap();
    match core.begin_sleep(kv, SleepMode::Discard) {
        Err(AllocError::PoolExported { pool, buffers }) => {
            assert_eq!((pool.as_str(), buffers), ("kv_cache", 2));
        }
        other => panic!("{:?}", other.map(|_| ())),
    }
    assert_eq!(core.pool_state(kv), Some(PoolState::Awake));
    // Unmarked (a region never shared), `b` no longer counts; a second unmark finds nothing,
    // an unknown pointer is an error.
    assert_eq!(core.unmark_exported(b.ptr), Ok(true));
    assert_eq!(core.unmark_exported(b.ptr), Ok(false));
    assert_eq!(
        core.unmark_exported(DevicePtr(b.ptr.0 + 1)),
        Err(AllocError::UnknownPointer(DevicePtr(b.ptr.0 + 1)))
    );
    match core.begin_sleep(kv, SleepMode::Discard) {
        Err(AllocError::PoolExported { buffers, .. }) => assert_eq!(buffers, 1),
        other => panic!("{:?}", other.map(|_| ())),
    }
    core.free(a.ptr).unwrap();
    core.free(b.ptr).unwrap();
    let again = core.malloc_in(kv, 5 * MIB, s).unwrap();
    assert_eq!(again.ptr, a.ptr, "a freed exported address, reused");
    let plan = core.begin_sleep(kv, SleepMode::Discard).unwrap();
    drop(complete_sleep(&mut core, plan, s));
    assert_eq!(core.pool_state(kv), Some(PoolState::Asleep));
    core.check_invariants().unwrap();
}
