//! [`HostCore`]: the pinned-host caching allocator as a synchronous state machine over a
//! [`Backend`].
//!
//! Semantics follow PyTorch's `CachingHostAllocatorImpl` and its CUDA specialization:
//! - `malloc` rounds the size to its class ([`crate::size_class`]), hands out a cached block of
//!   that class if there is one, else carves one from the reserve segment, else allocates a
//!   fresh block from the backend (`host_alloc`, or mmap + prefault + `host_register` with
//!   `pinned_use_cuda_host_register`). Blocks are never split or merged. On the register path
//!   sizes below a page are rounded up to a page (the mapping holds one anyway).
//! - `record_stream` only remembers the stream; `free` records one event per remembered stream
//!   (lazily, as PyTorch does, so a buffer used many times costs one event per stream) and the
//!   block returns to the cache only when `process_events` sees all of them complete.
//! - `process_events` queries every pending event (not just up to the first incomplete one, as
//!   PyTorch does: events of different streams complete out of order). `malloc` calls it first
//!   unless `pinned_use_background_threads` is set, in which case the owner's reaper calls it,
//!   and `malloc` calls it only on a cache miss before allocating fresh memory.
//! - A backend out-of-memory releases every releasable cached block and retries once.
//! - `empty_cache` processes events, then releases every cached block to the backend.
//!
//! The core never blocks on the GPU except in [`HostCore::drain_events`], never reads a clock
//! but the [`Clock`] it is given, and owns no threads (prefault's scoped threads end before
//! `malloc` returns).
//!
//! Where segments come from and go back to (the backend's calls, the reserve segment, a
//! dropped core's leftovers) is `core_memory.rs`; the malloc split for an owner that calls the
//! backend off its lock is `core_split.rs`.

use std::collections::{HashMap, VecDeque};

use crate::addr_map::AddrMap;
use std::sync::Arc;

use gpualloc_runtime::{Backend, BackendError, DeviceId, EventHandle, StreamHandle};

use crate::clock::Clock;
use crate::config::HostConfig;
use crate::error::{HostError, Result};
use crate::free_list::{Entry, FreeList};
use crate::mapping::{page_size, PageMapping};
use crate::reserve::ReserveSegment;
use crate::size_class::{size_class, SizeClass};
use crate::stats::HostStats;
use crate::{HostBlock, HostPtr};

/// Where a block's (or the reserve segment's) memory came from, and so how it goes back.
#[derive(Debug)]
enum Origin {
    /// Carved from the reserve segment: never released on its own.
    Reserve,
    /// `Backend::host_alloc`; released with `host_free`.
    HostAlloc,
    /// Our own mapping, registered with `Backend::host_register`; released with
    /// `host_unregister`, then unmapped.
    Registered(PageMapping),
}

#[derive(Debug)]
enum State {
    /// Handed out; the streams `record_stream` named since.
    Live { streams: Vec<StreamHandle> },
    /// Freed; waiting for this many recorded events.
    Pending { events: usize },
    /// In the free list.
    Cached(Entry),
}

#[derive(Debug)]
struct Block {
    size: u64,
    origin: Origin,
    state: State,
}

#[derive(Debug)]
enum Reserve {
    /// Not configured, or not needed yet.
    None,
    /// Allocating it failed once; not retried.
    Failed,
    /// Allocated: its memory and bump state.
    Ready {
        seg: ReserveSegment,
        memory: Origin,
        block_bytes: u64,
    },
}

/// The pinned-host caching allocator core. See the module docs.
pub struct HostCore {
    backend: Arc<dyn Backend>,
    clock: Arc<dyn Clock>,
    config: HostConfig,
    threshold: Option<u64>,
    cap: Option<u64>,
    blocks: AddrMap<Block>,
    free: FreeList,
    /// Recorded events and the block each guards, oldest first.
    events: VecDeque<(EventHandle, u64)>,
    /// Completed events kept for reuse, per device.
    event_pool: HashMap<DeviceId, Vec<EventHandle>>,
    reserve: Reserve,
    stats: HostStats,
}

