//! Waiting for memory: a malloc that, when the device is full even after the out-of-memory
//! chain, waits (bounded, first come first served, cancellable) for frees instead of failing.
//! A request larger than the whole device (or its memory-fraction cap) fails at once: no free
//! can make room for it. A waiter woken by a free that still does not fit passes the memory
//! on to the waiters behind it, so a large head does not block smaller requests that fit;
//! the head is overtaken at most `MAX_OVERTAKES` times, then memory waits for it alone
//! (`gpualloc_actor::waiters`).
//! The queue itself is `gpualloc_actor::Waiters`; frees and released caches wake
//! its head (`state.rs`, `slow.rs`).

use std::sync::Arc;
use std::time::Duration;

use crate::actor::device::DeviceActor;
use crate::buffer::DeviceBuffer;
use crate::error::Error;
use crate::options::MallocOptions;
use gpualloc_devices::MemPoolId;
use gpualloc_runtime::Stream;

impl DeviceActor {
    /// `malloc` of `pool` (`None`: the default pools) with `options`: waiting for memory or
    /// not.
    pub(crate) async fn malloc_with(
        self: &Arc<Self>,
        size: u64,
        stream: &Stream,
        pool: Option<MemPoolId>,
        options: MallocOptions,
    ) -> Result<DeviceBuffer, Error> {
        match options.wait_for_memory {
            None => self.malloc(size, stream, pool).await,
            Some(timeout) => self.malloc_waiting(size, stream, pool, timeout).await,
        }
    }

    /// `malloc`, waiting up to `timeout` (first come, first served) for frees to make room
    /// when the device is full. On timeout: the same out-of-memory error as without waiting.
    /// Like `malloc`, it counts no failure itself: the facade counts the one its user sees,
    /// so a wait that ends served counts none, however often it tried (`oom.rs`).
    pub(crate) async fn malloc_waiting(
        self: &Arc<Self>,
        size: u64,
        stream: &Stream,
        pool: Option<MemPoolId>,
        timeout: Duration,
    ) -> Result<DeviceBuffer, Error> {
        // Waiting needs a timer: the caller must be inside a tokio runtime.
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(Error::NoRuntime);
        }
        let deadline = tokio::time::Instant::now() + timeout;
        let waiters = &self.signals.waiters;
        // Queue behind requests already waiting, so they are served first.
        let mut turn = if waiters.is_empty() {
            None
        } else {
            Some(waiters.join())
        };
        loop {
            if let Some(t) = &turn {
                if tokio::time::timeout_at(deadline, t.wait()).await.is_err() {
                    // Out of time: one last try, whose error is the one to report.
                    let last = self.malloc(size, stream, pool).await;
                    drop(turn);
                    return last;
                }
            }
            match self.malloc(size, stream, pool).await {
                Ok(buf) => {
                    if let Some(t) = turn {
                        t.finish();
                    }
                    return Ok(buf);
                }
                Err(e) if e.is_oom() || matches!(&e, Error::Alloc(a) if a.is_retryable()) => {
                    if tokio::time::Instant::now() >= deadline || never_fits(&e) {
                        return Err(e);
                    }
                    if let Some(t) = &turn {
                        // Still too big for what came back: offer it to those behind.
                        t.pass();
                    } else {
                        tracing::debug_span!("malloc_wait", device = self.device.0, size).in_scope(
                            || {
                                tracing::debug!(
                                    device = self.device.0,
                                    size,
                                    "out of memory: waiting for frees"
                                )
                            },
                        );
                        turn = Some(waiters.join());
                        // Blocks parked in thread caches before the join go back to the
                        // core now; parks racing the join see it and free through the
                        // core (`thread_cache.rs`), so every later free wakes this turn.
                        self.call(|st| st.sweep_thread_cache()).await?;
                    }
                }
                Err(e) => return Err(e),
            }
        }
    }
}

/// True when the request cannot fit even on an empty device (`OomReport::exceeds_device`):
/// waiting for frees cannot help it.
fn never_fits(e: &Error) -> bool {
    e.oom_report().is_some_and(|r| r.exceeds_device())
}
