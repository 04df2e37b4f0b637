//! Lost devices: telling a sticky error apart, remembering it per device, and the watchdog that
//! fails the host functions the driver will never run.
//!
//! After a sticky error (a kernel faulted: `CUDA_ERROR_ILLEGAL_ADDRESS`, a launch failure, an
//! uncorrectable ECC error...) a context does no more work: every call in it returns that
//! error, and host functions queued on its streams never run, so every completion future
//! waiting on one would hang. The backend therefore:
//! - marks the device lost the first time one of its calls on that device returns a sticky
//!   code ([`Health::seen`]), and from then on answers every call on the device with
//!   [`BackendError::DeviceLost`] before touching the driver ([`Health::check`]);
//! - runs a watchdog thread (from the first launch on; idle, it sleeps until the next launch or
//!   a second passes) while host functions are pending: every [`PROBE_PERIOD`] it
//!   queries each such device's legacy stream (`cuStreamQuery`, which never blocks and
//!   reports a sticky error like any call), so a loss is found even when nobody calls the
//!   backend; it then calls the device's pending host functions with the error, which fails
//!   their futures ([`Pending::fail_device`]).
//!
//! The state is per process and final: a lost device stays lost for this backend (recovery
//! needs every holder of the primary context to let go of it, in practice a new process).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::Duration;

use cudarc::driver::sys::{self, CUresult};

use super::context::{bind, Contexts};
use super::error::catch;
use super::hostfn::Pending;
use gpualloc_runtime::error::{BackendError, Result};
use gpualloc_runtime::types::DeviceId;

/// How often the watchdog probes devices with pending host functions: the longest a future
/// waits past the loss of its device.
pub(crate) const PROBE_PERIOD: Duration = Duration::from_millis(20);

/// How long the watchdog sleeps when no host function is pending (a launch wakes it sooner).
const IDLE_PERIOD: Duration = Duration::from_secs(1);

/// True for the driver's sticky error codes: after one, the context is unusable. Each of these
/// is documented with "any further CUDA work will return the same error. To continue using
/// CUDA, the process must be terminated and relaunched": a device-side `assert` (710) as much
/// as an illegal address (700).
pub(crate) fn is_sticky(code: i32) -> bool {
    use CUresult::*;
    [
        CUDA_ERROR_ECC_UNCORRECTABLE,
        CUDA_ERROR_NVLINK_UNCORRECTABLE,
        CUDA_ERROR_ILLEGAL_ADDRESS,
        CUDA_ERROR_LAUNCH_TIMEOUT,
        CUDA_ERROR_ASSERT,
        CUDA_ERROR_HARDWARE_STACK_ERROR,
        CUDA_ERROR_ILLEGAL_INSTRUCTION,
        CUDA_ERROR_MISALIGNED_ADDRESS,
        CUDA_ERROR_INVALID_ADDRESS_SPACE,
        CUDA_ERROR_INVALID_PC,
        CUDA_ERROR_LAUNCH_FAILED,
        CUDA_ERROR_EXTERNAL_DEVICE,
        CUDA_ERROR_CONTAINED,
    ]
    .iter()
    .any(|c| *c as i32 == code)
}

/// The lost-device state, the pending host functions and the watchdog of one backend.
pub(crate) struct Health {
    /// Per device: its error once lost. Shared, so hot paths can watch it with a load
    /// (`Backend::lost_watch`).
    lost: Vec<Arc<OnceLock<BackendError>>>,
    pub(crate) pending: Arc<Pending>,
    watchdog: Mutex<Option<JoinHandle<()>>>,
    started: AtomicBool,
    stop: AtomicBool,
    /// True while the watchdog sleeps for [`IDLE_PERIOD`] (nothing was pending).
    idle: AtomicBool,
    /// Set by every launch; the watchdog clears it before it decides how long to sleep, so a
    /// launch between its scan and its sleep is never missed (see [`Health::launched`]).
    kicked: AtomicBool,
    wake: (Mutex<()>, Condvar),
}

impl Health {
    /// Healthy state for `count` devices; no thread yet.
    pub(crate) fn new(count: u32) -> Arc<Health> {
        Arc::new(Health {
            lost: (0..count).map(|_| Arc::new(OnceLock::new())).collect(),
            pending: Pending::new(count),
            watchdog: Mutex::new(None),
            started: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            idle: AtomicBool::new(false),
            kicked: AtomicBool::new(false),
            wake: (Mutex::new(()), Condvar::new()),
        })
    }

    /// The device-lost error of `device`, if it is lost.
    pub(crate) fn lost(&self, device: DeviceId) -> Option<BackendError> {
        self.lost.get(device.0 as usize)?.get().cloned()
    }

    /// The cell that holds `device`'s error once it is lost (`None`: no such device).
    pub(crate) fn lost_cell(&self, device: DeviceId) -> Option<Arc<OnceLock<BackendError>>> {
        self.lost.get(device.0 as usize).cloned()
    }

