//! Looking inside the core: snapshots of segments and blocks, the cross-stream frees
//! reported, and a full invariant check used by the property tests (and by debug assertions
//! in callers).

use std::collections::BTreeMap;

use crate::blocks::block::{BlockId, BlockState};
use crate::blocks::pool::PoolOwner;
use crate::core::{DeviceCore, MemPoolId};
use crate::ledger::cross_stream::CrossStreamFree;
use crate::ledger::snapshot::{BlockInfo, BlockStateName, DeviceSnapshot, PoolInfo, SegmentInfo};
use crate::ledger::stats::{DeviceStats, StatArray, StatType};
use crate::ledger::trace::TraceAction;
use crate::pools::pool_records::PoolOptions;

impl DeviceCore {
    /// The last [`CROSS_STREAM_LOG`](crate::CROSS_STREAM_LOG) frees the `debug_cross_stream_frees` check reported,
    /// oldest first (empty with the key off; `cross_stream.rs`).
    pub fn cross_stream_frees(&self) -> Vec<CrossStreamFree> {
        self.cross_stream.reports()
    }

    /// The segments of `pool` as in [`DeviceCore::snapshot`] (and no trace); `None` for an
    /// unknown pool.
    pub fn pool_snapshot(&self, pool: MemPoolId) -> Option<DeviceSnapshot> {
        self.private.get(pool.0)?;
        let mut snap = self.snapshot();
        snap.segments.retain(|s| s.pool_id == (0, pool.0));
        snap.pools.retain(|p| p.id == pool.0);
        snap.trace.clear();
        Some(snap)
    }

    /// Statistics of `pool` in the device's terms, for [`memory_summary`](crate::memory_summary):
    /// allocated and reserved bytes and segments as its usage tracks them (current, peak and
    /// totals); the other rows (active, requested, inactive split, allocation counts) from its
    /// blocks now, with the current value as peak and no totals (tracked per device only).
    pub fn pool_stats(&self, pool: MemPoolId) -> Option<DeviceStats> {
        let usage = self.pool_usage(pool)?;
        let snap = self.pool_snapshot(pool)?;
        let mut st = DeviceStats {
            max_split_size: self.stats.max_split_size,
            ..DeviceStats::default()
        };
        let set = |arr: &mut StatArray, small: bool, n: u64| {
            for i in [StatType::All as usize, 1 + usize::from(!small)] {
                arr.0[i].current += n;
                arr.0[i].peak = arr.0[i].peak.max(arr.0[i].current);
            }
        };
        for seg in &snap.segments {
            let small = seg.is_small;
            for b in &seg.blocks {
                let (live, active) = match b.state {
                    BlockStateName::ActiveAllocated => (true, true),
                    BlockStateName::ActivePendingFree => (false, true),
                    BlockStateName::Inactive => (false, false),
                };
                if live {
                    set(&mut st.allocation, small, 1);
                    set(&mut st.requested_bytes, small, b.requested_size);
                }
                if active {
                    set(&mut st.active, small, 1);
                    set(&mut st.active_bytes, small, b.size);
                } else if seg.blocks.len() > 1 && b.mapped {
                    set(&mut st.inactive_split, small, 1);
                    set(&mut st.inactive_split_bytes, small, b.size);
                }
            }
        }
        st.allocated_bytes = usage.allocated;
        st.reserved_bytes = usage.reserved;
        st.segment = usage.segments;
        Some(st)
    }

    /// Records a `snapshot` trace entry (when history is on): PyTorch's mark that a snapshot
    /// was taken here, to line snapshots up with the history (`size`: allocated bytes).
    pub fn record_snapshot_taken(&mut self) {
        let allocated = self.stats.allocated_bytes[StatType::All as usize].current;
        self.record(TraceAction::Snapshot, 0, allocated, 0);
    }

