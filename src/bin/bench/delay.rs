//! A backend that delegates to another and makes device mallocs slow (sleeping), to bench
//! what a slow driver call does to the requests queued behind it.

use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::Duration;

use gpualloc::runtime::types::{
    EventHandle, HostFn, HostRegisterFlags, IpcMemHandle, MemInfo, PhysHandle, StreamHandle,
};
use gpualloc::runtime::Result;
use gpualloc::{Backend, DeviceId, DevicePtr};

/// Delegates to `inner`; `malloc` on the chosen devices first sleeps `malloc_delay`.
pub struct DelayBackend {
    pub inner: Arc<dyn Backend>,
    pub malloc_delay: Duration,
    /// Devices whose mallocs are slow (None: all).
    pub only: Option<DeviceId>,
}

impl DelayBackend {
    fn delayed(&self, device: DeviceId) -> bool {
        match self.only {
            None => true,
            Some(d) => d == device,
        }
    }
}

impl Backend for DelayBackend {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn device_count(&self) -> Result<u32> {
        self.inner.device_count()
    }

    fn mem_info(&self, device: DeviceId) -> Result<MemInfo> {
        self.inner.mem_info(device)
    }

    fn malloc(&self, device: DeviceId, size: u64) -> Result<DevicePtr> {
        if self.delayed(device) {
            std::thread::sleep(self.malloc_delay);
        }
        self.inner.malloc(device, size)
    }

    fn free(&self, device: DeviceId, ptr: DevicePtr) -> Result<()> {
        self.inner.free(device, ptr)
    }

    fn device_synchronize(&self, device: DeviceId) -> Result<()> {
        self.inner.device_synchronize(device)
    }

    fn stream_create(&self, device: DeviceId) -> Result<StreamHandle> {
        self.inner.stream_create(device)
    }

    fn stream_destroy(&self, stream: StreamHandle) -> Result<()> {
        self.inner.stream_destroy(stream)
    }

    fn stream_synchronize(&self, stream: StreamHandle) -> Result<()> {
        self.inner.stream_synchronize(stream)
    }

    fn stream_wait_event(&self, stream: StreamHandle, event: EventHandle) -> Result<()> {
        self.inner.stream_wait_event(stream, event)
    }

    fn launch_host_func(&self, stream: StreamHandle, f: HostFn) -> Result<()> {
        self.inner.launch_host_func(stream, f)
    }

    fn memcpy_async(&self, stream: StreamHandle, dst: u64, src: u64, len: u64) -> Result<()> {
        self.inner.memcpy_async(stream, dst, src, len)
    }

    fn memset_async(
        &self,
        stream: StreamHandle,
        dst: DevicePtr,
        value: u8,
        len: u64,
    ) -> Result<()> {
        self.inner.memset_async(stream, dst, value, len)
    }

    fn copy_to_device(&self, stream: StreamHandle, dst: DevicePtr, src: &[u8]) -> Result<()> {
        self.inner.copy_to_device(stream, dst, src)
    }

    fn copy_from_device(&self, stream: StreamHandle, dst: &mut [u8], src: DevicePtr) -> Result<()> {
        self.inner.copy_from_device(stream, dst, src)
    }

    fn event_create(&self, device: DeviceId) -> Result<EventHandle> {
        self.inner.event_create(device)
    }

    fn event_record(&self, event: EventHandle, stream: StreamHandle) -> Result<()> {
        self.inner.event_record(event, stream)
    }

    fn event_query(&self, event: EventHandle) -> Result<bool> {
        self.inner.event_query(event)
    }

    fn event_synchronize(&self, event: EventHandle) -> Result<()> {
        self.inner.event_synchronize(event)
    }

    fn event_destroy(&self, event: EventHandle) -> Result<()> {
        self.inner.event_destroy(event)
    }

    fn host_alloc(&self, size: u64) -> Result<*mut u8> {
        self.inner.host_alloc(size)
    }

    fn host_free(&self, ptr: *mut u8) -> Result<()> {
        self.inner.host_free(ptr)
    }

    fn host_register(&self, ptr: *mut u8, len: u64, flags: HostRegisterFlags) -> Result<()> {
        self.inner.host_register(ptr, len, flags)
    }

    fn host_unregister(&self, ptr: *mut u8) -> Result<()> {
        self.inner.host_unregister(ptr)
    }

    fn vmm_granularity(&self, device: DeviceId) -> Result<u64> {
        self.inner.vmm_granularity(device)
    }

    fn va_reserve(&self, device: DeviceId, size: u64, alignment: u64) -> Result<DevicePtr> {
        self.inner.va_reserve(device, size, alignment)
    }

    fn va_free(&self, device: DeviceId, ptr: DevicePtr, size: u64) -> Result<()> {
        self.inner.va_free(device, ptr, size)
    }

    fn phys_create(&self, device: DeviceId, size: u64) -> Result<PhysHandle> {
        self.inner.phys_create(device, size)
    }

    fn phys_release(&self, handle: PhysHandle) -> Result<()> {
        self.inner.phys_release(handle)
    }

    fn map(&self, ptr: DevicePtr, size: u64, offset: u64, handle: PhysHandle) -> Result<()> {
        self.inner.map(ptr, size, offset, handle)
    }

    fn unmap(&self, ptr: DevicePtr, size: u64) -> Result<()> {
        self.inner.unmap(ptr, size)
    }

    fn set_access(&self, device: DeviceId, ptr: DevicePtr, size: u64) -> Result<()> {
        self.inner.set_access(device, ptr, size)
    }

    fn phys_export_fd(&self, handle: PhysHandle) -> Result<OwnedFd> {
        self.inner.phys_export_fd(handle)
    }

    fn phys_import_fd(&self, device: DeviceId, fd: OwnedFd) -> Result<PhysHandle> {
        self.inner.phys_import_fd(device, fd)
    }

    fn ipc_get_mem_handle(&self, ptr: DevicePtr) -> Result<IpcMemHandle> {
        self.inner.ipc_get_mem_handle(ptr)
    }

    fn ipc_open_mem_handle(&self, device: DeviceId, handle: &IpcMemHandle) -> Result<DevicePtr> {
        self.inner.ipc_open_mem_handle(device, handle)
    }

    fn ipc_close_mem_handle(&self, ptr: DevicePtr) -> Result<()> {
        self.inner.ipc_close_mem_handle(ptr)
    }
}
