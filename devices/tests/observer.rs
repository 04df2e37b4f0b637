//! The segment sink (`observer.rs`): every range the core maps or allocates is announced, and
//! every range it releases, with its pool; a late subscriber's snapshot plus the events after
//! it always equals what the core holds.

use std::sync::{Arc, Mutex};

use gpualloc_accounting::AccountingBackend;
use gpualloc_devices::{
    map_wake, release_slept_pages, wait_for_pool_streams, AllocatorConfig, DeviceCore, HeldRanges,
    MemPoolId, PoolOptions, SegmentAction, SegmentEvent, SleepMode,
};
use gpualloc_runtime::{Backend, DeviceId, StreamHandle};
use gpualloc_sim::{SimBackend, SimConfig};

const MIB: u64 = 1 << 20;

type Log = Arc<Mutex<Vec<SegmentEvent>>>;

fn rig(backend: Arc<dyn Backend>, conf: &str) -> (DeviceCore, StreamHandle, Log) {
    let s = backend.stream_create(DeviceId(0)).unwrap();
    let mut core =
        DeviceCore::new(backend, DeviceId(0), AllocatorConfig::parse(conf).unwrap()).unwrap();
    let log: Log = Arc::default();
    let sink = log.clone();
    core.set_segment_sink(Some(Box::new(move |e| sink.lock().unwrap().push(e))));
    (core, s, log)
}

fn accounting() -> Arc<dyn Backend> {
    Arc::new(AccountingBackend::new(1, 16 << 30))
}

fn take(log: &Log) -> Vec<(SegmentAction, u64, u64, Option<MemPoolId>)> {
    std::mem::take(&mut *log.lock().unwrap())
        .into_iter()
        .map(|e| (e.action, e.addr, e.size, e.pool))
        .collect()
}

/// The ranges held, rebuilt from a snapshot and the events after it.
fn replay(start: &[(u64, u64)], events: &[SegmentEvent]) -> Vec<(u64, u64)> {
    let mut held = HeldRanges::new(start.iter().copied());
    for e in events {
        held.apply(e).unwrap();
    }
    held.ranges().collect()
}

/// Adjacent ranges joined, for comparing layouts.
fn joined(ranges: impl IntoIterator<Item = (u64, u64)>) -> Vec<(u64, u64)> {
    let mut out: Vec<(u64, u64)> = Vec::new();
    for (a, s) in ranges {
        match out.last_mut() {
            Some(last) if last.0 + last.1 == a => last.1 += s,
            _ => out.push((a, s)),
        }
    }
    out
}

fn held_now(core: &DeviceCore) -> Vec<(u64, u64)> {
    core.segment_ranges()
        .iter()
        .map(|r| (r.addr, r.size))
        .collect()
}

#[test]
fn ordinary_segments_are_announced_allocated_and_freed_with_their_pool() {
    let (mut core, s, log) = rig(accounting(), "");
    let kv = core.create_named_pool("kv", PoolOptions::default());
    let a = core.malloc(3 * MIB, s).unwrap();
    let b = core.malloc_in(kv, 30 * MIB, s).unwrap();
    let events = take(&log);
    assert_eq!(
        events,
        vec![
            (SegmentAction::Alloc, a.ptr.0, 20 * MIB, None),
            (SegmentAction::Alloc, b.ptr.0, 30 * MIB, Some(kv)),
        ]
    );
    let ranges = core.segment_ranges();
    assert_eq!(ranges.len(), 2);
    assert!(ranges.iter().all(|r| !r.expandable));
    assert_eq!(
        ranges.iter().find(|r| r.addr == b.ptr.0).unwrap().pool,
        Some(kv)
    );
    core.free(a.ptr).unwrap();
    core.free(b.ptr).unwrap();
    core.release_pool(kv).unwrap();
    core.empty_cache().unwrap();
    let mut events = take(&log);
    events.sort_by_key(|e| e.1);
    let mut want = vec![
        (SegmentAction::Free, a.ptr.0, 20 * MIB, None),
        (SegmentAction::Free, b.ptr.0, 30 * MIB, Some(kv)),
    ];
    want.sort_by_key(|e| e.1);
    assert_eq!(events, want);
    assert!(core.segment_ranges().is_empty());
}

