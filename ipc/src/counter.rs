//! The shared reference-count protocol, as a handful of atomic steps on one 8-byte counter
//! (a slot of [`crate::refcount::RefCountFile`], which both processes map). Written against
//! the [`SharedCounter`] trait so the same steps run on real shared memory and, under
//! `cfg(loom)`, on loom's atomics (`tests/loom_refcount.rs`).
//!
//! The protocol, per exported buffer and importer (one slot each):
//! 1. The exporter *arms* the slot (`store(1, Release)`) before it sends the buffer, so the
//!    reference exists before the importer can see the buffer.
//! 2. The importer uses the buffer, synchronizes its stream, then *releases* its reference:
//!    a compare-and-swap decrement (`AcqRel`) that never goes below zero, so a late or
//!    repeated release cannot wrap the counter.
//! 3. The exporter *collects*: a slot that loads 0 (`Acquire`) is free; everything the
//!    importer wrote before releasing happens-before the exporter reuses the block.
//! 4. When the importer dies (its socket reaches EOF) the exporter *takes* the slot
//!    (`swap(0, AcqRel)`) and drops the importer's references itself. A release racing with
//!    the take finds 0 and does nothing; either way the block is released exactly once,
//!    because only the exporter's ledger releases blocks and it forgets the entry when it does.

use gpualloc_runtime::sync::atomic::{AtomicU64, Ordering};

/// One shared 8-byte counter. See the module docs for the protocol.
pub trait SharedCounter {
    /// Exporter: sets the count before sending (`Release`).
    fn arm(&self, count: u64);
    /// Importer: drops one reference unless the count is already 0 (`AcqRel` CAS). True if
    /// it dropped one.
    fn release_one(&self) -> bool;
    /// Exporter: true when every reference is gone (`Acquire` load).
    fn is_free(&self) -> bool;
    /// Exporter, importer gone: takes whatever references are left (`swap(0, AcqRel)`).
    fn take_all(&self) -> u64;
}

macro_rules! impl_counter {
    ($t:ty, $ord:path) => {
        impl SharedCounter for $t {
            fn arm(&self, count: u64) {
                self.store(count, <$ord>::Release);
            }

            fn release_one(&self) -> bool {
                self.fetch_update(<$ord>::AcqRel, <$ord>::Acquire, |v| v.checked_sub(1))
                    .is_ok()
            }

            fn is_free(&self) -> bool {
                self.load(<$ord>::Acquire) == 0
            }

            fn take_all(&self) -> u64 {
                self.swap(0, <$ord>::AcqRel)
            }
        }
    };
}

impl_counter!(AtomicU64, Ordering);
// Under loom the slots of a real shared mapping are still std atomics.
#[cfg(loom)]
impl_counter!(std::sync::atomic::AtomicU64, std::sync::atomic::Ordering);

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn release_never_goes_below_zero_and_take_returns_the_rest() {
        let c = AtomicU64::new(0);
        assert!(c.is_free());
        c.arm(2);
        assert!(!c.is_free());
        assert!(c.release_one());
        assert_eq!(c.take_all(), 1);
        assert!(!c.release_one());
        assert!(c.is_free());
        assert_eq!(c.load(Ordering::Relaxed), 0);
    }
}