    /// The segments and blocks right now, plus the trace history.
    pub fn snapshot(&self) -> DeviceSnapshot {
        let mut by_segment: BTreeMap<u64, Vec<BlockId>> = BTreeMap::new();
        for (id, b) in self.blocks.iter() {
            by_segment.entry(b.segment()).or_default().push(id);
        }
        let mut segments = Vec::with_capacity(self.segments.len());
        for (&base, meta) in self.segments.iter() {
            let mut ids = by_segment.remove(&base).unwrap_or_default();
            ids.sort_by_key(|&id| self.blocks.get(id).addr());
            let asleep = self
                .expandable
                .get(base)
                .is_some_and(|es| es.slept.is_some());
            let infos: Vec<BlockInfo> = ids
                .iter()
                .map(|&id| {
                    let b = self.blocks.get(id);
                    BlockInfo {
                        address: b.addr(),
                        size: b.size(),
                        requested_size: b.requested(),
                        state: match b.state() {
                            BlockState::Allocated => BlockStateName::ActiveAllocated,
                            BlockState::Pending => BlockStateName::ActivePendingFree,
                            BlockState::Free | BlockState::Mapping | BlockState::Unmapping => {
                                BlockStateName::Inactive
                            }
                        },
                        // A sleeping pool's blocks keep their books but have no memory.
                        mapped: b.mapped() && !asleep,
                        frames: if b.state() == BlockState::Allocated {
                            self.history.frames_of(b.addr()).cloned()
                        } else {
                            None
                        },
                    }
                })
                .collect();
            let expandable = self.expandable.contains(base);
            // As PyTorch does, an expandable segment shows as one segment per mapped run.
            let runs: Vec<Vec<BlockInfo>> = if expandable {
                infos
                    .split(|b| !b.mapped)
                    .filter(|run| !run.is_empty())
                    .map(<[BlockInfo]>::to_vec)
                    .collect()
            } else {
                vec![infos]
            };
            let pool = &self.pools[meta.pool];
            for blocks in runs {
                let sum = |active: bool, allocated_only: bool, requested: bool| {
                    blocks
                        .iter()
                        .filter(|b| {
                            !active
                                || (b.state != BlockStateName::Inactive
                                    && (!allocated_only
                                        || b.state == BlockStateName::ActiveAllocated))
                        })
                        .map(|b| if requested { b.requested_size } else { b.size })
                        .sum::<u64>()
                };
                segments.push(SegmentInfo {
                    device: self.device.0,
                    address: blocks.first().map_or(base, |b| b.address),
                    total_size: sum(false, false, false),
                    allocated_size: sum(true, true, false),
                    active_size: sum(true, false, false),
                    requested_size: sum(true, false, true),
                    stream: meta.stream.raw,
                    is_small: pool.is_small,
                    pool_id: match pool.owner {
                        PoolOwner::Default => (0, 0),
                        PoolOwner::Private(id) => (0, id),
                    },
                    is_expandable: expandable,
                    blocks,
                });
            }
        }
        let trace = self.history.entries();
        let pools = self
            .private
            .iter()
            .filter(|(_, p)| !p.released)
            .map(|(&id, p)| PoolInfo {
                id,
                name: p.usage.name.clone(),
                named: p.named,
                options: PoolOptions {
                    quota: p.usage.quota,
                    use_on_oom: p.use_on_oom,
                    unsplit: p.unsplit.and_then(Result::ok),
                },
            })
            .collect();
        DeviceSnapshot {
            segments,
            trace,
            pools,
        }
    }

