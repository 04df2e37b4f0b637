//! History recorded beside the core: what an owner that hands blocks out without the core
//! (the facade's thread cache: a block a thread freed, handed back to its next request)
//! records itself, to be added to the core's history.
//!
//! - Every entry takes its place in the order things happened from the core's counter
//!   ([`DeviceCore::trace_sequence`]), one `fetch_add` each, wherever it is recorded; the
//!   core's own entries take theirs from the same counter. A snapshot gives the history in
//!   that order (`TraceRing::in_order`), so entries handed in late, and a block freed on one
//!   thread after another thread revived it, still come out in the order they happened.
//! - A block whose free was recorded beside the core (it was parked) is later freed in the
//!   core for real ([`DeviceCore::free_recorded_beside`]): that free records nothing, so the
//!   history has one free per free the user made.

use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use gpualloc_runtime::DevicePtr;

use crate::core::DeviceCore;
use crate::error::AllocError;
use crate::trace::{TraceAction, TraceEntry};

impl DeviceCore {
    /// The counter that orders history entries (see the module docs). Entries recorded beside
    /// the core take their place with `fetch_add(1, Relaxed)` on it: a single atomic's updates
    /// are totally ordered, so an entry recorded after another (on any thread that saw it)
    /// gets a larger place.
    pub fn trace_sequence(&self) -> Arc<AtomicU64> {
        self.trace_seq.clone()
    }

    /// Adds `entries`, recorded beside the core with their places, to the history (nothing
    /// when history is off), and drains them. An `alloc` entry's frames are also kept for
    /// its block's snapshots while it is live; a `free_requested` forgets them.
    pub fn record_beside(&mut self, entries: &mut Vec<(u64, TraceEntry)>) {
        let Some(ring) = &mut self.trace else {
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
                        if self.active.contains_key(&entry.addr) {
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

    /// Frees `ptr`, whose `free_requested` and `free_completed` were recorded beside the
    /// core: as [`DeviceCore::free`], but recording neither again.
    pub fn free_recorded_beside(&mut self, ptr: DevicePtr) -> Result<(), AllocError> {
        self.free_recorded_beside = Some(ptr.0);
        let freed = self.free(ptr);
        self.free_recorded_beside = None;
        freed
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;
    use std::sync::Arc;

    use gpualloc_runtime::sim::{SimBackend, SimConfig};
    use gpualloc_runtime::{Backend, DeviceId};

    use crate::trace::{Frame, TraceAction, TraceEntry};
    use crate::{AllocatorConfig, DeviceCore};

    fn entry(action: TraceAction, addr: u64, size: u64) -> TraceEntry {
        TraceEntry {
            action,
            addr,
            size,
            stream: 7,
            time_us: 0,
            frames: None,
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
        // Parked again, then freed in the core for real.
        let mut again = vec![
            stamp(entry(TraceAction::FreeRequested, a.ptr.0, 1000)),
            stamp(entry(TraceAction::FreeCompleted, a.ptr.0, 1000)),
        ];
        core.record_beside(&mut again);
        let snap = core.snapshot();
        assert!(
            snap.segments[0]
                .blocks
                .iter()
                .all(|blk| blk.frames.is_none()),
            "a parked block's frames are forgotten"
        );
        core.free_recorded_beside(a.ptr).unwrap();
        core.free(b.ptr).unwrap();
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
                (FreeCompleted, a.ptr.0),
                (FreeRequested, b.ptr.0),
                (FreeCompleted, b.ptr.0),
            ],
            "the block parked and freed in the core has one free per park, the other its own"
        );
        assert_eq!(
            core.stats().allocated_bytes[0].current,
            0,
            "both freed for real"
        );
        assert!(core.free_recorded_beside(a.ptr).is_err(), "freed once");
    }
}
