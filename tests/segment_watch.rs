//! The segment observer through the public API: a watch's ranges plus
//! the events after them always equal what the allocator holds (early and late watchers, two
//! configs, pools, a sleep), and an observer that lags or panics does not disturb the
//! allocator or the other observers.

mod common;

use std::time::Duration;

use common::{build, joined, sim, MIB};
use gpualloc::{
    Allocator, DeviceId, HeldRanges, PoolOptions, SegmentAction, SegmentEvent, SegmentWatch,
    SleepMode, SEGMENT_EVENTS_BUFFERED,
};
use tokio::sync::broadcast::error::TryRecvError;

const D0: DeviceId = DeviceId(0);

/// Every event received so far, without waiting.
fn drain(watch: &mut SegmentWatch) -> Vec<SegmentEvent> {
    let mut out = Vec::new();
    loop {
        match watch.events.try_recv() {
            Ok(e) => out.push(e),
            Err(TryRecvError::Empty) => return out,
            Err(e) => panic!("{e:?}"),
        }
    }
}

/// The bytes held per page-joined range, from a watch's ranges and its events.
fn held(watch: &mut SegmentWatch) -> Vec<(u64, u64)> {
    let mut held = HeldRanges::new(watch.ranges.iter().map(|r| (r.addr, r.size)));
    for e in drain(watch) {
        held.apply(&e).unwrap();
    }
    joined(held.ranges())
}

