//! What a trace says by itself, before any replay: the allocations that were alive when
//! recording began, the segments PyTorch held then, and PyTorch's own peaks.
//!
//! Allocations alive at the start are (a) frees of addresses the trace never allocated, and
//! (b) blocks active in the final segments that the trace never allocated. The segments at the
//! start are the final segments walked back through the trace: undo each `segment_alloc`
//! (remove) and `segment_free` (add), last event first.

use std::collections::{BTreeMap, HashSet};

use gpualloc_runtime::addr_map::{AddrMap, AddrSet};

use gpualloc_devices::sizes::{round_size, SMALL_SIZE};
use gpualloc_devices::AllocatorConfig;
use gpualloc_trace::{Action, TraceEntry};

use crate::input::Trace;

/// An allocation that existed before the trace begins.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LiveAtStart {
    /// Address PyTorch gave it.
    pub addr: u64,
    /// Bytes requested.
    pub requested: u64,
    /// Stream id.
    pub stream: u64,
    /// Block size, when the final snapshot shows the block.
    pub block_size: Option<u64>,
}

/// A segment PyTorch held when recording began.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StartSegment {
    /// Base address.
    pub addr: u64,
    /// Bytes.
    pub size: u64,
    /// Stream id.
    pub stream: u64,
    /// Small pool.
    pub small: bool,
}

/// PyTorch's own figures for the traced span.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TorchFigures {
    /// Peak reserved bytes (None when the source has no segment list).
    pub peak_reserved: Option<u64>,
    /// Peak of requested bytes in use.
    pub peak_requested: Option<u64>,
    /// Reserved bytes when recording began.
    pub start_reserved: Option<u64>,
    /// `segment_alloc` events.
    pub segment_allocs: u64,
    /// `segment_free` events.
    pub segment_frees: u64,
    /// `oom` events.
    pub ooms: u64,
}

/// Allocations alive before the first event, sorted by address; and the number of frees that
/// could not be explained (double frees of traced allocations).
pub fn live_at_start(trace: &Trace) -> (Vec<LiveAtStart>, u64) {
    let mut live = AddrSet::default();
    let mut ever_allocated = AddrSet::default();
    let mut initial: BTreeMap<u64, LiveAtStart> = BTreeMap::new();
    let mut unexplained = 0;
    for e in &trace.events {
        match e.action {
            Action::Alloc => {
                live.insert(e.addr);
                ever_allocated.insert(e.addr);
            }
            Action::FreeRequested if !live.remove(&e.addr) => {
                if ever_allocated.contains(&e.addr) || initial.contains_key(&e.addr) {
                    unexplained += 1;
                } else {
                    let l = LiveAtStart {
                        addr: e.addr,
                        requested: e.size,
                        stream: e.stream,
                        block_size: None,
                    };
                    initial.insert(e.addr, l);
                }
            }
            _ => {}
        }
    }
    for seg in trace.final_segments.iter().flatten() {
        for b in seg.blocks.iter().filter(|b| b.active) {
            if live.contains(&b.addr) {
                continue;
            }
            initial
                .entry(b.addr)
                .and_modify(|l| l.block_size = Some(b.size))
                .or_insert(LiveAtStart {
                    addr: b.addr,
                    requested: b.requested,
                    stream: seg.stream,
                    block_size: Some(b.size),
                });
        }
    }
    (initial.into_values().collect(), unexplained)
}

/// The segments held when recording began (None without a final segment list).
pub fn start_segments(trace: &Trace) -> Option<Vec<StartSegment>> {
    let finals = trace.final_segments.as_ref()?;
    let mut set: BTreeMap<u64, StartSegment> = finals
        .iter()
        .map(|s| {
            (
                s.addr,
                StartSegment {
                    addr: s.addr,
                    size: s.size,
                    stream: s.stream,
                    small: s.small,
                },
            )
        })
        .collect();
    for e in trace.events.iter().rev() {
        match e.action {
            Action::SegmentAlloc => {
                set.remove(&e.addr);
            }
            Action::SegmentFree => {
                let small = e.size == gpualloc_devices::sizes::SMALL_BUFFER;
                set.insert(
                    e.addr,
                    StartSegment {
                        addr: e.addr,
                        size: e.size,
                        stream: e.stream,
                        small,
                    },
                );
            }
            _ => {}
        }
    }
    Some(set.into_values().collect())
}

