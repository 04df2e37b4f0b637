//! [`DeviceActor`]: one device's actor, shared by the [`Allocator`](crate::Allocator) and
//! every live [`DeviceBuffer`] of that device.
//!
//! A request first looks in the calling thread's slot of the thread cache (`thread_cache.rs`):
//! a block this thread freed with the same size on the same stream comes back without the
//! gate. Otherwise it tries to take the mailbox's gate and runs inline (a cache hit costs one
//! atomic gate acquire, the core's best-fit lookup and one release: no channel, no wake-up).
//! If the gate is busy the request is queued and its future awaits the reply. A miss leaves
//! the gate at once and continues on the blocking pool (`slow.rs`), so hits keep being served
//! while the device allocates. Its queries and the jobs drops post are in `queries.rs`.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use gpualloc_actor::landing::{CancelOnDrop, Landing, LandingOwner};
use gpualloc_actor::mailbox::Call;
use gpualloc_actor::{Mailbox, ReplySpin, Shutdown};
use gpualloc_devices::{
    AllocError, Allocation, CachedOutcome, DeviceCore, MemPoolId, SegmentRequest,
};
use gpualloc_runtime::{Backend, DeviceId, LostWatch, Stream, StreamHandle};

use crate::actor::state::{DetachedFreeGuard, DeviceMsg, DeviceState, Signals};
use crate::actor::thread_cache::{Park, ParkedFree, Revived, ThreadCache};
use crate::buffer::DeviceBuffer;
use crate::error::Error;
use crate::fork::ProcessGuard;
use crate::history::HISTORY_OFF;
use crate::history_frames::recording;

/// Tries of the gate, with exponential backoff (1, 2, 4 ... 128 pauses: a few microseconds in
/// all), before a request is queued. Backing off keeps waiting threads from stealing the
/// gate's and the core's cache lines from the holder: it roughly doubled the aggregate
/// throughput of 64 contending tasks on two cores.
const SPINS: usize = 24;

/// Checks of a queued request's reply before its task waits to be woken, with doubling
/// pauses (`Mailbox::await_reply`).
const REPLY_SPIN: ReplySpin = ReplySpin {
    rounds: 12,
    doubling: true,
};

/// A request that ran out of memory while other misses were in flight waits for them to land
/// (their memory, if their requests were cancelled, lands in the cache) and retries: at most
/// this many times...
const LANDING_RETRIES: usize = 3;

/// ...each waiting at most this long for the misses in flight to land.
const LANDING_WAIT: Duration = Duration::from_secs(5);

/// One device's actor. See the module docs.
pub struct DeviceActor {
    pub(crate) device: DeviceId,
    /// The core's backend: the user's, its unsafe calls made in relaxed capture mode
    /// (`gpualloc_runtime::CaptureSafe`). Every driver call of the actor goes through it.
    pub(crate) backend: Arc<dyn Backend>,
    /// The user's backend as given: what the user's streams name (a stream is checked
    /// against it), and where calls that cannot touch a capture go directly (the hit path's
    /// lost-device check: a layer less than `backend`).
    pub(crate) user_backend: Arc<dyn Backend>,
    /// How the hit paths learn that this device was lost (`Backend::lost_watch`).
    lost: LostWatch,
    pub(crate) mailbox: Mailbox<DeviceState>,
    pub(crate) signals: Arc<Signals>,
    pub(crate) process: ProcessGuard,
    /// Stops the actor task (not the core: that is `shutdown`).
    pub(crate) stop: Shutdown,
    /// Misses running on the blocking pool, and the notice of their landing.
    pub(crate) misses: Arc<MissesInFlight>,
    /// The runtime the allocator was built in: slow work goes to its blocking pool, so a
    /// request made from outside any runtime still works (and never panics).
    pub(crate) runtime: tokio::runtime::Handle,
}

impl std::fmt::Debug for DeviceActor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceActor")
            .field("device", &self.device)
            .finish_non_exhaustive()
    }
}

