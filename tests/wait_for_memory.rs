//! Waiting for memory: a request that can never fit fails at once, and a
//! large waiter at the head does not block smaller ones that fit, while its own wait is
//! bounded (it is overtaken at most `MAX_OVERTAKES` times).

use std::sync::Arc;
use std::time::{Duration, Instant};

mod common;

use common::{until_waiting, MIB};
use gpualloc::devices::TraceAction;
use gpualloc::runtime::accounting::AccountingBackend;
use gpualloc::{Allocator, DeviceBuffer, DeviceId, Error, HistoryOptions, MallocOptions, Stream};
use gpualloc_actor::waiters::MAX_OVERTAKES;
use tokio::task::JoinHandle;

const LONG: Duration = Duration::from_secs(20);

fn build(conf: &str, capacity: u64) -> Allocator {
    common::build(Arc::new(AccountingBackend::new(1, capacity)), conf)
}

fn waiter(alloc: &Allocator, s: &Stream, size: u64) -> JoinHandle<Result<DeviceBuffer, Error>> {
    let (alloc, s) = (alloc.clone(), s.clone());
    tokio::spawn(async move {
        alloc
            .malloc_with(size, &s, MallocOptions::wait_for(LONG))
            .await
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_that_can_never_fit_fails_at_once() {
    let cases = [
        ("", 100 * MIB),
        ("expandable_segments:True", 100 * MIB),
        ("thread_cache:False", 65 * MIB),
        ("per_process_memory_fraction:0.5", 40 * MIB),
    ];
    for (conf, size) in cases {
        let alloc = build(conf, 64 * MIB);
        let s = alloc.new_stream(DeviceId(0)).unwrap();
        let held = alloc.malloc(8 * MIB, &s).await.unwrap();
        let t0 = Instant::now();
        let err = alloc
            .malloc_with(size, &s, MallocOptions::wait_for(LONG))
            .await
            .unwrap_err();
        assert!(err.is_oom(), "{conf:?}: {err}");
        assert!(
            t0.elapsed() < LONG / 2,
            "{conf:?}: waited {:?} for memory no free can make",
            t0.elapsed()
        );
        drop(held);
        alloc.shutdown().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn smaller_waiters_that_fit_are_served_past_a_large_head() {
    for conf in ["", "thread_cache:False", "expandable_segments:True"] {
        let alloc = build(conf, 64 * MIB);
        let s = alloc.new_stream(DeviceId(0)).unwrap();
        let x = alloc.malloc(36 * MIB, &s).await.unwrap();
        let y = alloc.malloc(24 * MIB, &s).await.unwrap();
        let big = waiter(&alloc, &s, 48 * MIB);
        until_waiting(&alloc, 1).await;
        let small1 = waiter(&alloc, &s, 12 * MIB);
        until_waiting(&alloc, 2).await;
        let small2 = waiter(&alloc, &s, 12 * MIB);
        until_waiting(&alloc, 3).await;
        // 24 MiB come back: not enough for the head, enough for both small ones.
        drop(y);
        let a = tokio::time::timeout(Duration::from_secs(5), small1)
            .await
            .unwrap_or_else(|_| panic!("{conf:?}: a 12 MiB waiter stayed blocked"))
            .unwrap()
            .unwrap();
        let b = tokio::time::timeout(Duration::from_secs(5), small2)
            .await
            .unwrap_or_else(|_| panic!("{conf:?}: the second 12 MiB waiter stayed blocked"))
            .unwrap()
            .unwrap();
        assert!(!big.is_finished(), "{conf:?}: the head still waits");
        assert_eq!(alloc.device_actor(DeviceId(0)).unwrap().waiting(), 1);
        drop((a, b, x));
        let big = tokio::time::timeout(Duration::from_secs(5), big)
            .await
            .unwrap_or_else(|_| panic!("{conf:?}: the head was not served"))
            .unwrap()
            .unwrap();
        assert_eq!(big.len(), 48 * MIB);
        drop(big);
        alloc.shutdown().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_head_is_overtaken_at_most_max_overtakes_times() {
    let alloc = build("thread_cache:False", 64 * MIB);
    let s = alloc.new_stream(DeviceId(0)).unwrap();
    let x = alloc.malloc(36 * MIB, &s).await.unwrap();
    let big = waiter(&alloc, &s, 48 * MIB);
    until_waiting(&alloc, 1).await;
    // Each later request fits in the free 28 MiB; each served one overtakes the head.
    for i in 0..MAX_OVERTAKES {
        let small = waiter(&alloc, &s, 12 * MIB);
        let buf = tokio::time::timeout(Duration::from_secs(5), small)
            .await
            .unwrap_or_else(|_| panic!("overtake {i} was refused"))
            .unwrap()
            .unwrap();
        drop(buf);
    }
    // The head has aged: a later request that would fit now queues behind it.
    let late = waiter(&alloc, &s, 12 * MIB);
    until_waiting(&alloc, 2).await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!late.is_finished(), "an aged head is not overtaken");
    drop(x);
    let big = tokio::time::timeout(Duration::from_secs(5), big)
        .await
        .expect("the head is served first")
        .unwrap()
        .unwrap();
    let late = tokio::time::timeout(Duration::from_secs(5), late)
        .await
        .expect("then the next")
        .unwrap()
        .unwrap();
    drop((big, late));
    alloc.shutdown().await.unwrap();
}

/// Out-of-memory events of device 0: the stat, and the `oom` entries of its history.
async fn ooms(alloc: &Allocator) -> (u64, usize) {
    let stats = alloc.stats(DeviceId(0)).await.unwrap();
    let entries = common::history(alloc)
        .await
        .iter()
        .filter(|e| e.action == TraceAction::Oom)
        .count();
    (stats.num_ooms, entries)
}

/// A waiting malloc is one request: it counts as out of memory (`num_ooms`, one `oom` entry in
/// the history, one warning) only when it fails, once, however often it tried before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_malloc_counts_one_oom_and_only_when_it_fails() {
    for conf in ["", "thread_cache:False", "expandable_segments:True"] {
        let alloc = build(conf, 64 * MIB);
        alloc
            .record_history(HistoryOptions::default())
            .await
            .unwrap();
        let s = alloc.new_stream(DeviceId(0)).unwrap();
        let x = alloc.malloc(40 * MIB, &s).await.unwrap();
        let y = alloc.malloc(8 * MIB, &s).await.unwrap();
        let served = waiter(&alloc, &s, 40 * MIB);
        until_waiting(&alloc, 1).await;
        // A free that is not enough: the waiter tries again and fails again.
        drop(y);
        tokio::time::sleep(Duration::from_millis(50)).await;
        drop(x);
        let buf = tokio::time::timeout(Duration::from_secs(5), served)
            .await
            .unwrap_or_else(|_| panic!("{conf:?}: the waiter was not served"))
            .unwrap()
            .unwrap();
        assert_eq!(ooms(&alloc).await, (0, 0), "{conf:?}: a served waiter");

        // Out of time: one failure, counted once.
        let err = alloc
            .malloc_with(
                40 * MIB,
                &s,
                MallocOptions::wait_for(Duration::from_millis(100)),
            )
            .await
            .unwrap_err();
        assert!(err.is_oom(), "{conf:?}: {err}");
        assert_eq!(ooms(&alloc).await, (1, 1), "{conf:?}: a waiter out of time");
        // A plain malloc that fails counts as before.
        alloc.malloc(40 * MIB, &s).await.unwrap_err();
        assert_eq!(ooms(&alloc).await, (2, 2), "{conf:?}: a plain malloc");
        alloc
            .malloc_with(40 * MIB, &s, MallocOptions::default())
            .await
            .unwrap_err();
        assert_eq!(ooms(&alloc).await, (3, 3), "{conf:?}: malloc_with, no wait");
        drop(buf);
        alloc.shutdown().await.unwrap();
    }
}
