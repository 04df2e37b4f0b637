//! [`Waiters`]: requests waiting for memory instead of failing, served first come, first
//! served.
//!
//! A request that could not be served joins the queue ([`Waiters::join`]) and gets a
//! [`WaitTurn`]. Only the head of the queue is ever woken: by [`Waiters::wake_head`] (called
//! whenever memory comes back: a free, completed events, a released cache) or when the head
//! before it leaves. A woken head retries; on success it calls [`WaitTurn::finish`], which
//! wakes the next head; on failure it waits again, keeping its place. A turn dropped at any
//! point (cancellation, timeout) leaves the queue and passes the head's wake-up on, so a
//! cancelled waiter never strands the ones behind it.
//!
//! A request joining the queue is woken at once: it retries right after joining, so memory
//! freed between its failed attempt and the join is not missed (behind a head, that retry
//! may overtake it; see below).
//!
//! First come, first served, with bounded overtaking: a large head that cannot be served must
//! not block smaller requests behind it that would fit. A woken waiter whose retry fails
//! calls [`WaitTurn::pass`], which wakes the next one in the queue, so the memory that came
//! back is offered to every waiter in order until one fits. Each waiter served while the
//! head still waits *overtakes* it; after [`MAX_OVERTAKES`] overtakes the head ages into
//! strict FIFO: `pass` stops at it, and memory that comes back is offered to the head alone
//! until it is served (or leaves). So a head is overtaken at most `MAX_OVERTAKES` times:
//! never starved forever.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use gpualloc_runtime::sync::atomic::{AtomicUsize, Ordering};
use gpualloc_runtime::sync::{lock, Mutex};

/// How many later waiters may be served while the head waits, before memory that comes back
/// is offered to the head alone (see the module docs).
pub const MAX_OVERTAKES: u32 = 8;

struct Entry {
    id: u64,
    notified: bool,
    waker: Option<Waker>,
    /// Later waiters served while this one was the head.
    overtaken: u32,
}

#[derive(Default)]
struct Inner {
    queue: VecDeque<Entry>,
    next_id: u64,
}

/// The FIFO queue of waiting requests. See the module docs.
#[derive(Default)]
pub struct Waiters {
    inner: Mutex<Inner>,
    len: AtomicUsize,
}

impl std::fmt::Debug for Waiters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Waiters").field("len", &self.len()).finish()
    }
}

impl Waiters {
    /// An empty queue.
    pub fn new() -> Self {
        Waiters::default()
    }

    /// Number of waiting requests (a hint; cheap enough for every free).
    #[inline]
    pub fn len(&self) -> usize {
        self.len.load(Ordering::SeqCst)
    }

    /// True when nobody waits.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Waiting requests that are parked: their [`WaitTurn::wait`] was polled and is pending,
    /// with no wake-up since, so none of them is retrying (a request that joined, or was
    /// woken, is not parked until its retry failed and it waits again). A turn whose wait
    /// future was dropped unfinished still counts until it is woken or leaves (the facade
    /// drops one only at a timeout, right before its turn). Takes the queue's lock: for
    /// diagnostics and tests, not for every free.
    pub fn parked(&self) -> usize {
        lock(&self.inner)
            .queue
            .iter()
            .filter(|e| !e.notified && e.waker.is_some())
            .count()
    }

