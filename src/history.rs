//! What a live service did with its memory: record the allocator's history, dump
//! a snapshot PyTorch's memory viewer opens, get called when a `malloc` runs out of memory.
//!
//! The three steps PyTorch's users know (`_record_memory_history`, `_dump_snapshot`, drag the
//! file into MemoryViz):
//!
//! ```no_run
//! # async fn demo(alloc: gpualloc::Allocator) -> Result<(), gpualloc::Error> {
//! use gpualloc::HistoryOptions;
//! alloc.record_history(HistoryOptions { max_entries: 100_000, ..Default::default() }).await?;
//! // ... the service runs ...
//! alloc.dump_snapshot("memory.pickle").await?; // open it in PyTorch's memory viewer
//! alloc.stop_history().await?;
//! # Ok(()) }
//! ```
//!
//! - The history is a ring per device of at most `max_entries` entries (PyTorch's
//!   `max_entries`; the oldest fall off): `alloc`, `free_requested`, `free_completed`,
//!   `segment_alloc` / `segment_free`, `segment_map` / `segment_unmap`, `oom`, `snapshot`,
//!   each with `time_us` (wall clock, microseconds since the Unix epoch) and the stream.
//! - **The thread cache keeps serving while recording, and records what it does**: a park
//!   (a dropped buffer kept for its thread) writes the `free_requested` entry, a revive the
//!   `free_completed` and the `alloc` entry (with its frames, captured on the calling
//!   thread), into the thread's slot, each with its place from the core's history counter
//!   (`gpualloc_devices::DeviceCore::trace_sequence`, one `fetch_add`). Whoever next takes the
//!   device's gate hands them to the core (`record_beside`), and a snapshot gives every entry
//!   in the order it happened, so a buffer revived on one thread and dropped on another keeps
//!   its order. A parked block that goes back to the core instead has its `free_completed`
//!   recorded by the core as it frees it (`DeviceCore::free_parked`): like PyTorch's for a
//!   free that waits on stream events, the entry says when the block became free for other
//!   requests, so a request the core served while the block was parked did not see it in
//!   the history either, and a warm replay makes the same choice. A slot whose
//!   log passes 1,024 entries asks for a collection (a thread whose every request is a round
//!   trip never takes the gate), which also returns its parked block to the core: one round
//!   trip in about 340 then goes through the core. Starting a recording returns the blocks
//!   parked so far to the core (their frees happened before it), and a block parked
//!   unrecorded as the recording started is returned by the thread that parked it. When not
//!   recording, a park and a revive pay one relaxed load each.
//! - Frames: with [`HistoryOptions::spans`] each allocation carries the `tracing` span stack
//!   current at its `malloc` (and with [`HistoryOptions::backtraces`] a backtrace), in its
//!   `alloc` entry and in its block while it lives (`history_frames.rs`).
//! - [`Allocator::stop_history`] stops and clears the rings.
//! - [`Allocator::snapshot_pickle`] writes segments, blocks, `device_traces` and
//!   `allocator_settings` as PyTorch's `_dump_snapshot` does, with only the pickle opcodes
//!   MemoryViz.js reads (`gpualloc_devices::snapshot_pickle`).

use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::OnceLock;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use crate::actor::{DeviceState, Signals};
use crate::{Allocator, Error};

/// How [`Allocator::record_history`] records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HistoryOptions {
    /// Entries kept per device; the oldest fall off past it (at least 1).
    pub max_entries: usize,
    /// Give each allocation the `tracing` span stack current at its `malloc` as its frames
    /// (needs `tracing_error::ErrorLayer` in the subscriber: see `history_frames.rs`).
    pub spans: bool,
    /// Also a backtrace (implies `spans`; slow: for debugging sessions).
    pub backtraces: bool,
}

