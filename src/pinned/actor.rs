//! [`HostActor`]: the pinned-host allocator's actor, shared by the
//! [`Allocator`](crate::Allocator), its [`HostAllocator`](crate::HostAllocator) handles and
//! every live [`PinnedBuffer`].
//!
//! A malloc first tries the gate and looks in the cache inline (no channel, no wake-up); if
//! the gate is busy the cache lookup is queued and its future awaits the reply. A miss
//! continues on tokio's blocking pool, so no async worker ever waits on the driver: the
//! fresh pinned memory (`host_alloc`, or map + prefault + `host_register`) is allocated
//! outside the gate (the core's split malloc, `gpualloc_host::core::split`), so hits keep
//! being served meanwhile; only adopting the new block takes the gate again.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use gpualloc_actor::mailbox::Call;
use gpualloc_actor::{Mailbox, ReplySpin, Shutdown};
use gpualloc_devices::AllocError;
use gpualloc_host::core::split::Lookup;
use gpualloc_host::{HostBlock, HostCore, HostStats};
use gpualloc_runtime::Backend;

use crate::error::Error;
use crate::fork::ProcessGuard;
use crate::pinned::buffer::PinnedBuffer;
use crate::pinned::state::{HostSignals, HostState};

/// Tries of the gate before a request is queued.
const SPINS: usize = 4;

/// Checks of a queued request's reply before its task waits to be woken, one pause apart
/// (`Mailbox::await_reply`).
const REPLY_SPIN: ReplySpin = ReplySpin {
    rounds: 64,
    doubling: false,
};

/// The pinned-host allocator's actor. See the module docs.
pub struct HostActor {
    pub(crate) backend: Arc<dyn Backend>,
    pub(crate) mailbox: Mailbox<HostState>,
    pub(crate) signals: Arc<HostSignals>,
    pub(crate) process: ProcessGuard,
    /// Stops the actor task (not the core: that is `shutdown_blocking`).
    pub(crate) stop: Shutdown,
    /// Set once shutdown began: new requests fail at once.
    shut_down: AtomicBool,
}

impl std::fmt::Debug for HostActor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostActor")
            .field("backend", &self.backend.name())
            .finish_non_exhaustive()
    }
}

/// What the cache-only half of a malloc produced.
enum Cached {
    Hit(PinnedBuffer),
    Miss,
}

impl HostActor {
    pub(crate) fn new(
        core: HostCore,
        backend: Arc<dyn Backend>,
        process: ProcessGuard,
    ) -> Arc<Self> {
        let signals = Arc::new(HostSignals::default());
        Arc::new(HostActor {
            backend,
            mailbox: Mailbox::new(HostState {
                core,
                signals: signals.clone(),
                shut_down: false,
                recorded: Default::default(),
                retired: Vec::new(),
            }),
            signals,
            process,
            stop: Shutdown::new(),
            shut_down: AtomicBool::new(false),
        })
    }

    /// `Err(Forked)` in a forked child, `Err(Shutdown)` after shutdown.
    pub(crate) fn check(&self) -> Result<(), Error> {
        self.process.check()?;
        if self.shut_down.load(Ordering::Acquire) {
            return Err(AllocError::Shutdown.into());
        }
        Ok(())
    }

    /// Runs `f` on the state: inline if the gate is free, else queued for the holder.
    pub(crate) async fn call<R, F>(&self, f: F) -> Result<R, Error>
    where
        R: Send + 'static,
        F: FnOnce(&mut HostState) -> R + Send + 'static,
    {
        match self.mailbox.call(f) {
            Call::Ready(r) => Ok(r),
            Call::Queued(rx) => self
                .mailbox
                .await_reply(rx, REPLY_SPIN)
                .await
                .ok_or_else(|| Error::Internal("a queued pinned request was dropped".into())),
        }
    }

    /// The cache lookup under the gate.
    fn lookup(st: &mut HostState, size: u64) -> Result<Option<HostBlock>, Error> {
        if st.shut_down {
            return Err(AllocError::Shutdown.into());
        }
        Ok(st.core.try_cached(size)?)
    }

