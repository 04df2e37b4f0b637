//! Allocating under a stream capture: PyTorch's graph pools (`beginAllocateToPool`,
//! `endAllocateToPool`) and its rules while a capture is under way.
//!
//! A captured graph bakes in the pointers its work was captured with, so what is allocated
//! during the capture must stay where it is while the graph lives, and be handed out again
//! to the same requests when another graph is captured into the same pool. The owner
//! announces a capture ([`DeviceCore::begin_capture`]) with the backend's capture id and a
//! private pool: every allocation on the capture's streams (the one it began on, and those
//! that joined it, [`DeviceCore::join_capture`]) is served from that pool, whose memory no
//! request outside it ever gets. Until [`DeviceCore::end_capture`], as PyTorch does:
//! - no event is queried (`process_events` waits: querying an event recorded in a capture
//!   is refused by the driver), and a free of a block used on other streams is held back,
//!   its events recorded once no capture is under way; streams that were part of a capture
//!   when the use was recorded get no event then (their work is the graph's, ordered by
//!   it), other streams do;
//! - the miss chain does not synchronize to release every cached segment (synchronizing
//!   would end the capture), and `empty_cache` is refused with
//!   [`AllocError::CaptureUnderway`];
//! - a block freed during the capture goes back to the pool and may serve a later request
//!   of the same capture on the same stream (the graph orders them).
//!
//! A free with a use on a stream that captures *without* the core being told (a capture the
//! owner did not announce) is held back the same way until that stream stops capturing:
//! the core never records an event on a capturing stream.
//!
//! After the capture, the graph's work runs whenever it is launched, on any stream, and the
//! core sees no launch. So while a capture into a private pool is under way, a graph of it
//! lives, or a dropped graph's launches may still run (the owner says when they have:
//! [`DeviceCore::graph_dropped_with_launches`], [`DeviceCore::graph_launches_done`]), the
//! pool's memory stays the graph's ([`DeviceCore::pool_in_graph_use`]): a dropped stream's
//! segments of it are not orphaned (nor their free pages unmapped), a request at the pool's
//! quota does not release its cached memory, a `use_on_oom` pool does not lend it, and a sleep
//! waits ([`AllocError::PoolBusy`] while launches run; [`AllocError::PoolInGraph`] while a
//! graph lives).

use gpualloc_runtime::StreamHandle;

use crate::blocks::block::BlockId;
use crate::core::{DeviceCore, MemPoolId};
use crate::error::AllocError;

impl DeviceCore {
    /// Announces capture `capture` (the backend's id, from `stream_capture_status`) on
    /// `stream`: its allocations go to private pool `pool` until [`DeviceCore::end_capture`].
    /// Errors: an unknown or released pool, a capture already announced, a stream of another
    /// device, a shut-down core.
    pub fn begin_capture(
        &mut self,
        capture: u64,
        pool: MemPoolId,
        stream: StreamHandle,
    ) -> Result<(), AllocError> {
        if self.captures.get(capture).is_some() {
            return Err(AllocError::UnknownCapture(capture));
        }
        // PyTorch's `beginAllocateToPool`: the stream's requests go to the pool.
        self.begin_allocate_to_pool(pool, stream)?;
        self.captures.begin(capture, pool.0, stream);
        self.captures.unprepare(stream);
        Ok(())
    }

    /// The owner is about to begin a capture on `stream` (before the backend's begin):
    /// from now on no page of the stream's expandable segments is detached for a release
    /// (the release would synchronize the stream once it captures, which invalidates the
    /// capture). True once no such page work is in flight off the core: the owner may then
    /// begin; on false it asks again shortly. The stream stays prepared (once, however often
    /// asked) until [`DeviceCore::begin_capture`] or [`DeviceCore::unprepare_capture`].
    pub fn prepare_capture(&mut self, stream: StreamHandle) -> bool {
        if !self.captures.preparing(stream) {
            self.captures.prepare(stream);
        }
        !self.expandable.bases().into_iter().any(|s| {
            self.expandable.is_busy(s)
                && self.expandable.get(s).is_some_and(|es| es.stream == stream)
        })
    }

    /// The capture prepared on `stream` will not begin (the backend refused, or its caller
    /// went away).
    pub fn unprepare_capture(&mut self, stream: StreamHandle) {
        self.captures.unprepare(stream);
    }

