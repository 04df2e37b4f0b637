//! The state a device actor's mailbox guards, and the messages it handles.

use std::sync::Arc;

use gpualloc_actor::mailbox::{Actor, Job};
use gpualloc_actor::{ReaperArm, Waiters};
use gpualloc_devices::{DeviceCore, RoundTrips};
use gpualloc_runtime::{DevicePtr, Stream};

use crate::actor::device::DeviceActor;
use crate::actor::streams::KeptStreams;
use crate::actor::thread_cache::{Logged, ParkedFree, ThreadCache, PARKED_AT_MOST};

/// Signals shared between the guarded state and the actor's users.
#[derive(Debug, Default)]
pub(crate) struct Signals {
    /// Requests waiting for memory; woken whenever memory comes back.
    pub waiters: Waiters,
    /// Wakes the reaper when frees start waiting on stream events.
    pub reaper: ReaperArm,
    /// Blocks parked by the threads that freed them (`None`: `thread_cache:False`).
    pub thread_cache: Option<ThreadCache<DeviceActor>>,
    /// Whether history is being recorded, and with which frames (`history.rs`, the
    /// `HISTORY_*` levels). While it is not off the thread cache records its parks and
    /// revives in its slots, and collections hand them to the core.
    pub history: std::sync::atomic::AtomicU8,
    /// Captures under way into graph pools (`graph.rs`): while not zero the thread cache
    /// serves nothing.
    pub captures: std::sync::atomic::AtomicUsize,
    /// Segment frees off the gate: segments the core detached (off its books) whose driver
    /// frees have not returned yet (a cache release, a graph pool's release). Shutdown waits
    /// for none, so every segment is back with the device when it returns.
    pub detached_frees: DetachedFrees,
}

/// The count behind [`Signals::detached_frees`].
#[derive(Debug, Default)]
pub(crate) struct DetachedFrees(std::sync::atomic::AtomicUsize);

impl DetachedFrees {
    /// One batch of detached segments is on its way back to the device until the guard is
    /// dropped. Taken while the gate is held, in the step that detached them, so a shutdown
    /// after that step sees it.
    fn begin(&self) -> DetachedFreeGuard<'_> {
        self.0.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        DetachedFreeGuard(self)
    }

    /// [`DetachedFrees::begin`] for the outcome of a step that detached segments, when it
    /// holds some to free.
    pub fn begin_if_any<T, E>(
        &self,
        detached: &Result<Vec<T>, E>,
    ) -> Option<DetachedFreeGuard<'_>> {
        matches!(detached, Ok(s) if !s.is_empty()).then(|| self.begin())
    }

    /// Waits (sleeping, off the runtime's workers) until no batch is in flight, or `limit`.
    /// False on the limit.
    pub fn wait_none(&self, limit: std::time::Duration) -> bool {
        let start = std::time::Instant::now();
        while self.0.load(std::sync::atomic::Ordering::Acquire) > 0 {
            if start.elapsed() > limit {
                return false;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        true
    }
}

/// See [`DetachedFrees::begin`]; ends the batch when dropped (a panic in the frees too).
pub(crate) struct DetachedFreeGuard<'a>(&'a DetachedFrees);

impl Drop for DetachedFreeGuard<'_> {
    fn drop(&mut self) {
        (self.0).0.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    }
}

/// One device's core, plus the signals its handlers raise.
pub(crate) struct DeviceState {
    pub core: DeviceCore,
    pub signals: Arc<Signals>,
    /// Streams the core still names, kept alive for it (`streams.rs`).
    pub streams: KeptStreams,
    /// Scratch for the parked blocks a collection frees (kept to never allocate).
    parked: Vec<ParkedFree>,
    /// Scratch for the history entries a collection hands to the core.
    logged: Vec<Logged>,
    /// Where the core's segment events go once someone watches (`observer.rs`).
    pub segment_tx: Option<tokio::sync::broadcast::Sender<gpualloc_devices::SegmentEvent>>,
}

/// A queued message. Requests with replies travel as jobs.
pub(crate) enum DeviceMsg {
    /// A buffer was dropped.
    Free(DevicePtr),
    /// A block the thread cache had parked goes back to the core; its park recorded its
    /// `free_requested` (or happened before the recording), so the core records at most its
    /// `free_completed` (`DeviceCore::free_parked`).
    FreeParked(ParkedFree),
    /// A buffer is used on another stream (kept alive while the core names it).
    RecordStream(DevicePtr, Stream),
    /// Any other request (malloc, stats, snapshot, ...), with its reply inside.
    Job(Job<DeviceState>),
}

impl DeviceState {
    pub fn new(core: DeviceCore, signals: Arc<Signals>) -> Self {
        let capacity = if signals.thread_cache.is_some() {
            PARKED_AT_MOST
        } else {
            0
        };
        DeviceState {
            core,
            signals,
            streams: KeptStreams::default(),
            parked: Vec::with_capacity(capacity),
            logged: Vec::new(),
            segment_tx: None,
        }
    }

