//! Named private pools with a quota: what an inference server asks for (weights in one pool,
//! the KV cache in another), on top of PyTorch's `MemPool` (the private pools, whose primitives open this file).
//!
//! - A pool's blocks come from segments it allocated itself and go back to it: a request of
//!   another pool (or of the default pools) never gets one. The one exception is PyTorch's
//!   `use_on_oom`: a pool created with it lends its free blocks to any request of the device
//!   that would otherwise fail (the block still belongs to the pool and returns to it).
//! - A request names its pool ([`DeviceCore::try_cached_in`], [`DeviceCore::malloc_in`]);
//!   PyTorch's stream routing (`begin_allocate_to_pool`) works for these pools too.
//! - Under `expandable_segments` a named pool grows expandable segments of its own (PyTorch's
//!   unnamed private pools keep taking whole segments); otherwise whole segments, so a 1 KiB
//!   request reserves a 2 MiB small segment, as PyTorch's pools do.
//! - A quota caps the bytes a pool reserves (its segments or mapped pages, counting what is
//!   being obtained off the core for it). A miss that would pass it first returns the pool's
//!   own cached whole segments or wholly free pages to the device (never another pool's),
//!   then fails with [`AllocError::PoolQuota`], which names the pool, its quota and its
//!   usage.
//! - Usage per pool (reserved and allocated bytes, current and peak, segments):
//!   [`DeviceCore::pool_usage`]. The device's statistics count every pool, so they stay the
//!   sum of the default pools and the private ones.
//! - Like PyTorch's pools, a pool's cached segments are not returned by `empty_cache` until
//!   the pool is released ([`DeviceCore::release_pool`]).
//! - A dropped stream's free segments in a named pool become orphans of that pool
//!   (`orphans.rs`): they serve the pool's requests on other streams.

pub(crate) mod capture;
pub(crate) mod capture_state;
pub(crate) mod pool_records;
pub(crate) mod pool_state;
pub(crate) mod private;
pub(crate) mod sleep;
pub(crate) mod unsplit;

use gpualloc_runtime::StreamHandle;

use crate::blocks::pool::{BlockPool, PoolOwner};
use crate::core::{AllocParams, Allocation, DeviceCore, MemPoolId, LARGE_POOL, SMALL_POOL};
use crate::error::AllocError;
use crate::malloc::CachedOutcome;
use crate::pools::pool_records::{PoolOptions, PoolUsage};
use crate::pools::private::PrivatePool;

impl DeviceCore {
    /// Creates a private memory pool. With `use_on_oom`, its free blocks serve any request of
    /// this device that would otherwise fail.
    pub fn create_pool(&mut self, use_on_oom: bool) -> MemPoolId {
        let id = self.private.new_id();
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
                graphs: 0,
                launches: 0,
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
        if self.private.live(pool.0).is_none() {
            return Err(AllocError::UnknownPool(pool.0));
        }
        self.private.route(stream.raw, pool.0);
        Ok(())
    }

    /// Stops routing `stream`'s allocations to a private pool.
    pub fn end_allocate_to_pool(&mut self, stream: StreamHandle) {
        self.private.unroute(stream.raw);
    }

    /// Releases a private pool: no new allocations go to it, and its cached segments are
    /// returned by the next `empty_cache` (live allocations in it stay valid).
    pub fn release_pool(&mut self, pool: MemPoolId) -> Result<(), AllocError> {
        let p = self
            .private
            .get_mut(pool.0)
            .ok_or(AllocError::UnknownPool(pool.0))?;
        p.released = true;
        self.private.unroute_pool(pool.0);
        Ok(())
    }

    /// Creates a named private pool (see the module docs). Names need not be unique; the id
    /// is.
    pub fn create_named_pool(&mut self, name: &str, options: PoolOptions) -> MemPoolId {
        let unsplit = options.unsplit.map(|g| self.unsplit_granularity(g));
        let id = self.create_pool(options.use_on_oom);
        if let Some(p) = self.private.get_mut(id.0) {
            p.usage.name = name.to_string();
            p.usage.quota = options.quota;
            p.named = true;
            p.unsplit = unsplit;
        }
        id
    }

    /// What pool `pool` holds now; `None` for an unknown (or released and emptied) pool.
    pub fn pool_usage(&self, pool: MemPoolId) -> Option<PoolUsage> {
        self.private.get(pool.0).map(|p| p.usage.clone())
    }

    /// [`DeviceCore::try_cached`] for a request of `pool`.
    pub fn try_cached_in(
        &mut self,
        pool: MemPoolId,
        size: u64,
        stream: StreamHandle,
    ) -> Result<CachedOutcome, AllocError> {
        match self.private.get(pool.0) {
            Some(p) if !p.released => self.try_cached_routed(size, stream, Some(pool.0)),
            _ => Err(AllocError::UnknownPool(pool.0)),
        }
    }

