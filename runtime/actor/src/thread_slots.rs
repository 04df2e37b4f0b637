//! [`ThreadSlots`]: one small slot of state per thread in front of a flat-combining cell, for
//! work a thread can do on its own without the gate (a device actor's thread cache parks
//! freed blocks there and hands them straight back to the same thread).
//!
//! Each slot is a mutex of its own, on its own cache lines, so the owning thread's updates
//! touch no line another thread writes. The gate holder must see everything the slots hold
//! before it reads or changes the guarded state: it calls [`ThreadSlots::collect`] first,
//! which visits only the slots marked in one `dirty` word (a single load when none are).
//!
//! The one rule, and why no slot content is ever missed: **an owner that leaves its slot
//! non-empty marks it (after unlocking) unless it sees the mark set; a collector clears the
//! marks before it locks the slots it visits.** Take an owner's update U and a collector C.
//! If C locks the slot after U unlocked it, C sees U's contents. Otherwise C unlocked the
//! slot before U locked it, so C's clearing happens before U's check of the mark: U sees it
//! clear and sets it, and the next collector visits. Either way a non-empty slot is marked
//! or being collected. The mark is a hint in the other direction: a marked slot may be
//! empty (the owner emptied it itself), which costs a collector one needless visit.
//!
//! A flag other threads raise and owners read after their updates ("somebody waits for
//! memory", "the slots are closed") is ordered the same way, through the slots' mutexes: the
//! thread that raised it then visits every slot ([`ThreadSlots::collect_all`]), so for each
//! slot either that visit sees the owner's update or the owner's later read sees the flag.
//! No fence is needed on the owners' path (`tests/loom_thread_slots.rs` checks both).

use gpualloc_runtime::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use gpualloc_runtime::sync::{lock, Mutex};

/// Most slots a [`ThreadSlots`] can have (one bit each in the dirty word).
pub const MAX_SLOTS: usize = 64;

/// What a slot holds.
pub trait SlotState: Send {
    /// True when a collector has nothing to take from this slot.
    fn is_empty(&self) -> bool;
}

/// A slot on its own cache lines (two, for adjacent-line prefetch).
#[repr(align(128))]
struct Padded<S>(Mutex<S>);

/// Per-thread slots with a dirty word. See the module docs.
pub struct ThreadSlots<S> {
    dirty: AtomicU64,
    closed: AtomicBool,
    slots: Box<[Padded<S>]>,
    /// `slots.len() - 1`: the count is a power of two, so a thread's slot is its index masked
    /// (an `and`, where `%` by a count read at run time is a division on every update, several
    /// per thread-cache round trip).
    mask: usize,
}

impl<S> std::fmt::Debug for ThreadSlots<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ThreadSlots")
            .field("slots", &self.slots.len())
            .field("dirty", &self.dirty.load(Ordering::SeqCst))
            .finish()
    }
}

impl<S: SlotState> ThreadSlots<S> {
    /// `count` slots (clamped to 1..=[`MAX_SLOTS`], then rounded up to a power of two), each
    /// made by `make`.
    pub fn new(count: usize, mut make: impl FnMut() -> S) -> Self {
        let count = count.clamp(1, MAX_SLOTS).next_power_of_two();
        ThreadSlots {
            dirty: AtomicU64::new(0),
            closed: AtomicBool::new(false),
            slots: (0..count).map(|_| Padded(Mutex::new(make()))).collect(),
            mask: count - 1,
        }
    }

    /// How many slots there are (a power of two; the tests check the rounding).
    #[cfg(all(test, not(loom)))]
    fn count(&self) -> usize {
        self.slots.len()
    }

    /// Owner side: runs `f` on slot `index % count` and marks it if `f` left it non-empty.
    /// Threads beyond the slot count share slots (correct, only slower).
    #[inline]
    pub fn update<R>(&self, index: usize, f: impl FnOnce(&mut S) -> R) -> R {
        let i = index & self.mask;
        let (r, non_empty) = {
            let mut slot = lock(&self.slots[i].0);
            let r = f(&mut slot);
            (r, !slot.is_empty())
        };
        if non_empty {
            let bit = 1u64 << i;
            // Read first: while the mark stays set the line stays shared, not written.
            if self.dirty.load(Ordering::SeqCst) & bit == 0 {
                self.dirty.fetch_or(bit, Ordering::SeqCst);
            }
        }
        r
    }

    /// Collector side (the gate holder): clears the marks and runs `f` on each slot that was
    /// marked, to take what it holds. One load when nothing is marked.
    pub fn collect(&self, mut f: impl FnMut(&mut S)) {
        if self.dirty.load(Ordering::SeqCst) == 0 {
            return;
        }
        let mut marked = self.dirty.swap(0, Ordering::SeqCst);
        while marked != 0 {
            let i = marked.trailing_zeros() as usize;
            marked &= marked - 1;
            f(&mut lock(&self.slots[i].0));
        }
    }

    /// Like [`ThreadSlots::collect`], but visits every slot, marked or not. This is what a
    /// thread that raised a flag owners check after their updates (e.g. "somebody waits for
    /// memory") runs next: locking every slot orders it against each owner's last update, so
    /// it sees that update's contents, or the owner sees the flag. No fence is needed on
    /// either side, which keeps fences off the owners' path (`tests/loom_thread_slots.rs`).
    pub fn collect_all(&self, mut f: impl FnMut(&mut S)) {
        self.dirty.swap(0, Ordering::SeqCst);
        for slot in self.slots.iter() {
            f(&mut lock(&slot.0));
        }
    }

