//! Allocator statistics with PyTorch's key set (`torch.cuda.memory_stats()`).
//!
//! Each [`Stat`] tracks current, peak, allocated (sum of increases) and freed (sum of
//! decreases); array stats are kept for all pools, the small pool and the large pool.

/// Which pools a stat array entry covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StatType {
    /// Both pools.
    All = 0,
    /// The small pool (blocks of at most 1 MiB).
    Small = 1,
    /// The large pool.
    Large = 2,
}

use std::collections::BTreeMap;

pub use gpualloc_runtime::stat::Stat;

/// A stat per [`StatType`]: read it with [`StatArray::all`], [`StatArray::small`] and
/// [`StatArray::large`] (or index it by a `StatType`; indexing by 0/1/2 still works).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StatArray(pub [Stat; 3]);

impl StatArray {
    /// Both pools together (PyTorch's `.all.` keys).
    pub fn all(&self) -> &Stat {
        &self.0[StatType::All as usize]
    }

    /// The small pool: blocks of at most 1 MiB (`.small_pool.`).
    pub fn small(&self) -> &Stat {
        &self.0[StatType::Small as usize]
    }

    /// The large pool (`.large_pool.`).
    pub fn large(&self) -> &Stat {
        &self.0[StatType::Large as usize]
    }
}

impl std::ops::Deref for StatArray {
    type Target = [Stat; 3];

    fn deref(&self) -> &[Stat; 3] {
        &self.0
    }
}

impl std::ops::DerefMut for StatArray {
    fn deref_mut(&mut self) -> &mut [Stat; 3] {
        &mut self.0
    }
}

impl std::ops::Index<usize> for StatArray {
    type Output = Stat;

    fn index(&self, i: usize) -> &Stat {
        &self.0[i]
    }
}

impl std::ops::IndexMut<usize> for StatArray {
    fn index_mut(&mut self, i: usize) -> &mut Stat {
        &mut self.0[i]
    }
}

impl std::ops::Index<StatType> for StatArray {
    type Output = Stat;

    fn index(&self, t: StatType) -> &Stat {
        &self.0[t as usize]
    }
}

/// Every statistic of one device allocator.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeviceStats {
    /// Live allocations handed to users.
    pub allocation: StatArray,
    /// Segments held from the backend.
    pub segment: StatArray,
    /// Active blocks: allocated, or freed but waiting on stream events.
    pub active: StatArray,
    /// Free blocks that are part of a split segment (cannot be released).
    pub inactive_split: StatArray,
    /// Bytes of live allocations (rounded sizes).
    pub allocated_bytes: StatArray,
    /// Bytes of segments held from the backend.
    pub reserved_bytes: StatArray,
    /// Bytes of active blocks.
    pub active_bytes: StatArray,
    /// Bytes of free blocks in split segments.
    pub inactive_split_bytes: StatArray,
    /// Bytes users asked for (before rounding).
    pub requested_bytes: StatArray,
    /// Times the allocator released all cached memory and retried a failed device malloc.
    pub num_alloc_retries: u64,
    /// Out-of-memory errors returned.
    pub num_ooms: u64,
    /// Times all pending stream events were synchronized (`empty_cache`, OOM retry).
    pub num_sync_all_streams: u64,
    /// Successful device mallocs (and expandable-segment maps).
    pub num_device_alloc: u64,
    /// Device frees (and expandable-segment unmaps).
    pub num_device_free: u64,
    /// Live allocations of at least `max_split_size`.
    pub oversize_allocations: Stat,
    /// Segments of at least `max_split_size`.
    pub oversize_segments: Stat,
    /// The configured `max_split_size` in bytes, -1 when unlimited (PyTorch's
    /// `max_split_size` key: its `size_t` maximum read as `int64`). Set by the core; resets
    /// leave it alone.
    pub max_split_size: i64,
    /// Frees the `debug_cross_stream_frees` check reported (gpualloc's own counter: not one of
    /// PyTorch's keys, so not in [`DeviceStats::to_flat`]). Reset with the accumulated stats.
    pub num_cross_stream_frees: u64,
}

impl DeviceStats {
    /// Resets every peak to its current value (`reset_peak_memory_stats`).
    pub fn reset_peak(&mut self) {
        for arr in self.arrays_mut() {
            arr.iter_mut().for_each(Stat::reset_peak);
        }
        self.oversize_allocations.reset_peak();
        self.oversize_segments.reset_peak();
    }

    /// Resets the allocated/freed sums and the event counters (`reset_accumulated_memory_stats`).
    pub fn reset_accumulated(&mut self) {
        for arr in self.arrays_mut() {
            arr.iter_mut().for_each(Stat::reset_accumulated);
        }
        self.oversize_allocations.reset_accumulated();
        self.oversize_segments.reset_accumulated();
        self.num_alloc_retries = 0;
        self.num_ooms = 0;
        self.num_sync_all_streams = 0;
        self.num_device_alloc = 0;
        self.num_device_free = 0;
        self.num_cross_stream_frees = 0;
    }

    fn arrays_mut(&mut self) -> [&mut StatArray; 9] {
        [
            &mut self.allocation,
            &mut self.segment,
            &mut self.active,
            &mut self.inactive_split,
            &mut self.allocated_bytes,
            &mut self.reserved_bytes,
            &mut self.active_bytes,
            &mut self.inactive_split_bytes,
            &mut self.requested_bytes,
        ]
    }

