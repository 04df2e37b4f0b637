//! The gate of a flat-combining cell: one atomic word with a `LOCKED` bit (someone owns the
//! guarded state) and a `PENDING` bit (messages were queued for the owner).
//!
//! Every transition is a read-modify-write of the same word, so all of them are totally
//! ordered and no wake-up can be lost between "queue a message" and "release the gate":
//! a poster sets `PENDING` (and tries to take `LOCKED` in the same step); the owner can only
//! release with a compare-exchange from exactly `LOCKED`, which fails while `PENDING` is set,
//! so it must clear `PENDING` and drain first.
//!
//! All accesses are sequentially consistent: the mailbox's hand-off to its drainer task
//! pairs a gate store with a load of another flag (a store-buffer pattern), and on x86 the
//! read-modify-writes cost the same either way.

use gpualloc_runtime::sync::atomic::{AtomicUsize, Ordering};

const LOCKED: usize = 1;
const PENDING: usize = 2;

/// The gate word. See the module docs. Aligned to its own cache lines (two, for adjacent-line
/// prefetch): reference counts or other fields written next to it would otherwise steal the
/// line from the holder on every hit.
#[derive(Debug, Default)]
#[repr(align(128))]
pub struct Gate {
    state: AtomicUsize,
}

/// What a successful acquire found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Acquired {
    /// Messages were queued before the acquire: drain them before anything else.
    pub pending: bool,
}

impl Gate {
    /// An open gate with nothing pending.
    pub fn new() -> Self {
        Gate {
            state: AtomicUsize::new(0),
        }
    }

    /// Takes the gate if nobody holds it.
    #[inline]
    pub fn try_acquire(&self) -> Option<Acquired> {
        let prev = self.state.fetch_or(LOCKED, Ordering::SeqCst);
        if prev & LOCKED != 0 {
            None
        } else {
            Some(Acquired {
                pending: prev & PENDING != 0,
            })
        }
    }

    /// Announces a queued message (call after queuing it) and takes the gate if it was free.
    /// `Some` means the caller now holds the gate and must drain; `None` means the holder
    /// will see `PENDING` before it can release.
    pub fn announce(&self) -> Option<Acquired> {
        let prev = self.state.fetch_or(LOCKED | PENDING, Ordering::SeqCst);
        if prev & LOCKED != 0 {
            None
        } else {
            Some(Acquired { pending: true })
        }
    }

    /// Holder only: clears `PENDING`; true if it was set (drain the queue now).
    #[inline]
    pub fn take_pending(&self) -> bool {
        self.state.fetch_and(!PENDING, Ordering::SeqCst) & PENDING != 0
    }

    /// Holder only: releases the gate if nothing is pending. False means messages arrived:
    /// take them with [`Gate::take_pending`], drain, and try again.
    #[inline]
    pub fn try_release(&self) -> bool {
        self.state
            .compare_exchange(LOCKED, 0, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
    }

    /// Holder only: releases the gate but leaves `PENDING` set, so the next acquirer drains
    /// (used to hand work to the actor task instead of draining forever).
    pub fn release_with_pending(&self) {
        // Read-modify-writes only (no plain store), so every transition of the word stays
        // in one total order with the posters' announcements.
        self.state.fetch_or(PENDING, Ordering::SeqCst);
        self.state.fetch_and(!LOCKED, Ordering::SeqCst);
    }

    /// True while someone holds the gate (a hint: it may change at once).
    #[inline]
    pub fn is_locked(&self) -> bool {
        self.state.load(Ordering::SeqCst) & LOCKED != 0
    }

    /// True while messages are announced and not yet taken (a hint).
    #[inline]
    pub fn is_pending(&self) -> bool {
        self.state.load(Ordering::SeqCst) & PENDING != 0
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn acquire_release_and_pending_protocol() {
        let g = Gate::new();
        assert_eq!(g.try_acquire(), Some(Acquired { pending: false }));
        assert_eq!(g.try_acquire(), None);
        assert_eq!(
            g.announce(),
            None,
            "held: the poster leaves the work to the holder"
        );
        assert!(!g.try_release(), "cannot release with work pending");
        assert!(g.take_pending());
        assert!(!g.take_pending());
        assert!(g.try_release());
        assert_eq!(g.announce(), Some(Acquired { pending: true }));
        g.release_with_pending();
        assert!(!g.is_locked() && g.is_pending());
        assert_eq!(g.try_acquire(), Some(Acquired { pending: true }));
    }
}
