//! Turning driver results into [`BackendError`]s, and the one wrapper every raw call goes
//! through.
//!
//! [`drv`] runs a raw driver call inside `catch_unwind` (cudarc panics, rather than returning
//! an error, when a driver symbol cannot be loaded) and maps its `CUresult` with [`map_code`].
//! The mapping is pure, so it is unit tested without a driver.

use std::panic::{catch_unwind, AssertUnwindSafe};

use cudarc::driver::result::DriverError;
use cudarc::driver::sys::CUresult;

use gpualloc_runtime::capture::CaptureError;
use gpualloc_runtime::error::{BackendError, Result};

/// The class of failure of a non-success `CUresult` from the call `op`.
///
/// `OUT_OF_MEMORY` becomes [`BackendError::OutOfMemory`] with `requested: 0` (callers that know
/// the size fill it in with [`with_request`]), `INVALID_VALUE`, `NOT_SUPPORTED` and
/// `INVALID_HANDLE` their typed variants, anything else [`BackendError::Driver`] with the
/// numeric code and the symbolic name (taken from the binding, no driver call).
pub(crate) fn map_code(op: &'static str, code: CUresult) -> BackendError {
    match code {
        CUresult::CUDA_ERROR_OUT_OF_MEMORY => BackendError::OutOfMemory {
            requested: 0,
            what: op.to_string(),
        },
        CUresult::CUDA_ERROR_INVALID_VALUE => {
            BackendError::InvalidValue(format!("{op}: CUDA_ERROR_INVALID_VALUE"))
        }
        CUresult::CUDA_ERROR_NOT_SUPPORTED => {
            BackendError::NotSupported(format!("{op}: CUDA_ERROR_NOT_SUPPORTED"))
        }
        CUresult::CUDA_ERROR_INVALID_HANDLE => {
            BackendError::InvalidHandle(format!("{op}: CUDA_ERROR_INVALID_HANDLE"))
        }
        other => match CaptureError::from_code(other as i32) {
            Some(e) => BackendError::Capture(e),
            None => BackendError::Driver {
                code: other as i32,
                name: format!("{other:?}"),
            },
        },
    }
}

/// `Ok(())` for `CUDA_SUCCESS`, else [`map_code`].
pub(crate) fn check(op: &'static str, code: CUresult) -> Result<()> {
    match code {
        CUresult::CUDA_SUCCESS => Ok(()),
        other => Err(map_code(op, other)),
    }
}

/// Maps an error of cudarc's safe layer.
pub(crate) fn from_driver_error(op: &'static str, err: DriverError) -> BackendError {
    map_code(op, err.0)
}

/// The error reported when cudarc panicked inside `op` (a driver symbol it could not load).
pub(crate) fn panicked(op: &'static str) -> BackendError {
    BackendError::Unavailable(format!(
        "{op}: the CUDA driver library is missing or lacks this entry point"
    ))
}

/// Runs `f` (a closure around one raw call) and returns its raw result, or
/// [`panicked`] if cudarc panicked inside it.
pub(crate) fn catch<T>(op: &'static str, f: impl FnOnce() -> T) -> Result<T> {
    catch_unwind(AssertUnwindSafe(f)).map_err(|_| panicked(op))
}

/// Runs one raw driver call `f` named `op` and maps its result; never panics.
pub(crate) fn drv(op: &'static str, f: impl FnOnce() -> CUresult) -> Result<()> {
    check(op, catch(op, f)?)
}

/// Fills in the size and the memory kind of an [`BackendError::OutOfMemory`]; other errors
/// pass through unchanged.
pub(crate) fn with_request(
    err: BackendError,
    requested: u64,
    what: impl Into<String>,
) -> BackendError {
    match err {
        BackendError::OutOfMemory { .. } => BackendError::OutOfMemory {
            requested,
            what: what.into(),
        },
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn success_is_ok() {
        assert_eq!(check("cuMemAlloc", CUresult::CUDA_SUCCESS), Ok(()));
    }

    #[test]
    fn the_four_typed_classes() {
        assert!(map_code("cuMemAlloc", CUresult::CUDA_ERROR_OUT_OF_MEMORY).is_oom());
        assert_eq!(
            map_code("cuMemMap", CUresult::CUDA_ERROR_INVALID_VALUE),
            BackendError::InvalidValue("cuMemMap: CUDA_ERROR_INVALID_VALUE".into())
        );
        assert_eq!(
            map_code("cuMemCreate", CUresult::CUDA_ERROR_NOT_SUPPORTED),
            BackendError::NotSupported("cuMemCreate: CUDA_ERROR_NOT_SUPPORTED".into())
        );
        assert_eq!(
            map_code("cuEventQuery", CUresult::CUDA_ERROR_INVALID_HANDLE),
            BackendError::InvalidHandle("cuEventQuery: CUDA_ERROR_INVALID_HANDLE".into())
        );
    }

    #[test]
    fn other_codes_keep_number_and_name() {
        assert_eq!(
            map_code("cuStreamSynchronize", CUresult::CUDA_ERROR_LAUNCH_FAILED),
            BackendError::Driver {
                code: 719,
                name: "CUDA_ERROR_LAUNCH_FAILED".into()
            }
        );
        assert_eq!(
            map_code("cuEventQuery", CUresult::CUDA_ERROR_NOT_READY),
            BackendError::Driver {
                code: 600,
                name: "CUDA_ERROR_NOT_READY".into()
            }
        );
        assert_eq!(
            map_code("cuInit", CUresult::CUDA_ERROR_NO_DEVICE),
            BackendError::Driver {
                code: 100,
                name: "CUDA_ERROR_NO_DEVICE".into()
            }
        );
    }

    #[test]
    fn oom_gets_its_request() {
        let e = with_request(
            map_code("cuMemAlloc", CUresult::CUDA_ERROR_OUT_OF_MEMORY),
            4096,
            "device 1",
        );
        assert_eq!(
            e,
            BackendError::OutOfMemory {
                requested: 4096,
                what: "device 1".into()
            }
        );
        let other = with_request(BackendError::invalid("x"), 4096, "device 1");
        assert_eq!(other, BackendError::invalid("x"));
    }

    #[test]
    fn a_panicking_call_becomes_unavailable() {
        let r = drv("cuFake", || panic!("Missing symbol cuFake"));
        assert!(matches!(r, Err(BackendError::Unavailable(m)) if m.starts_with("cuFake")));
        assert_eq!(
            drv("cuFake", || CUresult::CUDA_ERROR_INVALID_VALUE).unwrap_err(),
            BackendError::InvalidValue("cuFake: CUDA_ERROR_INVALID_VALUE".into())
        );
    }
}
