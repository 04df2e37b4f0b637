//! The slow paths of a device actor, run on tokio's blocking pool and outside the gate
//! wherever the driver is involved, so cache hits keep being served:
//! - a miss's device malloc (PyTorch's `release_lock_on_cudamalloc`, always on here);
//! - expandable segments: creating, mapping and giving access to the pages a miss needs (plan
//!   under the gate, map outside, commit under it: `gpualloc_devices::growth`), and releasing
//!   free pages on `empty_cache` and when the device is full (detach under the gate, stream
//!   synchronization and unmapping outside, finish under it: `gpualloc_devices::shrink`);
//! - garbage collection (`garbage_collection_threshold`): the victims are chosen and taken out
//!   of the books under the gate, and freed outside;
//! - the out-of-memory chain's event synchronization and segment frees, `empty_cache` and
//!   shutdown.
//!
//! - a miss over `per_process_memory_fraction`: the cache is released off the gate before the
//!   segment is claimed again (with expandable segments: cached pages are unmapped off the
//!   gate before the growth is planned again).
//!
//! The gate is taken only for the short bookkeeping steps in between. When all of the above
//! found no room, the last step under the gate (`DeviceCore::malloc_without_device`) only
//! looks for blocks freed meanwhile and writes PyTorch's report: no device call. Only
//! shutdown runs the core's own release under the gate (nothing is served after it); the
//! core's in-place chain (`malloc_after_miss`) is for owners without a gate (`malloc`,
//! replay).

use std::sync::Arc;

use gpualloc_devices::{
    free_detached, map_growth, release_pages, release_reservation, AllocError, CachedOutcome,
    Growth, SegmentRequest,
};
use gpualloc_runtime::{DevicePtr, Stream};

use crate::actor::device::DeviceActor;
use crate::buffer::DeviceBuffer;
use crate::error::Error;
use crate::guarded::{guarded, guarded_step};

/// What an off-gate growth came to.
enum Grown {
    /// The request is served.
    Buffer(DeviceBuffer),
    /// Nothing to map: over the fraction cap, or the free blocks already suffice (freed
    /// meanwhile).
    InPlace(SegmentRequest),
    /// The device had no memory for the pages.
    Full(SegmentRequest),
}

/// Rounds of off-gate growth a miss tries (each maps what the request still lacks; another
/// request may take freshly mapped pages first) before the core's chain continues in place.
const GROWTH_ROUNDS: usize = 4;

impl DeviceActor {
    /// Finishes a miss: device malloc off the gate; if the device is full, release the cache
    /// off the gate and retry; finally the core's own chain.
    pub(crate) fn miss_blocking(
        self: &Arc<Self>,
        req: SegmentRequest,
        stream: Stream,
    ) -> Result<DeviceBuffer, Error> {
        let result = self.miss_inner(req, stream);
        let pruned = self
            .mailbox
            .hold_blocking()
            .state()
            .prune_streams_if_grown();
        drop(pruned);
        result
    }

