//! The `gpualloc` policy's placement rule for expandable segments: no dead remainders.
//!
//! With expandable segments PyTorch splits a free block whenever at least 512 B remain, so a
//! 1.5 MiB block taken by a 1.125 MiB request leaves a 384 KiB free block in the large pool,
//! where every request is over 1 MiB: nothing can use it until a neighbour is freed. In a
//! forward pass whose kept activations land in the holes of freed temporaries, such remainders
//! pile up (transformer-lm-forward-bf16: 22 of them, 13.4 MiB at the peak).
//!
//! The rule: when the best fit of a large-pool request in an expandable segment would leave a
//! remainder under [`DEAD_REMAINDER`], the request goes to the segment's tail instead (the
//! free block the segment grows from: when the best fit is the tail, it stays the choice), which
//! grows if it is too small. Where the segment cannot grow (the device or the memory-fraction
//! cap is full), the passed-over block is taken after all (`DeviceCore::take_passed_over`),
//! before any cache is released: the rule never causes an out-of-memory error or a release
//! that best fit would not.
//!
//! The threshold was picked by measurement on the three shared traces (peak reserved, 2 MiB
//! pages / 20 MiB pages): 256 KiB changes nothing; 512 KiB lowers
//! transformer-lm-forward-bf16 from 776 / 786 MiB to 764 / 766 MiB and leaves the other two
//! as they were; 1 MiB does the same for it but raises llama-lora-finetune by 34 / 20 MiB.

use crate::blocks::block::BlockId;
use crate::blocks::pool::key;
use crate::core::{AllocParams, Allocation, DeviceCore};
use crate::malloc::segment_request::SegmentRequest;

/// Remainders under this are "dead" in the large pool (see the module docs).
pub const DEAD_REMAINDER: u64 = 512 << 10;

impl DeviceCore {
    /// True when the policy passes over best-fit block `id` for `params`: a large-pool block
    /// of an expandable segment whose split would leave a remainder in `(0, DEAD_REMAINDER)`.
    pub(crate) fn passes_over(&self, id: BlockId, params: &AllocParams) -> bool {
        let b = self.blocks.get(id);
        let remainder = b.size() - params.size;
        self.config.policy.avoids_dead_remainders()
            && b.expandable()
            && !self.pools[params.pool].is_small
            && remainder > 0
            && remainder < DEAD_REMAINDER
    }

    /// The request's alternative to a passed-over block: the lowest free tail block of its
    /// stream and pool that holds it (taken out of the pool into `params.block`). False when
    /// none does: the request is a miss and the segment grows.
    ///
    /// A tail is a free mapped block followed by pages that are not mapped: unmapped, or
    /// being mapped or unmapped off the core right now. Its remainder joins those pages once
    /// they are mapped, so it is never dead; and the choice does not depend on whether an
    /// owner's map in flight has landed yet, so a replay of the history, which maps the pages
    /// where the history shows them (`recorded/`), makes the same choice. A fresh block (pages
    /// a growth mapped, not taken from since) is a tail too: a growth that filled the gap
    /// before a live block leaves no unmapped page behind its block, and the request that
    /// grew it looks in the cache again when an owner maps off the core (or a replay maps at
    /// the history's `segment_map`); in place it takes those pages directly.
    pub(crate) fn take_tail(&mut self, params: &mut AllocParams) -> bool {
        let stream = params.stream.raw;
        let blocks = &self.blocks;
        let tail = self.pools[params.pool]
            .free_range(key(stream, params.size, 0)..)
            .take_while(|(k, _)| k.0 == stream)
            .map(|(_, id)| *id)
            .filter(|id| {
                let b = blocks.get(*id);
                b.mapped() && (b.fresh() || b.next().is_some_and(|n| !blocks.get(n).mapped()))
            })
            .min_by_key(|id| blocks.get(*id).addr());
        let Some(id) = tail else {
            return false;
        };
        self.pools[params.pool].unfile_free(self.blocks.get(id));
        params.block = Some(id);
        true
    }

    /// After the segment could not grow for `params`: best fit with any remainder, the block
    /// the policy passed over included.
    pub(crate) fn take_passed_over(&mut self, params: &mut AllocParams) -> bool {
        if params.any_fit {
            return false;
        }
        params.any_fit = true;
        self.get_free_block(params)
    }

    /// For owners that grow segments off the core (`plan_growth`): the request's segment could
    /// not grow (the device is full), so before releasing any cache, serve it from the cache
    /// with any remainder, the block the policy passed over included. `Err` gives the request
    /// back when nothing fits.
    pub fn malloc_passed_over(
        &mut self,
        mut request: SegmentRequest,
    ) -> Result<Allocation, SegmentRequest> {
        if !self.take_passed_over(&mut request.params) {
            return Err(request);
        }
        let size = request.size;
        self.finish(&request.params, size).map_err(|_| request)
    }
}
