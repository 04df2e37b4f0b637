//! The books the core keeps beside its blocks: statistics, the history (a ring of trace
//! entries with their frames) and the segment observer. Every event of a block or segment is
//! written here through [`DeviceCore::record_in`], which with nothing recording, no frames
//! kept and no observer is three checks.

use std::sync::atomic::Ordering;

use crate::core::{DeviceCore, TraceClock};
use crate::pool::PoolOwner;
use crate::stats::DeviceStats;
use crate::trace::{Frames, TraceAction, TraceEntry, TraceRing};

/// How far back [`DeviceCore::attach_frames`] looks for an allocation's entry.
pub const ATTACH_WITHIN: usize = 4096;

impl DeviceCore {
    /// Sets the time stamped on trace entries from now on (the core has no clock).
    pub fn set_time_us(&mut self, now_us: u64) {
        self.now_us = now_us;
    }

    /// Stamps trace entries with `clock()` (microseconds) instead of the time last set with
    /// [`DeviceCore::set_time_us`]; `None` goes back to that. A live allocator passes its
    /// wall clock; a replay keeps the trace's own times.
    pub fn set_trace_clock(&mut self, clock: Option<TraceClock>) {
        self.clock = clock;
    }

    /// Starts recording history into a ring of `max_entries` (None stops and clears it,
    /// and forgets the frames of live blocks).
    pub fn record_history(&mut self, max_entries: Option<usize>) {
        self.trace = max_entries.map(TraceRing::new);
        if self.trace.is_none() {
            self.live_frames.clear();
        }
    }

    /// Attaches `frames` to the live allocation at `addr`: to its `alloc` entry (the newest
    /// for that address among the last `ATTACH_WITHIN` (4,096) entries) and to its block in
    /// snapshots until it is freed. Nothing when history is off or `addr` is not live.
    pub fn attach_frames(&mut self, addr: u64, frames: Frames) {
        let Some(ring) = &mut self.trace else {
            return;
        };
        if !self.active.contains_key(&addr) {
            return;
        }
        if let Some(e) = ring.newest_mut(ATTACH_WITHIN, |e| {
            e.action == TraceAction::Alloc && e.addr == addr
        }) {
            e.frames = Some(frames.clone());
        }
        self.live_frames.insert(addr, frames);
    }

    /// Statistics.
    pub fn stats(&self) -> &DeviceStats {
        &self.stats
    }

    /// Resets peak statistics to current values.
    pub fn reset_peak_stats(&mut self) {
        self.stats.reset_peak();
    }

    /// Resets accumulated statistics (sums and event counters).
    pub fn reset_accumulated_stats(&mut self) {
        self.stats.reset_accumulated();
    }

    /// Records a trace entry (when history is on) and announces a segment change to the
    /// segment sink (when one is set, `observer.rs`).
    pub(crate) fn record(&mut self, action: TraceAction, addr: u64, size: u64, stream: u64) {
        self.record_in(action, addr, size, stream, None);
    }

    /// [`DeviceCore::record`] of an entry about a block or segment of pool index `pool`: a
    /// private pool's entries carry its id.
    pub(crate) fn record_in(
        &mut self,
        action: TraceAction,
        addr: u64,
        size: u64,
        stream: u64,
        pool: Option<usize>,
    ) {
        if let Some(ring) = &mut self.trace {
            // A parked block's free was requested beside the core (`beside.rs`).
            let already = match self.freeing_parked {
                Some((parked, recorded)) if parked == addr => {
                    action == TraceAction::FreeRequested
                        || (!recorded && action == TraceAction::FreeCompleted)
                }
                _ => false,
            };
            if !already {
                let time_us = self.clock.as_ref().map_or(self.now_us, |clock| clock());
                let seq = self.trace_seq.fetch_add(1, Ordering::Relaxed);
                ring.push(
                    seq,
                    TraceEntry {
                        action,
                        addr,
                        size,
                        stream,
                        time_us,
                        frames: None,
                        pool: match pool.map(|p| self.pools[p].owner) {
                            Some(PoolOwner::Private(id)) => id,
                            _ => 0,
                        },
                        passed_over: false,
                    },
                );
            }
        }
        if action == TraceAction::FreeRequested && !self.live_frames.is_empty() {
            self.live_frames.remove(&addr);
        }
        self.announce(action, addr, size, stream);
    }

    /// Marks the `alloc` entry just recorded for `addr` as served by a passed-over block.
    pub(crate) fn mark_passed_over(&mut self, addr: u64) {
        if let Some(ring) = &mut self.trace {
            if let Some(e) =
                ring.newest_mut(1, |e| e.action == TraceAction::Alloc && e.addr == addr)
            {
                e.passed_over = true;
            }
        }
    }
}
