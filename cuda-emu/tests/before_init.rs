//! The driver's life cycle, in a process of its own (the emulator's state is global): before
//! `cuInit` every call is `CUDA_ERROR_NOT_INITIALIZED` (error names work, as the driver's
//! do); a primary context released to zero is gone under the thread that had it current.

use std::ffi::{c_char, CStr};

use gpualloc_cuda_emu::*;

#[test]
fn every_call_before_cu_init_is_not_initialized() {
    let mut n = -1;
    let mut ptr = 0u64;
    // SAFETY: valid out-pointers.
    unsafe {
        assert_eq!(cuDeviceGetCount(&mut n), CUDA_ERROR_NOT_INITIALIZED);
        assert_eq!(cuMemAlloc_v2(&mut ptr, 4096), CUDA_ERROR_NOT_INITIALIZED);
    }
    assert_eq!(cuCtxSynchronize(), CUDA_ERROR_NOT_INITIALIZED);
    assert_eq!(cuLaunchKernel(), CUDA_ERROR_NOT_INITIALIZED);
    let mut name: *const c_char = std::ptr::null();
    // SAFETY: a valid out-pointer; the result is a static C string.
    unsafe {
        assert_eq!(
            cuGetErrorName(CUDA_ERROR_NOT_INITIALIZED, &mut name),
            CUDA_SUCCESS
        );
        assert_eq!(
            CStr::from_ptr(name).to_str().unwrap(),
            "CUDA_ERROR_NOT_INITIALIZED"
        );
        assert_eq!(cuGetErrorName(12345, &mut name), CUDA_ERROR_INVALID_VALUE);
    }
    assert_eq!(cuInit(1), CUDA_ERROR_INVALID_VALUE, "flags must be 0");
    assert_eq!(cuInit(0), CUDA_SUCCESS);
    // SAFETY: a valid out-pointer.
    unsafe {
        assert_eq!(cuDeviceGetCount(&mut n), CUDA_SUCCESS);
    }
    assert_eq!(n, 1);
    let mut ctx: CUcontext = std::ptr::null_mut();
    // SAFETY: valid out-pointers.
    unsafe {
        assert_eq!(cuDevicePrimaryCtxRetain(&mut ctx, 0), CUDA_SUCCESS);
        assert_eq!(
            cuDevicePrimaryCtxRetain(&mut ctx, 1),
            CUDA_ERROR_INVALID_DEVICE
        );
    }
    assert_eq!(cuCtxSetCurrent(ctx), CUDA_SUCCESS);
    // SAFETY: a valid out-pointer.
    assert_eq!(unsafe { cuMemAlloc_v2(&mut ptr, 4096) }, CUDA_SUCCESS);
    assert_eq!(cuMemFree_v2(ptr), CUDA_SUCCESS);
    assert_eq!(cuDevicePrimaryCtxRelease_v2(0), CUDA_SUCCESS);
    // SAFETY: a valid out-pointer.
    assert_eq!(
        unsafe { cuMemAlloc_v2(&mut ptr, 4096) },
        CUDA_ERROR_INVALID_CONTEXT
    );
    assert_eq!(cuCtxSetCurrent(ctx), CUDA_ERROR_INVALID_CONTEXT);
    assert_eq!(cuDevicePrimaryCtxRelease_v2(0), CUDA_ERROR_INVALID_CONTEXT);
}
