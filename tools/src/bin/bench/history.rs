//! What recording the history costs (section `history`), hit pairs (malloc + drop
//! of 4 KiB on one stream, 200,000 after warm-up) on the accounting backend:
//!
//! - `hit_pair_history_on_median_ns` / `_p99_ns`: recording into a full ring of the default
//!   size (`Allocator::record_history`), against the same allocator not recording. The thread
//!   cache records its round trips in its slots (and a long slot log asks for a collection,
//!   one gate turn per ~340 pairs), all counted here.
//! - `hit_pair_history_on_gate_median_ns`: the same with `thread_cache:False` on both sides
//!   (the ring's own cost: three entries per pair).
//!
//! - `hit_pair_history_spans_median_ns`: recording with `HistoryOptions::spans`, inside two
//!   nested spans (a subscriber with `tracing_error::ErrorLayer`), against recording without
//!   frames (default config); `hit_pair_history_backtraces_median_ns`: the same with
//!   `backtraces` (fewer pairs: each captures a backtrace).
//!
//! What history *off* costs (one relaxed load per free) is measured by comparing
//! `hit_pair_median_ns` across commits (BENCHMARKS.md).

use gpualloc::{DeviceId, HistoryOptions};

use super::{actor_pairs, build, hit_backend, push_median_p99, Figure, Path};

pub(crate) async fn history_figures(figures: &mut Vec<Figure>) {
    const N: usize = 200_000;
    for path in [Path::ThreadCache, Path::Gate] {
        let alloc = build(hit_backend(), path);
        let stream = alloc.new_stream(DeviceId(0)).expect("stream");
        let mut off = actor_pairs(&alloc, &stream, N).await;
        // The default ring (100,000 entries), full: a service that has been recording for
        // a while. (Filling a new ring touches its memory for the first time: page faults,
        // about one per hundred entries, not measured here.)
        alloc
            .record_history(HistoryOptions::default())
            .await
            .expect("record_history");
        let _fill = actor_pairs(&alloc, &stream, HistoryOptions::default().max_entries / 2).await;
        let mut on = actor_pairs(&alloc, &stream, N).await;
        alloc.stop_history().await.expect("stop_history");
        push_median_p99(
            figures,
            [
                path.name(
                    "hit_pair_history_on_median_ns",
                    "hit_pair_history_on_gate_median_ns",
                ),
                path.name(
                    "hit_pair_history_on_p99_ns",
                    "hit_pair_history_on_gate_p99_ns",
                ),
            ],
            &mut on,
            &mut off,
        );
        let _ = alloc.shutdown().await;
    }
    frames_figures(figures).await;
}

/// Recording with span frames, and with backtraces, against recording without frames.
async fn frames_figures(figures: &mut Vec<Figure>) {
    use tracing::Instrument;
    use tracing_subscriber::layer::SubscriberExt;
    let subscriber = tracing_subscriber::registry().with(tracing_error::ErrorLayer::default());
    if tracing::subscriber::set_global_default(subscriber).is_err() {
        eprintln!("bench: a global subscriber is set already; span figures skipped");
        return;
    }
    let alloc = build(hit_backend(), Path::ThreadCache);
    let stream = alloc.new_stream(DeviceId(0)).expect("stream");
    let pairs = |n: usize, alloc: gpualloc::Allocator, stream: gpualloc::Stream| async move {
        async move { actor_pairs(&alloc, &stream, n).await }
            .instrument(tracing::info_span!("request", id = 42u64, model = "llama"))
            .await
    };
    let mut medians = Vec::new();
    for (spans, backtraces, n) in [
        (false, false, 50_000),
        (true, false, 50_000),
        (false, true, 2_000),
    ] {
        alloc
            .record_history(HistoryOptions {
                spans,
                backtraces,
                ..HistoryOptions::default()
            })
            .await
            .expect("record_history");
        let _fill = pairs(
            HistoryOptions::default().max_entries / 2,
            alloc.clone(),
            stream.clone(),
        )
        .instrument(tracing::info_span!("handler"))
        .await;
        let mut on = pairs(n, alloc.clone(), stream.clone())
            .instrument(tracing::info_span!("handler"))
            .await;
        medians.push(super::percentile(&mut on, 0.5));
    }
    let _ = alloc.stop_history().await;
    for (name, value) in [
        ("hit_pair_history_spans_median_ns", medians[1]),
        ("hit_pair_history_backtraces_median_ns", medians[2]),
    ] {
        figures.push(Figure {
            name,
            value,
            unit: "ns",
            reference: medians[0],
        });
    }
    let _ = alloc.shutdown().await;
}
