//! Actor plumbing shared by the device and host actors: small pieces, each on its own, all
//! built on [`gpualloc_runtime::sync`] so loom can model-check them (`tests/loom_actor.rs`).
//!
//! - [`gate`]: the one-word lock of a flat-combining cell (locked + work-pending bits).
//! - [`mailbox`]: the flat-combining cell: a state behind the gate that callers run their own
//!   request on when it is free, or queue a message for whoever holds it.
//! - [`handoff`]: posting a message from anywhere (e.g. `Drop` on any thread) without ever
//!   blocking.
//! - [`reply`]: a one-shot reply slot and the future that awaits it.
//! - [`landing`]: where work done off the gate lands: its request, or dropped if the request
//!   was cancelled, then announced to its owner.
//! - [`notify`]: a single-waiter wake-up with a stored permit.
//! - [`waiters`]: the FIFO queue of requests waiting for memory (woken by frees, cancel-safe).
//! - [`reaper`]: the arm/disarm logic of the timed reaper (interval while work is pending,
//!   asleep when none).
//! - [`shutdown`]: the shutdown signal.
//! - [`thread_slots`]: per-thread slots beside the state, for work a thread does without the
//!   gate; the holder collects them first.
//! - [`fork`]: telling a forked child from its parent with one memory load.
//!
//! None of these know what state they guard: they are generic, so the host allocator's actor
//! reuses them.

pub mod fork;
pub mod gate;
pub mod handoff;
pub mod landing;
pub mod mailbox;
pub mod notify;
pub mod reaper;
pub mod reply;
pub mod shutdown;
pub mod thread_slots;
pub mod waiters;

pub use fork::ForkGuard;
pub use mailbox::{Actor, Mailbox, ReplySpin};
pub use notify::{Notified, Notify};
pub use reaper::ReaperArm;
pub use reply::{reply_slot, ReplyFuture, ReplySender};
pub use shutdown::Shutdown;
pub use thread_slots::{SlotState, ThreadSlots};
pub use waiters::{WaitFuture, WaitTurn, Waiters};
