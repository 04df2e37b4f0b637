//! The importer's side of a device buffer: [`ImportedBuffer`] opens an offer in this
//! process (a legacy IPC handle, or VMM fds imported, mapped into a fresh reservation and
//! made accessible) and, on release, closes it and drops its reference in the shared
//! counter, which lets the exporter reuse the block, and tells the exporter at once. Dropping
//! it releases too. It keeps its connection's socket open (see `link.rs`): dropping the
//! connection first does not let the exporter take the block back while the buffer lives.
//!
//! VMM offers name the exporter's physical handles: offers on the same handles, in the same
//! layout, share one mapping of them per connection, counted by the buffers using it and
//! unmapped with the last (2,000 imported 2 MiB buffers of 20 MiB handles reserve the
//! 4,000 MiB imported, not the 39 GiB of a mapping each). A buffer released while others
//! still use its mapping stays reachable through theirs until they go: the handle is mapped
//! whole, as the export docs say.
//!
//! Ordering: the exporter synchronized its producing stream before sending (see
//! [`Readiness`]), so the importer may use the buffer at once. Before releasing, the
//! importer must finish its own work on it: [`ImportedBuffer::release_after`] synchronizes
//! the streams it names first.

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex, MutexGuard};

use gpualloc_runtime::{Backend, DeviceId, DevicePtr, IpcMemHandle, PhysHandle, StreamHandle};

use crate::counter::SharedCounter;
use crate::error::{IpcError, Result};
use crate::ledger::ExportId;
use crate::link::ConnLink;
use crate::message::{DeviceOffer, OfferedMemory, Readiness, WireChunk};
use crate::refcount::RefCountFile;

/// How the memory is open in this process.
#[derive(Debug)]
enum Opened {
    Legacy {
        base: DevicePtr,
    },
    /// A user of a shared VMM mapping of the connection.
    Vmm {
        key: VmmKey,
        mappings: Arc<VmmMappings>,
    },
}

/// Which physical memory a VMM mapping holds, as the exporter laid it out: offers with the
/// same key (buffers on the same physical handles) share one mapping.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct VmmKey {
    span: u64,
    chunks: Vec<WireChunk>,
}

/// The exporter's physical handles mapped into a reservation of this process.
#[derive(Debug)]
struct VmmMapping {
    device: DeviceId,
    base: DevicePtr,
    span: u64,
    maps: Vec<(DevicePtr, u64)>,
    handles: Vec<PhysHandle>,
}

/// The VMM mappings of one connection, each with the number of imported buffers using it:
/// a physical handle behind several buffers is imported and mapped once (a 20 MiB handle
/// behind ten 2 MiB buffers costs one 20 MiB reservation, not ten), and unmapped when its
/// last buffer is released.
#[derive(Debug, Default)]
pub(crate) struct VmmMappings {
    inner: Mutex<HashMap<VmmKey, (VmmMapping, usize)>>,
}

