//! Virtual memory (`cuMemAddressReserve`, `cuMemCreate`, `cuMemMap`, `cuMemSetAccess`,
//! export/import as POSIX fds) and legacy IPC handles (`cuIpc*MemHandle`) of the CUDA backend.
//!
//! Physical memory is created exportable as a POSIX fd where the system allows it; where the
//! driver refuses that handle type it is created without one (export then fails with the
//! driver's typed error), so expandable segments still work in restricted containers.

use std::ffi::{c_int, c_void};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use cudarc::driver::sys;

use super::backend::{CudaBackend, IpcOpened};
use super::error::{drv, with_request};
use super::validate::{aligned, alloc_size, inside_phys, non_null, range, va_alignment};
use gpualloc_runtime::error::{BackendError, Result};
use gpualloc_runtime::types::{DeviceId, DevicePtr, IpcMemHandle, PhysHandle};

/// Allocation properties of pinned device memory on `device`.
fn alloc_prop(
    device: DeviceId,
    handle_type: sys::CUmemAllocationHandleType,
) -> sys::CUmemAllocationProp {
    sys::CUmemAllocationProp {
        type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes: handle_type,
        location: location(device),
        win32HandleMetaData: std::ptr::null_mut(),
        allocFlags: sys::CUmemAllocationProp_st__bindgen_ty_1 {
            compressionType: 0,
            gpuDirectRDMACapable: 0,
            usage: 0,
            reserved: [0; 4],
        },
    }
}

fn location(device: DeviceId) -> sys::CUmemLocation {
    sys::CUmemLocation {
        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        // Ordinals come from cuDeviceGetCount (a c_int) and are checked before use.
        id: device.0 as c_int,
    }
}

const POSIX_FD: sys::CUmemAllocationHandleType =
    sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
const NO_HANDLE: sys::CUmemAllocationHandleType =
    sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE;

/// `cuMemGetAllocationGranularity` (minimum) of memory on `device` with `handle_type`.
fn granularity_of(device: DeviceId, handle_type: sys::CUmemAllocationHandleType) -> Result<usize> {
    let prop = alloc_prop(device, handle_type);
    let mut g: usize = 0;
    drv("cuMemGetAllocationGranularity", || {
        // SAFETY: `g` is a valid out-pointer and `prop` a fully initialized property struct,
        // both alive for the call.
        unsafe {
            sys::cuMemGetAllocationGranularity(
                &mut g,
                &prop,
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
            )
        }
    })?;
    Ok(g)
}

impl CudaBackend {
    /// `CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED` of `device`: needs the
    /// driver initialized, no context (unlike the granularity query, which binds one).
    pub(crate) fn cu_has_vmm(&self, device: DeviceId) -> bool {
        if self.contexts.check(device).is_err() {
            return false;
        }
        let Ok(ordinal) = c_int::try_from(device.0) else {
            return false;
        };
        let mut supported: c_int = 0;
        let asked = drv("cuDeviceGetAttribute", || {
            // SAFETY: `supported` is a valid out-pointer for the call; the driver is
            // initialized (the backend exists) and `ordinal` was checked against the device
            // count.
            unsafe {
                sys::cuDeviceGetAttribute(
                    &mut supported,
                    sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                    ordinal,
                )
            }
        });
        asked.is_ok() && supported != 0
    }

    pub(crate) fn cu_granularity(&self, device: DeviceId) -> Result<u64> {
        let slot = (self.granularity.get(device.0 as usize))
            .ok_or(BackendError::InvalidDevice(device.0))?;
        if let Some(g) = slot.get() {
            return Ok(*g);
        }
        // cuMemGetAllocationGranularity names its device in the properties and needs no
        // context: asking retains none (a process that works on GPU k makes no context on the
        // others, and a device another process holds in EXCLUSIVE_PROCESS mode still answers).
        self.health.check(device)?;
        self.contexts.check(device)?;
        let g = match granularity_of(device, POSIX_FD) {
            Err(BackendError::NotSupported(_) | BackendError::InvalidValue(_)) => {
                granularity_of(device, NO_HANDLE)
            }
            other => other,
        }?;
        if g == 0 {
            return Err(BackendError::NotSupported(format!(
                "virtual memory on {device}"
            )));
        }
        let _ = slot.set(g as u64);
        Ok(g as u64)
    }

