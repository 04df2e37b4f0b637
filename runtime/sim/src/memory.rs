//! The sim's region table: every address range device work may touch (device allocations,
//! mapped and accessible VMM ranges, pinned and registered host memory, opened IPC handles).
//!
//! Data operations (kernels, memcpys, memsets) validate each access against the table and
//! perform it under the table's read lock; anything that unmaps (free, unmap, host_free...)
//! removes its region under the write lock first. So an access never touches memory that is
//! being unmapped: a stale pointer gets a typed error instead of a SIGSEGV.

use std::collections::BTreeMap;
use std::os::fd::OwnedFd;
use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

use crate::os::{self, Mapping};
use gpualloc_runtime::error::{BackendError, Result};
use gpualloc_runtime::types::DeviceId;

/// What a region is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RegionKind {
    /// A device allocation from `malloc` (owns its mapping and memfd).
    Device,
    /// A mapped range inside a VMM reservation (the reservation owns the addresses).
    Vmm,
    /// Pinned host memory from `host_alloc` (owns its mapping).
    PinnedHost,
    /// Host memory registered with `host_register` (owned by the user).
    RegisteredHost,
    /// An opened IPC handle (owns its mapping and fd).
    IpcOpened,
}

/// One range in the table.
#[derive(Debug)]
pub(crate) struct Region {
    pub(crate) len: u64,
    pub(crate) kind: RegionKind,
    /// Owning device (`None` for host memory).
    pub(crate) device: Option<DeviceId>,
    /// False for a VMM mapping before `set_access`.
    pub(crate) accessible: bool,
    /// Device may read but not write it (host memory registered read-only).
    pub(crate) read_only: bool,
    /// The mapping this region owns, if any (unmapped when the region is dropped).
    pub(crate) _mapping: Option<Mapping>,
    /// The memfd behind it, if any (closed when the region is dropped).
    pub(crate) fd: Option<OwnedFd>,
}

/// The region table, shared by the backend and its stream workers.
#[derive(Debug, Default)]
pub(crate) struct Memory {
    regions: RwLock<BTreeMap<u64, Region>>,
}

type Regions = BTreeMap<u64, Region>;

fn covered(regions: &Regions, addr: u64, len: u64, write: bool) -> Result<()> {
    let end = addr
        .checked_add(len)
        .ok_or_else(|| BackendError::invalid(format!("range {addr:#x}+{len:#x} overflows")))?;
    let mut cur = addr;
    let mut prev_kind: Option<RegionKind> = None;
    while cur < end {
        let hole = || {
            BackendError::invalid(format!(
                "range {addr:#x}+{len:#x}: {cur:#x} is not device-accessible memory"
            ))
        };
        let (start, region) = regions.range(..=cur).next_back().ok_or_else(hole)?;
        let region_end = start + region.len;
        if cur >= region_end {
            return Err(hole());
        }
        if write && region.read_only {
            return Err(BackendError::invalid(format!(
                "range {addr:#x}+{len:#x}: {cur:#x} is read-only for the device"
            )));
        }
        if !region.accessible {
            return Err(BackendError::invalid(format!(
                "range {addr:#x}+{len:#x}: {cur:#x} is mapped but not accessible (set_access)"
            )));
        }
        // Only VMM mappings may be crossed (they tile a reservation, as an expandable segment
        // does); running off one allocation into its neighbour is an overrun.
        if let Some(prev) = prev_kind {
            if prev != RegionKind::Vmm || region.kind != RegionKind::Vmm {
                return Err(BackendError::invalid(format!(
                    "range {addr:#x}+{len:#x} runs past the end of its allocation at {cur:#x}"
                )));
            }
        }
        prev_kind = Some(region.kind);
        cur = region_end;
    }
    Ok(())
}

fn usize_len(len: u64) -> Result<usize> {
    usize::try_from(len).map_err(|_| BackendError::invalid(format!("length {len} too large")))
}

