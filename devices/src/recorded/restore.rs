//! Rebuilding a recorded allocator state: a segment with its live blocks at given offsets,
//! the gaps between them free and cached. Trace replays use it to start from the state
//! PyTorch had when recording began (`gpualloc replay --warm`).

use gpualloc_runtime::{DevicePtr, StreamHandle};

use crate::blocks::block::{Block, BlockId};
use crate::blocks::segment_table::SegmentMeta;
use crate::core::{DeviceCore, MemPoolId, LARGE_POOL, SMALL_POOL};
use crate::error::AllocError;

/// A live block of a segment to restore.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RestoredBlock {
    /// Start address, inside the segment.
    pub addr: u64,
    /// Block size (the rounded size, or more when PyTorch did not split the remainder).
    pub size: u64,
    /// Bytes the user asked for.
    pub requested: u64,
}

/// The pool a restored segment joins: the small or large pool of the device's default pools
/// or of a private pool (which must exist and not be released).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RestorePool {
    /// The private pool, `None` for the default pools.
    pub private: Option<MemPoolId>,
    /// Its small pool (else its large pool).
    pub small: bool,
}

impl RestorePool {
    /// The device's default small or large pool.
    pub fn default_pool(small: bool) -> Self {
        RestorePool {
            private: None,
            small,
        }
    }
}

impl DeviceCore {
    /// The block pool `target` names.
    pub(crate) fn restore_pool_index(&self, target: RestorePool) -> Result<usize, AllocError> {
        match target.private {
            None => Ok(if target.small { SMALL_POOL } else { LARGE_POOL }),
            Some(id) => match self.private.get(id.0) {
                Some(p) if !p.released => Ok(if target.small { p.small } else { p.large }),
                _ => Err(AllocError::UnknownPool(id.0)),
            },
        }
    }

    /// Allocates a segment of `size` bytes from the backend and fills it with `live` blocks
    /// (addresses relative to `base`, sorted, non-overlapping), the gaps becoming free cached
    /// blocks. Returns where the backend put the segment; live blocks are at the same offsets
    /// from it, in the pool `target` names. Restored segments are not counted as device
    /// allocations in the stats (they are in the reserved and allocated bytes, and in a
    /// private pool's usage).
    pub fn restore_segment(
        &mut self,
        base: u64,
        size: u64,
        stream: StreamHandle,
        target: RestorePool,
        live: &[RestoredBlock],
    ) -> Result<DevicePtr, AllocError> {
        let invalid = |reason: &'static str| AllocError::InvalidSize { size, reason };
        let pool = self.restore_pool_index(target)?;
        let small = target.small;
        if stream.device != self.device {
            return Err(AllocError::WrongDevice {
                expected: self.device,
                got: stream.device,
            });
        }
        let end = base.checked_add(size).ok_or(invalid("segment overflows"))?;
        let mut cursor = base;
        for b in live {
            let b_end = b
                .addr
                .checked_add(b.size)
                .ok_or(invalid("block overflows"))?;
            if b.size == 0 || b.addr < cursor || b_end > end {
                return Err(invalid(
                    "restored blocks must be sorted, disjoint and inside the segment",
                ));
            }
            cursor = b_end;
        }
        let ptr = self.backend.malloc(self.device, size)?;
        let shift = |addr: u64| addr - base + ptr.0;
        // Lay out the chain: gaps become free blocks.
        let mut pieces: Vec<(u64, u64, Option<u64>)> = Vec::with_capacity(live.len() * 2 + 1);
        let mut cursor = base;
        for b in live {
            if b.addr > cursor {
                pieces.push((cursor, b.addr - cursor, None));
            }
            pieces.push((b.addr, b.size, Some(b.requested)));
            cursor = b.addr + b.size;
        }
        if cursor < end {
            pieces.push((cursor, end - cursor, None));
        }
        let split = pieces.len() > 1;
        let mut prev: Option<BlockId> = None;
        for (addr, bsize, requested) in pieces {
            let block = Block::in_segment(ptr.0, shift(addr), bsize, stream, pool);
            let id = match prev {
                Some(p) => self.blocks.insert_after(p, block),
                None => self.blocks.insert(block),
            };
            prev = Some(id);
            match requested {
                Some(req) => {
                    self.blocks.get_mut(id).allocate(req, self.spill.tick());
                    self.active.insert(shift(addr), id);
                    self.book_allocated(pool, small, bsize, req);
                }
                None => {
                    self.pools[pool].file_free(self.blocks.get(id), id);
                    if split {
                        self.book_inactive_split_grew(small, 1, bsize);
                    }
                }
            }
        }
        self.book_segment(ptr.0, SegmentMeta { size, pool, stream });
        Ok(ptr)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use gpualloc_accounting::AccountingBackend;
    use gpualloc_runtime::{Backend, DeviceId};

    use super::*;
    use crate::AllocatorConfig;

    #[test]
    fn restored_segment_serves_the_gap_and_frees_merge() {
        let backend = Arc::new(AccountingBackend::new(1, 1 << 40));
        let dynb: Arc<dyn Backend> = backend.clone();
        let s = dynb.stream_create(DeviceId(0)).unwrap();
        let mut core = DeviceCore::new(dynb, DeviceId(0), AllocatorConfig::default()).unwrap();
        let base = 0x7000_4000_0000;
        backend.place_next(DeviceId(0), base);
        let mib = 1 << 20;
        let live = [
            RestoredBlock {
                addr: base + 2 * mib,
                size: 4 * mib,
                requested: 4 * mib - 100,
            },
            RestoredBlock {
                addr: base + 10 * mib,
                size: 2 * mib,
                requested: 2 * mib,
            },
        ];
        let ptr = core
            .restore_segment(base, 20 * mib, s, RestorePool::default_pool(false), &live)
            .unwrap();
        assert_eq!(ptr.0, base);
        core.check_invariants().unwrap();
        assert_eq!(core.stats().allocated_bytes[0].current, 6 * mib);
        assert_eq!(core.stats().inactive_split[0].current, 3);
        // Best fit: a 2 MiB request takes the 2 MiB gap at the start.
        assert_eq!(core.malloc(2 * mib, s).unwrap().ptr.0, base);
        core.free(DevicePtr(base + 2 * mib)).unwrap();
        core.free(DevicePtr(base + 10 * mib)).unwrap();
        core.check_invariants().unwrap();
        assert_eq!(
            core.stats().inactive_split[0].current,
            1,
            "all free space merged into one block"
        );
        let bad = [RestoredBlock {
            addr: base - 1,
            size: 1,
            requested: 1,
        }];
        assert!(core
            .restore_segment(base, mib, s, RestorePool::default_pool(true), &bad)
            .is_err());
    }
}
