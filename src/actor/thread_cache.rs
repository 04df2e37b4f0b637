//! The thread cache: a few blocks each thread freed, parked beside the device core and handed
//! straight back to the same thread's next request of the same size on the same stream,
//! without the actor's gate (config key `thread_cache`, on by default).
//!
//! Why: a cache hit through the gate moves the core's cache lines to the calling CPU, and
//! two CPUs taking turns on one core spend their time moving them (the core's hit path from
//! two threads behind a mutex runs at 0.6-0.8x of one thread: `bench contention`). Services
//! mostly free a tensor and ask for one of the same shape on the same stream, on the same
//! worker thread; that round trip needs no core at all. jemalloc's tcache and RMM's
//! per-thread arenas answer the same problem; unlike theirs, this cache keeps the core's
//! accounting exact.
//!
//! The rules, and what they keep:
//! - **Park**: a dropped buffer goes to its thread's slot (at most [`PARKED_PER_THREAD`];
//!   the oldest is then freed through the core), unless it was used on another stream
//!   (`record_stream`: its free waits on events), somebody is waiting for memory (they are
//!   woken by frees: a request that starts waiting sweeps every slot, and a park that raced
//!   it frees its blocks through the core), the cache closed (shutdown), or parking has not
//!   paid off for this thread lately (`ParkedBlocks::score`: a thread whose sizes never
//!   repeat frees through the core, as without the cache). A parked block is still
//!   allocated as far as the core knows.
//! - **Revive**: a malloc first looks in its thread's slot for a block parked with exactly
//!   the requested size on the same stream. It is handed out again at once: reuse by the
//!   stream that freed it is stream-ordered, exactly as the core's own reuse. The buffer
//!   holds the slot's [`Lane`] to the actor instead of the actor, so the round trip writes
//!   no line another thread writes.
//! - **Collect**: whoever takes the gate first folds every slot into the core: round trips
//!   are added to its totals ([`gpualloc_devices::RoundTrips`]), parked blocks are freed
//!   (`DeviceState::collect_thread_cache`). So the core never reads or changes its state
//!   while a block parked before is still parked; stats, snapshots, `empty_cache`, misses
//!   and the out-of-memory chain all see every free that happened before them.
//! - A revived block had the same size requested, so a round trip changes no current
//!   value (allocated, active, requested bytes, counts) and no peak: `memory_stats()` stays
//!   exactly what PyTorch's would be for the same frees and mallocs (only `inactive_split`'s
//!   running totals differ: the core would merge and re-split the block, the cache does not).
//! - **Close** (shutdown, or the allocator's last handle going): nothing is parked or
//!   revived any more, parked blocks go back through the core, and the lanes, which point
//!   back at the actor, are dropped, so the actor can go away.
//!
//! The departure, written down: the core would merge a freed block with free neighbours and
//! best-fit the next request, usually splitting the same block off again but sometimes
//! picking an equal-sized block at a lower address; the thread cache always hands back the
//! block just freed. `thread_cache:False` gives the core's choice every time (the trace replay
//! always uses the core directly). Blocks parked by a thread stay parked while the device is
//! idle; anything that touches the device collects them first. The cache is off with
//! `garbage_collection_threshold` (the core ages cached blocks by its own lookups, which
//! round trips skip). While history is recorded, parks and revives write their entries into
//! the slot, and collections hand them to the core (`history.rs`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use arrayvec::ArrayVec;
use gpualloc_actor::thread_slots::{thread_index, SlotState, ThreadSlots, MAX_SLOTS};
use gpualloc_devices::sizes::SMALL_SIZE;
use gpualloc_devices::{Allocation, Frames, RoundTrips, TraceAction, TraceEntry};
use gpualloc_runtime::{DevicePtr, StreamHandle};

/// Blocks one thread keeps parked at most.
pub(crate) const PARKED_PER_THREAD: usize = 8;

/// Blocks all threads together keep parked at most: what one collection can free.
pub(crate) const PARKED_AT_MOST: usize = PARKED_PER_THREAD * MAX_SLOTS;

/// A slot asks for a collection each time its history log grows past a multiple of this
/// many entries (`ThreadCache::park`): a thread whose every malloc is a round trip never
/// takes the gate, so nothing else would collect its log.
pub(crate) const LOG_FLUSH: usize = 1024;

