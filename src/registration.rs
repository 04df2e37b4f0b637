//! Keeping an outside registration cache in step with the allocator's segments: every range
//! the allocator maps is registered, and every registration is dropped *before* its memory is
//! unmapped or freed. This is what NCCL's user-buffer registration (`ncclCommRegister`,
//! the `nccl` feature's `gpualloc::nccl`), UCX's memory registration and NVSHMEM need. The
//! registrar itself is a trait, [`SegmentRegistrar`], so the rules are tested on the sim with
//! a fake one.
//!
//! ```no_run
//! # async fn demo(alloc: gpualloc::Allocator, pool: gpualloc::Pool) -> Result<(), gpualloc::Error> {
//! use gpualloc::{DeviceId, SegmentRegistrar};
//! struct Printer;
//! impl SegmentRegistrar for Printer {
//!     type Handle = ();
//!     fn register(&mut self, addr: u64, size: u64) -> Result<(), String> {
//!         println!("register {addr:#x} +{size}");
//!         Ok(())
//!     }
//!     fn deregister(&mut self, addr: u64, size: u64, _: ()) -> Result<(), String> {
//!         println!("deregister {addr:#x} +{size}");
//!         Ok(())
//!     }
//! }
//! let reg = alloc.register_segments(DeviceId(0), Some(&pool), Printer).await?;
//! // ... every segment of `pool` on device 0 is registered while `reg` lives ...
//! drop(reg); // deregisters what is left
//! # Ok(()) }
//! ```
//!
//! How:
//! - **Registering** follows the segment events of [`Allocator::watch_segments`]: the ranges
//!   held when the registration begins, then each `Map` / `Alloc` of the chosen pool (or of
//!   every pool), on a tokio task. A range is registered shortly after it is mapped, not
//!   before its first block is handed out: a buffer used before its registration lands works,
//!   unregistered (NCCL then copies through its own buffers).
//! - **Deregistering** is synchronous: a [`ReleaseHook`] on the backend runs just before
//!   every `unmap` and `free` driver call, whichever path releases the memory (trim,
//!   `empty_cache`, a pool's sleep, a shutdown), and deregisters every registration the
//!   range touches. A range being released is not registered until its release has returned.
//! - A registration the release covers only in part (a stretch of expandable pages of which
//!   some handles are unmapped) goes whole, as a registrar cannot shrink one, and the parts
//!   that stay mapped are registered again once the release has returned (or at once, when
//!   the allocator's event of the release comes first: a live registration's other pages are
//!   mapped, since every release drops the registrations it touches).
//! - So a registration never outlives its memory. The registrar runs under one lock: the
//!   release hook waits while a registration is in progress, on the thread that releases
//!   (possibly holding the device's allocator): registrars must be quick and must never call
//!   the allocator.
//! - A failed `register` or `deregister` is logged and counted ([`RegistrationStats`]); the
//!   range stays unregistered (or is forgotten). A registrar that panics is caught.
//! - Dropping the [`SegmentRegistration`] (or [`SegmentRegistration::close`]) removes the
//!   hook, stops the task and deregisters what is left.
//! - Needs a backend with release hooks (the sim and CUDA have them): otherwise
//!   `BackendError::NotSupported`.

use std::collections::BTreeMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex, MutexGuard};

use gpualloc_devices::{MemPoolId, SegmentEvent};
use gpualloc_runtime::release_hooks::{Release, ReleaseHook, ReleaseHookId};
use gpualloc_runtime::{BackendError, DeviceId};
use tokio::sync::broadcast::error::RecvError;
use tokio::task::JoinHandle;

use crate::observer::watch_actor;
use crate::{Allocator, DeviceActor, Error, Pool, SegmentAction, SegmentRange};

/// Registers ranges of device memory with an outside system (NCCL, UCX, ...).
pub trait SegmentRegistrar: Send + 'static {
    /// What a registration returns and its deregistration takes.
    type Handle: Send + 'static;
    /// Registers `[addr, addr + size)`, mapped now.
    fn register(&mut self, addr: u64, size: u64) -> Result<Self::Handle, String>;
    /// Drops the registration of `[addr, addr + size)`, still mapped now.
    fn deregister(&mut self, addr: u64, size: u64, handle: Self::Handle) -> Result<(), String>;
}

