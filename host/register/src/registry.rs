//! [`HostRegistry`]: registering existing host memory, synchronously, through the
//! [`IntervalCache`].
//!
//! A synchronous core: plain Rust that calls an `Arc<dyn Backend>` itself, with no async
//! runtime, no threads and no clock of its own (the slow-call diagnostic times the backend
//! call, nothing else). `register` rounds the range out to pages, asks the cache what is
//! missing, registers only that at the backend, and returns a [`RegistrationId`] that
//! remembers what the user asked for. `release` unregisters a backend range when its last
//! user releases it. `query` answers from the cache alone.
//!
//! On a backend failure the cache entries of the failed call are dropped (together with the
//! parts of this registration already registered, which are unregistered again), so the cache
//! never claims a range the backend does not hold; see [`super::exec`] for the retry.

use std::sync::Arc;
use std::time::Duration;

use gpualloc_runtime::{Backend, HostRegisterFlags};

#[cfg(doc)]
use super::error::RegisterError;
use super::error::RegisterResult;
use super::exec::{self, DEFAULT_SLOW_THRESHOLD};
use super::fork::ProcessGuard;
use super::interval_cache::{BackendRange, IntervalCache, RegistrationId, RegistrationInfo};
use super::stats::RegistryStats;

/// Registers existing host memory with a backend, deduplicated by an interval cache.
pub struct HostRegistry {
    backend: Arc<dyn Backend>,
    cache: IntervalCache,
    process: ProcessGuard,
    slow_threshold: Duration,
    stats: RegistryStats,
}

impl std::fmt::Debug for HostRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostRegistry")
            .field("backend", &self.backend.name())
            .field("registrations", &self.cache.len())
            .field("pid", &self.process.pid())
            .finish()
    }
}

impl HostRegistry {
    /// A registry over `backend`, for this process.
    pub fn new(backend: Arc<dyn Backend>) -> Self {
        HostRegistry {
            backend,
            cache: IntervalCache::new(crate::page_size()),
            process: ProcessGuard::new(),
            slow_threshold: DEFAULT_SLOW_THRESHOLD,
            stats: RegistryStats::default(),
        }
    }

    /// Sets the duration from which a backend registration is logged (`warn`) as slow, with
    /// the number of OS mappings its range crosses. Default: 10 ms.
    pub fn with_slow_threshold(mut self, threshold: Duration) -> Self {
        self.slow_threshold = threshold;
        self
    }

    /// Registers `ptr..ptr + len` (rounded out to pages) with `flags`. A range already
    /// covered by earlier registrations makes no backend call; an overlapping or adjacent one
    /// registers only the missing parts.
    ///
    /// Errors: [`RegisterError::NullPointer`], [`RegisterError::ZeroLength`],
    /// [`RegisterError::Wraps`], [`RegisterError::FlagConflict`],
    /// [`RegisterError::Unmapped`], [`RegisterError::Backend`], [`RegisterError::Forked`].
    /// On any error the cache and the backend are as before the call.
    ///
    /// # Safety
    /// The range is memory of this process that stays mapped while any registration covers
    /// it, and no copy queued on it is still pending when the last registration covering it
    /// is released (or the registry dropped): the driver copies into a registered range by
    /// address, later (see [`gpualloc_runtime::Backend::host_register`]).
    pub unsafe fn register(
        &mut self,
        ptr: *const u8,
        len: u64,
        flags: HostRegisterFlags,
    ) -> RegisterResult<RegistrationId> {
        self.process.check()?;
        let plan = self.cache.plan_register(ptr as u64, len, flags)?;
        if plan.new_ranges.is_empty() {
            self.stats.cache_hits += 1;
        }
        for (i, range) in plan.new_ranges.iter().enumerate() {
            // SAFETY: a part of the caller's range, under this function's contract.
            let result = unsafe {
                exec::register(
                    &*self.backend,
                    range,
                    flags,
                    self.slow_threshold,
                    &mut self.stats.backend_registers,
                )
            };
            match result {
                Ok(slow) => {
                    if let Some(slow) = slow {
                        self.stats.record_slow(slow);
                    }
                    self.cache.range_done(range.start);
                }
                Err(e) => {
                    self.stats.backend_failures += 1;
                    let mut undo = self.cache.range_failed(range.start).unregister;
                    for rest in &plan.new_ranges[i + 1..] {
                        undo.extend(self.cache.range_failed(rest.start).unregister);
                    }
                    for r in &undo {
                        // SAFETY: registered by this call just now: nothing was queued on it.
                        if let Err(u) = unsafe {
                            exec::unregister(&*self.backend, r, &mut self.stats.backend_unregisters)
                        } {
                            tracing::warn!(error = %u, "undoing a partial registration failed");
                        }
                    }
                    return Err(e);
                }
            }
        }
        self.stats.registrations += 1;
        Ok(plan.id)
    }