impl Default for HistoryOptions {
    /// 100,000 entries per device (PyTorch's own default keeps every entry; a service runs
    /// for days, so ours is bounded: about 4 MB per device), no frames.
    fn default() -> Self {
        HistoryOptions {
            max_entries: 100_000,
            spans: false,
            backtraces: false,
        }
    }
}

/// [`Signals::history`] levels: not recording, recording, recording with span frames, and
/// with a backtrace too (each level includes the ones below it).
pub(crate) const HISTORY_OFF: u8 = 0;
pub(crate) const HISTORY_PLAIN: u8 = 1;
pub(crate) const HISTORY_SPANS: u8 = 2;
pub(crate) const HISTORY_BACKTRACES: u8 = 3;

impl HistoryOptions {
    /// The [`Signals::history`] level these options record at.
    fn level(&self) -> u8 {
        if self.backtraces {
            HISTORY_BACKTRACES
        } else if self.spans {
            HISTORY_SPANS
        } else {
            HISTORY_PLAIN
        }
    }
}

/// Microseconds since the Unix epoch, from a monotonic clock started at the first call (one
/// clock for the whole process: the core's entries and the thread cache's share it).
pub(crate) fn now_us() -> u64 {
    static START: OnceLock<(Instant, u64)> = OnceLock::new();
    let (start, base) = START.get_or_init(|| {
        let base = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_micros() as u64);
        (Instant::now(), base)
    });
    base + start.elapsed().as_micros() as u64
}

impl Allocator {
    /// Starts recording every device's history (see the module docs); a recording already
    /// running starts over with the new options.
    pub async fn record_history(&self, options: HistoryOptions) -> Result<(), Error> {
        let level = options.level();
        let max_entries = options.max_entries.max(1);
        self.on_every_device(move |st, signals| {
            // Set before the sweep: a park racing it sees the level after its park (the
            // slot's mutex orders the two) and frees through the core.
            signals.history.store(level, Ordering::Relaxed);
            st.sweep_thread_cache();
            st.core.set_trace_clock(Some(Box::new(now_us)));
            st.core.record_history(Some(max_entries));
        })
        .await
    }

    /// Stops recording and clears every device's history; the thread cache parks again.
    pub async fn stop_history(&self) -> Result<(), Error> {
        self.on_every_device(|st, signals| {
            st.core.record_history(None);
            st.core.set_trace_clock(None);
            signals.history.store(HISTORY_OFF, Ordering::Relaxed);
        })
        .await
    }

    /// Runs `f` on every device's state, under its gate, one device after the other.
    async fn on_every_device(
        &self,
        f: impl Fn(&mut DeviceState, &Signals) + Clone + Send + 'static,
    ) -> Result<(), Error> {
        self.check()?;
        for d in 0..self.device_count() {
            let actor = self.device_actor(gpualloc_runtime::DeviceId(d))?;
            let (signals, f) = (actor.signals.clone(), f.clone());
            actor.call(move |st| f(st, &signals)).await?;
        }
        Ok(())
    }

    /// Every device's segments, blocks and history as PyTorch's `_dump_snapshot` pickle,
    /// which PyTorch's memory viewer opens.
    pub async fn snapshot_pickle(&self) -> Result<Vec<u8>, Error> {
        let devices = self.snapshot().await?;
        gpualloc_devices::snapshot_pickle::to_pickle(&devices, self.config())
            .map_err(|e| Error::Internal(format!("writing the snapshot pickle: {e}")))
    }

    /// [`Allocator::snapshot_pickle`] written to `path` (off the async runtime).
    pub async fn dump_snapshot(&self, path: impl AsRef<Path>) -> Result<(), Error> {
        let bytes = self.snapshot_pickle().await?;
        let path = path.as_ref().to_path_buf();
        tokio::task::spawn_blocking(move || {
            std::fs::write(&path, bytes).map_err(|e| Error::Write {
                path,
                kind: e.kind(),
                message: e.to_string(),
            })
        })
        .await
        .map_err(|e| Error::Internal(format!("writing the snapshot: {e}")))?
    }
}
