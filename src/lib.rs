//! gpualloc: an async, actor-based caching memory allocator for GPUs, for tokio services.
//!
//! ```no_run
//! # async fn demo() -> Result<(), gpualloc::Error> {
//! let alloc = gpualloc::Allocator::builder().build()?; // sim when no GPU (logged)
//! let stream = alloc.new_stream(gpualloc::DeviceId(0))?;
//! let buf = alloc.malloc(1 << 20, &stream).await?; // a cache hit is well under a microsecond
//! drop(buf); // back to the cache, from any thread
//! alloc.shutdown().await?;
//! # Ok(()) }
//! ```
//!
//! - [`Allocator`] / [`AllocatorBuilder`]: the handle and its construction.
//! - [`DeviceBuffer`]: RAII device memory; `Drop` never blocks.
//! - [`DeviceActor`]: one per device, owning that device's caching core.
//! - [`HostAllocator`] (`alloc.host()`) / [`PinnedBuffer`]: pinned host memory, and copies
//!   between it and device buffers on a stream; [`HostActor`] owns the pinned-host core.
//! - [`MallocOptions`]: e.g. wait for memory instead of failing.
//! - [`Pool`] (`alloc.pool(name, options)`): a named memory pool with a quota, whose blocks
//!   serve only its own requests (weights apart from the KV cache).
//! - [`Error`]: everything a call can fail with.
//! - Export to another process: [`Allocator::export_region`], [`Allocator::export`]
//!   (a `DeviceBuffer` is an ipc `ExportGuard`; see the [`ipc`] crate).
//! - Feature `cuda`: cudarc interop (a `DeviceBuffer` is a cudarc `DevicePtr<u8>` /
//!   `DevicePtrMut<u8>` and a kernel argument; `Stream` to and from `Arc<CudaStream>`).
//!
//! How it works: each device's caching core sits behind a flat-combining mailbox
//! (`gpualloc_actor`). A cache hit takes the mailbox's gate and runs inline on the
//! caller's thread (no channel, no wake-up); when the gate is busy the request is queued
//! and run by the holder. In front of that, each thread parks a few blocks it freed and
//! hands them straight back to its next request of the same size on the same stream,
//! without the gate (config key `thread_cache`); whoever takes the gate folds the parked
//! blocks back into the core first, so statistics and snapshots stay exact. Device mallocs, the out-of-memory chain's frees and event
//! synchronization run on tokio's blocking pool outside the gate, so hits keep flowing.
//!
//! Run the main job: `cargo run --release --example serve` (an inference-server-like
//! workload on the simulated GPU, data-checked). Figures: `cargo run --release --bin bench
//! [-- --json]`.

mod actor;
mod allocator;
mod buffer;
mod builder;
#[cfg(feature = "cuda")]
mod cuda;
mod error;
mod export;
mod fork;
mod graph;
mod guarded;
mod history;
mod history_frames;
#[cfg(feature = "nccl")]
pub mod nccl;
mod observer;
mod oom;
mod options;
mod pinned;
mod pool;
mod pool_sleep;
mod registration;

pub use actor::DeviceActor;
pub use allocator::Allocator;
pub use buffer::DeviceBuffer;
pub use builder::{cuda_backend, sim_backend, AllocatorBuilder, BackendKind, BACKEND_ENV};
pub use error::Error;
pub use gpualloc_devices::memory_summary;
pub use gpualloc_devices::{PoolState, SleepMode};
pub use gpualloc_runtime::capture::{CaptureError, CaptureMode, CaptureStatus};
pub use graph::{Capture, Graph, GraphPool};
pub use history::HistoryOptions;
pub use observer::{SegmentAction, SegmentRange, SegmentWatch, SEGMENT_EVENTS_BUFFERED};
pub use oom::OomEvent;
pub use options::MallocOptions;
pub use pinned::{CopyError, HostActor, HostAllocator, PinnedBuffer, PinnedCopy};
pub use pool::{Pool, PoolOptions, PoolUsage};
pub use registration::{RegistrationStats, SegmentRegistrar, SegmentRegistration};

#[cfg(feature = "cuda")]
pub use cudarc;
pub use gpualloc_devices as devices;
pub use gpualloc_devices::{
    format_size, AllocError, AllocatorConfig, ConfigError, CrossStreamFree, DeviceSnapshot,
    DeviceStats, HeldRanges, HeldRangesError, MemPoolId, OomReport, SegmentEvent, Stat, StatArray,
    StatType,
};
pub use gpualloc_host as host;
pub use gpualloc_host::{HostConfig, HostError, HostPtr, HostStats};
/// Registering host memory the user already has with the backend (deduplicated,
/// reference-counted, async on tokio's blocking pool): the `gpualloc-host-register` crate.
pub use gpualloc_host_register as host_register;
pub use gpualloc_ipc as ipc;
/// The GPU runtime layer: the `Backend` port, streams and events (`gpualloc-runtime`), the
/// simulated GPU (`gpualloc-sim`), the CUDA backend (`gpualloc-cuda`, feature `cuda`) and the
/// accounting backend (`gpualloc-accounting`), under the paths they always had.
pub mod runtime {
    pub use gpualloc_accounting as accounting;
    /// The CUDA backend (`gpualloc-cuda`, feature `cuda`).
    #[cfg(feature = "cuda")]
    pub use gpualloc_cuda as cuda;
    pub use gpualloc_runtime::*;
    pub use gpualloc_sim as sim;
}
pub use gpualloc_runtime::{Backend, BackendError, DeviceId, DevicePtr, Event, Stream};
pub use gpualloc_trace as trace;