    fn miss_inner(
        self: &Arc<Self>,
        req: SegmentRequest,
        stream: Stream,
    ) -> Result<DeviceBuffer, Error> {
        let size = req.requested();
        let _span = tracing::debug_span!(
            "malloc_miss",
            device = self.device.0,
            size,
            alloc_size = req.alloc_size()
        )
        .entered();
        let (req, expandable, claimed, collected) = {
            let mut held = self.mailbox.hold_blocking();
            // A miss may leave a segment of this stream in the cache: keep the stream alive
            // while the core names it (`streams.rs`).
            held.state().streams.keep(&stream);
            // Segments of streams their users dropped serve this request before a new one is
            // made (`gpualloc_devices::orphans`).
            held.state().retire_dropped_streams();
            let core = &mut held.state().core;
            let req = match core.malloc_from_orphans(req) {
                Ok(a) => {
                    drop(held);
                    return Ok(DeviceBuffer::new(a, self.clone(), stream));
                }
                Err(req) => req,
            };
            // Garbage collection (`garbage_collection_threshold`) picks its victims here and
            // frees them below, off the gate.
            let collected = core.detach_gc_victims()?;
            // Expandable segments map pages instead of allocating a segment (below). A
            // segment allocated off the gate is claimed against `per_process_memory_fraction`
            // first, so concurrent misses cannot overshoot it together.
            let expandable = req.maps_pages(core);
            let claimed = !expandable && req.claim_fraction(core);
            (req, expandable, claimed, collected)
        };
        if !collected.is_empty() {
            let _gc = tracing::debug_span!("garbage_collect", device = self.device.0).entered();
            let freed = guarded("garbage collection's segment frees", || {
                free_detached(self.backend.as_ref(), self.device, &collected)
            });
            if let Err(e) = freed {
                tracing::warn!(device = self.device.0, error = %e, "segment free failed");
            }
            self.signals.waiters.wake_head();
        }
        // When the device (or the fraction cap) had no room, the cache is released off the
        // gate and the device tried again; the core's last step then makes no device call.
        let req = if expandable {
            match self.grow_off_gate(req, &stream)? {
                Grown::Buffer(buf) => return Ok(buf),
                // Full: the device had no memory for the pages. Nothing to map: over the
                // fraction cap (or blocks were freed meanwhile, which the last step finds).
                Grown::Full(req) | Grown::InPlace(req) => {
                    // A block the `gpualloc` policy passed over for the growth serves the
                    // request before any cache is released (`gpualloc_devices::placement`).
                    let passed_over = self
                        .mailbox
                        .hold_blocking()
                        .state()
                        .core
                        .malloc_passed_over(req);
                    let req = match passed_over {
                        Ok(a) => return Ok(DeviceBuffer::new(a, self.clone(), stream)),
                        Err(req) => req,
                    };
                    tracing::info!(
                        device = self.device.0,
                        size,
                        "no room for the pages: releasing cached memory"
                    );
                    if self.release_cache_blocking_for(Some(&req)) > 0 {
                        match self.grow_off_gate(req, &stream)? {
                            Grown::Buffer(buf) => return Ok(buf),
                            Grown::InPlace(req) | Grown::Full(req) => req,
                        }
                    } else {
                        req
                    }
                }
            }
        } else {
            let outcome = if claimed {
                self.malloc_claimed(req, &stream)?
            } else {
                // Over the memory-fraction cap: free the cache off the gate, claim again.
                self.release_then_claim(req, &stream)?
            };
            match outcome {
                Ok(buf) => return Ok(buf),
                Err(req) => req,
            }
        };
        let result = self
            .mailbox
            .hold_blocking()
            .state()
            .core
            .malloc_without_device(req);
        match result {
            Ok(a) => Ok(DeviceBuffer::new(a, self.clone(), stream)),
            Err(e) => {
                if e.is_oom() {
                    tracing::warn!(device = self.device.0, size, "out of memory");
                }
                Err(e.into())
            }
        }
    }

    /// A request whose segment does not fit under `per_process_memory_fraction`: releases the
    /// cache off the gate (PyTorch frees cached blocks before giving up on the cap), then
    /// looks in the cache again and claims again. `Err(req)`: still over the cap (nothing
    /// was released, or not enough): the miss ends in the core's last step, which makes no
    /// device call.
    fn release_then_claim(
        self: &Arc<Self>,
        req: SegmentRequest,
        stream: &Stream,
    ) -> Result<Result<DeviceBuffer, SegmentRequest>, Error> {
        // A block freed since the lookup serves it before any cache is released (at a
        // pool's quota the release would take the pool's own free segments).
        {
            let mut held = self.mailbox.hold_blocking();
            if let CachedOutcome::Hit(a) = held.state().core.retry_cached(&req)? {
                drop(held);
                return Ok(Ok(DeviceBuffer::new(a, self.clone(), stream.clone())));
            }
        }
        if self.release_cache_blocking_for(Some(&req)) == 0 {
            return Ok(Err(req));
        }
        let retry = {
            let mut held = self.mailbox.hold_blocking();
            let core = &mut held.state().core;
            match core.retry_cached(&req)? {
                CachedOutcome::Hit(a) => {
                    drop(held);
                    return Ok(Ok(DeviceBuffer::new(a, self.clone(), stream.clone())));
                }
                CachedOutcome::Miss(retry) => {
                    if !retry.claim_fraction(core) {
                        return Ok(Err(retry));
                    }
                    retry
                }
            }
        };
        self.malloc_claimed(retry, stream)
    }