impl std::fmt::Debug for HostCore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostCore")
            .field("backend", &self.backend.name())
            .field("config", &self.config)
            .field("blocks", &self.blocks.len())
            .field("pending_events", &self.events.len())
            .finish_non_exhaustive()
    }
}

impl HostCore {
    /// A core over `backend` with `config` (validated), timing backend calls with `clock`.
    pub fn new(
        backend: Arc<dyn Backend>,
        config: HostConfig,
        clock: Arc<dyn Clock>,
    ) -> Result<Self> {
        config.validate()?;
        let cap = config.max_cached_bytes();
        Ok(HostCore {
            backend,
            clock,
            threshold: config.round_threshold_bytes(),
            cap,
            config,
            blocks: AddrMap::default(),
            free: FreeList::new(cap.is_some()),
            events: VecDeque::new(),
            event_pool: HashMap::new(),
            reserve: Reserve::None,
            stats: HostStats::default(),
        })
    }

    /// The configuration in force.
    pub fn config(&self) -> &HostConfig {
        &self.config
    }

    /// The size class a request of `size` bytes gets here.
    pub fn size_class(&self, size: u64) -> Result<SizeClass> {
        let mut class = size_class(size, self.threshold)?;
        if self.config.pinned_use_cuda_host_register {
            let page = page_size() as u64;
            class.rounded = class.rounded.max(page);
            class.max_fit = class.max_fit.max(page);
        }
        Ok(class)
    }

    /// Allocates a pinned block of at least `size` bytes. Errors: [`HostError::ZeroSize`],
    /// [`HostError::TooLarge`], or the backend's (out of memory after releasing the cache).
    pub fn malloc(&mut self, size: u64) -> Result<HostBlock> {
        let class = self.size_class(size)?;
        if !self.config.pinned_use_background_threads {
            self.process_events_logged();
        }
        if let Some(block) = self.take_cached(class, size) {
            return Ok(block);
        }
        if self.config.pinned_use_background_threads && !self.events.is_empty() {
            self.process_events_logged();
            if let Some(block) = self.take_cached(class, size) {
                return Ok(block);
            }
        }
        let _span =
            tracing::debug_span!("pinned_malloc_slow", size, rounded = class.rounded).entered();
        self.ensure_reserve();
        if let Some(addr) = self.carve_reserve(class.rounded) {
            return Ok(self.insert_live(addr, class.rounded, Origin::Reserve, size));
        }
        let (addr, origin) = match self.alloc_segment(class.rounded) {
            Err(HostError::Backend(e)) if e.is_oom() => {
                let released = self.release_cached();
                tracing::info!(
                    size,
                    released,
                    "pinned allocation out of memory; released the cache, retrying"
                );
                self.alloc_segment(class.rounded)?
            }
            other => other?,
        };
        Ok(self.insert_live(addr, class.rounded, origin, size))
    }

    /// Frees a block from [`HostCore::malloc`]. Without recorded streams it is cached at once;
    /// otherwise one event is recorded on each stream and the block waits for them. If
    /// recording fails the block stays allocated (the free can be retried) and the error is
    /// returned.
    pub fn free(&mut self, ptr: HostPtr) -> Result<()> {
        let block = self
            .blocks
            .get_mut(&ptr.0)
            .ok_or(HostError::UnknownPointer(ptr))?;
        let streams = match &mut block.state {
            State::Live { streams } => std::mem::take(streams),
            State::Pending { .. } | State::Cached(_) => return Err(HostError::DoubleFree(ptr)),
        };
        if streams.is_empty() {
            self.make_available(ptr.0);
            return Ok(());
        }
        let mut recorded = Vec::with_capacity(streams.len());
        for &stream in &streams {
            match self.record_on(stream) {
                Ok(ev) => recorded.push(ev),
                Err(e) => {
                    for ev in recorded {
                        self.event_pool.entry(ev.device).or_default().push(ev);
                    }
                    if let Some(b) = self.blocks.get_mut(&ptr.0) {
                        b.state = State::Live { streams };
                    }
                    return Err(e.into());
                }
            }
        }
        if let Some(b) = self.blocks.get_mut(&ptr.0) {
            b.state = State::Pending {
                events: recorded.len(),
            };
        }
        self.events
            .extend(recorded.into_iter().map(|ev| (ev, ptr.0)));
        Ok(())
    }