    /// Joins the tail of the queue.
    pub fn join(&self) -> WaitTurn<'_> {
        let mut inner = lock(&self.inner);
        let id = inner.next_id;
        inner.next_id += 1;
        // An empty queue: retry at once. Behind a head: try once at once (overtaking it if
        // it fits), unless the head has been overtaken enough.
        let notified = inner
            .queue
            .front()
            .is_none_or(|head| head.overtaken < MAX_OVERTAKES);
        inner.queue.push_back(Entry {
            id,
            notified,
            waker: None,
            overtaken: 0,
        });
        self.len.fetch_add(1, Ordering::SeqCst);
        WaitTurn {
            waiters: self,
            id,
            left: false,
        }
    }

    /// Memory came back: wake the head of the queue, if any.
    #[inline]
    pub fn wake_head(&self) {
        if self.is_empty() {
            return;
        }
        let waker = notify_head(&mut lock(&self.inner));
        if let Some(w) = waker {
            w.wake();
        }
    }

    /// Leaves the queue; `served` when the request got its memory (a waiter served behind
    /// the head counts as overtaking it).
    fn leave(&self, id: u64, served: bool) {
        let waker = {
            let mut inner = lock(&self.inner);
            let Some(pos) = inner.queue.iter().position(|e| e.id == id) else {
                return;
            };
            let unconsumed = inner.queue.remove(pos).is_some_and(|e| e.notified);
            self.len.fetch_sub(1, Ordering::SeqCst);
            if pos == 0 {
                notify_head(&mut inner)
            } else if served || unconsumed {
                // Served: it overtook the head, and what is left of the memory may fit the
                // one that was behind it (now at `pos`). Cancelled with a wake-up it never
                // used: pass that on.
                if served {
                    if let Some(head) = inner.queue.front_mut() {
                        head.overtaken = head.overtaken.saturating_add(1);
                    }
                }
                offer_at(&mut inner, pos)
            } else {
                None
            }
        };
        if let Some(w) = waker {
            w.wake();
        }
    }

    /// The waiter `id` retried and failed: offer the memory to the one behind it, unless the
    /// head has been overtaken [`MAX_OVERTAKES`] times.
    fn pass(&self, id: u64) {
        let waker = {
            let mut inner = lock(&self.inner);
            let Some(pos) = inner.queue.iter().position(|e| e.id == id) else {
                return;
            };
            offer_at(&mut inner, pos + 1)
        };
        if let Some(w) = waker {
            w.wake();
        }
    }
}

/// Offers memory that came back to the waiter at `pos` (behind the head), unless the head has
/// been overtaken [`MAX_OVERTAKES`] times: then it is the head's alone.
fn offer_at(inner: &mut Inner, pos: usize) -> Option<Waker> {
    let aged = inner
        .queue
        .front()
        .is_some_and(|head| head.overtaken >= MAX_OVERTAKES);
    if aged {
        return None;
    }
    let next = inner.queue.get_mut(pos)?;
    next.notified = true;
    next.waker.take()
}

fn notify_head(inner: &mut Inner) -> Option<Waker> {
    let head = inner.queue.front_mut()?;
    head.notified = true;
    head.waker.take()
}

/// A place in the queue. Dropping it leaves the queue (see the module docs).
pub struct WaitTurn<'a> {
    waiters: &'a Waiters,
    id: u64,
    left: bool,
}

impl<'a> WaitTurn<'a> {
    /// Waits until this request should retry (it is the head and memory came back).
    pub fn wait(&self) -> WaitFuture<'a> {
        WaitFuture {
            waiters: self.waiters,
            id: self.id,
        }
    }

    /// True if this request is at the head of the queue.
    pub fn is_head(&self) -> bool {
        lock(&self.waiters.inner)
            .queue
            .front()
            .is_some_and(|e| e.id == self.id)
    }

    /// The request was served: leave the queue and wake the next head.
    pub fn finish(mut self) {
        self.left = true;
        self.waiters.leave(self.id, true);
    }

    /// This request was woken, retried and still does not fit: offer the memory that came
    /// back to the waiter behind it (bounded overtaking; see the module docs). Keeps this
    /// request's place.
    pub fn pass(&self) {
        self.waiters.pass(self.id);
    }
}

impl Drop for WaitTurn<'_> {
    fn drop(&mut self) {
        if !self.left {
            self.waiters.leave(self.id, false);
        }
    }
}

/// Future of [`WaitTurn::wait`]; consumes the wake-up it resolves on. Dropping it keeps the
/// place in the queue (the [`WaitTurn`] owns that).
/// If the turn is gone, the future resolves at once.
pub struct WaitFuture<'a> {
    waiters: &'a Waiters,
    id: u64,
}

