//! [`ConnLink`]: what an imported buffer keeps of its importer's connection.
//!
//! Two rules hold by construction through it:
//! - The exporter reads EOF as "the importer released everything or died". So every
//!   [`ImportedBuffer`](crate::ImportedBuffer) keeps a duplicate of the connection's socket:
//!   dropping the connection while a buffer lives does not close the socket, and the exporter
//!   keeps the block until that buffer is released too.
//! - A release, by [`ImportedBuffer::release`](crate::ImportedBuffer::release) or by drop,
//!   sends the exporter a `Released` frame at once, so an exporter waiting for the buffer
//!   (`wait_returned`, `serve`) wakes without waiting for some other message.
//!
//! The frame is sent with a single non-blocking `send`: the importer's side of a connection
//! only ever sends these small frames, and one `send` of fewer bytes than a socket buffer
//! holds is atomic on a Unix stream socket, so frames from a buffer's drop and from the
//! connection never interleave. If the socket is full (the exporter is not reading) or
//! closed, the frame is dropped: the shared counter already says "released", and the
//! exporter sees it at its next `collect`.

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use rustix::net::SendFlags;

use crate::error::{IpcError, Result};
use crate::importer::released;
use crate::ledger::ExportId;

/// A duplicate of the importer's socket. See the module docs.
#[derive(Debug)]
pub(crate) struct ConnLink {
    sock: OwnedFd,
}

impl ConnLink {
    /// Duplicates `sock`.
    pub(crate) fn new(sock: BorrowedFd<'_>) -> Result<ConnLink> {
        let sock = sock
            .try_clone_to_owned()
            .map_err(|e| IpcError::os("dup", e))?;
        Ok(ConnLink { sock })
    }

    /// Tells the exporter that export `id` was released (one non-blocking send).
    pub(crate) fn notify_released(&self, id: ExportId) -> Result<()> {
        let bytes = released(id)?;
        let n = loop {
            match rustix::net::send(
                self.sock.as_fd(),
                &bytes,
                SendFlags::NOSIGNAL | SendFlags::DONTWAIT,
            ) {
                Ok(n) => break n,
                Err(rustix::io::Errno::INTR) => {}
                Err(rustix::io::Errno::PIPE) => return Err(IpcError::Closed),
                Err(e) => return Err(IpcError::os("send", io::Error::from(e))),
            }
        };
        if n == bytes.len() {
            Ok(())
        } else {
            // Not reachable for a frame this small (see the module docs); say so if it is.
            Err(IpcError::Truncated {
                got: n,
                expected: bytes.len(),
            })
        }
    }
}
