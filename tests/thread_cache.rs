//! The thread cache (`src/actor/thread_cache.rs`): a block a thread freed comes straight back
//! to its next request of the same size on the same stream, and everything that looks at the
//! device (stats, snapshots, `empty_cache`, other threads' requests, shutdown) sees the free
//! as if the core had done it.

mod common;

use std::sync::Arc;

use common::revivals;
use gpualloc::runtime::accounting::AccountingBackend;
use gpualloc::{AllocError, Allocator, AllocatorConfig, DeviceId, DeviceStats, Error};

const MIB: u64 = 1 << 20;

fn build(thread_cache: bool) -> (Arc<AccountingBackend>, Allocator) {
    let acc = Arc::new(AccountingBackend::new(1, 64 << 30));
    let alloc = Allocator::builder()
        .config(AllocatorConfig::default().with_thread_cache(thread_cache))
        .backend_instance(acc.clone())
        .build()
        .expect("build");
    (acc, alloc)
}

/// Statistics with `inactive_split`'s running totals set aside: the core merges a freed
/// block and splits it again, the thread cache does neither (documented).
fn comparable(mut s: DeviceStats) -> DeviceStats {
    for arr in [&mut s.inactive_split, &mut s.inactive_split_bytes] {
        for stat in arr.iter_mut() {
            stat.allocated = 0;
            stat.freed = 0;
        }
    }
    s
}

/// 50 rounds of (3000 B, 5 MiB) allocated, freed and asked for again on one stream: with
/// the thread cache the last 49 rounds skip the core, with the same addresses and the same
/// statistics (current values, peaks, totals) as the core gives without it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn revived_blocks_keep_addresses_and_stats_exact() {
    let mut runs = Vec::new();
    for on in [true, false] {
        let (_acc, alloc) = build(on);
        let s = alloc.new_stream(DeviceId(0)).unwrap();
        let mut ptrs = Vec::new();
        for _ in 0..50 {
            let a = alloc.malloc(3000, &s).await.unwrap();
            let b = alloc.malloc(5 * MIB, &s).await.unwrap();
            ptrs.push((a.ptr(), b.ptr()));
            drop(a);
            drop(b);
        }
        let stats = alloc.stats(DeviceId(0)).await.unwrap();
        runs.push((ptrs, stats, revivals(&alloc)));
        alloc.shutdown().await.unwrap();
    }
    let (with, without) = (&runs[0], &runs[1]);
    assert_eq!(
        with.2, 98,
        "every request after the first round was revived"
    );
    assert_eq!(without.2, 0);
    assert_eq!(with.0, without.0, "the same blocks as the core's best fit");
    let st = &with.1;
    assert_eq!(st.allocation[0].allocated, 100);
    assert_eq!(st.allocation[0].freed, 100);
    assert_eq!(st.allocation[0].current, 0);
    assert_eq!(st.allocation[0].peak, 2);
    assert_eq!(st.allocated_bytes[0].peak, 3072 + 5 * MIB);
    assert_eq!(st.allocated_bytes[0].allocated, 50 * (3072 + 5 * MIB));
    assert_eq!(st.requested_bytes[0].allocated, 50 * (3000 + 5 * MIB));
    assert_eq!(st.requested_bytes[1].freed, 50 * 3000, "small pool");
    assert_eq!(st.active_bytes[2].freed, 50 * 5 * MIB, "large pool");
    assert_eq!(comparable(with.1.clone()), comparable(without.1.clone()));
}