    /// Releases registration `id`; backend ranges it was the last user of are unregistered.
    /// Releasing twice is [`RegisterError::UnknownRegistration`]. If the backend refuses an
    /// unregister twice, the range is dropped from the cache anyway (the backend's
    /// `host_unregister` fails only for a range it does not hold) and the error returned.
    pub fn release(&mut self, id: RegistrationId) -> RegisterResult<()> {
        self.process.check()?;
        let undo = self.cache.release(id)?;
        self.stats.releases += 1;
        let mut first_err = None;
        for r in &undo {
            // SAFETY: the last registration of the range is released: `register`'s contract
            // has no copy pending on it.
            if let Err(e) =
                unsafe { exec::unregister(&*self.backend, r, &mut self.stats.backend_unregisters) }
            {
                self.stats.backend_failures += 1;
                first_err.get_or_insert(e);
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    /// The registration covering `ptr`, answered from the cache (no backend call). `None`
    /// when nothing covers it, or in a forked child (nothing is registered there).
    pub fn query(&self, ptr: *const u8) -> Option<RegistrationInfo> {
        if self.process.is_forked() {
            return None;
        }
        self.cache.query(ptr as u64)
    }

    /// What registration `id` covers, or `None` when it is not live.
    pub fn info(&self, id: RegistrationId) -> Option<RegistrationInfo> {
        self.cache.info(id)
    }

    /// Live registrations.
    pub fn len(&self) -> usize {
        self.cache.len()
    }

    /// True when no registration is live.
    pub fn is_empty(&self) -> bool {
        self.cache.is_empty()
    }

    /// The backend registrations the cache holds, ascending.
    pub fn backend_ranges(&self) -> Vec<BackendRange> {
        self.cache.backend_ranges()
    }

    /// The interval cache (read only), e.g. to check its invariants.
    pub fn cache(&self) -> &IntervalCache {
        &self.cache
    }

    /// Counters since creation.
    pub fn stats(&self) -> &RegistryStats {
        &self.stats
    }

    /// True when used from a process other than the one that created it (see
    /// [`super::fork`]).
    pub fn is_forked(&self) -> bool {
        self.process.is_forked()
    }

    /// In a forked child: forgets the parent's registrations (no backend call; the child
    /// holds none of them), adopts this process and `backend` (a backend created in the
    /// child), and returns what was forgotten, so the child can re-register what it needs.
    pub fn reset_after_fork(&mut self, backend: Arc<dyn Backend>) -> Vec<RegistrationInfo> {
        self.backend = backend;
        self.process = ProcessGuard::new();
        self.cache.clear()
    }
}

impl Drop for HostRegistry {
    /// Unregisters every backend range still held (not in a forked child, where the backend
    /// holds none of them).
    fn drop(&mut self) {
        if self.process.is_forked() {
            return;
        }
        let mut calls = 0;
        for r in self.cache.drain() {
            // SAFETY: the registry is dropped: `register`'s contract has no copy pending.
            if let Err(e) = unsafe { exec::unregister(&*self.backend, &r, &mut calls) } {
                tracing::warn!(error = %e, "unregister at registry drop failed");
            }
        }
    }
}
