//! Functions a backend calls just before (and just after) it gives device memory back to the
//! driver: every `unmap` of mapped pages and every `free` of an allocation.
//!
//! Why: a registration cache outside the allocator (NCCL's `ncclCommRegister`, UCX's
//! memory registration, NVSHMEM) must drop its registration of a range *before* the range is
//! unmapped, or it keeps a handle on memory that is gone and may later find a new allocation
//! at the same address. The allocator's segment events ([`crate`]'s users see them through
//! the facade's `watch_segments`) are delivered asynchronously, which is right for
//! registering but too late for deregistering; these hooks are the synchronous half.
//!
//! Every unmap and free passes through the backend, whichever path of the allocator releases
//! memory (a trim, `empty_cache`, a pool's sleep, a shutdown, an abandoned growth), so a hook
//! installed here sees all of them by construction.
//!
//! Rules:
//! - [`ReleaseHook::before_release`] runs on the thread that is about to make the driver
//!   call, possibly while the device's allocator is locked: keep it short, never call back
//!   into the allocator from it (that would deadlock), never block on the allocator. For a
//!   `free`, the device's queued work has finished by then (`free` synchronizes first), so a
//!   deregistration never runs under work still using the memory.
//! - [`ReleaseHook::after_release`] runs once the driver call returned (success or not).
//! - A hook that panics is caught: the release goes on and the other hooks still run.
//! - With no hook installed, a release pays one atomic load.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use crate::types::DeviceId;

/// What is about to be given back to the driver.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Release {
    /// `unmap(addr, size)`: the physical memory behind this range of mapped pages.
    Unmap {
        /// First address.
        addr: u64,
        /// Bytes.
        size: u64,
    },
    /// `free(device, addr)`: the whole allocation that starts at `addr`.
    Free {
        /// The device.
        device: DeviceId,
        /// The allocation's first address.
        addr: u64,
    },
}

impl Release {
    /// True if a registration of `[addr, addr + size)` must go before this release: it
    /// overlaps the unmapped range, or it lies in the freed allocation (which starts at the
    /// freed address: a registration starting there, or covering it).
    pub fn touches(&self, addr: u64, size: u64) -> bool {
        match *self {
            Release::Unmap { addr: a, size: s } => {
                addr < a.saturating_add(s) && a < addr.saturating_add(size)
            }
            Release::Free { addr: a, .. } => addr <= a && a < addr.saturating_add(size.max(1)),
        }
    }
}

/// A function pair run around every release (see the module docs).
pub trait ReleaseHook: Send + Sync + 'static {
    /// Runs just before the driver call that releases `release`.
    fn before_release(&self, release: Release);
    /// Runs just after that driver call returned.
    fn after_release(&self, _release: Release) {}
}

/// Identifies an installed hook, for [`ReleaseHooks::remove`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ReleaseHookId(u64);

/// The hooks of one backend. Backends that support them own one and return it from
/// [`crate::Backend::release_hooks`].
#[derive(Default)]
pub struct ReleaseHooks {
    any: AtomicBool,
    next_id: AtomicU64,
    hooks: RwLock<Vec<(ReleaseHookId, Arc<dyn ReleaseHook>)>>,
}

impl std::fmt::Debug for ReleaseHooks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReleaseHooks")
            .field("installed", &self.snapshot().len())
            .finish()
    }
}

impl ReleaseHooks {
    /// No hooks.
    pub fn new() -> Self {
        Self::default()
    }

    /// Installs `hook`; it sees every release from now on.
    pub fn add(&self, hook: Arc<dyn ReleaseHook>) -> ReleaseHookId {
        let id = ReleaseHookId(self.next_id.fetch_add(1, Ordering::Relaxed));
        let mut hooks = self.hooks.write().unwrap_or_else(|p| p.into_inner());
        hooks.push((id, hook));
        self.any.store(true, Ordering::Release);
        id
    }

