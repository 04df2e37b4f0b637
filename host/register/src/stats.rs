//! [`RegistryStats`]: counters of a registry, for tests, benchmarks and diagnostics.

use std::ops::Range;
use std::time::Duration;

/// A backend registration that took at least the registry's slow threshold.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlowRegistration {
    /// The backend range registered.
    pub range: Range<u64>,
    /// OS mappings the range crossed (`None` when the map could not be read).
    pub mappings: Option<u64>,
    /// How long the backend call took.
    pub took: Duration,
}

/// Counters of one registry.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RegistryStats {
    /// Successful `register` calls.
    pub registrations: u64,
    /// Registrations fully covered by the cache (no backend call of their own).
    pub cache_hits: u64,
    /// Successful `release` calls.
    pub releases: u64,
    /// `host_register` calls made (retries included).
    pub backend_registers: u64,
    /// `host_unregister` calls made (retries included).
    pub backend_unregisters: u64,
    /// Registrations or releases that failed at the backend.
    pub backend_failures: u64,
    /// Backend registrations at or above the slow threshold.
    pub slow_registrations: u64,
    /// The slowest of them.
    pub slowest: Option<SlowRegistration>,
}

impl RegistryStats {
    /// Records a slow registration.
    pub fn record_slow(&mut self, slow: SlowRegistration) {
        self.slow_registrations += 1;
        if self.slowest.as_ref().is_none_or(|s| s.took < slow.took) {
            self.slowest = Some(slow);
        }
    }
}
