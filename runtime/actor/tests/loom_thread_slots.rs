//! Loom models of the per-thread slots (`actor::thread_slots`) and the two protocols the
//! device actor's thread cache builds on them: an owner parking while a gate holder
//! collects, a park racing a request that starts waiting for memory, a revive racing
//! shutdown, and a revive's lane racing the close that drops every lane.
//!
//! Run: `RUSTFLAGS="--cfg loom" cargo test -p gpualloc-actor --release --test loom_thread_slots`.

#![cfg(loom)]

mod common;

use common::slots;
use gpualloc_actor::{SlotState, ThreadSlots, Waiters};
use loom::sync::atomic::{AtomicBool, Ordering};
use loom::sync::{Arc, Mutex};
use loom::thread;

/// Whatever an owner leaves in its slot is taken by exactly one collection, whether the
/// collection runs before, during or after the owner's updates: nothing is lost or taken
/// twice, and a slot left non-empty is always marked for the next collector.
#[test]
fn collect_never_misses_or_duplicates() {
    loom::model(|| {
        let s = slots();
        let s2 = s.clone();
        let owner = thread::spawn(move || {
            s2.update(0, |b| b.0.push(1));
            s2.update(0, |b| b.0.push(2));
        });
        let mut first = Vec::new();
        s.collect(|b| first.append(&mut b.0));
        owner.join().unwrap();
        let mut rest = Vec::new();
        s.collect(|b| rest.append(&mut b.0));
        first.extend(rest);
        first.sort();
        assert_eq!(first, vec![1, 2]);
        assert!(!s.is_marked(0) && !s.is_marked(1));
    });
}

/// A park racing a request that starts waiting for memory: the owner parks, then checks
/// for waiters and frees its parked blocks itself if it sees one; the waiter joins, then
/// collects every slot. A parked block is never missed by both (it would stay parked while
/// the waiter waits for a free that never comes), with no fence on either side, also when
/// the slot was already marked and the owner's park writes no mark.
#[test]
fn a_park_is_seen_by_a_waiter_or_unparked_by_its_owner() {
    for already_marked in [false, true] {
        loom::model(move || {
            let s = slots();
            if already_marked {
                s.update(1, |b| b.0.push(6));
            }
            let waiters = Arc::new(Waiters::new());
            let freed = Arc::new(Mutex::new(Vec::new()));
            let (s2, w2, f2) = (s.clone(), waiters.clone(), freed.clone());
            let owner = thread::spawn(move || {
                s2.update(1, |b| b.0.push(7));
                if !w2.is_empty() {
                    let mine = s2.update(1, |b| std::mem::take(&mut b.0));
                    f2.lock().unwrap().extend(mine);
                }
            });
            let turn = waiters.join();
            let mut seen = Vec::new();
            s.collect_all(|b| seen.append(&mut b.0));
            owner.join().unwrap();
            drop(turn);
            seen.extend(freed.lock().unwrap().iter().copied());
            seen.sort();
            let want: Vec<u32> = if already_marked { vec![6, 7] } else { vec![7] };
            assert_eq!(seen, want, "a parked block was missed by both sides");
        });
    }
}

/// A revive racing shutdown: shutdown closes the slots, collects them and then releases
/// the memory. A block taken out of a slot after the release (it was parked after the
/// collection) is never handed out: the reviver checks `is_closed` after taking it.
#[test]
fn nothing_is_revived_after_shutdown_released_memory() {
    loom::model(|| {
        let s = slots();
        let released = Arc::new(AtomicBool::new(false));
        let (s2, r2) = (s.clone(), released.clone());
        let owner = thread::spawn(move || {
            if s2.is_closed() {
                return;
            }
            s2.update(0, |b| b.0.push(3));
            let taken = s2.update(0, |b| b.0.pop().map(|v| (v, r2.load(Ordering::SeqCst))));
            if let Some((_, released_before_take)) = taken {
                let handed_out = !s2.is_closed();
                assert!(
                    !(handed_out && released_before_take),
                    "a block whose memory was released was handed out"
                );
            }
        });
        s.close();
        s.collect(|b| b.0.clear());
        released.store(true, Ordering::SeqCst);
        owner.join().unwrap();
    });
}

#[derive(Default)]
struct WithLane {
    items: Vec<u32>,
    lane: Option<Arc<()>>,
}

impl SlotState for WithLane {
    fn is_empty(&self) -> bool {
        self.items.is_empty()
    }
}

/// A park and a revive that makes the slot's lane (a reference back to the cache's owner)
/// racing a close that takes every parked block and drops every lane: the park may slip in
/// after the close's sweep, but the reviver checks `is_closed` after its update and drops the
/// lane itself, so no lane survives the close either way (it would keep the owner alive
/// forever).
#[test]
fn no_lane_survives_a_close() {
    loom::model(|| {
        let s = Arc::new(ThreadSlots::new(2, WithLane::default));
        let owner = Arc::new(());
        let (s2, o2) = (s.clone(), owner.clone());
        let reviver = thread::spawn(move || {
            if s2.is_closed() {
                return;
            }
            s2.update(0, |b| b.items.push(1));
            let lane = s2.update(0, |b| {
                b.items.pop()?;
                Some(b.lane.get_or_insert_with(|| o2.clone()).clone())
            });
            if s2.is_closed() {
                s2.update(0, |b| b.lane = None);
            }
            drop(lane);
        });
        s.close();
        s.collect_all(|b| {
            b.items.clear();
            b.lane = None;
        });
        reviver.join().unwrap();
        let mut lanes = 0;
        s.for_each(|b| lanes += usize::from(b.lane.is_some()));
        assert_eq!(lanes, 0, "a lane outlived the close");
        assert_eq!(Arc::strong_count(&owner), 1);
    });
}
