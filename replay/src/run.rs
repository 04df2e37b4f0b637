//! The replay loop: a trace's events through a `DeviceCore` on the accounting backend.
//!
//! - `alloc` → `malloc(size, stream)` (the trace's stream ids are the stream handles, so
//!   blocks are ordered by the same stream values PyTorch saw);
//! - `free_requested` → `free`; when the trace shows the block waited for other streams
//!   (its `free_completed` comes later), the replay records a use on a private stream first
//!   and completes that stream's event at the `free_completed`;
//! - a run of `segment_free` (or, with expandable segments, `segment_unmap`) events is the
//!   program calling `empty_cache()`: the replay does too;
//! - `free_completed` of a still-live address (RMM logs have no `free_requested`) frees it.
//!
//! Cold replay starts from nothing but the allocations alive at the start, allocated first,
//! largest first (ties by address). The order they were really made in is not in the trace;
//! largest first is best fit's tightest packing of them, so the cold figures never blame the
//! config for a layout the recording does not show. (Address order, tried on the three
//! snapshots in shared/traces, gives the same peaks.) Warm replay (`ReplayOptions::warm`) rebuilds PyTorch's state when recording
//! began — its segments at their real addresses, live blocks in them, the rest free — places
//! each new segment at the address of PyTorch's pending `segment_alloc` of the same size, and
//! compares every allocation's address with PyTorch's. It also follows a history recorded by
//! gpualloc's actor, which obtains segments and pages off its lock while other requests go on
//! (`gpualloc_devices` `recorded/`): an `alloc` right after the `segment_alloc` of the segment
//! holding it is served by that new segment without a cache lookup, and a `segment_map` inside
//! a reservation maps its pages at once, so the `alloc` that follows weighs them against the
//! blocks freed meanwhile, as the live request did. The expandable segments held when
//! recording began are restored as reservations (`analysis::reservations`), their mapped runs
//! and live blocks in them, and a reservation the history starts later is made where its
//! pages lie when it maps the first (a reservation released, its last page unmapped, and
//! made again later is two, possibly at the same addresses under another stream).
//!
//! Named pools (gpualloc_devices' `pools/`): the history names the pool of each `alloc` and
//! segment event (`segment_pool_id`); the replay makes a named pool per id, restores its
//! segments in it and serves its requests from it. A pool's sleep shows as a
//! `segment_unmap` of pages live blocks are on (the replay sleeps the pool there), its wake as
//! the `segment_map`s that follow (the replay wakes it at the first).

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use gpualloc_accounting::AccountingBackend;
use gpualloc_devices::sizes::{allocation_size, round_size};
use gpualloc_devices::{
    map_wake, release_slept_pages, wait_for_pool_streams, AllocError, Allocation, AllocatorConfig,
    DeviceCore, MemPoolId, Policy, PoolInfo, PoolOptions, PoolState, RecordedHandles, RestorePool,
    RestoredBlock, SegmentRequest, SleepMode,
};
use gpualloc_runtime::addr_map::AddrMap;
use gpualloc_runtime::{Backend, DeviceId, DevicePtr, StreamHandle};
use gpualloc_trace::Action;

use crate::analysis::{
    deferred_frees, event_pool, live_at_start, reservations, start_blocks, start_segments,
    torch_figures, torch_reserved_after, LiveAtStart, PoolKey, Reservation, StartSegment,
    DEFAULT_POOL,
};
use crate::input::Trace;
use crate::recorded_miss::malloc_with_new_segment;
use crate::report::{Mismatch, ReplayReport, Sample, Served};

/// A link of the miss chain a replay applies to the block the history names
/// (`DeviceCore::malloc_borrowed`, `DeviceCore::malloc_spilled`).
type RecordedLink = fn(&mut DeviceCore, SegmentRequest, u64) -> Result<Allocation, SegmentRequest>;

/// Why a replay could not run.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    /// Reading the file failed.
    #[error("cannot read {0}: {1}")]
    Io(String, String),
    /// The file is not a trace we can read.
    #[error("{0}")]
    Format(String),
    /// The trace parser refused the file.
    #[error("{file}: {source}")]
    Parse {
        /// The file (its name).
        file: String,
        /// What the parser said.
        #[source]
        source: gpualloc_trace::TraceError,
    },
    /// The allocator failed with something other than out-of-memory.
    #[error("allocator error at event {index}: {source}")]
    Alloc {
        /// Event index.
        index: usize,
        /// The error.
        source: gpualloc_devices::AllocError,
    },
    /// Warm replay needs the snapshot's segment list.
    #[error("{0}: warm replay needs a snapshot with segments")]
    NoSegments(String),
}

