//! Async connections on tokio: [`AsyncExportConn`] and [`AsyncImportConn`] over
//! `tokio::net::UnixStream`. Each socket step is a non-blocking `sendmsg`/`recvmsg` run
//! when tokio reports readiness, so no thread blocks; the protocol and semantics are those
//! of [`crate::blocking`]. An exporter's connection task typically ends in
//! [`AsyncExportConn::serve`], which sees EOF when the importer exits or is killed and then
//! takes back everything it still held.

use std::io;
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::Arc;

use gpualloc_runtime::{Backend, DeviceId, StreamHandle};
use tokio::io::Interest;
use tokio::net::UnixStream;

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

async fn send(sock: &UnixStream, out: &Outgoing) -> Result<()> {
    let fds: Vec<BorrowedFd<'_>> = out.fds.iter().map(|f| f.as_fd()).collect();
    let mut sent = 0;
    while sent < out.bytes.len() {
        sock.writable()
            .await
            .map_err(|e| IpcError::os("writable", e))?;
        match sock.try_io(Interest::WRITABLE, || {
            send_step(sock.as_fd(), &out.bytes, sent, &fds)
        }) {
            Ok(n) => sent += n,
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
                ) => {}
            Err(e) if e.kind() == io::ErrorKind::BrokenPipe => return Err(IpcError::Closed),
            Err(e) => return Err(IpcError::os("sendmsg", e)),
        }
    }
    Ok(())
}

async fn recv(sock: &UnixStream, reader: &mut FrameReader) -> Result<Frame> {
    loop {
        sock.readable()
            .await
            .map_err(|e| IpcError::os("readable", e))?;
        match sock.try_io(Interest::READABLE, || recv_step(sock.as_fd(), reader)) {
            Ok(n) => {
                if let Some(frame) = reader.advance(n)? {
                    return Ok(frame);
                }
            }
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
                ) => {}
            Err(e) if e.kind() == io::ErrorKind::ConnectionReset => return Err(IpcError::Closed),
            Err(e) => return Err(IpcError::os("recvmsg", e)),
        }
    }
}

/// The exporter's end of a connection (async). Dropping it with exports still out hands them
/// to a background thread that keeps them until the importer releases them or goes away
/// (see [`crate::blocking::ExportConn`]); usually one awaits [`AsyncExportConn::serve`].
pub struct AsyncExportConn {
    sock: UnixStream,
    reader: FrameReader,
    state: ExporterState,
    /// The connection's place with the keeper (`None` only while dropping).
    keeper: Option<KeeperSlot>,
}

impl AsyncExportConn {
    /// Checks the peer against `policy` and sends the hello.
    pub async fn new(
        sock: UnixStream,
        policy: &PeerPolicy,
        backend: Arc<dyn Backend>,
    ) -> Result<Self> {
        let peer = policy.check(sock.as_fd())?;
        let keeper = KeeperSlot::reserve(sock.as_fd(), peer)?;
        let state = ExporterState::new(backend, peer, DEFAULT_SLOTS)?;
        send(&sock, &state.hello()?).await?;
        Ok(AsyncExportConn {
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

    /// Sends shared host memory (see [`crate::blocking::ExportConn::send_host`]).
    pub async fn send_host(&mut self, mapping: &SharedMapping, tag: u64) -> Result<()> {
        send(&self.sock, &ExporterState::host(mapping, tag)?).await
    }

    /// Exports a device buffer (see [`crate::blocking::ExportConn::send_device`]). The
    /// producer stream's synchronization is a blocking backend call.
    pub async fn send_device(
        &mut self,
        region: &DeviceRegion,
        producer: Option<StreamHandle>,
        guard: Box<dyn ExportGuard>,
    ) -> Result<ExportId> {
        let (id, out) = self.state.device(region, producer, guard)?;
        if let Err(e) = send(&self.sock, &out).await {
            self.state.send_failed(id);
            return Err(e);
        }
        Ok(id)
    }

    /// Releases the guards of exports the importer has released. Returns their ids.
    pub fn collect(&mut self) -> Vec<ExportId> {
        self.state.collect()
    }

    /// Exports still out.
    pub fn outstanding(&self) -> usize {
        self.state.outstanding()
    }

    /// Waits until export `id` comes back (released, or reclaimed at EOF); see
    /// [`crate::blocking::ExportConn::wait_returned`].
    pub async fn wait_returned(&mut self, id: ExportId) -> Result<Returned> {
        loop {
            self.state.collect();
            if let Some(how) = self.state.returned(id)? {
                return Ok(how);
            }
            let received = recv(&self.sock, &mut self.reader).await;
            self.state.wait_step(received)?;
        }
    }

    /// Serves the connection until EOF; see [`crate::blocking::ExportConn::serve`].
    pub async fn serve(mut self) -> Result<ServeEnd> {
        loop {
            if let Some(end) = self
                .state
                .serve_step(recv(&self.sock, &mut self.reader).await)?
            {
                return Ok(end);
            }
        }
    }
}

impl Drop for AsyncExportConn {
    fn drop(&mut self) {
        if let Some(slot) = self.keeper.take() {
            self.state.hand_over(slot);
        }
    }
}

/// The importer's end of a connection (async).
pub struct AsyncImportConn {
    sock: UnixStream,
    reader: FrameReader,
    state: ImporterState,
    peer: PeerCred,
}

impl AsyncImportConn {
    /// Checks the peer against `policy` and reads the exporter's hello.
    pub async fn new(
        sock: UnixStream,
        policy: &PeerPolicy,
        backend: Arc<dyn Backend>,
        device: DeviceId,
    ) -> Result<Self> {
        let peer = policy.check(sock.as_fd())?;
        let mut reader = FrameReader::new();
        let hello = recv(&sock, &mut reader).await?;
        let state = ImporterState::from_hello(backend, device, sock.as_fd(), hello)?;
        Ok(AsyncImportConn {
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

    /// Receives the next shared host buffer or device buffer.
    pub async fn recv(&mut self) -> Result<Received> {
        let frame = recv(&self.sock, &mut self.reader).await?;
        self.state.on_frame(frame)
    }

    /// Synchronizes `streams` (blocking backend calls), releases `buf` and tells the
    /// exporter (one non-blocking send). Dropping `buf` releases and tells too.
    pub async fn release(&mut self, buf: ImportedBuffer, streams: &[StreamHandle]) -> Result<()> {
        buf.release_after(streams)?;
        Ok(())
    }
}
