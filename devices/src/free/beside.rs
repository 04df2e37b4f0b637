//! History recorded beside the core: what an owner that hands blocks out without the core
//! (the facade's thread cache: a block a thread freed, handed back to its next request)
//! records itself, to be added to the core's history.
//!
//! - Every entry takes its place in the order things happened from the core's counter
//!   ([`DeviceCore::trace_sequence`]), one `fetch_add` each, wherever it is recorded; the
//!   core's own entries take theirs from the same counter. A snapshot gives the history in
//!   that order (`TraceRing::in_order`), so entries handed in late, and a block freed on one
//!   thread after another thread revived it, still come out in the order they happened.
//! - A parked block's `free_requested` is recorded beside the core when it is parked; the
//!   block is freed in the core for real later ([`DeviceCore::free_parked`]), and only then
//!   does the core record its `free_completed`: from then on other requests can have it. (A
//!   revive records the `free_completed` and the `alloc` beside the core, one after the
//!   other.) So the history says when the block was free for the core, as PyTorch's does for
//!   a free that waits on stream events, and a replay of it makes the choices the core made:
//!   a request served while the block was parked did not see it. The history has one free
//!   per free the user made.

use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use gpualloc_runtime::DevicePtr;

use crate::core::DeviceCore;
use crate::error::AllocError;
use crate::ledger::trace::TraceEntry;

impl DeviceCore {
    /// The counter that orders history entries (see the module docs). Entries recorded beside
    /// the core take their place with `fetch_add(1, Relaxed)` on it: a single atomic's updates
    /// are totally ordered, so an entry recorded after another (on any thread that saw it)
    /// gets a larger place.
    pub fn trace_sequence(&self) -> Arc<AtomicU64> {
        self.history.sequence()
    }

    /// Adds `entries`, recorded beside the core with their places, to the history (nothing
    /// when history is off), and drains them. An `alloc` entry's frames are also kept for
    /// its block's snapshots while it is live; a `free_requested` forgets them.
    pub fn record_beside(&mut self, entries: &mut Vec<(u64, TraceEntry)>) {
        let active = &self.active;
        self.history
            .record_beside(entries, |addr| active.contains(addr));
    }

    /// Frees `ptr`, a block an owner parked beside the core (the thread cache), for real.
    /// `recorded`: the park recorded the block's `free_requested` beside the core, and the
    /// core records its `free_completed` now, as the block becomes free for other requests.
    /// Otherwise (parked before the recording began, or its entries were dropped) the core
    /// records nothing for it.
    pub fn free_parked(&mut self, ptr: DevicePtr, recorded: bool) -> Result<(), AllocError> {
        self.history.set_freeing_parked(Some((ptr.0, recorded)));
        let freed = self.free(ptr);
        self.history.set_freeing_parked(None);
        freed
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;
    use std::sync::Arc;

    use gpualloc_runtime::{Backend, DeviceId};
    use gpualloc_sim::{SimBackend, SimConfig};

    use crate::ledger::trace::{Frame, TraceAction, TraceEntry};
    use crate::{AllocatorConfig, DeviceCore};

    fn entry(action: TraceAction, addr: u64, size: u64) -> TraceEntry {
        TraceEntry {
            action,
            addr,
            size,
            stream: 7,
            time_us: 0,
            frames: None,
            pool: 0,
            passed_over: false,
            borrowed: false,
            spilled: false,
            grouped_pages: None,
            single_pages: None,
        }
    }

    fn actions(core: &DeviceCore) -> Vec<(TraceAction, u64)> {
        core.snapshot()
            .trace
            .iter()
            .map(|e| (e.action, e.addr))
            .collect()
    }

    #[test]
    fn entries_from_beside_take_their_place_and_a_parked_block_is_freed_once() {
        let sim: Arc<dyn Backend> = SimBackend::new(SimConfig::fast(1)).unwrap();
        let stream = sim.stream_create(DeviceId(0)).unwrap();
        let mut core = DeviceCore::new(sim, DeviceId(0), AllocatorConfig::default()).unwrap();
        let seq = core.trace_sequence();
        // Nothing is kept while history is off.
        let mut late = vec![(
            seq.fetch_add(1, Ordering::Relaxed),
            entry(TraceAction::Alloc, 1, 1),
        )];
        core.record_beside(&mut late);
        assert!(late.is_empty());
        core.record_history(Some(100));
        let a = core.malloc(1000, stream).unwrap();
        // Parked (recorded beside), revived with frames, parked again; then the core
        // allocates another block; the parked entries arrive after it.
        let frames: crate::Frames = vec![Frame {
            name: "request{id=1}".into(),
            filename: "a.rs".into(),
            line: 3,
        }]
        .into();
        let mut beside = Vec::new();
        let stamp = |e: TraceEntry| (seq.fetch_add(1, Ordering::Relaxed), e);
        beside.push(stamp(entry(TraceAction::FreeRequested, a.ptr.0, 1000)));
        beside.push(stamp(entry(TraceAction::FreeCompleted, a.ptr.0, 1000)));
        // (A revive's free_completed comes right before its alloc.)
        let mut revived = entry(TraceAction::Alloc, a.ptr.0, 1000);
        revived.frames = Some(frames.clone());
        beside.push(stamp(revived));
        let b = core.malloc(2000, stream).unwrap();
        // Handed in out of order: the core sorts them.
        beside.reverse();
        core.record_beside(&mut beside);
        let snap = core.snapshot();
        let block = snap.segments[0]
            .blocks
            .iter()
            .find(|blk| blk.address == a.ptr.0)
            .unwrap();
        assert_eq!(
            block.frames.as_ref(),
            Some(&frames),
            "the revived block's frames"
        );
        // Parked again (its free requested beside the core); the core serves another request
        // while it is parked, then frees it for real: its free completes only now.
        let mut again = vec![stamp(entry(TraceAction::FreeRequested, a.ptr.0, 1000))];
        let c = core.malloc(1000, stream).unwrap();
        assert_ne!(c.ptr, a.ptr, "the parked block is not free for the core");
        core.record_beside(&mut again);
        let snap = core.snapshot();
        assert!(
            snap.segments[0]
                .blocks
                .iter()
                .all(|blk| blk.frames.is_none()),
            "a parked block's frames are forgotten"
        );
        core.free_parked(a.ptr, true).unwrap();
        core.free(b.ptr).unwrap();
        // A block parked before the recording began: its free is recorded nowhere.
        core.free_parked(c.ptr, false).unwrap();
        use TraceAction::*;
        assert_eq!(
            actions(&core),
            vec![
                (SegmentAlloc, a.ptr.0),
                (Alloc, a.ptr.0),
                (FreeRequested, a.ptr.0),
                (FreeCompleted, a.ptr.0),
                (Alloc, a.ptr.0),
                (Alloc, b.ptr.0),
                (FreeRequested, a.ptr.0),
                (Alloc, c.ptr.0),
                (FreeCompleted, a.ptr.0),
                (FreeRequested, b.ptr.0),
                (FreeCompleted, b.ptr.0),
            ],
            "the block parked and freed in the core has one free per park, completed when the \
             core frees it; the others their own"
        );
        assert_eq!(
            core.stats().allocated_bytes[0].current,
            0,
            "both freed for real"
        );
        assert!(core.free_parked(a.ptr, true).is_err(), "freed once");
    }
}
