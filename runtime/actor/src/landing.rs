//! [`Landing`]: where work running off the gate (a miss on the blocking pool) lands: handed
//! to its request if that is still waiting, or dropped if the request was cancelled (for a
//! device buffer, dropping returns its block to the cache), and only then announced.
//!
//! The work counts as in flight from [`Landing::new`] until its result has been *taken*: by
//! the live request ([`Landing::take`]), or by the cancellation that drops it
//! ([`Landing::cancel`], or [`Landing::deliver`] after a cancel). Exactly one of them takes
//! it, under the slot's lock, and then announces the landing ([`LandingOwner::landed`]), so a
//! request that ran out of memory and waits for work in flight to land always finds a
//! cancelled request's memory back before it is told the work landed.
//!
//! Built on [`gpualloc_runtime::sync`], so loom checks it (`tests/loom_landing.rs`).

use gpualloc_runtime::sync::{lock, Arc, Mutex};

/// The owner of work in flight (the device actor): counts it and hears when it lands.
pub trait LandingOwner: Send + Sync {
    /// A landing was made: one more piece of work is in flight.
    fn started(&self);
    /// A landing was taken: one less in flight. Called once per [`Landing`], after the
    /// result was handed over or dropped.
    fn landed(&self);
}

struct Slot<T> {
    result: Option<T>,
    cancelled: bool,
}

/// One piece of work's landing place, shared by its request and the task doing the work.
pub struct Landing<T, O: LandingOwner> {
    owner: Arc<O>,
    slot: Mutex<Slot<T>>,
}

impl<T, O: LandingOwner> Landing<T, O> {
    /// Counts a piece of work as in flight on `owner` until the landing is taken.
    pub fn new(owner: Arc<O>) -> Arc<Self> {
        owner.started();
        Arc::new(Landing {
            owner,
            slot: Mutex::new(Slot {
                result: None,
                cancelled: false,
            }),
        })
    }

    /// The task's result arrives: kept for the request, or dropped and announced if the
    /// request is gone.
    pub fn deliver(&self, r: T) {
        let mut slot = lock(&self.slot);
        if slot.cancelled {
            drop(slot);
            drop(r);
            self.owner.landed();
        } else {
            slot.result = Some(r);
        }
    }

    /// The live request takes its result once its task has ended (`None` if the task ended
    /// without delivering: it never will now). Announces the landing either way.
    pub fn take(&self) -> Option<T> {
        let r = {
            let mut slot = lock(&self.slot);
            // Whatever the task did, it is over: nothing is left to count as in flight.
            slot.cancelled = true;
            slot.result.take()
        };
        self.owner.landed();
        r
    }

    /// The request is cancelled: a result already delivered is dropped now, then announced;
    /// otherwise the task drops and announces it when it lands.
    pub fn cancel(&self) {
        let r = {
            let mut slot = lock(&self.slot);
            slot.cancelled = true;
            slot.result.take()
        };
        if let Some(r) = r {
            drop(r);
            self.owner.landed();
        }
    }
}

/// Cancels the landing when the request's future is dropped before taking its result; set
/// the field to `None` once the request takes it itself.
pub struct CancelOnDrop<T, O: LandingOwner>(pub Option<Arc<Landing<T, O>>>);

impl<T, O: LandingOwner> Drop for CancelOnDrop<T, O> {
    fn drop(&mut self) {
        if let Some(l) = self.0.take() {
            l.cancel();
        }
    }
}
