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
//! Other pieces of the core live beside this file: `release.rs` (free, merge, release, the OOM
//! chain's release steps, `empty_cache`), `events.rs` (cross-stream frees), `inspect.rs`
//! (snapshot, invariants). Nothing here reads a clock or blocks on anything but the backend.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use gpualloc_runtime::addr_map::{AddrMap, AddrSet};
use gpualloc_runtime::{Backend, DeviceId, DevicePtr, EventHandle, StreamHandle};

use crate::block::{Block, BlockArena, BlockId, BlockState};
use crate::config::AllocatorConfig;
use crate::cross_stream::CrossStreamLog;
use crate::error::{AllocError, OomReport};
use crate::expandable::ExpandableSegment;
use crate::observer::SegmentSink;
use crate::pool::{key, BlockPool, PoolOwner};
use crate::pool_records::PoolUsage;
use crate::pool_state::PoolState;
use crate::sizes::{allocation_size, is_small, round_size, MIN_BLOCK_SIZE, SMALL_SIZE};
use crate::stats::{for_pool, DeviceStats};
use crate::trace::{Frames, TraceAction, TraceEntry, TraceRing};

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
    /// it there, whichever request it served (`mem_pools.rs`).
    pub pool: Option<MemPoolId>,
}

pub use crate::pool_id::MemPoolId;

/// How far back [`DeviceCore::attach_frames`] looks for an allocation's entry.
pub const ATTACH_WITHIN: usize = 4096;

/// A clock for trace entries, in microseconds (see [`DeviceCore::set_trace_clock`]).
pub type TraceClock = Box<dyn Fn() -> u64 + Send>;

/// A callback run when the pools have no block for a request, before a device malloc. It
/// returns pointers of this allocator's live allocations that may now be freed (e.g. blocks
/// another process has released); the core frees them and searches again.
pub type FreeMemoryCallback = Box<dyn FnMut() -> Vec<DevicePtr> + Send>;

pub(crate) struct PrivatePool {
    pub small: usize,
    pub large: usize,
    pub use_on_oom: bool,
    /// The user released the pool: its cached segments go back on `empty_cache`.
    pub released: bool,
    /// Name, quota and what it holds (`mem_pools.rs`).
    pub usage: PoolUsage,
    /// Made by `create_named_pool` (not PyTorch's unnamed `create_pool`).
    pub named: bool,
    /// Bytes of segments being allocated for it off the core
    /// ([`SegmentRequest::claim_fraction`]).
    pub claimed: u64,
    /// Granularity of its unsplit blocks, or why the one asked for cannot be (`unsplit.rs`).
    pub unsplit: Option<Result<u64, &'static str>>,
}

/// Parameters of one malloc on its way through the chain.
pub(crate) struct AllocParams {
    pub stream: StreamHandle,
    pub size: u64,
    pub alloc_size: u64,
    pub pool: usize,
    pub block: Option<BlockId>,
    /// The private pool the request named (`DeviceCore::try_cached_in`), if any.
    pub route: Option<u64>,
    /// Set once the request may take any fitting block, a dead remainder included: after the
    /// segment could not grow for it (see `Policy::avoids_dead_remainders`).
    pub any_fit: bool,
    /// Set by an owner that retries the request ([`SegmentRequest::quiet_oom`]): its
    /// out-of-memory errors are returned but not counted, recorded or logged.
    pub quiet_oom: bool,
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
    pub(crate) private: BTreeMap<u64, PrivatePool>,
    next_pool_id: u64,
    /// Streams whose allocations go to a private pool.
    pub(crate) routes: HashMap<u64, u64>,
    /// Allocated blocks by address.
    pub(crate) active: AddrMap<BlockId>,
    /// Allocations described for export to another process ([`DeviceCore::mark_exported`]),
    /// until they are freed.
    pub(crate) exported: AddrSet,
    /// Segments by base address (an expandable segment's whole reservation).
    pub(crate) segments: BTreeMap<u64, SegmentMeta>,
    /// Expandable segments by base address.
    pub(crate) expandable: BTreeMap<u64, ExpandableSegment>,
    /// Bytes being obtained off the core: expandable pages being mapped (`growth.rs`) and
    /// segments claimed by `SegmentRequest::claim_fraction`. They count against the cap.
    pub(crate) growing_bytes: u64,
    /// Off-core operations in flight per expandable segment (growths, page releases): its
    /// reservation is not freed while any runs (`growth.rs`, `shrink.rs`).
    pub(crate) busy: BTreeMap<u64, u32>,
    /// Reservations a shutdown left to their growths in flight (base → size).
    pub(crate) orphaned: BTreeMap<u64, u64>,
    /// Pending cross-stream frees per stream, in record order.
    pub(crate) pending: BTreeMap<StreamHandle, VecDeque<(EventHandle, BlockId)>>,
    pub(crate) event_pool: Vec<EventHandle>,
    /// Streams the owner's users dropped, with an event recorded on each when it was retired
    /// (`orphans.rs`).
    pub(crate) retiring: Vec<(StreamHandle, Option<EventHandle>)>,
    pub(crate) stats: DeviceStats,
    /// Bytes held from the backend (PyTorch's `total_allocated_memory`).
    pub(crate) total_reserved: u64,
    pub(crate) allowed_max: Option<u64>,
    pub(crate) device_total: u64,
    pub(crate) trace: Option<TraceRing>,
    pub(crate) now_us: u64,
    /// Where trace times come from when set (the facade's wall clock); else `now_us`.
    clock: Option<TraceClock>,
    /// The place of the next trace entry in the order things happened, shared with whoever
    /// records beside the core (`beside.rs`).
    pub(crate) trace_seq: Arc<AtomicU64>,
    /// A parked block being freed in the core for real, and whether its park was recorded
    /// beside the core: the core does not record its `free_requested` again, and records its
    /// `free_completed` only for a recorded park (`beside.rs`).
    pub(crate) freeing_parked: Option<(u64, bool)>,
    /// Frames of live allocations, by address (`attach_frames`), for snapshots.
    pub(crate) live_frames: HashMap<u64, Frames>,
    callbacks: Vec<FreeMemoryCallback>,
    /// Told of every segment change (`observer.rs`).
    pub(crate) segment_sink: Option<SegmentSink>,
    /// Reports of the `debug_cross_stream_frees` check (`cross_stream.rs`).
    pub(crate) cross_stream: CrossStreamLog,
    pub(crate) shut_down: bool,
    /// Devices given access to this device's expandable-segment memory (`add_peer`).
    pub(crate) peers: Vec<DeviceId>,
    #[cfg(feature = "rule-knobs")]
    knobs: RuleKnobs,
}

