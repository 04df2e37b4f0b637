//! Exporting a [`DeviceBuffer`] to another process through the ipc crate.
//!
//! - [`Allocator::export_region`] describes a live buffer as a [`DeviceRegion`]: its device,
//!   pointer, length, and the memory behind it (the base of its ordinary segment, or the
//!   mapped physical pages of its expandable segment), which only the device core knows; it
//!   is read under the device actor's mailbox like any other request. The buffer counts as
//!   exported from then until it is freed, or unmarked with
//!   [`Allocator::unexport_region`] (a region never sent): a named pool holding one refuses
//!   to sleep (`AllocError::PoolExported`).
//! - A `DeviceBuffer` is an [`ExportGuard`]: moved into `send_device`, it keeps its block
//!   allocated and unused while any importer holds it; when the importer releases it (or its
//!   connection ends) the guard is dropped, and the buffer's drop returns the block.
//! - [`Allocator::export`] does both over an async connection, with the buffer's stream as
//!   the producer stream (the importer's stream waits for the work queued on it).
//!
//! - What the importer reaches besides the buffer: the rest of its ordinary segment, or of
//!   the physical handles behind it in an expandable segment (the driver shares whole
//!   allocations and handles; `gpualloc_ipc::export` has the details). A buffer of a pool of
//!   unsplit blocks is alone on its range: allocate what you export to a peer you trust with
//!   nothing else from such a pool,
//!   `alloc.pool("export", PoolOptions { unsplit: Some(2 << 20), ..Default::default() })`
//!   (it needs expandable segments, the default where the backend has virtual memory).
//!
//! ```ignore
//! let mut conn = AsyncExportConn::new(sock, &PeerPolicy::default(), alloc.backend().clone()).await?;
//! let id = alloc.export(&mut conn, buf).await?; // `buf` now lives until the importer lets go
//! conn.wait_returned(id).await?;
//! ```

use std::sync::Arc;

use gpualloc_devices::{AllocationMemory, DeviceCore};
use gpualloc_ipc::{AsyncExportConn, DeviceRegion, ExportGuard, ExportId, SegmentMemory};
use gpualloc_runtime::DevicePtr;

use crate::allocator::Allocator;
use crate::buffer::DeviceBuffer;
use crate::error::Error;

/// Releasing an exported buffer drops it: its block goes back to the cache (after the
/// streams it was recorded on), exactly as when the user drops a buffer.
impl ExportGuard for DeviceBuffer {}

impl Allocator {
    /// Describes live `buffer` of this allocator for export (see the module docs). Errors
    /// for an empty buffer, a buffer of another allocator, and after a fork. The buffer is
    /// marked exported until it is freed (its pool may not sleep: the importer maps its
    /// pages); a region that ends up not shared is unmarked with
    /// [`Allocator::unexport_region`]. ([`Allocator::export`] needs neither: a send that
    /// fails frees the buffer.)
    pub async fn export_region(&self, buffer: &DeviceBuffer) -> Result<DeviceRegion, Error> {
        let actor = self.device_actor(buffer.device())?;
        actor.process.check()?;
        if !Arc::ptr_eq(actor, buffer.actor()) {
            return Err(Error::Export(
                "the buffer belongs to another allocator".into(),
            ));
        }
        if buffer.is_empty() {
            return Err(Error::Export("cannot export an empty buffer".into()));
        }
        let ptr = buffer.ptr();
        let region = actor
            .call(move |st| {
                let region = region_of(&st.core, ptr)?;
                // Until the buffer is freed its pool may not sleep (`AllocError::PoolExported`).
                st.core.mark_exported(ptr)?;
                Ok::<_, Error>(region)
            })
            .await??;
        Ok(region)
    }

    /// Undoes [`Allocator::export_region`] for a region that was never shared (or whose
    /// importers are all gone): `buffer`'s pool may sleep again. Returns whether it was
    /// marked. Unmarking a buffer another process still maps lets its pool sleep under the
    /// importer, which then sees other memory: only the exporter knows, so it is the caller's
    /// to say.
    pub async fn unexport_region(&self, buffer: &DeviceBuffer) -> Result<bool, Error> {
        let actor = self.device_actor(buffer.device())?;
        if !Arc::ptr_eq(actor, buffer.actor()) {
            return Err(Error::Export(
                "the buffer belongs to another allocator".into(),
            ));
        }
        let ptr = buffer.ptr();
        Ok(actor.call(move |st| st.core.unmark_exported(ptr)).await??)
    }

    /// Exports `buffer` over `conn`: the importer maps the same device memory, and its
    /// stream waits for the work queued on the buffer's stream so far. The buffer is kept
    /// (allocated, unused) until the importer releases it or goes away, then freed. On
    /// error the buffer is freed at once.
    pub async fn export(
        &self,
        conn: &mut AsyncExportConn,
        buffer: DeviceBuffer,
    ) -> Result<ExportId, Error> {
        let region = self.export_region(&buffer).await?;
        let producer = buffer.stream().handle();
        Ok(conn
            .send_device(&region, Some(producer), Box::new(buffer))
            .await?)
    }
}

/// Describes live allocation `ptr` of `core` as the ipc crate's [`DeviceRegion`] (the ipc
/// crate does not know the core): its requested length, and its ordinary segment's base or
/// the mapped physical handles of its expandable segment.
fn region_of(core: &DeviceCore, ptr: DevicePtr) -> Result<DeviceRegion, Error> {
    let (len, memory) = core.allocation_memory(ptr)?;
    let segment = match memory {
        AllocationMemory::Segment { base } => SegmentMemory::Allocation { base },
        AllocationMemory::Pages(pages) => SegmentMemory::from_pages(pages),
    };
    Ok(DeviceRegion {
        device: core.device(),
        ptr,
        len,
        segment,
    })
}
