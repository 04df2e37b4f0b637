//! What recording the history costs (section `history`, issue 23), hit pairs (malloc + drop
//! of 4 KiB on one stream, 200,000 after warm-up) on the accounting backend:
//!
//! - `hit_pair_history_on_median_ns` / `_p99_ns`: recording into a full ring of the default
//!   size (`Allocator::record_history`), against the same allocator not recording. The thread
//!   cache steps aside while recording, so the default path pays the gate as well as the ring.
//! - `hit_pair_history_on_gate_median_ns`: the same with `thread_cache:False` on both sides
//!   (the ring's own cost: three entries per pair).
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
}
