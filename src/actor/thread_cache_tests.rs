//! Unit tests of the thread cache: revives, parks, lanes, closing, recorded logs.

use super::*;
use gpualloc_runtime::DeviceId;

fn block(i: u64, size: u64) -> Allocation {
    Allocation {
        ptr: DevicePtr(0x1000 * (i + 1)),
        size,
        block_size: size.next_multiple_of(512),
        stream: StreamHandle {
            device: DeviceId(0),
            raw: 1,
        },
        small_pool: true,
        pool: None,
        oversize: false,
    }
}

type Cache = ThreadCache<()>;

fn new_cache() -> Cache {
    Cache::new(Arc::new(AtomicU64::new(0)))
}

/// Parks `a` unrecorded: the block to free through the core, if any (`a` itself when
/// declined, the oldest when evicted).
fn park(cache: &Cache, a: Allocation) -> Option<DevicePtr> {
    match cache.park(a, None) {
        Park::Declined(a) => Some(a.ptr),
        Park::Parked { evicted, flush } => {
            assert!(!flush, "nothing recorded");
            evicted.map(|e| {
                assert!(!e.recorded);
                e.ptr
            })
        }
    }
}

fn owner() -> Arc<()> {
    Arc::new(())
}

/// The block a revive handed back, if any.
fn revive(cache: &Cache, size: u64, stream: StreamHandle) -> Option<Allocation> {
    match cache.revive(&owner(), size, stream, None) {
        Revived::Hit(a, _lane) => Some(a),
        Revived::Free(_) | Revived::Miss => None,
    }
}

fn collect(cache: &Cache) -> (RoundTrips, Vec<ParkedFree>) {
    let (mut trips, mut parked) = (RoundTrips::default(), Vec::new());
    let mut log = Vec::new();
    cache.collect(false, &mut trips, &mut parked, &mut log);
    assert!(log.is_empty(), "nothing recorded");
    (trips, parked)
}

#[test]
fn revives_the_same_size_and_stream_only_and_evicts_the_oldest() {
    let cache = new_cache();
    assert!(park(&cache, block(0, 1000)).is_none());
    let other_stream = StreamHandle {
        device: DeviceId(0),
        raw: 2,
    };
    assert!(revive(&cache, 1000, other_stream).is_none());
    assert!(revive(&cache, 1024, block(0, 0).stream).is_none());
    assert_eq!(
        revive(&cache, 1000, block(0, 0).stream),
        Some(block(0, 1000))
    );
    assert!(
        revive(&cache, 1000, block(0, 0).stream).is_none(),
        "taken once"
    );
    for i in 1..=PARKED_PER_THREAD as u64 {
        assert!(park(&cache, block(i, 10 * i)).is_none());
    }
    assert_eq!(
        park(&cache, block(99, 7)),
        Some(block(1, 10).ptr),
        "the oldest goes"
    );
    assert_eq!(cache.revived(), 1);
    let (trips, parked) = collect(&cache);
    assert_eq!(trips.len(), 1);
    assert_eq!(parked.len(), PARKED_PER_THREAD);
    assert_eq!(collect(&cache), (RoundTrips::default(), vec![]));
}

#[test]
fn a_thread_whose_parks_never_pay_stops_parking_until_a_probe_does() {
    let cache = new_cache();
    // Parked, then a request of another size: the score goes negative.
    assert!(park(&cache, block(0, 100)).is_none());
    assert!(revive(&cache, 200, block(0, 0).stream).is_none());
    collect(&cache);
    let declined = (1..=40)
        .filter(|&i| park(&cache, block(i, 100 + i)).is_some())
        .count();
    // 40 drops while declining: every 16th parks (a probe).
    assert_eq!(declined, 40 - 2);
    let (_, parked) = collect(&cache);
    assert_eq!(parked.len(), 2, "the two probes");
    // A probe that is revived turns parking back on at once.
    let probe = (41..)
        .find(|&i| park(&cache, block(i, 500)).is_none())
        .unwrap();
    assert_eq!(
        revive(&cache, 500, block(0, 0).stream),
        Some(block(probe, 500))
    );
    assert!(park(&cache, block(200, 600)).is_none());
    assert!(park(&cache, block(201, 700)).is_none());
}

#[test]
fn lanes_are_made_once_per_slot_and_dropped_by_close() {
    let cache = new_cache();
    let owner = owner();
    let stream = block(0, 0).stream;
    let mut lanes = Vec::new();
    for i in 0..3 {
        assert!(park(&cache, block(i, 100)).is_none());
        match cache.revive(&owner, 100, stream, None) {
            Revived::Hit(_, lane) => lanes.push(lane),
            _ => panic!("parked just now"),
        }
    }
    assert!(Arc::ptr_eq(&lanes[0], &lanes[2]), "one lane per slot");
    assert_eq!(
        Arc::strong_count(&owner),
        2,
        "the lane holds the owner once"
    );
    assert_eq!(
        Arc::strong_count(&lanes[0]),
        4,
        "the slot and three buffers"
    );
    assert!(park(&cache, block(9, 100)).is_none());
    cache.close();
    assert_eq!(Arc::strong_count(&lanes[0]), 3, "the slot let go");
    assert!(matches!(
        cache.revive(&owner, 100, stream, None),
        Revived::Miss | Revived::Free(_)
    ));
    drop(lanes);
    assert_eq!(Arc::strong_count(&owner), 1, "no cycle left");
}

