//! The task of an actor (a device's, or the pinned host's): drains work the mailbox hands to
//! it (when a holder stopped draining after its bounded rounds) and runs the timed reaper,
//! which completes frees whose stream events finished on an interval while any are pending and
//! sleeps when none are. One implementation serves both actors through [`ActorParts`].

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use gpualloc_actor::{Actor, Mailbox, ReaperArm, Shutdown};
use tokio::runtime::Handle;
use tokio::task::JoinHandle;

use crate::actor::device::DeviceActor;

/// What the actor task needs of an actor.
pub(crate) trait ActorParts: Send + Sync + 'static {
    /// The state behind the actor's mailbox.
    type State: Actor + Send + 'static;
    /// The mailbox to drain.
    fn mailbox(&self) -> &Mailbox<Self::State>;
    /// Fires when the actor shuts down.
    fn stop(&self) -> &Shutdown;
    /// Armed while frees wait on stream events.
    fn reaper(&self) -> &ReaperArm;
    /// One reaper round; true while frees are still pending.
    fn reap(self: Arc<Self>) -> impl Future<Output = bool> + Send;
    /// For logs.
    fn label(&self) -> String;
}

impl ActorParts for DeviceActor {
    type State = crate::actor::state::DeviceState;

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
        let (pending, pruned) = self
            .call(|st| {
                let pending = st.reap();
                // Recorded frees completing is when kept streams stop being named.
                (pending, st.prune_streams_if_grown())
            })
            .await
            .unwrap_or((false, Vec::new()));
        if !pruned.is_empty() {
            // Destroying a stream may wait for its work (the sim joins its worker).
            self.runtime.spawn_blocking(move || drop(pruned));
        }
        pending
    }

    fn label(&self) -> String {
        format!("device {} actor", self.device.0)
    }
}

/// Spawns the task of `actor` on `runtime`; it ends when the actor's stop signal fires.
pub(crate) fn spawn_actor_task<A: ActorParts>(
    actor: Arc<A>,
    runtime: &Handle,
    reaper_interval: Duration,
) -> JoinHandle<()> {
    actor.mailbox().attach_drainer();
    runtime.spawn(async move {
        let drainer = async {
            loop {
                tokio::select! {
                    _ = actor.mailbox().wake().notified() => {
                        actor.mailbox().drain();
                    }
                    _ = actor.stop().wait() => break,
                }
            }
        };
        let reaper = actor
            .reaper()
            .run(actor.stop(), reaper_interval, tokio::time::sleep, || {
                actor.clone().reap()
            });
        tokio::join!(drainer, reaper);
        actor.mailbox().detach_drainer();
        tracing::debug!(actor = %actor.label(), "actor task stopped");
    })
}
