//! [`HostError`]: everything the pinned-host core can refuse or fail with.
//!
//! Bad input (zero or unroundable sizes, unknown pointers, double frees) gets its own variant;
//! backend failures pass through as [`HostError::Backend`].

use gpualloc_runtime::BackendError;

use crate::config::ConfigError;
use crate::HostPtr;

/// Result of a pinned-host core operation.
pub type Result<T, E = HostError> = std::result::Result<T, E>;

/// What a pinned-host core operation can fail with.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HostError {
    /// `malloc(0)`. PyTorch returns a null pointer; we return this typed error instead so a
    /// caller cannot mistake "nothing" for an allocation.
    #[error("pinned allocation of size 0")]
    ZeroSize,
    /// The size cannot be rounded to a block size (the rounded size would overflow) or does
    /// not fit this platform's address space.
    #[error("pinned allocation of {requested} bytes is too large")]
    TooLarge {
        /// Bytes asked for.
        requested: u64,
    },
    /// The pointer is not the start of a block of this allocator.
    #[error("{0} is not a pinned block of this allocator")]
    UnknownPointer(HostPtr),
    /// The block was already freed (it is cached or waiting on stream events).
    #[error("double free of pinned block {0}")]
    DoubleFree(HostPtr),
    /// `record_stream` on a block that is not allocated.
    #[error("record_stream on pinned block {0}, which is not allocated")]
    NotAllocated(HostPtr),
    /// The configuration is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The backend failed (out of memory, register refused, event errors, ...).
    #[error("backend: {0}")]
    Backend(#[from] BackendError),
}

impl HostError {
    /// True when the backend ran out of pinned memory (after the core's own retry).
    pub fn is_oom(&self) -> bool {
        matches!(self, HostError::Backend(e) if e.is_oom())
    }
}
