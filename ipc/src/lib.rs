//! Sharing memory between processes for gpualloc.
//!
//! - [`map`] and [`shm`]: shared host memory as Rust types (PyTorch's `MapAllocator`):
//!   memfd or `shm_open` objects, mapped shared or private, fds kept or closed, sizes
//!   checked with `fstat` so nothing maps past the end of an object.
//! - [`fdpass`], [`frame`], [`message`], [`peer`]: the wire: SCM_RIGHTS fd passing, a
//!   length-prefixed message format with a magic and a version, and SO_PEERCRED checks.
//! - [`export`], [`import`]: device buffers across processes (legacy IPC handles for
//!   ordinary segments, exported physical-memory fds for VMM segments), kept alive on the
//!   exporter by an [`ExportGuard`] until the importer releases them or dies.
//! - [`counter`], [`refcount`], [`ledger`]: the shared reference count that says when.
//! - [`blocking`] and [`asynchronous`]: connections for plain threads and for tokio.
//!
//! `unsafe` lives only in [`map`] and [`refcount`].
//!
//! # Threat model
//!
//! A peer is admitted by [`PeerPolicy`] (by default: the same user, checked with
//! `SO_PEERCRED`). An admitted peer is trusted with the memory it is given and nothing else,
//! where the driver's sharing allows: a device buffer is shared by its whole allocation or
//! physical handle, so an importer also reaches the other buffers there, except for buffers
//! of a pool of unsplit blocks, which are alone on theirs ([`export`] says exactly what is
//! reachable for each kind; [`DeviceRegion::exposed`] says it for one buffer).
//!
//! **What an importer can do to the exporter:** read and write the buffers it was sent (that
//! is the point) and what shares their allocation or physical handle (above), keep them as long as it likes (the exporter's blocks stay allocated until
//! it releases them, closes its connection and every buffer, or dies: memory it was given is
//! all it can waste), and send anything at all on its socket.
//!
//! **What it cannot do:**
//! - crash the exporter: every memory object it receives (the reference-count file, host
//!   memory) is a memfd sealed at its size before it is sent ([`shm::SIZE_SEALS`]), so it
//!   cannot truncate what the exporter has mapped (no SIGBUS); objects that cannot be sealed
//!   (POSIX shared memory, files) are never sent ([`IpcError::Unsealable`]); malformed,
//!   truncated or oversized frames and stray fds are typed errors (frames are capped at
//!   [`frame::MAX_BODY`] bytes and [`frame::MAX_FDS`] fds);
//! - make the exporter reuse a block it may still use: a block is freed only when its
//!   reference count (in the shared file) reaches zero, or at the importer's EOF; an importer
//!   that writes garbage or closes its connection but keeps a buffer keeps the block (the
//!   buffer holds the socket; a dropped exporter connection hands its exports to the
//!   [`keeper`] until EOF, whatever timeout or flag is on the exporter's socket);
//! - free another importer's blocks: each connection has its own reference-count file and
//!   ledger;
//! - name memory it was not sent: it only ever sends `Released` frames, which carry no
//!   pointers, only export ids the exporter checks against its ledger.
//!
//! **What it can make the exporter keep, and for how long:** the exports of its connections
//! (at most [`refcount::DEFAULT_SLOTS`] per connection) for as long as it holds them or
//! lives, and the connections themselves: every exporter connection, open or kept after its
//! drop, takes a socket duplicate and a place with the one keeper thread of the process when
//! it is made, at most [`keeper::MAX_CONNECTIONS_PER_PEER`] per peer process and
//! [`keeper::MAX_CONNECTIONS`] in all; past them a connection is refused up front
//! ([`IpcError::KeeperLimit`]), never by freeing what a peer holds.
//!
//! It *can* lie in the shared counters of its own exports (release early, release twice):
//! the counter never goes below zero, and an early release only makes the exporter reuse a
//! block the importer itself claims to be done with.
//!
//! **What the importer trusts the exporter for:** the contents of what it is sent, and that
//! the exporter keeps it alive (the exporter process is the owner of that memory). It does
//! not trust the exporter's sizes and fds: host memory must be sealed
//! ([`IpcError::NotSealed`]) and no longer than the object; a device offer must name an armed
//! slot ([`IpcError::Withdrawn`]) and lie inside the allocation actually opened
//! ([`Backend::mem_address_range`](gpualloc_runtime::Backend::mem_address_range)), and VMM
//! chunks inside their span and their physical handles (sealed memfds on the sim).
//!
//! `tests/fuzz.rs` feeds both ends hostile input (seeded, `GPUALLOC_FUZZ_ITERS` for more).

// tokio's own `cfg(loom)` build has no `net`: the async connections sit out loom runs.
#[cfg(not(loom))]
pub mod asynchronous;
pub mod blocking;
pub mod counter;
pub mod error;
pub mod export;
mod exporter;
pub mod fdpass;
pub mod frame;
pub mod import;
mod importer;
pub mod keeper;
pub mod ledger;
mod link;
pub mod map;
pub mod message;
pub mod peer;
pub mod refcount;
pub mod shm;

#[cfg(not(loom))]
pub use asynchronous::{AsyncExportConn, AsyncImportConn};
pub use blocking::{ExportConn, ImportConn};
pub use error::{IpcError, Result};
pub use export::{DeviceRegion, ExportGuard, OnRelease, SegmentMemory, VmmChunk};
pub use exporter::{Returned, ServeEnd};
pub use import::ImportedBuffer;
pub use importer::Received;
pub use ledger::ExportId;
pub use map::{Access, Advice, FdAfterMap, MapOptions, SharedMapping, Sharing};
pub use peer::{PeerCred, PeerPolicy};
pub use shm::Backing;
