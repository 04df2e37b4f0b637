//! What a named pool is set up with and what it holds ([`PoolOptions`], [`PoolUsage`]): a
//! leaf, so the core can keep each pool's record without importing the pools' logic
//! (`pools/`).

use crate::ledger::stats::StatArray;
use crate::pools::pool_state::PoolState;

/// How a named pool behaves.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PoolOptions {
    /// Most bytes the pool may reserve (`None`: no cap but the device's).
    pub quota: Option<u64>,
    /// Lend free blocks to requests of the device that would otherwise fail (PyTorch's
    /// `use_on_oom`).
    pub use_on_oom: bool,
    /// Keep every block unsplit, in a range of its own aligned to this many bytes
    /// (`unsplit.rs`; `None`: blocks are split and merged as usual).
    pub unsplit: Option<u64>,
}

/// What a pool holds, for [`DeviceCore::pool_usage`](crate::DeviceCore::pool_usage).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PoolUsage {
    /// The pool's name.
    pub name: String,
    /// Its quota.
    pub quota: Option<u64>,
    /// Bytes of its segments (all, small pool, large pool).
    pub reserved: StatArray,
    /// Bytes of its live blocks (rounded sizes).
    pub allocated: StatArray,
    /// Its ordinary segments (expandable ones count none, as in the device's statistics).
    pub segments: StatArray,
    /// Where it is in its sleep cycle (`sleep.rs`).
    pub state: PoolState,
    /// Bytes of physical memory its sleep released, which its wake maps back (0 when awake).
    pub asleep_bytes: u64,
}
