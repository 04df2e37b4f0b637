//! Device memory, copies and memsets, pointer attributes, pinned and registered host memory.

use std::ffi::{c_int, c_uint, c_void};

use gpualloc_runtime::{Backend, DevicePtr, HostRegisterFlags};

use crate::abi::*;
use crate::errors::sim_err;
use crate::state::{call, lock, out, Needs, PinnedRange};

/// `cuMemAlloc_v2`.
///
/// # Safety
/// `dptr` must be null or writable.
#[no_mangle]
pub unsafe extern "C" fn cuMemAlloc_v2(dptr: *mut CUdeviceptr, bytesize: usize) -> CUresult {
    call("cuMemAlloc_v2", Needs::Context, |emu, d| {
        if dptr.is_null() || bytesize == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let p = emu.sim.malloc(d, bytesize as u64).map_err(sim_err)?;
        out(dptr, p.0)
    })
}

/// `cuMemFree_v2`: synchronizes the device first; an unknown or freed pointer is
/// `CUDA_ERROR_INVALID_VALUE`.
#[no_mangle]
pub extern "C" fn cuMemFree_v2(dptr: CUdeviceptr) -> CUresult {
    call("cuMemFree_v2", Needs::Context, |emu, _| {
        let owner = emu
            .sim
            .pointer_device(DevicePtr(dptr))
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        if emu.sim.opened_by_another_process(DevicePtr(dptr)) {
            // Docs (cuIpcOpenMemHandle): "the exporting process must not free the memory
            // while an importing process is still using it" — undefined behaviour on the
            // driver (the importer reads or corrupts whatever reuses the pages). Reported as
            // loudly as possible: the exporter aborts, which fails any test.
            eprintln!(
                "gpualloc emulated CUDA driver: cuMemFree({dptr:#x}) while another process has \
                 the allocation open through its IPC handle (undefined behaviour on the \
                 driver); aborting"
            );
            std::process::abort();
        }
        if emu.free_without_sync {
            emu.sim.free_without_sync(owner, DevicePtr(dptr))
        } else {
            emu.sim.free(owner, DevicePtr(dptr))
        }
        .map_err(sim_err)
    })
}

/// `cuMemGetInfo_v2` of the current context's device.
///
/// # Safety
/// `free` and `total` must be null or writable.
#[no_mangle]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CUresult {
    call("cuMemGetInfo_v2", Needs::Context, |emu, d| {
        let info = emu.sim.mem_info(d).map_err(sim_err)?;
        out(free, info.free as usize)?;
        out(total, info.total as usize)
    })
}

/// `cuMemGetAddressRange_v2`.
///
/// # Safety
/// `pbase` and `psize` must each be null (not wanted) or writable.
#[no_mangle]
pub unsafe extern "C" fn cuMemGetAddressRange_v2(
    pbase: *mut CUdeviceptr,
    psize: *mut usize,
    dptr: CUdeviceptr,
) -> CUresult {
    call("cuMemGetAddressRange_v2", Needs::Context, |emu, _| {
        let (base, size) = emu
            .sim
            .mem_address_range(DevicePtr(dptr))
            .map_err(|_| CUDA_ERROR_NOT_FOUND)?;
        if !pbase.is_null() {
            out(pbase, base.0)?;
        }
        if !psize.is_null() {
            out(psize, size as usize)?;
        }
        Ok(())
    })
}

/// `cuMemsetD8Async`.
#[no_mangle]
pub extern "C" fn cuMemsetD8Async(
    dst: CUdeviceptr,
    value: u8,
    n: usize,
    stream: CUstream,
) -> CUresult {
    call("cuMemsetD8Async", Needs::Context, |emu, d| {
        let s = emu.work_stream(stream, d)?;
        emu.device_work(dst, n as u64, s.device)?;
        emu.sim
            .memset_async(s, DevicePtr(dst), value, n as u64)
            .map_err(sim_err)
    })
}

