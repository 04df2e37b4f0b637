//! Initialization, devices and primary contexts.

use std::ffi::{c_char, c_int, c_uint};

use gpualloc_runtime::Backend;

use crate::abi::*;
use crate::state::{call, context_of, device_of_context, lock, out, set_current, Needs};

/// `cuInit`.
#[no_mangle]
pub extern "C" fn cuInit(flags: c_uint) -> CUresult {
    if flags != 0 {
        return CUDA_ERROR_INVALID_VALUE;
    }
    match crate::state::init() {
        Ok(()) => CUDA_SUCCESS,
        Err(code) => code,
    }
}

/// `cuDriverGetVersion` (12.8; works before `cuInit`).
///
/// # Safety
/// `version` must be null or writable.
#[no_mangle]
pub unsafe extern "C" fn cuDriverGetVersion(version: *mut c_int) -> CUresult {
    match out(version, 12080) {
        Ok(()) => CUDA_SUCCESS,
        Err(code) => code,
    }
}

/// `cuDeviceGetCount`.
///
/// # Safety
/// `count` must be null or writable.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetCount(count: *mut c_int) -> CUresult {
    call("cuDeviceGetCount", Needs::Init, |emu, _| {
        out(count, emu.devices as c_int)
    })
}

fn check_device(devices: u32, dev: CUdevice) -> Result<u32, CUresult> {
    u32::try_from(dev)
        .ok()
        .filter(|d| *d < devices)
        .ok_or(CUDA_ERROR_INVALID_DEVICE)
}

/// `cuDeviceGet`.
///
/// # Safety
/// `device` must be null or writable.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGet(device: *mut CUdevice, ordinal: c_int) -> CUresult {
    call("cuDeviceGet", Needs::Init, |emu, _| {
        check_device(emu.devices, ordinal)?;
        out(device, ordinal)
    })
}

/// `cuDeviceGetName`: [`crate::DEVICE_NAME`] and the ordinal.
///
/// # Safety
/// `name` must be null or writable for `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetName(name: *mut c_char, len: c_int, dev: CUdevice) -> CUresult {
    call("cuDeviceGetName", Needs::Init, |emu, _| {
        let d = check_device(emu.devices, dev)?;
        let len = usize::try_from(len).map_err(|_| CUDA_ERROR_INVALID_VALUE)?;
        if name.is_null() || len == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let text = format!("{} {d}", crate::DEVICE_NAME);
        let n = text.len().min(len - 1);
        // SAFETY: `name` is non-null and writable for `len` bytes (the API's contract); we
        // write `n + 1 <= len` bytes.
        unsafe {
            std::ptr::copy_nonoverlapping(text.as_ptr(), name.cast::<u8>(), n);
            *name.add(n) = 0;
        }
        Ok(())
    })
}

/// Attribute values of an emulated device (an H100-like part without memory pools, so
/// cudarc does not use stream-ordered allocation); unknown attributes read 0.
fn attribute(attrib: c_int) -> c_int {
    match attrib {
        1 => 1024, // MAX_THREADS_PER_BLOCK
        16 => 132, // MULTIPROCESSOR_COUNT
        41 => 1,   // UNIFIED_ADDRESSING
        75 => 9,   // COMPUTE_CAPABILITY_MAJOR
        76 => 0,   // COMPUTE_CAPABILITY_MINOR
        102 => 1,  // VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
        103 => 1,  // HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED
        115 => 0,  // MEMORY_POOLS_SUPPORTED
        _ => 0,
    }
}

/// `cuDeviceGetAttribute`.
///
/// # Safety
/// `pi` must be null or writable.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetAttribute(
    pi: *mut c_int,
    attrib: c_int,
    dev: CUdevice,
) -> CUresult {
    call("cuDeviceGetAttribute", Needs::Init, |emu, _| {
        check_device(emu.devices, dev)?;
        out(pi, attribute(attrib))
    })
}

/// `cuDeviceTotalMem_v2`.
///
/// # Safety
/// `bytes` must be null or writable.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: CUdevice) -> CUresult {
    call("cuDeviceTotalMem_v2", Needs::Init, |emu, _| {
        let d = check_device(emu.devices, dev)?;
        let info = emu
            .sim
            .mem_info(gpualloc_runtime::DeviceId(d))
            .map_err(crate::errors::sim_err)?;
        out(bytes, info.total as usize)
    })
}