impl Future for WaitFuture<'_> {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let id = self.id;
        let mut inner = lock(&self.waiters.inner);
        let Some(entry) = inner.queue.iter_mut().find(|e| e.id == id) else {
            return Poll::Ready(());
        };
        if std::mem::take(&mut entry.notified) {
            return Poll::Ready(());
        }
        match &entry.waker {
            Some(w) if w.will_wake(cx.waker()) => {}
            _ => entry.waker = Some(cx.waker().clone()),
        }
        Poll::Pending
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use futures::FutureExt;

    #[test]
    fn only_the_head_is_woken_in_order() {
        let w = Waiters::new();
        let a = w.join();
        let b = w.join();
        assert_eq!(w.len(), 2);
        assert!(a.is_head() && !b.is_head());
        assert!(
            a.wait().now_or_never().is_some(),
            "joining an empty queue wakes at once"
        );
        assert!(
            b.wait().now_or_never().is_some(),
            "joining behind a head tries once at once"
        );
        assert_eq!(
            w.parked(),
            0,
            "both were woken at their join and polled nothing yet"
        );
        assert!(a.wait().now_or_never().is_none());
        assert_eq!(w.parked(), 1, "a waits for memory");
        w.wake_head();
        assert_eq!(w.parked(), 0, "a's wake-up is pending");
        assert!(b.wait().now_or_never().is_none(), "b is not the head");
        assert!(a.wait().now_or_never().is_some());
        a.finish();
        assert!(b.is_head());
        assert!(
            b.wait().now_or_never().is_some(),
            "the next head is woken when the head leaves"
        );
        drop(b);
        assert!(w.is_empty());
    }

    #[test]
    fn a_head_that_does_not_fit_passes_the_memory_on() {
        let w = Waiters::new();
        let big = w.join();
        let small1 = w.join();
        let small2 = w.join();
        // Each tried once on joining (and did not fit).
        for t in [&big, &small1, &small2] {
            assert!(t.wait().now_or_never().is_some());
        }
        // Memory comes back; the head retries, fails and passes it on.
        w.wake_head();
        assert!(big.wait().now_or_never().is_some());
        assert!(small1.wait().now_or_never().is_none(), "not offered yet");
        big.pass();
        assert!(
            small1.wait().now_or_never().is_some(),
            "offered after the head"
        );
        assert!(small2.wait().now_or_never().is_none());
        small1.finish();
        assert!(big.is_head(), "the head keeps its place");
        assert!(
            small2.wait().now_or_never().is_some(),
            "what is left is offered to the next"
        );
        // A waiter that also fails passes it further.
        w.wake_head();
        assert!(big.wait().now_or_never().is_some());
        big.pass();
        assert!(small2.wait().now_or_never().is_some());
        small2.pass();
        drop(small2);
        assert_eq!(w.len(), 1);
    }

    #[test]
    fn the_head_is_overtaken_at_most_max_overtakes_times() {
        let w = Waiters::new();
        let head = w.join();
        assert!(head.wait().now_or_never().is_some());
        for i in 0..MAX_OVERTAKES {
            let later = w.join();
            assert!(
                later.wait().now_or_never().is_some(),
                "tries once on joining"
            );
            head.pass();
            assert!(
                later.wait().now_or_never().is_some(),
                "overtake {i} is allowed"
            );
            later.finish();
        }
        let later = w.join();
        assert!(
            later.wait().now_or_never().is_none(),
            "an aged head: a new waiter does not even try"
        );
        head.pass();
        assert!(
            later.wait().now_or_never().is_none(),
            "after {MAX_OVERTAKES} overtakes the memory is the head's alone"
        );
        w.wake_head();
        assert!(later.wait().now_or_never().is_none());
        assert!(head.wait().now_or_never().is_some());
        // Once the head is served, the next head starts with a fresh budget.
        head.finish();
        assert!(later.is_head());
        assert!(later.wait().now_or_never().is_some());
        let behind = w.join();
        assert!(behind.wait().now_or_never().is_some());
        later.pass();
        assert!(
            behind.wait().now_or_never().is_some(),
            "a new head's budget is fresh"
        );
        drop(behind);
        drop(later);
        assert!(w.is_empty());
    }

    #[test]
    fn a_cancelled_waiter_passes_an_unused_wake_up_on() {
        let w = Waiters::new();
        let a = w.join();
        let b = w.join();
        let c = w.join();
        for t in [&a, &b, &c] {
            assert!(t.wait().now_or_never().is_some());
        }
        a.pass();
        drop(b);
        assert!(
            c.wait().now_or_never().is_some(),
            "b never used the memory a passed on"
        );
        drop(c);
        drop(a);
        assert!(w.is_empty());
    }

    #[test]
    fn a_cancelled_head_passes_the_turn_on() {
        let w = Waiters::new();
        let a = w.join();
        let b = w.join();
        let c = w.join();
        assert!(b.wait().now_or_never().is_some());
        assert!(c.wait().now_or_never().is_some());
        drop(a);
        assert!(b.wait().now_or_never().is_some());
        assert!(c.wait().now_or_never().is_none(), "not the head yet");
        drop(b);
        assert!(c.wait().now_or_never().is_some());
        assert_eq!(w.len(), 1);
    }
}
