//! The facade's error type: the device allocator's errors plus what only the facade can
//! report (a fork, a missing runtime, an unusable backend choice).

use gpualloc_devices::{AllocError, ConfigError, OomReport};
use gpualloc_host::HostError;
use gpualloc_ipc::IpcError;
use gpualloc_runtime::BackendError;

/// What an [`Allocator`](crate::Allocator) call can fail with.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Error {
    /// The device allocator refused: out of memory (with PyTorch's report), a bad size, a
    /// stream of another device, the allocator was shut down...
    #[error(transparent)]
    Alloc(#[from] AllocError),
    /// A backend call failed, or the requested backend is unavailable (e.g. CUDA asked for
    /// on a machine without a GPU: `BackendError::Unavailable`, never a silent fallback).
    #[error(transparent)]
    Backend(#[from] BackendError),
    /// A bad configuration string or value.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The pinned-host allocator refused: size 0, a size too large to round, a bad
    /// `pinned_*` config key or value, or the backend's failure (out of memory, ...).
    #[error("pinned host allocator: {0}")]
    Host(#[from] HostError),
    /// A copy's destination is shorter than its source.
    #[error("copy of {src} bytes into a buffer of {dst} bytes")]
    CopyLength {
        /// Bytes of the source.
        src: u64,
        /// Bytes of the destination.
        dst: u64,
    },
    /// The allocator was created in another process and this one is a `fork` of it: its
    /// threads and device state did not survive the fork. Create a new allocator here.
    #[error(
        "this allocator was created in process {parent} and cannot be used in process {child} \
         (a fork): its threads and device state do not survive fork; create a new allocator in the child"
    )]
    Forked {
        /// The process that created the allocator.
        parent: u32,
        /// This process.
        child: u32,
    },
    /// No such device on this backend.
    #[error("device {device} does not exist (the backend has {count} devices)")]
    InvalidDevice {
        /// The device asked for.
        device: u32,
        /// How many devices there are.
        count: u32,
    },
    /// The stream was created on another backend than this allocator's.
    #[error("the stream belongs to another backend than this allocator's")]
    ForeignStream,
    /// [`Graph::launch`](crate::Graph::launch) on a stream that is capturing: the launch
    /// would be captured into the other graph, whose lifetime then keeps this graph's pool in
    /// use, and the allocator does not track that. Launch it outside the capture.
    #[error(
        "a graph cannot be launched into a stream capture (the captured launch would use its \
         pool's memory for as long as the other graph lives, which the allocator does not \
         track); launch it outside the capture"
    )]
    LaunchIntoCapture,
    /// The allocator must be built inside a tokio runtime (its actor tasks run there), and
    /// waiting for memory needs the caller to run inside one (for its timer).
    #[error(
        "no tokio runtime: build the allocator, and wait for memory, from inside a tokio runtime"
    )]
    NoRuntime,
    /// Exporting a buffer to another process failed (the ipc crate's error, as text).
    #[error("export failed: {0}")]
    Export(String),
    /// A blocking-pool task of the allocator failed (it panicked or the runtime is stopping).
    #[error("internal error: {0}")]
    Internal(String),
    /// Writing a file the allocator was asked to write (a snapshot) failed.
    #[error("writing {path}: {kind} ({message})")]
    Write {
        /// The file.
        path: std::path::PathBuf,
        /// What the OS said.
        kind: std::io::ErrorKind,
        /// The OS's message.
        message: String,
    },
}

impl From<IpcError> for Error {
    fn from(e: IpcError) -> Self {
        match e {
            IpcError::Backend(b) => Error::Backend(b),
            other => Error::Export(other.to_string()),
        }
    }
}

impl Error {
    /// True for out of memory (after the whole retry chain, and after waiting if asked to).
    pub fn is_oom(&self) -> bool {
        matches!(self, Error::Alloc(e) if e.is_oom())
            || matches!(self, Error::Host(e) if e.is_oom())
    }

    /// The numbers behind a device out-of-memory error (PyTorch's report: requested, device
    /// free and total, allocated and reserved by this allocator); `None` for other errors.
    pub fn oom_report(&self) -> Option<&OomReport> {
        match self {
            Error::Alloc(AllocError::OutOfMemory(report)) => Some(report),
            _ => None,
        }
    }

    /// True when the device is lost: it hit a sticky error (a faulting kernel) and can do no
    /// more work, so the allocator hands out none of its memory
    /// ([`BackendError::DeviceLost`]).
    pub fn is_device_lost(&self) -> bool {
        match self {
            Error::Backend(e) | Error::Alloc(AllocError::Backend(e)) => e.is_device_lost(),
            _ => false,
        }
    }

    /// True if the allocator has been shut down.
    pub fn is_shutdown(&self) -> bool {
        matches!(self, Error::Alloc(AllocError::Shutdown))
    }
}
