//! One primary context per device, retained lazily, and binding it on the calling thread.
//!
//! A device's primary context (`cuDevicePrimaryCtxRetain`, through cudarc's
//! [`CudaContext::new`]) is retained on first use, so a process that only touches device 0
//! does not pay for a context on every GPU, and it is the context cudarc users share: buffers
//! and streams interoperate. Every raw call first binds the context of its device on the
//! calling thread ([`bind`]); backend methods are synchronous, so a binding never spans an
//! `.await`.

use std::sync::{Arc, OnceLock};

use cudarc::driver::safe::CudaContext;
use cudarc::driver::sys;

use super::error::{catch, drv, from_driver_error};
use gpualloc_runtime::error::{BackendError, Result};
use gpualloc_runtime::types::DeviceId;

/// Lazily retained primary contexts, one slot per device.
pub(crate) struct Contexts {
    slots: Vec<OnceLock<Arc<CudaContext>>>,
}

impl Contexts {
    /// Slots for `count` devices; nothing is retained yet.
    pub(crate) fn new(count: u32) -> Self {
        Contexts {
            slots: (0..count).map(|_| OnceLock::new()).collect(),
        }
    }

    /// Number of devices.
    pub(crate) fn count(&self) -> u32 {
        // The count came from a u32.
        self.slots.len() as u32
    }

    /// The slot of `device`, or [`BackendError::InvalidDevice`].
    fn slot(&self, device: DeviceId) -> Result<&OnceLock<Arc<CudaContext>>> {
        self.slots
            .get(device.0 as usize)
            .ok_or(BackendError::InvalidDevice(device.0))
    }

    /// Checks the ordinal without touching the driver.
    pub(crate) fn check(&self, device: DeviceId) -> Result<()> {
        self.slot(device).map(|_| ())
    }

    /// The primary context of `device` if this process retained it already.
    pub(crate) fn retained(&self, device: DeviceId) -> Option<&Arc<CudaContext>> {
        self.slot(device).ok()?.get()
    }

    /// The primary context of `device`, retained on first use.
    pub(crate) fn get(&self, device: DeviceId) -> Result<&Arc<CudaContext>> {
        let slot = self.slot(device)?;
        if let Some(ctx) = slot.get() {
            return Ok(ctx);
        }
        let ctx = catch("cuDevicePrimaryCtxRetain", || {
            CudaContext::new(device.0 as usize)
        })?
        .map_err(|e| from_driver_error("cuDevicePrimaryCtxRetain", e))?;
        // Two threads may race here; the loser's `Arc` is dropped, which releases its
        // retain of the same primary context (retains are reference counted by the driver).
        let _ = slot.set(ctx);
        slot.get()
            .ok_or_else(|| BackendError::Unavailable("context slot empty after set".into()))
    }
}

/// Makes `ctx` current on the calling thread (a no-op when it already is).
/// The context current on this thread when a backend call began, made current again when the
/// call ends ([`KeepCurrent::drop`]): the backend binds its primary contexts as it needs them,
/// and without this a user thread that also uses the CUDA runtime (or another library) would
/// find its current context, and so its device, silently switched after calling us.
pub(crate) struct KeepCurrent(Option<sys::CUcontext>);

impl KeepCurrent {
    /// Remembers the current context (none is remembered when the driver cannot say).
    pub(crate) fn new() -> KeepCurrent {
        let mut current: sys::CUcontext = std::ptr::null_mut();
        let read = drv("cuCtxGetCurrent", || {
            // SAFETY: `current` is a valid, writable out-pointer for the duration of the call.
            unsafe { sys::cuCtxGetCurrent(&mut current) }
        });
        KeepCurrent(read.ok().map(|()| current))
    }
}

impl Drop for KeepCurrent {
    fn drop(&mut self) {
        let Some(saved) = self.0 else {
            return;
        };
        let mut now: sys::CUcontext = std::ptr::null_mut();
        let read = drv("cuCtxGetCurrent", || {
            // SAFETY: as in `new`.
            unsafe { sys::cuCtxGetCurrent(&mut now) }
        });
        if read.is_ok() && now != saved {
            let _ = drv("cuCtxSetCurrent", || {
                // SAFETY: `saved` was current on this thread when the call began (or null,
                // which unbinds); a context the caller had current is still theirs to keep
                // alive, and the driver checks the value.
                unsafe { sys::cuCtxSetCurrent(saved) }
            });
        }
    }
}

pub(crate) fn bind(ctx: &CudaContext) -> Result<()> {
    let want = ctx.cu_ctx();
    let mut current: sys::CUcontext = std::ptr::null_mut();
    drv("cuCtxGetCurrent", || {
        // SAFETY: `current` is a valid, writable out-pointer for the duration of the call.
        unsafe { sys::cuCtxGetCurrent(&mut current) }
    })?;
    if current != want {
        drv("cuCtxSetCurrent", || {
            // SAFETY: `want` is a primary context retained by `ctx`, which the caller keeps
            // alive, so it is a valid context for the whole call.
            unsafe { sys::cuCtxSetCurrent(want) }
        })?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ordinals_are_checked_without_the_driver() {
        let c = Contexts::new(2);
        assert_eq!(c.count(), 2);
        assert!(c.check(DeviceId(1)).is_ok());
        assert_eq!(c.check(DeviceId(2)), Err(BackendError::InvalidDevice(2)));
        assert!(matches!(
            c.get(DeviceId(7)),
            Err(BackendError::InvalidDevice(7))
        ));
    }
}