/// `cuMemcpyAsync` (unified addressing: device or host memory on either side). A host side
/// that is not page-locked for this context is recorded as pageable, as for the typed copies:
/// the driver stages such a copy synchronously.
#[no_mangle]
pub extern "C" fn cuMemcpyAsync(
    dst: CUdeviceptr,
    src: CUdeviceptr,
    n: usize,
    stream: CUstream,
) -> CUresult {
    call("cuMemcpyAsync", Needs::Context, |emu, d| {
        let s = emu.work_stream(stream, d)?;
        // Unified addressing: a side in device memory is the device's (work on it must be
        // allowed: see `device_work`); any other is host memory. A freed device pointer looks
        // like host memory here and is refused by the copy itself (`CUDA_ERROR_INVALID_VALUE`):
        // only the typed copies know which side is the device's.
        for side in [dst, src] {
            if n == 0 {
                continue;
            }
            if emu.sim.pointer_device(DevicePtr(side)).is_some() {
                emu.device_work(side, n as u64, s.device)?;
            } else {
                emu.note_host_side(side as usize, n, d);
            }
        }
        emu.sim.memcpy_async(s, dst, src, n as u64).map_err(sim_err)
    })
}

/// `cuMemcpyDtoDAsync_v2`.
#[no_mangle]
pub extern "C" fn cuMemcpyDtoDAsync_v2(
    dst: CUdeviceptr,
    src: CUdeviceptr,
    n: usize,
    stream: CUstream,
) -> CUresult {
    call("cuMemcpyDtoDAsync_v2", Needs::Context, |emu, d| {
        let s = emu.work_stream(stream, d)?;
        emu.device_work(src, n as u64, s.device)?;
        emu.device_work(dst, n as u64, s.device)?;
        emu.sim.memcpy_async(s, dst, src, n as u64).map_err(sim_err)
    })
}

/// `cuMemcpyHtoDAsync_v2`: asynchronous from page-locked memory; from pageable memory the
/// driver stages the bytes before returning, and so does the emulator.
///
/// # Safety
/// `src` must be readable for `n` bytes.
#[no_mangle]
pub unsafe extern "C" fn cuMemcpyHtoDAsync_v2(
    dst: CUdeviceptr,
    src: *const c_void,
    n: usize,
    stream: CUstream,
) -> CUresult {
    call("cuMemcpyHtoDAsync_v2", Needs::Context, |emu, d| {
        let s = emu.work_stream(stream, d)?;
        if n == 0 {
            return Ok(());
        }
        if src.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        emu.note_host_side(src as usize, n, d);
        emu.device_work(dst, n as u64, s.device)?;
        if emu.sim.memcpy_async(s, dst, src as u64, n as u64).is_ok() {
            return Ok(());
        }
        // SAFETY: non-null, and the caller guarantees `n` readable bytes at `src`.
        let bytes = unsafe { std::slice::from_raw_parts(src.cast::<u8>(), n) };
        emu.sim
            .copy_to_device(s, DevicePtr(dst), bytes)
            .map_err(sim_err)
    })
}

/// `cuMemcpyDtoHAsync_v2`: asynchronous into page-locked memory; into pageable memory it
/// completes before returning.
///
/// # Safety
/// `dst` must be writable for `n` bytes.
#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoHAsync_v2(
    dst: *mut c_void,
    src: CUdeviceptr,
    n: usize,
    stream: CUstream,
) -> CUresult {
    call("cuMemcpyDtoHAsync_v2", Needs::Context, |emu, d| {
        let s = emu.work_stream(stream, d)?;
        if n == 0 {
            return Ok(());
        }
        if dst.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        emu.note_host_side(dst as usize, n, d);
        emu.device_work(src, n as u64, s.device)?;
        if emu.sim.memcpy_async(s, dst as u64, src, n as u64).is_ok() {
            return Ok(());
        }
        // SAFETY: non-null, and the caller guarantees `n` writable bytes at `dst`.
        let bytes = unsafe { std::slice::from_raw_parts_mut(dst.cast::<u8>(), n) };
        emu.sim
            .copy_from_device(s, bytes, DevicePtr(src))
            .map_err(sim_err)
    })
}

/// `CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL`.
const POINTER_DEVICE_ORDINAL: c_int = 9;

