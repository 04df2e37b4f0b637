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

pub use gpualloc_runtime::stat::Stat;

/// A stat per [`StatType`].
pub type StatArray = [Stat; 3];

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

    /// The stats as PyTorch's flat `memory_stats()` dictionary, e.g.
    /// `allocated_bytes.all.current`, `num_alloc_retries`.
    pub fn to_flat(&self) -> Vec<(String, u64)> {
        let mut out = Vec::with_capacity(160);
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
        out.push(("num_alloc_retries".into(), self.num_alloc_retries));
        out.push(("num_ooms".into(), self.num_ooms));
        out.push(("num_sync_all_streams".into(), self.num_sync_all_streams));
        out.push(("num_device_alloc".into(), self.num_device_alloc));
        out.push(("num_device_free".into(), self.num_device_free));
        out
    }
}

fn push_stat(out: &mut Vec<(String, u64)>, prefix: &str, s: &Stat) {
    out.push((format!("{prefix}.current"), s.current));
    out.push((format!("{prefix}.peak"), s.peak));
    out.push((format!("{prefix}.allocated"), s.allocated));
    out.push((format!("{prefix}.freed"), s.freed));
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
        assert!(flat.contains(&("allocated_bytes.all.current".to_string(), 50)));
        assert!(flat
            .iter()
            .any(|(k, _)| k == "requested_bytes.large_pool.peak"));
        assert_eq!(flat.len(), 9 * 3 * 4 + 2 * 4 + 5);
    }
}
