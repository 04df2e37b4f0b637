//! The driver API's C types and result codes, as plain integers and `repr(C)` structs.
//!
//! Enums arrive as `c_uint`/`c_int`, never as Rust enums: a value the emulator does not
//! know must be an error, not undefined behaviour.

#![allow(non_camel_case_types)]

use std::ffi::{c_int, c_uint, c_void};

/// `CUresult`.
pub type CUresult = c_uint;
/// `CUdevice`.
pub type CUdevice = c_int;
/// `CUdeviceptr`.
pub type CUdeviceptr = u64;
/// `CUcontext` (opaque).
pub type CUcontext = *mut c_void;
/// `CUstream` (opaque; null is the default stream).
pub type CUstream = *mut c_void;
/// `CUevent` (opaque).
pub type CUevent = *mut c_void;
/// `CUgraph` (opaque).
pub type CUgraph = *mut c_void;
/// `CUgraphExec` (opaque).
pub type CUgraphExec = *mut c_void;
/// `CUmemGenericAllocationHandle`.
pub type CUmemGenericAllocationHandle = u64;
/// `CU_STREAM_NON_BLOCKING`: a stream not ordered with the legacy default stream.
pub const CU_STREAM_NON_BLOCKING: c_uint = 1;
/// `CU_EVENT_BLOCKING_SYNC`: a host wait on the event sleeps instead of spinning.
pub const CU_EVENT_BLOCKING_SYNC: c_uint = 1;

/// `CUhostFn`.
pub type CUhostFn = Option<unsafe extern "C" fn(user_data: *mut c_void)>;

/// `CUmemLocation` (CUDA 12: a type and an id).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct CUmemLocation {
    /// `CUmemLocationType`; 1 is a device.
    pub type_: c_uint,
    /// The device ordinal.
    pub id: c_int,
}

/// `CUmemAllocationProp`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct CUmemAllocationProp {
    /// `CUmemAllocationType`; 1 is pinned device memory.
    pub type_: c_uint,
    /// `CUmemAllocationHandleType` bits; 1 is a POSIX fd.
    pub requested_handle_types: c_uint,
    /// Where the memory lives.
    pub location: CUmemLocation,
    /// Windows only.
    pub win32_handle_meta_data: *mut c_void,
    /// Compression, RDMA, usage, reserved.
    pub alloc_flags: [u8; 8],
}

/// `CUmemAccessDesc`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct CUmemAccessDesc {
    /// Who gets access.
    pub location: CUmemLocation,
    /// `CUmemAccess_flags`; 3 is read/write.
    pub flags: c_uint,
}

/// `CUipcMemHandle`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct CUipcMemHandle {
    /// The handle's bytes.
    pub reserved: [u8; 64],
}

macro_rules! codes {
    ($($name:ident = $value:literal, $text:literal;)*) => {
        $(
            #[doc = $text]
            pub const $name: CUresult = $value;
        )*

        /// The code's name and the driver's description, for `cuGetErrorName`/`String`.
        pub(crate) fn describe(code: CUresult) -> Option<(&'static [u8], &'static [u8])> {
            match code {
                $($value => Some((concat!(stringify!($name), "\0").as_bytes(), concat!($text, "\0").as_bytes())),)*
                _ => None,
            }
        }
    };
}

