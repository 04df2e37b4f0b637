//! [`Clock`]: where the core gets the time it records in `host_alloc_time` and
//! `host_free_time`.
//!
//! The core reads no clock of its own: its owner passes one in. The actor passes a
//! [`MonotonicClock`]; tests and trace replays pass a [`ManualClock`], so recorded timings are
//! deterministic.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// A monotonic time source: the time elapsed since some fixed origin.
pub trait Clock: Send + Sync {
    /// Time since the clock's origin.
    fn now(&self) -> Duration;
}

/// The process's monotonic clock ([`Instant`]), origin at construction.
#[derive(Debug, Clone, Copy)]
pub struct MonotonicClock {
    origin: Instant,
}

impl MonotonicClock {
    /// A clock whose origin is now.
    pub fn new() -> Self {
        MonotonicClock {
            origin: Instant::now(),
        }
    }
}

impl Default for MonotonicClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for MonotonicClock {
    fn now(&self) -> Duration {
        self.origin.elapsed()
    }
}

/// A clock that moves only when told to, plus a fixed step on every reading (so a timed
/// operation between two readings lasts exactly `step`).
#[derive(Debug, Default)]
pub struct ManualClock {
    nanos: AtomicU64,
    step_nanos: u64,
}

impl ManualClock {
    /// A clock at 0 that advances by `step` each time it is read.
    pub fn with_step(step: Duration) -> Self {
        ManualClock {
            nanos: AtomicU64::new(0),
            step_nanos: step.as_nanos() as u64,
        }
    }

    /// Moves the clock forward by `d`.
    pub fn advance(&self, d: Duration) {
        self.nanos.fetch_add(d.as_nanos() as u64, Ordering::Relaxed);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Duration {
        Duration::from_nanos(self.nanos.fetch_add(self.step_nanos, Ordering::Relaxed))
    }
}