/// How to replay.
#[derive(Debug, Clone)]
pub struct ReplayOptions {
    /// The allocator config under test; its `policy` says whose rules answer.
    /// [`ReplayOptions::default`] sets PyTorch's (the question the tool answers is "what would
    /// PyTorch do?"), while `AllocatorConfig::default()` alone is gpualloc's.
    pub config: AllocatorConfig,
    /// Start from PyTorch's recorded state and compare addresses.
    pub warm: bool,
    /// Device capacity in bytes (None: effectively unlimited, 1 TiB).
    pub capacity: Option<u64>,
    /// Keep a memory-over-time sample every this many events (0: none).
    pub sample_every: usize,
    /// Called with (events done, total) every 4096 events.
    pub progress: Option<fn(u64, u64)>,
    /// Called on the core before the replay starts (tests use it to break a rule on purpose).
    pub core_hook: Option<fn(&mut DeviceCore)>,
    /// Record the replay's own history in the core (from the first event on, stamped with
    /// the trace's `time_us`, or the event index where it has none), for an export that
    /// PyTorch's memory viewer opens (`replay --export-viz`).
    pub record_history: bool,
    /// Cold replay: new segments at the highest free address first, as CUDA's driver handed
    /// out most of them in the shared traces, instead of the lowest first (the default).
    /// Best fit breaks ties between equal free blocks by address, so the order can decide
    /// which block a request takes: cold qwen2-7b-layerwise-calib peaks at PyTorch's recorded
    /// 5.40 GiB top-down and at 5.79 GiB bottom-up. A warm replay places every segment
    /// at PyTorch's address and is not affected.
    pub top_down: bool,
    /// Where the free memory sits when reserved memory first reaches its peak
    /// ([`crate::waste::Waste`], `replay --waste`): a snapshot at every new peak, so off by
    /// default.
    pub waste_at_peak: bool,
}

impl Default for ReplayOptions {
    fn default() -> Self {
        ReplayOptions {
            config: AllocatorConfig::default().with_policy(Policy::Pytorch),
            warm: false,
            capacity: None,
            sample_every: 0,
            progress: None,
            core_hook: None,
            record_history: false,
            top_down: false,
            waste_at_peak: false,
        }
    }
}

const PRIVATE_STREAM_BASE: u64 = 0xFFFF_0000_0000_0000;
const DEVICE: DeviceId = DeviceId(0);

struct Replayer {
    backend: Arc<AccountingBackend>,
    core: DeviceCore,
    streams: AddrMap<StreamHandle>,
    /// PyTorch address → ours.
    addrs: AddrMap<DevicePtr>,
    /// PyTorch address → private stream of a deferred free.
    deferred: AddrMap<StreamHandle>,
    next_private: u64,
    warnings: u64,
    /// The history's private pools (`segment_pool_id`) → the replay's named pools.
    pools: HashMap<PoolKey, MemPoolId>,
    /// The private pools the recording describes (`Trace::pools`).
    recorded_pools: Vec<PoolInfo>,
}

impl Replayer {
    /// The replay's pool for the history's pool `id`, made at its first use (`None`: the
    /// default pools): as the recording describes it (`Trace::pools`: its name, quota,
    /// `use_on_oom`, unsplit blocks, and whether it was a named pool or PyTorch's unnamed
    /// kind), else a named pool without a quota, as gpualloc's are.
    fn pool(&mut self, id: PoolKey) -> Option<MemPoolId> {
        if id == DEFAULT_POOL {
            return None;
        }
        let (core, recorded) = (&mut self.core, &self.recorded_pools);
        Some(*self.pools.entry(id).or_insert_with(|| {
            match recorded.iter().find(|p| (0, p.id as i64) == id) {
                Some(p) if !p.named => core.create_pool(p.options.use_on_oom),
                Some(p) => core.create_named_pool(&p.name, p.options.clone()),
                None => core.create_named_pool(&format!("pool {id:?}"), PoolOptions::default()),
            }
        }))
    }

    /// A malloc of `size` bytes in `pool` (`None`: the default pools).
    fn malloc_in(
        &mut self,
        pool: Option<MemPoolId>,
        size: u64,
        stream: StreamHandle,
    ) -> Result<Allocation, AllocError> {
        match pool {
            Some(p) => self.core.malloc_in(p, size, stream),
            None => self.core.malloc(size, stream),
        }
    }

