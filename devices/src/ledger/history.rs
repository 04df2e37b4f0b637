//! The core's history: a ring of trace entries (PyTorch's `_record_memory_history`), the time
//! stamped on them, the counter that orders them with entries recorded beside the core
//! (`beside.rs`), and the frames of live allocations for snapshots. A component that owns its
//! fields: the core writes to it through [`History::record`] (from `DeviceCore::record_in`,
//! one call per event) and reads it for snapshots; nothing else touches its state.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::ledger::trace::{Frames, TraceAction, TraceEntry, TraceRing};

/// A clock for trace entries, in microseconds (see [`crate::DeviceCore::set_trace_clock`]).
pub type TraceClock = Box<dyn Fn() -> u64 + Send>;

/// How far back [`History::attach_frames`] looks for an allocation's entry.
pub(crate) const ATTACH_WITHIN: usize = 4096;

/// See the module docs.
#[derive(Default)]
pub(crate) struct History {
    /// The entries, when recording.
    ring: Option<TraceRing>,
    /// The time stamped on entries when no clock is set (the core has no clock of its own).
    now_us: u64,
    /// Where entry times come from when set (the facade's wall clock); else `now_us`.
    clock: Option<TraceClock>,
    /// The place of the next entry in the order things happened, shared with whoever records
    /// beside the core (`beside.rs`).
    seq: Arc<AtomicU64>,
    /// A parked block being freed in the core for real, and whether its park was recorded
    /// beside the core: its `free_requested` is not recorded again, and its `free_completed`
    /// only for a recorded park (`beside.rs`).
    freeing_parked: Option<(u64, bool)>,
    /// Frames of live allocations, by address (`attach_frames`), for snapshots.
    live_frames: HashMap<u64, Frames>,
}

impl History {
    /// True when nothing records and no frames are kept: [`History::record`] would change
    /// nothing (the usual case, checked on every hit and free).
    #[inline]
    pub fn is_quiet(&self) -> bool {
        self.ring.is_none() && self.live_frames.is_empty()
    }

    pub fn set_time_us(&mut self, now_us: u64) {
        self.now_us = now_us;
    }

    pub fn set_clock(&mut self, clock: Option<TraceClock>) {
        self.clock = clock;
    }

    /// Starts recording into a ring of `max_entries`; `None` stops, clears it and forgets the
    /// frames of live blocks.
    pub fn start(&mut self, max_entries: Option<usize>) {
        self.ring = max_entries.map(TraceRing::new);
        if self.ring.is_none() {
            self.live_frames.clear();
        }
    }

    /// Attaches `frames` to the live allocation at `addr` (the caller checked it is live):
    /// to its `alloc` entry, the newest for that address among the last [`ATTACH_WITHIN`],
    /// and to its block in snapshots until it is freed. Nothing when not recording.
    pub fn attach_frames(&mut self, addr: u64, frames: Frames) {
        let Some(ring) = &mut self.ring else {
            return;
        };
        if let Some(e) = ring.newest_mut(ATTACH_WITHIN, |e| {
            e.action == TraceAction::Alloc && e.addr == addr
        }) {
            e.frames = Some(frames.clone());
        }
        self.live_frames.insert(addr, frames);
    }

    /// Records an entry of the core about a block or segment (`pool`: its private pool's id,
    /// 0 for the default pools), unless a parked block's free already recorded it beside the
    /// core. A `free_requested` forgets the block's frames.
    pub fn record(&mut self, action: TraceAction, addr: u64, size: u64, stream: u64, pool: u64) {
        if let Some(ring) = &mut self.ring {
            let already = match self.freeing_parked {
                Some((parked, recorded)) if parked == addr => {
                    action == TraceAction::FreeRequested
                        || (!recorded && action == TraceAction::FreeCompleted)
                }
                _ => false,
            };
            if !already {
                let time_us = self.clock.as_ref().map_or(self.now_us, |clock| clock());
                let seq = self.seq.fetch_add(1, Ordering::Relaxed);
                let entry = TraceEntry {
                    action,
                    addr,
                    size,
                    stream,
                    time_us,
                    frames: None,
                    pool,
                    passed_over: false,
                    borrowed: false,
                    spilled: false,
                    grouped_pages: None,
                    single_pages: None,
                };
                ring.push(seq, entry);
            }
        }
        if action == TraceAction::FreeRequested && !self.live_frames.is_empty() {
            self.live_frames.remove(&addr);
        }
    }

