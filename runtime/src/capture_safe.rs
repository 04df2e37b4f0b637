//! [`CaptureSafe`]: a backend whose potentially unsafe calls never invalidate a user's stream
//! capture.
//!
//! While a stream capture is under way in global mode, the driver refuses a "potentially
//! unsafe" call (allocating, freeing or mapping memory, synchronizing, querying completion)
//! from *any* thread whose capture mode is not relaxed, and invalidates the capture (see
//! [`crate::capture`]). An allocator makes such calls from its own threads and from its
//! users' at any time, so it would break captures it knows nothing of. PyTorch puts the
//! thread in relaxed mode around its `cudaMalloc` for that reason; this wrapper does it
//! around every such call the allocators make, and restores the thread's mode after it.
//!
//! What stays the allocators' own care: not recording or querying events on a capturing
//! stream (relaxed mode does not allow those), which the device core defers until the
//! capture ends.
//!
//! When the backend says no capture can be under way ([`Backend::capture_may_be_underway`]:
//! no capture support, or none begun), the calls go straight through: no mode exchange.

use std::os::fd::OwnedFd;
use std::sync::Arc;

use crate::backend::Backend;
use crate::capture::{CaptureMode, CaptureStatus, GraphExecHandle, GraphHandle};
use crate::error::Result;
use crate::release_hooks::ReleaseHooks;
use crate::types::{
    DeviceId, DevicePtr, EventHandle, HostFn, HostRegisterFlags, IpcMemHandle, MemInfo, PhysHandle,
    StreamHandle,
};

/// `inner`, with its potentially unsafe calls made in relaxed capture mode (module docs).
#[derive(Clone)]
pub struct CaptureSafe {
    inner: Arc<dyn Backend>,
}

impl std::fmt::Debug for CaptureSafe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CaptureSafe")
            .field("backend", &self.inner.name())
            .finish()
    }
}

impl CaptureSafe {
    /// Wraps `inner`.
    pub fn new(inner: Arc<dyn Backend>) -> Self {
        CaptureSafe { inner }
    }

    /// The wrapped backend.
    pub fn inner(&self) -> &Arc<dyn Backend> {
        &self.inner
    }

    /// Runs `call` with the thread in relaxed capture mode, then puts its mode back.
    fn relaxed<T>(&self, call: impl FnOnce(&dyn Backend) -> Result<T>) -> Result<T> {
        if !self.inner.capture_may_be_underway() {
            return call(self.inner.as_ref());
        }
        let before = self.inner.exchange_capture_mode(CaptureMode::Relaxed);
        let result = call(self.inner.as_ref());
        if let Ok(mode) = before {
            if mode != CaptureMode::Relaxed {
                if let Err(e) = self.inner.exchange_capture_mode(mode) {
                    tracing::warn!(error = %e, "restoring the thread's capture mode failed");
                }
            }
        }
        result
    }
}

