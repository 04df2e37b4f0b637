//! The backend calls behind a registration: retry once, classify failures, log slow calls.
//!
//! Shared by the sync [`super::HostRegistry`] and the [`super::AsyncRegistry`] (which runs
//! these on a blocking thread). When the backend refuses a range, the range is checked against
//! `/proc/self/maps`: a hole is reported as [`RegisterError::Unmapped`] at once; anything else
//! is asked of the backend once more (its answer, not the cache's, is authoritative) before a
//! [`RegisterError::Backend`] is returned. The caller then drops the affected cache entries.

use std::ops::Range;
use std::time::{Duration, Instant};

use gpualloc_runtime::{Backend, HostRegisterFlags};

use super::error::{RegisterError, RegisterResult};
use super::maps::own_mappings_crossed;
use super::stats::SlowRegistration;

/// Default threshold above which a backend registration is logged as slow.
pub const DEFAULT_SLOW_THRESHOLD: Duration = Duration::from_millis(10);

/// Registers `range` at the backend (see the module docs); `calls` counts the backend calls
/// made. On success, returns the slow-call record when the call was slow.
///
/// # Safety
/// As [`gpualloc_runtime::Backend::host_register`]: the range stays mapped until it is
/// unregistered.
pub unsafe fn register(
    backend: &dyn Backend,
    range: &Range<u64>,
    flags: HostRegisterFlags,
    slow_threshold: Duration,
    calls: &mut u64,
) -> RegisterResult<Option<SlowRegistration>> {
    let len = range.end - range.start;
    let ptr = range.start as *mut u8;
    let started = Instant::now();
    *calls += 1;
    // SAFETY: this function's own contract.
    if let Err(first) = unsafe { backend.host_register(ptr, len, flags) } {
        if let Some(Err(hole)) = own_mappings_crossed(range, !flags.read_only) {
            return Err(RegisterError::Unmapped {
                range: range.clone(),
                hole,
            });
        }
        tracing::debug!(start = range.start, len, error = %first, "host_register failed; retrying once");
        *calls += 1;
        // SAFETY: as above.
        unsafe { backend.host_register(ptr, len, flags) }.map_err(|source| {
            RegisterError::Backend {
                op: "host_register",
                range: range.clone(),
                source,
            }
        })?;
    }
    let took = started.elapsed();
    let slow = (took >= slow_threshold).then(|| {
        let mappings = own_mappings_crossed(range, !flags.read_only).and_then(Result::ok);
        tracing::warn!(
            start = format_args!("{:#x}", range.start),
            len,
            mappings = mappings.unwrap_or(0),
            took_us = took.as_micros() as u64,
            "slow host registration: the range crosses {} OS mappings (fragmented address space \
             makes registration slower; see /proc/self/maps)",
            mappings.map_or_else(|| "an unknown number of".to_string(), |m| m.to_string()),
        );
        SlowRegistration {
            range: range.clone(),
            mappings,
            took,
        }
    });
    if slow.is_none() {
        tracing::trace!(
            start = range.start,
            len,
            took_us = took.as_micros() as u64,
            "host_register"
        );
    }
    Ok(slow)
}

/// Unregisters the backend range starting at `range.start`, retrying once; `calls` counts
/// the backend calls made.
///
/// # Safety
/// As [`gpualloc_runtime::Backend::host_unregister`]: no copy queued on the range is still
/// pending.
pub unsafe fn unregister(
    backend: &dyn Backend,
    range: &Range<u64>,
    calls: &mut u64,
) -> RegisterResult<()> {
    let ptr = range.start as *mut u8;
    *calls += 1;
    // SAFETY: this function's own contract.
    match unsafe { backend.host_unregister(ptr) } {
        Ok(()) => Ok(()),
        Err(first) => {
            tracing::debug!(start = range.start, error = %first, "host_unregister failed; retrying once");
            *calls += 1;
            // SAFETY: as above.
            unsafe { backend.host_unregister(ptr) }
                .map_err(|source| {
                    tracing::warn!(start = range.start, error = %source, "host_unregister failed twice; dropping the range from the cache");
                    RegisterError::Backend {
                        op: "host_unregister",
                        range: range.clone(),
                        source,
                    }
                })
        }
    }
}
