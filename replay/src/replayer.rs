//! The replayer: the state a replay carries through a trace (the core on the accounting
//! backend, the trace's streams and addresses mapped to the replay's, its named pools) and
//! what it does for each kind of event (`run.rs` drives it event by event).

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use gpualloc_accounting::AccountingBackend;
use gpualloc_devices::sizes::{allocation_size, round_size};
use gpualloc_devices::{
    map_wake, release_slept_pages, wait_for_pool_streams, AllocError, Allocation, DeviceCore,
    MemPoolId, PoolInfo, PoolOptions, RestorePool, RestoredBlock, SegmentRequest, SleepMode,
};
use gpualloc_runtime::addr_map::AddrMap;
use gpualloc_runtime::{DeviceId, DevicePtr, StreamHandle};
use gpualloc_trace::Action;

use crate::analysis::{
    event_pool, reservations, start_blocks, start_segments, LiveAtStart, PoolKey, Reservation,
    StartSegment, DEFAULT_POOL,
};
use crate::input::Trace;
use crate::recorded_miss::malloc_with_new_segment;
use crate::report::{Mismatch, ReplayReport, Served};
use crate::run::{ReplayError, ReplayOptions};

/// A link of the miss chain a replay applies to the block the history names
/// (`DeviceCore::malloc_borrowed`, `DeviceCore::malloc_spilled`).
type RecordedLink = fn(&mut DeviceCore, SegmentRequest, u64) -> Result<Allocation, SegmentRequest>;

/// The first raw handle of the private streams a replay makes for deferred frees.
const PRIVATE_STREAM_BASE: u64 = 0xFFFF_0000_0000_0000;
/// The device a replay runs on.
pub(crate) const DEVICE: DeviceId = DeviceId(0);

/// A replay in progress (see the module docs).
pub(crate) struct Replayer {
    pub(crate) backend: Arc<AccountingBackend>,
    pub(crate) core: DeviceCore,
    streams: AddrMap<StreamHandle>,
    /// PyTorch address → ours.
    pub(crate) addrs: AddrMap<DevicePtr>,
    /// PyTorch address → private stream of a deferred free.
    pub(crate) deferred: AddrMap<StreamHandle>,
    next_private: u64,
    pub(crate) warnings: u64,
    /// The history's private pools (`segment_pool_id`) → the replay's named pools.
    pools: HashMap<PoolKey, MemPoolId>,
    /// The private pools the recording describes (`Trace::pools`).
    recorded_pools: Vec<PoolInfo>,
}

impl Replayer {
    /// A replayer of a trace whose recording describes the private pools `recorded_pools`,
    /// on `core` over `backend`, before the first event.
    pub(crate) fn new(
        backend: Arc<AccountingBackend>,
        core: DeviceCore,
        recorded_pools: Vec<PoolInfo>,
    ) -> Self {
        Replayer {
            backend,
            core,
            streams: AddrMap::default(),
            addrs: AddrMap::default(),
            deferred: AddrMap::default(),
            next_private: 0,
            warnings: 0,
            pools: HashMap::new(),
            recorded_pools,
        }
    }

    /// The replay's pool for the history's pool `id`, made at its first use (`None`: the
    /// default pools): as the recording describes it (`Trace::pools`: its name, quota,
    /// `use_on_oom`, unsplit blocks, and whether it was a named pool or PyTorch's unnamed
    /// kind), else a named pool without a quota, as gpualloc's are.
    pub(crate) fn pool(&mut self, id: PoolKey) -> Option<MemPoolId> {
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
    pub(crate) fn sleep(&mut self, pool: MemPoolId) -> Result<(), AllocError> {
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
    pub(crate) fn wake(&mut self, pool: MemPoolId) -> Result<bool, AllocError> {
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
    pub(crate) fn live_in(&self, addr: u64, len: u64) -> bool {
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

    /// Where a restored segment of the history's pool `pool` goes (`small`: its small pool).
    fn restore_target(&mut self, pool: PoolKey, small: bool) -> RestorePool {
        RestorePool {
            private: self.pool(pool),
            small,
        }
    }

    /// Maps the history's addresses of restored `blocks` (in a segment the history had at
    /// `recorded`) to the replay's, the segment having landed at `base`; returns how many.
    fn map_restored(&mut self, blocks: &[RestoredBlock], recorded: u64, base: DevicePtr) -> usize {
        for b in blocks {
            self.addrs
                .insert(b.addr, DevicePtr(b.addr - recorded + base.0));
        }
        blocks.len()
    }

    /// Makes reservation `res` at its base, with the start segments `inside` it (its mapped
    /// runs, none when the history maps its first page at event `index`) and their live
    /// blocks; returns how many live blocks it placed.
    pub(crate) fn restore_reservation(
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
        let target = self.restore_target(res.pool, res.small);
        self.backend.place_next(DEVICE, res.base);
        let restored = self
            .core
            .restore_expandable(res.base, res.size, stream, target, &runs, &blocks);
        self.backend.clear_placement(DEVICE);
        let base = restored.map_err(|source| ReplayError::Alloc { index, source })?;
        Ok(self.map_restored(&blocks, res.base, base))
    }

    /// Warm: PyTorch's state when recording began, its segments at their addresses with the
    /// blocks alive in them (and, for a history of expandable segments, its reservations with
    /// their mapped runs). Returns the reservations planned (see `analysis::reservations`);
    /// allocations alive at the start that nothing holds count as warnings.
    pub(crate) fn start_warm(
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
            let target = self.restore_target(seg.pool, seg.small);
            self.backend.place_next(DEVICE, seg.addr);
            let base = self
                .core
                .restore_segment(seg.addr, seg.size, stream, target, &blocks)
                .map_err(|source| ReplayError::Alloc { index: 0, source })?;
            placed += self.map_restored(&blocks, seg.addr, base);
        }
        self.warnings += (initial.len() - placed) as u64;
        Ok(plan)
    }

    /// Cold: the allocations alive at the start, allocated largest first.
    pub(crate) fn start_cold(&mut self, initial: &[LiveAtStart]) -> Result<(), ReplayError> {
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
    pub(crate) fn alloc(
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

    pub(crate) fn free(&mut self, torch_addr: u64, deferred: bool) {
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
pub(crate) fn served_by_new_segment(trace: &Trace, i: usize) -> bool {
    let e = &trace.events[i];
    trace.events[..i]
        .iter()
        .rev()
        .find(|p| !matches!(p.action, Action::FreeRequested | Action::FreeCompleted))
        .is_some_and(|s| {
            s.action == Action::SegmentAlloc && s.addr <= e.addr && e.addr - s.addr < s.size
        })
}
