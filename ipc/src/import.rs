//! The importer's side of a device buffer: [`ImportedBuffer`] opens an offer in this
//! process (a legacy IPC handle, or VMM fds imported, mapped into a fresh reservation and
//! made accessible) and, on release, closes it and drops its reference in the shared
//! counter, which lets the exporter reuse the block, and tells the exporter at once. Dropping
//! it releases too. It keeps its connection's socket open (see `link.rs`): dropping the
//! connection first does not let the exporter take the block back while the buffer lives.
//!
//! Ordering: the exporter synchronized its producing stream before sending (see
//! [`Readiness`]), so the importer may use the buffer at once. Before releasing, the
//! importer must finish its own work on it: [`ImportedBuffer::release_after`] synchronizes
//! the streams it names first.

use std::os::fd::OwnedFd;
use std::sync::Arc;

use gpualloc_runtime::{Backend, DeviceId, DevicePtr, IpcMemHandle, PhysHandle, StreamHandle};

use crate::counter::SharedCounter;
use crate::error::{IpcError, Result};
use crate::ledger::ExportId;
use crate::link::ConnLink;
use crate::message::{DeviceOffer, OfferedMemory, Readiness};
use crate::refcount::RefCountFile;

/// How the memory is open in this process.
#[derive(Debug)]
enum Opened {
    Legacy {
        base: DevicePtr,
    },
    Vmm {
        device: DeviceId,
        base: DevicePtr,
        span: u64,
        maps: Vec<(DevicePtr, u64)>,
        handles: Vec<PhysHandle>,
    },
}

/// A device buffer of another process, open in this one. See the module docs.
pub struct ImportedBuffer {
    backend: Arc<dyn Backend>,
    refs: Arc<RefCountFile>,
    link: Arc<ConnLink>,
    id: ExportId,
    slot: u32,
    device: DeviceId,
    ptr: DevicePtr,
    len: u64,
    ready: Readiness,
    opened: Option<Opened>,
}

impl std::fmt::Debug for ImportedBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ImportedBuffer")
            .field("id", &self.id)
            .field("device", &self.device)
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .field("opened", &self.opened)
            .finish()
    }
}

impl ImportedBuffer {
    /// Opens `offer` (with its fds) on `device`'s backend.
    pub(crate) fn open(
        backend: Arc<dyn Backend>,
        refs: Arc<RefCountFile>,
        link: Arc<ConnLink>,
        device: DeviceId,
        offer: DeviceOffer,
        fds: Vec<OwnedFd>,
    ) -> Result<ImportedBuffer> {
        let Some(counter) = refs.counters().get(offer.slot as usize) else {
            return Err(IpcError::Malformed(format!(
                "slot {} of {}",
                offer.slot,
                refs.slots()
            )));
        };
        if offer.len == 0 {
            counter.decline();
            return Err(IpcError::Malformed("zero-length device buffer".into()));
        }
        // Take the reference before touching the memory: an offer the exporter already took
        // back (the slot no longer holds it) is refused, never opened.
        if !counter.accept() {
            return Err(IpcError::Withdrawn(offer.id));
        }
        match Self::open_memory(&backend, device, &offer, fds) {
            Ok((opened, ptr)) => Ok(ImportedBuffer {
                backend,
                refs,
                link,
                id: offer.id,
                slot: offer.slot,
                device,
                ptr,
                len: offer.len,
                ready: offer.ready,
                opened: Some(opened),
            }),
            Err(e) => {
                // Give the reference back: the exporter collects the slot as released.
                counter.release_one();
                Err(e)
            }
        }
    }

    /// Opens the memory an offer names and checks the offer against what was opened.
    fn open_memory(
        backend: &Arc<dyn Backend>,
        device: DeviceId,
        offer: &DeviceOffer,
        fds: Vec<OwnedFd>,
    ) -> Result<(Opened, DevicePtr)> {
        match &offer.memory {
            OfferedMemory::Legacy { handle, offset } => {
                let raw: [u8; 64] = handle
                    .as_slice()
                    .try_into()
                    .map_err(|_| IpcError::Malformed("IPC handle is not 64 bytes".into()))?;
                let base = backend.ipc_open_mem_handle(device, &IpcMemHandle(raw))?;
                let opened = Opened::Legacy { base };
                // The window must lie inside the allocation actually opened: a device
                // pointer past its end would fault on the GPU.
                match legacy_window(&**backend, base, *offset, offer.len) {
                    Ok(ptr) => Ok((opened, ptr)),
                    Err(e) => {
                        // The import fails as a whole; a failed close is logged by `close`.
                        let _ = close(&**backend, opened);
                        Err(e)
                    }
                }
            }
            OfferedMemory::Vmm {
                span,
                offset,
                chunks,
            } => {
                let span = *span;
                let in_span = offset.checked_add(offer.len).is_some_and(|end| end <= span);
                if !in_span || chunks.len() != fds.len() {
                    return Err(IpcError::Malformed("VMM offer does not add up".into()));
                }
                let gran = backend.vmm_granularity(device)?;
                let base = backend.va_reserve(device, span, gran)?;
                let mut opened = Opened::Vmm {
                    device,
                    base,
                    span,
                    maps: Vec::new(),
                    handles: Vec::new(),
                };
                let mapped =
                    map_chunks(&**backend, device, &mut opened, chunks, fds).and_then(|()| {
                        base.checked_add(*offset)
                            .ok_or_else(|| IpcError::Malformed("offset overflows".into()))
                    });
                match mapped {
                    Ok(ptr) => Ok((opened, ptr)),
                    Err(e) => {
                        // The import fails as a whole; a failed close is logged by `close`.
                        let _ = close(&**backend, opened);
                        Err(e)
                    }
                }
            }
        }
    }

