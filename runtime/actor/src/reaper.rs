//! The timed reaper's arm/disarm logic: a reaper task processes completed stream events on an
//! interval while any frees are pending, and sleeps (no timer, no wake-ups) when none are.
//!
//! Whoever creates pending work calls [`ReaperArm::arm`]: the first arm since the reaper went
//! to sleep wakes it. The reaper, each tick, first [`ReaperArm::disarm`]s and then checks for
//! pending work; if there is none it sleeps. Disarming *before* checking closes the race with
//! an `arm` that lands between the check and the sleep: that arm finds the flag clear and
//! notifies, so the reaper's next wait returns at once.

use std::future::Future;
use std::time::Duration;

use futures::future::{select, Either};

use crate::notify::Notify;
use crate::shutdown::Shutdown;
use gpualloc_runtime::sync::atomic::{AtomicBool, Ordering};

/// The reaper's wake-up flag. See the module docs.
#[derive(Debug, Default)]
pub struct ReaperArm {
    armed: AtomicBool,
    notify: Notify,
}

impl ReaperArm {
    /// A sleeping reaper's flag.
    pub fn new() -> Self {
        ReaperArm::default()
    }

    /// Pending work exists: make sure the reaper is running. Cheap when it already is.
    pub fn arm(&self) {
        if !self.armed.swap(true, Ordering::AcqRel) {
            self.notify.notify();
        }
    }

    /// Reaper only: clear the flag before checking for pending work.
    pub fn disarm(&self) {
        self.armed.store(false, Ordering::Release);
    }

    /// True while armed (a hint).
    pub fn is_armed(&self) -> bool {
        self.armed.load(Ordering::Acquire)
    }

    /// Resolves after the next `arm` that found the reaper asleep.
    pub async fn armed(&self) {
        self.notify.notified().await
    }

    /// Runs the reaper until `shutdown`: sleeps until armed, then calls `tick` every
    /// `interval` (with `sleep` from the caller's runtime) until `tick` reports no pending
    /// work. `tick` returns true while work is pending.
    pub async fn run<S, T>(
        &self,
        shutdown: &Shutdown,
        interval: Duration,
        sleep: impl Fn(Duration) -> S,
        mut tick: impl FnMut() -> T,
    ) where
        S: Future<Output = ()>,
        T: Future<Output = bool>,
    {
        loop {
            if shutdown.is_triggered() {
                return;
            }
            let armed = std::pin::pin!(self.armed());
            let stop = std::pin::pin!(shutdown.wait());
            if let Either::Right(_) = select(armed, stop).await {
                return;
            }
            loop {
                let nap = std::pin::pin!(sleep(interval));
                let stop = std::pin::pin!(shutdown.wait());
                if let Either::Right(_) = select(nap, stop).await {
                    return;
                }
                self.disarm();
                if !tick().await {
                    break;
                }
            }
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use futures::FutureExt;

    #[test]
    fn arm_wakes_once_and_disarm_reenables() {
        let r = ReaperArm::new();
        assert!(r.armed().now_or_never().is_none());
        r.arm();
        r.arm();
        assert!(r.armed().now_or_never().is_some());
        assert!(
            r.armed().now_or_never().is_none(),
            "a second arm while armed does not notify"
        );
        r.disarm();
        r.arm();
        assert!(r.armed().now_or_never().is_some());
    }
}