impl Memory {
    pub(crate) fn read_lock(&self) -> RwLockReadGuard<'_, Regions> {
        self.regions.read().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn write_lock(&self) -> RwLockWriteGuard<'_, Regions> {
        self.regions.write().unwrap_or_else(|p| p.into_inner())
    }

    /// Checks that `[addr, addr + len)` is readable device-accessible memory right now.
    pub(crate) fn validate(&self, addr: u64, len: u64) -> Result<()> {
        covered(&self.read_lock(), addr, len, false)
    }

    /// Checks that `[addr, addr + len)` is writable device-accessible memory right now.
    pub(crate) fn validate_write(&self, addr: u64, len: u64) -> Result<()> {
        covered(&self.read_lock(), addr, len, true)
    }

    /// Inserts a region; it must not overlap any other.
    pub(crate) fn insert(&self, addr: u64, region: Region) -> Result<()> {
        let mut regions = self.write_lock();
        Self::check_free(&regions, addr, region.len)?;
        regions.insert(addr, region);
        Ok(())
    }

    /// Errors when `[addr, addr + len)` overlaps a region.
    pub(crate) fn check_free(regions: &Regions, addr: u64, len: u64) -> Result<()> {
        let end = addr
            .checked_add(len)
            .ok_or_else(|| BackendError::invalid("range overflows"))?;
        if let Some((start, region)) = regions.range(..end).next_back() {
            if start + region.len > addr {
                return Err(BackendError::invalid(format!(
                    "range {addr:#x}+{len:#x} overlaps a known region at {start:#x}"
                )));
            }
        }
        Ok(())
    }

    /// Looks at the region starting exactly at `addr`, if it has kind `kind`.
    pub(crate) fn with_region<T>(
        &self,
        addr: u64,
        kind: RegionKind,
        f: impl FnOnce(&Region) -> T,
    ) -> Result<T> {
        let regions = self.read_lock();
        match regions.get(&addr) {
            Some(r) if r.kind == kind => Ok(f(r)),
            _ => Err(BackendError::invalid(format!(
                "{addr:#x} is not the start of a {kind:?} region"
            ))),
        }
    }

    /// The start and region containing `addr`.
    pub(crate) fn find_containing<T>(
        &self,
        addr: u64,
        f: impl FnOnce(u64, &Region) -> T,
    ) -> Option<T> {
        let regions = self.read_lock();
        let (start, region) = regions.range(..=addr).next_back()?;
        (addr < start + region.len).then(|| f(*start, region))
    }

    /// Removes and returns the region starting exactly at `addr` if it has kind `kind`. The
    /// caller drops it (unmapping it) after the lock is released.
    pub(crate) fn remove(&self, addr: u64, kind: RegionKind) -> Result<Region> {
        let mut regions = self.write_lock();
        match regions.get(&addr) {
            Some(r) if r.kind == kind => {}
            _ => {
                return Err(BackendError::invalid(format!(
                    "{addr:#x} is not the start of a {kind:?} region"
                )))
            }
        }
        regions
            .remove(&addr)
            .ok_or_else(|| BackendError::invalid(format!("{addr:#x} vanished")))
    }

    /// Sets the accessible flag of the regions starting at each of `starts`.
    pub(crate) fn set_accessible(&self, starts: &[u64]) {
        let mut regions = self.write_lock();
        for s in starts {
            if let Some(r) = regions.get_mut(s) {
                r.accessible = true;
            }
        }
    }

    /// Removes every region (at backend drop), returning them for the caller to drop.
    pub(crate) fn drain(&self) -> Vec<Region> {
        let mut regions = self.write_lock();
        std::mem::take(&mut *regions).into_values().collect()
    }

    /// Number of regions of `kind`.
    pub(crate) fn count(&self, kind: RegionKind) -> usize {
        self.read_lock().values().filter(|r| r.kind == kind).count()
    }

    /// Reads `len` bytes at `addr`.
    pub(crate) fn read(&self, addr: u64, len: u64) -> Result<Vec<u8>> {
        let ulen = usize_len(len)?;
        let regions = self.read_lock();
        covered(&regions, addr, len, false)?;
        // SAFETY: the range was validated under the read lock we hold, so it stays mapped
        // and readable until the guard drops.
        Ok(unsafe { os::read_raw(addr, ulen) })
    }

    /// Writes `data` at `addr`.
    pub(crate) fn write(&self, addr: u64, data: &[u8]) -> Result<()> {
        let regions = self.read_lock();
        covered(&regions, addr, data.len() as u64, true)?;
        // SAFETY: validated under the read lock we hold.
        unsafe { os::write_raw(addr, data) };
        Ok(())
    }

    /// Fills `len` bytes at `addr` with `value`.
    pub(crate) fn fill(&self, addr: u64, len: u64, value: u8) -> Result<()> {
        let ulen = usize_len(len)?;
        let regions = self.read_lock();
        covered(&regions, addr, len, true)?;
        // SAFETY: validated under the read lock we hold.
        unsafe { os::fill_raw(addr, value, ulen) };
        Ok(())
    }

    /// Copies `len` bytes from `src` to `dst`.
    pub(crate) fn copy(&self, dst: u64, src: u64, len: u64) -> Result<()> {
        let ulen = usize_len(len)?;
        let regions = self.read_lock();
        covered(&regions, dst, len, true)?;
        covered(&regions, src, len, false)?;
        // SAFETY: both ranges validated under the read lock we hold.
        unsafe { os::copy_raw(dst, src, ulen) };
        Ok(())
    }

    /// True when all `len` bytes at `addr` equal `value`.
    pub(crate) fn check(&self, addr: u64, len: u64, value: u8) -> Result<bool> {
        let ulen = usize_len(len)?;
        let regions = self.read_lock();
        covered(&regions, addr, len, false)?;
        // SAFETY: validated under the read lock we hold.
        Ok(unsafe { os::check_raw(addr, ulen, value) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn region(len: u64) -> Region {
        Region {
            len,
            kind: RegionKind::Vmm,
            device: None,
            accessible: true,
            read_only: false,
            _mapping: None,
            fd: None,
        }
    }

    #[test]
    fn coverage_spans_adjacent_regions_and_rejects_holes() {
        let mem = Memory::default();
        mem.insert(0x1000, region(0x1000)).unwrap();
        mem.insert(0x2000, region(0x1000)).unwrap();
        mem.insert(0x4000, region(0x1000)).unwrap();
        assert!(mem.validate(0x1800, 0x1000).is_ok());
        assert!(mem.validate(0x2800, 0x1000).is_err()); // crosses the hole at 0x3000
        assert!(mem.validate(0x800, 0x10).is_err());
        // Separate allocations side by side may not be crossed.
        let mut host = region(0x1000);
        host.kind = RegionKind::PinnedHost;
        mem.insert(0x5000, host).unwrap();
        assert!(mem.validate(0x4800, 0x1000).is_err());
        assert!(mem.validate(0x5000, 0x1000).is_ok());
        assert!(mem.validate(u64::MAX - 4, 8).is_err());
        assert!(mem.insert(0x2800, region(0x100)).is_err()); // overlap
        assert_eq!(mem.count(RegionKind::Vmm), 3);
    }
}
