//! Errors: the sim's typed errors as driver codes, and `cuGetErrorName`/`cuGetErrorString`
//! (which work before `cuInit`, as the driver's do).

use std::ffi::c_char;

use gpualloc_runtime::BackendError;

use crate::abi::*;

/// The driver code for a sim error.
pub(crate) fn code(e: &BackendError) -> CUresult {
    match e {
        BackendError::OutOfMemory { .. } => CUDA_ERROR_OUT_OF_MEMORY,
        BackendError::InvalidValue(_) => CUDA_ERROR_INVALID_VALUE,
        BackendError::NotSupported(_) => CUDA_ERROR_NOT_SUPPORTED,
        BackendError::InvalidDevice(_) => CUDA_ERROR_INVALID_DEVICE,
        BackendError::InvalidHandle(_) => CUDA_ERROR_INVALID_HANDLE,
        BackendError::Driver { code, .. } => u32::try_from(*code).unwrap_or(CUDA_ERROR_UNKNOWN),
        BackendError::Capture(e) => u32::try_from(e.code()).unwrap_or(CUDA_ERROR_UNKNOWN),
        _ => CUDA_ERROR_UNKNOWN,
    }
}

/// [`code`] for `map_err`.
pub(crate) fn sim_err(e: BackendError) -> CUresult {
    code(&e)
}

fn describe_into(error: CUresult, out: *mut *const c_char, pick: usize) -> CUresult {
    if out.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    match describe(error) {
        Some(texts) => {
            let text = if pick == 0 { texts.0 } else { texts.1 };
            // SAFETY: `out` is non-null and, by the API's contract, points to a writable
            // `const char *`; the string is a static NUL-terminated literal.
            unsafe { *out = text.as_ptr().cast() };
            CUDA_SUCCESS
        }
        None => {
            // SAFETY: as above.
            unsafe { *out = std::ptr::null() };
            CUDA_ERROR_INVALID_VALUE
        }
    }
}

/// `cuGetErrorName`.
///
/// # Safety
/// `p_str` must be null or point to writable storage for one pointer.
#[no_mangle]
pub unsafe extern "C" fn cuGetErrorName(error: CUresult, p_str: *mut *const c_char) -> CUresult {
    describe_into(error, p_str, 0)
}

/// `cuGetErrorString`.
///
/// # Safety
/// `p_str` must be null or point to writable storage for one pointer.
#[no_mangle]
pub unsafe extern "C" fn cuGetErrorString(error: CUresult, p_str: *mut *const c_char) -> CUresult {
    describe_into(error, p_str, 1)
}