    pub(crate) fn cu_va_reserve(
        &self,
        device: DeviceId,
        size: u64,
        alignment: u64,
    ) -> Result<DevicePtr> {
        let bytes = alloc_size("va_reserve", size)?;
        let align = va_alignment("va_reserve", alignment)?;
        aligned("va_reserve", "size", size, self.cu_granularity(device)?)?;
        self.bind_device(device)?;
        let mut ptr: sys::CUdeviceptr = 0;
        drv("cuMemAddressReserve", || {
            // SAFETY: `ptr` is a valid out-pointer; size and alignment were validated; no
            // fixed address is requested.
            unsafe { sys::cuMemAddressReserve(&mut ptr, bytes, align, 0, 0) }
        })
        .map_err(|e| with_request(e, size, format!("virtual address space of {device}")))?;
        Ok(DevicePtr(ptr))
    }

    pub(crate) fn cu_va_free(&self, device: DeviceId, ptr: DevicePtr, size: u64) -> Result<()> {
        let bytes = alloc_size("va_free", size)?;
        range("va_free", ptr.0, size)?;
        self.bind_device(device)?;
        drv("cuMemAddressFree", || {
            // SAFETY: takes the range by value; the driver checks that it is exactly a
            // reservation (CUDA_ERROR_INVALID_VALUE otherwise).
            unsafe { sys::cuMemAddressFree(ptr.0, bytes) }
        })
    }

    fn create_phys(
        &self,
        device: DeviceId,
        bytes: usize,
        handle_type: sys::CUmemAllocationHandleType,
    ) -> Result<u64> {
        let prop = alloc_prop(device, handle_type);
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        drv("cuMemCreate", || {
            // SAFETY: `handle` is a valid out-pointer and `prop` a fully initialized property
            // struct; `bytes` is a non-zero multiple of the granularity (checked by callers).
            unsafe { sys::cuMemCreate(&mut handle, bytes, &prop, 0) }
        })?;
        Ok(handle)
    }

    pub(crate) fn cu_phys_create(&self, device: DeviceId, size: u64) -> Result<PhysHandle> {
        let bytes = alloc_size("phys_create", size)?;
        aligned("phys_create", "size", size, self.cu_granularity(device)?)?;
        self.bind_device(device)?;
        let raw = match self.create_phys(device, bytes, POSIX_FD) {
            Err(BackendError::NotSupported(_) | BackendError::InvalidValue(_)) => {
                tracing::debug!(%device, "POSIX-fd shareable memory refused; creating it unexportable");
                self.create_phys(device, bytes, NO_HANDLE)
            }
            other => other,
        }
        .map_err(|e| with_request(e, size, device.to_string()))?;
        Ok(PhysHandle { device, raw, size })
    }

    pub(crate) fn cu_phys_release(&self, handle: PhysHandle) -> Result<()> {
        self.contexts.check(handle.device)?;
        if handle.raw == 0 {
            return Err(BackendError::InvalidHandle(
                "phys_release: null handle".into(),
            ));
        }
        self.bind_device(handle.device)?;
        drv("cuMemRelease", || {
            // SAFETY: takes the handle by value; the driver validates it and keeps the memory
            // alive while mappings of it remain.
            unsafe { sys::cuMemRelease(handle.raw) }
        })
    }

    pub(crate) fn cu_map(
        &self,
        ptr: DevicePtr,
        size: u64,
        offset: u64,
        handle: PhysHandle,
    ) -> Result<()> {
        let bytes = alloc_size("map", size)?;
        let offset_usize =
            usize::try_from(offset).map_err(|_| BackendError::invalid("map: offset too large"))?;
        range("map", ptr.0, size)?;
        // Docs of cuMemMap: "offset - Offset into the memory represented by handle from
        // which to start mapping. Note: currently must be zero."
        if offset != 0 {
            return Err(BackendError::invalid(
                "map: the driver maps physical memory from offset 0 only",
            ));
        }
        if handle.raw == 0 {
            return Err(BackendError::InvalidHandle(
                "map: null physical handle".into(),
            ));
        }
        let g = self.cu_granularity(handle.device)?;
        aligned("map", "address", ptr.0, g)?;
        aligned("map", "size", size, g)?;
        aligned("map", "offset", offset, g)?;
        inside_phys("map", offset, size, handle.size)?;
        self.bind_device(handle.device)?;
        drv("cuMemMap", || {
            // SAFETY: all arguments are by value and validated above; the driver checks that
            // the range lies in a reservation and is not already mapped.
            unsafe { sys::cuMemMap(ptr.0, bytes, offset_usize, handle.raw, 0) }
        })
    }

