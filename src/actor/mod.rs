//! The per-device actor: one [`DeviceActor`] per GPU owns that device's
//! [`DeviceCore`](gpualloc_devices::DeviceCore) behind a flat-combining
//! [`Mailbox`](gpualloc_actor::Mailbox).
//!
//! - `state`: the guarded state and its messages (Malloc/RecordStream/EmptyCache/Stats/
//!   Snapshot/Shutdown run as jobs; Free and RecordStream are plain messages so a buffer's
//!   `Drop` never allocates).
//! - `device`: the actor's shared handle and the async request paths (hits inline); a miss
//!   lands through `gpualloc_actor::landing` (its request, or the cache if the request was
//!   cancelled).
//! - `queries`: diagnostics, statistics and snapshots, and the jobs drops post.
//! - `slow`: what runs on tokio's blocking pool, outside the gate: device mallocs on a miss,
//!   the OOM chain's event synchronization and segment frees, `empty_cache`, shutdown.
//! - `streams`: the streams the core still names, kept alive after their users dropped them.
//! - `task`: the actor task: drains work handed to it and runs the timed reaper.
//! - `thread_cache`: blocks parked by the thread that freed them and handed straight back
//!   to its next same-size request on the same stream, without the gate.
//! - `wait`: malloc that waits for memory (FIFO, bounded, cancellable) instead of failing.

mod device;
mod queries;
mod slow;
mod state;
mod streams;
mod task;
mod thread_cache;
mod wait;

pub(crate) use device::Attempt;
pub use device::DeviceActor;
pub(crate) use state::{DeviceMsg, DeviceState, Signals};
pub(crate) use task::{spawn_actor_task, ActorParts};
pub(crate) use thread_cache::{Lane, Recording};