async fn now(alloc: &Allocator) -> Vec<(u64, u64)> {
    let w = alloc.watch_segments(D0).await.unwrap();
    joined(w.ranges.iter().map(|r| (r.addr, r.size)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ranges_and_events_add_up_to_what_the_allocator_holds() {
    for conf in ["", "expandable_segments:True", "thread_cache:False"] {
        let alloc = build(sim(4 << 30), conf);
        let s = alloc.new_stream(D0).unwrap();
        let mut early = alloc.watch_segments(D0).await.unwrap();
        assert!(early.ranges.is_empty());
        let kv = alloc.pool("kv", PoolOptions::default()).await.unwrap();
        let mut bufs = Vec::new();
        for i in 0..40u64 {
            bufs.push(alloc.malloc((i % 9) * 3 * MIB + 4096, &s).await.unwrap());
            bufs.push(kv.malloc((i % 4) * MIB + 100, &s).await.unwrap());
        }
        let mut late = alloc.watch_segments(D0).await.unwrap();
        let reserved = alloc.stats(D0).await.unwrap().reserved_bytes.all().current;
        assert_eq!(
            late.ranges.iter().map(|r| r.size).sum::<u64>(),
            reserved,
            "[{conf}]"
        );
        let kv_id = kv.id(D0).unwrap();
        let kv_bytes: u64 = late
            .ranges
            .iter()
            .filter(|r| r.pool == Some(kv_id))
            .map(|r| r.size)
            .sum();
        assert_eq!(kv_bytes, kv.usage(D0).await.unwrap().reserved.all().current);
        bufs.truncate(30);
        alloc.empty_cache().await.unwrap();
        for i in 0..10u64 {
            bufs.push(alloc.malloc(i * 5 * MIB + 1, &s).await.unwrap());
        }
        drop(bufs);
        alloc.empty_cache().await.unwrap();
        let truth = now(&alloc).await;
        assert_eq!(held(&mut early), truth, "[{conf}] early watcher");
        assert_eq!(held(&mut late), truth, "[{conf}] late watcher");
        alloc.shutdown().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pools_sleep_and_wake_are_announced_with_the_pool() {
    let alloc = build(sim(2 << 30), "expandable_segments:True");
    let s = alloc.new_stream(D0).unwrap();
    let kv = alloc.pool("kv", PoolOptions::default()).await.unwrap();
    let _b = kv.malloc(40 * MIB, &s).await.unwrap();
    let mut w = alloc.watch_segments(D0).await.unwrap();
    kv.sleep(SleepMode::Discard).await.unwrap();
    kv.wake().await.unwrap();
    let events = drain(&mut w);
    let id = Some(kv.id(D0).unwrap());
    let actions: Vec<SegmentAction> = events.iter().map(|e| e.action).collect();
    let asleep = actions
        .iter()
        .position(|a| *a == SegmentAction::PoolAsleep)
        .unwrap();
    let awake = actions
        .iter()
        .position(|a| *a == SegmentAction::PoolAwake)
        .unwrap();
    assert!(events[..asleep]
        .iter()
        .all(|e| e.action == SegmentAction::Unmap && e.pool == id));
    assert!(events[asleep + 1..awake]
        .iter()
        .all(|e| e.action == SegmentAction::Map && e.pool == id));
    assert_eq!(awake, actions.len() - 1);
    assert!(events.iter().all(|e| e.device == D0));
    alloc.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn observers_that_lag_or_panic_do_not_disturb_the_allocator() {
    let alloc = build(sim(2 << 30), "expandable_segments:True");
    let s = alloc.new_stream(D0).unwrap();
    let mut lagging = alloc.watch_segments(D0).await.unwrap();
    let mut steady = alloc.watch_segments(D0).await.unwrap();
    let panicking = alloc.watch_segments(D0).await.unwrap();
    let crashed = tokio::spawn(async move {
        let mut events = panicking.events;
        let e = events.recv().await.unwrap();
        panic!("an observer that panics on {e:?}");
    });
    // Map and unmap a page over and over: two events a round, past the channel's buffer.
    let rounds = SEGMENT_EVENTS_BUFFERED / 2 + 10;
    let counter = tokio::spawn(async move {
        let mut n = 0usize;
        while n < rounds + 1 {
            if steady.events.recv().await.unwrap().action == SegmentAction::Map {
                n += 1;
            }
        }
        n
    });
    for _ in 0..rounds {
        let b = alloc.malloc(2 * MIB, &s).await.unwrap();
        drop(b);
        alloc.empty_cache().await.unwrap();
    }
    assert!(crashed.await.unwrap_err().is_panic());
    let b = alloc.malloc(2 * MIB, &s).await.unwrap();
    match lagging.events.try_recv() {
        Err(TryRecvError::Lagged(n)) => assert!(n > 0),
        other => panic!("expected a lag, got {other:?}"),
    }
    let maps = tokio::time::timeout(Duration::from_secs(10), counter)
        .await
        .expect("the steady observer saw every map")
        .unwrap();
    assert_eq!(maps, rounds + 1);
    drop(b);
    alloc.shutdown().await.unwrap();
}

/// A pool of unsplit blocks: each buffer is a range of its own, announced with the buffer's
/// address and size (what NVLS registration needs); refused without expandable segments.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unsplit_pools_buffers_are_each_announced_as_their_own_range() {
    let g = 4 * MIB;
    let options = PoolOptions {
        unsplit: Some(g),
        ..PoolOptions::default()
    };
    let plain = build(sim(1 << 30), "expandable_segments:False");
    let err = plain.pool("nvls", options.clone()).await.unwrap_err();
    assert!(
        matches!(
            err,
            gpualloc::Error::Alloc(gpualloc::AllocError::NotSupported(_))
        ),
        "{err:?}"
    );
    for conf in [
        "expandable_segments:True",
        "expandable_segments:True,thread_cache:False",
    ] {
        let alloc = build(sim(2 << 30), conf);
        let s = alloc.new_stream(D0).unwrap();
        let nvls = alloc.pool("nvls", options.clone()).await.unwrap();
        let mut w = alloc.watch_segments(D0).await.unwrap();
        let mut bufs = Vec::new();
        for size in [100, 3 * MIB, g, g + 1, 9 * MIB] {
            let b = nvls.malloc(size, &s).await.unwrap();
            assert_eq!(b.ptr().0 % g, 0, "[{conf}] {size}");
            bufs.push(b);
        }
        let maps: Vec<(u64, u64)> = drain(&mut w)
            .iter()
            .filter(|e| e.action == SegmentAction::Map)
            .map(|e| (e.addr, e.size))
            .collect();
        let want: Vec<(u64, u64)> = bufs
            .iter()
            .map(|b| (b.ptr().0, b.len().div_ceil(g) * g))
            .collect();
        assert_eq!(maps, want, "[{conf}]");
        drop(bufs);
        alloc.shutdown().await.unwrap();
    }
}
