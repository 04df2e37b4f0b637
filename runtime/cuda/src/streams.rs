//! Streams, events, host functions and stream-ordered copies of the CUDA backend.
//!
//! Streams are cudarc [`CudaStream`]s (non-blocking, from `cuStreamCreate`) kept in the
//! backend's registry; destroying our handle drops our reference, and the driver stream is
//! destroyed when the last holder (us or a cudarc user) lets go. Events are created with
//! `CU_EVENT_DISABLE_TIMING` and destroyed when their last registry reference goes.

use std::sync::Arc;

use cudarc::driver::safe::{CudaContext, CudaStream};
use cudarc::driver::sys::{self, CUresult};

use super::backend::CudaBackend;
use super::context::bind;
use super::error::{catch, drv, from_driver_error, map_code};
use super::hostfn::{trampoline, Pending};
use super::validate::range;
use gpualloc_runtime::error::{BackendError, Result};
use gpualloc_runtime::types::{DeviceId, DevicePtr, EventHandle, HostFn, StreamHandle};

/// A driver event and the context it was created in.
pub(crate) struct CuEvent {
    raw: sys::CUevent,
    ctx: Arc<CudaContext>,
}

// SAFETY: a CUevent is an opaque driver handle that the driver lets any thread use; we never
// dereference it, and `Arc<CudaContext>` is itself Send + Sync.
unsafe impl Send for CuEvent {}
// SAFETY: as above; every operation on the handle is a thread-safe driver call.
unsafe impl Sync for CuEvent {}

impl Drop for CuEvent {
    fn drop(&mut self) {
        let raw = self.raw;
        let r = bind(&self.ctx).and_then(|()| {
            drv("cuEventDestroy", || {
                // SAFETY: `raw` was created by cuEventCreate and this is its only destroy
                // (the last registry reference is being dropped). A pending record still
                // completes for streams waiting on it, as the driver documents.
                unsafe { sys::cuEventDestroy_v2(raw) }
            })
        });
        if let Err(e) = r {
            tracing::warn!(error = %e, "cuEventDestroy failed");
        }
    }
}

impl CudaBackend {
    /// The live stream named by `handle`, with its device's context bound on this thread.
    pub(crate) fn bound_stream(&self, handle: StreamHandle) -> Result<Arc<CudaStream>> {
        self.health.check(handle.device)?;
        let s = self.streams.get(handle.device, handle.raw)?;
        bind(s.context())?;
        Ok(s)
    }

    fn bound_event(&self, handle: EventHandle) -> Result<Arc<CuEvent>> {
        self.health.check(handle.device)?;
        let e = self.events.get(handle.device, handle.raw)?;
        bind(&e.ctx)?;
        Ok(e)
    }

    pub(crate) fn cu_stream_create(&self, device: DeviceId) -> Result<StreamHandle> {
        let ctx = self.bind_device(device)?;
        // cudarc records errors of its own drops in the context and reports them on the next
        // safe-layer call; log and clear any, so they do not fail this unrelated create.
        if let Err(e) = ctx.check_err() {
            tracing::warn!(error = ?e, "earlier cudarc drop on {device} failed");
        }
        let s = catch("cuStreamCreate", || ctx.new_stream())?
            .map_err(|e| from_driver_error("cuStreamCreate", e))?;
        let raw = self.streams.fresh();
        self.streams.insert(device, raw, s)?;
        Ok(StreamHandle { device, raw })
    }

    pub(crate) fn cu_stream_destroy(&self, handle: StreamHandle) -> Result<()> {
        // The `Arc` (if it was ours alone, the driver stream) is dropped here, outside the
        // registry lock; cuStreamDestroy lets queued work finish first.
        let Some(s) = self.streams.remove(handle.device, handle.raw)? else {
            return Ok(());
        };
        if Arc::strong_count(&s) == 1 {
            // cudarc's drop binds through `bind_to_thread`, which gives up without binding
            // when an earlier cudarc drop left an error in the context: the destroy then runs
            // in whatever context the thread has (none, on a runtime worker), fails, and the
            // stream stays. Clear such an error (logged) and bind the stream's context here.
            let ctx = s.context();
            if let Err(e) = ctx.check_err() {
                tracing::warn!(error = ?e, "earlier cudarc drop on {} failed", handle.device);
            }
            bind(ctx)?;
        }
        drop(s);
        Ok(())
    }