/// What a [`SegmentRegistration`] has done.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RegistrationStats {
    /// Ranges registered now.
    pub live: usize,
    /// Bytes registered now.
    pub live_bytes: u64,
    /// Successful `register` calls so far.
    pub registered: u64,
    /// `deregister` calls so far (successful or not).
    pub deregistered: u64,
    /// `deregister` calls made by the release hook, just before an unmap or free.
    pub deregistered_before_release: u64,
    /// `register` or `deregister` calls that failed (or panicked).
    pub failures: u64,
}

/// The registrations of one registrar, under one lock (see the module docs).
struct Table<R: SegmentRegistrar> {
    registrar: R,
    /// By first address: (bytes, handle).
    live: BTreeMap<u64, (u64, R::Handle)>,
    /// Releases between their hook's two halves.
    releasing: Vec<Release>,
    /// Parts of registrations a release dropped that stay mapped: registered again once that
    /// release has returned (see [`outside`]).
    remainders: Vec<(Release, u64, u64)>,
    stats: RegistrationStats,
    closed: bool,
}

impl<R: SegmentRegistrar> Table<R> {
    fn register(&mut self, addr: u64, size: u64) {
        if self.closed || size == 0 || self.releasing.iter().any(|r| r.touches(addr, size)) {
            return;
        }
        // A registration the range overlaps is stale (its memory went and came back while
        // the events were on their way): replace it.
        let this = Release::Unmap { addr, size };
        self.deregister_where(|a, s| this.touches(a, s), false);
        let registrar = &mut self.registrar;
        let call = || registrar.register(addr, size);
        if let Some(handle) = guarded(&mut self.stats, "register", addr, size, call) {
            self.live.insert(addr, (size, handle));
            self.stats.registered += 1;
        }
    }

    /// Deregisters every registration `touches` selects; returns their ranges.
    fn deregister_where(
        &mut self,
        touches: impl Fn(u64, u64) -> bool,
        by_hook: bool,
    ) -> Vec<(u64, u64)> {
        let doomed: Vec<(u64, u64)> = self
            .live
            .iter()
            .filter(|(&a, (s, _))| touches(a, *s))
            .map(|(&a, (s, _))| (a, *s))
            .collect();
        for &(addr, _) in &doomed {
            let (size, handle) = self.live.remove(&addr).expect("listed above");
            self.stats.deregistered += 1;
            if by_hook {
                self.stats.deregistered_before_release += 1;
            }
            let registrar = &mut self.registrar;
            let call = || registrar.deregister(addr, size, handle);
            guarded(&mut self.stats, "deregister", addr, size, call);
        }
        doomed
    }

    /// The follow task saw `gone` (an unmap or free the allocator began): drops the
    /// registrations it touches and registers their parts outside it again at once. A live
    /// registration's memory is all mapped but for what a release began since it was made
    /// (a release's hook drops every registration it touches), so those parts are mapped.
    fn drop_for_event(&mut self, gone: Release) {
        for (addr, size) in self.deregister_where(|a, s| gone.touches(a, s), false) {
            for (a, s) in outside(gone, addr, size) {
                self.register(a, s);
            }
        }
    }

    fn stats(&self) -> RegistrationStats {
        RegistrationStats {
            live: self.live.len(),
            live_bytes: self.live.values().map(|(s, _)| s).sum(),
            ..self.stats
        }
    }

    /// Makes the registrations exactly `ranges` (after a lagged event stream).
    fn reconcile(&mut self, ranges: &[(u64, u64)]) {
        self.deregister_where(|a, s| !ranges.contains(&(a, s)), false);
        for &(addr, size) in ranges {
            if !self.live.contains_key(&addr) {
                self.register(addr, size);
            }
        }
    }
}

/// Runs the registrar's `call` (`what`: "register" or "deregister"): its value, or `None`
/// with a failure counted when it returns an error or panics (a panic is caught: the
/// allocator goes on).
fn guarded<T>(
    stats: &mut RegistrationStats,
    what: &str,
    addr: u64,
    size: u64,
    call: impl FnOnce() -> Result<T, String>,
) -> Option<T> {
    match catch_unwind(AssertUnwindSafe(call)) {
        Ok(Ok(value)) => Some(value),
        Ok(Err(e)) => {
            stats.failures += 1;
            tracing::warn!(addr, size, error = %e, "segment registrar's {what} failed");
            None
        }
        Err(_) => {
            stats.failures += 1;
            tracing::error!(addr, size, "segment registrar panicked in {what}");
            None
        }
    }
}