    /// A pool's sleep, shown in the history as a `segment_unmap` of pages its live blocks are
    /// on (`gpualloc_devices` `sleep.rs`: every page of the pool goes at once, its blocks
    /// stay allocated). The replay's events complete as the sleep waits for them.
    fn sleep(&mut self, pool: MemPoolId) -> Result<(), AllocError> {
        let plan = self.core.begin_sleep(pool, SleepMode::Discard)?;
        if let Err(e) = wait_for_pool_streams(self.backend.as_ref(), &plan) {
            self.core.abort_sleep(plan).release(self.backend.as_ref());
            return Err(e.into());
        }
        release_slept_pages(self.backend.as_ref(), &plan);
        self.core.finish_sleep(plan).release(self.backend.as_ref());
        Ok(())
    }

    /// A sleeping pool's wake, shown as the `segment_map`s of its pages: the first wakes it
    /// (every page at once), the rest find their pages mapped. `Ok(false)`: no room for its
    /// pages (the device or the memory-fraction cap is full); it stays asleep.
    fn wake(&mut self, pool: MemPoolId) -> Result<bool, AllocError> {
        let plan = match self.core.begin_wake(pool) {
            Ok(Some(plan)) => plan,
            Ok(None) => return Ok(true),
            Err(e) if e.is_oom() => return Ok(false),
            Err(e) => return Err(e),
        };
        match map_wake(self.backend.as_ref(), &plan) {
            Ok(woken) => {
                self.core
                    .finish_wake(plan, woken)
                    .release(self.backend.as_ref());
                Ok(true)
            }
            Err(e) => {
                self.core.abort_wake(plan).release(self.backend.as_ref());
                if e.is_oom() {
                    Ok(false)
                } else {
                    Err(e.into())
                }
            }
        }
    }

    /// True when a block the history has live lies in `[addr, addr + len)`.
    fn live_in(&self, addr: u64, len: u64) -> bool {
        self.addrs.keys().any(|&a| a >= addr && a - addr < len)
    }

    fn stream(&mut self, raw: u64) -> StreamHandle {
        if let Some(s) = self.streams.get(&raw) {
            return *s;
        }
        let s = self
            .backend
            .register_stream(DEVICE, raw)
            .unwrap_or(StreamHandle {
                device: DEVICE,
                raw,
            });
        self.streams.insert(raw, s);
        s
    }

    /// A malloc that a new ordinary segment served in the history: the miss chain's third
    /// driver (`recorded_miss.rs`), or an ordinary malloc where the config maps pages.
    fn malloc_new_segment(
        &mut self,
        pool: Option<MemPoolId>,
        size: u64,
        stream: StreamHandle,
    ) -> Result<Allocation, AllocError> {
        match malloc_with_new_segment(&mut self.core, pool, size, stream)? {
            Some(a) => Ok(a),
            None => self.malloc_in(pool, size, stream),
        }
    }

    /// A malloc the history shows served by a block the policy passes over (its segment
    /// could not grow right then: `TraceEntry::passed_over`): best fit with any remainder
    /// first, as the live request's last step was; a miss as usual if nothing fits
    /// (`recorded_miss.rs` says why this link is applied directly).
    fn malloc_passed_over(
        &mut self,
        pool: Option<MemPoolId>,
        size: u64,
        stream: StreamHandle,
    ) -> Result<Allocation, AllocError> {
        let request = self.core.segment_request_in(pool, size, stream)?;
        match self.core.malloc_passed_over(request) {
            Ok(a) => Ok(a),
            Err(request) => self.core.malloc_after_miss(request),
        }
    }

    /// A malloc the history shows served by one link of the chain from the free block at
    /// `addr`: a loan of another stream's block (`TraceEntry::borrowed`,
    /// `DeviceCore::malloc_borrowed`) or the spill into the large pool
    /// (`TraceEntry::spilled`, `DeviceCore::malloc_spilled`). The same link, or, where that
    /// block is not free here, an ordinary malloc (`recorded_miss.rs` says why these links
    /// are applied directly).
    fn malloc_by_link(
        &mut self,
        link: RecordedLink,
        pool: Option<MemPoolId>,
        size: u64,
        stream: StreamHandle,
        addr: u64,
    ) -> Result<Allocation, AllocError> {
        let request = self.core.segment_request_in(pool, size, stream)?;
        match link(&mut self.core, request, addr) {
            Ok(a) => Ok(a),
            Err(_) => self.malloc_in(pool, size, stream),
        }
    }