impl Backend for CaptureSafe {
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn as_any(&self) -> Option<&dyn std::any::Any> {
        self.inner.as_any()
    }
    fn device_count(&self) -> Result<u32> {
        self.inner.device_count()
    }
    fn mem_info(&self, device: DeviceId) -> Result<MemInfo> {
        self.inner.mem_info(device)
    }
    fn total_memory(&self, device: DeviceId) -> Result<u64> {
        self.inner.total_memory(device)
    }
    fn process_used(&self, device: DeviceId) -> Result<Option<u64>> {
        self.inner.process_used(device)
    }
    fn device_lost(&self, device: DeviceId) -> Option<crate::error::BackendError> {
        self.inner.device_lost(device)
    }
    fn lost_watch(&self, device: DeviceId) -> crate::backend::LostWatch {
        self.inner.lost_watch(device)
    }
    fn release_hooks(&self) -> Option<&ReleaseHooks> {
        self.inner.release_hooks()
    }
    fn malloc(&self, device: DeviceId, size: u64) -> Result<DevicePtr> {
        self.relaxed(|b| b.malloc(device, size))
    }
    fn mem_address_range(&self, ptr: DevicePtr) -> Result<(DevicePtr, u64)> {
        self.inner.mem_address_range(ptr)
    }
    fn enable_peer_access(&self, device: DeviceId, peer: DeviceId) -> Result<()> {
        self.inner.enable_peer_access(device, peer)
    }
    fn free(&self, device: DeviceId, ptr: DevicePtr) -> Result<()> {
        self.relaxed(|b| b.free(device, ptr))
    }
    fn device_synchronize(&self, device: DeviceId) -> Result<()> {
        self.relaxed(|b| b.device_synchronize(device))
    }
    fn stream_create(&self, device: DeviceId) -> Result<StreamHandle> {
        self.inner.stream_create(device)
    }
    fn stream_destroy(&self, stream: StreamHandle) -> Result<()> {
        self.inner.stream_destroy(stream)
    }
    fn stream_synchronize(&self, stream: StreamHandle) -> Result<()> {
        self.relaxed(|b| b.stream_synchronize(stream))
    }
    fn stream_query(&self, stream: StreamHandle) -> Result<bool> {
        self.relaxed(|b| b.stream_query(stream))
    }
    fn stream_wait_event(&self, stream: StreamHandle, event: EventHandle) -> Result<()> {
        self.inner.stream_wait_event(stream, event)
    }
    fn unordered_users(
        &self,
        stream: StreamHandle,
        ptr: DevicePtr,
        len: u64,
    ) -> Result<Option<Vec<StreamHandle>>> {
        self.inner.unordered_users(stream, ptr, len)
    }
    fn launch_host_func(&self, stream: StreamHandle, f: HostFn) -> Result<()> {
        self.inner.launch_host_func(stream, f)
    }
    unsafe fn memcpy_async(
        &self,
        stream: StreamHandle,
        dst: u64,
        src: u64,
        len: u64,
    ) -> Result<()> {
        // SAFETY: forwarded with the caller's guarantee.
        unsafe { self.inner.memcpy_async(stream, dst, src, len) }
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
        self.relaxed(|b| b.copy_to_device(stream, dst, src))
    }
    fn copy_from_device(&self, stream: StreamHandle, dst: &mut [u8], src: DevicePtr) -> Result<()> {
        self.relaxed(|b| b.copy_from_device(stream, dst, src))
    }
    fn event_create(&self, device: DeviceId) -> Result<EventHandle> {
        self.inner.event_create(device)
    }
    fn event_record(&self, event: EventHandle, stream: StreamHandle) -> Result<()> {
        self.inner.event_record(event, stream)
    }
    fn event_query(&self, event: EventHandle) -> Result<bool> {
        self.relaxed(|b| b.event_query(event))
    }
    fn event_synchronize(&self, event: EventHandle) -> Result<()> {
        self.relaxed(|b| b.event_synchronize(event))
    }
    fn event_destroy(&self, event: EventHandle) -> Result<()> {
        self.inner.event_destroy(event)
    }
    fn stream_begin_capture(&self, stream: StreamHandle, mode: CaptureMode) -> Result<()> {
        self.inner.stream_begin_capture(stream, mode)
    }
    fn stream_end_capture(&self, stream: StreamHandle) -> Result<GraphHandle> {
        self.inner.stream_end_capture(stream)
    }
    fn stream_capture_status(&self, stream: StreamHandle) -> Result<CaptureStatus> {
        self.inner.stream_capture_status(stream)
    }
    fn capture_may_be_underway(&self) -> bool {
        self.inner.capture_may_be_underway()
    }
    fn exchange_capture_mode(&self, mode: CaptureMode) -> Result<CaptureMode> {
        self.inner.exchange_capture_mode(mode)
    }
    fn graph_instantiate(&self, graph: GraphHandle) -> Result<GraphExecHandle> {
        self.inner.graph_instantiate(graph)
    }
    fn graph_launch(&self, exec: GraphExecHandle, stream: StreamHandle) -> Result<()> {
        self.inner.graph_launch(exec, stream)
    }
    fn graph_destroy(&self, graph: GraphHandle) -> Result<()> {
        self.inner.graph_destroy(graph)
    }
    fn graph_exec_destroy(&self, exec: GraphExecHandle) -> Result<()> {
        self.inner.graph_exec_destroy(exec)
    }
    fn host_alloc(&self, size: u64) -> Result<*mut u8> {
        self.relaxed(|b| b.host_alloc(size))
    }
    unsafe fn host_free(&self, ptr: *mut u8) -> Result<()> {
        // SAFETY: forwarded with the caller's guarantee.
        self.relaxed(|b| unsafe { b.host_free(ptr) })
    }
    unsafe fn host_register(&self, ptr: *mut u8, len: u64, flags: HostRegisterFlags) -> Result<()> {
        // SAFETY: forwarded with the caller's guarantee.
        self.relaxed(|b| unsafe { b.host_register(ptr, len, flags) })
    }
    unsafe fn host_unregister(&self, ptr: *mut u8) -> Result<()> {
        // SAFETY: forwarded with the caller's guarantee.
        self.relaxed(|b| unsafe { b.host_unregister(ptr) })
    }
    fn vmm_granularity(&self, device: DeviceId) -> Result<u64> {
        self.inner.vmm_granularity(device)
    }
    fn has_vmm(&self, device: DeviceId) -> bool {
        self.inner.has_vmm(device)
    }
    fn va_reserve(&self, device: DeviceId, size: u64, alignment: u64) -> Result<DevicePtr> {
        self.relaxed(|b| b.va_reserve(device, size, alignment))
    }
    fn va_free(&self, device: DeviceId, ptr: DevicePtr, size: u64) -> Result<()> {
        self.relaxed(|b| b.va_free(device, ptr, size))
    }
    fn phys_create(&self, device: DeviceId, size: u64) -> Result<PhysHandle> {
        self.relaxed(|b| b.phys_create(device, size))
    }
    fn phys_release(&self, handle: PhysHandle) -> Result<()> {
        self.relaxed(|b| b.phys_release(handle))
    }
    fn map(&self, ptr: DevicePtr, size: u64, offset: u64, handle: PhysHandle) -> Result<()> {
        self.relaxed(|b| b.map(ptr, size, offset, handle))
    }
    fn unmap(&self, ptr: DevicePtr, size: u64) -> Result<()> {
        self.relaxed(|b| b.unmap(ptr, size))
    }
    fn set_access(&self, device: DeviceId, ptr: DevicePtr, size: u64) -> Result<()> {
        self.relaxed(|b| b.set_access(device, ptr, size))
    }
    fn phys_export_fd(&self, handle: PhysHandle) -> Result<OwnedFd> {
        self.inner.phys_export_fd(handle)
    }
    fn phys_import_fd(&self, device: DeviceId, fd: OwnedFd) -> Result<PhysHandle> {
        self.relaxed(|b| b.phys_import_fd(device, fd))
    }
    fn ipc_get_mem_handle(&self, ptr: DevicePtr) -> Result<IpcMemHandle> {
        self.inner.ipc_get_mem_handle(ptr)
    }
    fn ipc_open_mem_handle(&self, device: DeviceId, handle: &IpcMemHandle) -> Result<DevicePtr> {
        self.relaxed(|b| b.ipc_open_mem_handle(device, handle))
    }
    fn ipc_close_mem_handle(&self, ptr: DevicePtr) -> Result<()> {
        self.relaxed(|b| b.ipc_close_mem_handle(ptr))
    }
}
