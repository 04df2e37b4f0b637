//! Where the accounting backend puts device memory: lowest free address first by default,
//! highest first with `highest_address_first` (a trace replay's model of a driver that hands
//! out addresses downwards).

use gpualloc_accounting::AccountingBackend;
use gpualloc_runtime::{Backend, DeviceId, DevicePtr};

const DEV: DeviceId = DeviceId(0);
const MIB: u64 = 1 << 20;
/// Device 0's window: 64 TiB from 0x7000_0000_0000.
const LO: u64 = 0x7000_0000_0000;
const HI: u64 = LO + (1 << 46);

#[test]
fn the_lowest_free_address_comes_first_by_default() {
    let b = AccountingBackend::new(1, 1 << 40);
    let a = b.malloc(DEV, 4 * MIB).unwrap().0;
    let c = b.malloc(DEV, 2 * MIB).unwrap().0;
    assert_eq!((a, c), (LO, LO + 4 * MIB));
}

#[test]
fn highest_address_first_walks_down_from_the_top_and_reuses_the_highest_gap() {
    let b = AccountingBackend::new(1, 1 << 40).highest_address_first();
    let a = b.malloc(DEV, 4 * MIB).unwrap().0;
    let c = b.malloc(DEV, 2 * MIB).unwrap().0;
    let d = b.malloc(DEV, 6 * MIB).unwrap().0;
    assert_eq!(a, HI - 4 * MIB);
    assert_eq!(c, HI - 6 * MIB);
    assert_eq!(d, HI - 12 * MIB);
    // A 4 MiB hole at the top: a 2 MiB request takes its upper half, a 6 MiB one goes below.
    b.free(DEV, DevicePtr(a)).unwrap();
    assert_eq!(b.malloc(DEV, 2 * MIB).unwrap().0, HI - 2 * MIB);
    assert_eq!(b.malloc(DEV, 6 * MIB).unwrap().0, HI - 18 * MIB);
    // Sizes round up to 2 MiB: 3 MiB is placed as 4 MiB.
    assert_eq!(b.malloc(DEV, 3 * MIB).unwrap().0, HI - 22 * MIB);
    // Reservations come from the same end.
    let r = b.va_reserve(DEV, 8 * MIB, 0).unwrap();
    assert_eq!(r.0, HI - 30 * MIB);
}
