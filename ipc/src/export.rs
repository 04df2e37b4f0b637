//! The exporter's view of a device buffer: [`DeviceRegion`] (device, pointer, length, and
//! the segment memory behind it) plus an [`ExportGuard`] that keeps the block alive and
//! unused until every importer has let go.
//!
//! # How the facade plugs in
//! The ipc crate does not know `DeviceBuffer`. To export one, the facade
//! 1. describes it as a [`DeviceRegion`]: its device, pointer and length, and either the
//!    base of its ordinary segment ([`SegmentMemory::Allocation`]) or, for an expandable
//!    segment, the mapped physical chunks that cover it ([`SegmentMemory::Vmm`]), as the
//!    device core tells them (`gpualloc_devices::DeviceCore::allocation_memory`: this crate
//!    does not depend on the core);
//! 2. moves the `DeviceBuffer` itself into the guard (`impl ExportGuard for DeviceBuffer {}`:
//!    releasing drops the buffer, which sends its free to the actor). The user no longer
//!    holds the buffer, so the block stays allocated and unused;
//! 3. calls `send_device(region, Some(producer_stream), Box::new(buffer))` on a connection.
//!
//! The connection releases the guard exactly once, when the importer releases its reference
//! or its connection ends (importer exited or was killed), or at once if the export fails.
//! [`OnRelease`] runs any closure then (a test's guard frees the block in its core).
//!
//! # What an importer can reach
//! The driver shares memory by allocation (legacy IPC opens a whole `cuMemAlloc` segment) or
//! by physical handle (a handle is mapped whole: `cuMemMap`'s offset must be zero), never by
//! byte range. So an importer can read and write, besides the buffer it was sent:
//! - for a buffer of an ordinary segment: the whole segment (up to the segment's size: 2 MiB
//!   of the small pool, 20 MiB, or the size of a large request), other buffers in it included;
//! - for a buffer of an expandable segment: the whole physical handles behind it (under the
//!   `gpualloc` policy a handle holds one growth, up to 20 MiB; under `pytorch`, one 20 MiB
//!   page of the large pool or 2 MiB of the small one), other buffers on them included;
//! - for a buffer of a pool of unsplit blocks (`PoolOptions::unsplit`, with expandable
//!   segments): its own range only, the buffer rounded up to the pool's granularity (2 MiB),
//!   which nothing else shares. **Allocate what you export to a peer you do not trust with
//!   your other buffers from such a pool.**
//!
//! [`DeviceRegion::exposed`] tells the exporter, before it sends, what the importer will
//! reach; `ImportedBuffer::reachable` tells the importer.

use std::os::fd::OwnedFd;

use gpualloc_runtime::{Backend, DeviceId, DevicePtr, PhysHandle};

use crate::error::{IpcError, Result};
use crate::message::{OfferedMemory, WireChunk};

/// Keeps an exported block alive while an importer may use it. Owning the guard is the
/// keep-alive; dropping it is the release, so every path that lets go of a guard (the
/// importer released, the importer died, the export failed, the connection was dropped)
/// releases the block, exactly once.
pub trait ExportGuard: Send + 'static {
    /// Every importer reference is gone: the block may be freed and reused. The default
    /// drops the guard, which is all most guards need (their `Drop` frees the block).
    fn release(self: Box<Self>) {}
}

/// An [`ExportGuard`] that runs a closure when released (dropped).
pub struct OnRelease<F: FnOnce() + Send + 'static>(Option<F>);

impl<F: FnOnce() + Send + 'static> OnRelease<F> {
    /// Runs `f` on release.
    pub fn new(f: F) -> Self {
        OnRelease(Some(f))
    }
}

impl<F: FnOnce() + Send + 'static> ExportGuard for OnRelease<F> {}

impl<F: FnOnce() + Send + 'static> Drop for OnRelease<F> {
    fn drop(&mut self) {
        if let Some(f) = self.0.take() {
            f()
        }
    }
}

/// The memory behind a device buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SegmentMemory {
    /// An ordinary segment from `Backend::malloc`, starting at `base`: exported with a
    /// legacy IPC handle of the whole segment plus the offset.
    Allocation {
        /// The segment's base address.
        base: DevicePtr,
    },
    /// An expandable segment: the mapped physical chunks covering the buffer, in address
    /// order and contiguous; exported as one fd per chunk.
    Vmm {
        /// The chunks.
        chunks: Vec<VmmChunk>,
    },
}

