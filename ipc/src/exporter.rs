//! The exporter's state for one connection, without I/O: the reference-count file it
//! shared, the ledger of what it sent, and the guards that keep those blocks alive. The
//! blocking and async connection types drive it; it tells them what bytes and fds to send
//! and what to do with what arrives.

use std::collections::BTreeSet;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;

use gpualloc_runtime::{Backend, StreamHandle};

use crate::error::{IpcError, Result};
use crate::export::{DeviceRegion, ExportGuard};
use crate::frame;
use crate::keeper::KeeperSlot;
use crate::ledger::{ExportId, ExportLedger};
use crate::map::SharedMapping;
use crate::message::{DeviceOffer, Message, Readiness};
use crate::peer::PeerCred;
use crate::refcount::RefCountFile;

/// Bytes and fds of one frame to send. The fds are this process's duplicates; the kernel
/// gives the peer its own, and these close once sent.
#[derive(Debug)]
pub(crate) struct Outgoing {
    pub bytes: Vec<u8>,
    pub fds: Vec<OwnedFd>,
}

/// Counts of what a connection gave back.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ServeEnd {
    /// Exports the importer released itself.
    pub released: usize,
    /// Exports reclaimed because the connection ended while the importer held them.
    pub reclaimed: usize,
}

/// How an export came back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Returned {
    /// The importer released it.
    Released,
    /// The connection ended (importer gone); the exporter took it back.
    Reclaimed,
}

pub(crate) struct ExporterState {
    backend: Arc<dyn Backend>,
    refs: Arc<RefCountFile>,
    ledger: ExportLedger<Box<dyn ExportGuard>>,
    pub(crate) peer: PeerCred,
    pub(crate) totals: ServeEnd,
    /// Exports that came back without the importer releasing them (reclaimed at the end of
    /// the connection, or never sent); every other export no longer out was released.
    /// Bounded by the slots: each id enters at most once, and only when it leaves a slot
    /// without a release.
    taken_back: BTreeSet<ExportId>,
}

impl ExporterState {
    pub(crate) fn new(backend: Arc<dyn Backend>, peer: PeerCred, slots: usize) -> Result<Self> {
        Ok(ExporterState {
            backend,
            refs: Arc::new(RefCountFile::create(slots)?),
            ledger: ExportLedger::new(slots),
            peer,
            totals: ServeEnd::default(),
            taken_back: BTreeSet::new(),
        })
    }

    pub(crate) fn hello(&self) -> Result<Outgoing> {
        let msg = Message::Hello {
            pid: std::process::id(),
            slots: u32::try_from(self.refs.slots()).unwrap_or(u32::MAX),
        };
        let fd = self
            .refs
            .fd()
            .ok_or_else(|| IpcError::Malformed("reference-count file lost its fd".into()))?;
        crate::shm::ensure_sealed(fd)?;
        Ok(Outgoing {
            bytes: frame::encode(&msg)?,
            fds: vec![dup(fd)?],
        })
    }

    pub(crate) fn host(mapping: &SharedMapping, tag: u64) -> Result<Outgoing> {
        let fd = mapping.fd().ok_or_else(|| {
            IpcError::InvalidExport("the mapping did not keep its fd (FdAfterMap::Close)".into())
        })?;
        // The importer gets its own fd of the object: sealed, it cannot shrink it under our
        // mapping (see `shm`).
        crate::shm::ensure_sealed(fd)?;
        // Sealed now, the object can no longer change size; if it shrank before, the
        // importer would refuse it: refuse it here, before it crosses.
        let actual = rustix::fs::fstat(fd)
            .map_err(|e| IpcError::os("fstat", e))?
            .st_size as u64;
        if actual < mapping.len() {
            return Err(IpcError::SizeMismatch {
                requested: mapping.len(),
                actual,
            });
        }
        let msg = Message::Host {
            len: mapping.len(),
            tag,
        };
        Ok(Outgoing {
            bytes: frame::encode(&msg)?,
            fds: vec![dup(fd)?],
        })
    }

