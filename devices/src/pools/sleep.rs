//! Sleep and wake of a named pool at stable addresses (vLLM's sleep mode, SGLang's
//! `torch_memory_saver`, built into the allocator): the physical memory of every segment of
//! the pool is released while its virtual ranges stay reserved, and a wake maps new physical
//! memory at the same addresses, so pointers held by kernels and CUDA graphs stay valid.
//!
//! Needs expandable segments (`expandable_segments:True`, where named pools grow expandable
//! segments of their own: `pools/`); otherwise [`AllocError::NotSupported`]. Because a
//! pool's segments are its own, sleeping one pool can never release another's memory.
//!
//! Three steps each way, for an owner that must not wait for streams or make driver calls
//! while it holds the core (the device actor), as growths and page releases do:
//!
//! Sleep:
//! 1. [`DeviceCore::begin_sleep`], under the core: records an event on every stream that used
//!    the pool (the segments' streams, the streams its live blocks were recorded on, the
//!    streams of its pending frees), takes every run of physical memory out of the pool's
//!    segments (booked as released at once, `segment_unmap` traced) and lists the live blocks
//!    to copy out ([`SleepMode::Offload`]). From here the pool serves no allocation
//!    ([`AllocError::PoolAsleep`]), a miss of the pool whose driver calls ran off the core
//!    included: it checks the pool again when it resumes (`miss/chain.rs`). Refused with
//!    [`AllocError::PoolBusy`] while pages of the pool's segments are being mapped or
//!    unmapped.
//! 2. Off the core: [`wait_for_pool_streams`] (events, not a device-wide synchronize), the
//!    owner's copies of [`SleepPlan::copies`] to host memory, then [`release_slept_pages`].
//! 3. [`DeviceCore::finish_sleep`]: the pool is [`PoolState::Asleep`]. Or, when the wait or a
//!    copy failed before anything was unmapped, [`DeviceCore::abort_sleep`] puts the pages
//!    back: the pool is awake as before.
//!
//! Wake:
//! 1. [`DeviceCore::begin_wake`]: checks the memory-fraction cap, claims the bytes (they count
//!    against the cap while being mapped) and returns the runs to map.
//! 2. Off the core: [`map_wake`] maps one new handle per run the pool had, at the same
//!    addresses (all or nothing: a failure unmaps and releases what it mapped), then the
//!    owner copies the data back.
//! 3. [`DeviceCore::finish_wake`] installs the pages: the pool is awake. Or
//!    [`DeviceCore::abort_wake`] after a failed map or copy: the pool stays asleep, nothing
//!    half-mapped, and the owner keeps its host copy; the error says how much the wake needed
//!    ([`AllocError::WakeOutOfMemory`]).
//!
//! Choices, documented for users:
//! - Live blocks stay allocated while asleep: their buffers, pointers and the allocated
//!   statistics are untouched (the device's `allocated_bytes` may exceed its
//!   `reserved_bytes` meanwhile), and they can be freed. Only reserved memory goes down, and
//!   the device's free memory goes up. [`PoolUsage::asleep_bytes`](crate::PoolUsage) says how
//!   much the wake maps back.
//! - The pool's free blocks keep their place and come back mapped; the wake maps exactly the
//!   runs the pool had (one handle each), no more.
//! - Device work touching a sleeping pool's memory fails (on the sim with a typed error; on a
//!   GPU with an illegal-address fault): finish it before the sleep, as vLLM's sleep mode
//!   requires.
//! - A wake does not count against the pool's quota (it maps what the pool had), but does
//!   count against `per_process_memory_fraction`.

use gpualloc_runtime::{Backend, BackendError, DeviceId, DevicePtr, EventHandle, StreamHandle};

use crate::blocks::block::BlockState;
use crate::core::{DeviceCore, MemPoolId};
use crate::error::AllocError;
use crate::expandable::growth::release_reservation;
use crate::expandable::segment::{map_pages, unmap_pages, Booking, Handles, MappedPages};
use crate::ledger::observer::SegmentAction;
use crate::pools::pool_state::PoolState;