    /// Notes that `stream` uses the block at `ptr`; when the block is freed, it is not reused
    /// until the work `stream` has queued by then is done.
    pub fn record_stream(&mut self, ptr: HostPtr, stream: StreamHandle) -> Result<()> {
        let block = self
            .blocks
            .get_mut(&ptr.0)
            .ok_or(HostError::UnknownPointer(ptr))?;
        match &mut block.state {
            State::Live { streams } => {
                if !streams.contains(&stream) {
                    streams.push(stream);
                }
                Ok(())
            }
            _ => Err(HostError::NotAllocated(ptr)),
        }
    }

    /// Queries every pending event and caches each block whose events have all completed.
    /// Returns how many blocks became reusable. A failing query leaves its event pending and
    /// is returned after the others have been processed.
    pub fn process_events(&mut self) -> Result<usize> {
        let mut first_error = None;
        let mut ready = 0;
        let pending = std::mem::take(&mut self.events);
        let mut still = VecDeque::with_capacity(pending.len());
        for (ev, addr) in pending {
            match self.backend.event_query(ev) {
                Ok(true) => {
                    self.event_pool.entry(ev.device).or_default().push(ev);
                    let done = match self.blocks.get_mut(&addr) {
                        Some(Block {
                            state: State::Pending { events },
                            ..
                        }) => {
                            *events -= 1;
                            *events == 0
                        }
                        _ => false,
                    };
                    if done {
                        self.make_available(addr);
                        ready += 1;
                    }
                }
                Ok(false) => still.push_back((ev, addr)),
                Err(e) => {
                    still.push_back((ev, addr));
                    first_error.get_or_insert(e);
                }
            }
        }
        self.events = still;
        match first_error {
            Some(e) => Err(e.into()),
            None => Ok(ready),
        }
    }

    /// Blocks until every pending event has completed, then processes them (for shutdown).
    pub fn drain_events(&mut self) -> Result<usize> {
        for &(ev, _) in &self.events {
            self.backend.event_synchronize(ev)?;
        }
        self.process_events()
    }

    /// Processes completed events, then returns every cached block to the backend. The
    /// reserve segment stays allocated; when none of its blocks is in use its carved blocks
    /// are dropped and it is carved afresh. Pooled events are destroyed. Errors are returned
    /// after everything else has been released.
    pub fn empty_cache(&mut self) -> Result<()> {
        let mut result = self.process_events().map(|_| ());
        if let Err(e) = self.release_cached_checked() {
            result = result.and(Err(e));
        }
        self.rewind_reserve_if_idle();
        for (_, evs) in self.event_pool.drain() {
            for ev in evs {
                if let Err(e) = self.backend.event_destroy(ev) {
                    result = result.and(Err(e.into()));
                }
            }
        }
        result
    }

    /// Current statistics. See [`crate::stats`] for what each key counts.
    pub fn stats(&self) -> HostStats {
        let mut s = self.stats;
        s.cached_bytes = self.free.bytes();
        s.reserve_unused_bytes = match &self.reserve {
            Reserve::Ready {
                seg, block_bytes, ..
            } => seg.size() - block_bytes,
            _ => 0,
        };
        s.num_host_alloc = s.segment.allocated;
        s.num_host_free = s.segment.freed;
        s
    }

    /// Sets every peak statistic to its current value.
    pub fn reset_peak_stats(&mut self) {
        self.stats.reset_peak();
    }