type Shared<R> = Arc<Mutex<Table<R>>>;

fn lock<R: SegmentRegistrar>(t: &Shared<R>) -> MutexGuard<'_, Table<R>> {
    // Registrar panics are caught inside; a poisoned lock can only come from a bug here,
    // and the table stays consistent at every step, so go on with it.
    t.lock().unwrap_or_else(|p| p.into_inner())
}

struct Hook<R: SegmentRegistrar>(Shared<R>);

/// The parts of `[addr, addr + size)` outside what `release` takes: they stay mapped. None
/// for a `Free`, which takes a whole allocation (a registration lies inside one).
fn outside(release: Release, addr: u64, size: u64) -> Vec<(u64, u64)> {
    let Release::Unmap { addr: a, size: n } = release else {
        return Vec::new();
    };
    let (end, released_end) = (addr.saturating_add(size), a.saturating_add(n));
    let mut parts = Vec::new();
    if addr < a {
        parts.push((addr, a.min(end) - addr));
    }
    if released_end < end {
        let from = released_end.max(addr);
        parts.push((from, end - from));
    }
    parts
}

impl<R: SegmentRegistrar> ReleaseHook for Hook<R> {
    fn before_release(&self, release: Release) {
        let mut t = lock(&self.0);
        t.releasing.push(release);
        // A registration reaching out of the release goes whole (a registrar cannot shrink
        // one); the parts outside are registered again after the release. Parts waiting for
        // another release that this one takes are cut to what stays mapped.
        for (addr, size) in t.deregister_where(|a, s| release.touches(a, s), true) {
            for (a, s) in outside(release, addr, size) {
                t.remainders.push((release, a, s));
            }
        }
        let waiting = std::mem::take(&mut t.remainders);
        for (owner, addr, size) in waiting {
            if release.touches(addr, size) {
                let kept = outside(release, addr, size);
                t.remainders
                    .extend(kept.into_iter().map(|(a, s)| (owner, a, s)));
            } else {
                t.remainders.push((owner, addr, size));
            }
        }
    }

    fn after_release(&self, release: Release) {
        let mut t = lock(&self.0);
        if let Some(i) = t.releasing.iter().position(|r| *r == release) {
            t.releasing.swap_remove(i);
        }
        let (mine, others): (Vec<_>, Vec<_>) = std::mem::take(&mut t.remainders)
            .into_iter()
            .partition(|(owner, _, _)| *owner == release);
        t.remainders = others;
        for (_, addr, size) in mine {
            t.register(addr, size);
        }
    }
}

/// Which segments of a device a registration follows.
#[derive(Debug, Clone, Copy)]
struct Filter {
    device: DeviceId,
    pool: Option<MemPoolId>,
}

impl Filter {
    fn range(&self, r: &SegmentRange) -> bool {
        self.pool.is_none() || r.pool == self.pool
    }
    fn event(&self, e: &SegmentEvent) -> bool {
        e.device == self.device && (self.pool.is_none() || e.pool == self.pool)
    }
}

/// A live registration (see the module docs). Dropping it deregisters everything.
pub struct SegmentRegistration {
    table: Arc<dyn TableView>,
    backend: Arc<dyn gpualloc_runtime::Backend>,
    hook: ReleaseHookId,
    task: JoinHandle<()>,
}

/// The registration's table without its registrar type.
trait TableView: Send + Sync {
    fn stats(&self) -> RegistrationStats;
    fn close(&self);
}

impl<R: SegmentRegistrar> TableView for Mutex<Table<R>> {
    fn stats(&self) -> RegistrationStats {
        self.lock().unwrap_or_else(|p| p.into_inner()).stats()
    }
    fn close(&self) {
        let mut t = self.lock().unwrap_or_else(|p| p.into_inner());
        t.closed = true;
        t.deregister_where(|_, _| true, false);
    }
}

impl std::fmt::Debug for SegmentRegistration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SegmentRegistration")
            .field("stats", &self.stats())
            .finish()
    }
}

impl SegmentRegistration {
    /// What it has done so far.
    pub fn stats(&self) -> RegistrationStats {
        self.table.stats()
    }

    /// Stops following the allocator and deregisters every range; returns the final stats.
    pub fn close(self) -> RegistrationStats {
        self.shut();
        self.table.stats()
    }

    fn shut(&self) {
        if let Some(hooks) = self.backend.release_hooks() {
            hooks.remove(self.hook);
        }
        self.task.abort();
        self.table.close();
    }
}