/// Deliberate departures from PyTorch's rules, to show that replay checks catch them
/// (feature `rule-knobs`, for tests only).
#[cfg(feature = "rule-knobs")]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RuleKnobs {
    /// Break ties between equal-size free blocks towards the higher address.
    pub tie_break_high_address: bool,
}

/// What the core remembers of a segment.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SegmentMeta {
    pub size: u64,
    pub pool: usize,
    pub stream: StreamHandle,
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
        let allowed_max = config
            .per_process_memory_fraction
            .map(|f| (total as f64 * f) as u64);
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
            private: BTreeMap::new(),
            next_pool_id: 1,
            routes: HashMap::new(),
            active: AddrMap::default(),
            exported: AddrSet::default(),
            segments: BTreeMap::new(),
            expandable: BTreeMap::new(),
            growing_bytes: 0,
            busy: BTreeMap::new(),
            orphaned: BTreeMap::new(),
            pending: BTreeMap::new(),
            event_pool: Vec::new(),
            retiring: Vec::new(),
            stats: DeviceStats {
                max_split_size,
                ..DeviceStats::default()
            },
            total_reserved: 0,
            allowed_max,
            device_total: total,
            trace: None,
            now_us: 0,
            clock: None,
            trace_seq: Arc::new(AtomicU64::new(0)),
            freeing_parked: None,
            live_frames: HashMap::new(),
            callbacks: Vec::new(),
            segment_sink: None,
            cross_stream: CrossStreamLog::default(),
            shut_down: false,
            peers: Vec::new(),
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

    /// Sets the time stamped on trace entries from now on (the core has no clock).
    pub fn set_time_us(&mut self, now_us: u64) {
        self.now_us = now_us;
    }

    /// Stamps trace entries with `clock()` (microseconds) instead of the time last set with
    /// [`DeviceCore::set_time_us`]; `None` goes back to that. A live allocator passes its
    /// wall clock; a replay keeps the trace's own times.
    pub fn set_trace_clock(&mut self, clock: Option<TraceClock>) {
        self.clock = clock;
    }

    /// Starts recording history into a ring of `max_entries` (None stops and clears it,
    /// and forgets the frames of live blocks).
    pub fn record_history(&mut self, max_entries: Option<usize>) {
        self.trace = max_entries.map(TraceRing::new);
        if self.trace.is_none() {
            self.live_frames.clear();
        }
    }

    /// Attaches `frames` to the live allocation at `addr`: to its `alloc` entry (the newest
    /// for that address among the last `ATTACH_WITHIN` (4,096) entries) and to its block in
    /// snapshots until it is freed. Nothing when history is off or `addr` is not live.
    pub fn attach_frames(&mut self, addr: u64, frames: Frames) {
        let Some(ring) = &mut self.trace else {
            return;
        };
        if !self.active.contains_key(&addr) {
            return;
        }
        if let Some(e) = ring.newest_mut(ATTACH_WITHIN, |e| {
            e.action == TraceAction::Alloc && e.addr == addr
        }) {
            e.frames = Some(frames.clone());
        }
        self.live_frames.insert(addr, frames);
    }

    /// Adds a callback run on a cache miss (see [`FreeMemoryCallback`]).
    pub fn add_free_memory_callback(&mut self, callback: FreeMemoryCallback) {
        self.callbacks.push(callback);
    }

    /// Statistics.
    pub fn stats(&self) -> &DeviceStats {
        &self.stats
    }

    /// Resets peak statistics to current values.
    pub fn reset_peak_stats(&mut self) {
        self.stats.reset_peak();
    }

    /// Resets accumulated statistics (sums and event counters).
    pub fn reset_accumulated_stats(&mut self) {
        self.stats.reset_accumulated();
    }

    /// Bytes held from the backend.
    pub fn reserved_bytes(&self) -> u64 {
        self.total_reserved
    }

    /// Number of frees still waiting on stream events.
    pub fn pending_frees(&self) -> usize {
        self.pending.values().map(VecDeque::len).sum()
    }

    /// Records a trace entry (when history is on) and announces a segment change to the
    /// segment sink (when one is set, `observer.rs`).
    pub(crate) fn record(&mut self, action: TraceAction, addr: u64, size: u64, stream: u64) {
        self.record_in(action, addr, size, stream, None);
    }

    /// [`DeviceCore::record`] of an entry about a block or segment of pool index `pool`: a
    /// private pool's entries carry its id.
    pub(crate) fn record_in(
        &mut self,
        action: TraceAction,
        addr: u64,
        size: u64,
        stream: u64,
        pool: Option<usize>,
    ) {
        if let Some(ring) = &mut self.trace {
            // A parked block's free was requested beside the core (`beside.rs`).
            let already = match self.freeing_parked {
                Some((parked, recorded)) if parked == addr => {
                    action == TraceAction::FreeRequested
                        || (!recorded && action == TraceAction::FreeCompleted)
                }
                _ => false,
            };
            if !already {
                let time_us = self.clock.as_ref().map_or(self.now_us, |clock| clock());
                let seq = self.trace_seq.fetch_add(1, Ordering::Relaxed);
                ring.push(
                    seq,
                    TraceEntry {
                        action,
                        addr,
                        size,
                        stream,
                        time_us,
                        frames: None,
                        pool: match pool.map(|p| self.pools[p].owner) {
                            Some(PoolOwner::Private(id)) => id,
                            _ => 0,
                        },
                        passed_over: false,
                    },
                );
            }
        }
        if action == TraceAction::FreeRequested && !self.live_frames.is_empty() {
            self.live_frames.remove(&addr);
        }
        self.announce(action, addr, size, stream);
    }

    /// Marks the `alloc` entry just recorded for `addr` as served by a passed-over block.
    fn mark_passed_over(&mut self, addr: u64) {
        if let Some(ring) = &mut self.trace {
            if let Some(e) =
                ring.newest_mut(1, |e| e.action == TraceAction::Alloc && e.addr == addr)
            {
                e.passed_over = true;
            }
        }
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

    // ---- private pools ----

    /// Creates a private memory pool. With `use_on_oom`, its free blocks serve any request of
    /// this device that would otherwise fail.
    pub fn create_pool(&mut self, use_on_oom: bool) -> MemPoolId {
        let id = self.next_pool_id;
        self.next_pool_id += 1;
        let small = self.pools.len();
        self.pools
            .push(BlockPool::new(true, PoolOwner::Private(id)));
        self.pools
            .push(BlockPool::new(false, PoolOwner::Private(id)));
        self.private.insert(
            id,
            PrivatePool {
                small,
                large: small + 1,
                use_on_oom,
                released: false,
                usage: PoolUsage {
                    name: format!("pool {id}"),
                    ..PoolUsage::default()
                },
                named: false,
                claimed: 0,
                unsplit: None,
            },
        );
        MemPoolId(id)
    }

    /// Routes allocations on `stream` to `pool` until [`DeviceCore::end_allocate_to_pool`].
    pub fn begin_allocate_to_pool(
        &mut self,
        pool: MemPoolId,
        stream: StreamHandle,
    ) -> Result<(), AllocError> {
        self.check_stream(stream)?;
        match self.private.get(&pool.0) {
            Some(p) if !p.released => {
                self.routes.insert(stream.raw, pool.0);
                Ok(())
            }
            _ => Err(AllocError::UnknownPool(pool.0)),
        }
    }

    /// Stops routing `stream`'s allocations to a private pool.
    pub fn end_allocate_to_pool(&mut self, stream: StreamHandle) {
        self.routes.remove(&stream.raw);
    }

    /// Releases a private pool: no new allocations go to it, and its cached segments are
    /// returned by the next `empty_cache` (live allocations in it stay valid).
    pub fn release_pool(&mut self, pool: MemPoolId) -> Result<(), AllocError> {
        let p = self
            .private
            .get_mut(&pool.0)
            .ok_or(AllocError::UnknownPool(pool.0))?;
        p.released = true;
        self.routes.retain(|_, id| *id != pool.0);
        Ok(())
    }

    /// The block pool of a request: the private pool it names (`route`), else the one its
    /// stream is routed to, else the default pools.
    fn pool_for(&self, rounded: u64, stream: StreamHandle, route: Option<u64>) -> usize {
        let small = is_small(rounded);
        match route
            .or_else(|| self.routes.get(&stream.raw).copied())
            .and_then(|id| self.private.get(&id))
        {
            Some(p) => {
                if small {
                    p.small
                } else {
                    p.large
                }
            }
            None => {
                if small {
                    SMALL_POOL
                } else {
                    LARGE_POOL
                }
            }
        }
    }

    // ---- malloc ----

    /// Allocates `size` bytes for use on `stream`. Size 0 returns a null allocation, as
    /// PyTorch does (freeing it is a no-op).
    pub fn malloc(&mut self, size: u64, stream: StreamHandle) -> Result<Allocation, AllocError> {
        match self.try_cached(size, stream)? {
            CachedOutcome::Hit(a) => Ok(a),
            CachedOutcome::Miss(request) => self.malloc_after_miss(request),
        }
    }

    /// The cache-only half of [`DeviceCore::malloc`]: steps 1–3. On a miss it returns the
    /// parameters for a segment allocation, which the caller may perform off this core (a
    /// device malloc is slow) and hand back with [`DeviceCore::malloc_with_segment`], run
    /// through the chain step by step ([`crate::Miss`]), or continue in place with
    /// [`DeviceCore::malloc_after_miss`].
    pub fn try_cached(
        &mut self,
        size: u64,
        stream: StreamHandle,
    ) -> Result<CachedOutcome, AllocError> {
        self.try_cached_routed(size, stream, None)
    }

    /// [`DeviceCore::try_cached`] for the private pool `route` names, if any.
    pub(crate) fn try_cached_routed(
        &mut self,
        size: u64,
        stream: StreamHandle,
        route: Option<u64>,
    ) -> Result<CachedOutcome, AllocError> {
        self.check_stream(stream)?;
        if size == 0 {
            return Ok(CachedOutcome::Hit(Allocation {
                ptr: DevicePtr(0),
                size: 0,
                block_size: 0,
                stream,
                small_pool: true,
                oversize: false,
                pool: None,
            }));
        }
        self.process_events()?;
        let mut params = self.params_for(size, stream, route)?;
        if self.get_free_block(&mut params)
            || (self.trigger_free_memory_callbacks()? && self.get_free_block(&mut params))
        {
            return self.finish(&params, size).map(CachedOutcome::Hit);
        }
        Ok(CachedOutcome::Miss(SegmentRequest { params, size }))
    }

    /// The parameters of a request for `size` bytes on `stream`: its rounded size, segment
    /// size and pool, after the pool's own rules.
    pub(crate) fn params_for(
        &self,
        size: u64,
        stream: StreamHandle,
        route: Option<u64>,
    ) -> Result<AllocParams, AllocError> {
        // `let else`, not `ok_or`: an error built eagerly is dropped on every hit.
        let overflows = || AllocError::InvalidSize {
            size,
            reason: "overflows when rounded",
        };
        let Some(rounded) = round_size(size, &self.config) else {
            return Err(overflows());
        };
        let Some(alloc_size) = allocation_size(rounded, &self.config) else {
            return Err(overflows());
        };
        let mut params = AllocParams {
            stream,
            size: rounded,
            alloc_size,
            pool: self.pool_for(rounded, stream, route),
            block: None,
            route,
            any_fit: false,
            quiet_oom: false,
        };
        self.apply_pool_rules(&mut params)?;
        Ok(params)
    }

    /// The last step of a miss whose owner already tried the device off the core (and
    /// released the cache there) and found no room: serves the request from blocks freed in
    /// the meantime (or from a private pool, as the chain does on OOM), else reports the
    /// out-of-memory error. Unlike [`DeviceCore::malloc_after_miss`] it neither allocates nor
    /// frees device memory, so an owner can call it under its lock without stalling others.
    pub fn malloc_without_device(
        &mut self,
        request: SegmentRequest,
    ) -> Result<Allocation, AllocError> {
        let SegmentRequest { mut params, size } = request;
        params.any_fit = true;
        if self.get_free_block(&mut params) || self.use_private_pool_on_oom(&mut params) {
            return self.finish(&params, size);
        }
        if let Some(e) = self.quota_failure(&params, size) {
            return Err(e);
        }
        Err(self.out_of_memory(size, &params))
    }

    /// Finishes a miss with a segment the caller allocated from the backend itself (`ptr`,
    /// `request.alloc_size()` bytes), claimed beforehand with
    /// [`SegmentRequest::claim_fraction`] (the claim ends here). The segment is adopted even
    /// if the cache could serve the request by now, so nothing leaks.
    pub fn malloc_with_segment(
        &mut self,
        request: SegmentRequest,
        ptr: DevicePtr,
    ) -> Result<Allocation, AllocError> {
        let SegmentRequest { mut params, size } = request;
        self.growing_bytes = self.growing_bytes.saturating_sub(params.alloc_size);
        self.claim_for_pool(params.pool, params.alloc_size, false);
        self.adopt_segment(&mut params, ptr);
        self.finish(&params, size)
    }

    /// A segment claimed with [`SegmentRequest::claim_fraction`] was not obtained (the device
    /// malloc failed, or the core shut down and it went back): it no longer counts.
    pub fn segment_not_obtained(&mut self, request: &SegmentRequest) {
        self.growing_bytes = self.growing_bytes.saturating_sub(request.params.alloc_size);
        self.claim_for_pool(request.params.pool, request.params.alloc_size, false);
    }

    /// For a miss an owner handles off the core: `take` looks for a block for the request in
    /// the cache (into its params); `Err` gives the request back when it finds none.
    pub(crate) fn serve_from_cache(
        &mut self,
        mut request: SegmentRequest,
        take: impl FnOnce(&mut Self, &mut AllocParams) -> bool,
    ) -> Result<Allocation, SegmentRequest> {
        if !take(self, &mut request.params) {
            return Err(request);
        }
        let size = request.size;
        self.finish(&request.params, size).map_err(|_| request)
    }

    pub(crate) fn finish(
        &mut self,
        params: &AllocParams,
        size: u64,
    ) -> Result<Allocation, AllocError> {
        match params.block {
            Some(id) => {
                // A block the policy passes over, taken because the segment could not grow:
                // the history says so (`TraceEntry::passed_over`).
                let passed_over = params.any_fit && self.passes_over(id, params);
                let a = self.alloc_found_block(id, params.size, size);
                if passed_over {
                    self.mark_passed_over(a.ptr.0);
                }
                Ok(a)
            }
            None => Err(AllocError::InvalidSize {
                size,
                reason: "no block found (internal)",
            }),
        }
    }

    pub(crate) fn out_of_memory(&mut self, size: u64, params: &AllocParams) -> AllocError {
        let info = self.backend.mem_info(self.device).unwrap_or_default();
        let report = OomReport {
            device: self.device,
            requested: size,
            alloc_size: params.alloc_size,
            device_total: if info.total > 0 {
                info.total
            } else {
                self.device_total
            },
            device_free: info.free,
            allowed: self.allowed_max,
            allocated: self.stats.allocated_bytes[0].current,
            reserved: self.stats.reserved_bytes[0].current,
            in_flight: self.growing_bytes,
            process_used: self.backend.process_used(self.device).ok().flatten(),
            expandable_segments: self.config.expandable_segments,
        };
        let error = AllocError::OutOfMemory(Box::new(report));
        if !params.quiet_oom {
            self.count_oom_of(&error, params.size, params.stream);
        }
        error
    }

    /// Counts `error`, an out-of-memory error of a malloc on `stream`, as PyTorch does when a
    /// malloc fails: `num_ooms`, an `oom` entry in the history (with the device's free bytes
    /// and the rounded request) and a warning; a private pool's quota error counts in
    /// `num_ooms` only. Other errors count nothing. The core does this itself for every
    /// request except those an owner marked with [`SegmentRequest::quiet_oom`]: an owner that
    /// retries a request (waiting for memory, for misses in flight) calls this once, for the
    /// failure its user sees.
    pub fn count_oom(&mut self, error: &AllocError, stream: StreamHandle) {
        let requested = match error {
            AllocError::OutOfMemory(report) => report.requested,
            _ => 0,
        };
        let rounded = round_size(requested, &self.config).unwrap_or(requested);
        self.count_oom_of(error, rounded, stream);
    }

    /// [`DeviceCore::count_oom`], the history entry naming `size` bytes.
    pub(crate) fn count_oom_of(&mut self, error: &AllocError, size: u64, stream: StreamHandle) {
        match error {
            AllocError::OutOfMemory(report) => {
                self.stats.num_ooms += 1;
                self.record(TraceAction::Oom, report.device_free, size, stream.raw);
                tracing::warn!(
                    device = self.device.0,
                    requested = report.requested,
                    reserved = report.reserved,
                    "out of memory"
                );
            }
            AllocError::PoolQuota {
                quota, reserved, ..
            } => {
                self.stats.num_ooms += 1;
                // An out-of-memory error for its user: in the history too, with the bytes the
                // pool had left in place of the device's free bytes.
                let left = quota.saturating_sub(*reserved);
                self.record(TraceAction::Oom, left, size, stream.raw);
            }
            _ => {}
        }
    }

    /// Best fit for `params` in its pool (PyTorch's `get_free_block`).
    pub(crate) fn get_free_block(&mut self, params: &mut AllocParams) -> bool {
        let gc_on = self.config.garbage_collection_threshold > 0.0 && self.allowed_max.is_some();
        let max_split = self.config.max_split_size;
        let max_rounding = self.config.max_non_split_rounding;
        if gc_on {
            self.pools[params.pool].get_free_block_calls += 1;
        }
        let pool = &self.pools[params.pool];
        let stream = params.stream.raw;
        // One walk of the free tree: its first entry is the best fit by size, and the best
        // fit by growth below goes on from there (a second search cost a tenth of a hit).
        let mut walk = pool.free.range((stream, params.size, 0)..);
        let Some((&first_key, &first_id)) = walk.next() else {
            return false;
        };
        let (mut k, mut id) = (first_key, first_id);
        if k.0 != stream {
            return false;
        }
        if self.unsplit_of(params.pool).is_some() {
            // A block of its own: only one of exactly the rounded size serves the request.
            if k.1 != params.size {
                return false;
            }
            self.pools[params.pool].free.remove(&k);
            params.block = Some(id);
            return true;
        }
        #[cfg(feature = "rule-knobs")]
        if self.knobs.tie_break_high_address {
            if let Some((hk, high)) = pool
                .free
                .range((stream, k.1, 0)..=(stream, k.1, u64::MAX))
                .next_back()
            {
                (k, id) = (*hk, *high);
                walk = pool
                    .free
                    .range((std::ops::Bound::Excluded(k), std::ops::Bound::Unbounded));
            }
        }
        if self.blocks.get(id).expandable {
            // Best fit by the size a block can grow to (its size plus the pages after it that
            // are not mapped), so address space stays free for growth. Pages being mapped or
            // unmapped off the core count as not mapped, up to the next mapped page: the
            // choice must not depend on whether another request's map has landed (a replay
            // of the history maps them where the history shows them). Without pages in
            // flight this is PyTorch's rule: its unmapped neighbours are one block.
            let grow = |id: BlockId| {
                let mut size = self.blocks.get(id).size;
                let mut next = self.blocks.get(id).next;
                while let Some(n) = next.map(|n| self.blocks.get(n)).filter(|n| !n.mapped) {
                    size += n.size;
                    next = n.next;
                }
                size
            };
            let mut best = grow(id);
            for (nk, nid) in walk {
                if !self.blocks.get(id).expandable || nk.0 != stream {
                    break;
                }
                let candidate = grow(*nid);
                if candidate >= best {
                    break;
                }
                (k, id, best) = (*nk, *nid, candidate);
            }
        }
        if !params.any_fit && self.passes_over(id, params) {
            return self.take_tail(params);
        }
        let block_size = k.1;
        // `max_split_size` limits expandable blocks only under PyTorch's policy.
        if !self.blocks.get(id).expandable || self.config.policy.max_split_limits_expandable() {
            // Never hand an oversize block to a small request.
            if params.size < max_split && block_size >= max_split {
                return false;
            }
            // A large request may take an oversize block only if the waste stays bounded.
            if params.size >= max_split && block_size >= params.size.saturating_add(max_rounding) {
                return false;
            }
        }
        self.pools[params.pool].free.remove(&k);
        params.block = Some(id);
        true
    }

    fn trigger_free_memory_callbacks(&mut self) -> Result<bool, AllocError> {
        if self.callbacks.is_empty() {
            return Ok(false);
        }
        let mut to_free = Vec::new();
        for cb in &mut self.callbacks {
            to_free.extend(cb());
        }
        let mut freed = false;
        for ptr in to_free {
            match self.free(ptr) {
                Ok(()) => freed = true,
                Err(e) => {
                    tracing::warn!(%ptr, error = %e, "free-memory callback returned a bad pointer")
                }
            }
        }
        if freed {
            self.process_events()?;
        }
        Ok(freed)
    }

    /// Takes a freshly allocated segment of `params.alloc_size` bytes into the books.
    pub(crate) fn adopt_segment(&mut self, params: &mut AllocParams, ptr: DevicePtr) {
        let size = params.alloc_size;
        let id = self
            .blocks
            .insert(Block::segment(ptr.0, size, params.stream, params.pool));
        self.book_segment(
            ptr.0,
            SegmentMeta {
                size,
                pool: params.pool,
                stream: params.stream,
            },
        );
        self.stats.num_device_alloc += 1;
        self.record_in(
            TraceAction::SegmentAlloc,
            ptr.0,
            size,
            params.stream.raw,
            Some(params.pool),
        );
        tracing::debug!(device = self.device.0, addr = ptr.0, size, "segment_alloc");
        params.block = Some(id);
    }

    pub(crate) fn use_private_pool_on_oom(&mut self, params: &mut AllocParams) -> bool {
        if matches!(self.pools[params.pool].owner, PoolOwner::Private(_)) {
            return false;
        }
        let candidates: Vec<usize> = self
            .private
            .values()
            .filter(|p| p.use_on_oom && !p.released && p.usage.state == PoolState::Awake)
            .map(|p| {
                if is_small(params.size) {
                    p.small
                } else {
                    p.large
                }
            })
            .collect();
        let original = params.pool;
        for pool in candidates {
            params.pool = pool;
            if self.get_free_block(params) {
                return true;
            }
        }
        params.pool = original;
        false
    }

    /// PyTorch's `should_split`.
    fn should_split(&self, block: &Block, size: u64) -> bool {
        let remaining = block.size - size;
        if self.pools[block.pool].is_small || self.config.expandable_segments {
            remaining >= MIN_BLOCK_SIZE
        } else {
            size < self.config.max_split_size && remaining > SMALL_SIZE
        }
    }

    /// Hands out the found block, splitting off the remainder when the rules allow
    /// (PyTorch's `alloc_found_block`).
    fn alloc_found_block(&mut self, mut id: BlockId, size: u64, requested: u64) -> Allocation {
        let found = self.blocks.get(id).clone();
        let small = self.pools[found.pool].is_small;
        let already_split = found.is_split();
        if self.should_split(&found, size) {
            // The front `size` bytes become a new block; the remainder keeps the old id.
            let front = Block {
                addr: found.addr,
                size,
                requested: 0,
                stream: found.stream,
                pool: found.pool,
                prev: found.prev,
                next: Some(id),
                state: BlockState::Free,
                event_count: 0,
                stream_uses: Vec::new(),
                segment: found.segment,
                gc_base: 0,
                mapped: found.mapped,
                expandable: found.expandable,
            };
            let front_id = self.blocks.insert(front);
            if let Some(p) = found.prev {
                self.blocks.get_mut(p).next = Some(front_id);
            }
            let gc_base = self.pools[found.pool].get_free_block_calls;
            let rest = self.blocks.get_mut(id);
            rest.prev = Some(front_id);
            rest.addr += size;
            rest.size -= size;
            rest.gc_base = gc_base;
            let (rest_key, rest_size) = (key(rest.stream.raw, rest.size, rest.addr), rest.size);
            self.pools[found.pool].free.insert(rest_key, id);
            if found.expandable {
                // inactive_split is not tracked for expandable segments (as in PyTorch).
            } else if already_split {
                for_pool(&mut self.stats.inactive_split_bytes, small, |s| {
                    s.decrease(size)
                });
            } else {
                for_pool(&mut self.stats.inactive_split_bytes, small, |s| {
                    s.increase(rest_size)
                });
                for_pool(&mut self.stats.inactive_split, small, |s| s.increase(1));
            }
            id = front_id;
        } else if already_split && !found.expandable {
            for_pool(&mut self.stats.inactive_split_bytes, small, |s| {
                s.decrease(found.size)
            });
            for_pool(&mut self.stats.inactive_split, small, |s| s.decrease(1));
        }
        let block = self.blocks.get_mut(id);
        block.state = BlockState::Allocated;
        block.requested = requested;
        let (addr, bsize, stream, pool) = (block.addr, block.size, block.stream, block.pool);
        self.active.insert(addr, id);
        let owner = self.owner_of(pool);
        self.count_allocated(pool, small, bsize, requested);
        let oversize = bsize >= self.config.max_split_size;
        if oversize {
            self.stats.oversize_allocations.increase(1);
        }
        self.record_in(TraceAction::Alloc, addr, requested, stream.raw, Some(pool));
        Allocation {
            ptr: DevicePtr(addr),
            size: requested,
            block_size: bsize,
            stream,
            small_pool: small,
            oversize,
            pool: owner,
        }
    }

    /// Counts a block of `bsize` bytes of block pool `pool` (`small`: its small pool) made
    /// allocated for `requested` bytes: in its private pool's usage and in the device's
    /// statistics. Every way a block becomes allocated (a malloc, a recorded block adopted, a
    /// restored one) counts it here.
    pub(crate) fn count_allocated(&mut self, pool: usize, small: bool, bsize: u64, requested: u64) {
        if let Some(u) = self.usage_mut(pool) {
            for_pool(&mut u.allocated, small, |s| s.increase(bsize));
        }
        for_pool(&mut self.stats.allocation, small, |s| s.increase(1));
        for_pool(&mut self.stats.allocated_bytes, small, |s| {
            s.increase(bsize)
        });
        for_pool(&mut self.stats.active, small, |s| s.increase(1));
        for_pool(&mut self.stats.active_bytes, small, |s| s.increase(bsize));
        for_pool(&mut self.stats.requested_bytes, small, |s| {
            s.increase(requested)
        });
    }

    /// Takes a segment at `addr` into the books: its metadata, the bytes reserved, and the
    /// segment in its private pool's usage and the device's statistics (a new segment and a
    /// restored one alike; a new one also counts a device allocation, its caller's part).
    pub(crate) fn book_segment(&mut self, addr: u64, meta: SegmentMeta) {
        let (size, pool) = (meta.size, meta.pool);
        self.segments.insert(addr, meta);
        self.total_reserved += size;
        let small = self.pools[pool].is_small;
        for_pool(&mut self.stats.segment, small, |s| s.increase(1));
        for_pool(&mut self.stats.reserved_bytes, small, |s| s.increase(size));
        if let Some(u) = self.usage_mut(pool) {
            for_pool(&mut u.segments, small, |s| s.increase(1));
            for_pool(&mut u.reserved, small, |s| s.increase(size));
        }
        if size >= self.config.max_split_size {
            self.stats.oversize_segments.increase(1);
        }
    }

    // ---- free and record_stream ----

    /// Marks live allocation `ptr` as exported to another process (the facade's
    /// `export_region` does, for every region it describes) until it is freed: a named pool
    /// holding one cannot sleep ([`AllocError::PoolExported`]), since the importer maps the
    /// pool's physical pages, which a sleep releases and a wake replaces with others.
    pub fn mark_exported(&mut self, ptr: DevicePtr) -> Result<(), AllocError> {
        if !self.active.contains_key(&ptr.0) {
            return Err(AllocError::UnknownPointer(ptr));
        }
        self.exported.insert(ptr.0);
        Ok(())
    }

    /// Undoes [`DeviceCore::mark_exported`] for live allocation `ptr` (a region described but
    /// never shared): its pool may sleep again. False when it was not marked.
    pub fn unmark_exported(&mut self, ptr: DevicePtr) -> Result<bool, AllocError> {
        if !self.active.contains_key(&ptr.0) {
            return Err(AllocError::UnknownPointer(ptr));
        }
        Ok(self.exported.remove(&ptr.0))
    }

    /// Frees an allocation. If other streams used it (`record_stream`), it returns to the pool
    /// only once events recorded on those streams now have completed. Freeing null is a no-op.
    pub fn free(&mut self, ptr: DevicePtr) -> Result<(), AllocError> {
        if ptr.0 == 0 {
            return Ok(());
        }
        let Some(id) = self.active.remove(&ptr.0) else {
            return Err(AllocError::UnknownPointer(ptr));
        };
        if !self.exported.is_empty() {
            self.exported.remove(&ptr.0);
        }
        let block = self.blocks.get_mut(id);
        block.state = BlockState::Pending;
        let (size, requested, stream, pool) =
            (block.size, block.requested, block.stream, block.pool);
        let has_uses = !block.stream_uses.is_empty();
        let small = self.pools[pool].is_small;
        for_pool(&mut self.stats.allocation, small, |s| s.decrease(1));
        for_pool(&mut self.stats.allocated_bytes, small, |s| s.decrease(size));
        if let Some(u) = self.usage_mut(pool) {
            for_pool(&mut u.allocated, small, |s| s.decrease(size));
        }
        self.record(TraceAction::FreeRequested, ptr.0, requested, stream.raw);
        if size >= self.config.max_split_size {
            self.stats.oversize_allocations.decrease(1);
        }
        if self.config.debug_cross_stream_frees
            && self
                .cross_stream
                .check_free(self.backend.as_ref(), self.blocks.get(id))
        {
            self.stats.num_cross_stream_frees += 1;
        }
        if has_uses {
            self.insert_events(id);
        } else {
            self.free_block(id);
        }
        Ok(())
    }

    /// Marks `ptr` as used on `stream` (PyTorch's `recordStream`): its free will wait for
    /// the work queued on `stream` at free time. Uses on the allocation stream are ignored.
    pub fn record_stream(
        &mut self,
        ptr: DevicePtr,
        stream: StreamHandle,
    ) -> Result<(), AllocError> {
        if self.shut_down {
            return Err(AllocError::Shutdown);
        }
        let Some(&id) = self.active.get(&ptr.0) else {
            return Err(AllocError::UnknownPointer(ptr));
        };
        let block = self.blocks.get_mut(id);
        if stream != block.stream && !block.stream_uses.contains(&stream) {
            block.stream_uses.push(stream);
        }
        Ok(())
    }

    /// The allocation at `ptr`, if it is live.
    pub fn allocation(&self, ptr: DevicePtr) -> Option<Allocation> {
        self.active.get(&ptr.0).map(|&id| {
            let b = self.blocks.get(id);
            Allocation {
                ptr,
                size: b.requested,
                block_size: b.size,
                stream: b.stream,
                small_pool: self.pools[b.pool].is_small,
                oversize: b.size >= self.config.max_split_size,
                pool: self.owner_of(b.pool),
            }
        })
    }
}