    /// Makes reservation `res` at its base, with the start segments `inside` it (its mapped
    /// runs, none when the history maps its first page at event `index`) and their live
    /// blocks; returns how many live blocks it placed.
    fn restore_reservation(
        &mut self,
        res: &Reservation,
        inside: &[&StartSegment],
        initial: &[LiveAtStart],
        index: usize,
    ) -> Result<usize, ReplayError> {
        // Runs side by side are one mapped stretch: a block may cross from one to the next.
        let mut stretches: Vec<StartSegment> = Vec::new();
        for s in inside {
            match stretches.last_mut() {
                Some(last) if last.addr + last.size == s.addr => last.size += s.size,
                _ => stretches.push(**s),
            }
        }
        let runs: Vec<(u64, u64)> = inside.iter().map(|s| (s.addr, s.size)).collect();
        let blocks: Vec<RestoredBlock> = stretches
            .iter()
            .flat_map(|s| start_blocks(s, initial, true))
            .collect();
        let stream = self.stream(res.stream);
        let target = RestorePool {
            private: self.pool(res.pool),
            small: res.small,
        };
        self.backend.place_next(DEVICE, res.base);
        let restored = self
            .core
            .restore_expandable(res.base, res.size, stream, target, &runs, &blocks);
        self.backend.clear_placement(DEVICE);
        let base = restored.map_err(|source| ReplayError::Alloc { index, source })?;
        for b in &blocks {
            self.addrs
                .insert(b.addr, DevicePtr(b.addr - res.base + base.0));
        }
        Ok(blocks.len())
    }

    /// Warm: PyTorch's state when recording began, its segments at their addresses with the
    /// blocks alive in them (and, for a history of expandable segments, its reservations with
    /// their mapped runs). Returns the reservations planned (see `analysis::reservations`);
    /// allocations alive at the start that nothing holds count as warnings.
    fn start_warm(
        &mut self,
        trace: &Trace,
        initial: &[LiveAtStart],
        capacity: u64,
    ) -> Result<Vec<Reservation>, ReplayError> {
        let mut plan: Vec<Reservation> = Vec::new();
        // A snapshot that records no segment at all (none at the end, no segment events: a
        // CPU profiler's recording) cannot say where anything was, like a log without
        // segments.
        let segments = start_segments(trace)
            .filter(|s| !s.is_empty() || trace.events.iter().any(|e| e.action.changes_segments()))
            .ok_or_else(|| ReplayError::NoSegments(trace.name.clone()))?;
        let mut placed = 0usize;
        if self.core.config().expandable_segments && records_pages(trace) {
            plan = reservations(trace, &segments, capacity + capacity / 8);
            for res in &plan {
                // Those with no page mapped yet are made at their first `segment_map`.
                let inside: Vec<&StartSegment> = segments.iter().filter(|s| res.holds(s)).collect();
                if !inside.is_empty() {
                    placed += self.restore_reservation(res, &inside, initial, 0)?;
                }
            }
        }
        for seg in segments.iter().filter(|_| plan.is_empty()) {
            let blocks = start_blocks(seg, initial, false);
            let stream = self.stream(seg.stream);
            let target = RestorePool {
                private: self.pool(seg.pool),
                small: seg.small,
            };
            self.backend.place_next(DEVICE, seg.addr);
            let base = self
                .core
                .restore_segment(seg.addr, seg.size, stream, target, &blocks)
                .map_err(|source| ReplayError::Alloc { index: 0, source })?;
            for b in &blocks {
                self.addrs
                    .insert(b.addr, DevicePtr(b.addr - seg.addr + base.0));
            }
            placed += blocks.len();
        }
        self.warnings += (initial.len() - placed) as u64;
        Ok(plan)
    }

    /// Cold: the allocations alive at the start, allocated largest first.
    fn start_cold(&mut self, initial: &[LiveAtStart]) -> Result<(), ReplayError> {
        // Largest first: the tightest packing of what was alive before recording began.
        let mut order: Vec<_> = initial.iter().collect();
        order.sort_by_key(|l| (std::cmp::Reverse(l.requested), l.addr));
        for l in order {
            let s = self.stream(l.stream);
            let pool = self.pool(l.pool);
            match self.malloc_in(pool, l.requested, s) {
                Ok(a) => {
                    self.addrs.insert(l.addr, a.ptr);
                }
                Err(e) if e.is_oom() => self.warnings += 1,
                Err(source) => return Err(ReplayError::Alloc { index: 0, source }),
            }
        }
        Ok(())
    }

