//! Cross-stream frees: a block freed after `record_stream` gets an event on every stream
//! that used it, and goes back to its pool only once all of them completed.
//!
//! Events come from a small pool of reusable backend events (creating one is a driver call).
//! Pending frees are kept per stream in record order, so one busy stream does not hold up
//! the others (PyTorch's `cuda_events`).

use gpualloc_runtime::{BackendError, EventHandle, StreamHandle};

use crate::blocks::block::BlockId;
use crate::core::DeviceCore;
use crate::error::AllocError;
use crate::ledger::books::Counted;
use crate::ledger::trace::TraceAction;

impl DeviceCore {
    /// Records an event on every stream that used the block and queues the block behind them.
    /// If the backend cannot record an event, the device is synchronized instead, which
    /// completes all prior work, and the block is freed at once: never lost, never reused early.
    /// A use on a stream that is capturing holds the free back instead
    /// (`pools/capture.rs`): an event recorded there would be the graph's.
    pub(crate) fn insert_events(&mut self, id: BlockId) {
        if self.uses_capturing(id) {
            self.captures.defer(id);
            return;
        }
        let uses = self.blocks.get_mut(id).take_uses();
        for stream in uses {
            match self.record_event(stream) {
                Ok(event) => {
                    self.blocks.get_mut(id).add_event();
                    self.pending.push(stream, event, id);
                }
                Err(e) => {
                    tracing::warn!(error = %e, "event record failed; synchronizing the device instead");
                    if let Err(e) = self.backend.device_synchronize(stream.device) {
                        tracing::error!(error = %e, "device synchronize failed");
                    }
                }
            }
        }
        if self.blocks.get(id).event_count() == 0 {
            self.return_block(id);
        }
    }

    /// [`DeviceCore::free_block`] of a block that had uses: a lent block goes back to its
    /// lender, and the loan ends (`streams/loans.rs`). The hit path's frees have no uses and
    /// call `free_block` itself, so loans cost them nothing.
    fn return_block(&mut self, id: BlockId) {
        let addr = self.blocks.get(id).addr();
        self.free_block(id);
        self.restream_if_lent(TraceAction::FreeCompleted, addr);
        self.loans.end(addr);
    }

    /// Records an event on `stream`: one of its device from the event pool, else a new one.
    /// An event whose record failed goes back to the pool (it is still a valid event).
    pub(crate) fn record_event(
        &mut self,
        stream: StreamHandle,
    ) -> Result<EventHandle, BackendError> {
        let event = match self.pending.take_spare_of(stream.device) {
            Some(e) => e,
            None => self.backend.event_create(stream.device)?,
        };
        self.backend
            .event_record(event, stream)
            .map(|()| event)
            .inspect_err(|_| self.pending.give_back([event]))
    }

    /// Completes the frees whose events have all completed; returns how many blocks went back
    /// to their pools. Called at the start of every malloc, and by the actor's reaper.
    /// While an announced capture is under way it does nothing (PyTorch: querying an event
    /// recorded in a capture is refused); after it, it first makes the frees captures held
    /// back.
    pub fn process_events(&mut self) -> Result<usize, AllocError> {
        // The hit path's test: nothing pending and nothing held back.
        if self.pending.is_empty() && !self.captures.has_deferred() {
            return Ok(0);
        }
        if !self.captures.is_quiet() {
            return Ok(0);
        }
        self.flush_deferred_frees();
        if self.pending.is_empty() {
            return Ok(0);
        }
        let backend = &self.backend;
        let (done, queried) = self.pending.pop_completed(|e| backend.event_query(e));
        let mut freed = 0;
        for id in done {
            freed += self.event_done(id);
        }
        queried?;
        Ok(freed)
    }

    /// Waits for every pending event and completes all pending frees.
    pub(crate) fn synchronize_and_free_events(&mut self) -> Result<(), AllocError> {
        self.count(Counted::SyncAllStreams);
        let backend = &self.backend;
        // What a failed wait leaves stays queued, so nothing is lost; then the report.
        let (done, waited) = self.pending.pop_all(|e| backend.event_synchronize(e));
        for id in done {
            self.event_done(id);
        }
        waited.map_err(AllocError::from)
    }

    /// The first `n` events of [`DeviceCore::pending_events`] were synchronized by the
    /// caller: completes their frees, in that order (the miss chain's last release, which
    /// PyTorch's `synchronize_and_free_events` does in place). A count past the pending
    /// events completes them all.
    pub(crate) fn complete_synchronized(&mut self, n: usize) {
        for id in self.pending.pop_first(n) {
            self.event_done(id);
        }
    }

    /// One event of block `id` completed; frees the block when it was the last. Returns 1 if
    /// the block went back to its pool.
    fn event_done(&mut self, id: BlockId) -> usize {
        if self.blocks.get_mut(id).complete_event() {
            self.return_block(id);
            1
        } else {
            0
        }
    }
}