    /// Zeroes the accumulated statistics.
    pub fn reset_accumulated_stats(&mut self) {
        self.stats.reset_accumulated();
    }

    /// Number of recorded events not yet seen complete.
    pub fn pending_events(&self) -> usize {
        self.events.len()
    }

    /// The pending events and the block each guards, oldest first (for a reaper that waits on
    /// the oldest, and for tests that complete them one by one).
    pub fn pending_event_list(&self) -> Vec<(EventHandle, HostPtr)> {
        self.events
            .iter()
            .map(|&(ev, addr)| (ev, HostPtr(addr)))
            .collect()
    }

    /// Number of blocks handed out and not yet freed.
    pub fn live_blocks(&self) -> usize {
        self.blocks
            .values()
            .filter(|b| matches!(b.state, State::Live { .. }))
            .count()
    }

    // ---- internals ----

    fn process_events_logged(&mut self) {
        if self.events.is_empty() {
            return;
        }
        if let Err(e) = self.process_events() {
            tracing::warn!(error = %e, "querying a pinned block's event failed");
        }
    }

    fn take_cached(&mut self, class: SizeClass, requested: u64) -> Option<HostBlock> {
        let e = self.free.take(class.rounded, class.max_fit)?;
        if let Some(b) = self.blocks.get_mut(&e.addr) {
            b.state = State::Live {
                streams: Vec::new(),
            };
        }
        self.stats.allocation.increase(1);
        self.stats.allocated_bytes.increase(e.size);
        Some(HostBlock {
            ptr: HostPtr(e.addr),
            size: e.size,
            requested,
        })
    }

    fn insert_live(&mut self, addr: u64, size: u64, origin: Origin, requested: u64) -> HostBlock {
        if !matches!(origin, Origin::Reserve) {
            self.stats.segment.increase(1);
            self.stats.reserved_bytes.increase(size);
        }
        self.stats.allocation.increase(1);
        self.stats.allocated_bytes.increase(size);
        self.blocks.insert(
            addr,
            Block {
                size,
                origin,
                state: State::Live {
                    streams: Vec::new(),
                },
            },
        );
        HostBlock {
            ptr: HostPtr(addr),
            size,
            requested,
        }
    }

    /// Moves a freed block whose events are done into the cache, then enforces the cap.
    fn make_available(&mut self, addr: u64) {
        let Some(b) = self.blocks.get_mut(&addr) else {
            return;
        };
        let releasable = !matches!(b.origin, Origin::Reserve);
        let entry = self.free.insert(addr, b.size, releasable);
        b.state = State::Cached(entry);
        self.stats.allocation.decrease(1);
        self.stats.allocated_bytes.decrease(b.size);
        self.enforce_cap();
    }

    fn enforce_cap(&mut self) {
        let Some(cap) = self.cap else { return };
        while self.free.releasable_bytes() > cap {
            let Some(e) = self.free.oldest_releasable() else {
                break;
            };
            if let Err(err) = self.release_block(e) {
                tracing::warn!(addr = e.addr, error = %err, "releasing a cached pinned block over the cap failed");
                break;
            }
        }
    }

    /// An event on `stream`'s device, recorded on `stream`.
    fn record_on(
        &mut self,
        stream: StreamHandle,
    ) -> std::result::Result<EventHandle, BackendError> {
        let ev = match self.event_pool.get_mut(&stream.device).and_then(Vec::pop) {
            Some(ev) => ev,
            None => self.backend.event_create(stream.device)?,
        };
        if let Err(e) = self.backend.event_record(ev, stream) {
            self.event_pool.entry(ev.device).or_default().push(ev);
            return Err(e);
        }
        Ok(ev)
    }
}

#[path = "core_memory.rs"]
mod memory;

#[path = "core_split.rs"]
pub mod split;

#[cfg(test)]
#[path = "core_tests.rs"]
mod tests;