impl SegmentMemory {
    /// An expandable segment's mapped physical handles, in address order, as (where, bytes,
    /// handle), each mapped whole at handle offset 0 (what
    /// `gpualloc_devices::DeviceCore::allocation_memory` gives).
    pub fn from_pages(pages: impl IntoIterator<Item = (DevicePtr, u64, PhysHandle)>) -> Self {
        SegmentMemory::Vmm {
            chunks: pages
                .into_iter()
                .map(|(ptr, size, handle)| VmmChunk {
                    ptr,
                    size,
                    handle,
                    handle_offset: 0,
                })
                .collect(),
        }
    }
}

/// One mapped piece of physical memory in the exporter's address space.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VmmChunk {
    /// Where it is mapped.
    pub ptr: DevicePtr,
    /// Bytes mapped.
    pub size: u64,
    /// The physical memory.
    pub handle: PhysHandle,
    /// Offset of the mapping into `handle`.
    pub handle_offset: u64,
}

/// A device buffer to export. See the module docs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceRegion {
    /// Its device.
    pub device: DeviceId,
    /// Its start.
    pub ptr: DevicePtr,
    /// Its length in bytes.
    pub len: u64,
    /// The memory behind it.
    pub segment: SegmentMemory,
}

impl DeviceRegion {
    /// The exporter's memory an importer of this region can reach (start, bytes): the whole
    /// allocation behind an ordinary segment's buffer (a legacy IPC handle opens all of it),
    /// the whole physical handles behind an expandable one (a handle is mapped whole). Equal
    /// to the buffer, rounded up to the granularity, only for a buffer of a pool of unsplit
    /// blocks; see the module docs.
    pub fn exposed(&self, backend: &dyn Backend) -> Result<(DevicePtr, u64)> {
        match &self.segment {
            SegmentMemory::Allocation { base } => Ok(backend.mem_address_range(*base)?),
            SegmentMemory::Vmm { chunks } => {
                let first = chunks
                    .first()
                    .ok_or_else(|| IpcError::InvalidExport("no chunks".into()))?;
                let bytes = chunks
                    .iter()
                    .try_fold(0u64, |sum, c| sum.checked_add(c.size))
                    .ok_or_else(|| IpcError::InvalidExport("chunk overflows".into()))?;
                Ok((first.ptr, bytes))
            }
        }
    }

    /// Checks the description and builds what travels: the offered memory and its fds.
    pub(crate) fn offer(&self, backend: &dyn Backend) -> Result<(OfferedMemory, Vec<OwnedFd>)> {
        if self.len == 0 {
            return Err(IpcError::InvalidExport("zero-length buffer".into()));
        }
        let end = self
            .ptr
            .0
            .checked_add(self.len)
            .ok_or_else(|| IpcError::InvalidExport("buffer wraps the address space".into()))?;
        match &self.segment {
            SegmentMemory::Allocation { base } => {
                let offset = self.ptr.0.checked_sub(base.0).ok_or_else(|| {
                    IpcError::InvalidExport(format!("{} is below its segment {base}", self.ptr))
                })?;
                let handle = backend.ipc_get_mem_handle(*base)?;
                Ok((
                    OfferedMemory::Legacy {
                        handle: handle.0.to_vec(),
                        offset,
                    },
                    Vec::new(),
                ))
            }
            SegmentMemory::Vmm { chunks } => {
                let first = chunks
                    .first()
                    .ok_or_else(|| IpcError::InvalidExport("no chunks".into()))?;
                let start = first.ptr.0;
                let mut at = start;
                let mut wire = Vec::with_capacity(chunks.len());
                for c in chunks {
                    if c.ptr.0 != at || c.size == 0 {
                        return Err(IpcError::InvalidExport(format!(
                            "chunks are not contiguous at {}",
                            c.ptr
                        )));
                    }
                    if c.handle.device != self.device {
                        return Err(IpcError::InvalidExport(
                            "a chunk belongs to another device".into(),
                        ));
                    }
                    wire.push(WireChunk {
                        handle: c.handle.raw,
                        va_offset: at - start,
                        size: c.size,
                        handle_offset: c.handle_offset,
                    });
                    at = at
                        .checked_add(c.size)
                        .ok_or_else(|| IpcError::InvalidExport("chunk overflows".into()))?;
                }
                if self.ptr.0 < start || end > at {
                    return Err(IpcError::InvalidExport(format!(
                        "chunks [{start:#x}, {at:#x}) do not cover the buffer"
                    )));
                }
                let fds = chunks
                    .iter()
                    .map(|c| backend.phys_export_fd(c.handle))
                    .collect::<std::result::Result<Vec<_>, _>>()?;
                Ok((
                    OfferedMemory::Vmm {
                        span: at - start,
                        offset: self.ptr.0 - start,
                        chunks: wire,
                    },
                    fds,
                ))
            }
        }
    }
}
