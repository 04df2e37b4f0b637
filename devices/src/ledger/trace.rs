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
    /// The private pool ([`crate::MemPoolId`]) of the block or segment of an `alloc` or
    /// segment entry; 0 for the device's default pools and for other actions. (PyTorch's
    /// entries have no pool; a replay needs it to put a pool's requests in that pool.)
    pub pool: u64,
    /// An `alloc` served by a block the policy passes over for a segment's tail (best fit
    /// with any remainder, `placement.rs`), because the segment could not grow then: the
    /// device or a cap was full, or the pages it needed were being mapped for another
    /// request. The history shows the request after those pages landed; a replay serves it
    /// the same way. (gpualloc's own: PyTorch has no such rule.)
    pub passed_over: bool,
    /// An `alloc` served by a loan: a free block of another stream, lent to the entry's
    /// stream (`streams/loans.rs`). The live request's lookup may have come before frees
    /// the history shows ahead of it (its own block's, pending then); a replay serves it by
    /// the same loan. (gpualloc's own: PyTorch has no loans.)
    pub borrowed: bool,
    /// An `alloc` of a small request served by a free block of the large pool (the spill,
    /// `malloc/spill.rs`). What decided it (the lifetimes the allocator learned before
    /// recording began) is not in the history; a replay spills where this mark is, into the
    /// block the entry names, and nowhere else. (gpualloc's own: PyTorch keeps the pools
    /// apart.)
    pub spilled: bool,
    /// A `segment_map` whose pages are not all grouped into physical handles of up to
    /// `large_segment_size`: its first `n` pages are, and the pages after them are handles
    /// as `single_pages` says (`map_ahead.rs`: a growth's handles end where its request
    /// ends). `None`:
    /// every page grouped, as PyTorch's maps (one page each there) and every other entry.
    /// A replay maps the pages as they were, so it releases the same ones later.
    pub grouped_pages: Option<u64>,
    /// With `grouped_pages`: how many pages after the grouped ones are a handle each; the
    /// pages after those share handles of up to `large_segment_size` again (`map_ahead.rs`:
    /// the pages ahead). `None`: every page after the grouped ones is a handle of its own
    /// (histories recorded before the pages ahead shared handles).
    pub single_pages: Option<u64>,
}

/// Bounded history; the oldest entries fall off.
///
/// Each entry comes with its place in the order things happened (`seq`, from
/// [`crate::DeviceCore::trace_sequence`]). Entries recorded beside the core (the facade's
/// thread cache) arrive later than entries the core recorded after them; the ring keeps them
/// in arrival order (what falls off first) and [`TraceRing::in_order`] gives them in the order
/// they happened.
#[derive(Debug, Clone)]
pub struct TraceRing {
    entries: VecDeque<(u64, TraceEntry)>,
    capacity: usize,
    /// Whether entries were recorded beside the core ([`TraceRing::push_beside`]).
    beside: bool,
}

impl TraceRing {
    /// A ring keeping at most `capacity` entries (at least 1).
    pub fn new(capacity: usize) -> Self {
        let capacity = capacity.max(1);
        TraceRing {
            entries: VecDeque::with_capacity(capacity.min(1 << 16)),
            capacity,
            beside: false,
        }
    }

    /// Appends an entry that happened `seq`-th, dropping the one that arrived first when full.
    pub fn push(&mut self, seq: u64, entry: TraceEntry) {
        if self.entries.len() == self.capacity {
            self.entries.pop_front();
        }
        self.entries.push_back((seq, entry));
    }

    /// [`TraceRing::push`] for an entry recorded beside the core, stamped by another thread.
    pub fn push_beside(&mut self, seq: u64, entry: TraceEntry) {
        self.beside = true;
        self.push(seq, entry);
    }

    /// Entries in the order they arrived.
    pub fn iter(&self) -> impl Iterator<Item = &TraceEntry> {
        self.entries.iter().map(|(_, e)| e)
    }