/// `cuDevicePrimaryCtxRetain`.
///
/// # Safety
/// `pctx` must be null or writable.
#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(pctx: *mut CUcontext, dev: CUdevice) -> CUresult {
    call("cuDevicePrimaryCtxRetain", Needs::Init, |emu, _| {
        let d = check_device(emu.devices, dev)?;
        if pctx.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let mut retained = lock(&emu.retained);
        if retained[d as usize] == 0 {
            emu.claim_exclusive(d)?;
            if let Err(code) = emu.take_context_memory(d) {
                emu.release_exclusive(d);
                return Err(code);
            }
        }
        retained[d as usize] += 1;
        drop(retained);
        out(pctx, context_of(d))
    })
}

/// `cuDevicePrimaryCtxGetState`: `active` is 1 while the primary context is retained (flags
/// are always 0).
///
/// # Safety
/// `flags` and `active` must be null or writable.
#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxGetState(
    dev: CUdevice,
    flags: *mut c_uint,
    active: *mut c_int,
) -> CUresult {
    call("cuDevicePrimaryCtxGetState", Needs::Init, |emu, _| {
        let d = check_device(emu.devices, dev)?;
        let retained = lock(&emu.retained)[d as usize] > 0;
        out(flags, 0)?;
        out(active, c_int::from(retained))
    })
}

/// `cuDevicePrimaryCtxRelease_v2`: releasing more often than retained is an error.
#[no_mangle]
pub extern "C" fn cuDevicePrimaryCtxRelease_v2(dev: CUdevice) -> CUresult {
    call("cuDevicePrimaryCtxRelease_v2", Needs::Init, |emu, _| {
        let d = check_device(emu.devices, dev)?;
        let mut retained = lock(&emu.retained);
        let slot = &mut retained[d as usize];
        if *slot == 0 {
            return Err(CUDA_ERROR_INVALID_CONTEXT);
        }
        *slot -= 1;
        if *slot == 0 {
            emu.release_exclusive(d);
            emu.give_context_memory(d);
            // A sticky error outlives the context: "the process must be terminated and
            // relaunched" (the driver's docs), so `faulted` stays.
        }
        Ok(())
    })
}

/// `cuCtxSetCurrent`: the context must be a retained primary context (null unbinds).
#[no_mangle]
pub extern "C" fn cuCtxSetCurrent(ctx: CUcontext) -> CUresult {
    call("cuCtxSetCurrent", Needs::Init, |emu, _| {
        if ctx.is_null() {
            set_current(None);
            return Ok(());
        }
        let d = device_of_context(ctx, emu.devices).ok_or(CUDA_ERROR_INVALID_CONTEXT)?;
        if lock(&emu.retained)[d as usize] == 0 {
            return Err(CUDA_ERROR_INVALID_CONTEXT);
        }
        set_current(Some(d));
        Ok(())
    })
}

/// `cuCtxGetCurrent` (null when none is current).
///
/// # Safety
/// `pctx` must be null or writable.
#[no_mangle]
pub unsafe extern "C" fn cuCtxGetCurrent(pctx: *mut CUcontext) -> CUresult {
    call("cuCtxGetCurrent", Needs::Init, |_, _| {
        let ctx = crate::state::current().map_or(std::ptr::null_mut(), context_of);
        out(pctx, ctx)
    })
}

/// `cuCtxGetDevice`.
///
/// # Safety
/// `device` must be null or writable.
#[no_mangle]
pub unsafe extern "C" fn cuCtxGetDevice(device: *mut CUdevice) -> CUresult {
    call("cuCtxGetDevice", Needs::Context, |_, d| {
        out(device, d.0 as CUdevice)
    })
}

/// `cuCtxSynchronize`: waits for all work of the current context's device.
#[no_mangle]
pub extern "C" fn cuCtxSynchronize() -> CUresult {
    call("cuCtxSynchronize", Needs::Context, |emu, d| {
        emu.sim
            .device_synchronize(d)
            .map_err(crate::errors::sim_err)
    })
}
