//! Backend calls whose panic (a custom backend's bug) must become an error, so the caller's
//! failure path runs (a claim goes back, planned pages go back to the unmapped set, a sleep is
//! rolled back) instead of unwinding past the books that count the call as in flight.
//!
//! What the call had done before it panicked is not undone: the backend's state is unknown.

use std::panic::{catch_unwind, AssertUnwindSafe};

use crate::error::BackendError;

/// Runs `call`, one or more backend calls described by `what`; a panic in it becomes
/// `BackendError::Unavailable("the backend panicked during {what}")` (in the call's own error
/// type), logged as an error.
pub fn guarded<T, E: From<BackendError>>(
    what: &str,
    call: impl FnOnce() -> Result<T, E>,
) -> Result<T, E> {
    catch_unwind(AssertUnwindSafe(call)).unwrap_or_else(|_| {
        tracing::error!("the backend panicked during {what}");
        Err(BackendError::Unavailable(format!("the backend panicked during {what}")).into())
    })
}