    /// Entries in the order they happened (by `seq`; arrival order among equal ones). Once
    /// entries were recorded beside the core their times never go back: an entry stamped a
    /// microsecond before one that took its place first (two threads reading the clock and
    /// the counter at once) gets the earlier one's time, so viewers that expect times in
    /// order get them. (Times the core was given, e.g. a replayed trace's, are kept as they
    /// are.)
    pub fn in_order(&self) -> Vec<TraceEntry> {
        let mut out: Vec<&(u64, TraceEntry)> = self.entries.iter().collect();
        // Already sorted unless entries came from beside the core: one pass then.
        if !out.windows(2).all(|w| w[0].0 <= w[1].0) {
            out.sort_by_key(|(seq, _)| *seq);
        }
        let mut time_us = 0;
        out.into_iter()
            .map(|(_, e)| {
                time_us = if self.beside {
                    time_us.max(e.time_us)
                } else {
                    e.time_us
                };
                TraceEntry {
                    time_us,
                    ..e.clone()
                }
            })
            .collect()
    }

    /// The newest of the last `within` entries that matches `pred`.
    pub fn newest_mut(
        &mut self,
        within: usize,
        pred: impl Fn(&TraceEntry) -> bool,
    ) -> Option<&mut TraceEntry> {
        self.entries
            .iter_mut()
            .rev()
            .take(within)
            .map(|(_, e)| e)
            .find(|e| pred(e))
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
            r.push(
                i,
                TraceEntry {
                    frames: None,
                    pool: 0,
                    passed_over: false,
                    borrowed: false,
                    spilled: false,
                    grouped_pages: None,
                    single_pages: None,
                    action: TraceAction::Alloc,
                    addr: i,
                    size: 1,
                    stream: 0,
                    time_us: i,
                },
            );
        }
        let addrs: Vec<u64> = r.iter().map(|e| e.addr).collect();
        assert_eq!(addrs, vec![3, 4]);
        assert_eq!(r.in_order(), r.iter().cloned().collect::<Vec<_>>());
        assert_eq!(TraceAction::FreeCompleted.as_str(), "free_completed");
    }

    #[test]
    fn late_arrivals_are_given_in_the_order_they_happened() {
        let mut r = TraceRing::new(3);
        let entry = |addr| TraceEntry {
            frames: None,
            pool: 0,
            passed_over: false,
            borrowed: false,
            spilled: false,
            grouped_pages: None,
            single_pages: None,
            action: TraceAction::Alloc,
            addr,
            size: 1,
            stream: 0,
            time_us: 100 - addr,
        };
        // Arrivals 5, 2, 9, 1: the first to arrive (5) falls off, not the oldest (1).
        for seq in [5, 2, 9, 1] {
            r.push(seq, entry(seq));
        }
        let happened: Vec<(u64, u64)> = r.in_order().iter().map(|e| (e.addr, e.time_us)).collect();
        assert_eq!(happened, vec![(1, 99), (2, 98), (9, 91)], "times as given");
        r.push_beside(9, entry(9));
        r.push(9, entry(9));
        r.push_beside(1, entry(1));
        let arrived: Vec<u64> = r.iter().map(|e| e.addr).collect();
        assert_eq!(arrived, vec![9, 9, 1]);
        let happened: Vec<(u64, u64)> = r.in_order().iter().map(|e| (e.addr, e.time_us)).collect();
        assert_eq!(
            happened,
            vec![(1, 99), (9, 99), (9, 99)],
            "times never go back once entries came from beside the core"
        );
        // Equal places keep their arrival order.
        let mut r = TraceRing::new(4);
        r.push(3, entry(30));
        r.push(1, entry(10));
        r.push(3, entry(31));
        let happened: Vec<u64> = r.in_order().iter().map(|e| e.addr).collect();
        assert_eq!(happened, vec![10, 30, 31]);
        // Arrived in reverse.
        let mut r = TraceRing::new(4);
        for seq in [3, 2, 1] {
            r.push(seq, entry(seq));
        }
        let happened: Vec<u64> = r.in_order().iter().map(|e| e.addr).collect();
        assert_eq!(happened, vec![1, 2, 3]);
    }
}