impl VmmMappings {
    fn lock(&self) -> MutexGuard<'_, HashMap<VmmKey, (VmmMapping, usize)>> {
        // Every step under the lock leaves the map consistent.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
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
    /// The exporter's memory this import makes reachable here: start and bytes.
    reach: (DevicePtr, u64),
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
        mappings: &Arc<VmmMappings>,
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
        match Self::open_memory(&backend, mappings, device, &offer, fds) {
            Ok((opened, ptr, reach)) => Ok(ImportedBuffer {
                backend,
                refs,
                link,
                id: offer.id,
                slot: offer.slot,
                device,
                ptr,
                len: offer.len,
                ready: offer.ready,
                reach,
                opened: Some(opened),
            }),
            Err(e) => {
                // Give the reference back: the exporter collects the slot as released.
                counter.release_one();
                Err(e)
            }
        }
    }

    /// Opens the memory an offer names and checks the offer against what was opened: how it
    /// is open, the buffer's start, and the exporter's memory reachable (start, bytes).
    fn open_memory(
        backend: &Arc<dyn Backend>,
        mappings: &Arc<VmmMappings>,
        device: DeviceId,
        offer: &DeviceOffer,
        fds: Vec<OwnedFd>,
    ) -> Result<(Opened, DevicePtr, (DevicePtr, u64))> {
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
                    Ok((ptr, size)) => Ok((opened, ptr, (base, size))),
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
                let ptr_in = |m: &VmmMapping| {
                    m.base
                        .checked_add(*offset)
                        .ok_or_else(|| IpcError::Malformed("offset overflows".into()))
                };
                let key = VmmKey {
                    span,
                    chunks: chunks.clone(),
                };
                let opened = |key| Opened::Vmm {
                    key,
                    mappings: mappings.clone(),
                };
                let mut open = mappings.lock();
                if let Some((m, users)) = open.get_mut(&key) {
                    // The same handles in the same layout: this process maps them already
                    // (the new fds close unused).
                    let ptr = ptr_in(m)?;
                    *users += 1;
                    let base = m.base;
                    return Ok((opened(key), ptr, (base, span)));
                }
                let gran = backend.vmm_granularity(device)?;
                let base = backend.va_reserve(device, span, gran)?;
                let mut m = VmmMapping {
                    device,
                    base,
                    span,
                    maps: Vec::new(),
                    handles: Vec::new(),
                };
                let mapped =
                    map_chunks(&**backend, device, &mut m, chunks, fds).and_then(|()| ptr_in(&m));
                match mapped {
                    Ok(ptr) => {
                        open.insert(key.clone(), (m, 1));
                        Ok((opened(key), ptr, (base, span)))
                    }
                    Err(e) => {
                        // The import fails as a whole; a failed close is logged by `close_vmm`.
                        let _ = close_vmm(&**backend, m);
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

    /// The exporter's memory this import makes reachable in this process (start, bytes): the
    /// whole allocation behind a legacy (ordinary-segment) buffer, the whole physical handles
    /// behind a VMM one. The buffer is [`ImportedBuffer::len`] bytes of it; the rest is memory
    /// of the exporter's that this process can read and write though it was not sent (see
    /// the [`crate::export`] docs for how an exporter keeps it to the buffer).
    pub fn reachable(&self) -> (DevicePtr, u64) {
        self.reach
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
) -> Result<(DevicePtr, u64)> {
    let (start, size) = backend.mem_address_range(base)?;
    let fits = start == base && offset.checked_add(len).is_some_and(|end| end <= size);
    if !fits {
        return Err(IpcError::Malformed(format!(
            "offer of {len} bytes at offset {offset} runs past the {size}-byte allocation opened"
        )));
    }
    let ptr = base
        .checked_add(offset)
        .ok_or_else(|| IpcError::Malformed("offset overflows".into()))?;
    Ok((ptr, size))
}

fn map_chunks(
    backend: &dyn Backend,
    device: DeviceId,
    m: &mut VmmMapping,
    chunks: &[WireChunk],
    fds: Vec<OwnedFd>,
) -> Result<()> {
    let VmmMapping {
        base,
        span,
        maps,
        handles,
        ..
    } = m;
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
/// A VMM mapping other buffers still use stays: this buffer's pointer is no longer used,
/// and the handles go when the last of them is released.
fn close(backend: &dyn Backend, opened: Opened) -> bool {
    match opened {
        Opened::Legacy { base } => ok("ipc_close_mem_handle", backend.ipc_close_mem_handle(base)),
        Opened::Vmm { key, mappings } => {
            let mut open = mappings.lock();
            let Some((_, users)) = open.get_mut(&key) else {
                return true;
            };
            *users -= 1;
            if *users > 0 {
                return true;
            }
            let (m, _) = open.remove(&key).expect("looked up above");
            drop(open);
            close_vmm(backend, m)
        }
    }
}

fn ok(what: &str, r: gpualloc_runtime::Result<()>) -> bool {
    match r {
        Ok(()) => true,
        Err(e) => {
            tracing::warn!(error = %e, "{what} of an imported buffer failed");
            false
        }
    }
}

/// Unmaps and releases a VMM mapping (see [`close`]).
fn close_vmm(backend: &dyn Backend, m: VmmMapping) -> bool {
    let VmmMapping {
        device,
        base,
        span,
        maps,
        handles,
    } = m;
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
