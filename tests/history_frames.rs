//! Frames of recorded allocations: with `HistoryOptions::spans` each allocation
//! carries the `tracing` span stack current at its `malloc` (names with fields, innermost
//! first, across `.await` points), in its `alloc` entry, in its block while it lives and in the
//! dumped pickle; with `backtraces` a backtrace comes first; without the options, none.
//! (A current-thread runtime: the subscriber set for this thread is the one the mallocs see.)

mod common;

use common::{recording, wait_in_flight, MIB};
use gpualloc::devices::{TraceAction, TraceEntry};
use gpualloc::{DeviceId, HistoryOptions};
use tracing::Instrument;
use tracing_subscriber::layer::SubscriberExt;

const D0: DeviceId = DeviceId(0);

/// Recording with span frames.
fn spans() -> HistoryOptions {
    HistoryOptions {
        spans: true,
        ..HistoryOptions::default()
    }
}

/// A subscriber whose span stacks `SpanTrace` can read (what a user adds).
fn span_subscriber() -> impl tracing::Subscriber + Send + Sync {
    tracing_subscriber::registry().with(tracing_error::ErrorLayer::default())
}

/// The block at `addr` in a device's snapshot.
fn block_at(snap: &gpualloc::devices::DeviceSnapshot, addr: u64) -> &gpualloc::devices::BlockInfo {
    snap.segments
        .iter()
        .flat_map(|s| &s.blocks)
        .find(|b| b.address == addr)
        .unwrap()
}

/// The `alloc` entries of a history.
fn allocs(trace: &[TraceEntry]) -> Vec<&TraceEntry> {
    trace
        .iter()
        .filter(|e| e.action == TraceAction::Alloc)
        .collect()
}

fn names(frames: Option<&[gpualloc::devices::Frame]>) -> Vec<String> {
    frames
        .unwrap_or_default()
        .iter()
        .map(|f| f.name.clone())
        .collect()
}

#[tokio::test(flavor = "current_thread")]
async fn allocations_carry_the_span_stack_of_their_malloc() {
    let _guard = tracing::subscriber::set_default(span_subscriber());
    for conf in ["", "thread_cache:False", "expandable_segments:True"] {
        let (alloc, s) = recording(conf, spans()).await;
        // The request span is made inside the handler's: its parent.
        let (kept, freed) = async {
            async {
                tokio::task::yield_now().await;
                let kept = alloc.malloc(3 * MIB, &s).await.unwrap();
                let freed = alloc.malloc(4096, &s).await.unwrap();
                (kept, freed.ptr().0)
            }
            .instrument(tracing::info_span!("request", id = 42, model = "llama"))
            .await
        }
        .instrument(tracing::info_span!("handler"))
        .await;
        let outside = alloc.malloc(MIB, &s).await.unwrap();
        let snap = alloc.snapshot().await.unwrap().remove(0);
        let allocs = allocs(&snap.trace);
        assert_eq!(allocs.len(), 3, "[{conf}]");
        let want = vec![
            "request{id=42 model=\"llama\"}".to_string(),
            "handler".to_string(),
        ];
        assert_eq!(names(allocs[0].frames.as_deref()), want, "[{conf}]");
        assert_eq!(allocs[1].addr, freed);
        assert_eq!(names(allocs[1].frames.as_deref()), want, "[{conf}]");
        assert_eq!(names(allocs[2].frames.as_deref()), Vec::<String>::new());
        let frame = &allocs[0].frames.as_ref().unwrap()[0];
        assert!(
            frame.filename.ends_with("history_frames.rs") && frame.line > 0,
            "{frame:?}"
        );
        // The live block carries them too; in the pickle as PyTorch's frames.
        let block = block_at(&snap, kept.ptr().0);
        assert_eq!(names(block.frames.as_deref()), want, "[{conf}]");
        let pickle =
            gpualloc::trace::Snapshot::from_pickle(&alloc.snapshot_pickle().await.unwrap())
                .unwrap();
        let alloc0 = pickle.device_traces[0]
            .iter()
            .find(|e| e.action == gpualloc::trace::Action::Alloc)
            .unwrap();
        let pickled: Vec<&str> = alloc0.frames.iter().map(|f| &*f.name).collect();
        assert_eq!(pickled, want, "[{conf}]");
        drop((kept, outside));
        alloc.shutdown().await.unwrap();
    }
}

