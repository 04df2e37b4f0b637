//! Where the pinned core's memory comes from and goes back to: segments allocated from the
//! backend (`host_alloc`, or a mapping of ours prefaulted and registered), the reserve
//! segment carved into blocks, cached blocks released, and what a dropped core gives back.

use std::time::Duration;

use gpualloc_runtime::{Backend, HostRegisterFlags};

use super::{Block, HostCore, Origin, Reserve, State};
use crate::clock::Clock;
use crate::error::{HostError, Result};
use crate::free_list::Entry;
use crate::mapping::PageMapping;
use crate::prefault::prefault;
use crate::reserve::ReserveSegment;
use crate::stats::HostStats;

impl HostCore {
    /// Releases every releasable cached block; returns how many. Failures are logged.
    pub(super) fn release_cached(&mut self) -> usize {
        let mut n = 0;
        for e in self.free.entries() {
            if !e.releasable {
                continue;
            }
            match self.release_block(e) {
                Ok(()) => n += 1,
                Err(err) => {
                    tracing::warn!(addr = e.addr, error = %err, "releasing a cached pinned block failed")
                }
            }
        }
        n
    }

    pub(super) fn release_cached_checked(&mut self) -> Result<()> {
        let mut result = Ok(());
        for e in self.free.entries() {
            if e.releasable {
                if let Err(err) = self.release_block(e) {
                    result = result.and(Err(err));
                }
            }
        }
        result
    }

    /// Returns a cached, releasable block to the backend. On failure it stays cached.
    pub(super) fn release_block(&mut self, e: Entry) -> Result<()> {
        let Some(block) = self.blocks.get(&e.addr) else {
            return Ok(());
        };
        release_memory(
            &*self.backend,
            &*self.clock,
            &mut self.stats,
            e.addr,
            &block.origin,
        )?;
        self.free.remove(e);
        if let Some(block) = self.blocks.remove(&e.addr) {
            self.stats.segment.decrease(1);
            self.stats.reserved_bytes.decrease(block.size);
            drop(block); // unmaps a registered block's memory
        }
        Ok(())
    }

    /// Allocates `bytes` of pinned memory from the backend, timed.
    pub(super) fn alloc_segment(&mut self, bytes: u64) -> Result<(u64, Origin)> {
        let t0 = self.clock.now();
        let got = if self.config.pinned_use_cuda_host_register {
            alloc_registered(
                self.backend.as_ref(),
                bytes,
                bytes,
                self.config.pinned_num_register_threads,
            )?
        } else {
            (self.backend.host_alloc(bytes)? as u64, Origin::HostAlloc)
        };
        let dt: Duration = self.clock.now().saturating_sub(t0);
        self.stats.host_alloc_time.record(dt);
        tracing::debug!(
            bytes,
            addr = got.0,
            micros = dt.as_micros() as u64,
            "pinned segment allocated"
        );
        Ok(got)
    }

    /// Allocates the reserve segment on first need, if configured.
    pub(super) fn ensure_reserve(&mut self) {
        let bytes = self.config.reserve_segment_bytes();
        if bytes == 0 || !matches!(self.reserve, Reserve::None) {
            return;
        }
        match self.alloc_segment(bytes) {
            Ok((addr, memory)) => {
                self.stats.segment.increase(1);
                self.stats.reserved_bytes.increase(bytes);
                self.reserve = Reserve::Ready {
                    seg: ReserveSegment::new(addr, bytes),
                    memory,
                    block_bytes: 0,
                };
            }
            Err(e) => {
                tracing::warn!(bytes, error = %e, "allocating the pinned reserve segment failed; not retrying");
                self.reserve = Reserve::Failed;
            }
        }
    }

    pub(super) fn carve_reserve(&mut self, bytes: u64) -> Option<u64> {
        match &mut self.reserve {
            Reserve::Ready {
                seg, block_bytes, ..
            } => {
                let addr = seg.carve(bytes)?;
                *block_bytes += bytes;
                Some(addr)
            }
            _ => None,
        }
    }

