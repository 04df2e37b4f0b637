//! Loom models of a miss's landing (`gpualloc_actor::landing`) and of the protocol the device
//! actor builds on it with the thread cache: the task delivering while its request is
//! cancelled, and a request that ran out of memory and waits for misses in flight, which
//! must find a cancelled miss's block (dropped into the task thread's thread-cache slot)
//! once it sees the miss landed.
//!
//! Run: `RUSTFLAGS="--cfg loom" cargo test -p gpualloc-actor --release --test loom_landing`.

#![cfg(loom)]

mod common;

use common::Bag;
use gpualloc_actor::landing::{CancelOnDrop, Landing, LandingOwner};
use gpualloc_actor::ThreadSlots;
use loom::sync::atomic::{AtomicUsize, Ordering};
use loom::sync::Arc;
use loom::thread;

/// The device actor's side: misses in flight, landings announced, and how many results had
/// been dropped when the last landing was announced.
#[derive(Default)]
struct Owner {
    in_flight: AtomicUsize,
    landed: AtomicUsize,
    dropped: Arc<AtomicUsize>,
    dropped_when_landed: AtomicUsize,
}

impl LandingOwner for Owner {
    fn started(&self) {
        self.in_flight.fetch_add(1, Ordering::AcqRel);
    }

    fn landed(&self) {
        self.dropped_when_landed
            .store(self.dropped.load(Ordering::Acquire), Ordering::Release);
        self.landed.fetch_add(1, Ordering::AcqRel);
        self.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A miss's result: counts its drop, as a dropped buffer returns its block to the cache.
struct Buffer(Arc<AtomicUsize>);

impl Drop for Buffer {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::AcqRel);
    }
}

/// A landing and the thread of its task, which delivers a [`Buffer`].
fn delivering() -> (
    Arc<Owner>,
    Arc<Landing<Buffer, Owner>>,
    thread::JoinHandle<()>,
) {
    let owner = Arc::new(Owner::default());
    let landing = Landing::new(owner.clone());
    let task = landing.clone();
    let dropped = owner.dropped.clone();
    let t = thread::spawn(move || task.deliver(Buffer(dropped)));
    (owner, landing, t)
}

/// The task delivers while the request is cancelled: the result is dropped exactly once,
/// before the one announcement, whichever side gets the slot first.
#[test]
fn a_delivery_racing_a_cancel_is_dropped_once_then_announced_once() {
    loom::model(|| {
        let (owner, landing, t) = delivering();
        drop(CancelOnDrop(Some(landing)));
        t.join().unwrap();
        assert_eq!(owner.dropped.load(Ordering::Acquire), 1);
        assert_eq!(owner.landed.load(Ordering::Acquire), 1);
        assert_eq!(owner.dropped_when_landed.load(Ordering::Acquire), 1);
        assert_eq!(owner.in_flight.load(Ordering::Acquire), 0);
    });
}

/// The live request takes what its task delivered: handed over, not dropped, one
/// announcement.
#[test]
fn a_live_request_takes_its_result() {
    loom::model(|| {
        let (owner, landing, t) = delivering();
        let mut guard = CancelOnDrop(Some(landing.clone()));
        t.join().unwrap();
        guard.0 = None;
        let taken = landing.take();
        assert!(taken.is_some());
        assert_eq!(owner.dropped.load(Ordering::Acquire), 0);
        assert_eq!(owner.landed.load(Ordering::Acquire), 1);
        drop(taken);
        drop(guard);
        assert_eq!(owner.landed.load(Ordering::Acquire), 1);
    });
}

loom::thread_local! {
    /// The calling thread's slot of the thread cache (`thread_slots::thread_index`).
    static MY_SLOT: std::cell::Cell<usize> = std::cell::Cell::new(0);
}

/// A miss's buffer whose drop parks its block (7) in the dropping thread's slot.
struct Parks(Arc<ThreadSlots<Bag>>);

impl Drop for Parks {
    fn drop(&mut self) {
        let index = MY_SLOT.with(|s| s.get());
        self.0.update(index, |b| b.0.push(7));
    }
}

/// A cancelled miss's block goes to the task thread's slot of the thread cache when its
/// buffer is dropped there; a request that ran out of memory and sees no miss in flight any
/// more then takes the gate, whose holder collects the slots first, and must find it.
#[test]
fn a_request_that_sees_the_miss_landed_finds_its_block_in_the_cache() {
    loom::model(|| {
        let owner = Arc::new(Owner::default());
        let slots = common::slots();
        let landing = Landing::new(owner.clone());

        // The blocking task (thread cache slot 0) delivers block 7; the request (slot 1) is
        // cancelled. Whichever drops the result parks the block in its own slot.
        let task = landing.clone();
        let task_slots = slots.clone();
        let t = thread::spawn(move || {
            MY_SLOT.with(|s| s.set(0));
            task.deliver(Parks(task_slots));
        });
        let r = thread::spawn(move || {
            MY_SLOT.with(|s| s.set(1));
            drop(CancelOnDrop(Some(landing)));
        });

        // A request that ran out of memory: once it sees nothing in flight, its retry
        // collects the thread cache and must find the block.
        if owner.in_flight.load(Ordering::Acquire) == 0 {
            let mut found = Vec::new();
            slots.collect(|b| found.append(&mut b.0));
            assert_eq!(
                found,
                vec![7],
                "the miss landed, its block is not in the cache"
            );
        }
        t.join().unwrap();
        r.join().unwrap();
        assert_eq!(owner.in_flight.load(Ordering::Acquire), 0);
    });
}

/// The task ends without delivering (its work panicked) while its request is cancelled:
/// whichever handle goes last announces the landing, once.
#[test]
fn a_task_that_dies_racing_a_cancel_lands_once() {
    loom::model(|| {
        let owner = Arc::new(Owner::default());
        let landing: Arc<Landing<Buffer, Owner>> = Landing::new(owner.clone());
        let task = landing.clone();
        let t = thread::spawn(move || drop(task));
        drop(CancelOnDrop(Some(landing)));
        t.join().unwrap();
        assert_eq!(owner.landed.load(Ordering::Acquire), 1);
        assert_eq!(owner.in_flight.load(Ordering::Acquire), 0);
    });
}
