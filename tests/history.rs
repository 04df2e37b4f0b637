//! Recording a live allocator's history and dumping it as PyTorch's snapshot pickle, through
//! the public API: the history has exactly the events a workload caused, in order,
//! in every config (the thread cache's round trips included: its slots record them, and a
//! block freed on one thread after another revived it keeps its order);
//! the ring keeps the newest entries; the pickle reads back with segments that agree with
//! `stats()`; a bad path is a typed error.

mod common;

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use common::{build, history, revivals, sim, MIB};
use gpualloc::devices::{TraceAction, TraceEntry};
use gpualloc::{DeviceId, Error, HistoryOptions};

const D0: DeviceId = DeviceId(0);

/// The entries about blocks (not segments), as (action, addr, size).
fn block_events(trace: &[TraceEntry]) -> Vec<(TraceAction, u64, u64)> {
    trace
        .iter()
        .filter(|e| {
            matches!(
                e.action,
                TraceAction::Alloc | TraceAction::FreeRequested | TraceAction::FreeCompleted
            )
        })
        .map(|e| (e.action, e.addr, e.size))
        .collect()
}

fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_micros() as u64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_history_has_exactly_the_events_the_workload_caused() {
    for conf in [
        "",
        "thread_cache:False",
        "expandable_segments:True",
        "expandable_segments:True,thread_cache:False",
    ] {
        let alloc = build(sim(1 << 30), conf);
        let s1 = alloc.new_stream(D0).unwrap();
        let s2 = alloc.new_stream(D0).unwrap();
        // Warm the thread cache before recording: a block parked now goes back to the core
        // when the recording starts.
        let warm = alloc.malloc(MIB, &s1).await.unwrap();
        drop(warm);
        let start = now_us();
        alloc
            .record_history(HistoryOptions::default())
            .await
            .unwrap();
        let mut want = Vec::new();
        let revived_before = revivals(&alloc);
        // Round trips of one size on one thread and stream: the cache's case.
        for _ in 0..3 {
            let b = alloc.malloc(MIB, &s1).await.unwrap();
            let (p, n) = (b.ptr().0, b.len());
            want.push((TraceAction::Alloc, p, n));
            drop(b);
            want.push((TraceAction::FreeRequested, p, n));
            want.push((TraceAction::FreeCompleted, p, n));
        }
        if !conf.contains("thread_cache:False") {
            // (Two when the task stays on its worker thread, as it does unless stolen.)
            assert!(
                revivals(&alloc) > revived_before,
                "[{conf}] the cache served round trips while recording"
            );
        }
        // A large block used on another stream: its free completes once that stream's work
        // is done.
        let big = alloc.malloc(30 * MIB, &s1).await.unwrap();
        let (bp, bn) = (big.ptr().0, big.len());
        want.push((TraceAction::Alloc, bp, bn));
        big.record_stream(&s2).unwrap();
        drop(big);
        want.push((TraceAction::FreeRequested, bp, bn));
        s2.synchronize().unwrap();
        let small = alloc.malloc(512, &s2).await.unwrap();
        // The next request after the stream's work is done reaps the pending free first.
        want.push((TraceAction::FreeCompleted, bp, bn));
        want.push((TraceAction::Alloc, small.ptr().0, small.len()));
        // An out-of-memory request.
        let oom = alloc.malloc(2 << 30, &s1).await.unwrap_err();
        assert!(oom.is_oom(), "{oom}");
        let trace = history(&alloc).await;
        assert_eq!(block_events(&trace), want, "[{conf}]");
        assert_eq!(
            trace.last().unwrap().action,
            TraceAction::Oom,
            "[{conf}] the failed request is the last entry"
        );
        assert_eq!(trace.last().unwrap().size, 2 << 30);
        // Segments: what was mapped or allocated, less what went back, is what is reserved.
        let mut held = 0i64;
        for e in &trace {
            match e.action {
                TraceAction::SegmentAlloc | TraceAction::SegmentMap => held += e.size as i64,
                TraceAction::SegmentFree | TraceAction::SegmentUnmap => held -= e.size as i64,
                _ => {}
            }
        }
        let reserved = alloc.stats(D0).await.unwrap().reserved_bytes.all().current as i64;
        // The warm-up's 2 MiB segment was there before the recording began.
        assert_eq!(held + 2 * MIB as i64, reserved, "[{conf}]");
        // Times: wall clock in microseconds, in order.
        assert!(trace.windows(2).all(|w| w[0].time_us <= w[1].time_us));
        assert!(
            trace[0].time_us >= start && trace[0].time_us <= now_us(),
            "[{conf}]"
        );
        drop(small);
        alloc.stop_history().await.unwrap();
        assert!(alloc.snapshot().await.unwrap()[0].trace.is_empty());
        alloc.shutdown().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ring_keeps_the_newest_entries_and_stop_clears_it() {
    let alloc = build(sim(1 << 30), "");
    let s = alloc.new_stream(D0).unwrap();
    alloc
        .record_history(HistoryOptions {
            max_entries: 5,
            ..HistoryOptions::default()
        })
        .await
        .unwrap();
    let mut last = 0;
    for i in 0..10u64 {
        let b = alloc.malloc(MIB + i * 4096, &s).await.unwrap();
        last = b.ptr().0;
        drop(b);
    }
    let trace = history(&alloc).await;
    // 5 kept: the mark of the snapshot, and before it the newest 4.
    assert_eq!(trace.len(), 4);
    let tail: Vec<TraceAction> = trace.iter().map(|e| e.action).collect();
    assert_eq!(
        tail,
        [
            TraceAction::FreeCompleted,
            TraceAction::Alloc,
            TraceAction::FreeRequested,
            TraceAction::FreeCompleted
        ]
    );
    assert_eq!(trace[3].addr, last);
    assert_eq!(trace[3].size, MIB + 9 * 4096);
    alloc.stop_history().await.unwrap();
    // Recording off: nothing is recorded any more.
    let b = alloc.malloc(MIB, &s).await.unwrap();
    drop(b);
    assert!(alloc.snapshot().await.unwrap()[0].trace.is_empty());
    alloc.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dumped_snapshot_reads_back_and_agrees_with_stats() {
    for conf in ["", "expandable_segments:True"] {
        let alloc = build(sim(1 << 30), conf);
        let s = alloc.new_stream(D0).unwrap();
        alloc
            .record_history(HistoryOptions::default())
            .await
            .unwrap();
        let mut keep = Vec::new();
        for i in 0..20u64 {
            let b = alloc
                .malloc((i % 5) * 3 * MIB + 1000 * i + 1, &s)
                .await
                .unwrap();
            if i % 3 == 0 {
                keep.push(b);
            }
        }
        let dir = std::env::temp_dir().join(format!("gpualloc-history-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(format!("snap{}.pickle", conf.len()));
        alloc.dump_snapshot(&path).await.unwrap();
        let bytes = std::fs::read(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        let snap = gpualloc_trace::Snapshot::from_pickle(&bytes).unwrap();
        let stats = alloc.stats(D0).await.unwrap();
        let reserved: u64 = snap.segments.iter().map(|s| s.total_size).sum();
        assert_eq!(reserved, stats.reserved_bytes.all().current, "[{conf}]");
        let active: u64 = snap
            .segments
            .iter()
            .flat_map(|s| &s.blocks)
            .filter(|b| b.state == gpualloc_trace::BlockState::ActiveAllocated)
            .map(|b| b.size)
            .sum();
        assert_eq!(active, stats.allocated_bytes.all().current, "[{conf}]");
        assert_eq!(snap.device_traces.len(), 1);
        let trace = &snap.device_traces[0];
        assert_eq!(
            trace
                .iter()
                .filter(|e| e.action == gpualloc_trace::Action::Alloc)
                .count(),
            20
        );
        assert!(trace.iter().all(|e| e.time_us.is_some()));
        let settings = snap.allocator_settings.as_ref().unwrap();
        assert!(settings.contains_key("expandable_segments"));
        // The pickle itself, written twice from the same state, is the same bytes (the only
        // difference is the mark of the second snapshot in the history).
        let again =
            gpualloc_trace::Snapshot::from_pickle(&alloc.snapshot_pickle().await.unwrap()).unwrap();
        assert_eq!(again.segments, snap.segments);
        assert_eq!(again.device_traces[0].len(), trace.len() + 1);
        // Read back, the pickle is exactly the typed snapshot it was written from.
        let snaps = alloc.snapshot().await.unwrap();
        let typed = gpualloc::devices::snapshot_pickle::to_snapshot(&snaps, alloc.config());
        let written =
            gpualloc::devices::snapshot_pickle::to_pickle(&snaps, alloc.config()).unwrap();
        assert_eq!(
            gpualloc_trace::Snapshot::from_pickle(&written).unwrap(),
            typed,
            "[{conf}]"
        );
        // A path that cannot be written is a typed error naming it.
        let bad = dir.join("no/such/folder/x.pickle");
        match alloc.dump_snapshot(&bad).await {
            Err(Error::Write { path, kind, .. }) => {
                assert_eq!(path, bad);
                assert_eq!(kind, std::io::ErrorKind::NotFound);
            }
            other => panic!("{other:?}"),
        }
        drop(keep);
        let _ = std::fs::remove_dir(&dir);
        alloc.shutdown().await.unwrap();
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}
