//! Running a boxed Rust closure as a `cuLaunchHostFunc` callback, and calling it anyway when
//! the driver never will.
//!
//! Each launch registers a [`Slot`] that owns the closure in its device's pending set; one
//! reference to the slot travels as the callback's `userData`. Whoever takes the closure out
//! of the slot first calls it, exactly once:
//! - the [`trampoline`] the driver calls when the stream reaches it, with `Ok(())`;
//! - [`Pending::fail_device`], with the device-lost error, once the device hit a sticky error
//!   (after one the driver runs no host function, so the futures they would complete would
//!   otherwise hang forever). The driver's `userData` reference is then never given back: an
//!   empty slot of a few dozen bytes leaks per host function pending at the loss; the closure
//!   and what it holds are freed.
//!
//! The closure runs on a thread of ours, not the driver's callback thread, where no CUDA call
//! is allowed (see [`RUNNER`]); the callback waits for it. A panic in the closure is caught:
//! unwinding into the driver's thread would abort.

use std::collections::HashMap;
use std::ffi::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

use gpualloc_runtime::error::{BackendError, Result};
use gpualloc_runtime::types::{DeviceId, HostFn};

/// One launched host function: its closure until someone calls it.
pub(crate) struct Slot {
    id: u64,
    device: usize,
    f: Mutex<Option<HostFn>>,
    owner: Weak<Pending>,
}

impl Slot {
    fn take(&self) -> Option<HostFn> {
        self.f.lock().unwrap_or_else(|p| p.into_inner()).take()
    }
}

/// The host functions launched and not yet called, per device.
pub(crate) struct Pending {
    devices: Vec<Mutex<HashMap<u64, Arc<Slot>>>>,
    next_id: AtomicU64,
}

/// Calls `f` with `result`, containing a panic.
fn call(f: HostFn, result: Result<()>) {
    if catch_unwind(AssertUnwindSafe(move || f(result))).is_err() {
        tracing::error!("a host function launched on a CUDA stream panicked");
    }
}

/// A closure to run on the [`runner`] thread, and where to say it ran.
type Job = (HostFn, Result<()>, std::sync::mpsc::Sender<()>);

/// Our thread that runs the closures the driver's callback thread hands over. No CUDA call
/// may be made on the driver's callback thread, and a closure may well make one: dropping
/// what it captured (the last clone of a `Stream`, an `Event`, an imported buffer) destroys
/// it, and the driver refuses that there (cudarc then records the error in the context,
/// where every later call finds it). The trampoline hands the closure over and waits until
/// it has run, so the stream still waits at its host function, as the driver's contract
/// says. Started with the first launch ([`ensure_runner`]); `None` when no thread could be
/// started, and closures then run on the driver's thread as before.
static RUNNER: std::sync::OnceLock<Option<std::sync::mpsc::Sender<Job>>> =
    std::sync::OnceLock::new();

/// Starts the runner thread on first use (a launch, on a thread of the caller's).
pub(crate) fn ensure_runner() {
    RUNNER.get_or_init(|| {
        let (tx, rx) = std::sync::mpsc::channel::<Job>();
        match std::thread::Builder::new()
            .name("gpualloc-cuda-hostfn".into())
            .spawn(move || {
                for (f, result, done) in rx {
                    call(f, result);
                    let _ = done.send(());
                }
            }) {
            Ok(_) => Some(tx),
            Err(e) => {
                tracing::warn!(error = %e, "no thread for host functions: they run on the driver's");
                None
            }
        }
    });
}

/// Runs `f` with `result` on the runner thread and waits for it (on the driver's callback
/// thread); where there is none, here.
fn call_on_runner(f: HostFn, result: Result<()>) {
    let Some(Some(tx)) = RUNNER.get() else {
        return call(f, result);
    };
    let (done, ran) = std::sync::mpsc::channel();
    let sent = tx.send((f, result, done));
    match sent {
        Ok(()) => {
            let _ = ran.recv();
        }
        // The runner is gone (never, short of a panic outside `call`): run it here.
        Err(std::sync::mpsc::SendError((f, result, _))) => call(f, result),
    }
}

