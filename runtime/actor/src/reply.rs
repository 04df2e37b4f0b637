//! A one-shot reply slot: the actor side puts a value, the requesting side awaits it.
//!
//! If the requester is gone (its future was dropped: cancellation), [`ReplySender::send`]
//! hands the value back so the sender can undo the work; and a value that was delivered but
//! never taken is dropped with the slot, so RAII values (a buffer that returns its block on
//! drop) never leak either way.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use gpualloc_runtime::sync::{lock, Arc, Mutex};

enum Slot<T> {
    Waiting(Option<Waker>),
    Full(T),
    Taken,
    /// The receiver was dropped.
    Closed,
}

/// The sending half: used once.
pub struct ReplySender<T> {
    slot: Arc<Mutex<Slot<T>>>,
    sent: bool,
}

/// The receiving half: a future of the value, or `None` if the sender was dropped unsent.
pub struct ReplyFuture<T> {
    slot: Arc<Mutex<Slot<T>>>,
}

/// A connected sender and future.
pub fn reply_slot<T>() -> (ReplySender<T>, ReplyFuture<T>) {
    let slot = Arc::new(Mutex::new(Slot::Waiting(None)));
    (
        ReplySender {
            slot: slot.clone(),
            sent: false,
        },
        ReplyFuture { slot },
    )
}

impl<T> ReplySender<T> {
    /// Delivers `value`; gives it back if the receiver is gone.
    pub fn send(mut self, value: T) -> Result<(), T> {
        self.sent = true;
        let waker = {
            let mut s = lock(&self.slot);
            match std::mem::replace(&mut *s, Slot::Taken) {
                Slot::Waiting(w) => {
                    *s = Slot::Full(value);
                    w
                }
                Slot::Closed => {
                    *s = Slot::Closed;
                    return Err(value);
                }
                other => {
                    *s = other;
                    return Err(value);
                }
            }
        };
        if let Some(w) = waker {
            w.wake();
        }
        Ok(())
    }

    /// True if the receiver was dropped (the request was cancelled).
    pub fn is_closed(&self) -> bool {
        matches!(&*lock(&self.slot), Slot::Closed)
    }
}

impl<T> Drop for ReplySender<T> {
    fn drop(&mut self) {
        if self.sent {
            return;
        }
        // Dropped unsent (the message was discarded): wake the receiver so it sees `None`.
        let waker = {
            let mut s = lock(&self.slot);
            match std::mem::replace(&mut *s, Slot::Taken) {
                Slot::Waiting(w) => w,
                other => {
                    *s = other;
                    None
                }
            }
        };
        if let Some(w) = waker {
            w.wake();
        }
    }
}

impl<T> Future for ReplyFuture<T> {
    type Output = Option<T>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<T>> {
        let mut s = lock(&self.slot);
        match std::mem::replace(&mut *s, Slot::Taken) {
            Slot::Full(v) => Poll::Ready(Some(v)),
            Slot::Taken | Slot::Closed => Poll::Ready(None),
            Slot::Waiting(w) => {
                let w = match w {
                    Some(w) if w.will_wake(cx.waker()) => w,
                    _ => cx.waker().clone(),
                };
                *s = Slot::Waiting(Some(w));
                Poll::Pending
            }
        }
    }
}

impl<T> Drop for ReplyFuture<T> {
    fn drop(&mut self) {
        // Take any delivered value out under the lock and drop it outside: its drop may post
        // a message (a buffer returning its block).
        let left = {
            let mut s = lock(&self.slot);
            std::mem::replace(&mut *s, Slot::Closed)
        };
        drop(left);
    }
}

impl<T> ReplyFuture<T> {
    /// True once a value (or the sender's drop) has arrived: polling now returns `Ready`.
    pub fn is_ready(&self) -> bool {
        !matches!(&*lock(&self.slot), Slot::Waiting(_))
    }

    /// Blocks the current thread until the reply comes (for blocking-pool threads only).
    pub fn wait_blocking(self) -> Option<T> {
        futures::executor::block_on(self)
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn delivers_once() {
        let (tx, rx) = reply_slot();
        assert!(tx.send(7u32).is_ok());
        assert_eq!(futures::executor::block_on(rx), Some(7));
    }

    #[test]
    fn a_cancelled_receiver_gives_the_value_back() {
        let (tx, rx) = reply_slot();
        drop(rx);
        assert!(tx.is_closed());
        assert_eq!(tx.send(5u32), Err(5));
    }

    #[test]
    fn a_dropped_sender_resolves_to_none() {
        let (tx, rx) = reply_slot::<u32>();
        drop(tx);
        assert_eq!(futures::executor::block_on(rx), None);
    }

    #[test]
    fn an_undelivered_value_is_dropped_with_the_receiver() {
        let token = std::sync::Arc::new(());
        let (tx, rx) = reply_slot();
        assert!(tx.send(token.clone()).is_ok());
        drop(rx);
        assert_eq!(std::sync::Arc::strong_count(&token), 1);
    }
}