#[tokio::test(flavor = "current_thread")]
async fn backtraces_come_first_and_no_options_no_frames() {
    let _guard = tracing::subscriber::set_default(span_subscriber());
    let options = HistoryOptions {
        backtraces: true,
        ..HistoryOptions::default()
    };
    let (alloc, s) = recording("", options).await;
    let b = async { alloc.malloc(MIB, &s).await.unwrap() }
        .instrument(tracing::info_span!("job"))
        .await;
    let snap = alloc.snapshot().await.unwrap().remove(0);
    let frames = snap
        .trace
        .iter()
        .find(|e| e.action == TraceAction::Alloc)
        .and_then(|e| e.frames.clone())
        .unwrap();
    assert_eq!(
        frames.last().unwrap().name,
        "job",
        "the span after the backtrace"
    );
    assert!(
        frames
            .iter()
            .any(|f| f.name.contains("backtraces_come_first") && f.line > 0),
        "{frames:?}"
    );
    drop(b);
    // Recording without frames: none captured.
    alloc
        .record_history(HistoryOptions::default())
        .await
        .unwrap();
    let b = async { alloc.malloc(MIB, &s).await.unwrap() }
        .instrument(tracing::info_span!("job"))
        .await;
    let snap = alloc.snapshot().await.unwrap().remove(0);
    assert!(snap.trace.iter().all(|e| e.frames.is_none()));
    drop(b);
    alloc.shutdown().await.unwrap();
}

/// Malloc futures dropped at every point (before, during and after the frames are attached)
/// while recording with frames: nothing leaks, every block goes back, the history still
/// dumps, and every entry that has frames has this test's span.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malloc_futures_dropped_while_frames_are_attached_leave_nothing_behind() {
    let _guard = tracing::subscriber::set_global_default(span_subscriber());
    for conf in ["", "expandable_segments:True"] {
        let (alloc, s) = recording(conf, spans()).await;
        for round in 0..200u64 {
            let (alloc2, s2) = (alloc.clone(), s.clone());
            let task = tokio::spawn(
                async move {
                    let b = alloc2.malloc((round % 9) * MIB + 4096, &s2).await.unwrap();
                    tokio::task::yield_now().await;
                    drop(b);
                }
                .instrument(tracing::info_span!("dropped", round)),
            );
            if round % 3 != 0 {
                // Let it start, then abort it wherever it is.
                for _ in 0..(round % 4) {
                    tokio::task::yield_now().await;
                }
                task.abort();
            }
            let _ = task.await;
        }
        // An aborted request's miss may still be running off the gate: its buffer returns
        // when it lands.
        let actor = alloc.device_actor(D0).unwrap();
        assert_eq!(wait_in_flight(actor, 5000, |m| m == 0).await, 0, "[{conf}]");
        let st = alloc.stats(D0).await.unwrap();
        assert_eq!(st.allocated_bytes.all().current, 0, "[{conf}]");
        let snap = gpualloc::trace::Snapshot::from_pickle(&alloc.snapshot_pickle().await.unwrap())
            .unwrap();
        let trace = &snap.device_traces[0];
        assert!(trace.iter().any(|e| !e.frames.is_empty()), "[{conf}]");
        assert!(trace
            .iter()
            .flat_map(|e| e.frames.iter())
            .all(|f| f.name.starts_with("dropped{round=")));
        alloc.shutdown().await.unwrap();
    }
}