#[test]
fn expandable_pages_are_announced_mapped_and_unmapped() {
    let (mut core, s, log) = rig(accounting(), "expandable_segments:True");
    let a = core.malloc(30 * MIB, s).unwrap();
    let b = core.malloc(5 * MIB, s).unwrap();
    let first = take(&log);
    assert!(!first.is_empty());
    assert!(first
        .iter()
        .all(|e| e.0 == SegmentAction::Map && e.3.is_none()));
    let mapped: u64 = first.iter().map(|e| e.2).sum();
    assert_eq!(mapped, core.reserved_bytes());
    // A late subscriber: a snapshot now, then the events after it.
    let snapshot = held_now(&core);
    assert_eq!(snapshot.iter().map(|r| r.1).sum::<u64>(), mapped);
    let log_after: Log = Arc::default();
    let sink = log_after.clone();
    core.set_segment_sink(Some(Box::new(move |e| sink.lock().unwrap().push(e))));
    core.free(a.ptr).unwrap();
    core.empty_cache().unwrap();
    core.malloc(50 * MIB, s).unwrap();
    core.free(b.ptr).unwrap();
    let after = log_after.lock().unwrap().clone();
    assert!(after.iter().any(|e| e.action == SegmentAction::Unmap));
    let rebuilt = replay(&snapshot, &after);
    assert_eq!(
        joined(rebuilt),
        joined(held_now(&core)),
        "snapshot + events = what the core holds"
    );
}

#[test]
fn a_sleep_and_a_wake_are_announced_with_their_pages() {
    let sim = SimBackend::new(SimConfig {
        capacity_per_device: 1 << 30,
        ..SimConfig::fast(1)
    })
    .unwrap();
    let backend: Arc<dyn Backend> = sim.clone();
    let (mut core, s, log) = rig(backend.clone(), "expandable_segments:True");
    let kv = core.create_named_pool("kv", PoolOptions::default());
    core.malloc(MIB, s).unwrap();
    core.malloc_in(kv, 24 * MIB, s).unwrap();
    let before = held_now(&core);
    take(&log);
    let reserved = core.pool_usage(kv).unwrap().reserved.all().current;
    let plan = core.begin_sleep(kv, SleepMode::Discard).unwrap();
    let unmaps = take(&log);
    assert!(unmaps
        .iter()
        .all(|e| e.0 == SegmentAction::Unmap && e.3 == Some(kv)));
    assert_eq!(
        unmaps.iter().map(|e| e.2).sum::<u64>(),
        reserved,
        "announced at the begin"
    );
    wait_for_pool_streams(backend.as_ref(), &plan).unwrap();
    release_slept_pages(backend.as_ref(), &plan);
    assert!(core.finish_sleep(plan).is_empty());
    assert_eq!(
        take(&log),
        vec![(SegmentAction::PoolAsleep, 0, reserved, Some(kv))]
    );
    assert!(core.segment_ranges().iter().all(|r| r.pool != Some(kv)));
    let plan = core.begin_wake(kv).unwrap().unwrap();
    assert!(take(&log).is_empty(), "nothing mapped yet");
    let woken = map_wake(backend.as_ref(), &plan).unwrap();
    assert!(core.finish_wake(plan, woken).is_empty());
    let events = take(&log);
    assert_eq!(
        events.last(),
        Some(&(SegmentAction::PoolAwake, 0, reserved, Some(kv)))
    );
    let maps = &events[..events.len() - 1];
    assert!(maps
        .iter()
        .all(|e| e.0 == SegmentAction::Map && e.3 == Some(kv)));
    assert_eq!(maps.iter().map(|e| e.2).sum::<u64>(), reserved);
    assert_eq!(held_now(&core), before);
}

#[test]
fn without_a_sink_nothing_is_announced_and_removing_it_stops_the_events() {
    let (mut core, s, log) = rig(accounting(), "");
    core.set_segment_sink(None);
    core.malloc(MIB, s).unwrap();
    assert!(take(&log).is_empty());
    assert_eq!(core.segment_ranges().len(), 1);
}