/// `cuPointerGetAttribute`: the device ordinal of device memory; other attributes are not
/// emulated.
///
/// # Safety
/// `data` must be null or writable for the attribute's type (an `int` for the ordinal).
#[no_mangle]
pub unsafe extern "C" fn cuPointerGetAttribute(
    data: *mut c_void,
    attribute: c_int,
    ptr: CUdeviceptr,
) -> CUresult {
    call("cuPointerGetAttribute", Needs::Init, |emu, _| {
        if attribute != POINTER_DEVICE_ORDINAL {
            crate::unsupported::once("cuPointerGetAttribute (this attribute)");
            return Err(CUDA_ERROR_NOT_SUPPORTED);
        }
        // An opened IPC mapping is the exporter's memory: its device, not the opener's.
        if let Some(o) = lock(&emu.ipc_opened).get(&ptr).copied() {
            return out(data.cast::<c_int>(), o.owner as c_int);
        }
        let d = emu
            .sim
            .pointer_device(DevicePtr(ptr))
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        out(data.cast::<c_int>(), d.0 as c_int)
    })
}

/// `cuMemHostAlloc` (flags: portable, device map, write-combined are accepted).
///
/// # Safety
/// `pp` must be null or writable.
#[no_mangle]
pub unsafe extern "C" fn cuMemHostAlloc(
    pp: *mut *mut c_void,
    bytesize: usize,
    flags: c_uint,
) -> CUresult {
    call("cuMemHostAlloc", Needs::Context, |emu, d| {
        if flags & !0x7 != 0 || bytesize == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let p = emu.sim.host_alloc(bytesize as u64).map_err(sim_err)?;
        lock(&emu.pinned).push(PinnedRange {
            start: p as usize,
            len: bytesize,
            portable: flags & 1 != 0,
            device: d.0,
        });
        out(pp, p.cast::<c_void>())
    })
}

/// `cuMemFreeHost`.
#[no_mangle]
pub extern "C" fn cuMemFreeHost(p: *mut c_void) -> CUresult {
    call("cuMemFreeHost", Needs::Context, |emu, _| {
        emu.sim.host_free(p.cast::<u8>()).map_err(sim_err)?;
        lock(&emu.pinned).retain(|r| r.start != p as usize);
        Ok(())
    })
}

/// `cuMemHostRegister_v2`.
#[no_mangle]
pub extern "C" fn cuMemHostRegister_v2(p: *mut c_void, bytesize: usize, flags: c_uint) -> CUresult {
    call("cuMemHostRegister_v2", Needs::Context, |emu, d| {
        if flags & !0xf != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let range = PinnedRange {
            start: p as usize,
            len: bytesize,
            portable: flags & 1 != 0,
            device: d.0,
        };
        let flags = HostRegisterFlags {
            portable: flags & 1 != 0,
            device_map: flags & 2 != 0,
            read_only: flags & 8 != 0,
        };
        // SAFETY: the driver API's contract for `cuMemHostRegister` is the backend's: the
        // caller keeps the range mapped until it unregisters it.
        unsafe {
            emu.sim
                .host_register(p.cast::<u8>(), bytesize as u64, flags)
        }
        .map_err(|e| match e {
            gpualloc_runtime::BackendError::InvalidValue(m) if m.contains("already") => {
                CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED
            }
            e => sim_err(e),
        })?;
        lock(&emu.pinned).push(range);
        Ok(())
    })
}

/// `cuMemHostUnregister`.
#[no_mangle]
pub extern "C" fn cuMemHostUnregister(p: *mut c_void) -> CUresult {
    call("cuMemHostUnregister", Needs::Context, |emu, _| {
        emu.sim
            .host_unregister(p.cast::<u8>())
            .map_err(|_| CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED)?;
        lock(&emu.pinned).retain(|r| r.start != p as usize);
        Ok(())
    })
}

/// Not a driver function: how many async copies so far had a host side that was not pinned
/// for the copying context (pageable, or registered without `PORTABLE` in another context).
/// The driver stages such copies synchronously; tests read this to catch it.
#[no_mangle]
pub extern "C" fn gpualloc_emu_pageable_copies() -> u64 {
    crate::state::emu().map_or(0, |e| {
        e.pageable_copies.load(std::sync::atomic::Ordering::Relaxed)
    })
}
