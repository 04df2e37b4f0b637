//! The accounting backend's own tests.

use super::*;

#[test]
fn addresses_are_aligned_lowest_first_and_capacity_is_enforced() {
    let b = AccountingBackend::new(2, 10 << 20);
    let d0 = DeviceId(0);
    let a = b.malloc(d0, 1).unwrap();
    let c = b.malloc(d0, 3 << 20).unwrap();
    assert_eq!(a.0, BASE);
    assert_eq!(c.0, BASE + ALIGNMENT);
    assert_eq!(b.mem_info(d0).unwrap().free, (10 << 20) - (6 << 20));
    assert!(b.malloc(d0, 5 << 20).unwrap_err().is_oom());
    b.free(d0, a).unwrap();
    assert_eq!(b.malloc(d0, 100).unwrap().0, BASE, "lowest gap reused");
    assert_eq!(b.malloc(DeviceId(1), 1).unwrap().0, BASE + WINDOW);
    assert_eq!(b.counts().mallocs, 4);
    assert_eq!(b.counts().failed_mallocs, 1);
}

#[test]
fn bad_input_is_typed() {
    let b = AccountingBackend::new(1, 1 << 30);
    assert!(matches!(
        b.malloc(DeviceId(0), 0),
        Err(BackendError::InvalidValue(_))
    ));
    assert!(matches!(
        b.malloc(DeviceId(0), u64::MAX - 100),
        Err(BackendError::InvalidValue(_))
    ));
    assert!(b.malloc(DeviceId(0), 1 << 62).unwrap_err().is_oom());
    assert!(matches!(
        b.malloc(DeviceId(3), 1),
        Err(BackendError::InvalidDevice(3))
    ));
    assert!(matches!(
        b.free(DeviceId(0), DevicePtr(12)),
        Err(BackendError::InvalidValue(_))
    ));
    assert!(matches!(
        b.unmap(DevicePtr(BASE), ALIGNMENT),
        Err(BackendError::InvalidValue(_))
    ));
}

#[test]
fn manual_events_stay_pending_until_completed_or_synchronized() {
    let b = AccountingBackend::manual_events(1, 1 << 30);
    let s = b.stream_create(DeviceId(0)).unwrap();
    let e = b.event_create(DeviceId(0)).unwrap();
    assert!(b.event_query(e).unwrap(), "never recorded = complete");
    b.event_record(e, s).unwrap();
    assert!(!b.event_query(e).unwrap());
    assert_eq!(b.pending_events(), 1);
    b.complete_event(e);
    assert!(b.event_query(e).unwrap());
    b.event_record(e, s).unwrap();
    b.device_synchronize(DeviceId(0)).unwrap();
    assert!(b.event_query(e).unwrap());
}

#[test]
fn a_free_completes_every_event_unless_told_not_to() {
    for synchronizes in [true, false] {
        let mut b = AccountingBackend::manual_events(1, 1 << 30);
        if !synchronizes {
            b = b.free_does_not_synchronize();
        }
        let s = b.stream_create(DeviceId(0)).unwrap();
        let e = b.event_create(DeviceId(0)).unwrap();
        b.event_record(e, s).unwrap();
        let p = b.malloc(DeviceId(0), 2 << 20).unwrap();
        b.free(DeviceId(0), p).unwrap();
        assert_eq!(b.event_query(e).unwrap(), synchronizes);
    }
}