codes! {
    CUDA_SUCCESS = 0, "no error";
    CUDA_ERROR_INVALID_VALUE = 1, "invalid argument";
    CUDA_ERROR_OUT_OF_MEMORY = 2, "out of memory";
    CUDA_ERROR_NOT_INITIALIZED = 3, "initialization error";
    CUDA_ERROR_DEVICE_UNAVAILABLE = 46, "CUDA-capable device(s) is/are busy or unavailable";
    CUDA_ERROR_NO_DEVICE = 100, "no CUDA-capable device is detected";
    CUDA_ERROR_INVALID_DEVICE = 101, "invalid device ordinal";
    CUDA_ERROR_INVALID_CONTEXT = 201, "invalid device context";
    CUDA_ERROR_INVALID_HANDLE = 400, "invalid resource handle";
    CUDA_ERROR_ILLEGAL_STATE = 401, "the operation cannot be performed in the present state";
    CUDA_ERROR_NOT_FOUND = 500, "named symbol not found";
    CUDA_ERROR_NOT_READY = 600, "device not ready";
    CUDA_ERROR_ECC_UNCORRECTABLE = 214, "uncorrectable ECC error encountered";
    CUDA_ERROR_NVLINK_UNCORRECTABLE = 220, "uncorrectable NVLink error detected during the execution";
    CUDA_ERROR_CONTAINED = 226, "an exception occurred on the device that is now contained by the GPU's error containment capability";
    CUDA_ERROR_ILLEGAL_ADDRESS = 700, "an illegal memory access was encountered";
    CUDA_ERROR_LAUNCH_TIMEOUT = 702, "the launch timed out and was terminated";
    CUDA_ERROR_ASSERT = 710, "device-side assert triggered";
    CUDA_ERROR_HARDWARE_STACK_ERROR = 714, "hardware stack error";
    CUDA_ERROR_ILLEGAL_INSTRUCTION = 715, "an illegal instruction was encountered";
    CUDA_ERROR_MISALIGNED_ADDRESS = 716, "misaligned address";
    CUDA_ERROR_INVALID_ADDRESS_SPACE = 717, "operation not supported on global/shared address space";
    CUDA_ERROR_INVALID_PC = 718, "invalid program counter";
    CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED = 704, "peer access is already enabled";
    CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712, "part or all of the requested memory range is already mapped";
    CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED = 713, "pointer does not correspond to a registered memory region";
    CUDA_ERROR_LAUNCH_FAILED = 719, "unspecified launch failure";
    CUDA_ERROR_NOT_PERMITTED = 800, "operation not permitted";
    CUDA_ERROR_NOT_SUPPORTED = 801, "operation not supported";
    CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED = 900, "operation not permitted when stream is capturing";
    CUDA_ERROR_STREAM_CAPTURE_INVALIDATED = 901, "operation failed due to a previous error during capture";
    CUDA_ERROR_STREAM_CAPTURE_MERGE = 902, "operation would result in a merge of separate capture sequences";
    CUDA_ERROR_STREAM_CAPTURE_UNMATCHED = 903, "capture was not ended in the same stream as it began";
    CUDA_ERROR_STREAM_CAPTURE_UNJOINED = 904, "capturing stream has unjoined work";
    CUDA_ERROR_STREAM_CAPTURE_ISOLATION = 905, "dependency created on uncaptured work in another stream";
    CUDA_ERROR_STREAM_CAPTURE_IMPLICIT = 906, "operation would make the legacy stream depend on a capturing blocking stream";
    CUDA_ERROR_CAPTURED_EVENT = 907, "operation not permitted on an event last recorded in a capturing stream";
    CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD = 908, "attempt to terminate a thread-local capture sequence from another thread";
    CUDA_ERROR_EXTERNAL_DEVICE = 911, "an error occurred on an external device";

    CUDA_ERROR_UNKNOWN = 999, "unknown error";
}

/// The driver's sticky error codes: after one, "any further CUDA work will return the same
/// error. To continue using CUDA, the process must be terminated and relaunched" (the docs
/// of each). What `gpualloc_emu_fault_stream_code` accepts.
pub const STICKY_CODES: [CUresult; 13] = [
    CUDA_ERROR_ECC_UNCORRECTABLE,
    CUDA_ERROR_NVLINK_UNCORRECTABLE,
    CUDA_ERROR_ILLEGAL_ADDRESS,
    CUDA_ERROR_LAUNCH_TIMEOUT,
    CUDA_ERROR_ASSERT,
    CUDA_ERROR_HARDWARE_STACK_ERROR,
    CUDA_ERROR_ILLEGAL_INSTRUCTION,
    CUDA_ERROR_MISALIGNED_ADDRESS,
    CUDA_ERROR_INVALID_ADDRESS_SPACE,
    CUDA_ERROR_INVALID_PC,
    CUDA_ERROR_LAUNCH_FAILED,
    CUDA_ERROR_EXTERNAL_DEVICE,
    CUDA_ERROR_CONTAINED,
];