impl Pending {
    /// An empty set for `count` devices.
    pub(crate) fn new(count: u32) -> Arc<Pending> {
        Arc::new(Pending {
            devices: (0..count).map(|_| Mutex::new(HashMap::new())).collect(),
            next_id: AtomicU64::new(0),
        })
    }

    fn set(&self, device: usize) -> std::sync::MutexGuard<'_, HashMap<u64, Arc<Slot>>> {
        self.devices[device]
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// Registers `f` for a launch on `device` and returns the launch's `userData`: it owns one
    /// reference to the slot; pass it to exactly one of [`trampoline`] (through the driver) or
    /// [`Pending::cancel`].
    pub(crate) fn register(self: &Arc<Self>, device: DeviceId, f: HostFn) -> Result<*mut c_void> {
        let d = device.0 as usize;
        if d >= self.devices.len() {
            return Err(BackendError::InvalidDevice(device.0));
        }
        let slot = Arc::new(Slot {
            id: self.next_id.fetch_add(1, Ordering::Relaxed),
            device: d,
            f: Mutex::new(Some(f)),
            owner: Arc::downgrade(self),
        });
        self.set(d).insert(slot.id, slot.clone());
        Ok(Arc::into_raw(slot).cast_mut().cast())
    }

    /// The launch of `data` failed: the driver will never call it. Unregisters it and drops
    /// the closure uncalled; true if it did, false if the closure was called already (the
    /// watchdog failed it with its device's loss in the meantime): then its outcome has been
    /// reported through it, and the launch must not report an error too.
    ///
    /// # Safety
    /// `data` comes from [`Pending::register`] and was passed to neither [`trampoline`] nor
    /// this function before.
    #[must_use]
    pub(crate) unsafe fn cancel(data: *mut c_void) -> bool {
        // SAFETY: per this function's contract, `data` owns one reference to a live slot.
        let slot = unsafe { Arc::from_raw(data.cast_const().cast::<Slot>()) };
        let uncalled = slot.take().is_some();
        forget(&slot);
        uncalled
    }

    /// Calls every closure still pending on `device` with `error`; returns how many.
    pub(crate) fn fail_device(&self, device: DeviceId, error: &BackendError) -> usize {
        let Some(set) = self.devices.get(device.0 as usize) else {
            return 0;
        };
        let slots: Vec<Arc<Slot>> = set
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .drain()
            .map(|(_, s)| s)
            .collect();
        let mut failed = 0;
        for slot in slots {
            if let Some(f) = slot.take() {
                call(f, Err(error.clone()));
                failed += 1;
            }
        }
        failed
    }

    /// How many host functions are pending on `device`.
    pub(crate) fn count(&self, device: DeviceId) -> usize {
        self.devices
            .get(device.0 as usize)
            .map_or(0, |s| s.lock().unwrap_or_else(|p| p.into_inner()).len())
    }
}

/// Removes `slot` from its owner's pending set (if the owner is still there).
fn forget(slot: &Slot) {
    if let Some(owner) = slot.owner.upgrade() {
        owner.set(slot.device).remove(&slot.id);
    }
}