/// PyTorch's reserved bytes after event `e`, from `reserved` before it (segment and page
/// events move it).
pub fn torch_reserved_after(reserved: u64, e: &TraceEntry) -> u64 {
    match e.action {
        Action::SegmentAlloc | Action::SegmentMap => reserved + e.size,
        Action::SegmentFree | Action::SegmentUnmap => reserved.saturating_sub(e.size),
        _ => reserved,
    }
}

/// PyTorch's peaks over the trace, from the segment history and the requested sizes
/// (`initial`: the allocations alive at the start, from [`live_at_start`]).
pub fn torch_figures(trace: &Trace, initial: &[LiveAtStart]) -> TorchFigures {
    let mut f = TorchFigures {
        segment_allocs: trace.count(Action::SegmentAlloc) as u64,
        segment_frees: trace.count(Action::SegmentFree) as u64,
        ooms: trace.count(Action::Oom) as u64,
        ..TorchFigures::default()
    };
    if let Some(start) = start_segments(trace) {
        let mut reserved: u64 = start.iter().map(|s| s.size).sum();
        f.start_reserved = Some(reserved);
        let mut peak = reserved;
        for e in &trace.events {
            reserved = torch_reserved_after(reserved, e);
            peak = peak.max(reserved);
        }
        f.peak_reserved = Some(peak);
    }
    let mut in_use: u64 = initial.iter().map(|l| l.requested).sum();
    let mut peak = in_use;
    for e in &trace.events {
        match e.action {
            Action::Alloc => in_use += e.size,
            Action::FreeRequested => in_use = in_use.saturating_sub(e.size),
            _ => {}
        }
        peak = peak.max(in_use);
    }
    f.peak_requested = Some(peak);
    f
}

/// Block sizes of the allocations alive in one start segment, as PyTorch's default rules made
/// them: the rounded request, extended to the next block when the gap is too small for the
/// large pool to have split it off (a free large-pool block is always over 1 MiB).
pub fn start_blocks(seg: &StartSegment, live: &[LiveAtStart]) -> Vec<(u64, u64, u64)> {
    let defaults = AllocatorConfig::default();
    let inside: Vec<&LiveAtStart> = live
        .iter()
        .filter(|l| l.addr >= seg.addr && l.addr < seg.addr + seg.size)
        .collect();
    let mut out = Vec::with_capacity(inside.len());
    for (i, l) in inside.iter().enumerate() {
        let next = inside.get(i + 1).map_or(seg.addr + seg.size, |n| n.addr);
        let size = match l.block_size {
            Some(s) => s,
            None => {
                let rounded = round_size(l.requested, &defaults).unwrap_or(l.requested);
                let gap = next.saturating_sub(l.addr + rounded);
                if !seg.small && gap > 0 && gap <= SMALL_SIZE {
                    next - l.addr
                } else {
                    rounded
                }
            }
        };
        out.push((l.addr, size.min(next - l.addr), l.requested));
    }
    out
}

/// Index of each `free_requested` whose `free_completed` comes later but not at once (the
/// block waited for other streams). A `free_requested` with no `free_completed` at all (a
/// format that records only one free event) is an immediate free.
pub fn deferred_frees(trace: &Trace) -> HashSet<usize> {
    let mut requested: AddrMap<usize> = AddrMap::default();
    let mut deferred = HashSet::new();
    for (i, e) in trace.events.iter().enumerate() {
        match e.action {
            Action::FreeRequested => {
                requested.insert(e.addr, i);
            }
            Action::FreeCompleted => {
                if let Some(j) = requested.remove(&e.addr) {
                    if j + 1 != i {
                        deferred.insert(j);
                    }
                }
            }
            Action::Alloc => {
                requested.remove(&e.addr);
            }
            _ => {}
        }
    }
    deferred
}
