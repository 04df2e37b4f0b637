//! The CUDA backend: the [`Backend`](gpualloc_runtime::Backend) trait on NVIDIA's driver API through
//! cudarc (the driver is loaded at run time, so this builds with no toolkit).
//!
//! - [`CudaBackend::new`] fails with a typed `Unavailable` error when there is no driver or
//!   no device; nothing here panics.
//! - A device whose context hit a sticky error (a faulting kernel) is lost: pending completion
//!   futures fail with `BackendError::DeviceLost` within a few tens of milliseconds, and every
//!   later call on the device fails with it (see `health`).
//! - Interop: [`CudaBackend::cudarc_context`], [`CudaBackend::adopt_stream`],
//!   [`CudaBackend::cudarc_stream`], [`CudaBackend::wrap_cudarc_stream`],
//!   [`CudaBackend::to_cudarc_stream`].
//!
//! Files: `backend` (construction, trait impl), `memory`, `streams`, `vmm` (one concern
//! each), `context` (primary contexts, binding), `registry` (live handles), `hostfn`
//! (callback trampoline, pending host functions), `health` (lost devices, the watchdog), `error` (result-code mapping), `validate` (input checks).

mod backend;
mod context;
mod error;
mod graphs;
mod health;
mod hostfn;
mod interop;
mod memory;
mod registry;
mod streams;
mod validate;
mod vmm;

pub use backend::CudaBackend;

#[cfg(test)]
mod tests;
