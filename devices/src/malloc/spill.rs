//! The `gpualloc` policy's spill: a small request that misses the default small pool takes a
//! free block of the default large pool's expandable segment instead of a new small page,
//! when its size is known to be short-lived, or, where small pages are a visible share of the
//! job's memory, when its lifetime is not known yet.
//!
//! PyTorch keeps the pools apart: blocks of 1 MiB or less come from 2 MiB small-pool pages,
//! the rest from the large pool, and neither pool's free memory serves the other. A job whose
//! small temporaries peak while its large blocks are low (a CNN's 1 MiB workspaces between
//! layers) then holds the small pool's extra pages all run, beside the large pool's peak:
//! cnn-counterfactual-small reserves 108 MiB where 104 hold its peak.
//!
//! The rule, on a miss of the default small pool (nothing free there on the request's stream):
//! - **A size known short-lived** (its last block lived at most [`SPILL_LIFETIME`]
//!   allocations; `spill_state.rs` learns lifetimes from the frees of both default pools),
//!   where a new small page would pass the most the small pool ever held, takes the best fit
//!   among the free mapped blocks of the default large pool's expandable segments on its
//!   stream, split to its size; freed, the block goes back to the large pool and merges there.
//!   Within the small pool's mark (its pages given to a growth of the large pool by the page
//!   move before it, `miss/chain.rs`) the small pool grows back as before: spilling there put
//!   a step's small temporaries in the large pool's holes at different places each step, and a
//!   repeated step of mixed sizes (`devices/tests/placement.rs`) reserved 98 MiB instead of 94
//!   and mapped pages until its third step.
//! - **A size never freed yet** spills only once some small block has been freed (the job
//!   computes; before, it loads what it keeps: a model's weights, biases and norms), where a
//!   new small page would make the small pool more than 1 / [`UNKNOWN_SPILL_SHARE`] of what
//!   the large pool has mapped, and only into a free block at the end of the large pool's
//!   mapped pages (no mapped block after it). Such a block may be long-lived (a kept
//!   activation): in a hole between live blocks it would pin the hole, and a later large
//!   request that the hole with its neighbour would have held maps new pages instead (spilling
//!   every small miss anywhere measured transformer-lm-forward-bf16 at 780 MiB instead of
//!   756, BENCHMARKS.md); at the mapped end it takes what a new small page would have. This
//!   keeps a step's first small peak from raising the small pool's mark for good:
//!   cnn-counterfactual-small's first step, its 1 MiB workspaces not freed yet, grew the small
//!   pool to three pages, and every later step filled them while the large pool peaked
//!   (106 MiB); now those requests spill, the small pool keeps two pages, and later steps spill
//!   their known short-lived workspaces (104 MiB). Without the first condition, a generated
//!   MiniLM-like inference spills its small weights as it loads them (82 MiB instead of 80);
//!   without the share, qwen3-gcn device 2 reserves 20,694 MiB instead of 20,618. A large
//!   model's small pool is a fraction of a percent of its memory and never passes the share
//!   (llama7b-offload: 48 MiB beside 19 GiB), so its small tensors stay apart as PyTorch
//!   keeps them.
//!
//! The core learns from the frees it sees. In front of it, the device actor's thread cache
//! parks a buffer dropped on its own stream and hands it out again without the core: such a
//! free reaches the core (and teaches a lifetime, or the first small free) only when the cache
//! gives the block back, so a live allocator with the thread cache may learn later than a
//! replay of its trace, and spill later (never wrongly: a spill only places a block).
//!
//! Not during a stream capture (a capture's requests are its graph pool's), not for private
//! pools (their memory is their own), not with ordinary segments (a block of a 20 MiB
//! `cudaMalloc` segment would keep the segment from `empty_cache` for a 512-byte tensor), and
//! not under PyTorch's policy. A spilled block is a large-pool block: its statistics count
//! in `large_pool`, and [`crate::Allocation::small_pool`] is false.

use crate::blocks::pool::key;
use crate::config::sizes::SMALL_BUFFER;
use crate::core::{AllocParams, DeviceCore, LARGE_POOL, SMALL_POOL};
use crate::malloc::segment_request::SegmentRequest;
use crate::Allocation;

/// A small size spills only if its last block lived at most this many allocations (of any
/// pool). Measured on the shared traces (default config, before the small pool's mark was a
/// condition): 20, 200 and 1,000 give the same peaks, 5,000 or no bound lower
/// llama-lora-finetune by 2 MiB more; with the mark, 1,000 gives that lower figure too. The
/// bound keeps a size that turned long-lived (a kept activation) out of the large pool's
/// holes.
pub const SPILL_LIFETIME: u64 = 1_000;

