//! [`Notify`]: wakes one waiting task, keeping a permit if nobody waits yet, so a
//! notification sent before the wait is never lost. Used to wake an actor task (queued work
//! it must drain, events to reap, shutdown). `notify` never blocks beyond a tiny critical
//! section that runs no user code, so it is safe from `Drop` on any thread.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use gpualloc_runtime::sync::{lock, Mutex};

#[derive(Default)]
struct State {
    permit: bool,
    waker: Option<Waker>,
}

/// A wake-up for one waiting task. See the module docs.
#[derive(Default)]
pub struct Notify {
    state: Mutex<State>,
}

impl std::fmt::Debug for Notify {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Notify").finish_non_exhaustive()
    }
}

impl Notify {
    /// No permit, no waiter.
    pub fn new() -> Self {
        Notify::default()
    }

    /// Stores a permit and wakes the waiter, if any.
    pub fn notify(&self) {
        let waker = {
            let mut s = lock(&self.state);
            s.permit = true;
            s.waker.take()
        };
        if let Some(w) = waker {
            w.wake();
        }
    }

    /// A future that completes once a permit is available (consuming it).
    pub fn notified(&self) -> Notified<'_> {
        Notified { notify: self }
    }

    /// Consumes the permit if one is stored.
    pub fn try_take(&self) -> bool {
        std::mem::take(&mut lock(&self.state).permit)
    }
}

/// Future of [`Notify::notified`]. Dropping it leaves any permit in place.
#[derive(Debug)]
pub struct Notified<'a> {
    notify: &'a Notify,
}

impl Future for Notified<'_> {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let mut s = lock(&self.notify.state);
        if std::mem::take(&mut s.permit) {
            return Poll::Ready(());
        }
        match &s.waker {
            Some(w) if w.will_wake(cx.waker()) => {}
            _ => s.waker = Some(cx.waker().clone()),
        }
        Poll::Pending
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn a_permit_sent_before_the_wait_is_kept() {
        let n = Notify::new();
        n.notify();
        n.notify();
        futures::executor::block_on(n.notified());
        assert!(!n.try_take(), "two notifies store one permit");
    }

    #[test]
    fn wakes_a_waiter_on_another_thread() {
        let n = std::sync::Arc::new(Notify::new());
        let n2 = n.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(10));
            n2.notify();
        });
        futures::executor::block_on(n.notified());
        t.join().unwrap();
    }
}
