//! [`DeviceCore`]: the caching allocator of one device, a synchronous state machine over a
//! [`Backend`].
//!
//! The malloc path is PyTorch's, step for step:
//! 1. complete the frees whose stream events have finished (`process_events`);
//! 2. round the size, pick the pool (small ≤ 1 MiB, else large) and the segment size;
//! 3. best fit in the pool for the same stream; else run the free-memory callbacks and retry;
//! 4. on a miss, the chain (`miss/`, a step machine that returns its driver calls): garbage-
//!    collect old cached blocks if the threshold is crossed, then allocate a segment; if the
//!    device is full: take a block from a private pool marked `use_on_oom`, release cached
//!    oversize blocks and retry, release every unused cached segment after synchronizing
//!    pending events and retry; then report out of memory;
//! 5. split the block if the rules allow, and hand out the front part.
//!
//! This file holds the core's state and its constructor; the parts that act on it live in
//! folders by component, each an `impl DeviceCore` block the core does not import: `malloc/`
//! (steps 1-3 and 5, the request of a miss, the out-of-memory report), `miss/` (step 4),
//! `free/` (free, `record_stream`, cross-stream frees, merge, release, `empty_cache`),
//! `expandable/`, `pools/` (private pools, sleep), `ledger/` (statistics, history, observer,
//! snapshots, invariants), `streams/`, `recorded/` (ARCHITECTURE.md has the table). Nothing
//! here reads a clock or blocks on anything but the backend.

use std::sync::Arc;

use gpualloc_runtime::{Backend, DeviceId, DevicePtr, StreamHandle};

use crate::blocks::block::{BlockArena, BlockId};
use crate::blocks::live::LiveBlocks;
use crate::blocks::pool::{BlockPool, PoolOwner};
use crate::blocks::segment_table::{SegmentMeta, SegmentTable};
use crate::budget::Budget;
use crate::config::AllocatorConfig;
use crate::error::AllocError;
use crate::expandable::segments::ExpandableSegments;
use crate::free::pending::PendingFrees;
use crate::ledger::cross_stream::CrossStreamLog;
use crate::ledger::history::History;
use crate::ledger::observer::SegmentObserver;
use crate::ledger::stats::DeviceStats;
use crate::malloc::callbacks::FreeMemoryCallbacks;
use crate::malloc::spill_state::SpillState;
use crate::pools::capture_state::Captures;
use crate::pools::private::PrivatePools;
use crate::streams::loan_table::Loans;
use crate::streams::retiring::RetiringStreams;

/// A live allocation handed to a user.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Allocation {
    /// Start address (null for a zero-size request).
    pub ptr: DevicePtr,
    /// Bytes the user asked for.
    pub size: u64,
    /// Bytes of the block backing it (the rounded size).
    pub block_size: u64,
    /// The allocation stream.
    pub stream: StreamHandle,
    /// The block is in a small pool (its statistics count as `small_pool`).
    pub small_pool: bool,
    /// The block is at least `max_split_size` (counted in `oversize_allocations`).
    pub oversize: bool,
    /// The private pool the block belongs to (`None`: the default pools). Its free returns
    /// it there, whichever request it served (`pools/`).
    pub pool: Option<MemPoolId>,
}

pub use crate::blocks::pool_id::MemPoolId;

pub use crate::malloc::callbacks::FreeMemoryCallback;

/// Parameters of one malloc on its way through the chain.
pub(crate) struct AllocParams {
    pub stream: StreamHandle,
    pub size: u64,
    pub alloc_size: u64,
    pub pool: usize,
    pub block: Option<BlockId>,
    /// Set once the request may take any fitting block, a dead remainder included: after the
    /// segment could not grow for it (see `Policy::avoids_dead_remainders`).
    pub any_fit: bool,
    /// Set by an owner that retries the request ([`SegmentRequest::quiet_oom`]): its
    /// out-of-memory errors are returned but not counted, recorded or logged.
    pub quiet_oom: bool,
    /// Set once free pages were moved for the request (`miss/chain.rs`, `ReleaseBeforeGrowth`):
    /// its growth maps what it needs and no pages ahead (`map_ahead.rs`), which would pass the
    /// most ever held that the move kept reserved memory under.
    pub exact_growth: bool,
}