/// A request of unknown lifetime spills only while a new small page would make the small pool
/// more than this share (1 / `UNKNOWN_SPILL_SHARE`) of what the large pool has mapped: where
/// small pages are a visible part of a job's memory. A large model's small pool is a fraction
/// of a percent of its memory, and its small tensors stay apart, as PyTorch keeps them.
/// Measured (default config, BENCHMARKS.md): 1/12 leaves cnn-counterfactual-small at 106 MiB;
/// 1/16 to 1/128 bring it to 104, and place llama-lora-finetune's small blocks differently
/// (5,634 to 5,646 MiB, 5,630 before; 1/16 gives 5,634).
pub const UNKNOWN_SPILL_SHARE: u64 = 16;

impl DeviceCore {
    /// The spill (see the module docs): true when `params` now holds a free block of the
    /// default large pool (taken out of its pool, `params.pool` set to it).
    pub(crate) fn spill_small(&mut self, params: &mut AllocParams) -> bool {
        if params.pool != SMALL_POOL
            || self.spill.as_recorded
            || !self.config.policy.spills_small_requests()
            || !self.captures.is_quiet()
        {
            return false;
        }
        let unknown = match self.spill.last(params.size) {
            Some(l) if l <= SPILL_LIFETIME => false,
            Some(_) => return false, // known long-lived
            None => true,
        };
        let may = if unknown {
            self.spill.freed_small()
                && self
                    .spill
                    .small_pool_outgrows_share(SMALL_BUFFER, UNKNOWN_SPILL_SHARE)
        } else {
            self.spill.small_pool_passes_most(SMALL_BUFFER)
        };
        if !may {
            return false;
        }
        let stream = params.stream.raw;
        let blocks = &self.blocks;
        // A block of unknown lifetime goes to a tail: a free block with no mapped block after
        // it, where it splits no hole between live blocks that a later large request with its
        // neighbour would have filled.
        let fits = |id| {
            let b = blocks.get(id);
            b.expandable() && (!unknown || b.next().is_none_or(|n| !blocks.get(n).mapped()))
        };
        // Best fit: the free tree is ordered by stream, size, address. Only blocks of an
        // expandable segment: ordinary segments are left out (module docs).
        let found = self.pools[LARGE_POOL]
            .free_range(key(stream, params.size, 0)..)
            .take_while(|(k, _)| k.0 == stream)
            .map(|(_, id)| *id)
            .find(|&id| fits(id));
        let Some(id) = found else {
            return false;
        };
        self.pools[LARGE_POOL].unfile_free(self.blocks.get(id));
        params.pool = LARGE_POOL;
        params.block = Some(id);
        true
    }

    /// For a replay that follows a history (`TraceEntry::spilled`): serves `request`, a
    /// small request of the default pools, as the live allocator did, by the spill into the
    /// free block of the default large pool on its stream that starts at `addr`, split to its
    /// size. What decided the live spill (lifetimes learned before recording began, the
    /// small pool's mark) is not in the history. `Err` gives the request back where no such
    /// block is free, it is too small, or the policy, the pool or a capture rules a spill out:
    /// the caller then serves it as an ordinary request.
    pub fn malloc_spilled(
        &mut self,
        request: SegmentRequest,
        addr: u64,
    ) -> Result<Allocation, SegmentRequest> {
        // As a lookup does first (an error here is the ordinary request's to report).
        if self.process_events().is_err() {
            return Err(request);
        }
        let params = &request.params;
        if params.pool != SMALL_POOL
            || !self.config.policy.spills_small_requests()
            || !self.captures.is_quiet()
        {
            return Err(request);
        }
        let k = key(params.stream.raw, params.size, 0);
        let found = self.pools[LARGE_POOL]
            .free_range(k..)
            .take_while(|(k, _)| k.0 == params.stream.raw)
            .find(|(k, id)| k.2 == addr && self.blocks.get(**id).expandable())
            .map(|(k, id)| (*k, *id));
        let Some((k, id)) = found else {
            return Err(request);
        };
        let a = self.finish_from_free(request, LARGE_POOL, &k, id)?;
        self.history.mark_spilled(a.ptr.0);
        Ok(a)
    }

    /// For a replay that follows a history recorded under a policy that spills: the miss
    /// chain spills nothing, and a small request is served by the large pool only through
    /// [`DeviceCore::malloc_spilled`], where the history shows it.
    pub fn spill_as_recorded(&mut self, on: bool) {
        self.spill.as_recorded = on;
    }
}
