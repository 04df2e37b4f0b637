//! The allocator's history: a bounded ring of trace entries in the shape of PyTorch's
//! `device_traces` (`torch.cuda.memory._record_memory_history`).
//!
//! Times come from the caller (`DeviceCore::set_time_us`), never from a clock here, so a
//! replay of a recorded trace produces the same history every run.

use std::collections::VecDeque;

/// What happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TraceAction {
    /// A block was handed to a user (`size` = requested bytes).
    Alloc,
    /// The user freed a block; it may still wait for stream events.
    FreeRequested,
    /// The block went back to its pool.
    FreeCompleted,
    /// A segment was allocated from the backend.
    SegmentAlloc,
    /// A segment was returned to the backend.
    SegmentFree,
    /// Physical memory was mapped into an expandable segment.
    SegmentMap,
    /// Physical memory was unmapped from an expandable segment.
    SegmentUnmap,
    /// An allocation failed (`addr` = bytes free on the device).
    Oom,
    /// A snapshot was taken.
    Snapshot,
}

impl TraceAction {
    /// PyTorch's name for the action (`"alloc"`, `"free_requested"`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            TraceAction::Alloc => "alloc",
            TraceAction::FreeRequested => "free_requested",
            TraceAction::FreeCompleted => "free_completed",
            TraceAction::SegmentAlloc => "segment_alloc",
            TraceAction::SegmentFree => "segment_free",
            TraceAction::SegmentMap => "segment_map",
            TraceAction::SegmentUnmap => "segment_unmap",
            TraceAction::Oom => "oom",
            TraceAction::Snapshot => "snapshot",
        }
    }
}

/// One frame of the context an allocation was made in: PyTorch's `frames` entries
/// (`name`, `filename`, `line`). The facade fills them from `tracing` spans or a backtrace.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Frame {
    /// The function, or the span with its fields (`handle_request{model="llama"}`).
    pub name: String,
    /// Source file.
    pub filename: String,
    /// Line in it.
    pub line: u32,
}

/// The frames of one allocation, innermost first, shared by its trace entry and its block.
pub type Frames = std::sync::Arc<[Frame]>;

/// One entry of the history.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceEntry {
    /// What happened.
    pub action: TraceAction,
    /// Address of the block or segment (free device bytes for `Oom`).
    pub addr: u64,
    /// Bytes concerned.
    pub size: u64,
    /// Raw handle of the stream.
    pub stream: u64,
    /// Caller-supplied time in microseconds.
    pub time_us: u64,
    /// Where the allocation was made (`alloc` entries, when the owner attached them:
    /// [`crate::DeviceCore::attach_frames`]).
    pub frames: Option<Frames>,
}

/// Bounded history; the oldest entries fall off.
#[derive(Debug, Clone)]
pub struct TraceRing {
    entries: VecDeque<TraceEntry>,
    capacity: usize,
}

impl TraceRing {
    /// A ring keeping at most `capacity` entries (at least 1).
    pub fn new(capacity: usize) -> Self {
        let capacity = capacity.max(1);
        TraceRing {
            entries: VecDeque::with_capacity(capacity.min(1 << 16)),
            capacity,
        }
    }

    /// Appends an entry, dropping the oldest when full.
    pub fn push(&mut self, entry: TraceEntry) {
        if self.entries.len() == self.capacity {
            self.entries.pop_front();
        }
        self.entries.push_back(entry);
    }

    /// Entries, oldest first.
    pub fn iter(&self) -> impl Iterator<Item = &TraceEntry> {
        self.entries.iter()
    }

    /// The newest of the last `within` entries that matches `pred`.
    pub fn newest_mut(
        &mut self,
        within: usize,
        pred: impl Fn(&TraceEntry) -> bool,
    ) -> Option<&mut TraceEntry> {
        self.entries.iter_mut().rev().take(within).find(|e| pred(e))
    }

    /// Number of entries held.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_keeps_the_newest() {
        let mut r = TraceRing::new(2);
        for i in 0..5 {
            r.push(TraceEntry {
                frames: None,
                action: TraceAction::Alloc,
                addr: i,
                size: 1,
                stream: 0,
                time_us: i,
            });
        }
        let addrs: Vec<u64> = r.iter().map(|e| e.addr).collect();
        assert_eq!(addrs, vec![3, 4]);
        assert_eq!(TraceAction::FreeCompleted.as_str(), "free_completed");
    }
}