impl Drop for SegmentRegistration {
    fn drop(&mut self) {
        self.shut();
    }
}

impl Allocator {
    /// Keeps `registrar` in step with the segments of `device`: those of `pool`, or with
    /// `None` every segment of the device (see the module docs).
    pub async fn register_segments<R: SegmentRegistrar>(
        &self,
        device: DeviceId,
        pool: Option<&Pool>,
        registrar: R,
    ) -> Result<SegmentRegistration, Error> {
        self.check()?;
        let actor = self.device_actor(device)?.clone();
        let filter = Filter {
            device,
            pool: pool.map(|p| p.id(device)).transpose()?,
        };
        let backend = self.backend().clone();
        let hooks = backend.release_hooks().ok_or_else(|| {
            BackendError::NotSupported(format!(
                "segment registration: the {} backend has no release hooks",
                backend.name()
            ))
        })?;
        let table: Shared<R> = Arc::new(Mutex::new(Table {
            registrar,
            live: BTreeMap::new(),
            releasing: Vec::new(),
            remainders: Vec::new(),
            stats: RegistrationStats::default(),
            closed: false,
        }));
        // The hook first: a range the snapshot lists can then not be released unseen.
        let hook = hooks.add(Arc::new(Hook(table.clone())));
        let watch = match watch_actor(&actor).await {
            Ok(w) => w,
            Err(e) => {
                hooks.remove(hook);
                return Err(e);
            }
        };
        {
            let mut t = lock(&table);
            for r in watch.ranges.iter().filter(|r| filter.range(r)) {
                t.register(r.addr, r.size);
            }
        }
        let task = tokio::spawn(follow(actor, filter, watch.events, table.clone()));
        Ok(SegmentRegistration {
            table,
            backend,
            hook,
            task,
        })
    }
}

/// Registers what the events map; re-reads the whole list after falling behind.
async fn follow<R: SegmentRegistrar>(
    actor: Arc<DeviceActor>,
    filter: Filter,
    mut events: tokio::sync::broadcast::Receiver<SegmentEvent>,
    table: Shared<R>,
) {
    loop {
        match events.recv().await {
            Ok(e) if filter.event(&e) => {
                let mut t = lock(&table);
                match e.action {
                    SegmentAction::Map | SegmentAction::Alloc => t.register(e.addr, e.size),
                    SegmentAction::Unmap => {
                        t.drop_for_event(Release::Unmap {
                            addr: e.addr,
                            size: e.size,
                        });
                    }
                    SegmentAction::Free => {
                        t.drop_for_event(Release::Free {
                            device: e.device,
                            addr: e.addr,
                        });
                    }
                    SegmentAction::PoolAsleep | SegmentAction::PoolAwake => {}
                }
            }
            Ok(_) => {}
            Err(RecvError::Lagged(missed)) => {
                tracing::warn!(missed, "segment registration fell behind; re-reading");
                let Ok(watch) = watch_actor(&actor).await else {
                    return;
                };
                let ranges: Vec<(u64, u64)> = watch
                    .ranges
                    .iter()
                    .filter(|r| filter.range(r))
                    .map(|r| (r.addr, r.size))
                    .collect();
                lock(&table).reconcile(&ranges);
                events = watch.events;
            }
            Err(RecvError::Closed) => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_parts_of_a_range_outside_a_release() {
        let unmap = |addr, size| Release::Unmap { addr, size };
        // Released in the middle, at the front, at the back, wholly, or past both ends.
        assert_eq!(outside(unmap(20, 10), 10, 40), vec![(10, 10), (30, 20)]);
        assert_eq!(outside(unmap(10, 10), 10, 40), vec![(20, 30)]);
        assert_eq!(outside(unmap(40, 10), 10, 40), vec![(10, 30)]);
        assert_eq!(outside(unmap(10, 40), 10, 40), vec![]);
        assert_eq!(outside(unmap(0, 100), 10, 40), vec![]);
        // Overlapping one end only.
        assert_eq!(outside(unmap(0, 20), 10, 40), vec![(20, 30)]);
        assert_eq!(outside(unmap(40, 100), 10, 40), vec![(10, 30)]);
        // A free takes a whole allocation: nothing stays.
        let free = Release::Free {
            device: DeviceId(0),
            addr: 10,
        };
        assert_eq!(outside(free, 10, 40), vec![]);
    }
}