    /// The buffer's start in this process.
    pub fn ptr(&self) -> DevicePtr {
        self.ptr
    }

    /// Its length.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Always false (offers are never empty).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Its device in this process.
    pub fn device(&self) -> DeviceId {
        self.device
    }

    /// The export's id on its connection.
    pub fn id(&self) -> ExportId {
        self.id
    }

    /// What the importer had to wait for (always [`Readiness::Synchronized`] today).
    pub fn readiness(&self) -> Readiness {
        self.ready
    }

    /// True when this is a VMM (expandable-segment) import.
    pub fn is_vmm(&self) -> bool {
        matches!(self.opened, Some(Opened::Vmm { .. }))
    }

    /// Synchronizes `streams` (this process's work on the buffer), then releases.
    pub fn release_after(self, streams: &[StreamHandle]) -> Result<ExportId> {
        for s in streams {
            self.backend.stream_synchronize(*s)?;
        }
        Ok(self.release())
    }

    /// Closes the memory in this process, drops the reference (the exporter may reuse the
    /// block from now on) and tells the exporter (best effort: see `link.rs`). Returns the
    /// export's id.
    pub fn release(mut self) -> ExportId {
        if self.release_now() {
            let _ = self.link.notify_released(self.id);
        }
        self.id
    }

    /// Closes and drops the reference; true if this call did (not an earlier one). When the
    /// close fails the memory may still be mapped here, so the reference is kept: the
    /// exporter gets the block back only when this process is gone (its connection's end).
    fn release_now(&mut self) -> bool {
        let Some(opened) = self.opened.take() else {
            return false;
        };
        if !close(&*self.backend, opened) {
            tracing::error!(
                id = self.id,
                "an imported buffer could not be closed: its reference is kept"
            );
            return false;
        }
        if let Some(c) = self.refs.counters().get(self.slot as usize) {
            c.release_one();
        }
        true
    }
}

impl Drop for ImportedBuffer {
    fn drop(&mut self) {
        if self.release_now() {
            if let Err(e) = self.link.notify_released(self.id) {
                tracing::debug!(id = self.id, error = %e, "could not tell the exporter of a release");
            }
        }
    }
}

/// The start of `[offset, offset + len)` inside the allocation opened at `base`, checked
/// against its size as the backend reports it.
fn legacy_window(
    backend: &dyn Backend,
    base: DevicePtr,
    offset: u64,
    len: u64,
) -> Result<DevicePtr> {
    let (start, size) = backend.mem_address_range(base)?;
    let fits = start == base && offset.checked_add(len).is_some_and(|end| end <= size);
    if !fits {
        return Err(IpcError::Malformed(format!(
            "offer of {len} bytes at offset {offset} runs past the {size}-byte allocation opened"
        )));
    }
    base.checked_add(offset)
        .ok_or_else(|| IpcError::Malformed("offset overflows".into()))
}

fn map_chunks(
    backend: &dyn Backend,
    device: DeviceId,
    opened: &mut Opened,
    chunks: &[crate::message::WireChunk],
    fds: Vec<OwnedFd>,
) -> Result<()> {
    let Opened::Vmm {
        base,
        span,
        device: _,
        maps,
        handles,
    } = opened
    else {
        return Ok(());
    };
    for (c, fd) in chunks.iter().zip(fds) {
        let fits = c.va_offset.checked_add(c.size).is_some_and(|e| e <= *span);
        if !fits {
            return Err(IpcError::Malformed("chunk outside the span".into()));
        }
        let h = backend.phys_import_fd(device, fd)?;
        handles.push(h);
        let at = base
            .checked_add(c.va_offset)
            .ok_or_else(|| IpcError::Malformed("chunk offset overflows".into()))?;
        backend.map(at, c.size, c.handle_offset, h)?;
        maps.push((at, c.size));
        backend.set_access(device, at, c.size)?;
    }
    Ok(())
}

/// Undoes an open, logging (not failing on) errors: it runs from `Drop`. Returns whether the
/// memory is no longer mapped in this process: false when the close (legacy) or an unmap
/// (VMM) failed, and then the caller must keep its reference, or the exporter would hand the
/// block out again while this process can still read and write it. (A failed `phys_release`
/// or `va_free` leaks this process's handle or address range, not the exporter's memory.)
fn close(backend: &dyn Backend, opened: Opened) -> bool {
    let ok = |what: &str, r: gpualloc_runtime::Result<()>| match r {
        Ok(()) => true,
        Err(e) => {
            tracing::warn!(error = %e, "{what} of an imported buffer failed");
            false
        }
    };
    match opened {
        Opened::Legacy { base } => ok("ipc_close_mem_handle", backend.ipc_close_mem_handle(base)),
        Opened::Vmm {
            device,
            base,
            span,
            maps,
            handles,
        } => {
            let mut unmapped = true;
            for (at, size) in maps {
                unmapped &= ok("unmap", backend.unmap(at, size));
            }
            if unmapped {
                // A page still mapped keeps its handle too.
                for h in handles {
                    ok("phys_release", backend.phys_release(h));
                }
                ok("va_free", backend.va_free(device, base, span));
            }
            unmapped
        }
    }
}