    /// The trace's `alloc` at `i`: a malloc (as the history shows its miss, warm), its
    /// address compared with PyTorch's (warm: `compared` counts (matched, compared); the
    /// first mismatch goes in the report), and placed where PyTorch's pending
    /// `segment_alloc` of its size put a new segment.
    fn alloc(
        &mut self,
        trace: &Trace,
        i: usize,
        options: &ReplayOptions,
        pending_segments: &mut HashMap<u64, VecDeque<u64>>,
        report: &mut ReplayReport,
        compared: &mut (u64, u64),
    ) -> Result<(), ReplayError> {
        let e = &trace.events[i];
        if self.addrs.contains_key(&e.addr) {
            // An address allocated twice without a free between: PyTorch's viewer
            // takes the first as freed; so does the replay, and counts a warning.
            self.warnings += 1;
            self.free(e.addr, false);
        }
        let stream = self.stream(e.stream);
        let pool = self.pool(event_pool(e));
        // Warm: place a new segment where PyTorch's pending segment_alloc of the same
        // size put it. Cold replays skip this bookkeeping (and its backend locks).
        let placement = if pending_segments.is_empty() {
            None
        } else {
            round_size(e.size, &options.config)
                .and_then(|rounded| allocation_size(rounded, &options.config))
                .and_then(|size| {
                    pending_segments
                        .get(&size)
                        .and_then(|q| q.front().copied())
                        .map(|a| (size, a))
                })
        };
        let mallocs_before = if options.warm {
            self.backend.counts().mallocs
        } else {
            0
        };
        // A new ordinary segment goes where PyTorch's was.
        let want = placement.map(|(_, addr)| addr);
        if let Some(addr) = want {
            self.backend.place_next(DEVICE, addr);
        }
        let result = if options.warm && served_by_new_segment(trace, i) {
            self.malloc_new_segment(pool, e.size, stream)
        } else if options.warm && e.passed_over {
            self.malloc_passed_over(pool, e.size, stream)
        } else if options.warm && e.borrowed {
            self.malloc_by_link(DeviceCore::malloc_borrowed, pool, e.size, stream, e.addr)
        } else if options.warm && e.spilled {
            self.malloc_by_link(DeviceCore::malloc_spilled, pool, e.size, stream, e.addr)
        } else {
            self.malloc_in(pool, e.size, stream)
        };
        let mut new_segment = false;
        if options.warm {
            new_segment = self.backend.counts().mallocs > mallocs_before;
        }
        if want.is_some() {
            self.backend.clear_placement(DEVICE);
        }
        if let Some((size, _)) = placement {
            if new_segment {
                if let Some(q) = pending_segments.get_mut(&size) {
                    q.pop_front();
                    if q.is_empty() {
                        pending_segments.remove(&size);
                    }
                }
            }
        }
        match result {
            Ok(a) => {
                if options.warm {
                    compared.1 += 1;
                    if a.ptr.0 == e.addr {
                        compared.0 += 1;
                    } else if report.first_mismatch.is_none() {
                        let torch_side = if served_by_new_segment(trace, i) {
                            Served::NewSegment
                        } else if e.borrowed {
                            Served::Loan
                        } else {
                            Served::Cached
                        };
                        let our_side = if new_segment {
                            Served::NewSegment
                        } else {
                            Served::Cached
                        };
                        report.first_mismatch = Some(Mismatch::describe(
                            i,
                            e.size,
                            a.ptr.0,
                            e.addr,
                            our_side,
                            torch_side,
                            a.block_size,
                        ));
                    }
                }
                self.addrs.insert(e.addr, a.ptr);
            }
            Err(err) if err.is_oom() => {}
            Err(source) => return Err(ReplayError::Alloc { index: i, source }),
        }
        Ok(())
    }

