//! The order of the miss chain (`CHAIN`) and the step that walks it.

use crate::budget;
use crate::core::{DeviceCore, LARGE_POOL, SMALL_POOL};
use crate::error::AllocError;
use crate::ledger::books::Counted;

use super::ops::{self, Flow, Op};
use super::{IoDone, Miss, MissStep};

/// When an allocation link runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum When {
    Always,
    /// Only for a pool of expandable segments (growth is the only new memory a pool at its
    /// quota may get without releasing first).
    Expands,
    /// Only after an oversize release that freed enough.
    Released,
}

/// One link of the chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Link {
    /// Free old cached segments (`garbage_collection_threshold`).
    CollectGarbage,
    /// Go on at the link after `QuotaFailure` unless a new segment would pass the request's
    /// pool quota.
    AtQuota,
    /// A segment of a stream its user dropped.
    AdoptOrphan,
    /// A free block of another stream, lent after that stream's work (`streams/loans.rs`).
    BorrowFree,
    /// A short-lived small request in the default large pool's free memory
    /// (`malloc/spill.rs`).
    SpillSmall,
    /// A new segment, or the pages of an expandable segment (PyTorch's `alloc_block`).
    AllocBlock { retry: bool, when: When },
    /// A block the `gpualloc` policy passed over.
    TakePassedOver,
    /// A block of a private pool marked `use_on_oom`.
    PrivatePoolOnOom,
    /// Release cached oversize blocks of the stream (`release_available_cached_blocks`).
    ReleaseOversize,
    /// Release the cached segments of the request's own pool (at its quota).
    ReleaseOwnPool,
    /// Synchronize pending events, release every cached segment (`release_cached_blocks`).
    ReleaseCached,
    /// Under the `gpualloc` policy, before a growth of an expandable segment would pass the
    /// most ever held: release the cache (after the user's `empty_cache`), or move the default
    /// pools' free pages (see below).
    ReleaseBeforeGrowth,
    /// The pool's quota error, if it still applies.
    QuotaFailure,
    /// Out of memory (or the quota error).
    OutOfMemory,
}

use Link::*;

/// The chain, in order. `AtQuota` skips the quota links when the request is not at its
/// pool's quota.
pub(crate) const CHAIN: &[Link] = &[
    CollectGarbage,
    AtQuota,
    AdoptOrphan,
    AllocBlock {
        retry: false,
        when: When::Expands,
    },
    TakePassedOver,
    ReleaseOwnPool,
    AllocBlock {
        retry: true,
        when: When::Expands,
    },
    QuotaFailure,
    // Every request from here.
    AdoptOrphan,
    BorrowFree,
    SpillSmall,
    ReleaseBeforeGrowth,
    AllocBlock {
        retry: false,
        when: When::Always,
    },
    TakePassedOver,
    PrivatePoolOnOom,
    ReleaseOversize,
    AllocBlock {
        retry: false,
        when: When::Released,
    },
    ReleaseCached,
    AllocBlock {
        retry: true,
        when: When::Always,
    },
    OutOfMemory,
];

/// Where the links every request goes through start.
fn after_quota() -> usize {
    CHAIN
        .iter()
        .position(|l| *l == QuotaFailure)
        .map_or(0, |i| i + 1)
}

