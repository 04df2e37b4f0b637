//! The books the core keeps beside its blocks: statistics, the history (`history.rs`, a
//! component of its own) and the segment observer (`observer_hooks.rs`). Every event of a
//! block or segment is written through [`DeviceCore::record_in`], one call per event.

pub(crate) mod books;
pub(crate) mod cross_stream;
pub(crate) mod history;
pub(crate) mod inspect;
pub(crate) mod observer;
pub(crate) mod observer_hooks;
pub(crate) mod round_trips;
pub mod snapshot;
pub mod snapshot_pickle;
pub mod stats;
pub(crate) mod summary;
pub mod trace;

use crate::blocks::pool::PoolOwner;
use crate::core::DeviceCore;
use crate::ledger::history::TraceClock;
use crate::ledger::stats::DeviceStats;
use crate::ledger::trace::{Frames, TraceAction};

impl DeviceCore {
    /// Sets the time stamped on trace entries from now on (the core has no clock).
    pub fn set_time_us(&mut self, now_us: u64) {
        self.history.set_time_us(now_us);
    }

    /// Stamps trace entries with `clock()` (microseconds) instead of the time last set with
    /// [`DeviceCore::set_time_us`]; `None` goes back to that. A live allocator passes its
    /// wall clock; a replay keeps the trace's own times.
    pub fn set_trace_clock(&mut self, clock: Option<TraceClock>) {
        self.history.set_clock(clock);
    }

    /// Starts recording history into a ring of `max_entries` (None stops and clears it,
    /// and forgets the frames of live blocks).
    pub fn record_history(&mut self, max_entries: Option<usize>) {
        self.history.start(max_entries);
    }

    /// Attaches `frames` to the live allocation at `addr`: to its `alloc` entry (the newest
    /// for that address among the last `ATTACH_WITHIN` (4,096) entries) and to its block in
    /// snapshots until it is freed. Nothing when history is off or `addr` is not live.
    pub fn attach_frames(&mut self, addr: u64, frames: Frames) {
        if self.active.contains(addr) {
            self.history.attach_frames(addr, frames);
        }
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
    #[inline]
    pub(crate) fn record(&mut self, action: TraceAction, addr: u64, size: u64, stream: u64) {
        self.record_in(action, addr, size, stream, None);
    }

    /// [`DeviceCore::record`] of an entry about a block or segment of pool index `pool`: a
    /// private pool's entries carry its id.
    #[inline]
    pub(crate) fn record_in(
        &mut self,
        action: TraceAction,
        addr: u64,
        size: u64,
        stream: u64,
        pool: Option<usize>,
    ) {
        // The hit path's case, inline: no history and no segment sink.
        if self.history.is_quiet() && !self.observer.is_set() {
            return;
        }
        self.record_heard(action, addr, size, stream, pool);
    }

    /// [`DeviceCore::record_in`] with a history or a segment sink to tell.
    #[cold]
    #[inline(never)]
    fn record_heard(
        &mut self,
        action: TraceAction,
        addr: u64,
        size: u64,
        stream: u64,
        pool: Option<usize>,
    ) {
        if !self.history.is_quiet() {
            let pool = match pool.map(|p| self.pools[p].owner) {
                Some(PoolOwner::Private(id)) => id,
                _ => 0,
            };
            self.history.record(action, addr, size, stream, pool);
        }
        self.announce(action, addr, size, stream);
    }

    /// Marks the `alloc` entry just recorded for `addr` as served by a passed-over block.
    pub(crate) fn mark_passed_over(&mut self, addr: u64) {
        self.history.mark_passed_over(addr);
    }

    /// Marks the `segment_map` entry just recorded for `addr` as grouping only its first
    /// `grouped` pages into shared physical handles, the `singles` pages after them a handle
    /// each (the rest shared again).
    pub(crate) fn mark_grouped_pages(&mut self, addr: u64, grouped: u64, singles: u64) {
        self.history.mark_grouped_pages(addr, grouped, singles);
    }
}
