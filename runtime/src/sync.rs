//! The synchronization primitives the concurrent pieces are built on: std's normally, loom's
//! under `cfg(loom)`, so the same code is model-checked. Shared-state code in this crate and
//! the actor shells imports from here, never from `std::sync` directly.

#[cfg(not(loom))]
pub use std::sync::{atomic, Arc, Condvar, Mutex, MutexGuard};

#[cfg(loom)]
pub use loom::sync::{atomic, Arc, Condvar, Mutex, MutexGuard};

/// Locks `m`, recovering the data if a panicking thread poisoned it. The state guarded in this
/// crate stays consistent across a panic (every update is a single assignment), so poisoning
/// carries no information here and must not turn into a second panic.
#[cfg(not(loom))]
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Locks `m` (loom's mutex never poisons in a model that does not panic).
#[cfg(loom)]
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}
