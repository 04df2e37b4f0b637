//! [`AsyncRegistry`]: asynchronous registration (seed §3.2) around the [`IntervalCache`].
//!
//! `register` records the registration's metadata in the cache at once (so `query` already
//! answers, with `ready: false`) and returns a [`PendingRegistration`]: a future that resolves
//! when the whole range is usable. The backend calls run on tokio's blocking pool
//! (`spawn_blocking`), never on an async worker thread, so a slow registration (hundreds of
//! milliseconds for a fragmented 512 MiB range, seed §2.1) does not stall other tasks.
//!
//! Concurrent registrations of the same range share one backend call: the second finds the
//! range in the cache, still in flight, and waits on the first call's shared completion (a
//! `tokio::sync::watch` channel, any number of waiters). A registration that overlaps a range
//! whose unregister is still in flight waits for that unregister before registering.
//!
//! The cache is updated by the background task itself, before it signals completion, so
//! dropping a [`PendingRegistration`] cancels nothing: the registration stays recorded until
//! it is released (its id is available before awaiting: [`PendingRegistration::id`]). When a
//! backend call fails, every registration sharing the range resolves to the error and is
//! dropped from the cache; the parts of them already registered are unregistered.
//!
//! [`RegistrationMode::Inline`] makes the same backend calls on the caller's task instead of
//! the blocking pool: it exists to measure what the blocking pool buys (benches/register.rs),
//! and needs its future polled to completion.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::ops::Range;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::Duration;

use gpualloc_runtime::{Backend, HostRegisterFlags};
use tokio::runtime::Handle;
use tokio::sync::watch;

use super::error::{RegisterError, RegisterResult};
use super::exec::{self, DEFAULT_SLOW_THRESHOLD};
use super::fork::ProcessGuard;
use super::interval_cache::{
    BackendRange, IntervalCache, RangeDone, RegistrationId, RegistrationInfo,
};
use super::stats::{RegistryStats, SlowRegistration};

/// Where the backend calls run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RegistrationMode {
    /// On tokio's blocking pool (the default).
    #[default]
    Background,
    /// On the task that awaits the [`PendingRegistration`] (for comparison only).
    Inline,
}

/// How an [`AsyncRegistry`] runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AsyncOptions {
    /// Where the backend calls run (default: the blocking pool).
    pub mode: RegistrationMode,
    /// Backend registrations at least this slow are logged (`warn`) with the number of OS
    /// mappings their range crosses (default: 10 ms).
    pub slow_threshold: Duration,
}

impl Default for AsyncOptions {
    fn default() -> Self {
        AsyncOptions {
            mode: RegistrationMode::Background,
            slow_threshold: DEFAULT_SLOW_THRESHOLD,
        }
    }
}

/// A shared completion: `None` while in flight, then the result.
type Done = watch::Receiver<Option<RegisterResult<()>>>;
type DoneTx = watch::Sender<Option<RegisterResult<()>>>;
type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

struct State {
    cache: IntervalCache,
    /// Backend registrations in flight, by range start.
    pending: HashMap<u64, Done>,
    /// Backend unregisters in flight: start -> (end, completion).
    unregistering: BTreeMap<u64, (u64, Done)>,
    stats: RegistryStats,
}

struct Inner {
    backend: Arc<dyn Backend>,
    handle: Handle,
    mode: RegistrationMode,
    slow_threshold: Duration,
    process: ProcessGuard,
    state: Mutex<State>,
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Drop for Inner {
    /// Unregisters every backend range still held (not in a forked child). Background tasks
    /// hold the `Inner`, so none is in flight here.
    fn drop(&mut self) {
        if self.process.is_forked() {
            return;
        }
        let ranges = self.lock().cache.drain();
        let mut calls = 0;
        for r in ranges {
            // SAFETY: the registry is dropped: `register`'s contract has no copy pending.
            if let Err(e) = unsafe { exec::unregister(&*self.backend, &r, &mut calls) } {
                tracing::warn!(error = %e, "unregister at registry drop failed");
            }
        }
    }
}

/// Registers existing host memory without blocking the async runtime. Cheap to clone.
#[derive(Clone)]
pub struct AsyncRegistry {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for AsyncRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AsyncRegistry")
            .field("backend", &self.inner.backend.name())
            .field("mode", &self.inner.mode)
            .finish()
    }
}

/// Waits for a shared completion.
async fn wait(mut rx: Done) -> RegisterResult<()> {
    match rx.wait_for(Option::is_some).await {
        Ok(v) => v.clone().unwrap_or(Ok(())),
        Err(_) => Err(RegisterError::TaskFailed(
            "the task completing it ended without a result".into(),
        )),
    }
}

/// The future of one registration: resolves to its id when the whole range is usable.
pub struct PendingRegistration {
    id: RegistrationId,
    fut: BoxFuture<RegisterResult<RegistrationId>>,
}