    pub(crate) fn cu_stream_synchronize(&self, handle: StreamHandle) -> Result<()> {
        let s = self.bound_stream(handle)?;
        drv("cuStreamSynchronize", || {
            // SAFETY: `s` is a live stream (we hold an `Arc` of it) of the bound context.
            unsafe { sys::cuStreamSynchronize(s.cu_stream()) }
        })
    }

    pub(crate) fn cu_stream_query(&self, handle: StreamHandle) -> Result<bool> {
        let s = self.bound_stream(handle)?;
        let code = catch("cuStreamQuery", || {
            // SAFETY: `s` is a live stream (we hold an `Arc` of it) of the bound context.
            unsafe { sys::cuStreamQuery(s.cu_stream()) }
        })?;
        match code {
            CUresult::CUDA_SUCCESS => Ok(true),
            CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            other => Err(map_code("cuStreamQuery", other)),
        }
    }

    pub(crate) fn cu_stream_wait_event(
        &self,
        stream: StreamHandle,
        event: EventHandle,
    ) -> Result<()> {
        let e = self.events.get(event.device, event.raw)?;
        let s = self.bound_stream(stream)?;
        drv("cuStreamWaitEvent", || {
            // SAFETY: both handles are live (we hold `Arc`s of them); waiting on an event of
            // another device's context is allowed by the driver.
            unsafe { sys::cuStreamWaitEvent(s.cu_stream(), e.raw, 0) }
        })
    }

    pub(crate) fn cu_launch_host_func(&self, handle: StreamHandle, f: HostFn) -> Result<()> {
        let s = self.bound_stream(handle)?;
        self.health.ensure_watchdog(&self.contexts);
        super::hostfn::ensure_runner();
        let data = self.health.pending.register(handle.device, f)?;
        self.health.launched();
        let r = catch("cuLaunchHostFunc", || {
            // SAFETY: `s` is a live stream; `trampoline` matches CUhostFn and takes the
            // reference to the slot that `data` owns, exactly once when the driver runs it.
            unsafe { sys::cuLaunchHostFunc(s.cu_stream(), Some(trampoline), data) }
        });
        match r {
            Ok(CUresult::CUDA_SUCCESS) => Ok(()),
            other => {
                // SAFETY: the launch failed, so the driver will never call `trampoline` with
                // `data`; it is still ours to cancel, once.
                if !unsafe { Pending::cancel(data) } {
                    // The watchdog found the device lost meanwhile and called the closure
                    // with that error: reported once, through the closure.
                    return Ok(());
                }
                Err(match other {
                    Ok(code) => map_code("cuLaunchHostFunc", code),
                    Err(e) => e,
                })
            }
        }
    }