    /// Frees `ptr`; wakes the reaper if the free now waits on events, and the head waiter.
    pub fn free(&mut self, ptr: DevicePtr) {
        free(&mut self.core, &self.signals, ptr, None);
    }

    /// Folds the thread cache into the core (see `thread_cache.rs`): the round trips of
    /// revived blocks go into its totals and parked blocks are freed. One load when no
    /// thread parked or revived anything since the last collection.
    pub fn collect_thread_cache(&mut self) {
        self.fold_thread_cache(false);
    }

    /// [`DeviceState::collect_thread_cache`] over every slot, marked or not: run by a request
    /// that just started waiting for memory, so no block parked before it joined stays
    /// parked (`ThreadSlots::collect_all`).
    pub fn sweep_thread_cache(&mut self) {
        self.fold_thread_cache(true);
    }

    /// Every turn of the gate starts here (`on_acquire`): without a thread cache that is one
    /// check, inline.
    #[inline]
    fn fold_thread_cache(&mut self, all: bool) {
        if self.signals.thread_cache.is_some() {
            self.fold_thread_cache_slots(all);
        }
    }

    fn fold_thread_cache_slots(&mut self, all: bool) {
        let DeviceState {
            core,
            signals,
            parked,
            logged,
            ..
        } = self;
        let Some(cache) = &signals.thread_cache else {
            return;
        };
        let mut trips = RoundTrips::default();
        cache.collect(all, &mut trips, parked, logged);
        if !trips.is_empty() {
            core.account_round_trips(&trips);
        }
        if !logged.is_empty() {
            core.record_beside(logged);
        }
        for p in parked.drain(..) {
            free(core, signals, p.ptr, Some(p.recorded));
        }
    }

    /// Streams whose users dropped them: blocks parked in thread caches go back to the core,
    /// then the core retires the streams (their free segments serve other streams once their
    /// work is done: `gpualloc_devices::orphans`). Run on misses, before a segment is made.
    pub fn retire_dropped_streams(&mut self) {
        let dropped = self.streams.dropped_by_users();
        if !dropped.is_empty() {
            self.sweep_thread_cache();
        }
        for stream in dropped {
            if let Err(e) = self.core.retire_stream(stream) {
                tracing::warn!(?stream, error = %e, "retiring a dropped stream failed");
            }
        }
    }

    /// Lets go of the kept streams the core no longer names, if their number doubled since
    /// the last pass (`streams.rs`); the caller drops them outside the gate.
    pub fn prune_streams_if_grown(&mut self) -> Vec<Stream> {
        if self.streams.wants_prune() {
            self.streams.prune(&self.core)
        } else {
            Vec::new()
        }
    }

    /// Completes frees whose events finished; true while some still wait.
    pub fn reap(&mut self) -> bool {
        match self.core.process_events() {
            Ok(n) if n > 0 => self.signals.waiters.wake_head(),
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(device = self.core.device().0, error = %e, "event query failed")
            }
        }
        self.core.pending_frees() > 0
    }
}

/// Frees `ptr` in `core`; `parked`: a block the thread cache had parked, and whether its park
/// was recorded (`DeviceMsg::FreeParked`).
fn free(core: &mut DeviceCore, signals: &Signals, ptr: DevicePtr, parked: Option<bool>) {
    let pending_before = core.pending_frees();
    let freed = match parked {
        Some(recorded) => core.free_parked(ptr, recorded),
        None => core.free(ptr),
    };
    if let Err(e) = freed {
        // After shutdown every segment went back already; a late free is expected.
        if !core.is_shut_down() {
            tracing::warn!(device = core.device().0, %ptr, error = %e, "free failed");
        }
        return;
    }
    if core.pending_frees() > pending_before {
        signals.reaper.arm();
    }
    signals.waiters.wake_head();
}

impl Actor for DeviceState {
    type Msg = DeviceMsg;

    fn handle(&mut self, msg: DeviceMsg) {
        match msg {
            DeviceMsg::Free(ptr) => self.free(ptr),
            DeviceMsg::FreeParked(p) => {
                free(&mut self.core, &self.signals, p.ptr, Some(p.recorded))
            }
            DeviceMsg::RecordStream(ptr, stream) => {
                match self.core.record_stream(ptr, stream.handle()) {
                    Ok(()) => self.streams.keep(&stream),
                    Err(e) => {
                        if !self.core.is_shut_down() {
                            tracing::warn!(%ptr, error = %e, "record_stream failed");
                        }
                    }
                }
            }
            DeviceMsg::Job(job) => {
                // A request queued behind the gate still sees every block parked before it.
                self.collect_thread_cache();
                job(self)
            }
        }
    }

    fn job(job: Job<Self>) -> DeviceMsg {
        DeviceMsg::Job(job)
    }

    fn on_acquire(&mut self) {
        self.collect_thread_cache();
    }
}