impl DeviceCore {
    /// Advances `miss` (see the `miss` module docs): `done` is the outcome of the driver call
    /// its last step asked for (`None` for the first step). Returns the next step.
    ///
    /// An outcome that does not belong to the miss's step (none where one was asked for, or
    /// one where none was) fails the miss with an internal error, after what the outcome
    /// holds went back to the books or the device.
    pub fn advance_miss(&mut self, miss: &mut Miss, done: Option<IoDone>) -> MissStep {
        let mut flow = match (miss.op.take(), done) {
            (Some(op), Some(done)) => match self.resume_op(miss, op, done) {
                // Off the core, others ran meanwhile: the request's pool may have begun to
                // sleep (its memory is going, and no growth may map pages into it: a growth
                // of its own was not under way, or the sleep would have waited for it) or
                // been forgotten, and else the request looks in the cache again before the
                // next link.
                Flow::Next if miss.off_core => {
                    let params = &mut miss.request.params;
                    match self
                        .check_serves(params.pool)
                        .and_then(|()| self.look_again(params))
                    {
                        Ok(true) => Flow::Found,
                        Ok(false) => Flow::Next,
                        Err(e) => Flow::Fail(e),
                    }
                }
                flow => flow,
            },
            // The owner may have let others at the core since the request's lookup: its pool
            // may have begun to sleep, or been forgotten.
            (None, None) if miss.off_core => match self.check_serves(miss.request.params.pool) {
                Ok(()) => Flow::Next,
                Err(e) => Flow::Fail(e),
            },
            (None, None) => Flow::Next,
            // A step without the outcome it waits for, or an outcome nothing waits for.
            (_, Some(done)) => self.salvage(done.0),
            (Some(_), None) => Flow::Fail(ops::mismatch()),
        };
        loop {
            match flow {
                Flow::Next => {
                    let Some(&link) = CHAIN.get(miss.at) else {
                        return MissStep::Failed(self.out_of_memory_of(miss));
                    };
                    miss.at += 1;
                    flow = self.run_link(miss, link);
                }
                Flow::Found => {
                    let (params, size) = (&miss.request.params, miss.request.size);
                    return match self.finish(params, size) {
                        // Another stream's block: lent to the request's stream.
                        Ok(a) if miss.borrowed => MissStep::Done(self.lend(a, params.stream)),
                        Ok(a) => {
                            if miss.spilled {
                                // A warm replay spills where the history says, and nowhere
                                // else (`malloc/spill.rs`).
                                self.history.mark_spilled(a.ptr.0);
                            }
                            MissStep::Done(a)
                        }
                        Err(e) => MissStep::Failed(e),
                    };
                }
                Flow::Fail(e) => return MissStep::Failed(e),
                Flow::Wait(op, io) => {
                    miss.op = Some(op);
                    return MissStep::Io(io);
                }
            }
        }
    }

