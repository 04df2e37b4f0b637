//! `DeviceCore::account_round_trips`: a tally of round trips done beside the core leaves the
//! statistics exactly where the same frees and reallocations through the core leave them,
//! except `inactive_split`'s totals (the core merges and re-splits; the tally does not).

use std::sync::Arc;

use gpualloc_accounting::AccountingBackend;
use gpualloc_devices::{AllocatorConfig, DeviceCore, DeviceStats, RoundTrips, StatType};
use gpualloc_runtime::{Backend, DeviceId, Stream};

fn core(config: AllocatorConfig) -> (DeviceCore, Stream) {
    let backend: Arc<dyn Backend> = Arc::new(AccountingBackend::new(1, 64 << 30));
    let stream = Stream::new(&backend, DeviceId(0)).unwrap();
    (
        DeviceCore::new(backend, DeviceId(0), config).unwrap(),
        stream,
    )
}

/// `inactive_split` totals set aside, the one part a tally does not reproduce.
fn without_split_totals(mut s: DeviceStats) -> DeviceStats {
    for arr in [&mut s.inactive_split, &mut s.inactive_split_bytes] {
        for stat in arr.iter_mut() {
            stat.allocated = 0;
            stat.freed = 0;
        }
    }
    s
}

fn check(config: AllocatorConfig, sizes: &[u64], trips: u64) {
    let (mut through, s1) = core(config.clone());
    let (mut beside, s2) = core(config);
    let mut tally = RoundTrips::default();
    for &size in sizes {
        let a = through.malloc(size, s1.handle()).unwrap();
        for _ in 0..trips {
            through.free(a.ptr).unwrap();
            let again = through.malloc(size, s1.handle()).unwrap();
            assert_eq!(again.ptr, a.ptr, "the core hands the same block back here");
        }
        let b = beside.malloc(size, s2.handle()).unwrap();
        for _ in 0..trips {
            tally.record(&b);
        }
    }
    assert_eq!(tally.len(), trips * sizes.len() as u64);
    beside.account_round_trips(&tally);
    assert_eq!(
        without_split_totals(beside.stats().clone()),
        without_split_totals(through.stats().clone())
    );
}

#[test]
fn small_and_large_round_trips_match_the_core() {
    // 4 KiB (small pool, split from a 2 MiB segment), 3 MiB (large pool, split from a
    // 20 MiB segment) and 40 MiB (a segment of its own).
    check(AllocatorConfig::default(), &[4096, 3 << 20, 40 << 20], 25);
}

#[test]
fn oversize_round_trips_match_the_core() {
    let config = AllocatorConfig::default()
        .with_max_split_size_mb(32)
        .unwrap();
    check(config, &[40 << 20, 1000], 7);
}

#[test]
fn a_tally_moves_totals_only() {
    let (mut c, s) = core(AllocatorConfig::default());
    let a = c.malloc(1000, s.handle()).unwrap();
    let before = c.stats().clone();
    let mut tally = RoundTrips::default();
    tally.record(&a);
    tally.record(&a);
    c.account_round_trips(&tally);
    let after = c.stats().clone();
    let (all, small, large) = (
        StatType::All as usize,
        StatType::Small as usize,
        StatType::Large as usize,
    );
    assert_eq!(
        after.allocation[all].current,
        before.allocation[all].current
    );
    assert_eq!(after.allocation[all].peak, before.allocation[all].peak);
    assert_eq!(
        after.allocation[all].allocated,
        before.allocation[all].allocated + 2
    );
    assert_eq!(
        after.allocation[all].freed,
        before.allocation[all].freed + 2
    );
    assert_eq!(
        after.allocated_bytes[small].allocated,
        before.allocated_bytes[small].allocated + 2 * 1024
    );
    assert_eq!(
        after.requested_bytes[small].freed,
        before.requested_bytes[small].freed + 2 * 1000
    );
    assert_eq!(
        after.allocated_bytes[large], before.allocated_bytes[large],
        "large pool untouched"
    );
    c.account_round_trips(&RoundTrips::default());
    assert_eq!(c.stats(), &after);
}