#[test]
fn host_memory_is_accounted_and_validated() {
    let b = AccountingBackend::new(1, 1 << 30).with_host_capacity(16 * HOST_PAGE);
    let a = b.host_alloc(1).unwrap();
    let c = b.host_alloc(HOST_PAGE + 1).unwrap();
    assert_eq!(a as u64, HOST_BASE);
    assert_eq!(
        c as u64,
        HOST_BASE + HOST_PAGE,
        "4 KiB aligned, lowest first"
    );
    assert_eq!(b.host_used(), 3 * HOST_PAGE);
    assert!(b.host_alloc(14 * HOST_PAGE).unwrap_err().is_oom());
    assert!(matches!(
        b.host_alloc(0),
        Err(BackendError::InvalidValue(_))
    ));
    assert!(matches!(
        b.host_alloc(u64::MAX - 100),
        Err(BackendError::InvalidValue(_))
    ));
    b.host_free(a).unwrap();
    assert!(
        matches!(b.host_free(a), Err(BackendError::InvalidValue(_))),
        "double free"
    );
    assert_eq!(b.host_alloc(10).unwrap(), a, "lowest gap reused");

    let r = 0x10_0000_0000u64 as *mut u8;
    let flags = HostRegisterFlags::default();
    assert!(
        b.host_register(r.wrapping_add(1), HOST_PAGE, flags)
            .is_err(),
        "unaligned ptr"
    );
    assert!(b.host_register(r, 100, flags).is_err(), "unaligned len");
    assert!(
        b.host_register(c, HOST_PAGE, flags).is_err(),
        "overlaps host_alloc"
    );
    b.host_register(r, 4 * HOST_PAGE, flags).unwrap();
    assert!(
        b.host_register(r.wrapping_add(4096), HOST_PAGE, flags)
            .is_err(),
        "overlap"
    );
    assert!(b
        .host_register(r.wrapping_add(4 * 4096), 20 * HOST_PAGE, flags)
        .unwrap_err()
        .is_oom());
    assert_eq!(b.host_used(), 7 * HOST_PAGE);
    assert!(
        b.host_unregister(r.wrapping_add(4096)).is_err(),
        "not a range start"
    );
    b.host_unregister(r).unwrap();
    assert!(b.host_unregister(r).is_err());
    let n = b.counts();
    assert_eq!(
        (
            n.host_allocs,
            n.host_frees,
            n.host_registers,
            n.host_unregisters
        ),
        (3, 1, 1, 1)
    );
}

#[test]
fn place_next_and_vmm_accounting() {
    let b = AccountingBackend::new(1, 8 << 20);
    let d = DeviceId(0);
    b.place_next(d, BASE + 10 * ALIGNMENT);
    assert_eq!(b.malloc(d, 1 << 20).unwrap().0, BASE + 10 * ALIGNMENT);
    let va = b.va_reserve(d, 8 * ALIGNMENT, ALIGNMENT).unwrap();
    assert_eq!(b.reservation_holding(d, va.0), Some(va.0));
    assert_eq!(
        b.reservation_holding(d, va.0 + 8 * ALIGNMENT - 1),
        Some(va.0)
    );
    assert_eq!(b.reservation_holding(d, va.0 + 8 * ALIGNMENT), None);
    assert_eq!(
        b.reservation_holding(d, BASE + 10 * ALIGNMENT),
        None,
        "a malloc"
    );
    let h = b.phys_create(d, ALIGNMENT).unwrap();
    b.map(va, ALIGNMENT, 0, h).unwrap();
    assert!(b.va_free(d, va, 8 * ALIGNMENT).is_err(), "still mapped");
    assert!(b.unmap(va, 2 * ALIGNMENT).is_err(), "more than mapped");
    b.unmap(va, ALIGNMENT).unwrap();
    b.phys_release(h).unwrap();
    b.va_free(d, va, 8 * ALIGNMENT).unwrap();
    assert_eq!(b.reservation_holding(d, va.0), None);
    assert_eq!(b.used(d), 2 << 20);
}

/// A replay's device is "unlimited" (1 TiB), and each expandable segment reserves 9/8 of the
/// device, as PyTorch's does: a job on 10 streams has two such segments per stream (small
/// and large pool). The window must hold them all (llama7b-offload-10streams, replayed warm
/// with `expandable_segments:True`, failed at event 1689 with "address space exhausted").
#[test]
fn a_device_window_holds_the_reservations_of_ten_streams_two_pools_each() {
    let capacity = 1u64 << 40;
    let b = AccountingBackend::new(2, capacity);
    let reservation = capacity + capacity / 8;
    let mut bases = Vec::new();
    for i in 0..20 {
        let r = b.va_reserve(DeviceId(0), reservation, 0);
        bases.push(r.unwrap_or_else(|e| panic!("reservation {i}: {e}")).0);
    }
    // Disjoint, inside device 0's window, below device 1's first address.
    bases.sort_unstable();
    assert!(bases.windows(2).all(|w| w[1] - w[0] >= reservation));
    let device1 = b.malloc(DeviceId(1), 1).unwrap().0;
    assert!(bases[19] + reservation <= device1);
    assert_eq!(bases[0], BASE);
}