    /// `stream` joined the announced capture `capture` (it waited on an event recorded in
    /// it): its allocations go to the capture's pool too. False when `capture` is not under
    /// way (the stream is left as it is).
    pub fn join_capture(&mut self, capture: u64, stream: StreamHandle) -> bool {
        if stream.device != self.device {
            return false;
        }
        match self.captures.join(capture, stream, self.spill.next_stamp()) {
            Some(pool) => {
                self.private.route(stream.raw, pool);
                true
            }
            None => false,
        }
    }

    /// While captures are under way: `stream`, not routed to a pool, joins the announced
    /// capture the backend says it is part of (it waited on an event recorded in one), so
    /// its allocations go to that capture's pool. PyTorch finds a request's capture the
    /// same way (`cudaStreamGetCaptureInfo` against each capture's id): one status query per
    /// request of a stream that is not routed, and only while a capture is under way.
    pub(crate) fn join_if_capturing(&mut self, stream: StreamHandle) {
        if self.private.routed(stream.raw).is_some() {
            return;
        }
        if let Ok(status) = self.backend.stream_capture_status(stream) {
            if let Some(id) = status.id() {
                self.join_capture(id, stream);
            }
        }
    }

    /// Ends the announced capture `capture`: its streams allocate from their usual pools
    /// again. When no other capture is under way, the frees captures held back are made.
    pub fn end_capture(&mut self, capture: u64) -> Result<(), AllocError> {
        let ended = self
            .captures
            .end(capture)
            .ok_or(AllocError::UnknownCapture(capture))?;
        for stream in ended.streams() {
            if self.private.routed(stream.raw) == Some(ended.pool) {
                self.private.unroute(stream.raw);
            }
        }
        // The last one: the frees held back are made now, so that a capture into the same
        // pool right after this one finds them (PyTorch's capture begins with an
        // `empty_cache`, which makes them).
        if self.captures.is_quiet() {
            self.flush_deferred_frees();
        }
        Ok(())
    }

    /// A graph was captured into `pool` (and instantiated): while it lives the pool cannot
    /// sleep ([`AllocError::PoolInGraph`]).
    pub fn graph_captured(&mut self, pool: MemPoolId) -> Result<(), AllocError> {
        let p = self
            .private
            .get_mut(pool.0)
            .ok_or(AllocError::UnknownPool(pool.0))?;
        p.graphs += 1;
        Ok(())
    }

    /// A graph captured into `pool` was destroyed, and no launch of it can still run.
    pub fn graph_dropped(&mut self, pool: MemPoolId) {
        if let Some(p) = self.private.get_mut(pool.0) {
            p.graphs = p.graphs.saturating_sub(1);
        }
    }

    /// A graph captured into `pool` was destroyed while launches of it may still run: the
    /// pool's memory stays the graph's until [`DeviceCore::graph_launches_done`].
    pub fn graph_dropped_with_launches(&mut self, pool: MemPoolId) {
        if let Some(p) = self.private.get_mut(pool.0) {
            p.graphs = p.graphs.saturating_sub(1);
            p.launches += 1;
        }
    }

    /// The launches of a graph announced by [`DeviceCore::graph_dropped_with_launches`] have
    /// all run.
    pub fn graph_launches_done(&mut self, pool: MemPoolId) {
        if let Some(p) = self.private.get_mut(pool.0) {
            p.launches = p.launches.saturating_sub(1);
        }
    }

    /// True while the memory of block pool `index` is a graph's (module docs): its private
    /// pool has a capture under way into it, a live graph, or launches of a dropped graph
    /// that may still run. False for the default pools.
    pub(crate) fn pool_in_graph_use(&self, index: usize) -> bool {
        let Some(id) = self.owner_of(index) else {
            return false;
        };
        self.private
            .get(id.0)
            .is_some_and(|p| p.graphs > 0 || p.launches > 0)
            || self.captures.fills(id.0)
    }

    /// The streams, other than capture `capture`'s own, that segments of its pool belong
    /// to: their work queued before the capture may still use the pool's blocks, which the
    /// capture may hand out (a block freed on such a stream serves its requests once it joins
    /// the capture), and the graph runs wherever it is launched, unordered with that work.
    /// The owner waits for their queued work after announcing the capture, as it waited for
    /// the capture stream's before the begin (PyTorch's `torch.cuda.graph` synchronizes the
    /// device). Frees of the pool's blocks on streams outside the capture, from the
    /// announcement on, are held back until it ends ([`DeviceCore::free`]). Empty for a
    /// capture not under way.
    pub fn streams_before_capture(&self, capture: u64) -> Vec<StreamHandle> {
        let Some(c) = self.captures.get(capture) else {
            return Vec::new();
        };
        let mut out: Vec<StreamHandle> = self
            .segments
            .values()
            .filter(|m| self.owner_of(m.pool) == Some(MemPoolId(c.pool)))
            .map(|m| m.stream)
            .filter(|s| !c.has(*s))
            .collect();
        out.sort();
        out.dedup();
        out
    }

