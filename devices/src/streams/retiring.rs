//! The streams whose users dropped them, until their segments are orphaned (`orphans.rs`):
//! each with the event recorded on it when it was retired, held until its work is done (a
//! leaf: the core holds it, `orphans.rs` drives it).

use gpualloc_runtime::{EventHandle, StreamHandle};

/// See the module docs.
#[derive(Debug, Default)]
pub(crate) struct RetiringStreams {
    /// Each retired stream with its event (None: its work is done, or it was idle).
    list: Vec<(StreamHandle, Option<EventHandle>)>,
}

impl RetiringStreams {
    /// True when `stream` is retiring already.
    pub(crate) fn contains(&self, stream: StreamHandle) -> bool {
        self.list.iter().any(|(s, _)| *s == stream)
    }

    /// `stream` retires; `event` was recorded on it (None when it was idle).
    pub(crate) fn add(&mut self, stream: StreamHandle, event: Option<EventHandle>) {
        self.list.push((stream, event));
    }

    /// The retiring streams.
    pub(crate) fn streams(&self) -> impl Iterator<Item = StreamHandle> + '_ {
        self.list.iter().map(|(s, _)| *s)
    }

    /// How many streams are retiring.
    pub(crate) fn len(&self) -> usize {
        self.list.len()
    }

    /// The `i`th retiring stream and its event.
    pub(crate) fn get(&self, i: usize) -> (StreamHandle, Option<EventHandle>) {
        self.list[i]
    }

    /// The `i`th stream's work is done: its event, for the spare pool.
    pub(crate) fn take_event(&mut self, i: usize) -> Option<EventHandle> {
        self.list[i].1.take()
    }

    /// The `i`th stream names no segment any more: it leaves (the last one takes its place).
    pub(crate) fn remove(&mut self, i: usize) {
        self.list.swap_remove(i);
    }

    /// Every stream leaves (shutdown): the events still held.
    pub(crate) fn drain_events(&mut self) -> Vec<EventHandle> {
        self.list.drain(..).filter_map(|(_, e)| e).collect()
    }
}
