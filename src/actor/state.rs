//! The state a device actor's mailbox guards, and the messages it handles.

use std::sync::Arc;

use gpualloc_devices::DeviceCore;
use gpualloc_runtime::actor::mailbox::{Actor, Job};
use gpualloc_runtime::actor::{ReaperArm, Waiters};
use gpualloc_runtime::{DevicePtr, StreamHandle};

/// Signals shared between the guarded state and the actor's users.
#[derive(Debug, Default)]
pub(crate) struct Signals {
    /// Requests waiting for memory; woken whenever memory comes back.
    pub waiters: Waiters,
    /// Wakes the reaper when frees start waiting on stream events.
    pub reaper: ReaperArm,
}

/// One device's core, plus the signals its handlers raise.
pub(crate) struct DeviceState {
    pub core: DeviceCore,
    pub signals: Arc<Signals>,
}

/// A queued message. Requests with replies travel as jobs.
pub(crate) enum DeviceMsg {
    /// A buffer was dropped.
    Free(DevicePtr),
    /// A buffer is used on another stream.
    RecordStream(DevicePtr, StreamHandle),
    /// Any other request (malloc, stats, snapshot, ...), with its reply inside.
    Job(Job<DeviceState>),
}

impl DeviceState {
    /// Frees `ptr`; wakes the reaper if the free now waits on events, and the head waiter.
    pub fn free(&mut self, ptr: DevicePtr) {
        let pending_before = self.core.pending_frees();
        if let Err(e) = self.core.free(ptr) {
            // After shutdown every segment went back already; a late free is expected.
            if !self.core.is_shut_down() {
                tracing::warn!(device = self.core.device().0, %ptr, error = %e, "free failed");
            }
            return;
        }
        if self.core.pending_frees() > pending_before {
            self.signals.reaper.arm();
        }
        self.signals.waiters.wake_head();
    }

    /// Completes frees whose events finished; true while some still wait.
    pub fn reap(&mut self) -> bool {
        match self.core.process_events() {
            Ok(n) if n > 0 => self.signals.waiters.wake_head(),
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(device = self.core.device().0, error = %e, "event query failed")
            }
        }
        self.core.pending_frees() > 0
    }
}

impl Actor for DeviceState {
    type Msg = DeviceMsg;

    fn handle(&mut self, msg: DeviceMsg) {
        match msg {
            DeviceMsg::Free(ptr) => self.free(ptr),
            DeviceMsg::RecordStream(ptr, stream) => {
                if let Err(e) = self.core.record_stream(ptr, stream) {
                    if !self.core.is_shut_down() {
                        tracing::warn!(%ptr, error = %e, "record_stream failed");
                    }
                }
            }
            DeviceMsg::Job(job) => job(self),
        }
    }

    fn job(job: Job<Self>) -> DeviceMsg {
        DeviceMsg::Job(job)
    }
}
