//! Typed errors of the GPU runtime layer.
//!
//! Every backend operation returns [`Result`]; no backend panics on bad input. The variants
//! mirror the classes of failure a CUDA driver reports, so the allocators above can react to
//! them (an [`BackendError::OutOfMemory`] starts the OOM chain, anything else is passed up).

/// Result of a backend operation.
pub type Result<T, E = BackendError> = std::result::Result<T, E>;

/// What a backend operation can fail with.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BackendError {
    /// The device (or host) has no memory left for this request.
    #[error("out of memory: requested {requested} bytes on {what}")]
    OutOfMemory {
        /// Bytes asked for.
        requested: u64,
        /// Which memory ran out ("device 0", "pinned host", ...).
        what: String,
    },
    /// An argument is invalid: zero or overflowing size, unknown pointer, unmapped range,
    /// a handle of another device, an fd that is not a memory handle...
    #[error("invalid value: {0}")]
    InvalidValue(String),
    /// The backend does not implement this operation (or this device lacks the capability).
    #[error("not supported: {0}")]
    NotSupported(String),
    /// No such device ordinal.
    #[error("invalid device {0}")]
    InvalidDevice(u32),
    /// The handle (stream, event, physical handle) is unknown or already destroyed.
    #[error("invalid handle: {0}")]
    InvalidHandle(String),
    /// The backend is unusable: no driver library, no device, or it was shut down.
    #[error("backend unavailable: {0}")]
    Unavailable(String),
    /// An OS call failed (mmap, memfd, ...).
    #[error("os error in {op}: {errno}")]
    Os {
        /// The call that failed.
        op: &'static str,
        /// The error it returned.
        errno: std::io::ErrorKind,
    },
    /// The driver returned an error code that has no better mapping.
    #[error("driver error {code} ({name})")]
    Driver {
        /// Numeric driver error code.
        code: i32,
        /// Its symbolic name, e.g. `CUDA_ERROR_LAUNCH_FAILED`.
        name: String,
    },
    /// The device hit an unrecoverable ("sticky") error, such as a kernel that faulted
    /// (`CUDA_ERROR_ILLEGAL_ADDRESS`): its context does no more work. Pending completion
    /// futures fail with this, every later call on the device does, and the allocator hands
    /// out none of its memory. Recovery takes a new process.
    #[error("device {device} is lost: {cause}")]
    DeviceLost {
        /// The device's ordinal.
        device: u32,
        /// The error that lost it, e.g. `CUDA_ERROR_ILLEGAL_ADDRESS (driver error 700)`.
        cause: String,
    },
    /// The call was refused for a stream capture's sake (the driver's 900–908), see
    /// [`crate::capture`].
    #[error("stream capture: {0}")]
    Capture(crate::capture::CaptureError),
    /// A backend call was failed on purpose by the sim's fault injection.
    #[error("injected fault in {0}")]
    Injected(&'static str),
}

impl BackendError {
    /// True for [`BackendError::OutOfMemory`] (and injected OOMs, which the sim reports as
    /// `OutOfMemory`): the caller may free cached memory and retry.
    pub fn is_oom(&self) -> bool {
        matches!(self, BackendError::OutOfMemory { .. })
    }

    /// True for [`BackendError::DeviceLost`]: the device can do no more work.
    pub fn is_device_lost(&self) -> bool {
        matches!(self, BackendError::DeviceLost { .. })
    }

    /// The capture error, for [`BackendError::Capture`].
    pub fn capture(&self) -> Option<crate::capture::CaptureError> {
        match self {
            BackendError::Capture(e) => Some(*e),
            _ => None,
        }
    }

    /// Shorthand for an [`BackendError::InvalidValue`].
    pub fn invalid(msg: impl Into<String>) -> Self {
        BackendError::InvalidValue(msg.into())
    }

    /// Maps an OS error from `op`.
    pub fn os(op: &'static str, err: impl Into<std::io::Error>) -> Self {
        BackendError::Os {
            op,
            errno: err.into().kind(),
        }
    }
}