    /// A device malloc off the gate for a request whose segment was claimed against the
    /// memory-fraction cap; if the device is full, release the cache off the gate and retry.
    /// `Err(req)` (claim dropped): the core's own chain continues.
    fn malloc_claimed(
        self: &Arc<Self>,
        req: SegmentRequest,
        stream: &Stream,
    ) -> Result<Result<DeviceBuffer, SegmentRequest>, Error> {
        let size = req.requested();
        match guarded("a miss's segment malloc", || {
            self.backend.malloc(self.device, req.alloc_size())
        }) {
            Ok(ptr) => return self.adopt(req, ptr, stream.clone()).map(Ok),
            Err(e) if e.is_oom() => {
                tracing::info!(
                    device = self.device.0,
                    size,
                    "device full: releasing cached memory"
                );
            }
            Err(e) => {
                self.unclaim(&req);
                return Err(e.into());
            }
        }
        let released = self.release_cache_blocking();
        let outcome = self.mailbox.hold_blocking().state().core.retry_cached(&req);
        // The retry below claims the same bytes (same size, same rounding).
        let retry = match outcome {
            Ok(CachedOutcome::Hit(a)) => {
                self.unclaim(&req);
                return Ok(Ok(DeviceBuffer::new(a, self.clone(), stream.clone())));
            }
            Ok(CachedOutcome::Miss(retry)) => retry,
            Err(e) => {
                self.unclaim(&req);
                return Err(e.into());
            }
        };
        if released > 0 {
            tracing::debug!(device = self.device.0, size, "retrying device malloc");
            match guarded("a miss's segment malloc", || {
                self.backend.malloc(self.device, retry.alloc_size())
            }) {
                Ok(ptr) => return self.adopt(retry, ptr, stream.clone()).map(Ok),
                Err(e) if e.is_oom() => {}
                Err(e) => {
                    self.unclaim(&req);
                    return Err(e.into());
                }
            }
        }
        self.unclaim(&req);
        Ok(Err(retry))
    }

    /// Drops the fraction claim of a segment that was not obtained.
    fn unclaim(&self, req: &SegmentRequest) {
        self.mailbox
            .hold_blocking()
            .state()
            .core
            .segment_not_obtained(req);
    }

    /// Expandable segments: maps the pages a miss needs off the gate (plan under the gate,
    /// map outside, commit under it: `gpualloc_devices::growth`), then retries the cached
    /// path.
    fn grow_off_gate(
        self: &Arc<Self>,
        mut req: SegmentRequest,
        stream: &Stream,
    ) -> Result<Grown, Error> {
        for _ in 0..GROWTH_ROUNDS {
            let plan = match self
                .mailbox
                .hold_blocking()
                .state()
                .core
                .plan_growth(&req)?
            {
                Growth::Map(plan) => plan,
                Growth::InPlace => return Ok(Grown::InPlace(req)),
            };
            let mapped = {
                let _map = tracing::debug_span!(
                    "expandable_map",
                    device = self.device.0,
                    bytes = plan.bytes()
                )
                .entered();
                guarded("a miss's page mapping", || {
                    map_growth(self.backend.as_ref(), &plan)
                })
            };
            let mut held = self.mailbox.hold_blocking();
            let core = &mut held.state().core;
            match mapped {
                Ok(handles) => {
                    if let Err(refused) = core.commit_growth(plan, handles) {
                        drop(held);
                        refused.release(self.backend.as_ref());
                        return Err(AllocError::Shutdown.into());
                    }
                    // The new pages are cached now; another request may take them first.
                    match core.retry_cached(&req)? {
                        CachedOutcome::Hit(a) => {
                            drop(held);
                            return Ok(Grown::Buffer(DeviceBuffer::new(
                                a,
                                self.clone(),
                                stream.clone(),
                            )));
                        }
                        CachedOutcome::Miss(r) => req = r,
                    }
                }
                Err(e) => {
                    let orphaned = core.abort_growth(plan);
                    drop(held);
                    if let Some(reservation) = orphaned {
                        release_reservation(self.backend.as_ref(), self.device, reservation);
                        return Err(AllocError::Shutdown.into());
                    }
                    if e.is_oom() {
                        return Ok(Grown::Full(req));
                    }
                    return Err(e.into());
                }
            }
        }
        Ok(Grown::InPlace(req))
    }

    /// Hands a segment allocated off the gate to the core (or back to the backend if the core
    /// shut down meanwhile).
    fn adopt(
        self: &Arc<Self>,
        req: SegmentRequest,
        ptr: DevicePtr,
        stream: Stream,
    ) -> Result<DeviceBuffer, Error> {
        let mut held = self.mailbox.hold_blocking();
        let core = &mut held.state().core;
        if core.is_shut_down() {
            core.segment_not_obtained(&req);
            drop(held);
            if let Err(e) = self.backend.free(self.device, ptr) {
                tracing::warn!(device = self.device.0, %ptr, error = %e, "free after shutdown failed");
            }
            return Err(AllocError::Shutdown.into());
        }
        let a = core.malloc_with_segment(req, ptr)?;
        drop(held);
        Ok(DeviceBuffer::new(a, self.clone(), stream))
    }

