//! The shared reference-count protocol, as a handful of atomic steps on one 8-byte counter
//! (a slot of [`crate::refcount::RefCountFile`], which both processes map). Written against
//! the [`SharedCounter`] trait so the same steps run on real shared memory and, under
//! `cfg(loom)`, on loom's atomics (`tests/loom_refcount.rs`).
//!
//! The protocol, per exported buffer and importer (one slot each):
//! 1. The exporter *offers* the slot (`store(OFFERED, Release)`) before it sends the buffer,
//!    so the reference exists before the importer can see the buffer.
//! 2. The importer *accepts* the offer before it opens the memory: a compare-and-swap from
//!    [`OFFERED`] to 1 (`AcqRel`). It fails when the exporter took the slot back meanwhile
//!    (step 4), and the importer then refuses the buffer: an offer the exporter reclaimed is
//!    never used. An importer that refuses an offer for another reason *declines* it (CAS
//!    from `OFFERED` to 0), which frees the slot.
//! 3. The importer uses the buffer, synchronizes its stream, then *releases* its reference:
//!    a compare-and-swap decrement (`AcqRel`) that never goes below zero and never touches an
//!    offer not yet accepted, so a late or repeated release cannot wrap the counter.
//! 4. The exporter *collects*: a slot that loads 0 (`Acquire`) is free; everything the
//!    importer wrote before releasing happens-before the exporter reuses the block.
//! 5. When the importer dies (its socket reaches EOF) the exporter *takes* the slot
//!    (`swap(0, AcqRel)`) and drops the importer's references itself. A release racing with
//!    the take finds 0 and does nothing; either way the block is released exactly once,
//!    because only the exporter's ledger releases blocks and it forgets the entry when it does.

use gpualloc_runtime::sync::atomic::{AtomicU64, Ordering};

/// A slot's value while it holds an offer the importer has not accepted yet.
pub const OFFERED: u64 = u64::MAX;

/// One shared 8-byte counter. See the module docs for the protocol.
pub trait SharedCounter {
    /// Exporter: sets the value before sending (`Release`): [`OFFERED`] for an offer.
    fn arm(&self, count: u64);
    /// Importer: takes the offer (`OFFERED` to 1, `AcqRel` CAS). False when the slot holds
    /// no offer (the exporter took it back, or a hostile exporter named a wrong slot).
    fn accept(&self) -> bool;
    /// Importer: refuses the offer (`OFFERED` to 0). False when the slot holds no offer.
    fn decline(&self) -> bool;
    /// Importer: drops one accepted reference unless the count is already 0 or the offer was
    /// never accepted (`AcqRel` CAS). True if it dropped one.
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

            fn accept(&self) -> bool {
                self.compare_exchange(OFFERED, 1, <$ord>::AcqRel, <$ord>::Acquire)
                    .is_ok()
            }

            fn decline(&self) -> bool {
                self.compare_exchange(OFFERED, 0, <$ord>::AcqRel, <$ord>::Acquire)
                    .is_ok()
            }

            fn release_one(&self) -> bool {
                self.fetch_update(<$ord>::AcqRel, <$ord>::Acquire, |v| {
                    if v == OFFERED {
                        None
                    } else {
                        v.checked_sub(1)
                    }
                })
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
    fn an_offer_is_accepted_or_declined_once_and_not_after_a_take() {
        let c = AtomicU64::new(0);
        assert!(!c.accept() && !c.decline(), "nothing offered");
        c.arm(OFFERED);
        assert!(!c.is_free());
        assert!(!c.release_one(), "a release before the accept does nothing");
        assert!(c.accept());
        assert!(!c.accept() && !c.decline());
        assert_eq!(c.load(Ordering::Relaxed), 1);
        assert!(c.release_one());
        assert!(c.is_free());
        c.arm(OFFERED);
        assert!(c.decline());
        assert!(c.is_free());
        // Taken back by the exporter before the importer looked: refused.
        c.arm(OFFERED);
        assert_eq!(c.take_all(), OFFERED);
        assert!(!c.accept());
        assert!(c.is_free());
    }

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
