//! Loans: a request that misses its own stream's free blocks takes another stream's free
//! block, ordered after that stream's work by an event, instead of new memory (the `gpualloc`
//! policy's miss-chain link `BorrowFree`, before any segment is allocated or grown).
//!
//! Why: cached blocks serve only the stream they were freed on (stream-ordered reuse), so a
//! job whose streams peak at different times (an offload engine: a copy stream per layer, a
//! compute stream) keeps each stream's peak reserved at once: on llama7b-offload-10streams
//! the streams' free memory at the peak was 4.35 GiB of 20.63 GiB reserved, 3.54 GiB of it on
//! one stream. A loan moves no page and needs no synchronization:
//! - **the order**: the lender's block is free, so only work the lender queued before its
//!   free can still touch it. The core records an event on the lender now and makes the
//!   borrower's stream wait for it (`cuEventRecord` + `cuStreamWaitEvent`, both asynchronous):
//!   everything the borrower queues with the block runs after the lender's work. The event is
//!   spare again at once (a wait waits for the record made before it);
//! - **the return**: the block stays the lender's (its segment, its pool, its stream), lent
//!   with the borrower as a recorded use: its free waits for an event on the borrower, as a
//!   `record_stream` free does, and then goes back to the lender's free blocks. The user sees
//!   the borrower's stream everywhere (the allocation, the history, the thread cache, which
//!   parks it under the borrower: reuse by the borrower is ordered);
//! - **the choice**: the best fit among the other streams' free mapped blocks of the request's
//!   pool (the default large pool only; private pools keep PyTorch's rules), smallest first,
//!   then lowest stream and address, under the size rules of the request's own pool;
//! - **not small blocks**: a loan costs an event record and a wait, and its return an event,
//!   each time the borrower's request misses its own blocks again: a stream that allocates and
//!   frees the same size in a loop borrows at every turn. For a large block that is the price
//!   of the memory it saves (llama7b-offload: a GiB at the peak); a small block saves at most
//!   its 2 MiB page, so the small pool keeps stream-only reuse: the stream gets a page of its
//!   own at its first miss and hits from then on (on llama7b-offload the small pool's loans
//!   saved 4 MiB of 20,852).
//!
//! Not while an announced capture is under way, nor to or from a stream that captures or is
//! about to (an event must not be recorded on, or waited for by, a capturing stream; a stream
//! whose status the backend cannot tell counts as capturing), nor under the `pytorch` policy. A loan is an
//! optimization: where the backend fails to record or wait for its event, the request goes on
//! to new memory as it would without loans. A job whose streams take turns makes a
//! record and a wait per loan and an event per return, no driver memory call: after warm-up a
//! repeated step maps, unmaps, allocates and frees nothing (`devices/tests/loans.rs`).

use gpualloc_runtime::{BackendError, CaptureStatus, StreamHandle};

use crate::blocks::block::BlockId;
use crate::blocks::pool::FreeKey;
use crate::core::{AllocParams, Allocation, DeviceCore};
use crate::error::AllocError;
use crate::ledger::trace::TraceAction;
use crate::malloc::segment_request::SegmentRequest;
use crate::streams::orphans::ORPHAN_STREAM;

impl DeviceCore {
    /// Lends allocation `a`, just made from another stream's block, to `borrower`: its free
    /// waits for an event on the borrower (a recorded use), and the user sees the borrower's
    /// stream in the allocation and the history.
    pub(crate) fn lend(&mut self, mut a: Allocation, borrower: StreamHandle) -> Allocation {
        if let Some(id) = self.active.get(a.ptr.0) {
            let new_use = self.blocks.get_mut(id).record_use(borrower);
            debug_assert!(
                new_use,
                "a loan is of another stream's block, with no uses yet"
            );
        }
        self.loans.begin(a.ptr.0, borrower);
        self.history
            .restream(TraceAction::Alloc, a.ptr.0, borrower.raw);
        self.history.mark_borrowed(a.ptr.0);
        a.stream = borrower;
        a
    }

    /// Gives the `action` entry just recorded for `addr` its borrower's stream, if the
    /// allocation at `addr` is lent (the history shows the user's stream throughout).
    pub(crate) fn restream_if_lent(&mut self, action: TraceAction, addr: u64) {
        if self.loans.is_empty() {
            return;
        }
        if let Some(borrower) = self.loans.borrower(addr) {
            self.history.restream(action, addr, borrower.raw);
        }
    }

    /// The stream a user sees for live allocation `addr` of a block of `stream`: its borrower
    /// if it is lent.
    #[inline]
    pub(crate) fn user_stream(&self, addr: u64, stream: StreamHandle) -> StreamHandle {
        if self.loans.is_empty() {
            return stream;
        }
        self.loans.borrower(addr).unwrap_or(stream)
    }

    /// Lends the request the best-fitting free block of another stream (see the module docs),
    /// if the policy and the pool allow loans and one fits: the block is in `params.block`,
    /// still the lender's until the miss's end lends it ([`DeviceCore::lend`]). False when
    /// none was lent.
    pub(crate) fn borrow_free(&mut self, params: &mut AllocParams) -> Result<bool, AllocError> {
        if self.loans.as_recorded || !self.may_borrow(params) {
            return Ok(false);
        }
        let Some((k, id)) = self.best_loan(params) else {
            return Ok(false);
        };
        let lender = self.blocks.get(id).stream();
        // A loan is an optimization: where the backend cannot order it, the request goes on
        // to new memory as it would without loans.
        if let Err(e) = self.order_after(lender, params.stream) {
            tracing::warn!(error = %e, "a loan could not be ordered; new memory instead");
            return Ok(false);
        }
        self.pools[params.pool].take_free(&k);
        params.block = Some(id);
        tracing::debug!(
            device = self.device.0,
            addr = k.2,
            size = k.1,
            lender = lender.raw,
            borrower = params.stream.raw,
            "free block lent to another stream"
        );
        Ok(true)
    }

