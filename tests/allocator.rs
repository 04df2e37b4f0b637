//! The allocator's behaviour through its public API on the accounting backend: hits, misses,
//! drops on any thread, shutdown, empty_cache, waiting for memory, cancellation.

use std::sync::Arc;
use std::time::Duration;

mod common;

use common::{until_parked, until_waiting};
use gpualloc::runtime::accounting::AccountingBackend;
use gpualloc::{
    Allocator, AllocatorConfig, BackendError, BackendKind, DeviceId, Error, MallocOptions,
};

const MIB: u64 = 1 << 20;

fn accounting(devices: u32, capacity: u64) -> (Arc<AccountingBackend>, Allocator) {
    let acc = Arc::new(AccountingBackend::new(devices, capacity));
    let alloc = Allocator::builder()
        .config(AllocatorConfig::default())
        .backend_instance(acc.clone())
        .build()
        .expect("build");
    (acc, alloc)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hit_after_free_reuses_the_block_and_stats_add_up() {
    let (acc, alloc) = accounting(1, 1 << 30);
    let s = alloc.new_stream(DeviceId(0)).unwrap();
    let a = alloc.malloc(3000, &s).await.unwrap();
    assert_eq!((a.len(), a.device()), (3000, DeviceId(0)));
    let p = a.ptr();
    drop(a);
    let b = alloc.malloc(3000, &s).await.unwrap();
    assert_eq!(b.ptr(), p, "a hit reuses the cached block");
    assert!(!b.is_empty());
    // What a person sees in a log: the address, the length and the device.
    let shown = format!("{b:?}");
    for part in [
        format!("{:?}", b.ptr()),
        "len: 3000".into(),
        "DeviceId(0)".into(),
    ] {
        assert!(shown.contains(&part), "{shown} lacks {part}");
    }
    // The default config under the `gpualloc` policy runs expandable segments where the
    // backend has virtual memory: one page mapped, no device malloc.
    assert_eq!(
        (acc.counts().mallocs, acc.counts().maps),
        (0, 1),
        "one driver call for two allocations"
    );
    let st = alloc.stats(DeviceId(0)).await.unwrap();
    assert_eq!(st.allocated_bytes[0].current, 3072);
    assert_eq!(st.reserved_bytes[0].current, 2 * MIB);
    let empty = alloc.malloc(0, &s).await.unwrap();
    assert!(empty.is_empty() && empty.ptr().0 == 0);
    drop(b);
    alloc.shutdown().await.unwrap();
    assert_eq!(acc.used(DeviceId(0)), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drops_on_plain_threads_and_after_shutdown_are_harmless() {
    let (acc, alloc) = accounting(1, 1 << 30);
    let s = alloc.new_stream(DeviceId(0)).unwrap();
    let mut bufs = Vec::new();
    for i in 0..64 {
        bufs.push(alloc.malloc(1000 + i * 100, &s).await.unwrap());
    }
    let half = bufs.split_off(32);
    std::thread::spawn(move || drop(half)).join().unwrap();
    let st = alloc.stats(DeviceId(0)).await.unwrap();
    assert_eq!(st.allocation[0].current, 32);
    alloc.shutdown().await.unwrap();
    assert_eq!(
        acc.used(DeviceId(0)),
        0,
        "shutdown returns every segment, live buffers too"
    );
    std::thread::spawn(move || drop(bufs)).join().unwrap();
    let err = alloc.malloc(10, &s).await.unwrap_err();
    assert!(err.is_shutdown(), "{err}");
    assert!(alloc.shutdown().await.is_ok(), "idempotent");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn empty_cache_returns_reserved_to_zero() {
    let (acc, alloc) = accounting(2, 1 << 30);
    let s0 = alloc.new_stream(DeviceId(0)).unwrap();
    let s1 = alloc.new_stream(DeviceId(1)).unwrap();
    let keep = alloc.malloc(12 * MIB, &s1).await.unwrap();
    let bufs = vec![
        alloc.malloc(100, &s0).await.unwrap(),
        alloc.malloc(30 * MIB, &s0).await.unwrap(),
        alloc.malloc(5 * MIB, &s1).await.unwrap(),
    ];
    drop(bufs);
    alloc.empty_cache().await.unwrap();
    assert_eq!(
        alloc.stats(DeviceId(0)).await.unwrap().reserved_bytes[0].current,
        0
    );
    assert_eq!(
        alloc.stats(DeviceId(1)).await.unwrap().reserved_bytes[0].current,
        12 * MIB
    );
    assert_eq!(acc.used(DeviceId(0)), 0);
    drop(keep);
    alloc.empty_cache().await.unwrap();
    assert_eq!(
        alloc.stats(DeviceId(1)).await.unwrap().reserved_bytes[0].current,
        0
    );
    assert_eq!(acc.used(DeviceId(1)), 0);
    let summary = alloc.memory_summary().await.unwrap();
    assert!(
        summary.contains("device ID 1") && summary.contains("GPU reserved memory"),
        "{summary}"
    );
    alloc.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oom_releases_the_cache_then_reports_pytorch_numbers() {
    let (_acc, alloc) = accounting(1, 64 * MIB);
    let s = alloc.new_stream(DeviceId(0)).unwrap();
    let a = alloc.malloc(40 * MIB, &s).await.unwrap();
    drop(a);
    // 40 MiB cached; 50 MiB does not fit next to it: the cache is released and it succeeds.
    let b = alloc.malloc(50 * MIB, &s).await.unwrap();
    let err = alloc.malloc(20 * MIB, &s).await.unwrap_err();
    assert!(err.is_oom(), "{err}");
    assert!(
        err.to_string().contains("tried to allocate 20.00 MiB"),
        "{err}"
    );
    drop(b);
    alloc.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_for_memory_succeeds_after_a_free_or_times_out_with_oom() {
    let (_acc, alloc) = accounting(1, 64 * MIB);
    let s = alloc.new_stream(DeviceId(0)).unwrap();
    let first = alloc.malloc(40 * MIB, &s).await.unwrap();
    // Without waiting: OOM at once.
    assert!(alloc.malloc(40 * MIB, &s).await.unwrap_err().is_oom());
    // With a short wait: the same OOM after the timeout.
    let t0 = std::time::Instant::now();
    let err = alloc
        .malloc_with(
            40 * MIB,
            &s,
            MallocOptions::wait_for(Duration::from_millis(30)),
        )
        .await
        .unwrap_err();
    assert!(err.is_oom(), "{err}");
    assert!(t0.elapsed() >= Duration::from_millis(30));
    // With a long wait: served once `first` is dropped.
    let alloc2 = alloc.clone();
    let s2 = s.clone();
    let waiter = tokio::spawn(async move {
        alloc2
            .malloc_with(
                40 * MIB,
                &s2,
                MallocOptions::wait_for(Duration::from_secs(10)),
            )
            .await
    });
    until_waiting(&alloc, 1).await;
    drop(first);
    let second = tokio::time::timeout(Duration::from_secs(5), waiter)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(second.len(), 40 * MIB);
    assert_eq!(alloc.device_actor(DeviceId(0)).unwrap().waiting(), 0);
    drop(second);
    alloc.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_are_served_in_order_and_cancelled_ones_leave_cleanly() {
    let (_acc, alloc) = accounting(1, 64 * MIB);
    let s = alloc.new_stream(DeviceId(0)).unwrap();
    let hog = alloc.malloc(60 * MIB, &s).await.unwrap();
    // 40 MiB waiters on a 64 MiB device: one is served at a time (two served by one pass
    // would push their numbers in whatever order their tasks run).
    let order = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut handles = Vec::new();
    for i in 0..3u32 {
        let (a, s, order) = (alloc.clone(), s.clone(), order.clone());
        handles.push(tokio::spawn(async move {
            let alloc = a;
            let buf = alloc
                .malloc_with(
                    40 * MIB,
                    &s,
                    MallocOptions::wait_for(Duration::from_secs(10)),
                )
                .await
                .unwrap();
            order.lock().unwrap().push(i);
            // Held until the waiters behind have retried, failed and parked again (see
            // below): a retry still running when this buffer goes back would take it.
            // (Nobody is served while this is held: the queue stays as it is.)
            let behind = alloc.device_actor(DeviceId(0)).unwrap().waiting();
            until_parked(&alloc, behind).await;
            drop(buf);
        }));
        until_waiting(&alloc, i as usize + 1).await;
    }
    // A fourth waiter is cancelled while queued: it must not block the others.
    let cancelled = {
        let (alloc, s) = (alloc.clone(), s.clone());
        tokio::spawn(async move {
            let _ = alloc
                .malloc_with(
                    40 * MIB,
                    &s,
                    MallocOptions::wait_for(Duration::from_secs(10)),
                )
                .await;
        })
    };
    until_waiting(&alloc, 4).await;
    cancelled.abort();
    let _ = cancelled.await;
    assert_eq!(alloc.device_actor(DeviceId(0)).unwrap().waiting(), 3);
    // A waiter retries once right after it joins, a turn that leaves passes its wake-up on,
    // and a woken head that still does not fit passes the memory that came back to the
    // waiters behind it: a retry still running when memory goes back takes it, as the
    // queue's bounded overtaking allows (a loaded CI machine saw [2, 0, 1] when memory came
    // back after a fixed wait). Those retries end first, each waiter parked: the order
    // asserted is the one memory coming back to parked waiters is served in.
    until_parked(&alloc, 3).await;
    let actor = alloc.device_actor(DeviceId(0)).unwrap();
    assert!(
        actor.describe().contains("3 waiting for memory (3 parked)"),
        "{}",
        actor.describe()
    );
    drop(hog);
    for h in handles {
        tokio::time::timeout(Duration::from_secs(5), h)
            .await
            .unwrap()
            .unwrap();
    }
    assert_eq!(*order.lock().unwrap(), vec![0, 1, 2]);
    alloc.empty_cache().await.unwrap();
    assert_eq!(
        alloc.stats(DeviceId(0)).await.unwrap().reserved_bytes[0].current,
        0
    );
    alloc.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_mallocs_leak_nothing() {
    let (acc, alloc) = accounting(1, 1 << 30);
    let s = alloc.new_stream(DeviceId(0)).unwrap();
    let mut kept = Vec::new();
    for i in 0..400u64 {
        let size = 1 + (i * 7919) % (24 * MIB);
        let fut = alloc.malloc(size, &s);
        match tokio::time::timeout(Duration::from_micros(i % 50), fut).await {
            Ok(Ok(b)) if i % 3 == 0 => kept.push(b),
            Ok(Ok(_)) | Err(_) => {}
            Ok(Err(e)) => panic!("{e}"),
        }
    }
    drop(kept);
    // Misses cancelled mid-flight finish on the blocking pool and return their blocks.
    let actor = alloc.device_actor(DeviceId(0)).unwrap().clone();
    for _ in 0..400 {
        if actor.misses_in_flight() == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(actor.misses_in_flight(), 0);
    let st = alloc.stats(DeviceId(0)).await.unwrap();
    assert_eq!(st.allocation[0].current, 0, "every allocation came back");
    alloc.empty_cache().await.unwrap();
    assert_eq!(acc.used(DeviceId(0)), 0);
    alloc.shutdown().await.unwrap();
}

#[tokio::test]
async fn cuda_without_a_gpu_is_a_typed_error_and_bad_input_too() {
    // Without a GPU (the CUDA run of scripts/gpu-check.sh has one: tests/cuda_request.rs
    // covers both cases).
    if gpualloc::cuda_backend().is_err() {
        let err = Allocator::builder()
            .backend(BackendKind::Cuda)
            .build()
            .unwrap_err();
        assert!(
            matches!(err, Error::Backend(BackendError::Unavailable(_))),
            "{err}"
        );
    }
    let err = Allocator::builder()
        .config_str("no_such_key:1")
        .backend(BackendKind::Accounting {
            devices: 1,
            capacity: 1 << 30,
        })
        .build()
        .unwrap_err();
    assert!(matches!(err, Error::Config(_)), "{err}");
    let (_acc, alloc) = accounting(1, 1 << 30);
    assert!(matches!(
        alloc.new_stream(DeviceId(3)),
        Err(Error::InvalidDevice {
            device: 3,
            count: 1
        })
    ));
    let other: Arc<dyn gpualloc::Backend> = Arc::new(AccountingBackend::new(1, 1 << 30));
    let foreign = gpualloc::Stream::new(&other, DeviceId(0)).unwrap();
    assert_eq!(
        alloc.malloc(10, &foreign).await.unwrap_err(),
        Error::ForeignStream
    );
    let s = alloc.new_stream(DeviceId(0)).unwrap();
    assert!(matches!(
        alloc.malloc(u64::MAX, &s).await,
        Err(Error::Alloc(_))
    ));
    alloc.shutdown().await.unwrap();
}

#[test]
fn building_outside_a_runtime_is_a_typed_error() {
    let err = Allocator::builder()
        .backend(BackendKind::Accounting {
            devices: 1,
            capacity: 1 << 30,
        })
        .build()
        .unwrap_err();
    assert_eq!(err, Error::NoRuntime);
}

#[test]
fn buffers_dropped_after_the_runtime_is_gone_return_their_memory() {
    let acc = Arc::new(AccountingBackend::new(1, 1 << 30));
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (alloc, bufs) = rt.block_on(async {
        let alloc = Allocator::builder()
            .backend_instance(acc.clone())
            .build()
            .unwrap();
        let s = alloc.new_stream(DeviceId(0)).unwrap();
        let mut bufs = Vec::new();
        for _ in 0..8 {
            bufs.push(alloc.malloc(MIB, &s).await.unwrap());
        }
        (alloc, bufs)
    });
    drop(rt);
    drop(alloc);
    assert!(acc.used(DeviceId(0)) > 0);
    drop(bufs);
    assert_eq!(
        acc.used(DeviceId(0)),
        0,
        "the last buffer's drop shuts the core down"
    );
}

#[test]
fn requests_from_outside_the_runtime_work_or_fail_cleanly() {
    let acc = Arc::new(AccountingBackend::new(1, 64 * MIB));
    let rt = tokio::runtime::Runtime::new().unwrap();
    let alloc = rt.block_on(async {
        Allocator::builder()
            .backend_instance(acc.clone())
            .build()
            .unwrap()
    });
    let s = alloc.new_stream(DeviceId(0)).unwrap();
    // A plain executor, no tokio context: hits, misses (on the allocator's runtime) and
    // drops all work; waiting for memory reports the missing runtime instead of panicking.
    let a = futures::executor::block_on(alloc.malloc(30 * MIB, &s)).unwrap();
    drop(a);
    let b = futures::executor::block_on(alloc.malloc(30 * MIB, &s)).unwrap();
    let err = futures::executor::block_on(alloc.malloc_with(
        50 * MIB,
        &s,
        MallocOptions::wait_for(Duration::from_millis(10)),
    ))
    .unwrap_err();
    assert_eq!(err, Error::NoRuntime);
    drop(b);
    rt.block_on(alloc.shutdown()).unwrap();
    assert_eq!(acc.used(DeviceId(0)), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_reaper_completes_cross_stream_frees_without_new_requests() {
    let acc = Arc::new(AccountingBackend::manual_events(1, 1 << 30));
    let alloc = Allocator::builder()
        .backend_instance(acc.clone())
        .reaper_interval(Duration::from_millis(1))
        .build()
        .unwrap();
    let s = alloc.new_stream(DeviceId(0)).unwrap();
    let other = alloc.new_stream(DeviceId(0)).unwrap();
    let buf = alloc.malloc(MIB, &s).await.unwrap();
    buf.record_stream(&other).unwrap();
    drop(buf);
    let active = |st: &gpualloc::DeviceStats| st.active_bytes[0].current;
    assert_eq!(
        active(&alloc.stats(DeviceId(0)).await.unwrap()),
        MIB,
        "the free waits for `other`"
    );
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(
        active(&alloc.stats(DeviceId(0)).await.unwrap()),
        MIB,
        "still pending: the event has not completed"
    );
    acc.complete_all_events();
    // No malloc follows: only the reaper can complete the free.
    let mut freed = false;
    for _ in 0..200 {
        tokio::time::sleep(Duration::from_millis(2)).await;
        if active(&alloc.stats(DeviceId(0)).await.unwrap()) == 0 {
            freed = true;
            break;
        }
    }
    assert!(freed, "the reaper returned the block");
    let actor = alloc.device_actor(DeviceId(0)).unwrap();
    for _ in 0..100 {
        if actor.describe().contains("reaper asleep") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    assert!(
        actor.describe().contains("reaper asleep"),
        "{}",
        actor.describe()
    );
    alloc.shutdown().await.unwrap();
}
