//! Running a boxed Rust closure as a `cuLaunchHostFunc` callback.
//!
//! The closure ([`HostFn`], a fat pointer) is boxed once more into a thin pointer that travels
//! as the callback's `userData`; the trampoline takes ownership back, runs it once and frees
//! it. A panic in the closure is caught: unwinding into the driver's thread would abort.

use std::ffi::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};

use crate::types::HostFn;

/// Turns `f` into the `userData` pointer for [`trampoline`]. The pointer owns the closure:
/// pass it to exactly one of [`trampoline`] or [`reclaim`].
pub(crate) fn into_user_data(f: HostFn) -> *mut c_void {
    Box::into_raw(Box::new(f)).cast()
}

/// Takes back a pointer from [`into_user_data`] whose launch failed, and drops the closure.
///
/// # Safety
/// `data` comes from [`into_user_data`] and was not passed to [`trampoline`] nor reclaimed.
pub(crate) unsafe fn reclaim(data: *mut c_void) {
    // SAFETY: per this function's contract, `data` is a live `Box<HostFn>` we own.
    drop(unsafe { Box::from_raw(data.cast::<HostFn>()) });
}

/// The `CUhostFn` the driver calls: runs and frees the closure behind `data`.
///
/// # Safety
/// `data` comes from [`into_user_data`] and is passed here exactly once (the driver calls a
/// host function once per successful launch).
pub(crate) unsafe extern "C" fn trampoline(data: *mut c_void) {
    // SAFETY: per this function's contract, `data` is a live `Box<HostFn>` that nobody else
    // will touch again; we take ownership and free it when this function returns.
    let f = unsafe { Box::from_raw(data.cast::<HostFn>()) };
    if catch_unwind(AssertUnwindSafe(move || (*f)())).is_err() {
        tracing::error!("a host function launched on a CUDA stream panicked");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    #[test]
    fn runs_once_and_frees_the_closure() {
        let hits = Arc::new(AtomicUsize::new(0));
        let h = hits.clone();
        let data = into_user_data(Box::new(move || {
            h.fetch_add(1, Ordering::SeqCst);
        }));
        assert_eq!(Arc::strong_count(&hits), 2);
        // SAFETY: `data` is fresh from `into_user_data` and used once.
        unsafe { trampoline(data) };
        assert_eq!(hits.load(Ordering::SeqCst), 1);
        assert_eq!(
            Arc::strong_count(&hits),
            1,
            "closure (and its capture) was freed"
        );
    }

    #[test]
    fn reclaim_frees_without_running() {
        let hits = Arc::new(AtomicUsize::new(0));
        let h = hits.clone();
        let data = into_user_data(Box::new(move || {
            h.fetch_add(1, Ordering::SeqCst);
        }));
        // SAFETY: `data` is fresh from `into_user_data` and used once.
        unsafe { reclaim(data) };
        assert_eq!(hits.load(Ordering::SeqCst), 0);
        assert_eq!(Arc::strong_count(&hits), 1);
    }

    #[test]
    fn a_panicking_closure_is_contained() {
        let guard = Arc::new(());
        let g = guard.clone();
        let data = into_user_data(Box::new(move || {
            let _g = g;
            panic!("boom");
        }));
        // SAFETY: `data` is fresh from `into_user_data` and used once.
        unsafe { trampoline(data) };
        assert_eq!(Arc::strong_count(&guard), 1);
    }
}
