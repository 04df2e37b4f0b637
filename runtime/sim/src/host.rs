//! The sim's host memory: pinned allocations (`host_alloc` / `host_free`), registered ranges
//! (`host_register` / `host_unregister`, checked and costed against this process's memory map,
//! parsed by [`gpualloc_runtime::procmaps`]), and copies between host and device memory
//! (`memcpy_async`).

use gpualloc_runtime::error::{BackendError, Result};
use gpualloc_runtime::procmaps::{mappings_crossed, parse_maps};
use gpualloc_runtime::types::{HostRegisterFlags, StreamHandle};

use crate::memory::{Region, RegionKind};
use crate::os::Mapping;
use crate::{latency, Op, SimBackend};

/// Counts the mappings of this process that `[start, end)` crosses, or errors when part of
/// the range is not mapped, or not readable (and writable, when `need_write`): the device must
/// be able to access all of it, or a copy would fault.
pub(crate) fn count_own_mappings(start: u64, end: u64, need_write: bool) -> Result<u64> {
    let text = std::fs::read_to_string("/proc/self/maps")
        .map_err(|e| BackendError::os("read /proc/self/maps", e))?;
    mappings_crossed(&parse_maps(&text), &(start..end), need_write).map_err(|at| {
        BackendError::invalid(format!(
            "host range {start:#x}..{end:#x}: {at:#x} is not mapped accessible memory"
        ))
    })
}

impl SimBackend {
    /// [`gpualloc_runtime::Backend::host_alloc`]: page-rounded pinned memory of the sim's own.
    pub(crate) fn pinned_alloc(&self, size: u64) -> Result<*mut u8> {
        self.enter(Op::HostAlloc)?;
        if size == 0 {
            return Err(BackendError::invalid("host_alloc of 0 bytes"));
        }
        let rounded = self
            .page_round(size)
            .ok_or_else(|| BackendError::OutOfMemory {
                requested: size,
                what: "pinned host".into(),
            })?;
        let mapping = Mapping::anonymous(rounded)?;
        let addr = mapping.addr();
        let region = Region {
            len: rounded,
            kind: RegionKind::PinnedHost,
            device: None,
            accessible: true,
            read_only: false,
            _mapping: Some(mapping),
            fd: None,
        };
        self.mem.insert(addr, region)?;
        latency::pay(self.latency().host_alloc_cost(size));
        Ok(addr as *mut u8)
    }

    /// [`gpualloc_runtime::Backend::host_register`], checked: the range must be mapped
    /// memory of this process (readable, and writable unless `flags.read_only`).
    pub(crate) fn register_range(
        &self,
        ptr: *mut u8,
        len: u64,
        flags: HostRegisterFlags,
    ) -> Result<()> {
        self.enter(Op::HostRegister)?;
        let start = ptr as u64;
        if len == 0 {
            return Err(BackendError::invalid("host_register of 0 bytes"));
        }
        if start == 0 {
            return Err(BackendError::invalid("host_register of a null pointer"));
        }
        // Any byte range, as the driver takes it (it locks the pages the range touches); the
        // region is the range itself, so a copy counts as pinned only inside it.
        let end = start
            .checked_add(len)
            .ok_or_else(|| BackendError::invalid("host_register range overflows"))?;
        let pages = start - start % self.page..end.next_multiple_of(self.page);
        let mappings = count_own_mappings(pages.start, pages.end, !flags.read_only)?;
        let region = Region {
            len,
            kind: RegionKind::RegisteredHost,
            device: None,
            accessible: true,
            read_only: flags.read_only,
            _mapping: None,
            fd: None,
        };
        self.mem.insert(start, region)?;
        latency::pay(self.latency().host_register_cost(len, mappings));
        Ok(())
    }
}

/// The calls the [`gpualloc_runtime::Backend`] trait marks `unsafe` because a GPU cannot check host addresses;
/// the sim checks every one, so it offers them safe.
impl SimBackend {
    /// [`gpualloc_runtime::Backend::memcpy_async`], safe on the sim: every address is checked against the sim's
    /// own regions (device memory, its pinned memory, and ranges registered through the unsafe
    /// [`gpualloc_runtime::Backend::host_register`], whose contract keeps them mapped) when the copy is queued
    /// and again, under the region table's lock, when it runs; nothing else is touched.
    pub fn memcpy_async(&self, stream: StreamHandle, dst: u64, src: u64, len: u64) -> Result<()> {
        self.enter(Op::MemcpyAsync)?;
        let (shared, tx) = self.stream(stream)?;
        if len == 0 {
            return Ok(());
        }
        self.mem.validate_write(dst, len)?;
        self.mem.validate(src, len)?;
        let mem = self.mem.clone();
        latency::pay(self.latency().launch);
        let touches = [(dst, len), (src, len)];
        self.enqueue_timed(&shared, &tx, len, &touches, move || mem.copy(dst, src, len))
    }

    /// [`gpualloc_runtime::Backend::host_free`], safe on the sim: only a pinned allocation of the sim's own is
    /// freed, under the region table's write lock, so a queued copy that reaches it later
    /// fails instead of touching unmapped memory.
    pub fn host_free(&self, ptr: *mut u8) -> Result<()> {
        self.enter(Op::HostFree)?;
        let region = self
            .mem
            .remove(Self::host_ptr(ptr).0, RegionKind::PinnedHost)?;
        let len = region.len;
        drop(region);
        latency::pay(self.latency().host_free_cost(len));
        Ok(())
    }

    /// [`gpualloc_runtime::Backend::host_unregister`], safe on the sim: copies queued on the range fail once
    /// it is gone (they check the region table when they run).
    pub fn host_unregister(&self, ptr: *mut u8) -> Result<()> {
        self.enter(Op::HostUnregister)?;
        self.mem.remove(ptr as u64, RegionKind::RegisteredHost)?;
        latency::pay(self.latency().host_unregister);
        Ok(())
    }
}
