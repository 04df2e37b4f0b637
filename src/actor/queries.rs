//! The device actor's queries and queued commands, off the malloc and free paths:
//! diagnostics (waiters, parked waiters, a one-line description), statistics and
//! snapshots (a call on the state), and the jobs that drops post without waiting (a pool
//! released, a dropped capture ended, a graph dropped).

use std::sync::atomic::Ordering;

use gpualloc_devices::{CrossStreamFree, DeviceCore, DeviceSnapshot, DeviceStats, MemPoolId};
use gpualloc_runtime::DeviceId;

use crate::actor::device::DeviceActor;
use crate::actor::state::{DeviceMsg, DeviceState};
use crate::actor::thread_cache::{ParkedFree, ThreadCache};
use crate::error::Error;

impl DeviceActor {
    /// The device this actor serves.
    pub fn device(&self) -> DeviceId {
        self.device
    }

    /// A one-line description of the actor's state, for diagnosing a stall: waiters (and how
    /// many of them are parked: every waiter parked while memory is free would be a lost
    /// wake-up), misses in flight, whether the gate is held and whether messages are queued.
    pub fn describe(&self) -> String {
        format!(
            "{}: {} waiting for memory ({} parked), {} misses in flight, gate {}, queue {}, reaper {}, {} revived by the thread cache",
            self.device,
            self.waiting(),
            self.parked_waiters(),
            self.misses_in_flight(),
            if self.mailbox.is_busy() {
                "held"
            } else {
                "free"
            },
            if self.mailbox.has_pending() {
                "non-empty"
            } else {
                "empty"
            },
            if self.signals.reaper.is_armed() {
                "armed"
            } else {
                "asleep"
            },
            self.thread_cache_revivals(),
        )
    }

    /// Closes the thread cache: nothing is parked or revived from now on, parked blocks are
    /// freed through the mailbox, and the slots' lanes (references back to this actor) go.
    /// Shutdown and the allocator's last handle call it. Never blocks.
    pub(crate) fn close_thread_cache(&self) {
        if let Some(cache) = &self.signals.thread_cache {
            for ptr in cache.close() {
                let recorded = false; // the slots' logs went with the close
                self.mailbox
                    .post(DeviceMsg::FreeParked(ParkedFree { ptr, recorded }));
            }
        }
    }

    /// Streams the actor keeps alive because the core still names them (cached segments of
    /// a stream the user dropped, recorded uses of live buffers; see [`gpualloc_runtime::Stream`]).
    pub async fn kept_streams(&self) -> Result<usize, Error> {
        self.call(|st| st.streams.len()).await
    }

    /// Blocks the thread cache handed straight back to the thread that freed them, so far
    /// (0 with `thread_cache:False`). Diagnostics: how often a malloc skipped the gate.
    pub fn thread_cache_revivals(&self) -> u64 {
        self.signals
            .thread_cache
            .as_ref()
            .map_or(0, ThreadCache::revived)
    }

    /// Number of requests waiting for memory right now.
    pub fn waiting(&self) -> usize {
        self.signals.waiters.len()
    }

    /// Requests waiting for memory that are parked: each retried, failed and now waits for
    /// memory to come back, so none is retrying right now (`gpualloc_actor::Waiters::parked`).
    /// At most [`DeviceActor::waiting`]. Diagnostics: memory freed once every waiter is
    /// parked goes to them in queue order.
    pub fn parked_waiters(&self) -> usize {
        self.signals.waiters.parked()
    }

    /// Releases private pool `id` (a [`crate::Pool`]'s last handle was dropped): queued,
    /// never blocks.
    pub(crate) fn release_pool(&self, id: MemPoolId) {
        self.mailbox
            .post(DeviceMsg::Job(Box::new(move |st: &mut DeviceState| {
                if let Err(e) = st.core.release_pool(id) {
                    tracing::debug!(pool = id.0, error = %e, "releasing a pool");
                }
            })));
    }

    /// Ends announced capture `id` (a [`crate::Capture`] dropped unended): queued, then the
    /// thread cache serves again.
    pub(crate) fn end_capture_later(&self, id: u64) {
        let signals = self.signals.clone();
        self.mailbox
            .post(DeviceMsg::Job(Box::new(move |st: &mut DeviceState| {
                if let Err(e) = st.core.end_capture(id) {
                    tracing::debug!(capture = id, error = %e, "ending a dropped capture");
                }
                signals.captures.fetch_sub(1, Ordering::AcqRel);
            })));
    }

    /// A graph captured into pool `pool` was dropped (`graph.rs`), with launches of it that
    /// may still run (`launches_running`) or none: queued.
    pub(crate) fn graph_dropped_later(&self, pool: MemPoolId, launches_running: bool) {
        self.post_core(move |core| {
            if launches_running {
                core.graph_dropped_with_launches(pool)
            } else {
                core.graph_dropped(pool)
            }
        });
    }

    /// Runs `f` on the core, queued (for a caller that cannot await: a drop).
    pub(crate) fn post_core(&self, f: impl FnOnce(&mut DeviceCore) + Send + 'static) {
        self.mailbox
            .post(DeviceMsg::Job(Box::new(move |st: &mut DeviceState| {
                f(&mut st.core)
            })));
    }

    /// The launches of a graph dropped with launches running have all run: queued.
    pub(crate) fn graph_launches_done_later(&self, pool: MemPoolId) {
        self.post_core(move |core| core.graph_launches_done(pool));
    }

    /// Statistics of this device.
    pub(crate) async fn stats(&self) -> Result<DeviceStats, Error> {
        self.call(|st| st.core.stats().clone()).await
    }

    /// Gives `peer` access to this device's expandable-segment memory (`DeviceCore::add_peer`).
    pub(crate) async fn add_peer(&self, peer: DeviceId) -> Result<(), Error> {
        self.call(move |st| st.core.add_peer(peer))
            .await?
            .map_err(Error::from)
    }

    /// Resets every peak to its current value (after folding in the thread cache).
    pub(crate) async fn reset_peak_stats(&self) -> Result<(), Error> {
        self.call(|st| st.core.reset_peak_stats()).await
    }

    /// Resets the allocated/freed sums and the event counters.
    pub(crate) async fn reset_accumulated_stats(&self) -> Result<(), Error> {
        self.call(|st| st.core.reset_accumulated_stats()).await
    }

    /// The last frees the `debug_cross_stream_frees` check reported.
    pub(crate) async fn cross_stream_frees(&self) -> Result<Vec<CrossStreamFree>, Error> {
        self.call(|st| st.core.cross_stream_frees()).await
    }

    /// Segments and blocks of this device.
    pub(crate) async fn snapshot(&self) -> Result<DeviceSnapshot, Error> {
        self.call(|st| {
            st.core.record_snapshot_taken();
            st.core.snapshot()
        })
        .await
    }
}
