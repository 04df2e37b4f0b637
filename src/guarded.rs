//! Backend calls made off the gate whose panic (a custom backend's bug) must become an error,
//! so the caller's failure path runs: a sleep or wake is rolled back, `empty_cache`'s event
//! synchronizations, segment frees and page unmaps go on as after a failed call. (A miss's
//! driver calls are guarded the same way where the miss chain makes them,
//! `gpualloc_devices::MissIo::perform`.) Unguarded, a panic skipped those paths and left the
//! core counting work that would never land.
//!
//! What the call had done before it panicked is not undone (pages it mapped stay mapped,
//! unaccounted): the backend's state is unknown.

use gpualloc_runtime::BackendError;

pub(crate) use gpualloc_runtime::guarded;

/// [`guarded`] for a step that logs its own failures and returns nothing (unmaps, page
/// releases): a panic in it is logged, and the caller goes on as after a failed call.
pub(crate) fn guarded_step(what: &str, step: impl FnOnce()) {
    let _ = guarded(what, || {
        step();
        Ok::<(), BackendError>(())
    });
}
