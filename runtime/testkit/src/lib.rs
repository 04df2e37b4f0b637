//! gpualloc's test kit: code its crates' tests share, never a dependency of the library.
//!
//! - [`conformance`]: the backend conformance suite, checks written once against
//!   `Arc<dyn Backend>` that every backend must pass (the sim's, the CUDA backend's on a GPU
//!   and on the emulated driver), with the stream-capture checks and
//!   [`capture_is_supported`].
//!
//! It is a dev-dependency only (`publish = false`): a user of gpualloc never builds it.

mod capture_checks;
pub mod conformance;

pub use capture_checks::capture_is_supported;