impl std::fmt::Debug for PendingRegistration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PendingRegistration")
            .field("id", &self.id)
            .finish()
    }
}

impl PendingRegistration {
    /// The registration's id, valid at once (release it even if the future is dropped).
    pub fn id(&self) -> RegistrationId {
        self.id
    }
}

impl Future for PendingRegistration {
    type Output = RegisterResult<RegistrationId>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.fut.as_mut().poll(cx)
    }
}

/// The future of one release: resolves when the backend ranges it freed are unregistered.
pub struct PendingRelease {
    fut: BoxFuture<RegisterResult<()>>,
}

impl std::fmt::Debug for PendingRelease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PendingRelease").finish()
    }
}

impl Future for PendingRelease {
    type Output = RegisterResult<()>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.fut.as_mut().poll(cx)
    }
}

impl AsyncRegistry {
    /// A registry over `backend` running its backend calls on the current tokio runtime's
    /// blocking pool. [`RegisterError::NoRuntime`] outside a runtime.
    pub fn new(backend: Arc<dyn Backend>) -> RegisterResult<Self> {
        Self::with_mode(backend, RegistrationMode::Background)
    }

    /// Like [`AsyncRegistry::new`], choosing where backend calls run.
    pub fn with_mode(backend: Arc<dyn Backend>, mode: RegistrationMode) -> RegisterResult<Self> {
        Self::with_options(
            backend,
            AsyncOptions {
                mode,
                ..AsyncOptions::default()
            },
        )
    }

    /// Like [`AsyncRegistry::new`], with all options.
    pub fn with_options(backend: Arc<dyn Backend>, options: AsyncOptions) -> RegisterResult<Self> {
        let handle = Handle::try_current().map_err(|_| RegisterError::NoRuntime)?;
        Ok(AsyncRegistry {
            inner: Arc::new(Inner {
                backend,
                handle,
                mode: options.mode,
                slow_threshold: options.slow_threshold,
                process: ProcessGuard::new(),
                state: Mutex::new(State {
                    cache: IntervalCache::new(crate::page_size()),
                    pending: HashMap::new(),
                    unregistering: BTreeMap::new(),
                    stats: RegistryStats::default(),
                }),
            }),
        })
    }

    /// Records a registration of `ptr..ptr + len` (rounded out to pages) at once and returns
    /// the future that resolves when it is usable. Bad input and flag conflicts fail here,
    /// with the same errors as [`super::HostRegistry::register`]; backend failures resolve
    /// the future to an error.
    ///
    /// # Safety
    /// The range is memory of this process that stays mapped while any registration covers
    /// it, and no copy queued on it is still pending when the last registration covering it
    /// is released (or the registry dropped): the driver copies into a registered range by
    /// address, later (see [`gpualloc_runtime::Backend::host_register`]).
    pub unsafe fn register(
        &self,
        ptr: *const u8,
        len: u64,
        flags: HostRegisterFlags,
    ) -> RegisterResult<PendingRegistration> {
        self.inner.process.check()?;
        let inner = &self.inner;
        let mut jobs: Vec<BoxFuture<()>> = Vec::new();
        let mut waits = Vec::new();
        let id = {
            let mut st = inner.lock();
            let plan = st.cache.plan_register(ptr as u64, len, flags)?;
            if plan.new_ranges.is_empty() {
                st.stats.cache_hits += 1;
            }
            for s in &plan.wait_on {
                if let Some(rx) = st.pending.get(s) {
                    waits.push(rx.clone());
                }
            }
            for range in plan.new_ranges {
                let deps: Vec<Done> = st
                    .unregistering
                    .range(..range.end)
                    .filter(|(_, (end, _))| *end > range.start)
                    .map(|(_, (_, rx))| rx.clone())
                    .collect();
                let (tx, rx) = watch::channel(None);
                st.pending.insert(range.start, rx.clone());
                waits.push(rx);
                let job = register_job(inner.clone(), range, flags, deps, tx);
                match inner.mode {
                    RegistrationMode::Background => {
                        inner.handle.spawn(job);
                    }
                    RegistrationMode::Inline => jobs.push(Box::pin(job)),
                }
            }
            plan.id
        };
        let inner = inner.clone();
        Ok(PendingRegistration {
            id,
            fut: Box::pin(async move {
                for job in jobs {
                    job.await;
                }
                let mut result = Ok(id);
                for rx in waits {
                    if let Err(e) = wait(rx).await {
                        result = result.and(Err(e));
                    }
                }
                if result.is_ok() {
                    inner.lock().stats.registrations += 1;
                }
                result
            }),
        })
    }

