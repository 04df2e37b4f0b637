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
mod keeper;
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
pub use export::{CoreGuard, DeviceRegion, ExportGuard, OnRelease, SegmentMemory, VmmChunk};
pub use exporter::{Returned, ServeEnd};
pub use import::ImportedBuffer;
pub use importer::Received;
pub use ledger::ExportId;
pub use map::{Access, Advice, FdAfterMap, MapOptions, SharedMapping, Sharing};
pub use peer::{PeerCred, PeerPolicy};
pub use shm::Backing;
