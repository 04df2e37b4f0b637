//! Device memory (`cuMemAlloc`/`cuMemFree`/`cuMemGetInfo`/`cuCtxSynchronize`) and pinned or
//! registered host memory (`cuMemHostAlloc`/`cuMemHostRegister`) of the CUDA backend.
//!
//! Allocation is synchronous on purpose: the caching allocator above owns reuse, so the
//! stream-ordered `cuMemAllocAsync` pool would only duplicate it.

use std::ffi::{c_int, c_void};

use cudarc::driver::sys;

use super::backend::CudaBackend;
use super::error::{catch, check, drv, with_request};
use super::validate::{alloc_size, host_range, host_register_flags, non_null};
use gpualloc_runtime::error::{BackendError, Result};
use gpualloc_runtime::types::{DeviceId, DevicePtr, HostRegisterFlags, MemInfo};

impl CudaBackend {
    pub(crate) fn cu_mem_info(&self, device: DeviceId) -> Result<MemInfo> {
        self.bind_device(device)?;
        let (mut free, mut total) = (0usize, 0usize);
        drv("cuMemGetInfo", || {
            // SAFETY: both out-pointers are valid and writable for the call; the device's
            // context is current on this thread.
            unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) }
        })?;
        Ok(MemInfo {
            free: free as u64,
            total: total as u64,
        })
    }

    /// `cuDeviceTotalMem`: needs no context, so it retains none.
    pub(crate) fn cu_total_memory(&self, device: DeviceId) -> Result<u64> {
        self.contexts.check(device)?;
        let ordinal = c_int::try_from(device.0)
            .map_err(|_| BackendError::invalid(format!("no such device {device}")))?;
        let mut total = 0usize;
        drv("cuDeviceTotalMem", || {
            // SAFETY: `total` is a valid out-pointer for the call; the driver is initialized
            // (the backend exists) and `ordinal` was checked against the device count.
            unsafe { sys::cuDeviceTotalMem_v2(&mut total, ordinal) }
        })?;
        Ok(total as u64)
    }

    /// `cuCtxEnablePeerAccess` of `peer`'s context from `device`'s (already enabled: fine).
    pub(crate) fn cu_enable_peer_access(&self, device: DeviceId, peer: DeviceId) -> Result<()> {
        if device == peer {
            return Err(BackendError::invalid(format!(
                "enable_peer_access: {device} and its peer are the same device"
            )));
        }
        let peer_ctx = self.contexts.get(peer)?.cu_ctx();
        self.bind_device(device)?;
        let r = catch("cuCtxEnablePeerAccess", || {
            // SAFETY: `peer_ctx` is the retained primary context of `peer` (held by this
            // backend for its lifetime); the flags must be 0.
            unsafe { sys::cuCtxEnablePeerAccess(peer_ctx, 0) }
        })?;
        match r {
            sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => Ok(()),
            other => check("cuCtxEnablePeerAccess", other),
        }
    }

    pub(crate) fn cu_malloc(&self, device: DeviceId, size: u64) -> Result<DevicePtr> {
        self.contexts.check(device)?;
        let bytes = alloc_size("malloc", size)?;
        self.bind_device(device)?;
        let mut ptr: sys::CUdeviceptr = 0;
        drv("cuMemAlloc", || {
            // SAFETY: `ptr` is a valid out-pointer; `bytes` is non-zero; the device's
            // context is current on this thread.
            unsafe { sys::cuMemAlloc_v2(&mut ptr, bytes) }
        })
        .map_err(|e| with_request(e, size, device.to_string()))?;
        Ok(DevicePtr(ptr))
    }

    pub(crate) fn cu_free(&self, device: DeviceId, ptr: DevicePtr) -> Result<()> {
        self.contexts.check(device)?;
        non_null("free", ptr.0)?;
        self.bind_device(device)?;
        let release = gpualloc_runtime::release_hooks::Release::Free {
            device,
            addr: ptr.0,
        };
        // The driver documents only that cuMemFree *may* synchronize: wait for the device's
        // queued work ourselves, so none of it still uses the memory when it goes (the rule
        // `Backend::free` states, and the cache's release path relies on), and before the
        // release hooks, whose deregistrations (NCCL's) must not run under queued work.
        drv("cuCtxSynchronize", || {
            // SAFETY: no arguments; synchronizes the context current on this thread.
            unsafe { sys::cuCtxSynchronize() }
        })?;
        self.release_hooks.around(release, || {
            // A hook may have made another context current (NCCL binds its device's).
            self.bind_device(device)?;
            drv("cuMemFree", || {
                // SAFETY: cuMemFree takes the address by value and validates it (an address
                // that is not a live allocation is CUDA_ERROR_INVALID_VALUE); the device was
                // synchronized just above, so no queued work still uses the memory.
                unsafe { sys::cuMemFree_v2(ptr.0) }
            })
        })
    }

    pub(crate) fn cu_device_synchronize(&self, device: DeviceId) -> Result<()> {
        self.bind_device(device)?;
        drv("cuCtxSynchronize", || {
            // SAFETY: no arguments; synchronizes the context current on this thread.
            unsafe { sys::cuCtxSynchronize() }
        })
    }

    pub(crate) fn cu_host_alloc(&self, size: u64) -> Result<*mut u8> {
        let bytes = alloc_size("host_alloc", size)?;
        self.bind_any()?;
        let mut ptr: *mut c_void = std::ptr::null_mut();
        drv("cuMemHostAlloc", || {
            // SAFETY: `ptr` is a valid out-pointer; `bytes` is non-zero; a context is current.
            // PORTABLE makes the memory pinned for every context, not just the current one.
            unsafe { sys::cuMemHostAlloc(&mut ptr, bytes, sys::CU_MEMHOSTALLOC_PORTABLE) }
        })
        .map_err(|e| with_request(e, size, "pinned host"))?;
        if ptr.is_null() {
            return Err(BackendError::OutOfMemory {
                requested: size,
                what: "pinned host".into(),
            });
        }
        Ok(ptr.cast())
    }

    pub(crate) fn cu_host_free(&self, ptr: *mut u8) -> Result<()> {
        non_null("host_free", ptr as usize as u64)?;
        self.bind_any()?;
        drv("cuMemFreeHost", || {
            // SAFETY: the driver validates that `ptr` came from cuMemHostAlloc (otherwise
            // CUDA_ERROR_INVALID_VALUE); the caller gives up the memory with this call.
            unsafe { sys::cuMemFreeHost(ptr.cast()) }
        })
    }

    pub(crate) fn cu_host_register(
        &self,
        ptr: *mut u8,
        len: u64,
        flags: HostRegisterFlags,
    ) -> Result<()> {
        let bytes = host_range("host_register", ptr, len)?;
        self.bind_any()?;
        drv("cuMemHostRegister", || {
            // SAFETY: `[ptr, ptr + bytes)` is a non-null, non-empty, non-wrapping range
            // (checked above); the driver checks that it is mapped memory of this process
            // and only page-locks it, never writes through it.
            unsafe { sys::cuMemHostRegister_v2(ptr.cast(), bytes, host_register_flags(flags)) }
        })
        .map_err(|e| with_request(e, len, "registered host"))
    }

    pub(crate) fn cu_host_unregister(&self, ptr: *mut u8) -> Result<()> {
        non_null("host_unregister", ptr as usize as u64)?;
        self.bind_any()?;
        drv("cuMemHostUnregister", || {
            // SAFETY: the driver validates that `ptr` starts a registered range (otherwise
            // CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED); unregistering does not touch its bytes.
            unsafe { sys::cuMemHostUnregister(ptr.cast()) }
        })
    }
}