#[test]
fn nothing_is_parked_or_revived_after_close() {
    let cache = new_cache();
    assert!(park(&cache, block(0, 1000)).is_none());
    assert!(park(&cache, block(1, 2000)).is_none());
    assert_eq!(
        cache.close(),
        vec![block(0, 0).ptr, block(1, 0).ptr],
        "handed back"
    );
    assert!(revive(&cache, 1000, block(0, 0).stream).is_none());
    assert_eq!(park(&cache, block(2, 1000)), Some(block(2, 1000).ptr));
    assert!(cache.unpark_mine().is_empty());
}

#[test]
fn recorded_parks_and_revives_are_logged_in_order_and_long_logs_ask_for_a_collection() {
    let seq = Arc::new(AtomicU64::new(100));
    let cache = Cache::new(seq.clone());
    let at = |time_us| Recording {
        time_us,
        frames: None,
    };
    let a = block(0, 1000);
    assert_eq!(
        cache.park(a, Some(at(5))),
        Park::Parked {
            evicted: None,
            flush: false
        }
    );
    let frames: Frames = vec![gpualloc_devices::Frame {
        name: "request".into(),
        filename: "x.rs".into(),
        line: 1,
    }]
    .into();
    let with_frames = || Recording {
        time_us: 6,
        frames: Some(frames.clone()),
    };
    assert!(matches!(
        cache.revive(&owner(), 1000, a.stream, Some(&with_frames)),
        Revived::Hit(..)
    ));
    // Unrecorded ones write nothing.
    assert!(park(&cache, a).is_none());
    assert!(revive(&cache, 1000, a.stream).is_some());
    // A block parked before the recording began, revived while recording: its free is
    // requested and completed at the revive. Another one recorded, still parked.
    let b = block(1, 2000);
    assert!(park(&cache, b).is_none());
    assert!(matches!(
        cache.revive(&owner(), 2000, b.stream, Some(&|| at(8))),
        Revived::Hit(..)
    ));
    let c = block(2, 3000);
    assert!(matches!(cache.park(c, Some(at(9))), Park::Parked { .. }));
    let (mut trips, mut parked, mut log) = (RoundTrips::default(), Vec::new(), Vec::new());
    cache.collect(false, &mut trips, &mut parked, &mut log);
    let got: Vec<(u64, TraceAction, u64, u64, bool)> = log
        .iter()
        .map(|(s, e)| (*s, e.action, e.addr, e.time_us, e.frames.is_some()))
        .collect();
    // Parked: only the free's request. The block is free for a request only when it is
    // revived (or freed in the core, which records the completion then).
    assert_eq!(
        got,
        vec![
            (100, TraceAction::FreeRequested, a.ptr.0, 5, false),
            (101, TraceAction::FreeCompleted, a.ptr.0, 6, false),
            (102, TraceAction::Alloc, a.ptr.0, 6, true),
            (103, TraceAction::FreeRequested, b.ptr.0, 8, false),
            (104, TraceAction::FreeCompleted, b.ptr.0, 8, false),
            (105, TraceAction::Alloc, b.ptr.0, 8, false),
            (106, TraceAction::FreeRequested, c.ptr.0, 9, false),
        ]
    );
    assert_eq!(log[2].1.size, 1000);
    assert_eq!(seq.load(Ordering::Relaxed), 107);
    assert_eq!(
        parked,
        vec![ParkedFree {
            ptr: c.ptr,
            recorded: true
        }],
        "the core records its free_completed when it frees it"
    );
    // A park that takes the log past a multiple of LOG_FLUSH asks for a collection, once
    // per multiple, revives' entries counted: a round trip logs three.
    let mut flushes = Vec::new();
    for i in 0..LOG_FLUSH {
        match cache.park(block(0, 1000), Some(at(7))) {
            Park::Parked { flush, .. } => {
                if flush {
                    flushes.push(i)
                }
            }
            Park::Declined(_) => panic!("parks pay here"),
        }
        assert!(matches!(
            cache.revive(&owner(), 1000, a.stream, Some(&|| at(7))),
            Revived::Hit(..)
        ));
    }
    assert_eq!(flushes, vec![341, 683], "at 1024 and 2048 entries");
    // Closing drops what was logged.
    cache.close();
    let mut log = Vec::new();
    cache.collect(true, &mut trips, &mut parked, &mut log);
    assert!(log.is_empty());
}
