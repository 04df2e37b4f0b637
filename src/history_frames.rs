//! The frames a recorded allocation carries: the `tracing` span stack current at
//! the `malloc`, and optionally a backtrace. PyTorch records Python and C++ stacks; a Rust
//! service's useful context is its spans (which request, which model, which handler), and
//! they survive `.await` points, where a backtrace shows only the executor's frames.
//!
//! - Spans come from `tracing-error`'s `SpanTrace`, which needs its layer in the user's
//!   subscriber: `tracing_subscriber::registry().with(tracing_error::ErrorLayer::default())`
//!   (plus their own layers). Without it an allocation carries no span frames.
//! - A span frame's name is the span's name with its fields (`request{id=42 model="llama"}`),
//!   its file and line where the span was declared. They are walked and formatted once per
//!   innermost span and thread, and reused while that span is current (`span_frames`).
//! - Backtraces (`HistoryOptions::backtraces`) are `std::backtrace::Backtrace::force_capture`
//!   (symbolized when the snapshot is taken: costly, for debugging sessions); their frames
//!   come first (innermost first, as PyTorch's), then the spans from the innermost out.
//! - A block the thread cache hands back gets its frames captured on the calling thread,
//!   into its `alloc` entry in the thread's slot (`history.rs`): no gate turn.
//! - Other frames are attached after the `malloc` succeeded, in one more turn of the device's
//!   gate; only while recording with frames on (otherwise a `malloc` pays one relaxed load). A
//!   `malloc` future dropped during that turn frees its buffer; the attach then finds the
//!   address no longer live and does nothing (or, if another request got the same address
//!   in between, gives it these frames: a wrong label, never a wrong book).

use std::cell::RefCell;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use tracing::span::Id;
use tracing::Metadata;

use gpualloc_devices::{Frame, Frames};

use crate::actor::{DeviceActor, Recording};
use crate::history::{now_us, HISTORY_BACKTRACES, HISTORY_SPANS};
use crate::DeviceBuffer;

/// What a park (`alloc: false`) or revive of the thread cache records at `level` (not off):
/// the time, and for a revive recorded with frames the caller's frames, captured on its
/// own thread (no gate turn, unlike a `malloc` through the core).
pub(crate) fn recording(level: u8, alloc: bool) -> Recording {
    Recording {
        time_us: now_us(),
        frames: (alloc && level >= HISTORY_SPANS).then(|| capture(level)),
    }
}

/// The frames of the current context at `level` (innermost first).
fn capture(level: u8) -> Frames {
    if level < HISTORY_BACKTRACES {
        return span_frames();
    }
    let mut frames = Vec::new();
    backtrace_frames(&std::backtrace::Backtrace::force_capture(), &mut frames);
    frames.extend(span_frames().iter().cloned());
    frames.into()
}

thread_local! {
    /// The span frames this thread captured last, and the innermost span they were captured
    /// in (its id and callsite).
    static LAST_SPANS: RefCell<Option<(Id, &'static Metadata<'static>, Frames)>> =
        const { RefCell::new(None) };
}

/// The span stack current on this thread as frames (innermost first). Mallocs in one span
/// share its frames: they are walked and formatted once per innermost span and thread, and
/// handed out again while that span is the current one (its id, with the registry's
/// generation bits, and its callsite tell it from a later span reusing the slot). Nothing is
/// lost by reusing them: `ErrorLayer` formats a span's fields once, when the span is made
/// (fields `Span::record`ed later do not show). Costs: `bench history` (BENCHMARKS.md).
fn span_frames() -> Frames {
    let current = tracing::dispatcher::get_default(|d| d.current_span());
    let (Some(id), Some(meta)) = (current.id(), current.metadata()) else {
        return walk_spans();
    };
    LAST_SPANS.with(|last| {
        // Nothing here calls back into a capture; a failed borrow just skips the cache.
        let Ok(mut last) = last.try_borrow_mut() else {
            return walk_spans();
        };
        if let Some((last_id, last_meta, frames)) = last.as_ref() {
            if last_id == id && std::ptr::eq(*last_meta, meta) {
                return frames.clone();
            }
        }
        let frames = walk_spans();
        *last = Some((id.clone(), meta, frames.clone()));
        frames
    })
}

/// Walks the span stack (`tracing-error`'s `SpanTrace`) into frames.
fn walk_spans() -> Frames {
    let mut frames = Vec::new();
    tracing_error::SpanTrace::capture().with_spans(|meta, fields| {
        let name = if fields.is_empty() {
            meta.name().to_string()
        } else {
            format!("{}{{{fields}}}", meta.name())
        };
        frames.push(Frame {
            name,
            filename: meta.file().unwrap_or("<unknown>").to_string(),
            line: meta.line().unwrap_or(0),
        });
        true
    });
    frames.into()
}

/// Parses `Backtrace`'s display ("  N: function" lines, each maybe followed by
/// "at file:line:column") into frames.
fn backtrace_frames(bt: &std::backtrace::Backtrace, out: &mut Vec<Frame>) {
    let text = bt.to_string();
    for line in text.lines() {
        let line = line.trim();
        if let Some((n, name)) = line.split_once(": ") {
            if !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()) {
                out.push(Frame {
                    name: name.to_string(),
                    filename: "??".to_string(),
                    line: 0,
                });
                continue;
            }
        }
        if let (Some(at), Some(last)) = (line.strip_prefix("at "), out.last_mut()) {
            // file:line:column
            let mut parts = at.rsplitn(3, ':');
            let (_col, line_no, file) = (parts.next(), parts.next(), parts.next());
            if let (Some(file), Some(line_no)) = (file, line_no.and_then(|l| l.parse().ok())) {
                last.filename = file.to_string();
                last.line = line_no;
            }
        }
    }
}

impl DeviceActor {
    /// True when mallocs must capture frames now (one relaxed load).
    #[inline]
    pub(crate) fn wants_frames(&self) -> bool {
        self.signals.history.load(Ordering::Relaxed) >= HISTORY_SPANS
    }

    /// Captures the caller's frames and attaches them to `buffer`'s allocation.
    pub(crate) async fn attach_frames(self: &Arc<Self>, buffer: &DeviceBuffer) {
        let level = self.signals.history.load(Ordering::Relaxed);
        if level < HISTORY_SPANS || buffer.ptr().0 == 0 {
            return;
        }
        let frames = capture(level);
        let addr = buffer.ptr().0;
        if let Err(e) = self
            .call(move |st| st.core.attach_frames(addr, frames))
            .await
        {
            tracing::debug!(error = %e, "frames not attached");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_backtrace_parses_into_named_frames_with_files() {
        let bt = std::backtrace::Backtrace::force_capture();
        let mut frames = Vec::new();
        backtrace_frames(&bt, &mut frames);
        assert!(!frames.is_empty());
        assert!(
            frames.iter().any(|f| f.name.contains("a_backtrace_parses")
                && f.filename.ends_with("history_frames.rs")
                && f.line > 0),
            "{frames:?}"
        );
    }
}