/// What happens to the data of a pool's live blocks while it sleeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SleepMode {
    /// Copied to host memory by the sleep and back by the wake.
    Offload,
    /// Dropped: after the wake the blocks hold whatever the new memory holds (weights that
    /// will be reloaded, a KV cache that will be recomputed).
    Discard,
}

/// A sleep begun by [`DeviceCore::begin_sleep`]: finish or abort it.
#[derive(Debug)]
#[must_use = "a begun sleep must be finished or aborted"]
pub struct SleepPlan {
    pool: MemPoolId,
    events: Vec<EventHandle>,
    /// Per segment: the runs taken out, as (segment, first page, pages).
    pages: Vec<(u64, usize, MappedPages)>,
    copies: Vec<(DevicePtr, u64)>,
}

impl SleepPlan {
    /// The live blocks to copy out (address, bytes the user asked for), in address order;
    /// empty for [`SleepMode::Discard`].
    pub fn copies(&self) -> &[(DevicePtr, u64)] {
        &self.copies
    }

    /// Bytes of physical memory the sleep releases.
    pub fn bytes(&self) -> u64 {
        self.pages.iter().map(|(_, _, m)| m.bytes()).sum()
    }
}

/// A wake begun by [`DeviceCore::begin_wake`]: finish or abort it.
#[derive(Debug)]
#[must_use = "a begun wake must be finished or aborted"]
pub struct WakePlan {
    pool: MemPoolId,
    device: DeviceId,
    peers: Vec<DeviceId>,
    runs: Vec<SleptSegment>,
    bytes: u64,
}

impl WakePlan {
    /// Bytes of physical memory the wake maps.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

/// A segment of a sleeping pool, as a wake maps it back.
#[derive(Debug)]
struct SleptSegment {
    seg: u64,
    base: u64,
    page: u64,
    /// The runs it had, as (first page, pages).
    layout: Vec<(usize, usize)>,
}

/// What [`map_wake`] mapped, for [`DeviceCore::finish_wake`].
#[derive(Debug)]
pub struct WokenPages {
    pages: Vec<(u64, usize, MappedPages)>,
}

impl WokenPages {
    /// Unmaps and releases the pages again (a wake whose copy back failed). Off the core.
    pub fn release(self, backend: &dyn Backend) {
        for (_, _, m) in &self.pages {
            unmap_pages(backend, m);
        }
    }
}

/// Driver work left by a finish or abort that met a shut-down core: run it off the core with
/// [`Leftovers::release`].
#[derive(Debug)]
#[must_use = "leftover pages and reservations must be released"]
pub struct Leftovers {
    device: DeviceId,
    pages: Vec<MappedPages>,
    reservations: Vec<(DevicePtr, u64)>,
}

impl Leftovers {
    /// Unmaps and releases the pages, then frees the reservations.
    pub fn release(self, backend: &dyn Backend) {
        for m in &self.pages {
            unmap_pages(backend, m);
        }
        for r in self.reservations {
            release_reservation(backend, self.device, r);
        }
    }

    /// True when there is nothing to release.
    pub fn is_empty(&self) -> bool {
        self.pages.is_empty() && self.reservations.is_empty()
    }
}

impl DeviceCore {
    /// Where `pool` is in its sleep cycle; `None` for an unknown pool.
    pub fn pool_state(&self, pool: MemPoolId) -> Option<PoolState> {
        self.private.get(pool.0).map(|p| p.usage.state)
    }