    pub(crate) fn cu_memcpy_async(
        &self,
        stream: StreamHandle,
        dst: u64,
        src: u64,
        len: u64,
    ) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        let bytes = range("memcpy_async", dst, len)?;
        range("memcpy_async", src, len)?;
        let s = self.bound_stream(stream)?;
        drv("cuMemcpyAsync", || {
            // SAFETY: the ranges are non-null and do not wrap (checked above). The trait's
            // contract is that both are device or page-locked host memory (unified
            // addressing) that the caller keeps alive until the stream passes this copy;
            // device addresses the driver does not know are CUDA_ERROR_INVALID_VALUE. (A
            // plain host address cannot be told apart here: the contract is the caller's.)
            unsafe { sys::cuMemcpyAsync(dst, src, bytes, s.cu_stream()) }
        })
    }

    pub(crate) fn cu_memset_async(
        &self,
        stream: StreamHandle,
        dst: DevicePtr,
        value: u8,
        len: u64,
    ) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        let bytes = range("memset_async", dst.0, len)?;
        let s = self.bound_stream(stream)?;
        drv("cuMemsetD8Async", || {
            // SAFETY: the driver validates that `[dst, dst + len)` is device memory; the
            // caller keeps it alive until the stream passes this memset.
            unsafe { sys::cuMemsetD8Async(dst.0, value, bytes, s.cu_stream()) }
        })
    }

    pub(crate) fn cu_copy_to_device(
        &self,
        stream: StreamHandle,
        dst: DevicePtr,
        src: &[u8],
    ) -> Result<()> {
        if src.is_empty() {
            return Ok(());
        }
        let bytes = range("copy_to_device", dst.0, src.len() as u64)?;
        let s = self.bound_stream(stream)?;
        drv("cuMemcpyHtoDAsync", || {
            // SAFETY: `src` is a live borrowed slice of `bytes` bytes; we synchronize the
            // stream below before the borrow ends (if that fails the context has a sticky
            // error and runs no further work). The driver validates `dst`.
            unsafe { sys::cuMemcpyHtoDAsync_v2(dst.0, src.as_ptr().cast(), bytes, s.cu_stream()) }
        })?;
        self.sync_bound(&s)
    }

    pub(crate) fn cu_copy_from_device(
        &self,
        stream: StreamHandle,
        dst: &mut [u8],
        src: DevicePtr,
    ) -> Result<()> {
        if dst.is_empty() {
            return Ok(());
        }
        let bytes = range("copy_from_device", src.0, dst.len() as u64)?;
        let s = self.bound_stream(stream)?;
        drv("cuMemcpyDtoHAsync", || {
            // SAFETY: `dst` is a live, exclusively borrowed slice of `bytes` bytes; we
            // synchronize the stream below before the borrow ends (if that fails the context
            // has a sticky error and runs no further work). The driver validates `src`.
            unsafe {
                sys::cuMemcpyDtoHAsync_v2(dst.as_mut_ptr().cast(), src.0, bytes, s.cu_stream())
            }
        })?;
        self.sync_bound(&s)
    }

    fn sync_bound(&self, s: &CudaStream) -> Result<()> {
        drv("cuStreamSynchronize", || {
            // SAFETY: `s` is a live stream of the bound context (the caller holds its `Arc`).
            unsafe { sys::cuStreamSynchronize(s.cu_stream()) }
        })
    }

    pub(crate) fn cu_event_create(&self, device: DeviceId) -> Result<EventHandle> {
        let ctx = self.bind_device(device)?.clone();
        let mut raw: sys::CUevent = std::ptr::null_mut();
        // Blocking sync: a host wait on the event (`event_synchronize`) sleeps in the
        // driver instead of spinning a CPU core until the event completes.
        let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32
            | sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC as u32;
        drv("cuEventCreate", || {
            // SAFETY: `raw` is a valid out-pointer; the device's context is current.
            unsafe { sys::cuEventCreate(&mut raw, flags) }
        })?;
        let handle = EventHandle {
            device,
            raw: self.events.fresh(),
        };
        self.events
            .insert(device, handle.raw, Arc::new(CuEvent { raw, ctx }))?;
        Ok(handle)
    }

    pub(crate) fn cu_event_record(&self, event: EventHandle, stream: StreamHandle) -> Result<()> {
        if event.device != stream.device {
            return Err(BackendError::invalid(format!(
                "event_record: event of {} on a stream of {}",
                event.device, stream.device
            )));
        }
        let e = self.events.get(event.device, event.raw)?;
        let s = self.bound_stream(stream)?;
        drv("cuEventRecord", || {
            // SAFETY: both handles are live (we hold `Arc`s) and of the same, bound context.
            unsafe { sys::cuEventRecord(e.raw, s.cu_stream()) }
        })
    }

    pub(crate) fn cu_event_query(&self, event: EventHandle) -> Result<bool> {
        let e = self.bound_event(event)?;
        let code = catch("cuEventQuery", || {
            // SAFETY: `e` is a live event (we hold an `Arc`).
            unsafe { sys::cuEventQuery(e.raw) }
        })?;
        match code {
            CUresult::CUDA_SUCCESS => Ok(true),
            CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            other => Err(map_code("cuEventQuery", other)),
        }
    }

    pub(crate) fn cu_event_synchronize(&self, event: EventHandle) -> Result<()> {
        let e = self.bound_event(event)?;
        drv("cuEventSynchronize", || {
            // SAFETY: `e` is a live event (we hold an `Arc`).
            unsafe { sys::cuEventSynchronize(e.raw) }
        })
    }

    pub(crate) fn cu_event_destroy(&self, event: EventHandle) -> Result<()> {
        drop(self.events.remove(event.device, event.raw)?);
        Ok(())
    }
}
