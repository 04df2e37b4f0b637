//! The GPU runtime layer of gpualloc.
//!
//! - [`Backend`]: every GPU-runtime operation the allocators need, object safe, typed errors.
//! - The simulated GPU (real OS memory: memfd, mmap, worker-thread streams; the embedded
//!   default, what every test and benchmark runs on) is the crate `gpualloc-sim`; the
//!   accounting backend (addresses and byte counts only, for replays) is `gpualloc-accounting`;
//!   the actor plumbing is `gpualloc-actor`.
//! - The CUDA backend (the same trait on cudarc's driver API) is the crate `gpualloc-cuda`.
//! - [`Stream`], [`Event`] and [`Completion`]: RAII handles and futures that resolve when the
//!   GPU has passed a point, woken by a backend host callback rather than polling.
//!
//! Concurrency primitives come from [`sync`], which is loom's under `cfg(loom)`.

pub mod addr_map;
pub mod backend;
pub mod capture;
pub mod capture_safe;
pub mod completion;
pub mod error;
pub mod guarded;
pub mod procmaps;
pub mod release_hooks;
pub mod stat;
pub mod stream;
pub mod sync;
pub mod types;

pub use backend::{Backend, LostWatch};
pub use capture::{CaptureError, CaptureMode, CaptureStatus, GraphExecHandle, GraphHandle};
pub use capture_safe::CaptureSafe;
pub use completion::{Completion, CompletionCell};
pub use error::{BackendError, Result};
pub use guarded::guarded;
pub use stream::{Event, Stream};
pub use types::{
    DeviceId, DevicePtr, EventHandle, HostFn, HostRegisterFlags, IpcMemHandle, MemInfo, PhysHandle,
    StreamHandle,
};