/// A malloc's attempt made without waiting (`DeviceActor::try_malloc`), or its queued lookup
/// (`DeviceActor::cached_job`, never `Busy`).
pub(crate) enum Attempt {
    Hit(DeviceBuffer),
    Failed(Error),
    /// The cache had no block: the request for a segment.
    Miss(SegmentRequest),
    /// The gate stayed busy: queue the lookup.
    Busy,
}

impl DeviceActor {
    pub(crate) fn new(
        core: DeviceCore,
        user_backend: Arc<dyn Backend>,
        process: ProcessGuard,
        runtime: tokio::runtime::Handle,
    ) -> Arc<Self> {
        // Garbage collection ages cached blocks by the core's own lookups, which round trips
        // beside it would skip: the thread cache stays off with it. So it does with the
        // `debug_cross_stream_frees` check, which the core makes on every free.
        let config = core.config();
        let thread_cache = (config.thread_cache
            && config.garbage_collection_threshold == 0.0
            && !config.debug_cross_stream_frees)
            .then(|| ThreadCache::new(core.trace_sequence()));
        let signals = Arc::new(Signals {
            thread_cache,
            ..Signals::default()
        });
        Arc::new(DeviceActor {
            device: core.device(),
            backend: core.backend().clone(),
            lost: user_backend.lost_watch(core.device()),
            user_backend,
            mailbox: Mailbox::new(DeviceState::new(core, signals.clone())),
            signals,
            process,
            stop: Shutdown::new(),
            misses: Arc::new(MissesInFlight::default()),
            runtime,
        })
    }

    /// Misses whose driver calls are running on the blocking pool right now (they finish
    /// even if their request was cancelled, then return the block), and releases off the gate
    /// outside any miss (a cache release, a graph pool's: `DeviceActor::release_in_flight`).
    pub fn misses_in_flight(&self) -> usize {
        self.misses.count.load(Ordering::Acquire)
    }

    /// Runs `f` on the state: inline if the gate is free, else queued for the holder.
    pub(crate) async fn call<R, F>(&self, f: F) -> Result<R, Error>
    where
        R: Send + 'static,
        F: FnOnce(&mut DeviceState) -> R + Send + 'static,
    {
        match self.mailbox.call(f) {
            Call::Ready(r) => Ok(r),
            Call::Queued(rx) => self
                .mailbox
                .await_reply(rx, REPLY_SPIN)
                .await
                .ok_or_else(|| Error::Internal("a queued request was dropped".into())),
        }
    }

