//! [`HostCore::malloc`] split in three, so an owner that serializes access to the core (the
//! `HostActor`) can do the slow part — the driver call, or mapping and faulting in the pages
//! — without holding its lock, and keep serving cache hits meanwhile:
//!
//! 1. [`HostCore::try_cached`] (cheap): a cached block, or `None`.
//! 2. [`HostCore::lookup_miss`] (cheap, except the one-time reserve segment allocation): what
//!    `malloc` does next short of fresh memory (background-mode event processing, the reserve
//!    segment); a block, or a [`FreshRequest`].
//! 3. [`FreshRequest::allocate`] (slow, needs no core), then [`HostCore::adopt`] (cheap).
//!
//! If `allocate` runs out of memory, call [`HostCore::malloc`]: it releases the cache and
//! retries, as a plain `malloc` would. The sequence leaves the core exactly as `malloc` would.

use std::sync::Arc;
use std::time::Duration;

use gpualloc_runtime::Backend;

use crate::clock::Clock;
use crate::core::{HostCore, Origin};
use crate::error::Result;
use crate::HostBlock;

/// What [`HostCore::lookup_miss`] found.
#[derive(Debug)]
pub enum Lookup {
    /// A block (from the cache, or carved from the reserve segment).
    Hit(HostBlock),
    /// Fresh memory is needed.
    Fresh(FreshRequest),
}

/// Fresh pinned memory a miss needs: allocate it with [`FreshRequest::allocate`] (no core
/// needed), then give it to [`HostCore::adopt`].
pub struct FreshRequest {
    bytes: u64,
    requested: u64,
    register_threads: Option<usize>,
    backend: Arc<dyn Backend>,
    clock: Arc<dyn Clock>,
}

impl std::fmt::Debug for FreshRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FreshRequest")
            .field("bytes", &self.bytes)
            .field("requested", &self.requested)
            .field("register_threads", &self.register_threads)
            .finish_non_exhaustive()
    }
}

/// Memory from [`FreshRequest::allocate`]. Give it to [`HostCore::adopt`] (of the core that
/// made the request): dropped otherwise, its memory is leaked.
#[derive(Debug)]
pub struct FreshMemory {
    addr: u64,
    bytes: u64,
    requested: u64,
    origin: Origin,
    elapsed: Duration,
}

impl FreshRequest {
    /// Bytes to allocate (the request rounded to its size class).
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Allocates the memory: `host_alloc`, or (with `pinned_use_cuda_host_register`) map,
    /// prefault on the configured threads, and `host_register`. Slow; touches no core.
    pub fn allocate(&self) -> Result<FreshMemory> {
        let t0 = self.clock.now();
        let (addr, origin) = match self.register_threads {
            None => (
                self.backend.host_alloc(self.bytes)? as u64,
                Origin::HostAlloc,
            ),
            Some(threads) => super::memory::alloc_registered(
                self.backend.as_ref(),
                self.bytes,
                self.requested,
                threads,
            )?,
        };
        Ok(FreshMemory {
            addr,
            bytes: self.bytes,
            requested: self.requested,
            origin,
            elapsed: self.clock.now().saturating_sub(t0),
        })
    }
}

impl HostCore {
    /// The cache-only half of [`HostCore::malloc`]: a cached block of `size`'s class, or
    /// `None` on a miss. Bad sizes get the same errors as `malloc`.
    pub fn try_cached(&mut self, size: u64) -> Result<Option<HostBlock>> {
        let class = self.size_class(size)?;
        if !self.config.pinned_use_background_threads {
            self.process_events_logged();
        }
        Ok(self.take_cached(class, size))
    }