    /// Returns every unused cached segment to the device, doing the driver calls off the
    /// gate: synchronize the events pending frees wait on, detach the free segments, free
    /// them. Returns how many segments went back.
    pub(crate) fn release_cache_blocking(&self) -> usize {
        self.release_cache_blocking_for(None)
    }

    /// [`DeviceActor::release_cache_blocking`]; for a request at its private pool's quota,
    /// that pool's own cached segments go back too (`gpualloc_devices` `mem_pools.rs`).
    pub(crate) fn release_cache_blocking_for(&self, request: Option<&SegmentRequest>) -> usize {
        let _span = tracing::debug_span!("release_cache", device = self.device.0).entered();
        let events = self.mailbox.hold_blocking().state().core.pending_events();
        for e in events {
            let synced = guarded("a cache release's event synchronization", || {
                self.backend.event_synchronize(e)
            });
            if let Err(err) = synced {
                tracing::warn!(device = self.device.0, error = %err, "event synchronize failed");
            }
        }
        let detached = self
            .mailbox
            .hold_blocking()
            .state()
            .core
            .detach_free_segments_for(request);
        let segments = match detached {
            Ok(s) => s,
            Err(e) => {
                if !e.eq(&AllocError::Shutdown) {
                    tracing::warn!(device = self.device.0, error = %e, "releasing the cache failed");
                }
                return 0;
            }
        };
        let freed = guarded("a cache release's segment frees", || {
            free_detached(self.backend.as_ref(), self.device, &segments)
        });
        if let Err(e) = freed {
            tracing::warn!(device = self.device.0, error = %e, "segment free failed");
        }
        let pages = self.release_free_pages_blocking(request);
        if !segments.is_empty() || pages > 0 {
            self.signals.waiters.wake_head();
        }
        self.prune_streams();
        segments.len() + pages
    }

    /// Expandable segments: unmaps the whole pages of every free block, with the stream
    /// synchronization and the driver calls off the gate (`gpualloc_devices::shrink`).
    /// Returns how many free blocks gave up pages.
    fn release_free_pages_blocking(&self, request: Option<&SegmentRequest>) -> usize {
        let detached = self
            .mailbox
            .hold_blocking()
            .state()
            .core
            .detach_free_pages_for(request);
        let releases = match detached {
            Ok(r) if !r.is_empty() => r,
            _ => return 0,
        };
        let n = releases.len();
        // A panic while unmapping (a custom backend's bug) is logged by the guard; the core
        // books the pages released either way, as it does when an unmap fails.
        guarded_step("a cache release's page unmaps", || {
            release_pages(self.backend.as_ref(), &releases)
        });
        let mut orphaned = Vec::new();
        {
            let mut held = self.mailbox.hold_blocking();
            let core = &mut held.state().core;
            for r in releases {
                match core.finish_page_release(r) {
                    Ok(Some(reservation)) => orphaned.push(reservation),
                    Ok(None) => {}
                    Err(e) => {
                        tracing::warn!(device = self.device.0, error = %e, "finishing a page release failed")
                    }
                }
            }
        }
        for reservation in orphaned {
            release_reservation(self.backend.as_ref(), self.device, reservation);
        }
        n
    }

    /// `empty_cache` for this device.
    pub(crate) fn empty_cache_blocking(&self) -> Result<(), Error> {
        if self.mailbox.hold_blocking().state().core.is_shut_down() {
            return Err(AllocError::Shutdown.into());
        }
        self.release_cache_blocking();
        let mut held = self.mailbox.hold_blocking();
        let core = &mut held.state().core;
        if core.config().expandable_segments {
            // Unmapping pages of expandable segments is the core's own business.
            core.empty_cache()?;
        }
        drop(held);
        self.prune_streams();
        Ok(())
    }

    /// Lets go of the kept streams the core no longer names (`streams.rs`), dropping them
    /// after the gate is released.
    pub(crate) fn prune_streams(&self) {
        let pruned = {
            let mut held = self.mailbox.hold_blocking();
            let st = held.state();
            st.streams.prune(&st.core)
        };
        drop(pruned);
    }

    /// Shuts the core down (every segment back to the device) and wakes every waiter so
    /// they fail at once instead of waiting out their timeouts.
    pub(crate) fn shutdown_blocking(&self) -> Result<(), Error> {
        // Closed before the core lets go of its memory: nothing parked is revived after.
        self.close_thread_cache();
        let (result, kept) = {
            let mut held = self.mailbox.hold_blocking();
            let st = held.state();
            let result = st.core.shutdown();
            (result, st.streams.take_all())
        };
        // Every segment went back: no stream is needed any more.
        drop(kept);
        self.signals.waiters.wake_head();
        result.map_err(Error::from)
    }
}