/// A block the thread cache hands back gets the frames of the `malloc` that revived it, not
/// those of its first `malloc`, in its entry and on its block; no gate turn attaches them.
#[tokio::test(flavor = "current_thread")]
async fn a_revived_block_carries_the_frames_of_the_malloc_that_revived_it() {
    let _guard = tracing::subscriber::set_default(span_subscriber());
    let (alloc, s) = recording("", spans()).await;
    let revived_before = alloc.device_actor(D0).unwrap().thread_cache_revivals();
    let first = alloc
        .malloc(MIB, &s)
        .instrument(tracing::info_span!("load", model = "a"))
        .await
        .unwrap();
    let ptr = first.ptr().0;
    drop(first);
    let again = alloc
        .malloc(MIB, &s)
        .instrument(tracing::info_span!("request", id = 7))
        .await
        .unwrap();
    assert_eq!(again.ptr().0, ptr);
    assert_eq!(
        alloc.device_actor(D0).unwrap().thread_cache_revivals(),
        revived_before + 1,
        "revived by the thread cache"
    );
    let snap = alloc.snapshot().await.unwrap().remove(0);
    let allocs = allocs(&snap.trace);
    assert_eq!(allocs.len(), 2);
    assert_eq!(
        names(allocs[0].frames.as_deref()),
        vec!["load{model=\"a\"}"]
    );
    assert_eq!(names(allocs[1].frames.as_deref()), vec!["request{id=7}"]);
    let block = block_at(&snap, ptr);
    assert_eq!(names(block.frames.as_deref()), vec!["request{id=7}"]);
    drop(again);
    let snap = alloc.snapshot().await.unwrap().remove(0);
    let block = block_at(&snap, ptr);
    assert!(block.frames.is_none(), "freed (parked): no frames");
    alloc.shutdown().await.unwrap();
}

/// Span frames are walked once per innermost span and thread and reused while it is
/// current: spans of one callsite made one after another (their registry slot reused) each
/// give their own fields, and a parent's frames come back after its child's. (A field
/// recorded into a span after it was made shows nowhere: `ErrorLayer` formats a span's
/// fields when it is made, as it did before frames were reused.)
#[tokio::test(flavor = "current_thread")]
async fn each_span_gives_its_own_frames_when_frames_are_reused() {
    let _guard = tracing::subscriber::set_default(span_subscriber());
    for conf in ["", "thread_cache:False"] {
        let (alloc, s) = recording(conf, spans()).await;
        for id in 0..40u64 {
            let b = alloc
                .malloc(MIB, &s)
                .instrument(tracing::info_span!("request", id))
                .await
                .unwrap();
            drop(b);
        }
        let outer = tracing::info_span!("outer", status = tracing::field::Empty);
        let held = async {
            let a = alloc.malloc(2 * MIB, &s).await.unwrap();
            let b = alloc
                .malloc(2 * MIB, &s)
                .instrument(tracing::info_span!("inner"))
                .await
                .unwrap();
            let c = alloc.malloc(2 * MIB, &s).await.unwrap();
            tracing::Span::current().record("status", 200);
            let d = alloc
                .malloc(2 * MIB, &s)
                .instrument(tracing::info_span!("after"))
                .await
                .unwrap();
            vec![a, b, c, d]
        }
        .instrument(outer)
        .await;
        let history = common::history(&alloc).await;
        let allocs: Vec<Vec<String>> = allocs(&history)
            .iter()
            .map(|e| names(e.frames.as_deref()))
            .collect();
        assert_eq!(allocs.len(), 44, "[{conf}]");
        for (id, frames) in allocs[..40].iter().enumerate() {
            assert_eq!(frames, &vec![format!("request{{id={id}}}")], "[{conf}]");
        }
        assert_eq!(allocs[40], vec!["outer"], "[{conf}]");
        assert_eq!(allocs[41], vec!["inner", "outer"], "[{conf}]");
        assert_eq!(allocs[42], vec!["outer"], "[{conf}]");
        assert_eq!(allocs[43], vec!["after", "outer"], "[{conf}]");
        drop(held);
        alloc.shutdown().await.unwrap();
    }
}