    /// After [`HostCore::try_cached`] missed: what `malloc` does next short of allocating
    /// fresh memory. Allocates the reserve segment on first need (slow, once).
    pub fn lookup_miss(&mut self, size: u64) -> Result<Lookup> {
        let class = self.size_class(size)?;
        if self.config.pinned_use_background_threads && !self.events.is_empty() {
            self.process_events_logged();
            if let Some(block) = self.take_cached(class, size) {
                return Ok(Lookup::Hit(block));
            }
        }
        self.ensure_reserve();
        if let Some(addr) = self.carve_reserve(class.rounded) {
            let block = self.insert_live(addr, class.rounded, Origin::Reserve, size);
            return Ok(Lookup::Hit(block));
        }
        Ok(Lookup::Fresh(FreshRequest {
            bytes: class.rounded,
            requested: size,
            register_threads: self
                .config
                .pinned_use_cuda_host_register
                .then_some(self.config.pinned_num_register_threads),
            backend: self.backend.clone(),
            clock: self.clock.clone(),
        }))
    }

    /// Takes memory from [`FreshRequest::allocate`] as a new live block, as `malloc` would.
    pub fn adopt(&mut self, memory: FreshMemory) -> HostBlock {
        self.stats.host_alloc_time.record(memory.elapsed);
        tracing::debug!(
            bytes = memory.bytes,
            addr = memory.addr,
            micros = memory.elapsed.as_micros() as u64,
            "pinned segment allocated (off the owner's lock)"
        );
        self.insert_live(memory.addr, memory.bytes, memory.origin, memory.requested)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{HostConfig, HostPtr, ManualClock};
    use gpualloc_accounting::AccountingBackend;

    use crate::HostError;

    const MIB: u64 = 1 << 20;

    fn core(config: HostConfig) -> HostCore {
        let backend = Arc::new(AccountingBackend::new(1, 1 << 30).with_host_capacity(1 << 30));
        HostCore::new(backend, config, Arc::new(ManualClock::default())).unwrap()
    }

    fn split_malloc(core: &mut HostCore, size: u64) -> HostBlock {
        if let Some(b) = core.try_cached(size).unwrap() {
            return b;
        }
        match core.lookup_miss(size).unwrap() {
            Lookup::Hit(b) => b,
            Lookup::Fresh(req) => {
                let mem = req.allocate().unwrap();
                core.adopt(mem)
            }
        }
    }

    #[test]
    fn the_split_path_leaves_the_core_as_malloc_does() {
        let mut a = core(HostConfig::default());
        let mut b = core(HostConfig::default());
        let mut ptrs = Vec::new();
        for size in [1000, 5000, 3 * MIB, 100 * MIB, 1000] {
            let x = a.malloc(size).unwrap();
            let y = split_malloc(&mut b, size);
            assert_eq!((x.size, x.requested), (y.size, y.requested));
            ptrs.push((x.ptr, y.ptr));
        }
        let (x0, y0): (HostPtr, HostPtr) = ptrs[0];
        a.free(x0).unwrap();
        b.free(y0).unwrap();
        assert_eq!(a.malloc(1000).unwrap().ptr, x0);
        assert_eq!(
            split_malloc(&mut b, 1000).ptr,
            y0,
            "a hit through try_cached"
        );
        let (sa, sb) = (a.stats(), b.stats());
        assert_eq!(sa.segment, sb.segment);
        assert_eq!(sa.allocation, sb.allocation);
        assert_eq!(sa.reserved_bytes, sb.reserved_bytes);
        assert_eq!(sb.host_alloc_time.count, 5);
        assert_eq!(b.live_blocks(), 5);
    }

    #[test]
    fn the_reserve_segment_serves_misses_before_fresh_memory() {
        let mut c = core(HostConfig {
            pinned_reserve_segment_size_mb: 4,
            ..HostConfig::default()
        });
        assert_eq!(c.try_cached(MIB).unwrap(), None);
        let Lookup::Hit(block) = c.lookup_miss(MIB).unwrap() else {
            panic!("expected a carve from the reserve segment");
        };
        assert_eq!(block.size, MIB);
        assert_eq!(c.stats().segment.current, 1, "the reserve segment only");
        assert!(
            matches!(c.lookup_miss(8 * MIB).unwrap(), Lookup::Fresh(r) if r.bytes() == 8 * MIB)
        );
        assert_eq!(c.try_cached(0), Err(HostError::ZeroSize));
        assert!(matches!(
            c.lookup_miss(u64::MAX - 100),
            Err(HostError::TooLarge { .. })
        ));
    }
}