    /// The cache-only half of a malloc, as a job queued on the state. The buffer is built
    /// inside, so a hit delivered to a cancelled request is dropped and returns its block.
    fn cached_job(
        self: &Arc<Self>,
        size: u64,
        stream: &Stream,
        pool: Option<MemPoolId>,
    ) -> impl FnOnce(&mut DeviceState) -> Attempt + Send + 'static {
        let actor = self.clone();
        let stream = stream.clone();
        move |st: &mut DeviceState| {
            let looked = cached(&mut st.core, size, stream.handle(), pool);
            actor.attempt_of(looked, &stream)
        }
    }

    /// What a cache lookup came to, as an attempt of a malloc on `stream`.
    fn attempt_of(
        self: &Arc<Self>,
        looked: Result<CachedOutcome, AllocError>,
        stream: &Stream,
    ) -> Attempt {
        match looked {
            Ok(CachedOutcome::Hit(a)) => {
                Attempt::Hit(DeviceBuffer::new(a, self.clone(), stream.clone()))
            }
            Ok(CachedOutcome::Miss(req)) => Attempt::Miss(req),
            Err(e) => Attempt::Failed(e.into()),
        }
    }

    /// `malloc` on this device: a hit inline, a miss on the blocking pool. Out of memory (or a
    /// pool's quota) while other misses or releases are in flight: wait for them to land and
    /// retry (bounded by `LANDING_RETRIES` × `LANDING_WAIT`, [`DeviceActor::may_land`]). The
    /// out-of-memory report counts the bytes other misses are obtaining (`OomReport::in_flight`). A failure is not counted here
    /// (`SegmentRequest::quiet_oom`): the facade counts the one its user sees
    /// ([`DeviceActor::count_oom`], `oom.rs`), however often the request was tried (here, and
    /// by a malloc waiting for memory, `wait.rs`).
    pub(crate) async fn malloc(
        self: &Arc<Self>,
        size: u64,
        stream: &Stream,
        pool: Option<MemPoolId>,
    ) -> Result<DeviceBuffer, Error> {
        // A hit is served without a future of its own: what the other paths hold across
        // their awaits (a reply slot, a landing, a blocking task's handle, a timer) lives in
        // a box they allocate, so every request's future stays small and a hit does not pay
        // to move a large one (640 bytes before, `bench hit` in BENCHMARKS.md).
        if let Some(buf) = self.revive(size, stream, pool) {
            return Ok(buf);
        }
        self.malloc_past_thread_cache(size, stream, pool).await
    }

    /// [`DeviceActor::malloc`] after [`DeviceActor::revive`] found nothing: the gate's
    /// attempt, and the rest boxed.
    pub(crate) async fn malloc_past_thread_cache(
        self: &Arc<Self>,
        size: u64,
        stream: &Stream,
        pool: Option<MemPoolId>,
    ) -> Result<DeviceBuffer, Error> {
        match self.try_malloc(size, stream, pool) {
            Attempt::Hit(buf) => Ok(buf),
            first => Box::pin(self.malloc_from(first, size, stream, pool)).await,
        }
    }

    /// [`DeviceActor::malloc`] after its first attempt.
    pub(crate) async fn malloc_from(
        self: &Arc<Self>,
        first: Attempt,
        size: u64,
        stream: &Stream,
        pool: Option<MemPoolId>,
    ) -> Result<DeviceBuffer, Error> {
        let mut attempt = Some(first);
        let mut retries = 0;
        loop {
            let this = match attempt.take() {
                Some(a) => a,
                None => match self.revive(size, stream, pool) {
                    Some(buf) => Attempt::Hit(buf),
                    None => self.try_malloc(size, stream, pool),
                },
            };
            let r = self.finish_attempt(this, size, stream, pool).await;
            let wait = match &r {
                Err(e) => retries < LANDING_RETRIES && self.may_land(e),
                Ok(_) => false,
            };
            if !wait {
                return r;
            }
            drop(r);
            retries += 1;
            tracing::debug!(
                device = self.device.0,
                size,
                in_flight = self.misses_in_flight(),
                "out of memory with misses in flight: waiting for them to land"
            );
            self.until_misses_land().await;
        }
    }

    /// True when `error` may not hold once the misses and releases in flight land: out of
    /// memory short of the device's own size, with some in flight (or a release in flight at
    /// the failure, which may have landed since: one more try then); or a pool's quota with
    /// some in flight, or some of the pool's memory on its way at the failure (the quota
    /// counts memory on its way in and out, so a request made while the pool's own release is
    /// under way meets it until that ends).
    fn may_land(&self, error: &Error) -> bool {
        match error {
            Error::Alloc(AllocError::PoolQuota { in_flight, .. }) => {
                self.misses_in_flight() > 0 || *in_flight > 0
            }
            _ => error.oom_report().is_some_and(|r| {
                !r.exceeds_device() && (self.misses_in_flight() > 0 || r.releasing > 0)
            }),
        }
    }

    /// Counts `error`, the out-of-memory error a malloc on `stream` failed with, in the core
    /// (`DeviceCore::count_oom`: `num_ooms`, an `oom` history entry, a warning). `malloc`'s
    /// attempts mark their requests so the core does not count them itself. Only the error
    /// path pays this gate turn.
    pub(crate) async fn count_oom(&self, error: &AllocError, stream: &Stream) {
        let (error, handle) = (error.clone(), stream.handle());
        // A core that shut down meanwhile has no statistics left to count in.
        let _ = self.call(move |st| st.core.count_oom(&error, handle)).await;
    }

    /// Waits until no miss is in flight, or `LANDING_WAIT` passed. Works from any executor:
    /// the timer is registered with the allocator's runtime.
    async fn until_misses_land(&self) {
        let deadline = tokio::time::Instant::now() + LANDING_WAIT;
        let mut sleep = {
            let _in_runtime = self.runtime.enter();
            Box::pin(tokio::time::sleep_until(deadline))
        };
        loop {
            let landed = self.misses.landed.notified();
            tokio::pin!(landed);
            // Registered before the check, so a landing in between is not missed.
            landed.as_mut().enable();
            if self.misses_in_flight() == 0 {
                return;
            }
            tokio::select! {
                _ = &mut landed => {}
                _ = &mut sleep => return,
            }
        }
    }

    /// The thread-cache half of a malloc: a block this thread parked with the same size on
    /// the same stream, handed back without the gate. `None` when the cache has none (or is
    /// off, or the request is for a named pool, or the device is lost: the gate's attempt
    /// reports that). The hottest path: the facade calls it before anything else, so a hit
    /// returns without building an [`Attempt`] or a future of its own.
    #[inline]
    pub(crate) fn revive(
        self: &Arc<Self>,
        size: u64,
        stream: &Stream,
        pool: Option<MemPoolId>,
    ) -> Option<DeviceBuffer> {
        // The thread cache holds default-pool blocks only (`release`), and serves none while
        // a capture is under way: its requests go to a graph pool (`graph.rs`).
        let cache = self.signals.thread_cache.as_ref()?;
        if pool.is_some() || self.signals.captures.load(Ordering::Acquire) != 0 {
            return None;
        }
        // A lost device (a sticky error: its context does no more work) hands out nothing,
        // cached blocks included: their memory may be what the faulting kernel corrupted, and
        // no work on it could run anyway. (One load of the backend's lost-device cell, or
        // nothing on a backend that never loses a device: `LostWatch`.)
        if self.lost.is_lost(&*self.user_backend, self.device) {
            return None;
        }
        // While recording, a revive writes its `alloc` entry into the thread's slot
        // (`history.rs`): out of line, so the quiet path carries none of it.
        let level = self.signals.history.load(Ordering::Relaxed);
        if level != HISTORY_OFF {
            return self.revive_recorded(cache, size, stream, level);
        }
        let revived = cache.revive(self, size, stream.handle(), None);
        self.hand_out(revived, stream)
    }

    /// [`DeviceActor::revive`] while the history is recorded at `level`.
    #[cold]
    #[inline(never)]
    fn revive_recorded(
        self: &Arc<Self>,
        cache: &ThreadCache<DeviceActor>,
        size: u64,
        stream: &Stream,
        level: u8,
    ) -> Option<DeviceBuffer> {
        let make = || recording(level, true);
        let revived = cache.revive(self, size, stream.handle(), Some(&make));
        self.hand_out(revived, stream)
    }

    /// What a revive found, as a buffer for `stream`: a block taken after the thread cache
    /// closed goes back to the core.
    #[inline]
    fn hand_out(&self, revived: Revived<DeviceActor>, stream: &Stream) -> Option<DeviceBuffer> {
        match revived {
            Revived::Hit(a, lane) => Some(DeviceBuffer::revived(a, lane, stream.clone())),
            Revived::Free(ptr) => {
                let recorded = false; // its entries went with the slot's log
                self.mailbox
                    .post(DeviceMsg::FreeParked(ParkedFree { ptr, recorded }));
                None
            }
            Revived::Miss => None,
        }
    }

    /// The part of a malloc that never waits, after [`DeviceActor::revive`]: a lost device's
    /// error, or the cache lookup under the gate when it is free within a few spins.
    pub(crate) fn try_malloc(
        self: &Arc<Self>,
        size: u64,
        stream: &Stream,
        pool: Option<MemPoolId>,
    ) -> Attempt {
        if self.lost.is_lost(&*self.user_backend, self.device) {
            if let Some(lost) = self.user_backend.device_lost(self.device) {
                return Attempt::Failed(lost.into());
            }
        }
        let handle = stream.handle();
        // Fast path: nothing is cloned or allocated while the gate is held, and the gate is
        // held for ~100 ns at a time, so spin (with backoff) before queuing: a queued request
        // costs an allocation, a reply slot and maybe a wake-up.
        let mut attempt = None;
        for round in 0..SPINS {
            if !self.mailbox.is_busy() {
                if let Ok(r) = self
                    .mailbox
                    .try_run(|st| cached(&mut st.core, size, handle, pool))
                {
                    attempt = Some(r);
                    break;
                }
            }
            for _ in 0..(1u32 << round.min(7)) {
                std::hint::spin_loop();
            }
        }
        match attempt {
            Some(looked) => self.attempt_of(looked, stream),
            None => Attempt::Busy,
        }
    }

    /// The rest of a malloc after [`DeviceActor::try_malloc`]: the queued lookup when the
    /// gate was busy, the miss.
    async fn finish_attempt(
        self: &Arc<Self>,
        attempt: Attempt,
        size: u64,
        stream: &Stream,
        pool: Option<MemPoolId>,
    ) -> Result<DeviceBuffer, Error> {
        let mut attempt = attempt;
        loop {
            match attempt {
                Attempt::Hit(buf) => return Ok(buf),
                Attempt::Failed(e) => return Err(e),
                Attempt::Miss(req) => return self.miss(req, stream).await,
                // The queued lookup never comes back busy.
                Attempt::Busy => attempt = self.call(self.cached_job(size, stream, pool)).await?,
            }
        }
    }

    /// A miss: the chain runs on the blocking pool, its result lands here (or back in the
    /// cache if this future was dropped meanwhile).
    async fn miss(
        self: &Arc<Self>,
        mut req: SegmentRequest,
        stream: &Stream,
    ) -> Result<DeviceBuffer, Error> {
        // Out of memory is counted once per user request, by the facade (`oom.rs`).
        req.quiet_oom();
        let actor = self.clone();
        let stream = stream.clone();
        // The blocking task runs to completion even if this future is dropped; the landing
        // then returns its block to the cache (never to a user): nothing leaks. Until it lands
        // its bytes count as in flight, and requests that run out of memory meanwhile wait
        // for it (`malloc`; `gpualloc_actor::landing`).
        let landing = Landing::new(self.misses.clone());
        let mut guard = CancelOnDrop(Some(landing.clone()));
        let task = landing.clone();
        let joined = self
            .runtime
            .spawn_blocking(move || task.deliver(actor.miss_blocking(req, stream)))
            .await;
        guard.0 = None;
        let taken = landing.take();
        joined.map_err(|e| Error::Internal(format!("malloc task failed: {e}")))?;
        taken.unwrap_or_else(|| Err(Error::Internal("a miss delivered nothing".into())))
    }

    /// Takes back a dropped buffer's block: parked in the calling thread's slot of the thread
    /// cache when it may be (see `thread_cache.rs`), else freed through the mailbox. Never
    /// blocks.
    pub(crate) fn release(&self, a: Allocation, used_elsewhere: bool) {
        if let Some(cache) = &self.signals.thread_cache {
            // A private pool's block goes back to its pool through the core: a parked block
            // could be revived for a request of another pool.
            if !used_elsewhere && self.signals.waiters.is_empty() && a.pool.is_none() {
                // While recording, the park writes the free's entries into the thread's
                // slot (`history.rs`).
                let level = self.signals.history.load(Ordering::Relaxed);
                let record = (level != HISTORY_OFF).then(|| recording(level, false));
                match cache.park(a, record) {
                    Park::Declined(a) => self.mailbox.post(DeviceMsg::Free(a.ptr)),
                    Park::Parked { evicted, flush } => {
                        if let Some(old) = evicted {
                            self.mailbox.post(DeviceMsg::FreeParked(old));
                        }
                        if flush {
                            // Any job collects the thread cache first (`state.rs`).
                            self.mailbox.post(DeviceMsg::Job(Box::new(|_| {})));
                        }
                    }
                }
                // A request that starts waiting for memory sweeps every slot right after it
                // joined (`wait.rs`), and so does the start of a history recording
                // (`history.rs`). If its sweep locked this slot before the park, this check
                // sees it (the slot's mutex orders the two): free the parked blocks through
                // the core, whose frees wake the waiter, and a block parked unrecorded
                // does not stay parked into the recording.
                let started = level == HISTORY_OFF
                    && self.signals.history.load(Ordering::Relaxed) != HISTORY_OFF;
                if !self.signals.waiters.is_empty() || started {
                    for p in cache.unpark_mine() {
                        self.mailbox.post(DeviceMsg::FreeParked(p));
                    }
                }
                return;
            }
        }
        self.mailbox.post(DeviceMsg::Free(a.ptr));
    }
}

