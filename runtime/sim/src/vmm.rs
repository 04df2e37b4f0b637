//! The sim's virtual memory: reservations of real address space, memfd physical handles,
//! `MAP_FIXED` mappings, access via `mprotect`, fd export/import.

use std::collections::{BTreeMap, HashMap};
use std::os::fd::{AsFd, OwnedFd};

use crate::memory::{Region, RegionKind};
use crate::os::{self, Mapping};
use crate::{latency, lock, SimBackend};
use gpualloc_runtime::error::{BackendError, Result};
use gpualloc_runtime::types::{DeviceId, DevicePtr, PhysHandle};

/// One mapping inside a reservation.
#[derive(Debug)]
struct Mapped {
    len: u64,
    phys: u64,
}

/// A reserved VA range and what is mapped in it.
#[derive(Debug)]
struct Reservation {
    device: DeviceId,
    va: Mapping,
    mapped: BTreeMap<u64, Mapped>,
}

/// A physical allocation.
#[derive(Debug)]
struct Phys {
    device: DeviceId,
    size: u64,
    fd: OwnedFd,
    /// `phys_release` has been called: it lives only while mapped.
    released: bool,
    /// Live mappings of it.
    maps: u64,
    /// Imported from an fd: its bytes are counted where it was created, not here.
    imported: bool,
}

/// Reservations and physical handles.
#[derive(Debug, Default)]
pub(crate) struct VmmState {
    reservations: BTreeMap<u64, Reservation>,
    phys: HashMap<u64, Phys>,
}

impl VmmState {
    /// Drops everything (backend shutdown): unmaps reservations, closes memfds.
    pub(crate) fn clear(&mut self) {
        self.reservations.clear();
        self.phys.clear();
    }

    /// The reservation containing `[ptr, ptr + size)`.
    fn reservation_of(&self, ptr: u64, size: u64) -> Result<(u64, &Reservation)> {
        let end = ptr
            .checked_add(size)
            .ok_or_else(|| BackendError::invalid("range overflows"))?;
        match self.reservations.range(..=ptr).next_back() {
            Some((start, r)) if end <= start + r.va.len() => Ok((*start, r)),
            _ => Err(BackendError::invalid(format!(
                "range {ptr:#x}+{size:#x} is not inside one VA reservation"
            ))),
        }
    }

    /// The starts of the mappings exactly tiling `[ptr, ptr + size)`, or `InvalidValue`.
    fn exact_mappings(&self, ptr: u64, size: u64) -> Result<(u64, Vec<u64>)> {
        let (rstart, r) = self.reservation_of(ptr, size)?;
        let end = ptr + size;
        let mut cur = ptr;
        let mut starts = Vec::new();
        for (start, m) in r.mapped.range(ptr..end) {
            if *start != cur {
                break;
            }
            starts.push(*start);
            cur = start + m.len;
        }
        if size == 0 || cur != end {
            return Err(BackendError::invalid(format!(
                "range {ptr:#x}+{size:#x} is not exactly a set of mapped ranges"
            )));
        }
        Ok((rstart, starts))
    }
}

impl SimBackend {
    fn check_granular(&self, what: &str, v: u64) -> Result<()> {
        if v % self.config.granularity != 0 {
            return Err(BackendError::invalid(format!(
                "{what} {v:#x} is not a multiple of the granularity {:#x}",
                self.config.granularity
            )));
        }
        Ok(())
    }

    pub(crate) fn vmm_reserve(
        &self,
        device: DeviceId,
        size: u64,
        alignment: u64,
    ) -> Result<DevicePtr> {
        self.check_device(device)?;
        if size == 0 {
            return Err(BackendError::invalid("va_reserve of 0 bytes"));
        }
        self.check_granular("reservation size", size)?;
        let align = if alignment == 0 {
            self.config.granularity
        } else {
            alignment
        };
        if !align.is_power_of_two() {
            return Err(BackendError::invalid(format!(
                "alignment {align:#x} is not a power of two"
            )));
        }
        let va = Mapping::reserve(size, align.max(self.page))?;
        let addr = va.addr();
        lock(&self.vmm).reservations.insert(
            addr,
            Reservation {
                device,
                va,
                mapped: BTreeMap::new(),
            },
        );
        latency::pay(self.latency().va);
        Ok(DevicePtr(addr))
    }

