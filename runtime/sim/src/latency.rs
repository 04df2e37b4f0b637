//! The sim's latency model: what each driver call costs on real hardware.
//!
//! Costs are paid by sleeping the calling thread (never spinning). Sleeps shorter than the
//! OS timer slack (tens of µs) are inaccurate, so short costs accumulate as a per-thread debt
//! that is slept off once it exceeds [`SLEEP_QUANTUM`]; oversleeping is credited back. Over
//! many calls the average cost matches the model.

use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// Threads of this process sleeping in [`pay`] right now (all sims together).
static SLEEPING: AtomicUsize = AtomicUsize::new(0);

/// How many sim calls are paying their latency (sleeping) right now, in this process: lets a
/// benchmark tell which of its requests overlapped a slow call.
pub fn sleeping_now() -> usize {
    SLEEPING.load(Ordering::Acquire)
}

/// Latency debt below which a call does not sleep yet (see the module docs).
pub const SLEEP_QUANTUM: Duration = Duration::from_micros(100);

/// What each simulated driver call costs. [`LatencyModel::default`] approximates a current
/// data-center GPU; [`LatencyModel::zero`] makes every call free (fast tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LatencyModel {
    /// `malloc` (`cuMemAlloc`): ~50 µs.
    pub malloc: Duration,
    /// `free` after it has synchronized the device: ~10 µs.
    pub free: Duration,
    /// `mem_info`, `device_count`, `vmm_granularity`: ~1 µs.
    pub query: Duration,
    /// `stream_create` / `stream_destroy`: ~5 µs.
    pub stream: Duration,
    /// Event create / record / query / destroy, `stream_wait_event`: ~1 µs.
    pub event: Duration,
    /// Enqueueing work (kernel, memcpy, memset, host function): ~2 µs.
    pub launch: Duration,
    /// Stream-ordered copies, per GiB moved (on the stream's thread): ~40 ms (25 GB/s).
    pub copy_per_gib: Duration,
    /// `host_alloc` fixed cost: ~10 µs.
    pub host_alloc_base: Duration,
    /// `host_alloc` per MiB (pinning is proportional to size): ~0.3 ms.
    pub host_alloc_per_mib: Duration,
    /// `host_free` fixed cost: ~10 µs.
    pub host_free_base: Duration,
    /// `host_free` per MiB: ~0.05 ms.
    pub host_free_per_mib: Duration,
    /// `host_register` fixed cost: ~20 µs.
    pub host_register_base: Duration,
    /// `host_register` per GiB: ~60 ms.
    pub host_register_per_gib: Duration,
    /// `host_register` per OS memory mapping the range crosses: ~10 µs.
    pub host_register_per_mapping: Duration,
    /// `host_unregister`: ~20 µs.
    pub host_unregister: Duration,
    /// `va_reserve` / `va_free`: ~5 µs.
    pub va: Duration,
    /// `phys_create` / `phys_release`: ~30 µs.
    pub phys: Duration,
    /// `map` / `unmap`: ~10 µs each.
    pub map: Duration,
    /// `set_access`: ~20 µs.
    pub set_access: Duration,
    /// IPC and fd export/import: ~50 µs.
    pub ipc: Duration,
}

impl Default for LatencyModel {
    fn default() -> Self {
        let us = Duration::from_micros;
        LatencyModel {
            malloc: us(50),
            free: us(10),
            query: us(1),
            stream: us(5),
            event: us(1),
            launch: us(2),
            copy_per_gib: Duration::from_millis(40),
            host_alloc_base: us(10),
            host_alloc_per_mib: us(300),
            host_free_base: us(10),
            host_free_per_mib: us(50),
            host_register_base: us(20),
            host_register_per_gib: Duration::from_millis(60),
            host_register_per_mapping: us(10),
            host_unregister: us(20),
            va: us(5),
            phys: us(30),
            map: us(10),
            set_access: us(20),
            ipc: us(50),
        }
    }
}