/// Result of the cache-only half of malloc.
pub enum CachedOutcome {
    /// Served from the cache.
    Hit(Allocation),
    /// A segment must be allocated.
    Miss(SegmentRequest),
}

/// A miss waiting for a segment (see [`DeviceCore::try_cached`]).
pub struct SegmentRequest {
    pub(crate) params: AllocParams,
    pub(crate) size: u64,
}

impl SegmentRequest {
    /// Marks the request as one its owner retries: an out-of-memory error it ends in is
    /// returned but not counted (`num_ooms`), recorded (`oom` history entry) or logged; the
    /// owner calls [`DeviceCore::count_oom`] for the failure its user sees. Retries made with
    /// [`DeviceCore::retry_cached`] keep the mark.
    pub fn quiet_oom(&mut self) {
        self.params.quiet_oom = true;
    }

    /// Bytes of the segment to allocate.
    pub fn alloc_size(&self) -> u64 {
        self.params.alloc_size
    }

    /// Bytes the user asked for.
    pub fn requested(&self) -> u64 {
        self.size
    }

    /// True when a segment of this size fits under `per_process_memory_fraction` right now,
    /// counting memory being obtained off the core (`DeviceCore::growing_bytes`).
    pub fn fits_fraction(&self, core: &DeviceCore) -> bool {
        core.allowed_max.is_none_or(|max| {
            core.total_reserved
                .saturating_add(core.growing_bytes)
                .saturating_add(self.params.alloc_size)
                <= max
        }) && core.quota_error(&self.params, self.size).is_none()
    }

    /// True when the request is served by mapping pages of an expandable segment (the
    /// default pools and named pools with `expandable_segments`); false when it needs a whole
    /// segment from the device's malloc (ordinary segments, and PyTorch's unnamed private
    /// pools, which never expand).
    pub fn maps_pages(&self, core: &DeviceCore) -> bool {
        core.pool_expands(self.params.pool)
    }

    /// [`SegmentRequest::fits_fraction`], and if it fits, counts the segment as being
    /// allocated off the core until [`DeviceCore::malloc_with_segment`] adopts it or
    /// [`DeviceCore::segment_not_obtained`] says it failed: every check (this one, the core's
    /// own chain, expandable growth) counts it against `per_process_memory_fraction`, so
    /// concurrent misses off the core cannot overshoot the cap together.
    pub fn claim_fraction(&self, core: &mut DeviceCore) -> bool {
        let fits = self.fits_fraction(core);
        if fits {
            core.growing_bytes += self.params.alloc_size;
            core.claim_for_pool(self.params.pool, self.params.alloc_size, true);
        }
        fits
    }
}
