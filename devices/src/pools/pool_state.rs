//! Where a named pool is in its sleep cycle (`sleep.rs` moves it): a leaf, so errors and the
//! pools' records can name a pool's state without depending on the sleep itself.

use std::fmt;

/// Where a named pool is in its sleep cycle.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PoolState {
    /// Serving allocations.
    #[default]
    Awake,
    /// Between [`DeviceCore::begin_sleep`](crate::DeviceCore::begin_sleep) and its finish or abort.
    FallingAsleep,
    /// Its physical memory released.
    Asleep,
    /// Between [`DeviceCore::begin_wake`](crate::DeviceCore::begin_wake) and its finish or abort.
    Waking,
}

impl fmt::Display for PoolState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            PoolState::Awake => "awake",
            PoolState::FallingAsleep => "falling asleep",
            PoolState::Asleep => "asleep",
            PoolState::Waking => "waking",
        })
    }
}