/// A history entry recorded in a slot, with its place in the order things happened.
pub(crate) type Logged = (u64, TraceEntry);

/// Bounds of a slot's score (see [`ParkedBlocks::score`]).
const SCORE_LIMIT: i32 = 16;

/// While a slot's score is negative, one drop in this many still parks, to notice when the
/// thread's pattern changes.
const PROBE_EVERY: u32 = 16;

/// A block parked in a slot, and whether its park was recorded: its `free_requested` is in
/// the history, and the core records its `free_completed` when it frees it
/// (`gpualloc_devices::DeviceCore::free_parked`), or the revive that hands it back does.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct ParkedBlock {
    pub a: Allocation,
    pub recorded: bool,
}

/// A parked block to free through the core (`DeviceCore::free_parked`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ParkedFree {
    pub ptr: DevicePtr,
    /// Its park was recorded: the core records the `free_completed`.
    pub recorded: bool,
}

impl ParkedBlock {
    fn to_free(self) -> ParkedFree {
        ParkedFree {
            ptr: self.a.ptr,
            recorded: self.recorded,
        }
    }
}

/// What one thread's slot holds.
pub(crate) struct ParkedBlocks<O> {
    /// Oldest first. Inline, not on the heap: the slot's padding keeps it off every other
    /// thread's cache lines (two heap buffers side by side would share one).
    parked: ArrayVec<ParkedBlock, PARKED_PER_THREAD>,
    /// Round trips of revived blocks not yet added to the core's totals.
    trips: RoundTrips,
    /// History entries of parks and revives made while recording, not yet handed to the
    /// core (`gpualloc_devices::DeviceCore::record_beside`).
    log: Vec<Logged>,
    /// `log.len() / LOG_FLUSH` when a park last asked for a collection (0 after one).
    flush_mark: usize,
    /// Blocks revived from this slot, ever (for diagnostics and tests).
    revived: u64,
    /// Whether parking pays for this thread, within ±[`SCORE_LIMIT`]: a revive lifts it to
    /// at least 1; an eviction, and a request of this thread that finds parked blocks but
    /// none it can use, take 1. (Collections by other threads do not count: they are not
    /// this thread's pattern.) Below zero the thread frees through the core (parking only
    /// every [`PROBE_EVERY`]th block): a parked block that is never revived only moves its
    /// free into the next gate holder's request, which then waits for it.
    score: i32,
    /// Drops declined while the score is negative, for the probes.
    declined: u32,
    /// What the buffers this slot hands out hold instead of the actor itself.
    lane: Option<Arc<Lane<O>>>,
}

impl<O> ParkedBlocks<O> {
    fn adjust(&mut self, by: i32) {
        self.score = (self.score + by).clamp(-SCORE_LIMIT, SCORE_LIMIT);
    }
}

impl<O: Send + Sync> SlotState for ParkedBlocks<O> {
    fn is_empty(&self) -> bool {
        self.parked.is_empty() && self.trips.is_empty() && self.log.is_empty()
    }
}

/// A thread's reference to the owner of a thread cache (the device actor). A revived buffer
/// holds a clone of its slot's lane rather than of the actor: the lane's reference count is
/// written by that thread alone, while the actor's would be written by every thread on every
/// revive and every drop, which measured at half the two-thread throughput. On cache lines
/// of its own, like the slots.
#[repr(align(128))]
pub(crate) struct Lane<O>(pub Arc<O>);

/// What [`ThreadCache::park`] did.
#[derive(Debug, PartialEq)]
pub(crate) enum Park {
    /// Not parked (parking has not paid off for this thread lately, the thread is exiting,
    /// or the device shut down): free it through the core, as without the cache.
    Declined(Allocation),
    /// Parked.
    Parked {
        /// The oldest parked block, when the slot was full: free it through the core.
        evicted: Option<ParkedFree>,
        /// The slot's history log is long: ask for a collection.
        flush: bool,
    },
}

/// What [`ThreadCache::revive`] found.
pub(crate) enum Revived<O> {
    /// A parked block, and the lane its buffer holds.
    Hit(Allocation, Arc<Lane<O>>),
    /// A parked block taken out after the cache closed: free it through the core.
    Free(DevicePtr),
    /// Nothing to hand back.
    Miss,
}