    fn free(&mut self, torch_addr: u64, deferred: bool) {
        let Some(ptr) = self.addrs.remove(&torch_addr) else {
            self.warnings += 1;
            return;
        };
        if deferred {
            let raw = PRIVATE_STREAM_BASE + self.next_private;
            self.next_private += 1;
            let s = self.stream(raw);
            if self.core.record_stream(ptr, s).is_ok() {
                self.deferred.insert(torch_addr, s);
            }
        }
        // The stream the trace freed it on (a lent block's borrower: `streams/loans.rs` in
        // `gpualloc_devices`).
        let stream = self.core.allocation(ptr).map(|a| a.stream);
        if self.core.free(ptr).is_err() {
            self.warnings += 1;
        }
        // The replay runs no work: what the freeing stream queued is done by its free. Only a
        // lent block's return waits for an event on a stream of the trace (deferred frees
        // wait on streams of their own, above); the next request finds it back.
        if let Some(s) = stream {
            self.backend.complete_stream(s);
        }
    }
}

/// True when the trace maps or unmaps pages, or ends with expandable segments.
fn records_pages(trace: &Trace) -> bool {
    trace
        .events
        .iter()
        .any(|e| matches!(e.action, Action::SegmentMap | Action::SegmentUnmap))
        || trace.final_segments.iter().flatten().any(|s| s.expandable)
}

/// True when the history shows `alloc` event `i` served by the ordinary segment allocated
/// right before it, frees aside: a free recorded while the request's segment was obtained off
/// the core can land between the two (`serve` with `expandable_segments:False`: 39.98% of a
/// device's addresses before they were passed over), and the live request adopted its segment
/// whatever was freed meanwhile.
fn served_by_new_segment(trace: &Trace, i: usize) -> bool {
    let e = &trace.events[i];
    trace.events[..i]
        .iter()
        .rev()
        .find(|p| !matches!(p.action, Action::FreeRequested | Action::FreeCompleted))
        .is_some_and(|s| {
            s.action == Action::SegmentAlloc && s.addr <= e.addr && e.addr - s.addr < s.size
        })
}

/// Replays `trace` under `options`.
pub fn replay(trace: &Trace, options: &ReplayOptions) -> Result<ReplayReport, ReplayError> {
    replay_core(trace, options).map(|(report, _)| report)
}

