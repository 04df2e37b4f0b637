//! Virtual memory management (reserve, create, map, set access, export/import as POSIX fds)
//! and legacy IPC handles, on the sim's real reservations and memfds.

use std::ffi::{c_int, c_uint, c_void};
use std::os::fd::{BorrowedFd, IntoRawFd, OwnedFd};

use gpualloc_runtime::{Backend, DeviceId, DevicePtr, IpcMemHandle};

use crate::abi::*;
use crate::errors::sim_err;
use crate::state::{call, lock, out, IpcOpened, Needs};

/// `CU_MEM_LOCATION_TYPE_DEVICE`.
const LOCATION_DEVICE: c_uint = 1;
/// `CU_MEM_ALLOCATION_TYPE_PINNED`.
const ALLOCATION_PINNED: c_uint = 1;
/// `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`.
const HANDLE_POSIX_FD: c_uint = 1;
/// `CU_MEM_ACCESS_FLAGS_PROT_READWRITE`.
const ACCESS_READWRITE: c_uint = 3;

/// The device a `CUmemAllocationProp` names, checked.
///
/// # Safety
/// `prop` must be null or point to a readable `CUmemAllocationProp`.
unsafe fn prop_device(
    prop: *const CUmemAllocationProp,
    devices: u32,
) -> Result<DeviceId, CUresult> {
    if prop.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: non-null and readable by the caller's contract; all fields are plain integers
    // or a pointer we do not follow.
    let prop = unsafe { prop.read() };
    let id = u32::try_from(prop.location.id).map_err(|_| CUDA_ERROR_INVALID_DEVICE)?;
    if prop.type_ != ALLOCATION_PINNED || prop.location.type_ != LOCATION_DEVICE {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    if prop.requested_handle_types & !HANDLE_POSIX_FD != 0 {
        return Err(CUDA_ERROR_NOT_SUPPORTED);
    }
    if id >= devices {
        return Err(CUDA_ERROR_INVALID_DEVICE);
    }
    Ok(DeviceId(id))
}

/// `cuMemGetAllocationGranularity` (minimum and recommended are the same).
///
/// # Safety
/// `granularity` must be null or writable; `prop` null or readable.
#[no_mangle]
pub unsafe extern "C" fn cuMemGetAllocationGranularity(
    granularity: *mut usize,
    prop: *const CUmemAllocationProp,
    option: c_uint,
) -> CUresult {
    call("cuMemGetAllocationGranularity", Needs::Init, |emu, _| {
        // SAFETY: forwarded with the caller's guarantee.
        let d = unsafe { prop_device(prop, emu.devices) }?;
        if option > 1 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let g = emu.sim.vmm_granularity(d).map_err(sim_err)?;
        out(granularity, g as usize)
    })
}

/// `cuMemAddressReserve` (no fixed address requests; `flags` must be 0).
///
/// # Safety
/// `ptr` must be null or writable.
#[no_mangle]
pub unsafe extern "C" fn cuMemAddressReserve(
    ptr: *mut CUdeviceptr,
    size: usize,
    alignment: usize,
    addr: CUdeviceptr,
    flags: u64,
) -> CUresult {
    call("cuMemAddressReserve", Needs::Context, |emu, d| {
        if flags != 0 || ptr.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        if addr != 0 {
            crate::unsupported::once("cuMemAddressReserve (fixed address)");
        }
        let p = emu
            .sim
            .va_reserve(d, size as u64, alignment as u64)
            .map_err(sim_err)?;
        out(ptr, p.0)
    })
}

/// `cuMemAddressFree`: the whole reservation, exactly.
#[no_mangle]
pub extern "C" fn cuMemAddressFree(ptr: CUdeviceptr, size: usize) -> CUresult {
    call("cuMemAddressFree", Needs::Context, |emu, d| {
        emu.sim
            .va_free(d, DevicePtr(ptr), size as u64)
            .map_err(sim_err)
    })
}

/// `cuMemCreate` (counts against the device's memory, as `cuMemAlloc` does).
///
/// # Safety
/// `handle` must be null or writable; `prop` null or readable.
#[no_mangle]
pub unsafe extern "C" fn cuMemCreate(
    handle: *mut CUmemGenericAllocationHandle,
    size: usize,
    prop: *const CUmemAllocationProp,
    flags: u64,
) -> CUresult {
    call("cuMemCreate", Needs::Context, |emu, _| {
        // SAFETY: forwarded with the caller's guarantee.
        let d = unsafe { prop_device(prop, emu.devices) }?;
        if flags != 0 || handle.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let h = emu.sim.phys_create(d, size as u64).map_err(sim_err)?;
        lock(&emu.phys).insert(h.raw, h);
        out(handle, h.raw)
    })
}

/// `cuMemRelease`: a handle still mapped is released when its last mapping goes (the sim
/// defers it, as the driver does).
#[no_mangle]
pub extern "C" fn cuMemRelease(handle: CUmemGenericAllocationHandle) -> CUresult {
    call("cuMemRelease", Needs::Context, |emu, _| {
        let h = lock(&emu.phys)
            .remove(&handle)
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        emu.sim.phys_release(h).map_err(sim_err)
    })
}

/// `cuMemMap`. Docs: "offset - Offset into the memory represented by handle from which to
/// start mapping. Note: currently must be zero"; "flags - currently unused, must be zero".
#[no_mangle]
pub extern "C" fn cuMemMap(
    ptr: CUdeviceptr,
    size: usize,
    offset: usize,
    handle: CUmemGenericAllocationHandle,
    flags: u64,
) -> CUresult {
    call("cuMemMap", Needs::Context, |emu, _| {
        if flags != 0 || offset != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let h = *lock(&emu.phys)
            .get(&handle)
            .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        emu.sim
            .map(DevicePtr(ptr), size as u64, offset as u64, h)
            .map_err(sim_err)?;
        lock(&emu.vmm_access).insert(ptr, (size as u64, 0));
        Ok(())
    })
}

/// `cuMemUnmap`: exactly whole mappings.
#[no_mangle]
pub extern "C" fn cuMemUnmap(ptr: CUdeviceptr, size: usize) -> CUresult {
    call("cuMemUnmap", Needs::Context, |emu, _| {
        emu.sim
            .unmap(DevicePtr(ptr), size as u64)
            .map_err(sim_err)?;
        let end = ptr + size as u64;
        let mut maps = lock(&emu.vmm_access);
        let gone: Vec<u64> = maps.range(ptr..end).map(|(s, _)| *s).collect();
        for s in gone {
            maps.remove(&s);
        }
        Ok(())
    })
}

/// `cuMemSetAccess`: read/write for devices; until it is called the range is not
/// accessible.
///
/// # Safety
/// `desc` must be null or readable for `count` descriptors.
#[no_mangle]
pub unsafe extern "C" fn cuMemSetAccess(
    ptr: CUdeviceptr,
    size: usize,
    desc: *const CUmemAccessDesc,
    count: usize,
) -> CUresult {
    call("cuMemSetAccess", Needs::Context, |emu, _| {
        if desc.is_null() || count == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: non-null and readable for `count` descriptors by the caller's contract.
        let descs = unsafe { std::slice::from_raw_parts(desc, count) };
        for dsc in descs {
            let id = u32::try_from(dsc.location.id).map_err(|_| CUDA_ERROR_INVALID_DEVICE)?;
            if dsc.location.type_ != LOCATION_DEVICE || dsc.flags != ACCESS_READWRITE {
                crate::unsupported::once("cuMemSetAccess (other than device read/write)");
                return Err(CUDA_ERROR_NOT_SUPPORTED);
            }
            if id >= emu.devices {
                return Err(CUDA_ERROR_INVALID_DEVICE);
            }
            emu.sim
                .set_access(DeviceId(id), DevicePtr(ptr), size as u64)
                .map_err(sim_err)?;
            let end = ptr + size as u64;
            for (_, (_, mask)) in lock(&emu.vmm_access).range_mut(ptr..end) {
                *mask |= 1u64 << id.min(63);
            }
        }
        Ok(())
    })
}

/// `cuMemExportToShareableHandle` (POSIX fds only; the caller owns the new fd).
///
/// # Safety
/// `shareable` must be null or writable for an `int`.
#[no_mangle]
pub unsafe extern "C" fn cuMemExportToShareableHandle(
    shareable: *mut c_void,
    handle: CUmemGenericAllocationHandle,
    handle_type: c_uint,
    flags: u64,
) -> CUresult {
    call("cuMemExportToShareableHandle", Needs::Context, |emu, _| {
        if handle_type != HANDLE_POSIX_FD {
            return Err(CUDA_ERROR_NOT_SUPPORTED);
        }
        if flags != 0 || shareable.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let h = *lock(&emu.phys)
            .get(&handle)
            .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        let fd = emu.sim.phys_export_fd(h).map_err(sim_err)?;
        out(shareable.cast::<c_int>(), fd.into_raw_fd())
    })
}

/// `cuMemImportFromShareableHandle` (POSIX fds, passed as the pointer's value; the fd stays
/// the caller's).
///
/// # Safety
/// `handle` must be null or writable.
#[no_mangle]
pub unsafe extern "C" fn cuMemImportFromShareableHandle(
    handle: *mut CUmemGenericAllocationHandle,
    os_handle: *mut c_void,
    handle_type: c_uint,
) -> CUresult {
    call(
        "cuMemImportFromShareableHandle",
        Needs::Context,
        |emu, d| {
            if handle_type != HANDLE_POSIX_FD {
                return Err(CUDA_ERROR_NOT_SUPPORTED);
            }
            if handle.is_null() {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
            let raw = c_int::try_from(os_handle as isize).map_err(|_| CUDA_ERROR_INVALID_VALUE)?;
            if raw < 0 {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
            // SAFETY: the caller passes an open fd it keeps owning; we only borrow it to
            // duplicate it, and the duplicate is ours.
            let fd: OwnedFd = unsafe { BorrowedFd::borrow_raw(raw) }
                .try_clone_to_owned()
                .map_err(|_| CUDA_ERROR_INVALID_VALUE)?;
            let h = emu.sim.phys_import_fd(d, fd).map_err(sim_err)?;
            lock(&emu.phys).insert(h.raw, h);
            out(handle, h.raw)
        },
    )
}

/// `cuIpcGetMemHandle` (of a `cuMemAlloc` allocation). Docs: "Takes a pointer to the base
/// of an existing device memory allocation previously allocated with cuMemAlloc": a pointer
/// inside one is `CUDA_ERROR_INVALID_VALUE`.
///
/// # Safety
/// `handle` must be null or writable.
#[no_mangle]
pub unsafe extern "C" fn cuIpcGetMemHandle(
    handle: *mut CUipcMemHandle,
    dptr: CUdeviceptr,
) -> CUresult {
    call("cuIpcGetMemHandle", Needs::Context, |emu, _| {
        let (base, _) = emu
            .sim
            .mem_address_range(DevicePtr(dptr))
            .map_err(|_| CUDA_ERROR_INVALID_VALUE)?;
        if base.0 != dptr {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let h = emu
            .sim
            .ipc_get_mem_handle(DevicePtr(dptr))
            .map_err(sim_err)?;
        out(handle, CUipcMemHandle { reserved: h.0 })
    })
}

/// `cuIpcOpenMemHandle_v2`: a handle made by this same process is refused with
/// `CUDA_ERROR_INVALID_CONTEXT`, as by the driver.
///
/// # Safety
/// `pdptr` must be null or writable.
#[no_mangle]
pub unsafe extern "C" fn cuIpcOpenMemHandle_v2(
    pdptr: *mut CUdeviceptr,
    handle: CUipcMemHandle,
    flags: c_uint,
) -> CUresult {
    call("cuIpcOpenMemHandle_v2", Needs::Context, |emu, d| {
        if flags & !1 != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let handle_of = IpcMemHandle(handle.reserved);
        if emu.sim.ipc_handle_pid(&handle_of) == Some(std::process::id()) {
            return Err(CUDA_ERROR_INVALID_CONTEXT);
        }
        let mut opened = lock(&emu.ipc_opened);
        // Docs: "If the handle was already opened by the current context, the reference
        // count on the handle is incremented by 1 and the existing device pointer is
        // returned."
        if let Some((ptr, o)) = opened
            .iter_mut()
            .find(|(_, o)| o.opener == d.0 && o.handle == handle.reserved)
        {
            o.count += 1;
            return out(pdptr, *ptr);
        }
        let owner = emu.sim.ipc_handle_device(&handle_of).map_or(d.0, |o| o.0);
        let p = emu
            .sim
            .ipc_open_mem_handle(d, &handle_of)
            .map_err(sim_err)?;
        opened.insert(
            p.0,
            IpcOpened {
                opener: d.0,
                owner,
                handle: handle.reserved,
                count: 1,
            },
        );
        out(pdptr, p.0)
    })
}

/// `cuIpcCloseMemHandle`: only in the context that opened the handle
/// (`CUDA_ERROR_INVALID_CONTEXT` in another). Docs: "Decrements the reference count of the
/// memory returned by cuIpcOpenMemHandle by 1. When the reference count reaches 0, this API
/// unmaps the memory."
#[no_mangle]
pub extern "C" fn cuIpcCloseMemHandle(dptr: CUdeviceptr) -> CUresult {
    call("cuIpcCloseMemHandle", Needs::Context, |emu, d| {
        let mut opened = lock(&emu.ipc_opened);
        let o = opened.get_mut(&dptr).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        if o.opener != d.0 {
            return Err(CUDA_ERROR_INVALID_CONTEXT);
        }
        if o.count > 1 {
            o.count -= 1;
            return Ok(());
        }
        emu.sim
            .ipc_close_mem_handle(DevicePtr(dptr))
            .map_err(sim_err)?;
        opened.remove(&dptr);
        Ok(())
    })
}

/// `cuCtxEnablePeerAccess`: the current context may reach `peer_context`'s ordinary
/// allocations (which the emulator never limits); virtual-memory mappings still need
/// `cuMemSetAccess` for the device. Enabling a pair twice is
/// `CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED`, a context with itself `CUDA_ERROR_INVALID_DEVICE`.
#[no_mangle]
pub extern "C" fn cuCtxEnablePeerAccess(peer_context: CUcontext, flags: c_uint) -> CUresult {
    call("cuCtxEnablePeerAccess", Needs::Context, |emu, d| {
        if flags != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let peer = crate::state::device_of_context(peer_context, emu.devices)
            .ok_or(CUDA_ERROR_INVALID_CONTEXT)?;
        if peer == d.0 {
            return Err(CUDA_ERROR_INVALID_DEVICE);
        }
        if !lock(&emu.peer_access).insert((d.0, peer)) {
            return Err(CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED);
        }
        Ok(())
    })
}
