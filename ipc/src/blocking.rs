//! Blocking connections for plain threads: [`ExportConn`] and [`ImportConn`] over a std
//! `UnixStream`. Same protocol and semantics as the async ones in [`crate::asynchronous`].

use std::io;
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::sync::Arc;

use gpualloc_runtime::{Backend, DeviceId, StreamHandle};

use crate::error::{IpcError, Result};
use crate::export::{DeviceRegion, ExportGuard};
use crate::exporter::{ExporterState, Outgoing, Returned, ServeEnd};
use crate::fdpass::{recv_step, send_step};
use crate::frame::{Frame, FrameReader};
use crate::import::ImportedBuffer;
use crate::importer::{ImporterState, Received};
use crate::keeper::KeeperSlot;
use crate::ledger::ExportId;
use crate::map::SharedMapping;
use crate::peer::{PeerCred, PeerPolicy};
use crate::refcount::DEFAULT_SLOTS;

fn send(sock: BorrowedFd<'_>, out: &Outgoing) -> Result<()> {
    let fds: Vec<BorrowedFd<'_>> = out.fds.iter().map(|f| f.as_fd()).collect();
    let mut sent = 0;
    while sent < out.bytes.len() {
        match send_step(sock, &out.bytes, sent, &fds) {
            Ok(n) => sent += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == io::ErrorKind::BrokenPipe => return Err(IpcError::Closed),
            Err(e) => return Err(IpcError::os("sendmsg", e)),
        }
    }
    Ok(())
}

fn recv(sock: BorrowedFd<'_>, reader: &mut FrameReader) -> Result<Frame> {
    loop {
        match recv_step(sock, reader) {
            Ok(n) => {
                if let Some(frame) = reader.advance(n)? {
                    return Ok(frame);
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == io::ErrorKind::ConnectionReset => return Err(IpcError::Closed),
            Err(e) => return Err(IpcError::os("recvmsg", e)),
        }
    }
}

/// The exporter's end of a connection (blocking). Dropping it with exports still out hands
/// them to a background thread that keeps them until the importer releases them or goes
/// away (see `keeper.rs`): a block is never reused while the importer may still use it.
pub struct ExportConn {
    sock: UnixStream,
    reader: FrameReader,
    state: ExporterState,
    /// The connection's place with the keeper (`None` only while dropping).
    keeper: Option<KeeperSlot>,
}

impl ExportConn {
    /// Checks the peer against `policy` and sends the hello (with a reference-count file of
    /// [`DEFAULT_SLOTS`] slots).
    pub fn new(sock: UnixStream, policy: &PeerPolicy, backend: Arc<dyn Backend>) -> Result<Self> {
        let peer = policy.check(sock.as_fd())?;
        let keeper = KeeperSlot::reserve(sock.as_fd(), peer)?;
        let state = ExporterState::new(backend, peer, DEFAULT_SLOTS)?;
        send(sock.as_fd(), &state.hello()?)?;
        Ok(ExportConn {
            sock,
            reader: FrameReader::new(),
            state,
            keeper: Some(keeper),
        })
    }

    /// The importer process.
    pub fn peer(&self) -> PeerCred {
        self.state.peer
    }

    /// Sends shared host memory; `mapping` must have kept its fd. The importer maps the
    /// same object; both mappings keep it alive.
    pub fn send_host(&mut self, mapping: &SharedMapping, tag: u64) -> Result<()> {
        send(self.sock.as_fd(), &ExporterState::host(mapping, tag)?)
    }

    /// Exports a device buffer. `producer` (the stream that wrote it) is synchronized first;
    /// `guard` keeps the block alive until the importer releases it or goes away (on error
    /// it is released at once).
    pub fn send_device(
        &mut self,
        region: &DeviceRegion,
        producer: Option<StreamHandle>,
        guard: Box<dyn ExportGuard>,
    ) -> Result<ExportId> {
        let (id, out) = self.state.device(region, producer, guard)?;
        if let Err(e) = send(self.sock.as_fd(), &out) {
            self.state.send_failed(id);
            return Err(e);
        }
        Ok(id)
    }

    /// Releases the guards of exports the importer has released (reading the shared
    /// counters, without waiting for its message). Returns their ids.
    pub fn collect(&mut self) -> Vec<ExportId> {
        self.state.collect()
    }

    /// Exports still out.
    pub fn outstanding(&self) -> usize {
        self.state.outstanding()
    }

    /// What came back so far.
    pub fn totals(&self) -> ServeEnd {
        self.state.totals
    }

    /// Blocks until export `id` comes back: released by the importer, or reclaimed because
    /// the connection ended. An export already back answers at once with how it came back;
    /// an id this connection never issued is [`IpcError::UnknownExport`].
    pub fn wait_returned(&mut self, id: ExportId) -> Result<Returned> {
        loop {
            self.state.collect();
            if let Some(how) = self.state.returned(id)? {
                return Ok(how);
            }
            let received = recv(self.sock.as_fd(), &mut self.reader);
            self.state.wait_step(received)?;
        }
    }

    /// Serves the connection until the importer closes it, releasing exports as they come
    /// back and reclaiming the rest at the end.
    pub fn serve(mut self) -> Result<ServeEnd> {
        loop {
            if let Some(end) = self
                .state
                .serve_step(recv(self.sock.as_fd(), &mut self.reader))?
            {
                return Ok(end);
            }
        }
    }
}

impl Drop for ExportConn {
    fn drop(&mut self) {
        if let Some(slot) = self.keeper.take() {
            self.state.hand_over(slot);
        }
    }
}

/// The importer's end of a connection (blocking).
pub struct ImportConn {
    sock: UnixStream,
    reader: FrameReader,
    state: ImporterState,
    peer: PeerCred,
}

impl ImportConn {
    /// Checks the peer against `policy` and reads the exporter's hello. Device buffers are
    /// opened on `device` of `backend`.
    pub fn new(
        sock: UnixStream,
        policy: &PeerPolicy,
        backend: Arc<dyn Backend>,
        device: DeviceId,
    ) -> Result<Self> {
        let peer = policy.check(sock.as_fd())?;
        let mut reader = FrameReader::new();
        let hello = recv(sock.as_fd(), &mut reader)?;
        let state = ImporterState::from_hello(backend, device, sock.as_fd(), hello)?;
        Ok(ImportConn {
            sock,
            reader,
            state,
            peer,
        })
    }

    /// The exporter process.
    pub fn peer(&self) -> PeerCred {
        self.peer
    }

    /// The exporter's pid, as its hello says.
    pub fn exporter_pid(&self) -> u32 {
        self.state.exporter_pid
    }

    /// Receives the next shared host buffer or device buffer.
    pub fn recv(&mut self) -> Result<Received> {
        let frame = recv(self.sock.as_fd(), &mut self.reader)?;
        self.state.on_frame(frame)
    }

    /// Synchronizes `streams`, releases `buf` and tells the exporter. (Dropping `buf` or
    /// [`ImportedBuffer::release`] releases and tells too, without synchronizing.)
    pub fn release(&mut self, buf: ImportedBuffer, streams: &[StreamHandle]) -> Result<()> {
        buf.release_after(streams)?;
        Ok(())
    }
}