/// Only the same size on the same stream is revived; a buffer used on another stream goes
/// through the core (its free waits on events); use on its own stream does not count.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_same_size_same_stream_unshared_blocks_are_revived() {
    // Another stream, another size: the core, which finds the parked block (collected when
    // the request took the gate).
    let (_acc, alloc) = build(true);
    let s1 = alloc.new_stream(DeviceId(0)).unwrap();
    let s2 = alloc.new_stream(DeviceId(0)).unwrap();
    let a = alloc.malloc(4096, &s1).await.unwrap();
    let pa = a.ptr();
    drop(a);
    let other_stream = alloc.malloc(4096, &s2).await.unwrap();
    // Not revived, nor lent (small blocks are not: `loans.rs`): a page of s2's own.
    assert_ne!(other_stream.ptr(), pa);
    assert_eq!(revivals(&alloc), 0);
    let other_size = alloc.malloc(4000, &s1).await.unwrap();
    assert_eq!(other_size.ptr(), pa, "s1's block, from the core");
    assert_eq!(revivals(&alloc), 0);
    alloc.shutdown().await.unwrap();

    // Used on another stream: the core. Used on its own stream: still revived.
    let (_acc, alloc) = build(true);
    let s1 = alloc.new_stream(DeviceId(0)).unwrap();
    let s2 = alloc.new_stream(DeviceId(0)).unwrap();
    let shared = alloc.malloc(4000, &s1).await.unwrap();
    shared.record_stream(&s2).unwrap();
    drop(shared);
    let after_shared = alloc.malloc(4000, &s1).await.unwrap();
    assert_eq!(
        revivals(&alloc),
        0,
        "a block used on s2 waits on events in the core"
    );
    after_shared.record_stream(&s1).unwrap();
    let p = after_shared.ptr();
    drop(after_shared);
    let again = alloc.malloc(4000, &s1).await.unwrap();
    assert_eq!((again.ptr(), revivals(&alloc)), (p, 1));
    drop(again);
    alloc.shutdown().await.unwrap();
}

/// Shutdown returns parked blocks to the device with the rest; nothing is revived after it,
/// and late drops are harmless.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_returns_parked_blocks_and_ends_revivals() {
    let (acc, alloc) = build(true);
    let s = alloc.new_stream(DeviceId(0)).unwrap();
    let kept = alloc.malloc(2 * MIB, &s).await.unwrap();
    drop(alloc.malloc(4096, &s).await.unwrap());
    drop(alloc.malloc(4096, &s).await.unwrap());
    assert_eq!(revivals(&alloc), 1);
    alloc.shutdown().await.unwrap();
    assert_eq!(acc.used(DeviceId(0)), 0, "parked and live blocks went back");
    let err = alloc.malloc(4096, &s).await.unwrap_err();
    assert!(matches!(err, Error::Alloc(AllocError::Shutdown)), "{err:?}");
    assert_eq!(revivals(&alloc), 1);
    drop(kept);
    let err = alloc.malloc(2 * MIB, &s).await.unwrap_err();
    assert!(matches!(err, Error::Alloc(AllocError::Shutdown)), "{err:?}");
    assert_eq!(acc.used(DeviceId(0)), 0);
}

/// A parked block is freed as far as anyone else can tell: stats, snapshots, `empty_cache`
/// and another thread's request for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parked_blocks_are_seen_by_stats_snapshots_empty_cache_and_other_threads() {
    let (acc, alloc) = build(true);
    let s = alloc.new_stream(DeviceId(0)).unwrap();
    let buf = alloc.malloc(MIB, &s).await.unwrap();
    drop(buf);
    let st = alloc.stats(DeviceId(0)).await.unwrap();
    assert_eq!(st.allocated_bytes[0].current, 0);
    assert_eq!(st.active[0].current, 0);
    let snap = alloc.snapshot().await.unwrap();
    let blocks: Vec<_> = snap[0].segments.iter().flat_map(|s| &s.blocks).collect();
    assert!(
        blocks.iter().all(|b| b.state.as_str() == "inactive"),
        "{blocks:?}"
    );

    // Parked on another thread, requested here: the core serves it from its cache.
    let (a2, s2) = (alloc.clone(), s.clone());
    let q = std::thread::spawn(move || {
        let b = futures::executor::block_on(a2.malloc(3 * MIB, &s2)).unwrap();
        b.ptr()
    })
    .join()
    .unwrap();
    let here = alloc.malloc(3 * MIB, &s).await.unwrap();
    assert_eq!(
        here.ptr(),
        q,
        "the other thread's parked block, through the core"
    );
    assert_eq!(revivals(&alloc), 0);
    // Expandable segments (the default on a backend with virtual memory): one growth each,
    // the small pool's one page, and the large pool's 4 MiB in two handles (the page wholly
    // inside the 3 MiB request, then the page it ends in).
    assert_eq!(
        (acc.counts().mallocs, acc.counts().maps),
        (0, 3),
        "a small and a large segment, nothing more"
    );
    drop(here);

    alloc.empty_cache().await.unwrap();
    let st = alloc.stats(DeviceId(0)).await.unwrap();
    assert_eq!(st.reserved_bytes[0].current, 0);
    assert_eq!(acc.used(DeviceId(0)), 0);
    alloc.shutdown().await.unwrap();
}

