//! [`Shutdown`]: a one-way signal. Once triggered it stays triggered; every waiter wakes,
//! and waiters that come later return at once.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use gpualloc_runtime::sync::atomic::{AtomicBool, Ordering};
use gpualloc_runtime::sync::{lock, Mutex};

/// The shutdown signal. See the module docs.
#[derive(Default)]
pub struct Shutdown {
    triggered: AtomicBool,
    wakers: Mutex<Vec<Waker>>,
}

impl std::fmt::Debug for Shutdown {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shutdown")
            .field("triggered", &self.is_triggered())
            .finish()
    }
}

impl Shutdown {
    /// Not triggered.
    pub fn new() -> Self {
        Shutdown::default()
    }

    /// Triggers the signal; true for the call that triggered it first.
    pub fn trigger(&self) -> bool {
        let first = !self.triggered.swap(true, Ordering::AcqRel);
        let wakers = std::mem::take(&mut *lock(&self.wakers));
        for w in wakers {
            w.wake();
        }
        first
    }

    /// True once triggered.
    pub fn is_triggered(&self) -> bool {
        self.triggered.load(Ordering::Acquire)
    }

    /// Resolves once triggered.
    pub fn wait(&self) -> ShutdownWait<'_> {
        ShutdownWait { shutdown: self }
    }
}

/// Future of [`Shutdown::wait`].
#[derive(Debug)]
pub struct ShutdownWait<'a> {
    shutdown: &'a Shutdown,
}

impl Future for ShutdownWait<'_> {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if self.shutdown.is_triggered() {
            return Poll::Ready(());
        }
        let mut wakers = lock(&self.shutdown.wakers);
        // Re-check under the lock: `trigger` sets the flag before taking the wakers.
        if self.shutdown.is_triggered() {
            return Poll::Ready(());
        }
        if !wakers.iter().any(|w| w.will_wake(cx.waker())) {
            wakers.push(cx.waker().clone());
        }
        Poll::Pending
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use futures::FutureExt;

    #[test]
    fn triggers_once_and_releases_everyone() {
        let s = Shutdown::new();
        assert!(s.wait().now_or_never().is_none());
        assert!(s.trigger());
        assert!(!s.trigger());
        assert!(s.wait().now_or_never().is_some());
        assert!(s.is_triggered());
    }
}
