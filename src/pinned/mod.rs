//! The pinned-host side of the facade: one [`HostActor`] owns the
//! [`HostCore`](gpualloc_host::HostCore) behind the same flat-combining
//! [`Mailbox`](gpualloc_actor::Mailbox) the device actors use, and
//! [`Allocator::host`](crate::Allocator::host) hands out a cheap [`HostAllocator`] handle.
//!
//! - `state`: the guarded state and its messages (Free and RecordStream are plain messages, so
//!   a buffer's `Drop` never allocates; everything else runs as a job).
//! - `actor`: the shared handle and the async request paths (cache hits inline, misses on the
//!   blocking pool), `empty_cache`, stats, shutdown.
//! - `task`: the actor task: drains work handed to it and runs the timed reaper.
//! - `buffer`: [`PinnedBuffer`], RAII pinned memory; `slice`: its `Deref` to `[u8]`.
//! - `copy`: async copies between pinned and device buffers that record the stream use and
//!   hold the pinned buffer until the stream has passed them ([`PinnedCopy`]).
//! - `handle`: [`HostAllocator`], what `alloc.host()` returns.

mod actor;
mod buffer;
mod copy;
mod handle;
mod slice;
mod state;
mod task;

pub use actor::HostActor;
pub use buffer::PinnedBuffer;
pub use copy::{CopyError, PinnedCopy};
pub use handle::HostAllocator;
