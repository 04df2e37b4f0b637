//! gpualloc: an async, actor-based caching memory allocator for GPUs, for tokio services.
//!
//! This facade re-exports the layers below it. See the README for the two commands that
//! matter (run the main job, run the tests).

pub use gpualloc_runtime as runtime;
pub use gpualloc_runtime::{Backend, BackendError, DeviceId, DevicePtr, Event, Stream};