    pub(crate) fn cu_unmap(&self, ptr: DevicePtr, size: u64) -> Result<()> {
        let bytes = alloc_size("unmap", size)?;
        range("unmap", ptr.0, size)?;
        let release = gpualloc_runtime::release_hooks::Release::Unmap { addr: ptr.0, size };
        self.release_hooks.around(release, || {
            self.bind_any()?;
            drv("cuMemUnmap", || {
                // SAFETY: by-value arguments; the driver checks the range is exactly mapped
                // (CUDA_ERROR_INVALID_VALUE otherwise). The caller has finished all work using
                // it, as the trait requires.
                unsafe { sys::cuMemUnmap(ptr.0, bytes) }
            })
        })
    }

    pub(crate) fn cu_set_access(&self, device: DeviceId, ptr: DevicePtr, size: u64) -> Result<()> {
        let bytes = alloc_size("set_access", size)?;
        range("set_access", ptr.0, size)?;
        self.bind_device(device)?;
        let desc = sys::CUmemAccessDesc {
            location: location(device),
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        drv("cuMemSetAccess", || {
            // SAFETY: `desc` is one fully initialized descriptor, alive for the call, and the
            // count passed is 1; the driver checks the range is mapped.
            unsafe { sys::cuMemSetAccess(ptr.0, bytes, &desc, 1) }
        })
    }

    pub(crate) fn cu_phys_export_fd(&self, handle: PhysHandle) -> Result<OwnedFd> {
        if handle.raw == 0 {
            return Err(BackendError::InvalidHandle(
                "phys_export_fd: null handle".into(),
            ));
        }
        self.bind_device(handle.device)?;
        let mut fd: c_int = -1;
        drv("cuMemExportToShareableHandle", || {
            // SAFETY: for POSIX_FILE_DESCRIPTOR the out-parameter is an `int`, and `fd` is a
            // valid, writable `c_int` for the call.
            unsafe {
                sys::cuMemExportToShareableHandle(
                    (&mut fd as *mut c_int).cast::<c_void>(),
                    handle.raw,
                    POSIX_FD,
                    0,
                )
            }
        })?;
        if fd < 0 {
            return Err(BackendError::Driver {
                code: -1,
                name: "cuMemExportToShareableHandle returned no fd".into(),
            });
        }
        // SAFETY: the driver just created `fd` for us; nothing else owns or closes it.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    pub(crate) fn cu_phys_import_fd(&self, device: DeviceId, fd: OwnedFd) -> Result<PhysHandle> {
        self.bind_device(device)?;
        let mut raw: sys::CUmemGenericAllocationHandle = 0;
        let os_handle = fd.as_raw_fd() as isize as *mut c_void;
        drv("cuMemImportFromShareableHandle", || {
            // SAFETY: `raw` is a valid out-pointer; for POSIX_FILE_DESCRIPTOR the OS handle is
            // the fd itself cast to a pointer (never dereferenced), and `fd` stays open for
            // the call. The driver rejects fds that are not exported memory.
            unsafe { sys::cuMemImportFromShareableHandle(&mut raw, os_handle, POSIX_FD) }
        })?;
        // The driver does not take ownership of the fd: close ours now.
        drop(fd);
        // The driver does not report an imported allocation's size: 0 means unknown.
        Ok(PhysHandle {
            device,
            raw,
            size: 0,
        })
    }

    /// The device whose memory `ptr` is (`CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL`).
    fn pointer_device(&self, op: &'static str, ptr: DevicePtr) -> Result<DeviceId> {
        non_null(op, ptr.0)?;
        self.bind_any()?;
        let mut ordinal: c_int = -1;
        drv("cuPointerGetAttribute", || {
            // SAFETY: DEVICE_ORDINAL writes one `int`, and `ordinal` is a valid, writable
            // `c_int`; the driver validates `ptr`.
            unsafe {
                sys::cuPointerGetAttribute(
                    (&mut ordinal as *mut c_int).cast::<c_void>(),
                    sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                    ptr.0,
                )
            }
        })?;
        let device = DeviceId(
            u32::try_from(ordinal)
                .map_err(|_| BackendError::invalid(format!("{op}: {ptr} is not device memory")))?,
        );
        self.contexts.check(device)?;
        Ok(device)
    }

    /// The handle of the allocation containing `ptr`: the driver takes the allocation's base
    /// pointer only ("a pointer to the base of an existing device memory allocation"), so
    /// the base is looked up first.
    pub(crate) fn cu_ipc_get_mem_handle(&self, ptr: DevicePtr) -> Result<IpcMemHandle> {
        let (base, _) = self.cu_mem_address_range(ptr)?;
        let mut h = sys::CUipcMemHandle { reserved: [0; 64] };
        drv("cuIpcGetMemHandle", || {
            // SAFETY: `h` is a valid, writable handle struct; `base` is the start of a live
            // allocation (the driver validates it too).
            unsafe { sys::cuIpcGetMemHandle(&mut h, base.0) }
        })?;
        Ok(IpcMemHandle(h.reserved.map(|b| b as u8)))
    }

    pub(crate) fn cu_ipc_open_mem_handle(
        &self,
        device: DeviceId,
        handle: &IpcMemHandle,
    ) -> Result<DevicePtr> {
        self.bind_device(device)?;
        let h = sys::CUipcMemHandle {
            reserved: handle.0.map(|b| b as std::ffi::c_char),
        };
        let mut ptr: sys::CUdeviceptr = 0;
        drv("cuIpcOpenMemHandle", || {
            // SAFETY: `ptr` is a valid out-pointer; the handle is passed by value and the
            // driver rejects bytes that are not a handle of a live allocation.
            unsafe {
                sys::cuIpcOpenMemHandle_v2(
                    &mut ptr,
                    h,
                    sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
                )
            }
        })?;
        // Its size, in the opening context (still current).
        let (mut base, mut size): (sys::CUdeviceptr, usize) = (0, 0);
        let ranged = drv("cuMemGetAddressRange", || {
            // SAFETY: both out-pointers are valid and writable; `ptr` was just opened.
            unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr) }
        });
        if let Err(e) = ranged {
            // Close what was opened; the import fails as a whole.
            let _ = drv("cuIpcCloseMemHandle", || {
                // SAFETY: by-value address opened above, in the current context.
                unsafe { sys::cuIpcCloseMemHandle(ptr) }
            });
            return Err(e);
        }
        // The driver counts opens of one handle in one context and returns the same pointer
        // each time: count them too, so that each import closes once.
        self.ipc_opened
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(ptr)
            .or_insert(IpcOpened {
                opener: device,
                size: size as u64,
                count: 0,
            })
            .count += 1;
        Ok(DevicePtr(ptr))
    }

    /// The legacy IPC mapping this backend opened that holds `ptr`, if any.
    fn ipc_opened_at(&self, ptr: DevicePtr) -> Option<(u64, IpcOpened)> {
        let opened = self.ipc_opened.lock().unwrap_or_else(|p| p.into_inner());
        let (base, o) = opened.range(..=ptr.0).next_back()?;
        (ptr.0 < base.saturating_add(o.size)).then_some((*base, *o))
    }

    pub(crate) fn cu_mem_address_range(&self, ptr: DevicePtr) -> Result<(DevicePtr, u64)> {
        // An opened IPC mapping's range was read when it was opened (in the context that
        // opened it): asking again would bind the pointer's own device, the exporter's, and
        // make this process a context there.
        if let Some((base, o)) = self.ipc_opened_at(ptr) {
            return Ok((DevicePtr(base), o.size));
        }
        let device = self.pointer_device("mem_address_range", ptr)?;
        self.bind_device(device)?;
        let (mut base, mut size): (sys::CUdeviceptr, usize) = (0, 0);
        drv("cuMemGetAddressRange", || {
            // SAFETY: both out-pointers are valid and writable for the call; the address is
            // passed by value and the driver rejects one outside every allocation.
            unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr.0) }
        })?;
        Ok((DevicePtr(base), size as u64))
    }

    /// Closes in the context that opened the handle (the pointer's device is the exporter's,
    /// which differs when it was opened on another GPU); one open is counted off only when
    /// the close succeeded, so a failed close can be retried.
    pub(crate) fn cu_ipc_close_mem_handle(&self, ptr: DevicePtr) -> Result<()> {
        non_null("ipc_close_mem_handle", ptr.0)?;
        let opener = self
            .ipc_opened
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&ptr.0)
            .map(|o| o.opener)
            .ok_or_else(|| {
                BackendError::invalid(format!(
                    "ipc_close_mem_handle: {ptr} was not opened by ipc_open_mem_handle"
                ))
            })?;
        self.bind_device(opener)?;
        drv("cuIpcCloseMemHandle", || {
            // SAFETY: by-value address; the driver checks it was opened by cuIpcOpenMemHandle,
            // and the context current here is the one that opened it.
            unsafe { sys::cuIpcCloseMemHandle(ptr.0) }
        })?;
        let mut opened = self.ipc_opened.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(o) = opened.get_mut(&ptr.0) {
            o.count -= 1;
            if o.count == 0 {
                opened.remove(&ptr.0);
            }
        }
        Ok(())
    }
}
