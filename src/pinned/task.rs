//! The host actor's part in the shared actor task (`crate::actor::spawn_actor_task`): its
//! mailbox, stop signal and reaper. The reaper is PyTorch's `pinned_use_background_threads`;
//! here it always runs, and that setting only stops the core from also querying events at the
//! start of every malloc.

use std::sync::Arc;

use gpualloc_actor::{Mailbox, ReaperArm, Shutdown};

use crate::actor::ActorParts;
use crate::pinned::actor::HostActor;
use crate::pinned::state::HostState;

impl ActorParts for HostActor {
    type State = HostState;

    fn mailbox(&self) -> &Mailbox<Self::State> {
        &self.mailbox
    }

    fn stop(&self) -> &Shutdown {
        &self.stop
    }

    fn reaper(&self) -> &ReaperArm {
        &self.signals.reaper
    }

    async fn reap(self: Arc<Self>) -> bool {
        let (pending, retired) = self
            .call(|st| (st.reap(), std::mem::take(&mut st.retired)))
            .await
            .unwrap_or((false, Vec::new()));
        if !retired.is_empty() {
            // Destroying a stream may wait for its work (the sim joins its worker).
            tokio::task::spawn_blocking(move || drop(retired));
        }
        pending
    }

    fn label(&self) -> String {
        "pinned-host actor".into()
    }
}
