//! [`DeviceActor`]: one device's actor, shared by the [`Allocator`](crate::Allocator) and
//! every live [`DeviceBuffer`] of that device.
//!
//! A request first tries to take the mailbox's gate and run inline (a cache hit costs one
//! atomic gate acquire, the core's best-fit lookup and one release: no channel, no wake-up).
//! If the gate is busy the request is queued and its future awaits the reply. A miss leaves
//! the gate at once and continues on the blocking pool (`slow.rs`), so hits keep being served
//! while the device allocates.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use gpualloc_devices::{CachedOutcome, DeviceCore, DeviceSnapshot, DeviceStats, SegmentRequest};
use gpualloc_runtime::actor::mailbox::Call;
use gpualloc_runtime::actor::{Mailbox, ReplyFuture, Shutdown};
use gpualloc_runtime::{Backend, DeviceId, Stream};

use crate::actor::state::{DeviceState, Signals};
use crate::buffer::DeviceBuffer;
use crate::error::Error;
use crate::fork::ProcessGuard;

/// Tries of the gate before a request is queued.
const SPINS: usize = 4;

/// Checks of a queued request's reply before its task waits to be woken.
const REPLY_SPINS: usize = 64;

/// Yields to other tasks before a request is queued.
const YIELDS: usize = 0;

/// One device's actor. See the module docs.
pub struct DeviceActor {
    pub(crate) device: DeviceId,
    pub(crate) backend: Arc<dyn Backend>,
    pub(crate) mailbox: Mailbox<DeviceState>,
    pub(crate) signals: Arc<Signals>,
    pub(crate) process: ProcessGuard,
    /// Stops the actor task (not the core: that is `shutdown`).
    pub(crate) stop: Shutdown,
    /// Misses running on the blocking pool.
    pub(crate) misses_in_flight: AtomicUsize,
}

impl std::fmt::Debug for DeviceActor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceActor")
            .field("device", &self.device)
            .finish_non_exhaustive()
    }
}

/// What the cache-only half of a malloc produced.
pub(crate) enum Cached {
    Hit(DeviceBuffer),
    Miss(SegmentRequest),
}

impl DeviceActor {
    pub(crate) fn new(core: DeviceCore, process: ProcessGuard) -> Arc<Self> {
        let signals = Arc::new(Signals::default());
        Arc::new(DeviceActor {
            device: core.device(),
            backend: core.backend().clone(),
            mailbox: Mailbox::new(DeviceState {
                core,
                signals: signals.clone(),
            }),
            signals,
            process,
            stop: Shutdown::new(),
            misses_in_flight: AtomicUsize::new(0),
        })
    }

    /// The device this actor serves.
    pub fn device(&self) -> DeviceId {
        self.device
    }

    /// Misses whose device allocation is running on the blocking pool right now (they finish
    /// even if their request was cancelled, then return the block).
    pub fn misses_in_flight(&self) -> usize {
        self.misses_in_flight.load(Ordering::Acquire)
    }

    /// Number of requests waiting for memory right now.
    pub fn waiting(&self) -> usize {
        self.signals.waiters.len()
    }

    /// Runs `f` on the state: inline if the gate is free, else queued for the holder.
    pub(crate) async fn call<R, F>(&self, f: F) -> Result<R, Error>
    where
        R: Send + 'static,
        F: FnOnce(&mut DeviceState) -> R + Send + 'static,
    {
        match self.mailbox.call(f) {
            Call::Ready(r) => Ok(r),
            Call::Queued(rx) => self.await_reply(rx).await,
        }
    }

    /// Awaits a queued reply. It always comes: holders drain before releasing the gate and
    /// hand leftovers only to a live actor task.
    ///
    /// Flat combining: the holder is usually running our request right now, so first spin
    /// briefly on the reply (or take the gate and run the queue ourselves if it frees up):
    /// this keeps the worker thread hot instead of parking it and being woken again.
    async fn await_reply<R>(&self, rx: ReplyFuture<R>) -> Result<R, Error> {
        for _ in 0..REPLY_SPINS {
            if rx.is_ready() {
                break;
            }
            if !self.mailbox.is_busy() {
                self.mailbox.drain();
            }
            std::hint::spin_loop();
        }
        rx.await
            .ok_or_else(|| Error::Internal("a queued request was dropped".into()))
    }

