//! What happens to exports still out when the exporter drops its connection.
//!
//! The crate's promise is that an exported block stays alive until the importer releases it
//! or dies. Taking the blocks back the moment the exporter drops its connection (or the
//! moment `serve` fails on a malformed frame from the importer) would break it: the importer
//! still has the memory mapped, and its writes would land in whatever the cache hands the
//! block to next. So a connection dropped with exports out hands them to a keeper thread,
//! which reads the socket (ignoring what it says), collects what the importer releases, and
//! takes the rest back only at EOF: when the importer closed its connection and every buffer
//! of it, or died. A peer that never does keeps what it was given, and nothing more.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use rustix::io::Errno;
use rustix::net::RecvFlags;

use crate::exporter::ExporterState;

/// Keeps `state`'s exports until the peer at the other end of `sock` releases them or its
/// socket reaches EOF, on a thread of its own. Where no thread can be started (or the socket
/// cannot be duplicated), they are taken back at once, with a warning.
pub(crate) fn keep_until_eof(sock: BorrowedFd<'_>, state: ExporterState) {
    let sock: OwnedFd = match sock.try_clone_to_owned() {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!(error = %e, "cannot keep exports after the connection: reclaiming now");
            return;
        }
    };
    // The keeper blocks in recv; a tokio socket's description is non-blocking.
    if let Err(e) = rustix::io::ioctl_fionbio(&sock, false) {
        tracing::warn!(error = %e, "cannot keep exports after the connection: reclaiming now");
        return;
    }
    let spawned = std::thread::Builder::new()
        .name("gpualloc-ipc-keeper".into())
        .spawn(move || keep(sock, state));
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "cannot keep exports after the connection: reclaiming now");
    }
}

fn keep(sock: OwnedFd, mut state: ExporterState) {
    let mut buf = [0u8; 4096];
    while state.outstanding() > 0 {
        // A plain recv: fds a peer attaches are closed by the kernel, bytes are ignored
        // (only the shared counters say what was released).
        match rustix::net::recv(sock.as_fd(), &mut buf, RecvFlags::empty()) {
            Ok((0, _)) => break,
            Ok(_) => {
                state.collect();
            }
            Err(Errno::INTR) => {}
            Err(_) => break,
        }
    }
    // Dropping the state takes back whatever is still out.
    drop(state);
}