    /// Whether the policy, the request's pool and the captures under way let `params` borrow.
    fn may_borrow(&self, params: &AllocParams) -> bool {
        self.config.policy.lends_across_streams()
            && self.owner_of(params.pool).is_none()
            && !self.pools[params.pool].is_small
            && self.captures.is_quiet()
            && !self.capturing(params.stream)
    }

    /// For a replay that follows a history (`TraceEntry::borrowed`): serves `request` as the
    /// live allocator did, by a loan of the free block of another stream of its pool that
    /// starts at `addr`, ordered and lent as the miss chain's loan link lends. The
    /// live request's own lookup came before frees the history shows ahead of its `alloc`
    /// (its own block's free was still pending at the lookup and completed before its miss
    /// chain ran), so a replay's lookup at the entry could take its own stream's block
    /// instead. `Err` gives the request back where no such block is free, it is too small or
    /// the size rules refuse it, or the policy, the pool or a capture rules a loan out: the
    /// caller then serves it as an ordinary request.
    pub fn malloc_borrowed(
        &mut self,
        request: SegmentRequest,
        addr: u64,
    ) -> Result<Allocation, SegmentRequest> {
        // As a lookup does first: loans whose borrower's work is done are back with their
        // lenders (an error here is the ordinary request's to report).
        if self.process_events().is_err() {
            return Err(request);
        }
        let params = &request.params;
        if !self.may_borrow(params) {
            return Err(request);
        }
        let pool = &self.pools[params.pool];
        let found = pool
            .free_range(..)
            .find(|(k, _)| k.2 == addr)
            .map(|(k, id)| (*k, *id));
        let Some((k, id)) = found else {
            return Err(request);
        };
        let lender = self.blocks.get(id).stream();
        if k.0 == params.stream.raw
            || k.0 == ORPHAN_STREAM
            || k.1 < params.size
            || !self.size_rules_allow(k.1, params.size, self.blocks.get(id).expandable())
            || self.capturing(lender)
            || self.order_after(lender, params.stream).is_err()
        {
            return Err(request);
        }
        let (pool, borrower) = (request.params.pool, request.params.stream);
        let a = self.finish_from_free(request, pool, &k, id)?;
        Ok(self.lend(a, borrower))
    }

    /// For a replay that follows a history recorded under a policy that lends: the miss
    /// chain lends nothing, and a request is served by a loan only through
    /// [`DeviceCore::malloc_borrowed`], where the history shows one. A live request's chain
    /// ran at its own time, so a replay's chain at the history's `alloc` can find a loan the
    /// live one did not (a block freed meanwhile) before the segment the history shows.
    pub fn lend_as_recorded(&mut self, on: bool) {
        self.loans.as_recorded = on;
    }

    /// Makes `borrower`'s later work wait for the work `lender` queued so far: an event
    /// recorded on the lender, waited for by the borrower. The event is spare again at once
    /// (a wait waits for the record made before it).
    fn order_after(
        &mut self,
        lender: StreamHandle,
        borrower: StreamHandle,
    ) -> Result<(), BackendError> {
        let event = match self.pending.take_spare_of(self.device) {
            Some(e) => e,
            None => self.backend.event_create(self.device)?,
        };
        let ordered = self
            .backend
            .event_record(event, lender)
            .and_then(|()| self.backend.stream_wait_event(borrower, event));
        self.pending.give_back([event]);
        ordered
    }

    /// The best fit for `params` among the free blocks of its pool of the other streams that
    /// are not capturing: the smallest, then the lowest stream and address; None when no
    /// block fits under the size rules `get_free_block` applies.
    fn best_loan(&self, params: &AllocParams) -> Option<(FreeKey, BlockId)> {
        let pool = &self.pools[params.pool];
        let mut best: Option<(FreeKey, BlockId)> = None;
        let mut from: FreeKey = (0, 0, 0);
        // Each stream with a free block, in order: the first key at or after `from`.
        while let Some((&(stream, _, _), _)) = pool.free_range(from..).next() {
            if stream == ORPHAN_STREAM {
                break;
            }
            if stream != params.stream.raw {
                let fit = pool
                    .free_range((stream, params.size, 0)..=(stream, u64::MAX, u64::MAX))
                    .next()
                    .map(|(k, id)| (*k, *id));
                if let Some((k, id)) = fit {
                    let better = best.is_none_or(|(b, _)| k.1 < b.1);
                    if better
                        && self.size_rules_allow(k.1, params.size, self.blocks.get(id).expandable())
                        && !self.capturing(StreamHandle {
                            device: params.stream.device,
                            raw: k.0,
                        })
                    {
                        best = Some((k, id));
                    }
                }
            }
            let Some(next) = stream.checked_add(1) else {
                break;
            };
            from = (next, 0, 0);
        }
        best
    }

    /// True when `stream` is capturing, or the backend cannot say (asked only where the
    /// backend says a capture may be under way), or its owner prepares a capture on it
    /// ([`DeviceCore::prepare_capture`]): such a stream neither lends nor borrows. The last
    /// because the backend's begin runs on the owner's thread, outside the core: between this
    /// check and the loan's event record it could begin, and the record would be a node of
    /// the capture, the borrower's wait a fork into it (its end then fails: a stream was not
    /// joined back).
    fn capturing(&self, stream: StreamHandle) -> bool {
        if self.captures.preparing(stream) {
            return true;
        }
        if !self.backend.capture_may_be_underway() {
            return false;
        }
        !matches!(
            self.backend.stream_capture_status(stream),
            Ok(CaptureStatus::None)
        )
    }
}