    /// Marks the `alloc` entry just recorded for `addr` as served by a passed-over block.
    pub fn mark_passed_over(&mut self, addr: u64) {
        if let Some(ring) = &mut self.ring {
            if let Some(e) =
                ring.newest_mut(1, |e| e.action == TraceAction::Alloc && e.addr == addr)
            {
                e.passed_over = true;
            }
        }
    }

    /// Marks the `alloc` entry just recorded for `addr` as a small request served by the
    /// large pool (the spill).
    pub fn mark_spilled(&mut self, addr: u64) {
        if let Some(ring) = &mut self.ring {
            if let Some(e) =
                ring.newest_mut(1, |e| e.action == TraceAction::Alloc && e.addr == addr)
            {
                e.spilled = true;
            }
        }
    }

    /// Marks the `alloc` entry just recorded for `addr` as served by a loan.
    pub fn mark_borrowed(&mut self, addr: u64) {
        if let Some(ring) = &mut self.ring {
            if let Some(e) =
                ring.newest_mut(1, |e| e.action == TraceAction::Alloc && e.addr == addr)
            {
                e.borrowed = true;
            }
        }
    }

    /// Marks the `segment_map` entry just recorded for `addr` as grouping only its first
    /// `grouped` pages into shared physical handles, the `singles` pages after them a handle
    /// each (the rest shared again).
    pub fn mark_grouped_pages(&mut self, addr: u64, grouped: u64, singles: u64) {
        if let Some(ring) = &mut self.ring {
            if let Some(e) =
                ring.newest_mut(1, |e| e.action == TraceAction::SegmentMap && e.addr == addr)
            {
                e.grouped_pages = Some(grouped);
                e.single_pages = Some(singles);
            }
        }
    }

    /// Gives the `action` entry just recorded for `addr` the stream `stream` (a loan's
    /// borrower: `streams/loans.rs`).
    pub fn restream(&mut self, action: TraceAction, addr: u64, stream: u64) {
        if let Some(ring) = &mut self.ring {
            if let Some(e) = ring.newest_mut(1, |e| e.action == action && e.addr == addr) {
                e.stream = stream;
            }
        }
    }

    /// The counter that orders entries (`beside.rs`).
    pub fn sequence(&self) -> Arc<AtomicU64> {
        self.seq.clone()
    }

    /// Adds `entries` recorded beside the core (nothing when not recording) and drains them;
    /// an `alloc` entry's frames are kept for its block while `is_live` says it is live, a
    /// `free_requested` forgets them.
    pub fn record_beside(
        &mut self,
        entries: &mut Vec<(u64, TraceEntry)>,
        is_live: impl Fn(u64) -> bool,
    ) {
        let Some(ring) = &mut self.ring else {
            entries.clear();
            return;
        };
        // In order, so the frames of a block freed on one thread and revived on another end
        // up as the last of them left them (the ring itself is sorted at snapshots).
        entries.sort_by_key(|(seq, _)| *seq);
        for (seq, entry) in entries.drain(..) {
            match entry.action {
                TraceAction::Alloc => {
                    if let Some(frames) = &entry.frames {
                        if is_live(entry.addr) {
                            self.live_frames.insert(entry.addr, frames.clone());
                        }
                    }
                }
                TraceAction::FreeRequested => {
                    self.live_frames.remove(&entry.addr);
                }
                _ => {}
            }
            ring.push_beside(seq, entry);
        }
    }

    /// Sets (or clears) the parked block the core is freeing for real (`beside.rs`).
    pub fn set_freeing_parked(&mut self, parked: Option<(u64, bool)>) {
        self.freeing_parked = parked;
    }

    /// The frames of the live allocation at `addr`, if kept.
    pub fn frames_of(&self, addr: u64) -> Option<&Frames> {
        self.live_frames.get(&addr)
    }

    /// The entries in the order things happened (empty when not recording).
    pub fn entries(&self) -> Vec<TraceEntry> {
        self.ring
            .as_ref()
            .map(TraceRing::in_order)
            .unwrap_or_default()
    }
}