/// The caching allocator of one device. See the module docs.
///
/// Streams are plain handles here: the owner keeps each stream that
/// [`DeviceCore::streams_in_use`] names alive (cached blocks and expandable segments call the
/// backend with their stream long after the request that brought them).
pub struct DeviceCore {
    pub(crate) backend: Arc<dyn Backend>,
    pub(crate) device: DeviceId,
    pub(crate) config: AllocatorConfig,
    pub(crate) blocks: BlockArena,
    /// Pools by index: 0 small and 1 large of the default owner, then private pools' pairs.
    pub(crate) pools: Vec<BlockPool>,
    /// Private pools, their ids and the streams routed to them.
    pub(crate) private: PrivatePools,
    /// Allocated blocks by address, and those described for export to another process.
    pub(crate) active: LiveBlocks,
    /// Segments by base address (an expandable segment's whole reservation).
    pub(crate) segments: SegmentTable,
    /// Expandable segments by base address.
    pub(crate) expandable: ExpandableSegments,
    /// What the core holds from the backend, what is being obtained off it, and the
    /// memory-fraction cap on both (`budget.rs`).
    pub(crate) budget: Budget,
    /// Frees waiting on other streams' events, and the spare events (`pending.rs`).
    pub(crate) pending: PendingFrees,
    /// Streams the owner's users dropped, with an event recorded on each when it was retired
    /// (`orphans.rs`).
    pub(crate) retiring: RetiringStreams,
    pub(crate) stats: DeviceStats,
    /// The history: entries, their times and order, frames of live blocks (`history.rs`).
    pub(crate) history: History,
    /// Run on a miss before new memory (`malloc/callbacks.rs`).
    pub(crate) callbacks: FreeMemoryCallbacks,
    /// Told of every segment change (`observer.rs`).
    pub(crate) observer: SegmentObserver,
    /// Reports of the `debug_cross_stream_frees` check (`cross_stream.rs`).
    pub(crate) cross_stream: CrossStreamLog,
    /// Stream captures announced by the owner, and the frees they hold back
    /// (`pools/capture.rs`).
    pub(crate) captures: Captures,
    /// Allocations lent to another stream than their block's (`streams/loans.rs`).
    pub(crate) loans: Loans,
    /// What the spill decides by (`malloc/spill_state.rs`).
    pub(crate) spill: SpillState,
    pub(crate) shut_down: bool,
    #[cfg(feature = "rule-knobs")]
    pub(crate) knobs: RuleKnobs,
}

/// Deliberate departures from PyTorch's rules, to show that replay checks catch them
/// (feature `rule-knobs`, for tests only).
#[cfg(feature = "rule-knobs")]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RuleKnobs {
    /// Break ties between equal-size free blocks towards the higher address.
    pub tie_break_high_address: bool,
}

pub(crate) const SMALL_POOL: usize = 0;
pub(crate) const LARGE_POOL: usize = 1;

impl DeviceCore {
    /// A core for `device` of `backend`. Reads the device's total memory once (for
    /// `per_process_memory_fraction` and OOM reports).
    pub fn new(
        backend: Arc<dyn Backend>,
        device: DeviceId,
        config: AllocatorConfig,
    ) -> Result<Self, AllocError> {
        config.validate()?;
        // The total alone: on CUDA, free memory would need the device's context, and a core
        // is made for every device whether the process uses it or not.
        let total = backend.total_memory(device)?;
        let budget = Budget::new(total, config.per_process_memory_fraction);
        // PyTorch reports its `size_t` maximum as `int64`: -1.
        let max_split_size = i64::try_from(config.max_split_size).unwrap_or(-1);
        Ok(DeviceCore {
            backend,
            device,
            config,
            blocks: BlockArena::default(),
            pools: vec![
                BlockPool::new(true, PoolOwner::Default),
                BlockPool::new(false, PoolOwner::Default),
            ],
            private: PrivatePools::new(),
            active: LiveBlocks::default(),
            segments: SegmentTable::default(),
            expandable: ExpandableSegments::default(),
            budget,
            pending: PendingFrees::default(),
            retiring: RetiringStreams::default(),
            stats: DeviceStats {
                max_split_size,
                ..DeviceStats::default()
            },
            history: History::default(),
            callbacks: FreeMemoryCallbacks::default(),
            observer: SegmentObserver::default(),
            cross_stream: CrossStreamLog::default(),
            captures: Captures::default(),
            loans: Loans::default(),
            spill: SpillState::default(),
            shut_down: false,
            #[cfg(feature = "rule-knobs")]
            knobs: RuleKnobs::default(),
        })
    }

    /// Breaks PyTorch's rules on purpose (feature `rule-knobs`, tests only).
    #[cfg(feature = "rule-knobs")]
    pub fn set_rule_knobs(&mut self, knobs: RuleKnobs) {
        self.knobs = knobs;
    }

    /// The device this core serves.
    pub fn device(&self) -> DeviceId {
        self.device
    }

    /// The configuration in force.
    pub fn config(&self) -> &AllocatorConfig {
        &self.config
    }

    /// The backend.
    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }

    /// Adds a callback run on a cache miss (see [`FreeMemoryCallback`]).
    pub fn add_free_memory_callback(&mut self, callback: FreeMemoryCallback) {
        self.callbacks.add(callback);
    }

    /// Bytes held from the backend.
    pub fn reserved_bytes(&self) -> u64 {
        self.budget.reserved()
    }

    /// Number of frees still waiting on stream events.
    #[inline]
    pub fn pending_frees(&self) -> usize {
        self.pending.len()
    }

    pub(crate) fn check_stream(&self, stream: StreamHandle) -> Result<(), AllocError> {
        if self.shut_down {
            return Err(AllocError::Shutdown);
        }
        if stream.device != self.device {
            return Err(AllocError::WrongDevice {
                expected: self.device,
                got: stream.device,
            });
        }
        Ok(())
    }

    /// Takes a segment at `addr` into the books: its metadata, the bytes reserved, and the
    /// segment in its private pool's usage and the device's statistics (a new segment and a
    /// restored one alike; a new one also counts a device allocation, its caller's part).
    pub(crate) fn book_segment(&mut self, addr: u64, meta: SegmentMeta) {
        let (size, pool) = (meta.size, meta.pool);
        self.segments.insert(addr, meta);
        self.budget.reserve(size);
        let small = self.pools[pool].is_small;
        self.book_segment_stats(pool, small, size, true);
    }
}
