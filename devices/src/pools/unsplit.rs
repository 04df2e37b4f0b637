//! Pools of unsplit blocks aligned to a granularity, for NCCL's NVLS and symmetric-memory
//! registration: a buffer must start at offset 0 of a range registered on its own, the same
//! on every rank, which split blocks break (pytorch#148374).
//!
//! - [`PoolOptions::unsplit`](crate::PoolOptions)`: Some(g)`: `g` a power of two and a multiple of
//!   the backend's virtual-memory granularity (2 MiB on current GPUs); the pool needs
//!   `expandable_segments:True` (its ranges are virtual memory). Otherwise its mallocs fail
//!   with [`AllocError::NotSupported`] (the facade refuses such a pool when creating it).
//! - A request of the pool is rounded up to a multiple of `g` and gets a range of its own:
//!   a reservation of exactly that size, aligned to `g`, mapped by one physical handle (one
//!   [`SegmentEvent`](crate::SegmentEvent) `Map` with the block's own address and size).
//! - Its block is never split and never merged with another; once freed it serves only a
//!   request of the same rounded size on the same stream, else the request gets a new range.
//! - Everything else is a named pool's: quota, statistics, release (the range is unmapped and
//!   its reservation freed), sleep and wake.

use gpualloc_runtime::BackendError;

use crate::core::{AllocParams, DeviceCore};
use crate::error::AllocError;
use crate::pools::pool_state::PoolState;
use crate::pools::private::PrivatePool;

impl DeviceCore {
    /// The granularity of the unsplit blocks of block pool `index`, if its pool keeps them.
    pub(crate) fn unsplit_of(&self, index: usize) -> Option<u64> {
        let id = self.owner_of(index)?;
        match self.private.get(id.0)?.unsplit {
            Some(Ok(g)) => Some(g),
            _ => None,
        }
    }

    /// `g` if it can be a pool's granularity of unsplit blocks on this device, else why not.
    pub(crate) fn unsplit_granularity(&self, g: u64) -> Result<u64, &'static str> {
        if !self.config.expandable_segments {
            return Err("a pool of unsplit blocks needs expandable_segments:True");
        }
        let granularity = self.backend.vmm_granularity(self.device).map_err(|e| match e {
            BackendError::NotSupported(_) => {
                "the backend has no virtual memory for a pool of unsplit blocks"
            }
            // The device has virtual memory (it was asked before), but could not answer now:
            // not a missing feature, and not said to be one.
            _ => "the device's virtual-memory granularity could not be read (device lost or unavailable)",
        })?;
        if !g.is_power_of_two() || g % granularity != 0 {
            return Err("unsplit: the granularity must be a power of two and a multiple of the device's (2 MiB)");
        }
        Ok(g)
    }

    /// Checks `options` as [`DeviceCore::create_named_pool`] would take them: the error a
    /// pool with them would fail its mallocs with.
    pub fn check_pool_options(&self, options: &crate::PoolOptions) -> Result<(), AllocError> {
        match options.unsplit.map(|g| self.unsplit_granularity(g)) {
            Some(Err(why)) => Err(AllocError::NotSupported(why)),
            _ => Ok(()),
        }
    }

    /// Whether block pool `index` still serves a miss whose driver calls ran off the core
    /// (others used the core meanwhile): `PoolAsleep` when its named pool began to sleep
    /// (`sleep.rs`); `UnknownPool` when its pool was released and forgotten, which happens
    /// only to a cancelled request's miss (a live request holds its pool): the memory it
    /// would bring in would be in a pool no release looks at again.
    pub(crate) fn check_serves(&self, index: usize) -> Result<(), AllocError> {
        let Some(id) = self.owner_of(index) else {
            return Ok(());
        };
        match self.private.get(id.0) {
            Some(p) => awake(p),
            None => Err(AllocError::UnknownPool(id.0)),
        }
    }

    /// The rules a named pool sets for a request, in one lookup (the default pools pay one
    /// comparison): a pool that is not awake serves none (`sleep.rs`); a pool of unsplit
    /// blocks rounds its size up to the pool's granularity, in its large block pool, or fails
    /// when its granularity could not be taken.
    pub(crate) fn apply_pool_rules(&self, params: &mut AllocParams) -> Result<(), AllocError> {
        let Some(id) = self.owner_of(params.pool) else {
            return Ok(());
        };
        let Some(p) = self.private.get(id.0) else {
            return Ok(());
        };
        awake(p)?;
        let g = match p.unsplit {
            None => return Ok(()),
            Some(Err(why)) => return Err(AllocError::NotSupported(why)),
            Some(Ok(g)) => g,
        };
        let rounded = params
            .size
            .checked_next_multiple_of(g)
            .ok_or(AllocError::InvalidSize {
                size: params.size,
                reason: "overflows when rounded to the pool's granularity",
            })?;
        params.size = rounded;
        params.alloc_size = rounded;
        params.pool = p.large;
        Ok(())
    }
}

/// `PoolAsleep` unless pool `p` is awake.
fn awake(p: &PrivatePool) -> Result<(), AllocError> {
    if p.usage.state != PoolState::Awake {
        return Err(AllocError::PoolAsleep {
            pool: p.usage.name.clone(),
            state: p.usage.state,
        });
    }
    Ok(())
}