    /// The cache-only half of a malloc, as a job queued on the state. The buffer is built
    /// inside, so a hit delivered to a cancelled request is dropped and returns its block.
    fn cached_job(
        self: &Arc<Self>,
        size: u64,
        stream: &Stream,
    ) -> impl FnOnce(&mut DeviceState) -> Result<Cached, Error> + Send + 'static {
        let actor = self.clone();
        let stream = stream.clone();
        move |st: &mut DeviceState| match st.core.try_cached(size, stream.handle()) {
            Ok(CachedOutcome::Hit(a)) => Ok(Cached::Hit(DeviceBuffer::new(a, actor, stream))),
            Ok(CachedOutcome::Miss(req)) => Ok(Cached::Miss(req)),
            Err(e) => Err(e.into()),
        }
    }

    /// `malloc` on this device: a hit inline, a miss on the blocking pool.
    pub(crate) async fn malloc(
        self: &Arc<Self>,
        size: u64,
        stream: &Stream,
    ) -> Result<DeviceBuffer, Error> {
        let handle = stream.handle();
        // Fast path: nothing is cloned or allocated while the gate is held, and the gate is
        // held for ~100 ns at a time, so spin briefly before queuing (a queued request costs
        // an allocation, a reply slot and a wake-up).
        let mut attempt = None;
        for _ in 0..SPINS {
            if !self.mailbox.is_busy() {
                if let Ok(r) = self.mailbox.try_run(|st| st.core.try_cached(size, handle)) {
                    attempt = Some(r);
                    break;
                }
            }
            std::hint::spin_loop();
        }
        if attempt.is_none() {
            for _ in 0..YIELDS {
                tokio::task::yield_now().await;
                if let Ok(r) = self.mailbox.try_run(|st| st.core.try_cached(size, handle)) {
                    attempt = Some(r);
                    break;
                }
            }
        }
        let outcome = match attempt {
            Some(Ok(CachedOutcome::Hit(a))) => {
                Cached::Hit(DeviceBuffer::new(a, self.clone(), stream.clone()))
            }
            Some(Ok(CachedOutcome::Miss(req))) => Cached::Miss(req),
            Some(Err(e)) => return Err(e.into()),
            None => self.call(self.cached_job(size, stream)).await??,
        };
        match outcome {
            Cached::Hit(buf) => Ok(buf),
            Cached::Miss(req) => {
                let actor = self.clone();
                let stream = stream.clone();
                // The blocking task runs to completion even if this future is dropped; its
                // buffer is then dropped there and returns the block: nothing leaks.
                self.misses_in_flight.fetch_add(1, Ordering::AcqRel);
                tokio::task::spawn_blocking(move || {
                    let r = actor.miss_blocking(req, stream);
                    actor.misses_in_flight.fetch_sub(1, Ordering::AcqRel);
                    r
                })
                .await
                .map_err(|e| Error::Internal(format!("malloc task failed: {e}")))?
            }
        }
    }

    /// `malloc`, waiting up to `timeout` (first come, first served) for frees to make room
    /// when the device is full. On timeout: the same out-of-memory error as without waiting.
    pub(crate) async fn malloc_waiting(
        self: &Arc<Self>,
        size: u64,
        stream: &Stream,
        timeout: Duration,
    ) -> Result<DeviceBuffer, Error> {
        let deadline = tokio::time::Instant::now() + timeout;
        let waiters = &self.signals.waiters;
        // Queue behind requests already waiting, so they are served first.
        let mut turn = if waiters.is_empty() {
            None
        } else {
            Some(waiters.join())
        };
        loop {
            if let Some(t) = &turn {
                if tokio::time::timeout_at(deadline, t.wait()).await.is_err() {
                    // Out of time: one last try, whose error is the one to report.
                    let last = self.malloc(size, stream).await;
                    drop(turn);
                    return last;
                }
            }
            match self.malloc(size, stream).await {
                Ok(buf) => {
                    if let Some(t) = turn {
                        t.finish();
                    }
                    return Ok(buf);
                }
                Err(e) if e.is_oom() => {
                    if tokio::time::Instant::now() >= deadline {
                        return Err(e);
                    }
                    if turn.is_none() {
                        let _span =
                            tracing::debug_span!("malloc_wait", device = self.device.0, size)
                                .entered();
                        tracing::debug!(
                            device = self.device.0,
                            size,
                            "out of memory: waiting for frees"
                        );
                        turn = Some(waiters.join());
                    }
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Statistics of this device.
    pub(crate) async fn stats(&self) -> Result<DeviceStats, Error> {
        self.call(|st| st.core.stats().clone()).await
    }

    /// Segments and blocks of this device.
    pub(crate) async fn snapshot(&self) -> Result<DeviceSnapshot, Error> {
        self.call(|st| st.core.snapshot()).await
    }
}
