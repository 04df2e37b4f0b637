//! [`HostStats`]: the pinned-host allocator's statistics, with PyTorch's host keys
//! (`torch.cuda.host_memory_stats()`), plus the byte counts that make them checkable.
//!
//! Meaning of each key here (PyTorch's own are approximate per-bucket sums; ours are exact):
//! - `allocation`, `allocated_bytes`: blocks handed out and not yet reusable — in use, or freed
//!   but waiting for stream events — and their bytes (block sizes, after rounding).
//! - `segment`, `reserved_bytes`: memory held from the backend: one segment per fresh block,
//!   plus the reserve segment (whole) once it exists.
//! - `num_host_alloc`, `num_host_free`: backend allocations and releases (`host_alloc` or
//!   mmap + `host_register`; `host_free` or `host_unregister` + munmap).
//! - `host_alloc_time`, `host_free_time`: time spent in those calls, in microseconds.
//! - `cached_bytes`: bytes of free blocks ready for reuse; `reserve_unused_bytes`: bytes of
//!   the reserve segment not in any block (padding to 4 KiB and the uncarved tail).
//!
//! Invariant: `reserved_bytes.current = allocated_bytes.current + cached_bytes +
//! reserve_unused_bytes`.

use std::collections::BTreeMap;
use std::time::Duration;

pub use gpualloc_runtime::stat::Stat;

/// Durations of a kind of call, as PyTorch's `DurationStat`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DurationStat {
    /// Sum of all durations.
    pub total: Duration,
    /// Longest.
    pub max: Duration,
    /// Shortest (zero when `count` is 0).
    pub min: Duration,
    /// Number of calls.
    pub count: u64,
}

impl DurationStat {
    /// Records one call lasting `d`.
    pub fn record(&mut self, d: Duration) {
        self.min = if self.count == 0 || self.min.is_zero() {
            d
        } else {
            self.min.min(d)
        };
        self.max = self.max.max(d);
        self.total += d;
        self.count += 1;
    }

    /// Mean duration (zero when `count` is 0).
    pub fn avg(&self) -> Duration {
        if self.count == 0 {
            Duration::ZERO
        } else {
            self.total / self.count.min(u64::from(u32::MAX)) as u32
        }
    }

    /// Forgets max and min: the next recorded call sets both.
    pub fn reset_peak(&mut self) {
        self.max = Duration::ZERO;
        self.min = Duration::ZERO;
    }
}

/// Statistics of the pinned-host allocator. See the module docs for each key.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HostStats {
    /// Blocks in use or waiting for stream events.
    pub allocation: Stat,
    /// Backend allocations held (fresh blocks plus the reserve segment).
    pub segment: Stat,
    /// Bytes of `allocation`.
    pub allocated_bytes: Stat,
    /// Bytes of `segment`.
    pub reserved_bytes: Stat,
    /// Backend allocations made (`segment.allocated`).
    pub num_host_alloc: u64,
    /// Backend releases made (`segment.freed`).
    pub num_host_free: u64,
    /// Time in backend allocations.
    pub host_alloc_time: DurationStat,
    /// Time in backend releases.
    pub host_free_time: DurationStat,
    /// Bytes of free blocks ready for reuse.
    pub cached_bytes: u64,
    /// Bytes of the reserve segment outside every block.
    pub reserve_unused_bytes: u64,
}

impl HostStats {
    /// The stats as PyTorch's flat `host_memory_stats()` keys (`"allocation.current"`,
    /// `"host_alloc_time.total"` in microseconds, `"num_host_alloc"`, ...), plus
    /// `"cached_bytes"` and `"reserve_unused_bytes"`.
    pub fn as_map(&self) -> BTreeMap<String, u64> {
        let mut m = BTreeMap::new();
        for (name, s) in [
            ("allocation", &self.allocation),
            ("segment", &self.segment),
            ("allocated_bytes", &self.allocated_bytes),
            ("reserved_bytes", &self.reserved_bytes),
        ] {
            m.insert(format!("{name}.current"), s.current);
            m.insert(format!("{name}.peak"), s.peak);
            m.insert(format!("{name}.allocated"), s.allocated);
            m.insert(format!("{name}.freed"), s.freed);
        }
        for (name, d) in [
            ("host_alloc_time", &self.host_alloc_time),
            ("host_free_time", &self.host_free_time),
        ] {
            m.insert(format!("{name}.total"), d.total.as_micros() as u64);
            m.insert(format!("{name}.max"), d.max.as_micros() as u64);
            m.insert(format!("{name}.min"), d.min.as_micros() as u64);
            m.insert(format!("{name}.count"), d.count);
            m.insert(format!("{name}.avg"), d.avg().as_micros() as u64);
        }
        m.insert("num_host_alloc".into(), self.num_host_alloc);
        m.insert("num_host_free".into(), self.num_host_free);
        m.insert("cached_bytes".into(), self.cached_bytes);
        m.insert("reserve_unused_bytes".into(), self.reserve_unused_bytes);
        m
    }

    /// Sets every peak to its current value.
    pub fn reset_peak(&mut self) {
        for s in [
            &mut self.allocation,
            &mut self.segment,
            &mut self.allocated_bytes,
            &mut self.reserved_bytes,
        ] {
            s.reset_peak();
        }
        self.host_alloc_time.reset_peak();
        self.host_free_time.reset_peak();
    }

    /// Zeroes the accumulated totals (the current values and peaks stay).
    pub fn reset_accumulated(&mut self) {
        for s in [
            &mut self.allocation,
            &mut self.segment,
            &mut self.allocated_bytes,
            &mut self.reserved_bytes,
        ] {
            s.reset_accumulated();
        }
        self.num_host_alloc = 0;
        self.num_host_free = 0;
        self.host_alloc_time = DurationStat::default();
        self.host_free_time = DurationStat::default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_tracks_current_peak_and_totals() {
        let mut s = Stat::default();
        s.increase(5);
        s.increase(3);
        s.decrease(6);
        assert_eq!(
            s,
            Stat {
                current: 2,
                peak: 8,
                allocated: 8,
                freed: 6
            }
        );
        s.reset_peak();
        assert_eq!(s.peak, 2);
        s.reset_accumulated();
        assert_eq!((s.allocated, s.freed, s.current), (0, 0, 2));
    }

    #[test]
    fn duration_stat_and_map_keys() {
        let mut d = DurationStat::default();
        d.record(Duration::from_micros(10));
        d.record(Duration::from_micros(30));
        assert_eq!(
            (d.min, d.max, d.count),
            (Duration::from_micros(10), Duration::from_micros(30), 2)
        );
        assert_eq!(d.avg(), Duration::from_micros(20));
        let stats = HostStats {
            host_alloc_time: d,
            num_host_alloc: 2,
            ..HostStats::default()
        };
        let m = stats.as_map();
        assert_eq!(m["host_alloc_time.total"], 40);
        assert_eq!(m["num_host_alloc"], 2);
        assert!(m.contains_key("allocated_bytes.peak") && m.contains_key("segment.freed"));
    }
}
