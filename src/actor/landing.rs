//! Where a miss running on the blocking pool lands: handed to its request if that is still
//! waiting, or returned to the cache if the request was cancelled, and only then announced.
//!
//! A miss counts as in flight (`DeviceActor::misses_in_flight`) until its result has been
//! *taken*: by the live request, or by the cancellation that drops its
//! buffer (which returns the block to the cache, never to a user). Exactly one of the two
//! takes it, under the slot's lock, and then announces the landing, so a request that ran out
//! of memory and waits for misses to land (`DeviceActor::malloc`) always finds a cancelled
//! request's memory in the cache when it retries.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use crate::actor::device::DeviceActor;
use crate::buffer::DeviceBuffer;
use crate::error::Error;

type MissResult = Result<DeviceBuffer, Error>;

#[derive(Default)]
struct Slot {
    result: Option<MissResult>,
    cancelled: bool,
}

/// One miss's landing place, shared by its request and its blocking task.
pub(crate) struct Landing {
    actor: Arc<DeviceActor>,
    slot: Mutex<Slot>,
}

impl Landing {
    /// Counts a miss as in flight on `actor` until the landing is taken.
    pub fn new(actor: Arc<DeviceActor>) -> Arc<Landing> {
        actor.misses_in_flight.fetch_add(1, Ordering::AcqRel);
        Arc::new(Landing {
            actor,
            slot: Mutex::new(Slot::default()),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Slot> {
        self.slot.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The blocking task's result arrives: kept for the request, or dropped (its block back to
    /// the cache) and announced if the request is gone.
    pub fn deliver(&self, r: MissResult) {
        let mut slot = self.lock();
        if slot.cancelled {
            drop(slot);
            drop(r);
            self.announce();
        } else {
            slot.result = Some(r);
        }
    }

    /// The live request takes its result once its task has ended (`None` if the task died
    /// without delivering: it never will now). Announces the landing either way.
    pub fn take(&self) -> Option<MissResult> {
        let r = {
            let mut slot = self.lock();
            // Whatever the task did, it is over: nothing is left to count as in flight.
            slot.cancelled = true;
            slot.result.take()
        };
        self.announce();
        r
    }

    /// The request is cancelled: a result already delivered is dropped now (its block back to
    /// the cache); otherwise the task drops it when it lands.
    pub fn cancel(&self) {
        let r = {
            let mut slot = self.lock();
            slot.cancelled = true;
            slot.result.take()
        };
        if let Some(r) = r {
            drop(r);
            self.announce();
        }
    }

    fn announce(&self) {
        let a = &self.actor;
        a.misses_in_flight.fetch_sub(1, Ordering::AcqRel);
        a.miss_landed.notify_waiters();
    }
}

/// Cancels the landing when the request's future is dropped before taking its result.
pub(crate) struct CancelOnDrop(pub Option<Arc<Landing>>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if let Some(l) = self.0.take() {
            l.cancel();
        }
    }
}
