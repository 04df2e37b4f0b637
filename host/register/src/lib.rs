//! Registering host memory the user already has (a big `Vec`, an mmapped model file) with
//! the backend (`cuMemHostRegister` on CUDA), after ROCm's shared-virtual-memory lessons: a
//! concept of its own, apart from the pinned-host caching allocator (`gpualloc-host`), which
//! allocates the memory it pins itself.
//!
//! Feature `async` (on by default) adds [`AsyncRegistry`], on tokio's blocking pool; without
//! it the crate needs no async runtime.
//!
//! - [`interval_cache`]: [`IntervalCache`], the pure interval cache (§3.1): dedup, reference
//!   counts per backend range, only missing parts registered, never split.
//! - [`registry`]: [`HostRegistry`], the synchronous registry over a `Backend`.
//! - `async_registry` (feature `async`): `AsyncRegistry`, backend calls on tokio's blocking
//!   pool, shared completions for concurrent registrations of one range (§3.2).
//! - [`coherence`]: [`CoherenceGuard`], CPU/device ordering at hand-overs (§3.3).
//! - [`fork`]: registrations do not survive `fork()` (§2.3): detection and the typed error.
//! - [`exec`]: the backend calls (retry once, failure classification, slow-call log with the
//!   number of OS mappings crossed, §2.1); [`maps`]: `/proc/self/maps`.
//! - [`stats`]: [`RegistryStats`]; [`error`]: [`RegisterError`].

#[cfg(feature = "async")]
pub mod async_registry;
pub mod coherence;
pub mod error;
pub mod exec;
pub mod fork;
pub mod interval_cache;
pub use gpualloc_runtime::procmaps as maps;
pub mod registry;
pub mod stats;

#[cfg(feature = "async")]
pub use async_registry::{
    AsyncOptions, AsyncRegistry, PendingRegistration, PendingRelease, RegistrationMode,
};
pub use coherence::CoherenceGuard;
pub use error::{RegisterError, RegisterResult};
pub use interval_cache::{BackendRange, IntervalCache, RegistrationId, RegistrationInfo};
pub use registry::HostRegistry;
pub use stats::{RegistryStats, SlowRegistration};

/// The OS page size: the unit the registry rounds ranges to.
pub fn page_size() -> u64 {
    rustix::param::page_size() as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn send_sync<T: Send + Sync>() {}
    #[cfg(feature = "async")]
    fn send<T: Send>() {}

    #[test]
    fn handles_cross_threads() {
        send_sync::<HostRegistry>();
        send_sync::<CoherenceGuard>();
        #[cfg(feature = "async")]
        {
            send_sync::<AsyncRegistry>();
            send::<PendingRegistration>();
            send::<PendingRelease>();
        }
    }
}
