//! The host actor's task: drains work the mailbox hands to it (when a holder stopped draining
//! after its bounded rounds) and runs the timed reaper, which completes frees whose stream
//! events finished on an interval while any are pending and sleeps when none are (PyTorch's
//! `pinned_use_background_threads`; here the reaper always runs, and that setting only stops
//! the core from also querying events at the start of every malloc).

use std::sync::Arc;
use std::time::Duration;

use tokio::runtime::Handle;
use tokio::task::JoinHandle;

use crate::pinned::actor::HostActor;

/// Spawns the task on `runtime`; it ends when the actor's `stop` signal fires.
pub(crate) fn spawn_host_task(
    actor: Arc<HostActor>,
    runtime: &Handle,
    reaper_interval: Duration,
) -> JoinHandle<()> {
    actor.mailbox.attach_drainer();
    runtime.spawn(async move {
        let drainer = async {
            loop {
                tokio::select! {
                    _ = actor.mailbox.wake().notified() => {
                        actor.mailbox.drain();
                    }
                    _ = actor.stop.wait() => break,
                }
            }
        };
        let reaper =
            actor
                .signals
                .reaper
                .run(&actor.stop, reaper_interval, tokio::time::sleep, || {
                    let actor = actor.clone();
                    async move { actor.call(|st| st.reap()).await.unwrap_or(false) }
                });
        tokio::join!(drainer, reaper);
        actor.mailbox.detach_drainer();
        tracing::debug!("host actor task stopped");
    })
}