/// The `CUhostFn` the driver calls: calls the closure behind `data` with `Ok(())`, unless it
/// was already failed, and frees the driver's reference to the slot.
///
/// # Safety
/// `data` comes from [`Pending::register`] and is passed here exactly once (the driver calls a
/// host function once per successful launch).
pub(crate) unsafe extern "C" fn trampoline(data: *mut c_void) {
    // SAFETY: per this function's contract, `data` owns one reference to a live slot, which
    // nobody else will use again; it is released when this function returns.
    let slot = unsafe { Arc::from_raw(data.cast_const().cast::<Slot>()) };
    if let Some(f) = slot.take() {
        forget(&slot);
        call_on_runner(f, Ok(()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    fn counting(results: &Arc<Mutex<Vec<Result<()>>>>) -> HostFn {
        let r = results.clone();
        Box::new(move |res| r.lock().unwrap().push(res))
    }

    #[test]
    fn the_driver_call_runs_it_once_and_frees_everything() {
        let pending = Pending::new(2);
        let results = Arc::new(Mutex::new(Vec::new()));
        let data = pending.register(DeviceId(1), counting(&results)).unwrap();
        assert_eq!(pending.count(DeviceId(1)), 1);
        assert_eq!(pending.count(DeviceId(0)), 0);
        assert_eq!(Arc::strong_count(&results), 2);
        // SAFETY: `data` is fresh from `register` and used once.
        unsafe { trampoline(data) };
        assert_eq!(*results.lock().unwrap(), vec![Ok(())]);
        assert_eq!(pending.count(DeviceId(1)), 0);
        assert_eq!(Arc::strong_count(&results), 1, "closure was freed");
        // Failing the device afterwards calls nothing.
        assert_eq!(pending.fail_device(DeviceId(1), &lost()), 0);
        assert_eq!(results.lock().unwrap().len(), 1);
    }

    fn lost() -> BackendError {
        BackendError::DeviceLost {
            device: 1,
            cause: "test".into(),
        }
    }

    /// A launch that fails after the watchdog already failed its closure (a loss found in
    /// between) reports once: through the closure, not through the launch as well.
    #[test]
    fn a_cancel_after_the_closure_was_failed_reports_nothing_more() {
        let pending = Pending::new(2);
        let results = Arc::new(Mutex::new(Vec::new()));
        let data = pending.register(DeviceId(1), counting(&results)).unwrap();
        assert_eq!(pending.fail_device(DeviceId(1), &lost()), 1);
        // SAFETY: `data` is fresh from `register`; the driver never got it.
        assert!(!unsafe { Pending::cancel(data) });
        assert_eq!(*results.lock().unwrap(), vec![Err(lost())]);
        // Uncalled: the cancel drops it and says so.
        let data = pending.register(DeviceId(1), counting(&results)).unwrap();
        // SAFETY: as above.
        assert!(unsafe { Pending::cancel(data) });
        assert_eq!(results.lock().unwrap().len(), 1);
        assert_eq!(Arc::strong_count(&results), 1, "both closures were freed");
    }

    #[test]
    fn failing_a_device_calls_its_pending_closures_with_the_error_and_only_those() {
        let pending = Pending::new(2);
        let results = Arc::new(Mutex::new(Vec::new()));
        let on_1: Vec<_> = (0..3)
            .map(|_| pending.register(DeviceId(1), counting(&results)).unwrap())
            .collect();
        let on_0 = pending.register(DeviceId(0), counting(&results)).unwrap();
        assert_eq!(pending.fail_device(DeviceId(1), &lost()), 3);
        assert_eq!(*results.lock().unwrap(), vec![Err(lost()); 3]);
        assert_eq!(pending.count(DeviceId(1)), 0);
        assert_eq!(pending.count(DeviceId(0)), 1);
        // A late driver call of a failed one (the slot is empty) calls nothing again.
        // SAFETY: each `data` is from `register` and used once.
        unsafe { trampoline(on_1[0]) };
        unsafe { trampoline(on_0) };
        assert_eq!(results.lock().unwrap().len(), 4);
        assert_eq!(results.lock().unwrap()[3], Ok(()));
        assert_eq!(pending.fail_device(DeviceId(7), &lost()), 0);
        assert_eq!(
            pending.register(DeviceId(2), counting(&results)).err(),
            Some(BackendError::InvalidDevice(2))
        );
    }

    #[test]
    fn cancel_frees_without_calling() {
        let pending = Pending::new(1);
        let hits = Arc::new(AtomicUsize::new(0));
        let h = hits.clone();
        let data = pending
            .register(
                DeviceId(0),
                Box::new(move |_| {
                    h.fetch_add(1, Ordering::SeqCst);
                }),
            )
            .unwrap();
        // SAFETY: `data` is fresh from `register` and used once.
        assert!(unsafe { Pending::cancel(data) });
        assert_eq!(hits.load(Ordering::SeqCst), 0);
        assert_eq!(Arc::strong_count(&hits), 1);
        assert_eq!(pending.count(DeviceId(0)), 0);
    }

    #[test]
    fn a_panicking_closure_is_contained() {
        let pending = Pending::new(1);
        let guard = Arc::new(());
        let g = guard.clone();
        let data = pending
            .register(
                DeviceId(0),
                Box::new(move |_| {
                    let _g = g;
                    panic!("boom");
                }),
            )
            .unwrap();
        // SAFETY: `data` is fresh from `register` and used once.
        unsafe { trampoline(data) };
        assert_eq!(Arc::strong_count(&guard), 1);
    }
}