    pub(crate) fn vmm_va_free(&self, device: DeviceId, ptr: DevicePtr, size: u64) -> Result<()> {
        self.check_device(device)?;
        let removed = {
            let mut vmm = lock(&self.vmm);
            match vmm.reservations.get(&ptr.0) {
                Some(r) if r.device == device && r.va.len() == size => {
                    if !r.mapped.is_empty() {
                        return Err(BackendError::invalid(format!(
                            "va_free of {ptr} with {} live mapping(s)",
                            r.mapped.len()
                        )));
                    }
                }
                _ => {
                    return Err(BackendError::invalid(format!(
                        "{ptr}+{size:#x} is not a reservation of {device}"
                    )))
                }
            }
            vmm.reservations.remove(&ptr.0)
        };
        drop(removed);
        latency::pay(self.latency().va);
        Ok(())
    }

    pub(crate) fn vmm_phys_create(&self, device: DeviceId, size: u64) -> Result<PhysHandle> {
        self.check_device(device)?;
        if size == 0 {
            return Err(BackendError::invalid("phys_create of 0 bytes"));
        }
        self.check_granular("physical size", size)?;
        self.take_capacity(device, size)?;
        let fd = match os::memfd(size, &device.to_string()) {
            Ok(fd) => fd,
            Err(e) => {
                self.give_capacity(device, size);
                return Err(e);
            }
        };
        latency::pay(self.latency().phys);
        Ok(self.insert_phys(device, size, fd, false))
    }

    /// Records a new physical handle over `fd`.
    fn insert_phys(&self, device: DeviceId, size: u64, fd: OwnedFd, imported: bool) -> PhysHandle {
        let raw = self.next_id();
        let phys = Phys {
            device,
            size,
            fd,
            released: false,
            maps: 0,
            imported,
        };
        lock(&self.vmm).phys.insert(raw, phys);
        PhysHandle { device, raw, size }
    }

    /// Removes `raw` if it is released and unmapped; returns the bytes to give back.
    fn reap_phys(&self, vmm: &mut VmmState, raw: u64) -> Option<(DeviceId, u64)> {
        let p = vmm.phys.get(&raw)?;
        if !(p.released && p.maps == 0) {
            return None;
        }
        let p = vmm.phys.remove(&raw)?;
        (!p.imported).then_some((p.device, p.size))
    }

    pub(crate) fn vmm_phys_release(&self, handle: PhysHandle) -> Result<()> {
        let freed = {
            let mut vmm = lock(&self.vmm);
            match vmm.phys.get_mut(&handle.raw) {
                Some(p) if !p.released && p.device == handle.device => p.released = true,
                _ => return Err(BackendError::InvalidHandle(format!("unknown {handle:?}"))),
            }
            self.reap_phys(&mut vmm, handle.raw)
        };
        if let Some((device, bytes)) = freed {
            self.give_capacity(device, bytes);
        }
        latency::pay(self.latency().phys);
        Ok(())
    }

    pub(crate) fn vmm_map(
        &self,
        ptr: DevicePtr,
        size: u64,
        offset: u64,
        handle: PhysHandle,
    ) -> Result<()> {
        if size == 0 {
            return Err(BackendError::invalid("map of 0 bytes"));
        }
        self.check_granular("map address", ptr.0)?;
        self.check_granular("map size", size)?;
        self.check_granular("map offset", offset)?;
        let mut vmm = lock(&self.vmm);
        let (phys_size, device) = match vmm.phys.get(&handle.raw) {
            Some(p) if !p.released && p.device == handle.device => (p.size, p.device),
            _ => return Err(BackendError::InvalidHandle(format!("unknown {handle:?}"))),
        };
        match offset.checked_add(size) {
            Some(end) if end <= phys_size => {}
            _ => {
                return Err(BackendError::invalid(format!(
                    "offset {offset:#x} + size {size:#x} exceeds the physical size {phys_size:#x}"
                )))
            }
        }
        let (rstart, r) = vmm.reservation_of(ptr.0, size)?;
        if let Some((s, m)) = r.mapped.range(..ptr.0 + size).next_back() {
            if s + m.len > ptr.0 {
                return Err(BackendError::invalid(format!(
                    "{ptr}+{size:#x} overlaps the mapping at {s:#x}"
                )));
            }
        }
        let fd = match vmm.phys.get(&handle.raw) {
            Some(p) => p.fd.as_fd(),
            None => return Err(BackendError::InvalidHandle(format!("unknown {handle:?}"))),
        };
        r.va.map_fixed(ptr.0, size, fd, offset)?;
        let region = Region {
            len: size,
            kind: RegionKind::Vmm,
            device: Some(device),
            accessible: false,
            read_only: false,
            _mapping: None,
            fd: None,
        };
        if let Err(e) = self.mem.insert(ptr.0, region) {
            // Cannot happen (the range was reserved and unmapped); undo the mapping anyway.
            let _ = r.va.reset_none(ptr.0, size);
            return Err(e);
        }
        if let Some(r) = vmm.reservations.get_mut(&rstart) {
            r.mapped.insert(
                ptr.0,
                Mapped {
                    len: size,
                    phys: handle.raw,
                },
            );
        }
        if let Some(p) = vmm.phys.get_mut(&handle.raw) {
            p.maps += 1;
        }
        drop(vmm);
        latency::pay(self.latency().map);
        Ok(())
    }

