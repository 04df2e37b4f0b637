//! The thread cache: a few blocks each thread freed, parked beside the device core and handed
//! straight back to the same thread's next request of the same size on the same stream,
//! without the actor's gate (config key `thread_cache`, on by default).
//!
//! Why: a cache hit through the gate moves the core's cache lines to the calling CPU, and
//! two CPUs taking turns on one core spend most of their time moving them (the core's hit
//! path alone runs ~25% slower from two threads than from one). Services mostly free a
//! tensor and ask for one of the same shape on the same stream, on the same worker thread;
//! that round trip needs no core at all. jemalloc's tcache and RMM's per-thread arenas
//! answer the same problem; unlike theirs, this cache keeps the core's accounting exact.
//!
//! The rules, and what they keep:
//! - **Park**: a dropped buffer goes to its thread's slot (at most
//!   [`PARKED_PER_THREAD`]; the oldest is then freed through the core) unless it was used
//!   on another stream (`record_stream`: its free waits on events), somebody is waiting for
//!   memory (they are woken by frees: a request that starts waiting sweeps every slot, and
//!   a park that raced it frees its blocks through the core), or the device shut down. A parked block is still
//!   allocated as far as the core knows.
//! - **Revive**: a malloc first looks in its thread's slot for a block parked with exactly
//!   the requested size on the same stream. It is handed out again at once: reuse by the
//!   stream that freed it is stream-ordered, exactly as the core's own reuse.
//! - **Collect**: whoever takes the gate first folds every slot into the core: round trips
//!   are added to its totals ([`gpualloc_devices::RoundTrips`]), parked blocks are freed
//!   (`DeviceState::collect_thread_cache`). So the core never reads or changes its state
//!   while a block parked before is still parked; stats, snapshots, `empty_cache`, misses
//!   and the out-of-memory chain all see every free that happened before them.
//! - A revived block had the same size requested, so a round trip changes no current
//!   value (allocated, active, requested bytes, counts) and no peak: `memory_stats()` stays
//!   exactly what PyTorch's would be for the same frees and mallocs.
//!
//! The departure, written down: the core would merge a freed block with free neighbours and
//! best-fit the next request, usually splitting the same block off again but sometimes
//! picking an equal-sized block at a lower address; the thread cache always hands back the
//! block just freed. `thread_cache:False` gives the core's choice every time (the trace replay
//! always uses the core directly). Blocks parked by a thread stay parked while the device is
//! idle; anything that touches the device collects them first.

use gpualloc_devices::{Allocation, RoundTrips};
use gpualloc_runtime::actor::thread_slots::{thread_index, SlotState, ThreadSlots, MAX_SLOTS};
use gpualloc_runtime::{DevicePtr, StreamHandle};

/// Blocks one thread keeps parked at most.
pub(crate) const PARKED_PER_THREAD: usize = 8;

/// What one thread's slot holds.
pub(crate) struct ParkedBlocks {
    /// Oldest first.
    parked: Vec<Allocation>,
    /// Round trips of revived blocks not yet added to the core's totals.
    trips: RoundTrips,
    /// Blocks revived from this slot, ever (for diagnostics and tests).
    revived: u64,
}

impl SlotState for ParkedBlocks {
    fn is_empty(&self) -> bool {
        self.parked.is_empty() && self.trips.is_empty()
    }
}

/// One device's thread cache. See the module docs.
#[derive(Debug)]
pub(crate) struct ThreadCache {
    slots: ThreadSlots<ParkedBlocks>,
}

impl ThreadCache {
    pub fn new() -> Self {
        ThreadCache {
            // Capacity up front: parking and reviving never allocate.
            slots: ThreadSlots::new(MAX_SLOTS, || ParkedBlocks {
                parked: Vec::with_capacity(PARKED_PER_THREAD),
                trips: RoundTrips::default(),
                revived: 0,
            }),
        }
    }

    /// Takes the block the calling thread parked most recently with exactly `size` bytes
    /// requested on `stream`, and counts the round trip.
    pub fn revive(&self, size: u64, stream: StreamHandle) -> Option<Allocation> {
        let index = thread_index()?;
        let a = self.slots.update(index, |slot| {
            let pos = slot
                .parked
                .iter()
                .rposition(|a| a.size == size && a.stream == stream)?;
            let a = slot.parked.remove(pos);
            slot.trips.record(&a);
            slot.revived += 1;
            Some(a)
        })?;
        // Shutdown closes the slots before it collects them and returns every segment: a
        // block taken out after the close may have no memory behind it any more. (Taken out
        // before it, it is a live buffer at shutdown, like any other.)
        if self.slots.is_closed() {
            return None;
        }
        Some(a)
    }

    /// Parks `a` in the calling thread's slot. Returns a block the caller must free through
    /// the core: the oldest parked one when the slot was full, or `a` itself when it cannot
    /// be parked (the thread is exiting, or the device shut down).
    pub fn park(&self, a: Allocation) -> Option<Allocation> {
        let Some(index) = thread_index() else {
            return Some(a);
        };
        if self.slots.is_closed() {
            return Some(a);
        }
        self.slots.update(index, |slot| {
            let evicted = (slot.parked.len() >= PARKED_PER_THREAD).then(|| slot.parked.remove(0));
            slot.parked.push(a);
            evicted
        })
    }

    /// Takes every block out of the calling thread's slot, for the caller to free through
    /// the core (somebody started waiting for memory just as a block was parked). They are
    /// returned, not freed here: freeing may take the gate, whose holder locks the slots.
    pub fn unpark_mine(&self) -> Vec<DevicePtr> {
        let Some(index) = thread_index() else {
            return Vec::new();
        };
        self.slots
            .update(index, |slot| slot.parked.drain(..).map(|a| a.ptr).collect())
    }

    /// Gate holder: empties every marked slot (every slot with `all`: a request that just
    /// started waiting for memory), adding its round trips to `trips` and its parked blocks
    /// to `parked` for the caller to free.
    pub fn collect(&self, all: bool, trips: &mut RoundTrips, parked: &mut Vec<DevicePtr>) {
        let take = |slot: &mut ParkedBlocks| {
            trips.merge(&slot.trips);
            slot.trips = RoundTrips::default();
            parked.extend(slot.parked.drain(..).map(|a| a.ptr));
        };
        if all {
            self.slots.collect_all(take);
        } else {
            self.slots.collect(take);
        }
    }

    /// Blocks handed back by the thread cache so far, over all threads.
    pub fn revived(&self) -> u64 {
        let mut n = 0;
        self.slots.for_each(|slot| n += slot.revived);
        n
    }

    /// From now on nothing is parked or revived (shutdown; see [`ThreadCache::revive`]).
    pub fn close(&self) {
        self.slots.close();
    }
}