/// One device's thread cache, owned by `O` (the device actor). See the module docs.
///
/// The slots' lanes point back at the owner, a cycle that [`ThreadCache::close`] breaks:
/// shutdown calls it, and so does the allocator when its last handle goes.
pub(crate) struct ThreadCache<O> {
    slots: ThreadSlots<ParkedBlocks<O>>,
    /// The device core's history order (`DeviceCore::trace_sequence`).
    trace_seq: Arc<AtomicU64>,
}

/// What a recorded revive or park writes into its slot's log (`None`: history is off).
pub(crate) struct Recording {
    /// Microseconds since the Unix epoch (`history.rs`).
    pub time_us: u64,
    /// The frames of an `alloc` (revives only, when recording with frames; a park's are
    /// `None`).
    pub frames: Option<Frames>,
}

fn logged(seq: u64, action: TraceAction, a: &Allocation, rec: &Recording) -> Logged {
    let entry = TraceEntry {
        action,
        addr: a.ptr.0,
        size: a.size,
        stream: a.stream.raw,
        time_us: rec.time_us,
        frames: rec.frames.clone(),
        // The thread cache holds blocks of the default pools only.
        pool: 0,
        passed_over: false,
        borrowed: false,
        // A small block of the large pool is a spill's (`gpualloc_devices::spill`): its
        // revive is served from the large pool, and a replay must do the same.
        spilled: action == TraceAction::Alloc && !a.small_pool && a.block_size <= SMALL_SIZE,
        grouped_pages: None,
        single_pages: None,
    };
    (seq, entry)
}

impl<O> std::fmt::Debug for ThreadCache<O> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.slots.fmt(f)
    }
}

impl<O: Send + Sync> ThreadCache<O> {
    /// A cache whose history entries take their places from `trace_seq` (the device core's
    /// `trace_sequence`).
    pub fn new(trace_seq: Arc<AtomicU64>) -> Self {
        ThreadCache {
            trace_seq,
            slots: ThreadSlots::new(MAX_SLOTS, || ParkedBlocks {
                parked: ArrayVec::new(),
                trips: RoundTrips::default(),
                log: Vec::new(),
                flush_mark: 0,
                revived: 0,
                score: 0,
                declined: 0,
                lane: None,
            }),
        }
    }

    /// Takes the block the calling thread parked most recently with exactly `size` bytes
    /// requested on `stream`, and counts the round trip. `owner` makes the slot's lane the
    /// first time one is needed. While recording, `record` makes the `alloc` entry's time
    /// and frames (called only for a hit, under the slot's lock, which only collections
    /// contend).
    pub fn revive(
        &self,
        owner: &Arc<O>,
        size: u64,
        stream: StreamHandle,
        record: Option<&dyn Fn() -> Recording>,
    ) -> Revived<O> {
        let Some(index) = thread_index() else {
            return Revived::Miss;
        };
        if !self.slots.is_marked(index) {
            return Revived::Miss; // nothing parked here since the last collection
        }
        let found = self.slots.update(index, |slot| {
            let Some(pos) = slot
                .parked
                .iter()
                .rposition(|p| p.a.size == size && p.a.stream == stream)
            else {
                if !slot.parked.is_empty() {
                    slot.adjust(-1); // parked blocks, none of them what this thread wants
                }
                return None;
            };
            let ParkedBlock { a, recorded } = slot.parked.remove(pos);
            if let Some(record) = record {
                // The block is free for this request only now: its free completes right
                // before the alloc (`gpualloc_devices::beside`). A block parked before the
                // recording began has its free requested here too, so every alloc in the
                // history follows a free of the same block.
                let rec = record();
                let n = if recorded { 2 } else { 3 };
                let mut seq = self.trace_seq.fetch_add(n, Ordering::Relaxed);
                let plain = Recording {
                    time_us: rec.time_us,
                    frames: None,
                };
                if !recorded {
                    slot.log
                        .push(logged(seq, TraceAction::FreeRequested, &a, &plain));
                    seq += 1;
                }
                slot.log
                    .push(logged(seq, TraceAction::FreeCompleted, &a, &plain));
                slot.log.push(logged(seq + 1, TraceAction::Alloc, &a, &rec));
            }
            slot.trips.record(&a);
            slot.revived += 1;
            slot.score = slot.score.max(0);
            slot.adjust(1);
            let lane = slot
                .lane
                .get_or_insert_with(|| Arc::new(Lane(owner.clone())));
            Some((a, lane.clone()))
        });
        let Some((a, lane)) = found else {
            return Revived::Miss;
        };
        // Checked after taking the block (and maybe making the lane), never before: close
        // marks the slots closed before it sweeps them, so either its sweep saw this slot
        // after the update, or this check sees it closed (the slot's mutex orders the two).
        // Shutdown returns every segment after closing: a block taken out now may have no
        // memory behind it any more; taken out before the close, it is a live buffer at
        // shutdown like any other.
        if self.slots.is_closed() {
            self.slots.update(index, |slot| slot.lane = None);
            // (Its entries, if any, went with the slot's log: the core records nothing.)
            return Revived::Free(a.ptr);
        }
        Revived::Hit(a, lane)
    }

