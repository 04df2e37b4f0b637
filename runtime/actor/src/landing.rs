//! [`Landing`]: where work running off the gate (a miss on the blocking pool) lands: handed
//! to its request if that is still waiting, or dropped if the request was cancelled (for a
//! device buffer, dropping returns its block to the cache), and only then announced.
//!
//! The work counts as in flight from [`Landing::new`] until its result has been *taken*: by
//! the live request ([`Landing::take`]), or by the cancellation that drops it
//! ([`Landing::cancel`], or [`Landing::deliver`] after a cancel). Exactly one of them takes
//! it, under the slot's lock, and then announces the landing ([`LandingOwner::landed`], once
//! per landing; by the landing's drop if the task ended without delivering after a cancel), so a
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
    /// The landing was announced (or is being, by whoever set this): at most once.
    announced: bool,
}

impl<T> Slot<T> {
    /// Whether the caller is the one to announce the landing.
    fn claim(&mut self) -> bool {
        !std::mem::replace(&mut self.announced, true)
    }
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
                announced: false,
            }),
        })
    }

    /// The task's result arrives: kept for the request, or dropped and announced if the
    /// request is gone.
    pub fn deliver(&self, r: T) {
        let mut slot = lock(&self.slot);
        if slot.cancelled {
            let announce = slot.claim();
            drop(slot);
            self.settle(Some(r), announce);
        } else {
            slot.result = Some(r);
        }
    }

    /// The live request takes its result once its task has ended (`None` if the task ended
    /// without delivering: it never will now). Announces the landing either way.
    pub fn take(&self) -> Option<T> {
        let (r, announce) = {
            let mut slot = lock(&self.slot);
            // Whatever the task did, it is over: nothing is left to count as in flight.
            slot.cancelled = true;
            (slot.result.take(), slot.claim())
        };
        self.settle(None, announce);
        r
    }

    /// The request is cancelled: a result already delivered is dropped now, then announced;
    /// otherwise the task drops and announces it when it lands.
    pub fn cancel(&self) {
        let (r, announce) = {
            let mut slot = lock(&self.slot);
            slot.cancelled = true;
            let r = slot.result.take();
            let announce = r.is_some() && slot.claim();
            (r, announce)
        };
        self.settle(r, announce);
    }

    /// After the slot's lock: drops what was taken out of it (a dropped buffer returns its
    /// block), then announces the landing if the caller claimed that.
    fn settle(&self, dropped: Option<T>, announce: bool) {
        drop(dropped);
        if announce {
            self.owner.landed();
        }
    }
}

/// The last handle went without an announcement: the task ended without delivering (a
/// panic in the work, or a blocking pool that shut down before running it) after its request
/// was cancelled. Nobody will take the landing now, so it is announced here; otherwise the
/// work would count as in flight forever, and every request that ran out of memory would
/// wait for it.
impl<T, O: LandingOwner> Drop for Landing<T, O> {
    fn drop(&mut self) {
        let (r, announce) = {
            let mut slot = lock(&self.slot);
            (slot.result.take(), slot.claim())
        };
        self.settle(r, announce);
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

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[derive(Default)]
    struct Owner {
        in_flight: AtomicUsize,
        landed: AtomicUsize,
    }

    impl LandingOwner for Owner {
        fn started(&self) {
            self.in_flight.fetch_add(1, Ordering::Relaxed);
        }
        fn landed(&self) {
            self.landed.fetch_add(1, Ordering::Relaxed);
            self.in_flight.fetch_sub(1, Ordering::Relaxed);
        }
    }

    fn counts(o: &Owner) -> (usize, usize) {
        (
            o.in_flight.load(Ordering::Relaxed),
            o.landed.load(Ordering::Relaxed),
        )
    }

    /// The task dies without delivering (a panic in the miss, or a blocking pool that shut
    /// down before running it) after its request was cancelled: nobody will take the
    /// landing, and the work must not count as in flight forever (every later out of memory
    /// would wait for it).
    #[test]
    fn a_task_that_ends_without_delivering_after_a_cancel_still_lands() {
        let owner = Arc::new(Owner::default());
        let landing: Arc<Landing<u32, Owner>> = Landing::new(owner.clone());
        let task = landing.clone();
        assert_eq!(counts(&owner), (1, 0));
        drop(CancelOnDrop(Some(landing)));
        assert_eq!(counts(&owner), (1, 0), "the task may still deliver");
        drop(task);
        assert_eq!(counts(&owner), (0, 1));
    }

    /// Every way a landing ends announces it exactly once, the landing's drop included.
    #[test]
    fn every_ending_lands_once() {
        type Case = fn(&Arc<Landing<u32, Owner>>);
        let cases: [(&str, Case); 5] = [
            ("deliver, take", |l| {
                l.deliver(1);
                assert_eq!(l.take(), Some(1));
            }),
            ("take without a delivery", |l| assert_eq!(l.take(), None)),
            ("deliver, cancel", |l| {
                l.deliver(1);
                l.cancel();
            }),
            ("cancel, deliver", |l| {
                l.cancel();
                l.deliver(1);
            }),
            ("cancel, cancel, take", |l| {
                l.cancel();
                l.cancel();
                assert_eq!(l.take(), None);
            }),
        ];
        for (name, case) in cases {
            let owner = Arc::new(Owner::default());
            let landing = Landing::new(owner.clone());
            case(&landing);
            assert_eq!(counts(&owner), (0, 1), "{name}: announced by the calls");
            drop(landing);
            assert_eq!(counts(&owner), (0, 1), "{name}: not again by the drop");
        }
    }

    /// A request future dropped before it took its result cancels the landing: the task's
    /// delivery then lands at once, while the task still holds the landing.
    #[test]
    fn a_dropped_request_makes_the_delivery_land() {
        let owner = Arc::new(Owner::default());
        let landing: Arc<Landing<u32, Owner>> = Landing::new(owner.clone());
        let task = landing.clone();
        drop(CancelOnDrop(Some(landing)));
        task.deliver(1);
        assert_eq!(counts(&owner), (0, 1));
        drop(task);
        assert_eq!(counts(&owner), (0, 1));
    }
}