/// The cache lookup of a request of `pool` (`None`: the default pools).
fn cached(
    core: &mut DeviceCore,
    size: u64,
    stream: StreamHandle,
    pool: Option<MemPoolId>,
) -> Result<CachedOutcome, AllocError> {
    match pool {
        Some(p) => core.try_cached_in(p, size, stream),
        None => core.try_cached(size, stream),
    }
}

/// Misses in flight: counted while they run on the blocking pool, and announced to requests
/// that ran out of memory meanwhile when they land (`DeviceActor::malloc`). A type of its own,
/// private to the actor, so nothing but a miss's landing, or a release's end
/// ([`ReleaseInFlight`]), counts or announces one.
#[derive(Default)]
pub(crate) struct MissesInFlight {
    count: AtomicUsize,
    /// Notified whenever a miss lands (succeeds or fails).
    landed: tokio::sync::Notify,
}

impl LandingOwner for MissesInFlight {
    fn started(&self) {
        self.count.fetch_add(1, Ordering::AcqRel);
    }

    fn landed(&self) {
        self.count.fetch_sub(1, Ordering::AcqRel);
        self.landed.notify_waiters();
    }
}

/// A release made off the gate outside any miss (a cache release's frees and unmaps, a graph
/// pool's frees), counted with the misses in flight until dropped
/// ([`DeviceActor::release_in_flight`]).
pub(crate) struct ReleaseInFlight<'a>(&'a MissesInFlight);