    /// Sleep step 1 (see the module docs).
    pub fn begin_sleep(
        &mut self,
        pool: MemPoolId,
        mode: SleepMode,
    ) -> Result<SleepPlan, AllocError> {
        if self.shut_down {
            return Err(AllocError::Shutdown);
        }
        let p = match self.private.get(pool.0) {
            Some(p) if !p.released => p,
            _ => return Err(AllocError::UnknownPool(pool.0)),
        };
        if !self.pool_expands(p.large) {
            return Err(AllocError::NotSupported(
                "sleep needs a named pool of expandable segments (expandable_segments:True)",
            ));
        }
        if p.usage.state != PoolState::Awake {
            return Err(AllocError::PoolAsleep {
                pool: p.usage.name.clone(),
                state: p.usage.state,
            });
        }
        let capturing = self.captures.fills(pool.0);
        if p.graphs > 0 || capturing {
            return Err(AllocError::PoolInGraph {
                pool: p.usage.name.clone(),
                graphs: p.graphs,
                capturing,
            });
        }
        // A dropped graph's launches may still use the pages: the owner retries.
        if p.launches > 0 {
            return Err(AllocError::PoolBusy {
                pool: p.usage.name.clone(),
            });
        }
        let own = [p.small, p.large];
        let exported = self
            .active
            .exported()
            .filter(|&id| own.contains(&self.blocks.get(id).pool()))
            .count();
        if exported > 0 {
            return Err(AllocError::PoolExported {
                pool: p.usage.name.clone(),
                buffers: exported,
            });
        }
        let segs: Vec<u64> = self
            .expandable
            .bases()
            .into_iter()
            .filter(|&s| self.segments.pool_of(s).is_some_and(|p| own.contains(&p)))
            .collect();
        if segs.iter().any(|&s| self.expandable.is_busy(s)) {
            return Err(AllocError::PoolBusy {
                pool: p.usage.name.clone(),
            });
        }
        self.process_events()?;
        // Every stream that may still touch the pool's memory.
        let mut streams: Vec<StreamHandle> = segs
            .iter()
            .filter_map(|&s| self.expandable.get(s))
            .map(|es| es.stream)
            .collect();
        let mut copies = Vec::new();
        for (_, b) in self.blocks.iter().filter(|(_, b)| own.contains(&b.pool())) {
            streams.extend(b.stream_uses().iter().copied());
            if b.state() == BlockState::Allocated && mode == SleepMode::Offload {
                copies.push((DevicePtr(b.addr()), b.requested()));
            }
        }
        let blocks = &self.blocks;
        streams.extend(
            self.pending
                .streams_of(|id| own.contains(&blocks.get(id).pool())),
        );
        streams.sort_by_key(|s| (s.device.0, s.raw));
        streams.dedup();
        copies.sort_by_key(|c| c.0 .0);
        // An event recorded on a capturing stream would be the graph's, not a point to wait for.
        if streams.iter().any(|&s| self.stream_captures(s)) {
            return Err(AllocError::CaptureUnderway("putting a pool to sleep"));
        }
        let mut events = Vec::with_capacity(streams.len());
        for stream in streams {
            match self.record_event(stream) {
                Ok(e) => events.push(e),
                Err(e) => {
                    self.pending.give_back(events);
                    return Err(e.into());
                }
            }
        }
        let mut pages = Vec::new();
        for &seg in &segs {
            let Some(es) = self.expandable.get_mut(seg) else {
                continue;
            };
            if es.runs.is_empty() {
                continue;
            }
            es.slept = Some(es.runs.clone());
            for (first, n) in es.mapped_stretches() {
                pages.push((seg, first, es.take_runs_inside(first, first + n)));
            }
            self.expandable.begin_work(seg);
        }
        for (seg, _, m) in &pages {
            self.book_segment_pages(*seg, m.start, m.bytes(), Booking::Released);
            // The device has them until the unmap returns (`finish_sleep`, `abort_sleep`).
            self.budget.releasing_begins(m.bytes());
        }
        let name = self.set_state(pool, PoolState::FallingAsleep);
        tracing::debug!(
            device = self.device.0,
            pool = name,
            bytes = pages.iter().map(|p| p.2.bytes()).sum::<u64>(),
            "pool falling asleep"
        );
        Ok(SleepPlan {
            pool,
            events,
            pages,
            copies,
        })
    }

    /// Sleep step 3 once the pages are unmapped: the pool is asleep. Returns what a shutdown
    /// meanwhile left to release.
    pub fn finish_sleep(&mut self, plan: SleepPlan) -> Leftovers {
        self.pending.give_back(plan.events);
        let mut left = self.leftovers();
        let mut bytes = 0;
        for (seg, _, m) in &plan.pages {
            bytes += m.bytes();
            self.budget.released(m.bytes());
            if let Some(r) = self.expandable.end_work(*seg) {
                left.reservations.push(r);
            }
        }
        if let Some(p) = self.private.get_mut(plan.pool.0) {
            if p.usage.state == PoolState::FallingAsleep {
                p.usage.state = PoolState::Asleep;
                p.usage.asleep_bytes = bytes;
                self.announce_pool(SegmentAction::PoolAsleep, plan.pool, bytes);
            }
        }
        left
    }