    /// [`DeviceCore::malloc`] for a request of `pool`.
    pub fn malloc_in(
        &mut self,
        pool: MemPoolId,
        size: u64,
        stream: StreamHandle,
    ) -> Result<Allocation, AllocError> {
        match self.try_cached_in(pool, size, stream)? {
            CachedOutcome::Hit(a) => Ok(a),
            CachedOutcome::Miss(request) => self.malloc_after_miss(request),
        }
    }

    /// True when block pool `index` grows expandable segments: the default pools and named
    /// pools under `expandable_segments` (PyTorch's unnamed private pools take whole
    /// segments).
    pub(crate) fn pool_expands(&self, index: usize) -> bool {
        self.config.expandable_segments
            && match self.owner_of(index) {
                None => true,
                Some(id) => self.private.is_named(id.0),
            }
    }

    /// [`DeviceCore::quota_error`], counted as an out-of-memory error (a failed request).
    pub(crate) fn quota_failure(&mut self, params: &AllocParams, size: u64) -> Option<AllocError> {
        let e = self.quota_error(params, size)?;
        if !params.quiet_oom {
            self.count_oom_of(&e, params.size, params.stream);
        }
        Some(e)
    }

    /// Bytes the private pool owning block pool `index` may still reserve under its quota
    /// (counting what is being obtained for it off the core); `None` without a quota.
    pub(crate) fn pool_room(&self, index: usize) -> Option<u64> {
        let p = self.private.get(self.owner_of(index)?.0)?;
        let held = p.usage.reserved.all().current.saturating_add(p.claimed);
        Some(p.usage.quota?.saturating_sub(held))
    }

    /// The private pool owning block pool `index`, if any.
    pub(crate) fn owner_of(&self, index: usize) -> Option<MemPoolId> {
        match self.pools.get(index)?.owner {
            PoolOwner::Private(id) => Some(MemPoolId(id)),
            PoolOwner::Default => None,
        }
    }

    /// The usage of the private pool owning block pool `index`, if any.
    pub(crate) fn usage_mut(&mut self, index: usize) -> Option<&mut PoolUsage> {
        let id = self.owner_of(index)?;
        self.private.get_mut(id.0).map(|p| &mut p.usage)
    }

    /// The error of a request of `requested` bytes that a new segment for `params` would
    /// take past its pool's quota; `None` when it fits. For a pool of expandable segments the
    /// new memory is the request's rounded size (at most what its growth maps).
    pub(crate) fn quota_error(&self, params: &AllocParams, requested: u64) -> Option<AllocError> {
        let id = self.owner_of(params.pool)?;
        let p = self.private.get(id.0)?;
        let quota = p.usage.quota?;
        let reserved = p.usage.reserved.all().current;
        let held = reserved.saturating_add(p.claimed);
        let new = if self.pool_expands(params.pool) {
            params.size
        } else {
            params.alloc_size
        };
        (held.saturating_add(new) > quota).then(|| AllocError::PoolQuota {
            pool: p.usage.name.clone(),
            quota,
            reserved,
            requested,
            in_flight: p.claimed,
        })
    }

    /// The block pools (large, small) of the private pool owning block pool `index`.
    pub(crate) fn own_pools(&self, index: usize) -> Option<[usize; 2]> {
        let id = self.owner_of(index)?;
        self.private.get(id.0).map(|p| [p.large, p.small])
    }

    /// The block pools a release of cached memory covers, as `empty_cache`'s does: the
    /// default pools and released private pools. (A request at its pool's quota releases its
    /// own pools instead: the chain's `ReleaseOwnPool` link, with [`DeviceCore::own_pools`].)
    pub(crate) fn release_scope(&self) -> Vec<usize> {
        let mut pools = vec![LARGE_POOL, SMALL_POOL];
        pools.extend(
            self.private
                .values()
                .filter(|p| p.released)
                .flat_map(|p| [p.large, p.small]),
        );
        pools
    }

    /// Counts `bytes` as claimed off the core for the pool of block pool `index`
    /// (`claim`: true to add, false to remove).
    pub(crate) fn claim_for_pool(&mut self, index: usize, bytes: u64, claim: bool) {
        let Some(id) = self.owner_of(index) else {
            return;
        };
        if let Some(p) = self.private.get_mut(id.0) {
            p.claimed = if claim {
                p.claimed.saturating_add(bytes)
            } else {
                p.claimed.saturating_sub(bytes)
            };
        }
    }
}