    pub(crate) fn vmm_set_access(&self, device: DeviceId, ptr: DevicePtr, size: u64) -> Result<()> {
        self.check_device(device)?;
        let vmm = lock(&self.vmm);
        let (rstart, starts) = vmm.exact_mappings(ptr.0, size)?;
        let r = vmm
            .reservations
            .get(&rstart)
            .ok_or_else(|| BackendError::invalid("reservation vanished"))?;
        r.va.protect_rw(ptr.0, size)?;
        self.mem.set_accessible(&starts);
        drop(vmm);
        latency::pay(self.latency().set_access);
        Ok(())
    }

    pub(crate) fn vmm_unmap(&self, ptr: DevicePtr, size: u64) -> Result<()> {
        let mut freed = Vec::new();
        {
            let mut vmm = lock(&self.vmm);
            let (rstart, starts) = vmm.exact_mappings(ptr.0, size)?;
            // Remove the regions first (write lock): no access can be in progress after this.
            let removed: Vec<Region> = {
                let mut regions = self.mem.write_lock();
                starts.iter().filter_map(|s| regions.remove(s)).collect()
            };
            drop(removed);
            let mut physes = Vec::new();
            if let Some(r) = vmm.reservations.get_mut(&rstart) {
                for s in &starts {
                    if let Some(m) = r.mapped.remove(s) {
                        physes.push(m.phys);
                    }
                }
                r.va.reset_none(ptr.0, size)?;
            }
            for raw in physes {
                if let Some(p) = vmm.phys.get_mut(&raw) {
                    p.maps = p.maps.saturating_sub(1);
                }
                if let Some(f) = self.reap_phys(&mut vmm, raw) {
                    freed.push(f);
                }
            }
        }
        for (device, bytes) in freed {
            self.give_capacity(device, bytes);
        }
        latency::pay(self.latency().map);
        Ok(())
    }

    pub(crate) fn vmm_export(&self, handle: PhysHandle) -> Result<OwnedFd> {
        let vmm = lock(&self.vmm);
        let fd = match vmm.phys.get(&handle.raw) {
            Some(p) if !p.released && p.device == handle.device => p.fd.as_fd(),
            _ => return Err(BackendError::InvalidHandle(format!("unknown {handle:?}"))),
        };
        let dup = fd
            .try_clone_to_owned()
            .map_err(|e| BackendError::os("dup", e))?;
        drop(vmm);
        latency::pay(self.latency().ipc);
        Ok(dup)
    }

    pub(crate) fn vmm_import(&self, device: DeviceId, fd: OwnedFd) -> Result<PhysHandle> {
        self.check_device(device)?;
        let size = os::memory_file_size(&fd)?;
        if size == 0 {
            return Err(BackendError::invalid("imported memory handle is empty"));
        }
        self.check_granular("imported size", size)?;
        latency::pay(self.latency().ipc);
        Ok(self.insert_phys(device, size, fd, true))
    }

    /// Live reservations (for leak checks in tests).
    pub fn live_reservations(&self) -> usize {
        lock(&self.vmm).reservations.len()
    }

    /// Live physical handles, released-but-mapped ones included.
    pub fn live_phys(&self) -> usize {
        lock(&self.vmm).phys.len()
    }
}
