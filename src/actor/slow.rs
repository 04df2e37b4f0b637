//! The slow paths of a device actor, run on tokio's blocking pool and outside the gate
//! wherever the driver is involved, so cache hits keep being served:
//! - a miss: the core's miss chain (`gpualloc_devices::Miss`, off-core rules) advanced under
//!   the gate, each driver call it asks for (a segment malloc, mapping pages, freeing
//!   segments, synchronizing events, unmapping pages) made outside it (PyTorch's
//!   `release_lock_on_cudamalloc`, always on here, and more: every driver call of the chain);
//! - `empty_cache`: pending events synchronized, segments detached under the gate and freed
//!   outside, free pages of expandable segments unmapped outside (`gpualloc_devices::shrink`);
//! - shutdown, which runs the core's own release under the gate (nothing is served after it).

use std::sync::Arc;

use gpualloc_devices::{
    free_detached, release_pages, release_reservation, AllocError, Miss, MissStep, SegmentRequest,
};
use gpualloc_runtime::Stream;

use crate::actor::device::DeviceActor;
use crate::buffer::DeviceBuffer;
use crate::error::Error;
use crate::guarded::guarded;

impl DeviceActor {
    /// Finishes a miss: the core's chain, its driver calls off the gate (see the module
    /// docs).
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
        {
            let mut held = self.mailbox.hold_blocking();
            // Segments of streams their users dropped serve this request before a new one is
            // made (`gpualloc_devices::orphans`).
            held.state().retire_dropped_streams();
            if let Err(e) = held.state().core.orphan_retired() {
                tracing::warn!(device = self.device.0, error = %e, "orphaning retired streams failed");
            }
        }
        let mut miss = Miss::off_core(req);
        let mut done = None;
        let mut released = false;
        // A release's driver call returned: its memory is booked back with the device in the
        // next step, and only then may waiters look (before, the cap still counts it).
        let mut wake_after_step = false;
        let result = loop {
            let step = {
                let mut held = self.mailbox.hold_blocking();
                let st = held.state();
                let step = st.core.advance_miss(&mut miss, done.take());
                if !matches!(step, MissStep::Io(_)) {
                    // The miss may leave a segment of this stream in the cache: the stream is
                    // kept while the core names it (`streams.rs`). Kept here, in the hold of
                    // the last step, not when the miss began: until now the miss holds the
                    // stream itself, and while its driver calls ran off the gate nothing in
                    // the core may have named it (a release before its segment is made, an
                    // ordinary segment's device malloc), so a pass may have let go of it.
                    st.streams.keep(&stream);
                }
                step
            };
            if std::mem::take(&mut wake_after_step) {
                // Requests waiting for memory may find some now.
                released = true;
                self.signals.waiters.wake_head();
            }
            match step {
                MissStep::Done(a) => break Ok(DeviceBuffer::new(a, self.clone(), stream)),
                MissStep::Failed(e) => {
                    if e.is_oom() {
                        tracing::warn!(device = self.device.0, size, "out of memory");
                    }
                    break Err(e.into());
                }
                MissStep::Io(io) => {
                    wake_after_step = io.releases_memory();
                    done = Some(io.perform(self.backend.as_ref()));
                }
            }
        };
        if released {
            self.prune_streams();
        }
        result
    }

    /// Returns every unused cached segment to the device, doing the driver calls off the
    /// gate: synchronize the events pending frees wait on, detach the free segments, free
    /// them. Returns how many segments went back.
    pub(crate) fn release_cache_blocking(&self) -> usize {
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
        let (detached, in_flight) = {
            let mut held = self.mailbox.hold_blocking();
            let detached = held.state().core.detach_free_segments();
            // Taken in the step that detached them: a shutdown or a request that runs out of
            // memory after it waits for the frees.
            let in_flight = self.segment_frees_begin(&detached);
            (detached, in_flight)
        };
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
        // Back with the device: no longer counted against the cap (`finish_segment_frees`).
        self.mailbox
            .hold_blocking()
            .state()
            .core
            .finish_segment_frees(&segments);
        drop(in_flight);
        if let Err(e) = freed {
            tracing::warn!(device = self.device.0, error = %e, "segment free failed");
        }
        let pages = self.release_free_pages_blocking();
        if !segments.is_empty() || pages > 0 {
            self.signals.waiters.wake_head();
        }
        self.prune_streams();
        segments.len() + pages
    }

    /// Expandable segments: unmaps the whole pages of every free block, with the stream
    /// synchronization and the driver calls off the gate (`gpualloc_devices::shrink`).
    /// Returns how many free blocks gave up pages.
    fn release_free_pages_blocking(&self) -> usize {
        let (detached, releasing) = {
            let mut held = self.mailbox.hold_blocking();
            let detached = held.state().core.detach_free_pages();
            let some = matches!(&detached, Ok(r) if !r.is_empty());
            (detached, some.then(|| self.release_in_flight()))
        };
        let releases = match detached {
            Ok(r) if !r.is_empty() => r,
            _ => return 0,
        };
        let n = releases.len();
        // A failure is logged where it happens, a panic (a custom backend's bug) by the guard;
        // the core books the pages released either way, as it does when an unmap fails.
        let _ = guarded("a cache release's page unmaps", || {
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
        drop(releasing);
        for reservation in orphaned {
            release_reservation(self.backend.as_ref(), self.device, reservation);
        }
        n
    }

    /// `empty_cache` for this device.
    pub(crate) fn empty_cache_blocking(&self) -> Result<(), Error> {
        {
            let mut held = self.mailbox.hold_blocking();
            let core = &held.state().core;
            if core.is_shut_down() {
                return Err(AllocError::Shutdown.into());
            }
            // It synchronizes: refused while a capture is under way, as PyTorch does.
            if core.captures_underway() {
                return Err(AllocError::CaptureUnderway("empty_cache").into());
            }
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
        // Segments detached before the core shut down may still be on their way back.
        if !self.signals.detached_frees.wait_none(SHUTDOWN_FREES_WAIT) {
            tracing::warn!(
                device = self.device.0,
                "segment frees off the gate still running after {SHUTDOWN_FREES_WAIT:?}"
            );
        }
        // Every segment went back: no stream is needed any more.
        drop(kept);
        self.signals.waiters.wake_head();
        result.map_err(Error::from)
    }
}

/// How long shutdown waits for segment frees already off the gate (each a driver call).
const SHUTDOWN_FREES_WAIT: std::time::Duration = std::time::Duration::from_secs(10);