/// 16 tasks on two workers, 2,000 round trips each with sizes from a small set on their own
/// and on a shared stream: the totals count every allocation and free exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_round_trips_are_counted_exactly() {
    const TASKS: u64 = 16;
    const ROUNDS: u64 = 2000;
    const SIZES: [u64; 4] = [512, 4096, 100_000, 3 * MIB];
    let (_acc, alloc) = build(true);
    let shared = alloc.new_stream(DeviceId(0)).unwrap();
    let tasks: Vec<_> = (0..TASKS)
        .map(|t| {
            let alloc = alloc.clone();
            let shared = shared.clone();
            tokio::spawn(async move {
                let own = alloc.new_stream(DeviceId(0)).unwrap();
                for i in 0..ROUNDS {
                    let stream = if (i + t) % 3 == 0 { &shared } else { &own };
                    let size = SIZES[((i / 7 + t) % 4) as usize];
                    let buf = alloc.malloc(size, stream).await.unwrap();
                    if i % 64 == 0 {
                        tokio::task::yield_now().await;
                    }
                    drop(buf);
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    let per_round: u64 = (0..TASKS)
        .flat_map(|t| (0..ROUNDS).map(move |i| SIZES[((i / 7 + t) % 4) as usize]))
        .sum();
    // A block one stream lent another goes back to its lender once an event on the borrower
    // completes, as a `record_stream` free does: until the next request (or this release,
    // which synchronizes first) it counts as active.
    alloc.empty_cache().await.unwrap();
    let st = alloc.stats(DeviceId(0)).await.unwrap();
    assert_eq!(st.allocation[0].allocated, TASKS * ROUNDS);
    assert_eq!(st.allocation[0].freed, TASKS * ROUNDS);
    assert_eq!(st.allocation[0].current, 0);
    assert_eq!(st.active[0].current, 0);
    assert_eq!(st.requested_bytes[0].allocated, per_round);
    assert_eq!(st.requested_bytes[0].freed, per_round);
    assert_eq!(st.requested_bytes[0].current, 0);
    assert_eq!(
        st.allocated_bytes[0].allocated, st.allocated_bytes[0].freed,
        "every allocated byte was freed"
    );
    assert!(
        st.allocation[0].peak <= TASKS,
        "peak {}",
        st.allocation[0].peak
    );
    // Every request that takes the gate collects every slot, so interleaved streams and
    // sizes keep the hit rate low here (5-25% seen), and threads whose parks stop paying
    // stop parking; the point is that the cache took part.
    assert!(
        revivals(&alloc) > TASKS * ROUNDS / 100,
        "{}",
        revivals(&alloc)
    );
    alloc.shutdown().await.unwrap();
}

/// The thread cache's lanes point back at the device actor; dropping the allocator's last
/// handle without `shutdown` breaks that cycle, so the actor and its core go away and every
/// segment returns to the device once the buffers are gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_allocator_without_shutdown_returns_everything() {
    let (acc, alloc) = build(true);
    let s = alloc.new_stream(DeviceId(0)).unwrap();
    drop(alloc.malloc(4096, &s).await.unwrap());
    let revived = alloc.malloc(4096, &s).await.unwrap(); // holds the thread's lane
    drop(alloc.malloc(3 * MIB, &s).await.unwrap()); // parked
    assert_eq!(revivals(&alloc), 1);
    let actor = Arc::downgrade(alloc.device_actor(DeviceId(0)).unwrap());
    drop(alloc);
    drop(revived);
    for _ in 0..500 {
        if actor.strong_count() == 0 && acc.used(DeviceId(0)) == 0 {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(2)).await;
    }
    panic!(
        "actor alive: {} references, {} bytes still on the device",
        actor.strong_count(),
        acc.used(DeviceId(0))
    );
}