    /// `malloc`: a hit inline, a miss on the blocking pool.
    pub(crate) async fn malloc(self: &Arc<Self>, size: u64) -> Result<PinnedBuffer, Error> {
        self.check()?;
        let mut attempt = None;
        for _ in 0..SPINS {
            if !self.mailbox.is_busy() {
                if let Ok(r) = self.mailbox.try_run(|st| Self::lookup(st, size)) {
                    attempt = Some(r);
                    break;
                }
            }
            std::hint::spin_loop();
        }
        let outcome = match attempt {
            Some(Ok(Some(block))) => Cached::Hit(PinnedBuffer::new(block, self.clone())),
            Some(Ok(None)) => Cached::Miss,
            Some(Err(e)) => return Err(e),
            None => {
                // The buffer is built inside the job, so a hit delivered to a cancelled
                // request is dropped and returns its block.
                let actor = self.clone();
                self.call(move |st| {
                    Ok::<_, Error>(match Self::lookup(st, size)? {
                        Some(block) => Cached::Hit(PinnedBuffer::new(block, actor)),
                        None => Cached::Miss,
                    })
                })
                .await??
            }
        };
        match outcome {
            Cached::Hit(buf) => Ok(buf),
            Cached::Miss => {
                let actor = self.clone();
                // Runs to completion even if this future is dropped; the buffer is then
                // dropped there and returns its block: nothing leaks.
                tokio::task::spawn_blocking(move || actor.miss_blocking(size))
                    .await
                    .map_err(|e| Error::Internal(format!("pinned malloc task failed: {e}")))?
            }
        }
    }

    /// A miss, on the blocking pool: the cheap steps under the gate, the fresh allocation
    /// (driver call, or map + prefault + register) outside it, then adopt it under the gate.
    /// Out of memory: the core's own chain (release the cache, retry) under the gate.
    fn miss_blocking(self: &Arc<Self>, size: u64) -> Result<PinnedBuffer, Error> {
        let _span = tracing::debug_span!("pinned_malloc_miss", size).entered();
        let lookup = {
            let mut held = self.mailbox.hold_blocking();
            let st = held.state();
            if st.shut_down {
                return Err(AllocError::Shutdown.into());
            }
            st.core.lookup_miss(size)?
        };
        let request = match lookup {
            Lookup::Hit(block) => return Ok(PinnedBuffer::new(block, self.clone())),
            Lookup::Fresh(request) => request,
        };
        let block = match request.allocate() {
            Ok(memory) => {
                let mut held = self.mailbox.hold_blocking();
                let st = held.state();
                let block = st.core.adopt(memory);
                if st.shut_down {
                    st.free(block.ptr);
                    return Err(AllocError::Shutdown.into());
                }
                block
            }
            Err(e) if e.is_oom() => {
                tracing::info!(size, "pinned memory full: releasing the cache and retrying");
                let mut held = self.mailbox.hold_blocking();
                let st = held.state();
                if st.shut_down {
                    return Err(AllocError::Shutdown.into());
                }
                st.core.malloc(size)?
            }
            Err(e) => return Err(e.into()),
        };
        Ok(PinnedBuffer::new(block, self.clone()))
    }

    /// Statistics (PyTorch's `host_memory_stats`; [`HostStats::as_map`] gives its keys).
    pub(crate) async fn stats(&self) -> Result<HostStats, Error> {
        self.process.check()?;
        self.call(|st| st.core.stats()).await
    }

    /// Returns every cached block to the backend, off the async workers (releasing pinned
    /// memory is a slow driver call).
    pub(crate) async fn empty_cache(self: &Arc<Self>) -> Result<(), Error> {
        self.check()?;
        let actor = self.clone();
        tokio::task::spawn_blocking(move || {
            let mut held = actor.mailbox.hold_blocking();
            held.state().core.empty_cache().map_err(Error::from)
        })
        .await
        .map_err(|e| Error::Internal(format!("pinned empty_cache task failed: {e}")))?
    }

    /// Shuts the core down: waits for every pending stream event, then releases every cached
    /// block. Live buffers keep their memory (it is CPU memory their owners may still read);
    /// each goes back to the backend when dropped. New requests fail with `Shutdown`.
    pub(crate) fn shutdown_blocking(&self) -> Result<(), Error> {
        self.shut_down.store(true, Ordering::Release);
        let mut held = self.mailbox.hold_blocking();
        let st = held.state();
        st.shut_down = true;
        let drained = st.core.drain_events().map(|_| ());
        let emptied = st.core.empty_cache();
        let retired = std::mem::take(&mut st.retired);
        drop(held);
        drop(retired);
        drained.and(emptied).map_err(Error::from)
    }
}