    /// Checks every structural invariant; returns a description of the first violation.
    ///
    /// - blocks tile each segment exactly, linked in address order, and no two overlap;
    /// - each free block is in its pool's set under its current key, and nothing else is;
    /// - allocated blocks are exactly the active map; pending blocks have events queued;
    /// - stats equal what the pools hold: segments, reserved, allocated, active, requested,
    ///   per pool kind.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut reserved = [0u64; 3];
        let mut segs = [0u64; 3];
        let mut allocated = [0u64; 3];
        let mut allocations = [0u64; 3];
        let mut active = [0u64; 3];
        let mut requested = [0u64; 3];
        let add = |arr: &mut [u64; 3], small: bool, v: u64| {
            arr[StatType::All as usize] += v;
            arr[if small {
                StatType::Small
            } else {
                StatType::Large
            } as usize] += v;
        };
        let mut free_seen = 0usize;
        let mut pending_blocks = 0usize;
        for (&base, meta) in self.segments.iter() {
            let small = self.pools[meta.pool].is_small;
            let es = self.expandable.get(base);
            match es {
                // Expandable segments count their mapped pages as reserved, and are not
                // counted as segments (as in PyTorch).
                Some(es) => add(&mut reserved, small, es.mapped_bytes()),
                None => {
                    add(&mut reserved, small, meta.size);
                    add(&mut segs, small, 1);
                }
            }
            // Find the head: the block at `base` with no prev.
            let head = self
                .blocks
                .iter()
                .find(|(_, b)| b.addr() == base && b.segment() == base)
                .map(|(id, _)| id)
                .ok_or_else(|| format!("segment {base:#x} has no head block"))?;
            let mut cursor = base;
            let mut prev: Option<BlockId> = None;
            let mut next = Some(head);
            while let Some(id) = next {
                let b = self.blocks.get(id);
                if b.addr() != cursor
                    || b.prev() != prev
                    || b.segment() != base
                    || b.pool() != meta.pool
                {
                    return Err(format!(
                        "block {id} at {:#x} breaks segment {base:#x}'s chain",
                        b.addr()
                    ));
                }
                if b.size() == 0 {
                    return Err(format!("empty block at {:#x}", b.addr()));
                }
                if b.expandable() != es.is_some() {
                    return Err(format!(
                        "block at {:#x} disagrees with its segment on expandability",
                        b.addr()
                    ));
                }
                if let Some(es) = es {
                    // Mapped blocks lie on mapped pages; unmapped blocks are whole unmapped pages.
                    if !es.booked_pages_are(b.addr(), b.size(), b.mapped()) {
                        return Err(format!(
                            "block at {:#x} (mapped: {}) crosses pages of the other kind",
                            b.addr(),
                            b.mapped()
                        ));
                    }
                    if !b.mapped() && ((b.addr() - base) % es.page != 0 || b.size() % es.page != 0)
                    {
                        return Err(format!(
                            "unmapped block at {:#x} is not page aligned",
                            b.addr()
                        ));
                    }
                    if !b.mapped()
                        && !matches!(
                            b.state(),
                            BlockState::Free | BlockState::Mapping | BlockState::Unmapping
                        )
                    {
                        return Err(format!("unmapped block at {:#x} is in use", b.addr()));
                    }
                }
                match b.state() {
                    BlockState::Mapping | BlockState::Unmapping => {
                        if b.mapped() || !b.expandable() {
                            return Err(format!(
                                "block at {:#x} being mapped is mapped or not expandable",
                                b.addr()
                            ));
                        }
                    }
                    BlockState::Free => {
                        free_seen += 1;
                        if !self.pools[b.pool()].holds(b, id) {
                            return Err(format!(
                                "free block at {:#x} missing from its pool",
                                b.addr()
                            ));
                        }
                        if b.event_count() != 0 {
                            return Err(format!("free block at {:#x} has events", b.addr()));
                        }
                    }
                    BlockState::Allocated => {
                        if self.active.get(b.addr()) != Some(id) {
                            return Err(format!(
                                "allocated block at {:#x} not in the active map",
                                b.addr()
                            ));
                        }
                        add(&mut allocated, small, b.size());
                        add(&mut allocations, small, 1);
                        add(&mut active, small, b.size());
                        add(&mut requested, small, b.requested());
                    }
                    BlockState::Pending => {
                        pending_blocks += 1;
                        if b.event_count() == 0 {
                            return Err(format!("pending block at {:#x} has no events", b.addr()));
                        }
                        add(&mut active, small, b.size());
                        add(&mut requested, small, b.requested());
                    }
                }
                cursor = b.end();
                prev = Some(id);
                next = b.next();
            }
            if cursor != base + meta.size {
                return Err(format!(
                    "segment {base:#x} tiles {:#x} of {:#x} bytes",
                    cursor - base,
                    meta.size
                ));
            }
        }
        let pooled: usize = self.pools.iter().map(|p| p.len()).sum();
        if pooled != free_seen {
            return Err(format!(
                "{pooled} pooled blocks but {free_seen} free blocks in segments"
            ));
        }
        if self.active.len() as u64 != allocations[0] {
            return Err(format!(
                "active map {} != allocated blocks {}",
                self.active.len(),
                allocations[0]
            ));
        }
        let queued: std::collections::HashSet<BlockId> = self.pending.blocks().collect();
        if queued.len() != pending_blocks {
            return Err(format!(
                "{} blocks queued on events, {pending_blocks} pending",
                queued.len()
            ));
        }
        if self.budget.reserved() != reserved[0] {
            return Err(format!(
                "total_reserved {} != segments {}",
                self.budget.reserved(),
                reserved[0]
            ));
        }
        let s = &self.stats;
        let checks: [(&str, [u64; 3], &crate::ledger::stats::StatArray); 6] = [
            ("reserved_bytes", reserved, &s.reserved_bytes),
            ("segment", segs, &s.segment),
            ("allocated_bytes", allocated, &s.allocated_bytes),
            ("allocation", allocations, &s.allocation),
            ("active_bytes", active, &s.active_bytes),
            ("requested_bytes", requested, &s.requested_bytes),
        ];
        for (name, want, got) in checks {
            for i in 0..3 {
                if got[i].current != want[i] {
                    return Err(format!(
                        "stat {name}[{i}] = {} but pools hold {}",
                        got[i].current, want[i]
                    ));
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use gpualloc_accounting::AccountingBackend;
    use gpualloc_runtime::{Backend, DeviceId};

    use crate::{AllocatorConfig, DeviceCore};

    fn core(conf: &str) -> (DeviceCore, gpualloc_runtime::StreamHandle) {
        let backend: Arc<dyn Backend> = Arc::new(AccountingBackend::new(1, 1 << 30));
        let s = backend.stream_create(DeviceId(0)).unwrap();
        let core =
            DeviceCore::new(backend, DeviceId(0), AllocatorConfig::parse(conf).unwrap()).unwrap();
        (core, s)
    }

    /// The checker bites: books that disagree with the pools are reported.
    #[test]
    fn broken_books_are_reported() {
        let (mut c, s) = core("");
        c.malloc(3 << 20, s).unwrap();
        c.check_invariants().unwrap();
        c.budget.reserve(1);
        assert!(c.check_invariants().unwrap_err().contains("total_reserved"));

        let (mut c, s) = core("");
        c.malloc(3 << 20, s).unwrap();
        c.stats.allocated_bytes[0].current += 512;
        assert!(c
            .check_invariants()
            .unwrap_err()
            .contains("allocated_bytes"));

        // Expandable pages taken away without the layout a sleep keeps: the blocks that say
        // they are mapped now lie on unmapped pages.
        let (mut c, s) = core("expandable_segments:True");
        c.malloc(3 << 20, s).unwrap();
        let seg = c.expandable.bases()[0];
        let es = c.expandable.get_mut(seg).unwrap();
        let runs = std::mem::take(&mut es.runs);
        let err = c.check_invariants().unwrap_err();
        assert!(err.contains("crosses pages"), "{err}");
        // With the layout kept (asleep), the books are consistent again, but for the bytes.
        let es = c.expandable.get_mut(seg).unwrap();
        es.slept = Some(runs);
        let err = c.check_invariants().unwrap_err();
        assert!(err.contains("total_reserved"), "{err}");
    }
}