    /// Releases registration `id` at once (releasing twice is
    /// [`RegisterError::UnknownRegistration`]); the returned future resolves when the backend
    /// ranges it was the last user of are unregistered (awaiting it is optional).
    pub fn release(&self, id: RegistrationId) -> RegisterResult<PendingRelease> {
        self.inner.process.check()?;
        let dones = {
            let mut st = self.inner.lock();
            let undo = st.cache.release(id)?;
            st.stats.releases += 1;
            start_unregisters(&self.inner, &mut st, undo)
        };
        Ok(PendingRelease {
            fut: Box::pin(async move {
                let mut result = Ok(());
                for rx in dones {
                    if let Err(e) = wait(rx).await {
                        result = result.and(Err(e));
                    }
                }
                result
            }),
        })
    }

    /// The registration covering `ptr` (`ready: false` while its backend call is in flight),
    /// from the cache alone. `None` when nothing covers it, or in a forked child.
    pub fn query(&self, ptr: *const u8) -> Option<RegistrationInfo> {
        if self.inner.process.is_forked() {
            return None;
        }
        self.inner.lock().cache.query(ptr as u64)
    }

    /// What registration `id` covers, or `None` when it is not live.
    pub fn info(&self, id: RegistrationId) -> Option<RegistrationInfo> {
        self.inner.lock().cache.info(id)
    }

    /// The backend registrations the cache holds (registered or in flight), ascending.
    pub fn backend_ranges(&self) -> Vec<BackendRange> {
        self.inner.lock().cache.backend_ranges()
    }

    /// Backend calls (registers and unregisters) in flight.
    pub fn in_flight(&self) -> usize {
        let st = self.inner.lock();
        st.pending.len() + st.unregistering.len()
    }

    /// Counters since creation.
    pub fn stats(&self) -> RegistryStats {
        self.inner.lock().stats.clone()
    }
}

/// Moves `ranges` (already removed from the cache) to the in-flight unregister table and
/// spawns their backend calls; returns their completions.
fn start_unregisters(inner: &Arc<Inner>, st: &mut State, ranges: Vec<Range<u64>>) -> Vec<Done> {
    let mut dones = Vec::new();
    for range in ranges {
        let (tx, rx) = watch::channel(None);
        st.unregistering
            .insert(range.start, (range.end, rx.clone()));
        dones.push(rx);
        inner.handle.spawn(unregister_job(inner.clone(), range, tx));
    }
    dones
}

/// Registers one backend range, then records the outcome in the cache and signals it.
async fn register_job(
    inner: Arc<Inner>,
    range: Range<u64>,
    flags: HostRegisterFlags,
    deps: Vec<Done>,
    tx: DoneTx,
) {
    for d in deps {
        let _ = wait(d).await;
    }
    let call = {
        let backend = inner.backend.clone();
        let range = range.clone();
        let slow = inner.slow_threshold;
        move || {
            let mut calls = 0;
            // SAFETY: a part of a range given to the unsafe `register`, under its contract.
            let r = unsafe { exec::register(&*backend, &range, flags, slow, &mut calls) };
            (calls, r)
        }
    };
    let (calls, result): (u64, RegisterResult<Option<SlowRegistration>>) = match inner.mode {
        RegistrationMode::Background => match tokio::task::spawn_blocking(call).await {
            Ok(out) => out,
            Err(e) => (0, Err(RegisterError::TaskFailed(e.to_string()))),
        },
        RegistrationMode::Inline => call(),
    };
    let dones = {
        let mut st = inner.lock();
        st.pending.remove(&range.start);
        st.stats.backend_registers += calls;
        let undo = match &result {
            Ok(slow) => {
                if let Some(slow) = slow {
                    st.stats.record_slow(slow.clone());
                }
                match st.cache.range_done(range.start) {
                    RangeDone::Unused(r) => vec![r],
                    RangeDone::Live | RangeDone::Unknown => Vec::new(),
                }
            }
            Err(_) => {
                st.stats.backend_failures += 1;
                st.cache.range_failed(range.start).unregister
            }
        };
        start_unregisters(&inner, &mut st, undo)
    };
    drop(dones);
    tx.send_replace(Some(result.map(|_| ())));
}

/// Unregisters one backend range, then clears it from the in-flight table and signals it.
async fn unregister_job(inner: Arc<Inner>, range: Range<u64>, tx: DoneTx) {
    let call = {
        let backend = inner.backend.clone();
        let range = range.clone();
        move || {
            let mut calls = 0;
            // SAFETY: the range's last registration was released (or its registration
            // failed): `register`'s contract has no copy pending on it.
            let r = unsafe { exec::unregister(&*backend, &range, &mut calls) };
            (calls, r)
        }
    };
    let (calls, result) = match inner.mode {
        RegistrationMode::Background => match tokio::task::spawn_blocking(call).await {
            Ok(out) => out,
            Err(e) => (0, Err(RegisterError::TaskFailed(e.to_string()))),
        },
        RegistrationMode::Inline => call(),
    };
    {
        let mut st = inner.lock();
        st.unregistering.remove(&range.start);
        st.stats.backend_unregisters += calls;
        if result.is_err() {
            st.stats.backend_failures += 1;
        }
    }
    tx.send_replace(Some(result));
}