    /// Prepares a device export. On error the guard is released (the export did not
    /// happen, so nothing holds the block).
    pub(crate) fn device(
        &mut self,
        region: &DeviceRegion,
        producer: Option<StreamHandle>,
        guard: Box<dyn ExportGuard>,
    ) -> Result<(ExportId, Outgoing)> {
        let prepared = (|| {
            if let Some(s) = producer {
                // The chosen readiness protocol: the producer's writes are complete before
                // the importer can see the buffer.
                self.backend.stream_synchronize(s)?;
            }
            region.offer(&*self.backend)
        })();
        let (memory, fds) = match prepared {
            Ok(p) => p,
            Err(e) => {
                guard.release();
                return Err(e);
            }
        };
        // A full ledger drops (releases) the guard with the error.
        let (id, slot) = self.ledger.offer(self.refs.counters(), guard)?;
        let msg = Message::Device(DeviceOffer {
            id,
            slot,
            device: region.device.0,
            len: region.len,
            ready: Readiness::Synchronized,
            memory,
        });
        match frame::encode(&msg) {
            Ok(bytes) => Ok((id, Outgoing { bytes, fds })),
            Err(e) => {
                self.send_failed(id);
                Err(e)
            }
        }
    }

    /// The frame of export `id` never left: forget it and release its guard.
    pub(crate) fn send_failed(&mut self, id: ExportId) {
        if let Ok(guard) = self.ledger.cancel(self.refs.counters(), id) {
            self.taken_back.insert(id);
            guard.release();
        }
    }

    /// Handles a message from the importer; returns the exports it gave back.
    pub(crate) fn on_message(&mut self, msg: Message) -> Result<Vec<ExportId>> {
        match msg {
            Message::Released { .. } => Ok(self.collect()),
            other => Err(IpcError::Unexpected {
                expected: "released",
                got: other.name().into(),
            }),
        }
    }

    /// Releases the guards of every export whose references are all gone.
    pub(crate) fn collect(&mut self) -> Vec<ExportId> {
        let done = self.ledger.collect(self.refs.counters());
        self.totals.released += done.len();
        release_all(done)
    }

    /// The connection ended: take back everything still out.
    /// One step of `serve` (blocking or async alike): a received frame is handled; the end
    /// of the connection (closed, or cut mid-frame) reclaims everything still out and ends the
    /// serve with its totals.
    pub(crate) fn serve_step(
        &mut self,
        received: Result<frame::Frame>,
    ) -> Result<Option<ServeEnd>> {
        match received {
            Ok(frame) => {
                self.on_message(frame.message)?;
                Ok(None)
            }
            Err(IpcError::Closed | IpcError::Truncated { .. }) => {
                self.reclaim();
                Ok(Some(self.totals))
            }
            Err(e) => Err(e),
        }
    }

    pub(crate) fn reclaim(&mut self) -> Vec<ExportId> {
        // What the importer released before going counts as released.
        self.collect();
        let done = self.ledger.reclaim_all(self.refs.counters());
        if !done.is_empty() {
            tracing::info!(
                count = done.len(),
                peer = self.peer.pid,
                "reclaimed exports of a closed ipc connection"
            );
        }
        self.totals.reclaimed += done.len();
        self.taken_back.extend(done.iter().map(|(id, _)| *id));
        release_all(done)
    }

    /// How export `id` came back, `None` while it is out; [`IpcError::UnknownExport`] for an
    /// id this connection never issued.
    pub(crate) fn returned(&self, id: ExportId) -> Result<Option<Returned>> {
        if !self.ledger.issued(id) {
            Err(IpcError::UnknownExport(id))
        } else if self.ledger.is_out(id) {
            Ok(None)
        } else if self.taken_back.contains(&id) {
            Ok(Some(Returned::Reclaimed))
        } else {
            Ok(Some(Returned::Released))
        }
    }