    /// The stats as PyTorch's flat `memory_stats()` dictionary: the same 122 keys (e.g.
    /// `allocated_bytes.all.current`, `num_alloc_retries`, `max_split_size`), and values as
    /// PyTorch's `int64` (so `max_split_size` is -1 when unlimited).
    pub fn to_flat(&self) -> BTreeMap<String, i64> {
        let mut out = BTreeMap::new();
        let arrays: [(&str, &StatArray); 9] = [
            ("allocation", &self.allocation),
            ("segment", &self.segment),
            ("active", &self.active),
            ("inactive_split", &self.inactive_split),
            ("allocated_bytes", &self.allocated_bytes),
            ("reserved_bytes", &self.reserved_bytes),
            ("active_bytes", &self.active_bytes),
            ("inactive_split_bytes", &self.inactive_split_bytes),
            ("requested_bytes", &self.requested_bytes),
        ];
        for (name, arr) in arrays {
            for (pool, s) in ["all", "small_pool", "large_pool"].iter().zip(arr.iter()) {
                push_stat(&mut out, &format!("{name}.{pool}"), s);
            }
        }
        push_stat(&mut out, "oversize_allocations", &self.oversize_allocations);
        push_stat(&mut out, "oversize_segments", &self.oversize_segments);
        let counters = [
            ("num_alloc_retries", self.num_alloc_retries),
            ("num_ooms", self.num_ooms),
            ("num_sync_all_streams", self.num_sync_all_streams),
            ("num_device_alloc", self.num_device_alloc),
            ("num_device_free", self.num_device_free),
        ];
        for (name, v) in counters {
            out.insert(name.into(), as_i64(v));
        }
        out.insert("max_split_size".into(), self.max_split_size);
        out
    }
}

/// PyTorch's values are `int64`; counts and bytes never reach 2^63.
fn as_i64(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

fn push_stat(out: &mut BTreeMap<String, i64>, prefix: &str, s: &Stat) {
    out.insert(format!("{prefix}.current"), as_i64(s.current));
    out.insert(format!("{prefix}.peak"), as_i64(s.peak));
    out.insert(format!("{prefix}.allocated"), as_i64(s.allocated));
    out.insert(format!("{prefix}.freed"), as_i64(s.freed));
}

/// Applies `f` to the entries of `arr` for `All` and the pool's own type.
pub(crate) fn for_pool(arr: &mut StatArray, small: bool, f: impl Fn(&mut Stat)) {
    f(&mut arr[StatType::All as usize]);
    f(&mut arr[if small {
        StatType::Small
    } else {
        StatType::Large
    } as usize]);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_tracks_peak_and_sums_and_resets() {
        let mut s = DeviceStats::default();
        for_pool(&mut s.allocated_bytes, true, |x| x.increase(100));
        for_pool(&mut s.allocated_bytes, true, |x| x.decrease(60));
        for_pool(&mut s.allocated_bytes, false, |x| x.increase(10));
        let all = s.allocated_bytes[StatType::All as usize];
        assert_eq!(
            (all.current, all.peak, all.allocated, all.freed),
            (50, 100, 110, 60)
        );
        assert_eq!(s.allocated_bytes[StatType::Small as usize].current, 40);
        assert_eq!(s.allocated_bytes[StatType::Large as usize].current, 10);
        s.reset_peak();
        assert_eq!(s.allocated_bytes[0].peak, 50);
        s.num_ooms = 3;
        s.reset_accumulated();
        assert_eq!(
            (
                s.allocated_bytes[0].allocated,
                s.allocated_bytes[0].freed,
                s.num_ooms
            ),
            (0, 0, 0)
        );
        let flat = s.to_flat();
        assert_eq!(flat["allocated_bytes.all.current"], 50);
        assert!(flat.contains_key("requested_bytes.large_pool.peak"));
        assert_eq!(flat.len(), 9 * 3 * 4 + 2 * 4 + 6);
    }

    /// PyTorch's `torch.cuda.memory_stats()` keys (its `memoryStats` in `Module.cpp`): the nine
    /// pool-broken stats, the two oversize stats, five counters and `max_split_size`: 122.
    #[test]
    fn flat_keys_are_pytorchs_122() {
        let mut want: Vec<String> = Vec::new();
        for name in [
            "allocation",
            "segment",
            "active",
            "inactive_split",
            "allocated_bytes",
            "reserved_bytes",
            "active_bytes",
            "inactive_split_bytes",
            "requested_bytes",
        ] {
            for pool in ["all", "small_pool", "large_pool"] {
                for metric in ["current", "peak", "allocated", "freed"] {
                    want.push(format!("{name}.{pool}.{metric}"));
                }
            }
        }
        for name in ["oversize_allocations", "oversize_segments"] {
            for metric in ["current", "peak", "allocated", "freed"] {
                want.push(format!("{name}.{metric}"));
            }
        }
        for name in [
            "num_alloc_retries",
            "num_ooms",
            "max_split_size",
            "num_sync_all_streams",
            "num_device_alloc",
            "num_device_free",
        ] {
            want.push(name.to_string());
        }
        want.sort();
        assert_eq!(want.len(), 122);
        let got: Vec<String> = DeviceStats::default().to_flat().into_keys().collect();
        assert_eq!(got, want);
    }

    #[test]
    fn named_accessors_read_the_pool_entries() {
        let mut s = DeviceStats::default();
        for_pool(&mut s.reserved_bytes, true, |x| x.increase(2 << 20));
        for_pool(&mut s.reserved_bytes, false, |x| x.increase(20 << 20));
        assert_eq!(s.reserved_bytes.all().current, 22 << 20);
        assert_eq!(s.reserved_bytes.small().current, 2 << 20);
        assert_eq!(s.reserved_bytes.large().current, 20 << 20);
        assert_eq!(s.reserved_bytes[StatType::Large].current, 20 << 20);
    }
}