    /// Sleep step 3 when the wait or a copy failed (nothing was unmapped): the pages go back
    /// into the segments and the pool is awake again. Returns what a shutdown meanwhile left
    /// to release (then the pages too).
    pub fn abort_sleep(&mut self, plan: SleepPlan) -> Leftovers {
        self.pending.give_back(plan.events);
        let mut left = self.leftovers();
        for (seg, first, m) in plan.pages {
            self.budget.released(m.bytes());
            if let Some(r) = self.expandable.end_work(seg) {
                left.reservations.push(r);
            }
            // A shutdown meanwhile took the segment out of the books (`release_all_expandable`).
            match self.expandable.get_mut(seg) {
                Some(es) => {
                    es.install(first, &m);
                    es.slept = None;
                    let (start, len) = (m.start, m.bytes());
                    self.book_segment_pages(seg, start, len, Booking::Restored);
                }
                None => left.pages.push(m),
            }
        }
        self.set_state(plan.pool, PoolState::Awake);
        left
    }

    /// Wake step 1 (see the module docs). `Ok(None)` when the pool is awake already.
    pub fn begin_wake(&mut self, pool: MemPoolId) -> Result<Option<WakePlan>, AllocError> {
        if self.shut_down {
            return Err(AllocError::Shutdown);
        }
        let p = match self.private.get(pool.0) {
            Some(p) if !p.released => p,
            _ => return Err(AllocError::UnknownPool(pool.0)),
        };
        match p.usage.state {
            PoolState::Awake => return Ok(None),
            PoolState::Asleep => {}
            state => {
                return Err(AllocError::PoolAsleep {
                    pool: p.usage.name.clone(),
                    state,
                })
            }
        }
        let own = [p.small, p.large];
        let mut runs = Vec::new();
        let mut bytes = 0u64;
        for (&seg, es) in self.expandable.iter() {
            if !self
                .segments
                .get(seg)
                .is_some_and(|m| own.contains(&m.pool))
            {
                continue;
            }
            let Some(slept) = &es.slept else {
                continue;
            };
            let layout: Vec<(usize, usize)> = slept.iter().map(|(&s, &(_, n))| (s, n)).collect();
            bytes += layout.iter().map(|r| r.1 as u64).sum::<u64>() * es.page;
            runs.push(SleptSegment {
                seg,
                base: es.base,
                page: es.page,
                layout,
            });
        }
        if let Some(max) = self.budget.allowed() {
            let held = self.budget.held();
            if held.saturating_add(bytes) > max {
                return Err(AllocError::WakeOutOfMemory {
                    pool: p.usage.name.clone(),
                    needed: bytes,
                    free: max.saturating_sub(held),
                });
            }
        }
        self.budget.claim(bytes);
        for r in &runs {
            self.expandable.begin_work(r.seg);
        }
        self.set_state(pool, PoolState::Waking);
        Ok(Some(WakePlan {
            pool,
            device: self.device,
            peers: self.expandable.peers().to_vec(),
            runs,
            bytes,
        }))
    }