    /// One step of `wait_returned` after a receive: handles the frame, or reclaims
    /// everything at the end of the connection.
    pub(crate) fn wait_step(&mut self, received: Result<frame::Frame>) -> Result<()> {
        match received {
            Ok(frame) => self.on_message(frame.message).map(|_| ()),
            Err(IpcError::Closed | IpcError::Truncated { .. }) => {
                self.reclaim();
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    pub(crate) fn outstanding(&self) -> usize {
        self.ledger.outstanding()
    }

    /// The connection is being dropped: exports still out go to the keeper (`keeper.rs`),
    /// which takes them back only once the importer released them or is gone; with nothing
    /// out, the connection's place with the keeper is given back.
    pub(crate) fn hand_over(&mut self, slot: KeeperSlot) {
        self.collect();
        if self.outstanding() == 0 {
            return;
        }
        let slots = self.refs.slots();
        let kept = ExporterState {
            backend: self.backend.clone(),
            refs: self.refs.clone(),
            ledger: std::mem::replace(&mut self.ledger, ExportLedger::new(slots)),
            peer: self.peer,
            totals: self.totals,
            taken_back: std::mem::take(&mut self.taken_back),
        };
        tracing::debug!(
            count = kept.outstanding(),
            peer = self.peer.pid,
            "ipc connection dropped with exports out: kept until the importer lets go"
        );
        slot.keep(kept);
    }
}

impl Drop for ExporterState {
    fn drop(&mut self) {
        self.reclaim();
    }
}

fn release_all(done: Vec<(ExportId, Box<dyn ExportGuard>)>) -> Vec<ExportId> {
    done.into_iter()
        .map(|(id, guard)| {
            guard.release();
            id
        })
        .collect()
}

fn dup(fd: std::os::fd::BorrowedFd<'_>) -> Result<OwnedFd> {
    fd.as_fd()
        .try_clone_to_owned()
        .map_err(|e| IpcError::os("dup", e))
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::export::{OnRelease, SegmentMemory};
    use gpualloc_runtime::DeviceId;
    use gpualloc_sim::{SimBackend, SimConfig};
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn every_failed_export_releases_its_guard() {
        let backend: Arc<dyn Backend> = SimBackend::new(SimConfig::fast(1)).unwrap();
        let ptr = backend.malloc(DeviceId(0), 1 << 20).unwrap();
        let peer = PeerCred {
            pid: 1,
            uid: 0,
            gid: 0,
        };
        let mut state = ExporterState::new(backend.clone(), peer, 1).unwrap();
        let released = Arc::new(AtomicUsize::new(0));
        let guard = || {
            let r = released.clone();
            Box::new(OnRelease::new(move || {
                r.fetch_add(1, Ordering::SeqCst);
            }))
        };
        let region = DeviceRegion {
            device: DeviceId(0),
            ptr,
            len: 4096,
            segment: SegmentMemory::Allocation { base: ptr },
        };
        let (id, out) = state.device(&region, None, guard()).unwrap();
        assert!(out.fds.is_empty());
        // The only slot is taken: the next export fails and its guard is released at once.
        assert!(matches!(
            state.device(&region, None, guard()),
            Err(IpcError::SlotsExhausted(1))
        ));
        assert_eq!(released.load(Ordering::SeqCst), 1);
        // A zero-length region is refused, guard released.
        let empty = DeviceRegion { len: 0, ..region };
        assert!(matches!(
            state.device(&empty, None, guard()),
            Err(IpcError::InvalidExport(_))
        ));
        assert_eq!(released.load(Ordering::SeqCst), 2);
        // A send that failed gives the slot back.
        state.send_failed(id);
        assert_eq!(released.load(Ordering::SeqCst), 3);
        assert_eq!(state.outstanding(), 0);
        drop(state);
        backend.free(DeviceId(0), ptr).unwrap();
    }
}