    /// `Err(DeviceLost)` when `device` is lost.
    pub(crate) fn check(&self, device: DeviceId) -> Result<()> {
        match self.lost(device) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Marks `device` lost (the first cause wins) and fails its pending host functions.
    /// Returns the device's error.
    pub(crate) fn mark_lost(&self, device: DeviceId, cause: String) -> BackendError {
        let Some(slot) = self.lost.get(device.0 as usize) else {
            return BackendError::InvalidDevice(device.0);
        };
        let err = slot
            .get_or_init(|| {
                tracing::error!(device = device.0, %cause, "CUDA device lost (sticky error)");
                BackendError::DeviceLost {
                    device: device.0,
                    cause,
                }
            })
            .clone();
        let failed = self.pending.fail_device(device, &err);
        if failed > 0 {
            tracing::warn!(
                device = device.0,
                failed,
                "failed the host functions pending on a lost device"
            );
        }
        err
    }

    /// Passes `r`, the result of a call on `device`, through: a sticky driver error marks the
    /// device lost and becomes [`BackendError::DeviceLost`].
    pub(crate) fn seen<T>(&self, device: DeviceId, r: Result<T>) -> Result<T> {
        match r {
            Err(BackendError::Driver { code, name }) if is_sticky(code) => {
                Err(self.mark_lost(device, format!("{name} (driver error {code})")))
            }
            other => other,
        }
    }

    /// Starts the watchdog on first use (a launch of a host function); `contexts` are the
    /// backend's, probed while their device has host functions pending.
    pub(crate) fn ensure_watchdog(self: &Arc<Self>, contexts: &Arc<Contexts>) {
        if self.started.load(Ordering::Acquire) {
            return;
        }
        let mut slot = self.watchdog.lock().unwrap_or_else(|p| p.into_inner());
        if self.started.swap(true, Ordering::AcqRel) {
            return;
        }
        let (health, contexts) = (self.clone(), contexts.clone());
        match std::thread::Builder::new()
            .name("gpualloc-cuda-watchdog".into())
            .spawn(move || health.watch(&contexts))
        {
            Ok(handle) => *slot = Some(handle),
            // Without the thread a loss is still found by the next call on the device.
            Err(e) => tracing::warn!(error = %e, "could not start the CUDA watchdog thread"),
        }
    }

    fn watch(&self, contexts: &Contexts) {
        let (lock, cv) = &self.wake;
        let mut guard = lock.lock().unwrap_or_else(|p| p.into_inner());
        while !self.stop.load(Ordering::Acquire) {
            drop(guard);
            let mut watched = false;
            for d in 0..contexts.count() {
                let device = DeviceId(d);
                if self.lost(device).is_some() || self.pending.count(device) == 0 {
                    continue;
                }
                watched = true;
                if let Some(ctx) = contexts.retained(device) {
                    if let Some(code) = probe(ctx) {
                        self.mark_lost(device, format!("{code:?} (found by the watchdog)"));
                    }
                }
            }
            guard = lock.lock().unwrap_or_else(|p| p.into_inner());
            if self.stop.load(Ordering::Acquire) {
                break;
            }
            let period = self.sleep_period(watched);
            guard = cv
                .wait_timeout(guard, period)
                .unwrap_or_else(|p| p.into_inner())
                .0;
            self.idle.store(false, Ordering::Release);
        }
    }

    /// How long the watchdog sleeps after a scan, called with its wake lock held: idle
    /// (nothing pending was seen, and no launch since the scan began) sleeps long, else it
    /// probes again within [`PROBE_PERIOD`].
    ///
    /// Why the `kicked` flag: a launch after the scan found nothing, but before `idle` is set,
    /// saw the watchdog awake and did not notify it; without the flag it then slept a whole
    /// [`IDLE_PERIOD`] (1 s) past a loss instead of 20 ms. With it (sequentially consistent
    /// on both sides): either the launch's `kicked` comes before the swap here, and the sleep
    /// is short; or after, and then its load of `idle` comes after the store here, sees it
    /// set, and notifies under the wake lock, which the watchdog holds until it waits.
    fn sleep_period(&self, watched: bool) -> Duration {
        self.idle.store(!watched, Ordering::SeqCst);
        let kicked = self.kicked.swap(false, Ordering::SeqCst);
        if watched || kicked {
            self.idle.store(false, Ordering::SeqCst);
            PROBE_PERIOD
        } else {
            IDLE_PERIOD
        }
    }

    /// A host function was just registered: wakes an idle watchdog, so a loss is found within
    /// [`PROBE_PERIOD`] of it rather than [`IDLE_PERIOD`]. A store and a load when it is awake.
    pub(crate) fn launched(&self) {
        self.kicked.store(true, Ordering::SeqCst);
        if self.idle.load(Ordering::SeqCst) {
            let _g = self.wake.0.lock().unwrap_or_else(|p| p.into_inner());
            self.wake.1.notify_all();
        }
    }

    /// Stops the watchdog and waits for it (the backend is going away).
    pub(crate) fn shutdown(&self) {
        {
            let _g = self.wake.0.lock().unwrap_or_else(|p| p.into_inner());
            self.stop.store(true, Ordering::Release);
            self.wake.1.notify_all();
        }
        let handle = self
            .watchdog
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(h) = handle {
            let _ = h.join();
        }
    }
}

/// The sticky code `ctx` reports, if any: binds it and queries its legacy stream.
fn probe(ctx: &cudarc::driver::safe::CudaContext) -> Option<CUresult> {
    bind(ctx).ok()?;
    let code = catch("cuStreamQuery", || {
        // SAFETY: the null stream is the bound context's legacy stream; the query takes no
        // pointers and never blocks.
        unsafe { sys::cuStreamQuery(std::ptr::null_mut()) }
    })
    .ok()?;
    is_sticky(code as i32).then_some(code)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex as StdMutex;

    /// A launch the scan did not see (it came after the scan, before the sleep) keeps the
    /// watchdog's next sleep short: the race that delayed a loss's discovery to 1 s.
    #[test]
    fn a_launch_between_the_scan_and_the_sleep_keeps_the_sleep_short() {
        let h = Health::new(1);
        assert_eq!(
            h.sleep_period(false),
            IDLE_PERIOD,
            "nothing pending, no launch"
        );
        assert!(h.idle.load(Ordering::SeqCst));
        h.idle.store(false, Ordering::SeqCst);
        // The launch lands while the watchdog is awake (after its scan).
        h.launched();
        assert_eq!(h.sleep_period(false), PROBE_PERIOD);
        assert!(!h.idle.load(Ordering::SeqCst));
        // The kick is used once.
        assert_eq!(h.sleep_period(false), IDLE_PERIOD);
        assert_eq!(h.sleep_period(true), PROBE_PERIOD, "something pending");
    }

    #[test]
    fn sticky_codes_are_told_apart() {
        for c in [
            700, 702, 710, 714, 715, 716, 717, 718, 719, 214, 220, 226, 911,
        ] {
            assert!(is_sticky(c), "{c}");
        }
        for c in [0, 1, 2, 101, 201, 400, 600, 701, 999] {
            assert!(!is_sticky(c), "{c}");
        }
    }

    #[test]
    fn a_sticky_error_loses_the_device_and_fails_its_pending_host_functions() {
        let h = Health::new(2);
        let results = Arc::new(StdMutex::new(Vec::new()));
        let r = results.clone();
        let data = h
            .pending
            .register(
                DeviceId(1),
                Box::new(move |res| r.lock().unwrap().push(res)),
            )
            .unwrap();
        // A non-sticky error passes through and loses nothing.
        let oom: Result<()> = Err(BackendError::Driver {
            code: 701,
            name: "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES".into(),
        });
        assert_eq!(h.seen(DeviceId(1), oom.clone()), oom);
        assert_eq!(h.seen(DeviceId(1), Ok(5)), Ok(5));
        assert!(h.check(DeviceId(1)).is_ok());
        // The cells the hot paths watch (`Backend::lost_watch`): empty until the loss, none
        // past the last device.
        let cells = [0, 1].map(|d| h.lost_cell(DeviceId(d)).unwrap());
        assert!(cells[0].get().is_none() && cells[1].get().is_none());
        assert!(h.lost_cell(DeviceId(2)).is_none());
        let sticky: Result<()> = Err(BackendError::Driver {
            code: 700,
            name: "CUDA_ERROR_ILLEGAL_ADDRESS".into(),
        });
        let err = h.seen(DeviceId(1), sticky).unwrap_err();
        let BackendError::DeviceLost { device, cause } = &err else {
            panic!("{err:?}");
        };
        assert_eq!(*device, 1);
        assert!(cause.contains("CUDA_ERROR_ILLEGAL_ADDRESS"), "{cause}");
        assert_eq!(*results.lock().unwrap(), vec![Err(err.clone())]);
        assert_eq!(h.check(DeviceId(1)), Err(err.clone()));
        assert!(h.check(DeviceId(0)).is_ok());
        assert_eq!(
            cells[1].get(),
            Some(&err),
            "the lost device's cell holds its error"
        );
        assert!(cells[0].get().is_none(), "the other device's is empty");
        // The first cause stays.
        assert_eq!(h.mark_lost(DeviceId(1), "later".into()), err);
        assert_eq!(
            h.mark_lost(DeviceId(9), "x".into()),
            BackendError::InvalidDevice(9)
        );
        // SAFETY: `data` is from `register` and used once (a late driver call).
        unsafe { super::super::hostfn::trampoline(data) };
        assert_eq!(results.lock().unwrap().len(), 1);
    }
}