    /// Wake step 3 after [`map_wake`] (and the owner's copies back): installs the pages; the
    /// pool is awake. Returns what a shutdown meanwhile left to release (then the pages too).
    pub fn finish_wake(&mut self, plan: WakePlan, woken: WokenPages) -> Leftovers {
        let mut left = self.end_wake(&plan);
        let live = !self.shut_down
            && self
                .private
                .get(plan.pool.0)
                .is_some_and(|p| p.usage.state == PoolState::Waking);
        if !live {
            left.pages
                .extend(woken.pages.into_iter().map(|(_, _, m)| m));
            return left;
        }
        for (seg, first, m) in woken.pages {
            let Some(es) = self.expandable.get_mut(seg) else {
                left.pages.push(m);
                continue;
            };
            es.install(first, &m);
            es.slept = None;
            let (start, len) = (m.start, m.bytes());
            // A peer added while these pages were being mapped gets access now.
            for peer in self
                .expandable
                .peers()
                .iter()
                .filter(|p| !plan.peers.contains(p))
            {
                if let Err(e) = self.backend.set_access(*peer, DevicePtr(start), len) {
                    tracing::warn!(peer = peer.0, addr = start, error = %e, "peer access to woken pages failed");
                }
            }
            self.book_segment_pages(seg, start, len, Booking::Mapped);
        }
        self.set_state(plan.pool, PoolState::Awake);
        self.announce_pool(SegmentAction::PoolAwake, plan.pool, plan.bytes);
        left
    }

    /// Wake step 3 after a failed [`map_wake`] or copy back (the pages released again): the
    /// pool stays asleep. Returns what a shutdown meanwhile left to release.
    pub fn abort_wake(&mut self, plan: WakePlan) -> Leftovers {
        let left = self.end_wake(&plan);
        if let Some(p) = self.private.get_mut(plan.pool.0) {
            if p.usage.state == PoolState::Waking {
                p.usage.state = PoolState::Asleep;
            }
        }
        left
    }

    fn end_wake(&mut self, plan: &WakePlan) -> Leftovers {
        self.budget.unclaim(plan.bytes);
        let mut left = self.leftovers();
        for r in &plan.runs {
            if let Some(res) = self.expandable.end_work(r.seg) {
                left.reservations.push(res);
            }
        }
        left
    }

    fn leftovers(&self) -> Leftovers {
        Leftovers {
            device: self.device,
            pages: Vec::new(),
            reservations: Vec::new(),
        }
    }

    /// Sets `pool`'s state (and clears its asleep bytes when awake); returns its name.
    fn set_state(&mut self, pool: MemPoolId, state: PoolState) -> String {
        let Some(p) = self.private.get_mut(pool.0) else {
            return String::new();
        };
        p.usage.state = state;
        if state == PoolState::Awake {
            p.usage.asleep_bytes = 0;
        }
        p.usage.name.clone()
    }

    /// [`DeviceCore::book_pages`] for pages of segment `seg`.
    fn book_segment_pages(&mut self, seg: u64, start: u64, len: u64, booking: Booking) {
        if let Some(meta) = self.segments.get(seg).copied() {
            self.book_pages(meta.pool, meta.stream.raw, start, len, booking);
        }
    }
}

/// Sleep step 2a, off the core: waits for the events [`DeviceCore::begin_sleep`] recorded,
/// i.e. for the work queued on every stream that used the pool.
pub fn wait_for_pool_streams(backend: &dyn Backend, plan: &SleepPlan) -> Result<(), BackendError> {
    for &e in &plan.events {
        backend.event_synchronize(e)?;
    }
    Ok(())
}

/// Sleep step 2c, off the core: unmaps and releases the pool's physical memory (after the
/// streams were waited for and the data copied out). Best effort, as a page release.
pub fn release_slept_pages(backend: &dyn Backend, plan: &SleepPlan) {
    for (_, _, m) in &plan.pages {
        unmap_pages(backend, m);
    }
}

/// Wake step 2, off the core: maps one new physical handle per run the pool had, at the same
/// addresses. All or nothing: on failure what it mapped is unmapped and released again.
pub fn map_wake(backend: &dyn Backend, plan: &WakePlan) -> Result<WokenPages, BackendError> {
    let mut woken = WokenPages { pages: Vec::new() };
    for s in &plan.runs {
        for &(first, n) in &s.layout {
            let start = s.base + first as u64 * s.page;
            match map_pages(
                backend,
                plan.device,
                &plan.peers,
                start,
                n,
                s.page,
                Handles::of(n),
            ) {
                Ok(m) => woken.pages.push((s.seg, first, m)),
                Err(e) => {
                    woken.release(backend);
                    return Err(e);
                }
            }
        }
    }
    Ok(woken)
}
