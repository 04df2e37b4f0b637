//! [`RegisterError`]: everything registering existing host memory can refuse or fail with.
//!
//! Bad input (null pointer, zero length, a range that wraps the address space, an unknown or
//! already released handle) is refused before any backend call. Backend failures carry the
//! operation and the backend's error; an unmapped range is recognised and reported as such.

use std::ops::Range;

use gpualloc_runtime::{BackendError, HostRegisterFlags};

use super::RegistrationId;

/// Result of a registration operation.
pub type RegisterResult<T> = std::result::Result<T, RegisterError>;

/// What registering, querying or releasing host memory can fail with.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RegisterError {
    /// The pointer is null.
    #[error("cannot register a null pointer")]
    NullPointer,
    /// The length is zero.
    #[error("cannot register 0 bytes at {ptr:#x}")]
    ZeroLength {
        /// Start address asked for.
        ptr: u64,
    },
    /// `ptr + len`, or its rounding up to a page boundary, wraps the address space.
    #[error("range {ptr:#x}+{len:#x} wraps the address space")]
    Wraps {
        /// Start address asked for.
        ptr: u64,
        /// Length asked for.
        len: u64,
    },
    /// Part of the range is not mapped (or not accessible) in this process.
    #[error("range {:#x}..{:#x} is not mapped memory at {hole:#x}", range.start, range.end)]
    Unmapped {
        /// The page-aligned range that was being registered.
        range: Range<u64>,
        /// First address found not mapped (or not accessible).
        hole: u64,
    },
    /// The range overlaps a backend registration made with flags that do not give what this
    /// registration asks for (e.g. it is read-only and this one needs writes). The backend
    /// cannot register a byte twice and splitting the existing registration is not allowed.
    #[error("range {:#x}..{:#x} is already registered with {existing:?}, which does not satisfy {requested:?}", range.start, range.end)]
    FlagConflict {
        /// The existing backend registration.
        range: Range<u64>,
        /// Its flags.
        existing: HostRegisterFlags,
        /// The flags asked for.
        requested: HostRegisterFlags,
    },
    /// The handle is not a live registration: never issued, released already (a double
    /// release), or dropped because its backend registration failed.
    #[error("{0} is not a live registration (released twice, or its registration failed)")]
    UnknownRegistration(RegistrationId),
    /// The registry was created in another process: this is a `fork()`ed child, where no
    /// registration of the parent exists at the backend. See [`crate::fork`].
    #[error(
        "registry created in process {parent} used in forked child {child}; call reset_after_fork"
    )]
    Forked {
        /// Process that created the registry.
        parent: u32,
        /// This process.
        child: u32,
    },
    /// Async registration needs a tokio runtime and none is running on this thread.
    #[error("async registration needs a tokio runtime")]
    NoRuntime,
    /// The background task running the backend call was cancelled or panicked.
    #[error("background registration task failed: {0}")]
    TaskFailed(String),
    /// The backend refused the call twice (the call was retried once).
    #[error("backend {op} of {:#x}..{:#x} failed: {source}", range.start, range.end)]
    Backend {
        /// `"host_register"` or `"host_unregister"`.
        op: &'static str,
        /// The backend range of the call.
        range: Range<u64>,
        /// What the backend said (the second time).
        source: BackendError,
    },
}