    pub(super) fn rewind_reserve_if_idle(&mut self) {
        let Reserve::Ready {
            seg, block_bytes, ..
        } = &mut self.reserve
        else {
            return;
        };
        let busy = self
            .blocks
            .values()
            .any(|b| matches!(b.origin, Origin::Reserve) && !matches!(b.state, State::Cached(_)));
        if busy {
            return;
        }
        let carved: Vec<u64> = self
            .blocks
            .iter()
            .filter(|(_, b)| matches!(b.origin, Origin::Reserve))
            .map(|(a, _)| *a)
            .collect();
        for addr in carved {
            if let Some(Block {
                state: State::Cached(e),
                ..
            }) = self.blocks.remove(&addr)
            {
                self.free.remove(e);
            }
        }
        seg.rewind();
        *block_bytes = 0;
    }
}

impl Drop for HostCore {
    /// Returns what can safely go back: cached blocks, pooled events, and the reserve segment
    /// if none of its blocks is in use. Blocks still in use or waiting for events are leaked on
    /// purpose (their memory stays mapped): someone may still read or write them.
    fn drop(&mut self) {
        self.process_events_logged();
        self.release_cached();
        self.rewind_reserve_if_idle();
        for (_, evs) in self.event_pool.drain() {
            for ev in evs {
                let _ = self.backend.event_destroy(ev);
            }
        }
        let mut leaked = 0;
        for (_, block) in self.blocks.drain() {
            if !matches!(block.origin, Origin::Reserve) {
                leaked += 1;
            }
            if let Origin::Registered(m) = block.origin {
                std::mem::forget(m);
            }
        }
        let reserve = std::mem::replace(&mut self.reserve, Reserve::None);
        if let Reserve::Ready {
            seg,
            memory,
            block_bytes,
        } = reserve
        {
            if block_bytes == 0 {
                let released = release_memory(
                    &*self.backend,
                    &*self.clock,
                    &mut self.stats,
                    seg.base(),
                    &memory,
                );
                if let Err(e) = released {
                    tracing::warn!(error = %e, "releasing the pinned reserve segment failed");
                    if let Origin::Registered(m) = memory {
                        std::mem::forget(m);
                    }
                }
            } else {
                leaked += 1;
                if let Origin::Registered(m) = memory {
                    std::mem::forget(m);
                }
            }
        }
        if leaked > 0 {
            tracing::warn!(
                leaked,
                "pinned allocator dropped with blocks still in use; leaking them"
            );
        }
    }
}

/// The register path of a new segment: map `bytes`, prefault them on `threads` threads, and
/// register them (`requested`: what the user asked for, named in a too-large error). Shared by
/// `HostCore::alloc_segment` and the split malloc's `FreshRequest::allocate`.
pub(super) fn alloc_registered(
    backend: &dyn Backend,
    bytes: u64,
    requested: u64,
    threads: usize,
) -> Result<(u64, Origin)> {
    let len = usize::try_from(bytes).map_err(|_| HostError::TooLarge { requested })?;
    let mut mapping = PageMapping::new(len)?;
    prefault(mapping.as_mut_slice(), threads);
    // SAFETY: the mapping is the segment's own (`Origin::Registered`): it is unregistered in
    // `release_memory` before it is dropped.
    unsafe {
        backend.host_register(
            mapping.as_ptr(),
            mapping.len() as u64,
            HostRegisterFlags::default(),
        )
    }?;
    Ok((mapping.addr(), Origin::Registered(mapping)))
}

/// The backend half of releasing memory from `HostCore::alloc_segment`, timed into
/// `host_free_time`. The caller drops a registered mapping afterwards (unmapping it).
fn release_memory(
    backend: &dyn Backend,
    clock: &dyn Clock,
    stats: &mut HostStats,
    addr: u64,
    origin: &Origin,
) -> Result<()> {
    let t0 = clock.now();
    match origin {
        Origin::Reserve => return Ok(()),
        // SAFETY (both): the pool releases a segment only when every block of it is free and
        // past the events recorded on it, so no copy is pending and no buffer refers to it;
        // `addr` came from this backend's `host_alloc`, the mapping was registered by
        // `alloc_registered`.
        Origin::HostAlloc => unsafe { backend.host_free(addr as *mut u8) }?,
        Origin::Registered(m) => unsafe { backend.host_unregister(m.as_ptr()) }?,
    }
    let dt = clock.now().saturating_sub(t0);
    stats.host_free_time.record(dt);
    Ok(())
}
