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
//! A request joining an empty queue is woken at once: it retries right after joining, so
//! memory freed between its failed attempt and the join is not missed.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use crate::sync::atomic::{AtomicUsize, Ordering};
use crate::sync::{lock, Mutex};

struct Entry {
    id: u64,
    notified: bool,
    waker: Option<Waker>,
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
    pub fn len(&self) -> usize {
        self.len.load(Ordering::SeqCst)
    }

    /// True when nobody waits.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Joins the tail of the queue.
    pub fn join(&self) -> WaitTurn<'_> {
        let mut inner = lock(&self.inner);
        let id = inner.next_id;
        inner.next_id += 1;
        let notified = inner.queue.is_empty();
        inner.queue.push_back(Entry {
            id,
            notified,
            waker: None,
        });
        self.len.fetch_add(1, Ordering::SeqCst);
        WaitTurn {
            waiters: self,
            id,
            left: false,
        }
    }

    /// Memory came back: wake the head of the queue, if any.
    pub fn wake_head(&self) {
        if self.is_empty() {
            return;
        }
        let waker = notify_head(&mut lock(&self.inner));
        if let Some(w) = waker {
            w.wake();
        }
    }

    fn leave(&self, id: u64) {
        let waker = {
            let mut inner = lock(&self.inner);
            let Some(pos) = inner.queue.iter().position(|e| e.id == id) else {
                return;
            };
            inner.queue.remove(pos);
            self.len.fetch_sub(1, Ordering::SeqCst);
            if pos == 0 {
                notify_head(&mut inner)
            } else {
                None
            }
        };
        if let Some(w) = waker {
            w.wake();
        }
    }
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
        self.waiters.leave(self.id);
    }
}

impl Drop for WaitTurn<'_> {
    fn drop(&mut self) {
        if !self.left {
            self.waiters.leave(self.id);
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
        assert!(a.wait().now_or_never().is_none());
        w.wake_head();
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
    fn a_cancelled_head_passes_the_turn_on() {
        let w = Waiters::new();
        let a = w.join();
        let b = w.join();
        let c = w.join();
        drop(a);
        assert!(b.wait().now_or_never().is_some());
        assert!(c.wait().now_or_never().is_none(), "not the head yet");
        drop(b);
        assert!(c.wait().now_or_never().is_some());
        assert_eq!(w.len(), 1);
    }
}
