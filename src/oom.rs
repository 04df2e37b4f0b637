//! Out-of-memory observers: [`AllocatorBuilder::on_oom`](crate::AllocatorBuilder::on_oom)
//! callbacks and the `oom_snapshot_path` config key, PyTorch's
//! `_cuda_attach_out_of_memory_observer` plus the `_dump_snapshot` its users call from it.
//!
//! - They run when a `malloc` (of the allocator or of a pool) *fails* with an out-of-memory
//!   error (`Error::is_oom`): after the out-of-memory chain, and with `wait_for` only once the
//!   wait is over. Never for a wait that ends in a buffer.
//! - They run in the task of the failing `malloc`, after the device's actor answered: never
//!   while the device's gate is held, so an observer may call the allocator (take a
//!   snapshot, free a cache of its own). The `malloc` returns its error after them.
//! - With `oom_snapshot_path:/path/file.pickle` the snapshot (history included when one is
//!   being recorded, [`Allocator::record_history`]) is written there first, so the
//!   callbacks find it ([`OomEvent::snapshot`]). A failure to write it is logged, and the
//!   malloc's error is returned as it was. Concurrent failures write one after the other.
//! - An observer that panics is caught and logged; the others still run.
//! - The failure is counted here too, once (`num_ooms`, the history's `oom` entry, the
//!   warning), before the observers run: the device's own attempts are not counted, so a
//!   `malloc` retried while misses land or while waiting for memory is one failure, and a
//!   wait that ends in a buffer is none.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::Arc;

use gpualloc_runtime::{DeviceId, Stream};

use crate::{Allocator, DeviceActor, DeviceBuffer, Error};

/// What an out-of-memory observer is told.
#[derive(Debug, Clone)]
pub struct OomEvent {
    /// The device of the failed request.
    pub device: DeviceId,
    /// Bytes requested.
    pub size: u64,
    /// The error the `malloc` returns (PyTorch's report in `Error::oom_report`).
    pub error: Error,
    /// The snapshot written for it (`oom_snapshot_path`), if one was.
    pub snapshot: Option<PathBuf>,
}

/// An out-of-memory observer.
pub(crate) type OomObserver = Arc<dyn Fn(&OomEvent) + Send + Sync>;

/// The observers of an allocator.
#[derive(Clone, Default)]
pub(crate) struct OomObservers(pub(crate) Vec<OomObserver>);

impl std::fmt::Debug for OomObservers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} out-of-memory observers", self.0.len())
    }
}

impl Allocator {
    /// True if a `malloc`'s `result` needs [`Allocator::follow_up`]: frames to attach
    /// (recording with frames, `history_frames.rs`) or an out-of-memory failure to count and
    /// observe. Plain code, no future: the usual `malloc` pays one test of its result and one
    /// relaxed load (an `.await` on the successful path cost ~10% of a hit pair).
    pub(crate) fn malloc_follow_up(
        &self,
        actor: &DeviceActor,
        result: &Result<DeviceBuffer, Error>,
    ) -> bool {
        match result {
            Ok(buffer) => Self::buffer_follow_up(actor, buffer),
            // Counted (`follow_up`), then observed.
            Err(e) => e.is_oom(),
        }
    }

    /// [`Allocator::malloc_follow_up`] of a `malloc` that got `buffer`: frames to attach. A
    /// revived buffer's frames went into its slot's entry (`history_frames.rs`).
    #[inline]
    pub(crate) fn buffer_follow_up(actor: &DeviceActor, buffer: &DeviceBuffer) -> bool {
        actor.wants_frames() && !buffer.is_revived()
    }

    /// What a `malloc` does after [`Allocator::malloc_follow_up`] said so (callers box it, so
    /// their futures stay as small as without it): attach the caller's frames to the buffer,
    /// or count the out-of-memory failure and run the observers; returns `result`.
    pub(crate) async fn follow_up(
        &self,
        actor: &Arc<DeviceActor>,
        stream: &Stream,
        size: u64,
        result: Result<DeviceBuffer, Error>,
    ) -> Result<DeviceBuffer, Error> {
        match result {
            Ok(buffer) => {
                actor.attach_frames(&buffer).await;
                Ok(buffer)
            }
            Err(error) => {
                // The device's malloc counts no out-of-memory failure itself (its attempts
                // are retried): this is the one its user sees. Counted before the observers
                // run, so their snapshot shows the `oom` entry.
                if let Error::Alloc(e) = &error {
                    actor.count_oom(e, stream).await;
                }
                if self.config().oom_snapshot_path.is_none() && self.oom_observers().0.is_empty() {
                    return Err(error);
                }
                Err(self.run_oom_observers(stream.device(), size, error).await)
            }
        }
    }

    async fn run_oom_observers(&self, device: DeviceId, size: u64, error: Error) -> Error {
        let path = self.config().oom_snapshot_path.as_ref();
        let observers = self.oom_observers();
        let mut snapshot = None;
        if let Some(path) = path {
            let _one_at_a_time = self.oom_dump_lock().lock().await;
            match self.dump_snapshot(path).await {
                Ok(()) => snapshot = Some(PathBuf::from(path)),
                Err(e) => tracing::warn!(error = %e, "out of memory: the snapshot was not written"),
            }
        }
        let event = OomEvent {
            device,
            size,
            error,
            snapshot,
        };
        for observer in &observers.0 {
            if catch_unwind(AssertUnwindSafe(|| observer(&event))).is_err() {
                tracing::error!(
                    device = device.0,
                    size,
                    "an out-of-memory observer panicked"
                );
            }
        }
        event.error
    }
}