    /// True for a free of block `id` that a capture under way must not get: the block is of
    /// a pool a capture fills, and either its stream is outside every capture (its work is
    /// eager, unordered with the graph's), or the block was handed out before its stream
    /// joined the capture (the stream's work from before the join is eager too: only the
    /// queued work of the pool's streams at the capture's begin is waited for,
    /// `streams_before_capture`). A join the core has not seen yet (it learns of one at the
    /// stream's next request) counts as made just now. Asked only while captures are under way.
    pub(crate) fn eager_free_into_capture(&self, id: BlockId) -> bool {
        let b = self.blocks.get(id);
        if !self
            .owner_of(b.pool())
            .is_some_and(|pool| self.captures.fills(pool.0))
        {
            return false;
        }
        if !self.stream_captures(b.stream()) {
            return true;
        }
        let joined = self.captures.joined_at(b.stream()).unwrap_or(u64::MAX);
        b.born() < joined
    }

    /// The capture announced as under way on `stream` (begun or joined there), if any.
    pub fn capture_of(&self, stream: StreamHandle) -> Option<u64> {
        self.captures.of_stream(stream)
    }

    /// True while an announced capture is under way.
    pub fn captures_underway(&self) -> bool {
        !self.captures.is_quiet()
    }

    /// True while an announced capture allocates into `pool`.
    pub fn pool_in_capture(&self, pool: MemPoolId) -> bool {
        self.captures.fills(pool.0)
    }

    /// A block used on other streams is being freed: its events are recorded now, or, while
    /// a capture is under way, once none is.
    pub(crate) fn free_with_uses(&mut self, id: BlockId) {
        if self.captures.is_quiet() {
            // Uses noted during captures that have ended get their events like any other
            // (PyTorch drops them only for a free it deferred).
            self.captures.take_uses(id);
            self.insert_events(id);
        } else {
            // The deferred free drops the uses noted during captures (`flush_deferred_frees`).
            self.captures.defer(id);
        }
    }

    /// Notes a use recorded on `stream` while a capture is under way, if `stream` is part of
    /// a capture: that use is the graph's work, which the free does not wait for. A use on a
    /// stream outside every capture is eager work (another task's, beside a capture) and gets
    /// its event like any other; PyTorch drops every use recorded while a capture is under
    /// way, and the block could then be reused while that stream's work still runs.
    pub(crate) fn note_capture_use(&mut self, id: BlockId, stream: StreamHandle) {
        if !self.captures.is_quiet() && self.stream_captures(stream) {
            self.captures.note_use(id, stream);
        }
    }

    /// True when `stream` is part of a capture: an announced one (begun or joined there), or
    /// one the backend reports (joined through an event, or begun without the owner). Nothing
    /// may synchronize such a stream (the driver invalidates the capture): the free pages of
    /// its expandable segments stay mapped meanwhile (`expandable/`).
    pub(crate) fn stream_captures(&self, stream: StreamHandle) -> bool {
        self.captures.preparing(stream)
            || self.captures.of_stream(stream).is_some()
            || (self.backend.capture_may_be_underway()
                && self
                    .backend
                    .stream_capture_status(stream)
                    .is_ok_and(|c| c.is_capturing()))
    }

    /// Makes the frees captures held back, once none is under way: events on the streams
    /// used outside captures, or the free at once.
    pub(crate) fn flush_deferred_frees(&mut self) {
        for id in self.captures.take_deferred() {
            let during_captures = self.captures.take_uses(id);
            self.blocks
                .get_mut(id)
                .forget_uses(|s| during_captures.contains(s));
            self.insert_events(id);
        }
    }

    /// True when a stream block `id` was used on is part of a capture
    /// ([`DeviceCore::stream_captures`]: one the owner may not have announced, or one it
    /// prepares, whose begin may run between this check and the event's record on the
    /// owner's thread): no event may be recorded there.
    pub(crate) fn uses_capturing(&self, id: BlockId) -> bool {
        self.blocks
            .get(id)
            .stream_uses()
            .iter()
            .any(|s| self.stream_captures(*s))
    }
}