/// Replays `trace` under `options` and hands back the core in its final state too (its
/// statistics cover the whole replay: `summary` prints them).
pub fn replay_core(
    trace: &Trace,
    options: &ReplayOptions,
) -> Result<(ReplayReport, DeviceCore), ReplayError> {
    let capacity = options.capacity.unwrap_or(1 << 40);
    // Events complete where the history says (`free_completed`), not at a segment's free.
    let mut backend = AccountingBackend::manual_events(1, capacity).free_does_not_synchronize();
    if options.top_down {
        backend = backend.highest_address_first();
    }
    let backend = Arc::new(backend);
    let dynb: Arc<dyn Backend> = backend.clone();
    // As the allocator runs it: the accounting backend has virtual memory.
    let mut core = DeviceCore::new(dynb, DEVICE, options.config.resolved(true))
        .map_err(|source| ReplayError::Alloc { index: 0, source })?;
    if let Some(hook) = options.core_hook {
        hook(&mut core);
    }
    // A history recorded under a policy that lends marks its loans (`gpualloc_borrowed`), and
    // one under a policy that spills small requests into the large pool its spills
    // (`gpualloc_spilled`): a warm replay lends and spills there and nowhere else (what
    // decided them live is not in the history).
    if let Some(recorded) = trace.recorded_config.as_ref().filter(|_| options.warm) {
        core.lend_as_recorded(recorded.policy.lends_across_streams());
        core.spill_as_recorded(recorded.policy.spills_small_requests());
    }
    let mut r = Replayer {
        backend,
        core,
        streams: AddrMap::default(),
        addrs: AddrMap::default(),
        deferred: AddrMap::default(),
        next_private: 0,
        warnings: 0,
        pools: HashMap::new(),
        recorded_pools: trace.pools.clone(),
    };
    let (initial, unexplained) = live_at_start(trace);
    r.warnings += unexplained;
    let torch = torch_figures(trace, &initial);
    // Warm, expandable history: the reservations to make (see `analysis::reservations`).
    let reservations_plan = if options.warm {
        r.start_warm(trace, &initial, capacity)?
    } else {
        r.start_cold(&initial)?;
        Vec::new()
    };

    // A warm replay's start state is the recording's, not the replay's: its pages are not
    // counted. (A cold replay counts what it allocated for the allocations alive at the
    // start: its own layout of them.)
    let baseline = if options.warm {
        (r.backend.counts().maps, r.core.stats().num_device_alloc)
    } else {
        (0, 0)
    };
    let deferred = deferred_frees(trace);
    // Warm: PyTorch's segment_alloc addresses not yet used, per size.
    let mut pending_segments: HashMap<u64, VecDeque<u64>> = HashMap::new();
    let mut report = ReplayReport::new(trace, options, torch);
    if options.record_history {
        // Every event the replay makes: at most one per trace event, plus the segment
        // events of a release.
        r.core.record_history(Some(2 * trace.events.len() + 1024));
    }
    // Warm: addresses that matched PyTorch's, and addresses compared.
    let mut compared = (0u64, 0u64);
    // PyTorch's own reserved bytes as the trace goes, for the plot's reference line.
    let mut torch_reserved = report.torch.start_reserved;
    let started = Instant::now();
    let total = trace.events.len() as u64;
    // The highest reserved memory so far (`waste_at_peak`).
    let mut peak_seen = 0u64;
    for (i, e) in trace.events.iter().enumerate() {
        if options.record_history {
            let at = e.time_us.and_then(|t| u64::try_from(t).ok());
            r.core.set_time_us(at.unwrap_or(i as u64));
        }
        match e.action {
            Action::SegmentMap if options.warm => {
                // A sleeping pool's first page back is its wake (which maps every page it
                // had: the `segment_map`s after it, and this one's own map below, find their
                // pages mapped and change nothing). A replay holding more memory than the
                // recording did may not have room: the pool stays asleep (a warning), and its
                // next page tries again.
                if let Some(pool) = r.pool(event_pool(e)) {
                    if r.core.pool_state(pool) == Some(PoolState::Asleep) {
                        let woken = r
                            .wake(pool)
                            .map_err(|source| ReplayError::Alloc { index: i, source })?;
                        if !woken {
                            r.warnings += 1;
                        }
                    }
                }
                // The first page of a reservation the history starts: the reservation first.
                if r.backend.reservation_holding(DEVICE, e.addr).is_none() {
                    let planned = reservations_plan.iter().find(|p| p.first_map == Some(i));
                    if let Some(res) = planned {
                        r.restore_reservation(res, &[], &[], i)?;
                    }
                }
                // Pages mapped for a request before it looked in the cache again: the blocks
                // freed meanwhile compete with them, as they did live. (Without expandable
                // segments in the config nothing is mapped.)
                r.core
                    .map_recorded_growth(
                        e.addr,
                        e.size,
                        RecordedHandles {
                            grouped_pages: e.grouped_pages,
                            single_pages: e.single_pages,
                        },
                    )
                    .map_err(|source| ReplayError::Alloc { index: i, source })?;
            }
            Action::SegmentMap => {}
            Action::SegmentAlloc => {
                if options.warm {
                    pending_segments
                        .entry(e.size)
                        .or_default()
                        .push_back(e.addr);
                }
            }
            Action::Alloc => r.alloc(
                trace,
                i,
                options,
                &mut pending_segments,
                &mut report,
                &mut compared,
            )?,
            Action::FreeRequested => r.free(e.addr, deferred.contains(&i)),
            Action::FreeCompleted => {
                if let Some(s) = r.deferred.remove(&e.addr) {
                    r.backend.complete_stream(s);
                    r.core
                        .process_events()
                        .map_err(|source| ReplayError::Alloc { index: i, source })?;
                } else if r.addrs.contains_key(&e.addr) {
                    // A log without free_requested (RMM): the free happens here.
                    r.free(e.addr, false);
                } else {
                    // A free whose events the replay completed at its `free_requested` (a lent
                    // block's return: its borrower's work is done there) lands here, where the
                    // history shows it back, before a `segment_unmap` or a loan that follows
                    // needs it free. Nothing pending: one test.
                    r.core
                        .process_events()
                        .map_err(|source| ReplayError::Alloc { index: i, source })?;
                }
            }
            Action::SegmentFree if options.warm => {
                // The segment the history released, not others: the release may have kept
                // segments with frees pending on stream events (`gpualloc_devices` `recorded/`). A segment
                // the replay does not have free there stays.
                r.core
                    .release_recorded_segment(e.addr)
                    .map_err(|source| ReplayError::Alloc { index: i, source })?;
            }
            Action::SegmentUnmap if options.warm && r.core.config().expandable_segments => {
                // Likewise the pages the history unmapped.
                let unmapped = r
                    .core
                    .unmap_recorded_pages(e.addr, e.size)
                    .map_err(|source| ReplayError::Alloc { index: i, source })?;
                // Pages under live blocks of a named pool that is awake: its sleep.
                if let Some(pool) = r.pool(event_pool(e)) {
                    let awake = r.core.pool_state(pool) == Some(PoolState::Awake);
                    if !unmapped && awake && r.live_in(e.addr, e.size) {
                        r.sleep(pool)
                            .map_err(|source| ReplayError::Alloc { index: i, source })?;
                    }
                }
            }
            Action::SegmentFree | Action::SegmentUnmap => {
                // Expandable segments' pages go back as `segment_unmap` runs.
                let run_start = i == 0 || !trace.events[i - 1].action.releases_memory();
                if run_start {
                    r.core
                        .empty_cache()
                        .map_err(|source| ReplayError::Alloc { index: i, source })?;
                }
            }
            Action::Oom | Action::Snapshot => {}
        }
        torch_reserved = torch_reserved.map(|t| torch_reserved_after(t, e));
        if options.waste_at_peak {
            let reserved = r.core.stats().reserved_bytes[0].current;
            if reserved > peak_seen {
                peak_seen = reserved;
                report.waste = Some(crate::waste::Waste::of(&r.core.snapshot(), i as u64));
            }
        }
        if options.sample_every > 0
            && (i % options.sample_every == 0 || i + 1 == trace.events.len())
        {
            let st = r.core.stats();
            report.samples.push(Sample {
                event: i as u64,
                time_us: e.time_us,
                reserved: st.reserved_bytes[0].current,
                allocated: st.allocated_bytes[0].current,
                torch_reserved,
            });
        }
        if let Some(progress) = options.progress {
            if i % 4096 == 0 {
                progress(i as u64, total);
            }
        }
    }
    let elapsed = started.elapsed().as_secs_f64();
    let st = r.core.stats();
    report.peak_reserved = st.reserved_bytes[0].peak;
    report.peak_allocated = st.allocated_bytes[0].peak;
    report.peak_requested = st.requested_bytes[0].peak;
    if let Some(w) = &mut report.waste {
        w.set_floors(
            st.allocated_bytes.all().peak,
            st.allocated_bytes.small().peak,
            st.allocated_bytes.large().peak,
        );
    }
    report.device_mallocs = st.num_device_alloc.saturating_sub(baseline.1);
    report.device_frees = st.num_device_free;
    let calls = r.backend.counts();
    report.page_maps = calls.maps.saturating_sub(baseline.0);
    report.page_unmaps = calls.unmaps;
    report.synchronizations = st.num_sync_all_streams;
    report.retries = st.num_alloc_retries;
    report.ooms = st.num_ooms;
    report.warnings = r.warnings;
    report.events_per_second = if elapsed > 0.0 {
        total as f64 / elapsed
    } else {
        f64::INFINITY
    };
    if options.warm {
        report.address_match = Some(compared);
    }
    Ok((report, r.core))
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpualloc_trace::TraceEntry;

    /// An `alloc` is served by the ordinary segment allocated before it (frees between aside)
    /// only where it lies inside that segment.
    #[test]
    fn an_alloc_is_served_by_the_new_segment_only_inside_it() {
        const MIB: u64 = 1 << 20;
        let base = 0x7000_0000_0000;
        let trace_with = |alloc_at: u64| Trace {
            name: "t".into(),
            device: 0,
            events: vec![
                TraceEntry::new(Action::SegmentAlloc, base, 20 * MIB, 7),
                TraceEntry::new(Action::FreeRequested, base - 4 * MIB, MIB, 7),
                TraceEntry::new(Action::FreeCompleted, base - 4 * MIB, MIB, 7),
                TraceEntry::new(Action::Alloc, alloc_at, MIB, 7),
            ],
            final_segments: None,
            recorded_config: None,
            pools: Vec::new(),
        };
        let served = |at: u64| served_by_new_segment(&trace_with(at), 3);
        assert!(served(base));
        assert!(served(base + 19 * MIB));
        assert!(!served(base + 20 * MIB), "the segment's end is outside it");
        assert!(!served(base + 21 * MIB));
        assert!(!served(base - 2 * MIB));
        // Another alloc between: not the new segment's request.
        let mut t = trace_with(base);
        t.events
            .insert(3, TraceEntry::new(Action::Alloc, base - 4 * MIB, MIB, 7));
        assert!(!served_by_new_segment(&t, 4));
    }
}