    /// Parks `a` in the calling thread's slot; while recording, `record` stamps its
    /// `free_requested` entry (its `free_completed` comes when the block is free again for
    /// somebody: a revive, or the core's free of it).
    pub fn park(&self, a: Allocation, record: Option<Recording>) -> Park {
        let Some(index) = thread_index() else {
            return Park::Declined(a);
        };
        if self.slots.is_closed() {
            return Park::Declined(a);
        }
        self.slots.update(index, |slot| {
            if slot.score < 0 {
                slot.declined = slot.declined.wrapping_add(1);
                if slot.declined % PROBE_EVERY != 0 {
                    return Park::Declined(a);
                }
            }
            let evicted = slot
                .parked
                .is_full()
                .then(|| slot.parked.remove(0).to_free());
            if evicted.is_some() {
                slot.adjust(-1);
            }
            let mut flush = false;
            if let Some(rec) = &record {
                let seq = self.trace_seq.fetch_add(1, Ordering::Relaxed);
                slot.log
                    .push(logged(seq, TraceAction::FreeRequested, &a, rec));
                // The log crossed a multiple of LOG_FLUSH since the last request.
                let mark = slot.log.len() / LOG_FLUSH;
                flush = mark > slot.flush_mark;
                slot.flush_mark = mark;
            }
            slot.parked.push(ParkedBlock {
                a,
                recorded: record.is_some(),
            });
            Park::Parked { evicted, flush }
        })
    }

    /// Takes every block out of the calling thread's slot, for the caller to free through
    /// the core (somebody started waiting for memory just as a block was parked). They are
    /// returned, not freed here: freeing may take the gate, whose holder locks the slots.
    pub fn unpark_mine(&self) -> Vec<ParkedFree> {
        let Some(index) = thread_index() else {
            return Vec::new();
        };
        self.slots.update(index, |slot| {
            slot.parked.drain(..).map(ParkedBlock::to_free).collect()
        })
    }

    /// Gate holder: empties every marked slot (every slot with `all`: a request that just
    /// started waiting for memory), adding its round trips to `trips`, its parked blocks
    /// to `parked` for the caller to free (`DeviceCore::free_parked`: the core records the
    /// `free_completed` of a recorded park) and its history entries to `log`.
    pub fn collect(
        &self,
        all: bool,
        trips: &mut RoundTrips,
        parked: &mut Vec<ParkedFree>,
        log: &mut Vec<Logged>,
    ) {
        let take = |slot: &mut ParkedBlocks<O>| {
            trips.merge(&slot.trips);
            slot.trips = RoundTrips::default();
            parked.extend(slot.parked.drain(..).map(ParkedBlock::to_free));
            log.append(&mut slot.log);
            slot.flush_mark = 0;
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

    /// From now on nothing is parked or revived (shutdown, or the allocator's last handle
    /// went; see [`ThreadCache::revive`]). Drops every lane and every slot's history log and
    /// returns every parked block, for the caller to free through the core, recording
    /// nothing (their parks' entries went with the logs). Round trips stay for the next
    /// collection.
    pub fn close(&self) -> Vec<DevicePtr> {
        self.slots.close();
        let mut parked = Vec::new();
        self.slots.collect_all(|slot| {
            slot.lane = None;
            slot.log = Vec::new();
            slot.flush_mark = 0;
            parked.extend(slot.parked.drain(..).map(|p| p.a.ptr));
        });
        parked
    }
}

#[cfg(test)]
#[path = "thread_cache_tests.rs"]
mod tests;