/// A batch of detached segments on its way back to the device, in both counts that wait for
/// it until dropped ([`DeviceActor::segment_frees_begin`]).
pub(crate) struct SegmentFreesInFlight<'a> {
    /// Shutdown waits for it (`Signals::detached_frees`).
    _shutdown: DetachedFreeGuard<'a>,
    /// A request out of memory meanwhile waits for it.
    _release: ReleaseInFlight<'a>,
}

impl Drop for ReleaseInFlight<'_> {
    fn drop(&mut self) {
        self.0.landed();
    }
}

impl DeviceActor {
    /// Counts a release off the gate with the misses in flight until the guard is dropped:
    /// the memory it gives back counts against `per_process_memory_fraction` until its
    /// driver calls return and the core books them (`DeviceCore::releasing_bytes`), so a
    /// request that runs out of memory meanwhile waits for it and tries again, as it waits for
    /// a miss. Take it in the step that takes the memory out of the books; drop it after the
    /// step that books the release's end.
    pub(crate) fn release_in_flight(&self) -> ReleaseInFlight<'_> {
        self.misses.started();
        ReleaseInFlight(&self.misses)
    }

    /// For the step that detached segments to free off the gate (`detached`, when it holds
    /// some): the batch counts for shutdown and as a release in flight until the guard is
    /// dropped, after the step that books the frees' end.
    pub(crate) fn segment_frees_begin<T, E>(
        &self,
        detached: &Result<Vec<T>, E>,
    ) -> Option<SegmentFreesInFlight<'_>> {
        let shutdown = self.signals.detached_frees.begin_if_any(detached)?;
        Some(SegmentFreesInFlight {
            _shutdown: shutdown,
            _release: self.release_in_flight(),
        })
    }
}