    /// Runs `f` on every slot without taking anything (reading counters). Locks each in turn.
    pub fn for_each(&self, mut f: impl FnMut(&S)) {
        for slot in self.slots.iter() {
            f(&lock(&slot.0));
        }
    }

    /// True if slot `index % count` is marked (a hint: unmarked means its owner left it empty,
    /// or a collection is taking what it held). One load, no lock: an owner can skip a
    /// lookup in a slot that cannot hold anything.
    #[inline]
    pub fn is_marked(&self, index: usize) -> bool {
        self.dirty.load(Ordering::SeqCst) & (1u64 << (index & self.mask)) != 0
    }

    /// Marks the slots closed: from now on [`ThreadSlots::is_closed`] is true. Whoever takes
    /// something out of a slot checks it afterwards (see the device actor's thread cache).
    pub fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
    }

    /// True once [`ThreadSlots::close`] ran.
    #[inline]
    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::SeqCst)
    }
}

/// A small number naming the calling thread while it lives: the slot index of
/// [`ThreadSlots::update`]. A thread's number is handed back when it exits and reused by the
/// next new thread, so as long as at most [`MAX_SLOTS`] threads use the slots at once (a
/// runtime's workers, plus blocking-pool threads that come and go) no two live threads share
/// a slot. What a slot held when its thread exited stays there for the next collection.
/// `None` while the thread is being torn down.
#[cfg(not(loom))]
#[inline]
pub fn thread_index() -> Option<usize> {
    use std::sync::Mutex as StdMutex;

    /// Numbers handed back by exited threads, and the next never-used one.
    static FREE: StdMutex<(Vec<usize>, usize)> = StdMutex::new((Vec::new(), 0));

    struct Index(usize);

    impl Index {
        fn take() -> Index {
            let mut free = FREE.lock().unwrap_or_else(|p| p.into_inner());
            let (returned, next) = &mut *free;
            Index(returned.pop().unwrap_or_else(|| {
                *next += 1;
                *next - 1
            }))
        }
    }

    impl Drop for Index {
        fn drop(&mut self) {
            FREE.lock()
                .unwrap_or_else(|p| p.into_inner())
                .0
                .push(self.0);
        }
    }

    thread_local! {
        static INDEX: Index = Index::take();
    }
    INDEX.try_with(|i| i.0).ok()
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[derive(Default)]
    struct Bag(Vec<u32>);

    impl SlotState for Bag {
        fn is_empty(&self) -> bool {
            self.0.is_empty()
        }
    }

    #[test]
    fn collect_takes_what_owners_left_and_only_marked_slots() {
        let slots = ThreadSlots::new(4, Bag::default);
        assert!((0..4).all(|i| !slots.is_marked(i)));
        slots.update(1, |b| b.0.push(10));
        slots.update(5, |b| b.0.push(11)); // shares slot 1
        slots.update(2, |b| b.0.push(20));
        slots.update(2, |b| b.0.clear()); // emptied by its owner: marked, but empty
        assert!(slots.is_marked(1) && slots.is_marked(5) && slots.is_marked(2));
        assert!(!slots.is_marked(0) && !slots.is_marked(3));
        let mut seen = Vec::new();
        let mut visits = 0;
        slots.collect(|b| {
            visits += 1;
            seen.append(&mut b.0);
        });
        assert_eq!(seen, vec![10, 11]);
        assert_eq!(visits, 2, "slots 1 and 2 were marked, 0 and 3 were not");
        assert!((0..4).all(|i| !slots.is_marked(i)));
        let mut again = 0;
        slots.collect(|_| again += 1);
        assert_eq!(again, 0);
    }

    #[test]
    fn slot_count_is_clamped_and_close_is_sticky() {
        // At most MAX_SLOTS slots: index MAX_SLOTS lands on slot 0.
        let slots = ThreadSlots::new(1000, Bag::default);
        slots.update(MAX_SLOTS, |b| b.0.push(1));
        assert!(slots.is_marked(0) && !slots.is_marked(1));
        // At least one slot: every index lands on it.
        let one = ThreadSlots::new(0, Bag::default);
        one.update(5, |b| b.0.push(1));
        assert!(one.is_marked(0) && one.is_marked(7));
        assert_eq!((slots.count(), one.count()), (MAX_SLOTS, 1));
        // A count that is not a power of two is rounded up: 3 asked, 4 slots, so index 3
        // has a slot of its own and index 4 shares slot 0.
        let three = ThreadSlots::new(3, Bag::default);
        assert_eq!(three.count(), 4);
        three.update(3, |b| b.0.push(1));
        assert!(three.is_marked(3) && !three.is_marked(0));
        three.update(4, |b| b.0.push(2));
        assert!(three.is_marked(0) && !three.is_marked(1) && !three.is_marked(2));
        assert!(!slots.is_closed());
        slots.close();
        assert!(slots.is_closed());
    }

    #[test]
    fn live_threads_have_distinct_indices() {
        let here = thread_index().unwrap();
        assert_eq!(thread_index(), Some(here), "stable for the thread's life");
        // All four hold their numbers at the barrier at once.
        let barrier = std::sync::Arc::new(std::sync::Barrier::new(4));
        let live: Vec<_> = (0..4)
            .map(|_| {
                let barrier = barrier.clone();
                std::thread::spawn(move || {
                    let i = thread_index().unwrap();
                    barrier.wait();
                    i
                })
            })
            .collect();
        let mut seen: Vec<usize> = live.into_iter().map(|t| t.join().unwrap()).collect();
        seen.push(here);
        seen.sort();
        seen.dedup();
        assert_eq!(seen.len(), 5, "live threads never share an index: {seen:?}");
    }
}