    /// Removes the hook `id`; false if it was not installed. A release running now may still
    /// call it once more (it took its list before the removal).
    pub fn remove(&self, id: ReleaseHookId) -> bool {
        let mut hooks = self.hooks.write().unwrap_or_else(|p| p.into_inner());
        let before = hooks.len();
        hooks.retain(|(i, _)| *i != id);
        self.any.store(!hooks.is_empty(), Ordering::Release);
        hooks.len() != before
    }

    /// Number of hooks installed.
    pub fn len(&self) -> usize {
        self.snapshot().len()
    }

    /// True if no hook is installed.
    pub fn is_empty(&self) -> bool {
        !self.any.load(Ordering::Acquire)
    }

    fn snapshot(&self) -> Vec<Arc<dyn ReleaseHook>> {
        let hooks = self.hooks.read().unwrap_or_else(|p| p.into_inner());
        hooks.iter().map(|(_, h)| h.clone()).collect()
    }

    /// Runs the driver call `release_now` for `release` between the hooks' two halves.
    pub fn around<T>(&self, release: Release, release_now: impl FnOnce() -> T) -> T {
        if !self.any.load(Ordering::Acquire) {
            return release_now();
        }
        let hooks = self.snapshot();
        for h in &hooks {
            if catch_unwind(AssertUnwindSafe(|| h.before_release(release))).is_err() {
                tracing::error!(?release, "a release hook panicked before the release");
            }
        }
        let out = release_now();
        for h in &hooks {
            if catch_unwind(AssertUnwindSafe(|| h.after_release(release))).is_err() {
                tracing::error!(?release, "a release hook panicked after the release");
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    struct Log(Mutex<Vec<String>>, &'static str);
    impl ReleaseHook for Log {
        fn before_release(&self, r: Release) {
            self.0
                .lock()
                .unwrap()
                .push(format!("{} before {r:?}", self.1));
        }
        fn after_release(&self, r: Release) {
            self.0
                .lock()
                .unwrap()
                .push(format!("{} after {r:?}", self.1));
        }
    }

    struct Panics;
    impl ReleaseHook for Panics {
        fn before_release(&self, _: Release) {
            panic!("hook bug");
        }
        fn after_release(&self, _: Release) {
            panic!("hook bug");
        }
    }

    #[test]
    fn hooks_run_around_the_call_in_order_and_survive_a_panicking_one() {
        let hooks = ReleaseHooks::new();
        let r = Release::Unmap {
            addr: 0x20_0000,
            size: 0x20_0000,
        };
        assert_eq!(hooks.around(r, || 7), 7);
        assert!(hooks.is_empty());
        let log = Arc::new(Log(Mutex::new(Vec::new()), "a"));
        let a = hooks.add(log.clone());
        let p = hooks.add(Arc::new(Panics));
        let b = hooks.add(Arc::new(Log(Mutex::new(Vec::new()), "b")));
        assert_eq!(hooks.len(), 3);
        let seen = hooks.around(r, || {
            log.0.lock().unwrap().push("driver".into());
            5
        });
        assert_eq!(seen, 5);
        assert_eq!(
            *log.0.lock().unwrap(),
            vec![
                format!("a before {r:?}"),
                "driver".to_string(),
                format!("a after {r:?}")
            ]
        );
        assert!(hooks.remove(p));
        assert!(!hooks.remove(p));
        assert!(hooks.remove(a));
        assert!(hooks.remove(b));
        assert!(hooks.is_empty());
        hooks.around(r, || ());
        assert_eq!(
            log.0.lock().unwrap().len(),
            3,
            "a removed hook is not called"
        );
    }

    #[test]
    fn touches_overlapping_ranges_only() {
        let u = Release::Unmap {
            addr: 100,
            size: 50,
        };
        assert!(u.touches(100, 1));
        assert!(u.touches(149, 10));
        assert!(u.touches(50, 51));
        assert!(!u.touches(50, 50));
        assert!(!u.touches(150, 10));
        let f = Release::Free {
            device: DeviceId(0),
            addr: 1000,
        };
        assert!(f.touches(1000, 4096));
        assert!(f.touches(900, 101));
        assert!(!f.touches(900, 100));
        assert!(!f.touches(1001, 10));
        assert!(
            f.touches(1000, 0),
            "an empty registration at the address goes too"
        );
    }
}