    fn run_link(&mut self, miss: &mut Miss, link: Link) -> Flow {
        let size = miss.request.size;
        let params = &mut miss.request.params;
        match link {
            CollectGarbage => {
                // None unless `garbage_collection_threshold` and the memory fraction are set
                // and reserved memory is past the threshold (`gc_victims`).
                let victims = self.gc_victims();
                let segments = victims
                    .into_iter()
                    .map(|id| self.detach_block(id))
                    .collect();
                self.free_segments(segments, Op::Free)
            }
            AtQuota => {
                if self.quota_error(params, size).is_none() {
                    miss.at = after_quota();
                }
                Flow::Next
            }
            AdoptOrphan => found_if(self.adopt_orphan(params)),
            BorrowFree => match self.borrow_free(params) {
                Ok(found) => {
                    miss.borrowed = found;
                    found_if(found)
                }
                Err(e) => Flow::Fail(e),
            },
            AllocBlock { retry, when } => {
                let runs = match when {
                    When::Always => true,
                    When::Expands => self.pool_expands(params.pool),
                    When::Released => miss.released,
                };
                if !runs {
                    return Flow::Next;
                }
                if retry {
                    self.count(Counted::Retry);
                }
                self.alloc_block_step(params, miss.off_core)
            }
            SpillSmall => {
                miss.spilled = self.spill_small(params);
                found_if(miss.spilled)
            }
            TakePassedOver => found_if(self.take_passed_over(params)),
            PrivatePoolOnOom => found_if(self.use_private_pool_on_oom(params)),
            ReleaseOversize => {
                let (victims, enough) = self.oversize_victims(params);
                miss.released = enough;
                let segments = victims
                    .into_iter()
                    .map(|id| self.detach_block(id))
                    .collect();
                self.free_segments(segments, Op::Free)
            }
            // A graph's memory is not the pool's to release (`pools/capture.rs`).
            ReleaseOwnPool if self.pool_in_graph_use(params.pool) => Flow::Next,
            ReleaseOwnPool => {
                let pools = self.own_pools(params.pool).into_iter().flatten().collect();
                self.release_step(ops::Release::own(pools))
            }
            // Free memory strands in holes between live blocks and on other streams. Before
            // reserved memory grows past the most it ever held, what is free goes back first
            // and the growth maps it again where the request needs it (`budget.rs` says which
            // release is allowed):
            // - the whole cache, a bounded number of times after each `empty_cache` of the
            //   user's: a job that empties its cache between steps pays for releases already;
            // - else, for the default large pool, the default pools' free pages (a small
            //   pool's whole free pages too), once per rise of the mark: with
            //   no synchronization (a free block has no pending event; the unmap waits for its
            //   stream as every unmap does), and none once the mark stops rising, so a repeated
            //   step after warm-up makes no driver call for either rule.
            ReleaseBeforeGrowth => {
                let policy = self.config.policy;
                if !self.captures.is_quiet()
                    || !self.pool_expands(params.pool)
                    || !self.budget.passes_high_water(params.alloc_size)
                {
                    return Flow::Next;
                }
                let may_release = policy.releases_before_growth();
                // For the default large pool only, from the default pools only: a private
                // pool's memory is its own (a graph's, or an unsplit pool's ranges, which would
                // be released and reserved again), and a small request's growth would move
                // 2 MiB pages between streams for at most one page.
                let may_move = policy.moves_pages_before_growth()
                    && params.pool == LARGE_POOL
                    && MOVED_POOLS
                        .iter()
                        .map(|&p| self.free_whole_pages(p))
                        .sum::<u64>()
                        >= moved_enough(params.alloc_size);
                let release = self.budget.take_release_before_growth(
                    params.alloc_size,
                    may_release,
                    may_move,
                );
                match release {
                    budget::ReleaseBeforeGrowth::Cache => {
                        let pools = self.release_scope();
                        self.release_step(ops::Release::cached(pools))
                    }
                    budget::ReleaseBeforeGrowth::PoolPages => {
                        params.exact_growth = true;
                        self.release_step(ops::Release::pages(MOVED_POOLS.to_vec()))
                    }
                    budget::ReleaseBeforeGrowth::Nothing => Flow::Next,
                }
            }
            // It synchronizes: not while a capture is under way (PyTorch skips it too).
            ReleaseCached if !self.captures.is_quiet() => Flow::Next,
            ReleaseCached => {
                let pools = self.release_scope();
                self.release_step(ops::Release::cached(pools))
            }
            QuotaFailure => match self.quota_failure(params, size) {
                Some(e) => Flow::Fail(e),
                None => Flow::Next,
            },
            OutOfMemory => Flow::Fail(self.out_of_memory_of(miss)),
        }
    }

    /// The error a miss ends in when nothing served it: the pool's quota, else out of memory.
    fn out_of_memory_of(&mut self, miss: &Miss) -> AllocError {
        let (params, size) = (&miss.request.params, miss.request.size);
        match self.quota_failure(params, size) {
            Some(e) => e,
            None => self.out_of_memory(size, params),
        }
    }
}

/// The pools whose free pages a page move unmaps: the default ones.
const MOVED_POOLS: [usize; 2] = [LARGE_POOL, SMALL_POOL];

/// The least free memory, in whole pages of the default pools, worth a page move for a
/// growth of `alloc_size`: 3/4 of it. Fewer free pages than the request mostly means the job
/// needs more memory, not that holes strand it; moving them then only scatters the layout.
/// Measured on the shared traces (default config and the configs of `real_traces.rs`, with no
/// pages ahead after a move): a share of 1/4 or 1/2 leaves transformer-lm-train at 0.6%
/// fragmentation instead of 0.13%, and 1/2 reserves 62 MiB more than PyTorch there with
/// `expandable_segments:True`; 1 reserves 4 MiB more than PyTorch on qwen3-gcn device 0;
/// 3/2 or more leaves qwen2-7b-layerwise-calib at 7.04% or 4.91% instead of 1.71%.
fn moved_enough(alloc_size: u64) -> u64 {
    alloc_size / 4 * 3
}

fn found_if(found: bool) -> Flow {
    if found {
        Flow::Found
    } else {
        Flow::Next
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_quota_links_end_where_every_request_goes_on() {
        let at = after_quota();
        assert_eq!(CHAIN[at - 1], QuotaFailure);
        assert_eq!(CHAIN[at], AdoptOrphan);
        assert_eq!(CHAIN.last(), Some(&OutOfMemory));
    }
}
