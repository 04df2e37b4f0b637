//! The importer's state for one connection, without I/O: the exporter's reference-count
//! file (from its hello) and how each received frame becomes a host mapping or an
//! [`ImportedBuffer`].

use std::sync::Arc;

use gpualloc_runtime::{Backend, DeviceId};

use crate::error::{IpcError, Result};
use crate::frame::{self, Frame};
use crate::import::{ImportedBuffer, VmmMappings};
use crate::ledger::ExportId;
use crate::link::ConnLink;
use crate::map::{FdAfterMap, MapOptions, SharedMapping};
use crate::message::Message;
use crate::refcount::RefCountFile;
use crate::shm;

/// What an importer received.
#[derive(Debug)]
pub enum Received {
    /// Shared host memory, mapped read/write and shared.
    Host {
        /// The mapping.
        mapping: SharedMapping,
        /// The exporter's label.
        tag: u64,
    },
    /// A device buffer, open in this process.
    Device(ImportedBuffer),
}

pub(crate) struct ImporterState {
    pub(crate) backend: Arc<dyn Backend>,
    pub(crate) device: DeviceId,
    pub(crate) refs: Arc<RefCountFile>,
    /// A duplicate of the connection's socket each imported buffer keeps.
    pub(crate) link: Arc<ConnLink>,
    pub(crate) exporter_pid: u32,
    /// The VMM mappings of this connection's imports, shared by buffers on the same handles.
    pub(crate) mappings: Arc<VmmMappings>,
}

impl ImporterState {
    /// Reads the hello frame that came on `sock`.
    pub(crate) fn from_hello(
        backend: Arc<dyn Backend>,
        device: DeviceId,
        sock: std::os::fd::BorrowedFd<'_>,
        hello: Frame,
    ) -> Result<Self> {
        let Frame { message, mut fds } = hello;
        match (message, fds.pop()) {
            (Message::Hello { pid, .. }, Some(fd)) => Ok(ImporterState {
                backend,
                device,
                refs: Arc::new(RefCountFile::open(fd)?),
                link: Arc::new(ConnLink::new(sock)?),
                exporter_pid: pid,
                mappings: Arc::default(),
            }),
            (other, _) => Err(IpcError::Unexpected {
                expected: "hello",
                got: other.name().into(),
            }),
        }
    }

    pub(crate) fn on_frame(&self, frame: Frame) -> Result<Received> {
        let Frame { message, mut fds } = frame;
        match message {
            Message::Host { len, tag } => {
                let fd = fds.pop().ok_or(IpcError::FdCount {
                    got: 0,
                    expected: 1,
                })?;
                shm::check_sealed(std::os::fd::AsFd::as_fd(&fd))?;
                let mapping = shm::open_fd(
                    fd,
                    Some(len),
                    MapOptions::shared_rw().with_fd(FdAfterMap::Close),
                )?;
                Ok(Received::Host { mapping, tag })
            }
            Message::Device(offer) => Ok(Received::Device(ImportedBuffer::open(
                self.backend.clone(),
                self.refs.clone(),
                self.link.clone(),
                &self.mappings,
                self.device,
                offer,
                fds,
            )?)),
            other => Err(IpcError::Unexpected {
                expected: "host or device",
                got: other.name().into(),
            }),
        }
    }
}

/// The nudge telling the exporter that `id` was released.
pub(crate) fn released(id: ExportId) -> Result<Vec<u8>> {
    frame::encode(&Message::Released { id })
}
