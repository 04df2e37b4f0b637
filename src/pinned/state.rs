//! The state the host actor's mailbox guards, and the messages it handles.

use std::collections::HashMap;
use std::sync::Arc;

use gpualloc_actor::mailbox::{Actor, Job};
use gpualloc_actor::ReaperArm;
use gpualloc_host::{HostCore, HostPtr};
use gpualloc_runtime::Stream;

/// Signals shared between the guarded state and the actor's users.
#[derive(Debug, Default)]
pub(crate) struct HostSignals {
    /// Wakes the reaper when frees start waiting on stream events.
    pub reaper: ReaperArm,
}

/// The pinned-host core, plus what its handlers need.
pub(crate) struct HostState {
    pub core: HostCore,
    pub signals: Arc<HostSignals>,
    /// Set by shutdown: mallocs fail, and late frees release their memory at once.
    pub shut_down: bool,
    /// The streams each live buffer was recorded on, kept alive until its free has recorded
    /// an event on each (the user may drop a stream first; see `Stream`'s docs).
    pub recorded: HashMap<u64, Vec<Stream>>,
    /// Streams whose events were recorded, to be dropped outside the gate (destroying a
    /// stream may wait for its work on the sim): by the reaper or by shutdown.
    pub retired: Vec<Stream>,
}

/// A queued message. Requests with replies travel as jobs.
pub(crate) enum HostMsg {
    /// A pinned buffer was dropped.
    Free(HostPtr),
    /// A pinned buffer is used on a stream (kept alive until the buffer's free).
    RecordStream(HostPtr, Stream),
    /// Any other request (malloc, stats, ...), with its reply inside.
    Job(Job<HostState>),
}

impl HostState {
    /// Frees `ptr`; wakes the reaper if the free now waits on events. After shutdown the
    /// cache is emptied at once, so late frees return their memory to the backend.
    pub fn free(&mut self, ptr: HostPtr) {
        let pending_before = self.core.pending_events();
        let freed = self.core.free(ptr);
        // Recorded or not, the core names these streams no more.
        if let Some(streams) = self.recorded.remove(&ptr.0) {
            self.retired.extend(streams);
        }
        if let Err(e) = freed {
            tracing::warn!(%ptr, error = %e, "pinned free failed");
            return;
        }
        if self.shut_down {
            if let Err(e) = self.core.empty_cache() {
                tracing::warn!(%ptr, error = %e, "releasing a pinned block after shutdown failed");
            }
        } else if self.core.pending_events() > pending_before {
            self.signals.reaper.arm();
        }
    }

    /// Completes frees whose events finished; true while some still wait.
    pub fn reap(&mut self) -> bool {
        if let Err(e) = self.core.process_events() {
            tracing::warn!(error = %e, "querying a pinned block's event failed");
        }
        self.core.pending_events() > 0
    }
}

impl Actor for HostState {
    type Msg = HostMsg;

    fn handle(&mut self, msg: HostMsg) {
        match msg {
            HostMsg::Free(ptr) => self.free(ptr),
            HostMsg::RecordStream(ptr, stream) => {
                match self.core.record_stream(ptr, stream.handle()) {
                    Ok(()) => {
                        let kept = self.recorded.entry(ptr.0).or_default();
                        if !kept.contains(&stream) {
                            kept.push(stream);
                        }
                    }
                    Err(e) => tracing::warn!(%ptr, error = %e, "pinned record_stream failed"),
                }
            }
            HostMsg::Job(job) => job(self),
        }
    }

    fn job(job: Job<Self>) -> HostMsg {
        HostMsg::Job(job)
    }
}