impl LatencyModel {
    /// Every call free: for fast tests.
    pub fn zero() -> Self {
        let z = Duration::ZERO;
        LatencyModel {
            malloc: z,
            free: z,
            query: z,
            stream: z,
            event: z,
            launch: z,
            copy_per_gib: z,
            host_alloc_base: z,
            host_alloc_per_mib: z,
            host_free_base: z,
            host_free_per_mib: z,
            host_register_base: z,
            host_register_per_gib: z,
            host_register_per_mapping: z,
            host_unregister: z,
            va: z,
            phys: z,
            map: z,
            set_access: z,
            ipc: z,
        }
    }

    /// `base + per_unit * (bytes / unit)`, saturating.
    pub fn scaled(base: Duration, per_unit: Duration, bytes: u64, unit: u64) -> Duration {
        let nanos = per_unit.as_nanos().saturating_mul(u128::from(bytes)) / u128::from(unit.max(1));
        let extra = Duration::from_nanos(u64::try_from(nanos).unwrap_or(u64::MAX));
        base.saturating_add(extra)
    }

    /// Cost of `host_alloc(size)`.
    pub fn host_alloc_cost(&self, size: u64) -> Duration {
        Self::scaled(self.host_alloc_base, self.host_alloc_per_mib, size, 1 << 20)
    }

    /// Cost of `host_free` of `size` bytes.
    pub fn host_free_cost(&self, size: u64) -> Duration {
        Self::scaled(self.host_free_base, self.host_free_per_mib, size, 1 << 20)
    }

    /// Cost of `host_register` of `len` bytes crossing `mappings` OS mappings.
    pub fn host_register_cost(&self, len: u64, mappings: u64) -> Duration {
        Self::scaled(
            self.host_register_base,
            self.host_register_per_gib,
            len,
            1 << 30,
        )
        .saturating_add(
            self.host_register_per_mapping
                .saturating_mul(u32::try_from(mappings).unwrap_or(u32::MAX)),
        )
    }

    /// Cost of copying `len` bytes in stream order.
    pub fn copy_cost(&self, len: u64) -> Duration {
        Self::scaled(Duration::ZERO, self.copy_per_gib, len, 1 << 30)
    }
}

thread_local! {
    /// Latency owed by this thread, in nanoseconds (negative: credit from oversleeping).
    static DEBT_NANOS: Cell<i128> = const { Cell::new(0) };
}

/// Charges `cost` to the calling thread, sleeping once the accumulated debt reaches
/// [`SLEEP_QUANTUM`].
pub fn pay(cost: Duration) {
    if cost.is_zero() {
        return;
    }
    let debt = DEBT_NANOS.with(|d| {
        let v = d.get() + cost.as_nanos() as i128;
        d.set(v);
        v
    });
    if debt < SLEEP_QUANTUM.as_nanos() as i128 {
        return;
    }
    let start = Instant::now();
    SLEEPING.fetch_add(1, Ordering::AcqRel);
    std::thread::sleep(Duration::from_nanos(
        u64::try_from(debt).unwrap_or(u64::MAX),
    ));
    SLEEPING.fetch_sub(1, Ordering::AcqRel);
    let slept = start.elapsed().as_nanos() as i128;
    // Credit at most one quantum of oversleep, so a long stall is not paid back by later calls.
    DEBT_NANOS.with(|d| d.set((debt - slept).max(-(SLEEP_QUANTUM.as_nanos() as i128))));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scaled_costs() {
        let m = LatencyModel::default();
        assert_eq!(
            m.host_alloc_cost(4 << 20),
            Duration::from_micros(10 + 4 * 300)
        );
        assert_eq!(
            m.host_register_cost(1 << 30, 3),
            Duration::from_micros(20) + Duration::from_millis(60) + Duration::from_micros(30)
        );
        assert_eq!(m.copy_cost(1 << 29), Duration::from_millis(20));
        assert_eq!(
            LatencyModel::zero().host_alloc_cost(1 << 30),
            Duration::ZERO
        );
    }

    #[test]
    fn small_costs_accumulate_into_real_time() {
        let start = Instant::now();
        for _ in 0..200 {
            pay(Duration::from_micros(10));
        }
        let took = start.elapsed();
        assert!(took >= Duration::from_micros(1_800), "took {took:?}");
        assert!(took < Duration::from_millis(500), "took {took:?}");
    }
}
