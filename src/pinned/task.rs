//! The host actor's part in the shared actor task (`crate::actor::spawn_actor_task`): its
//! mailbox, stop signal and reaper. The reaper is PyTorch's `pinned_use_background_threads`;
//! here it always runs, and that setting only stops the core from also querying events at the
//! start of every malloc.

use std::sync::Arc;

use gpualloc_runtime::actor::{Mailbox, ReaperArm, Shutdown};

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
        self.call(|st| st.reap()).await.unwrap_or(false)
    }

    fn label(&self) -> String {
        "pinned-host actor".into()
    }
}
