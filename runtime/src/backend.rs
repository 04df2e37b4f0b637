//! The [`Backend`] trait: everything the allocators ask of a GPU runtime.
//!
//! It is object safe (`Arc<dyn Backend>`), `Send + Sync`, and speaks in plain handles
//! ([`crate::types`]). Every operation returns a typed [`BackendError`];
//! none panics on bad input. Three implementations exist: `SimBackend` (crate `gpualloc-sim`),
//! the simulated GPU every test runs; `AccountingBackend` (crate `gpualloc-accounting`),
//! addresses and byte counts only; and `CudaBackend` (crate `gpualloc-cuda`).
//!
//! Semantics follow CUDA's driver API, so code written against the sim behaves the same on
//! a GPU:
//! - `free` synchronizes the device before releasing memory (as `cuMemFree` does);
//! - an event that was never recorded queries as complete; `event_record` replaces what an
//!   event tracks; `stream_wait_event` waits for the record current at the time of the call;
//! - a host callback runs after all work enqueued on its stream before it;
//! - virtual memory follows the VMM API: reserve an address range, create physical
//!   memory, map it at a granularity-aligned offset, then set access before use.

use std::os::fd::OwnedFd;
use std::sync::{Arc, OnceLock};

use crate::capture::{CaptureMode, CaptureStatus, GraphExecHandle, GraphHandle};
use crate::error::{BackendError, Result};
use crate::types::{
    DeviceId, DevicePtr, EventHandle, HostFn, HostRegisterFlags, IpcMemHandle, MemInfo, PhysHandle,
    StreamHandle,
};

/// How a hot path learns that a device was lost ([`Backend::lost_watch`]).
#[derive(Debug, Clone)]
pub enum LostWatch {
    /// The backend never loses a device: nothing to check.
    Never,
    /// The backend's own record of the loss, shared: empty until the device is lost, then the
    /// error [`Backend::device_lost`] returns, for good. Checking it is one load.
    Cell(Arc<OnceLock<BackendError>>),
    /// Call [`Backend::device_lost`] at every check.
    Ask,
}

impl LostWatch {
    /// Whether `device` of `backend` is lost, by this watch (`backend` is asked only for
    /// [`LostWatch::Ask`]).
    #[inline]
    pub fn is_lost(&self, backend: &dyn Backend, device: DeviceId) -> bool {
        match self {
            LostWatch::Never => false,
            LostWatch::Cell(cell) => cell.get().is_some(),
            LostWatch::Ask => backend.device_lost(device).is_some(),
        }
    }
}

/// A GPU runtime, as the allocators see it. See the module docs for the semantics.
pub trait Backend: Send + Sync + 'static {
    /// Short name for logs: `"sim"` or `"cuda"`.
    fn name(&self) -> &'static str;

    /// The backend as `Any`, for callers that need its concrete type behind an
    /// `Arc<dyn Backend>` (e.g. the facade's cudarc interop finds the `CudaBackend`).
    fn as_any(&self) -> Option<&dyn std::any::Any> {
        None
    }

    // ---- devices and device memory ----

    /// Number of devices.
    fn device_count(&self) -> Result<u32>;
    /// Free and total memory of `device`.
    fn mem_info(&self, device: DeviceId) -> Result<MemInfo>;
    /// Total memory of `device`, without making the device ready for work: on CUDA it needs no
    /// context (`cuDeviceTotalMem`), so asking it of every device costs none of them a context
    /// (building an allocator does). Defaults to `mem_info`'s total.
    fn total_memory(&self, device: DeviceId) -> Result<u64> {
        self.mem_info(device).map(|m| m.total)
    }
    /// Device memory this process has in use on `device` (allocated through this backend and
    /// otherwise), where the backend can tell; `None` where it cannot (the driver API alone
    /// does not say per process: PyTorch asks NVML). For out-of-memory reports.
    fn process_used(&self, device: DeviceId) -> Result<Option<u64>> {
        let _ = device;
        Ok(None)
    }
    /// `Some(BackendError::DeviceLost)` once `device` is lost: it hit a sticky error (a
    /// faulting kernel) and can do no more work; every call on it fails with that error from
    /// then on. The allocator asks before each allocation, so it must be cheap (an atomic
    /// load). Defaults to `None` (backends whose devices cannot be lost: the sim).
    fn device_lost(&self, device: DeviceId) -> Option<crate::error::BackendError> {
        let _ = device;
        None
    }
    /// How a caller that checks `device` on every request (the allocator's cache hits) learns
    /// that it was lost without a call per check: [`LostWatch::Never`] (its devices cannot be
    /// lost), a [`LostWatch::Cell`] holding what [`Backend::device_lost`] returns, or
    /// [`LostWatch::Ask`]: call `device_lost` each time. The default, `Ask`, is right for any
    /// backend; a backend that overrides `device_lost` shares its cell to be cheaper, and
    /// one that never loses a device says `Never`.
    fn lost_watch(&self, device: DeviceId) -> LostWatch {
        let _ = device;
        LostWatch::Ask
    }
    /// The hooks this backend runs around every [`Backend::unmap`] and [`Backend::free`]
    /// ([`crate::release_hooks`]): how a registration cache outside the allocator (NCCL's
    /// user buffers) drops a range before its memory goes. `None` (the default): the backend
    /// has none, and the allocator's registration adapters refuse it with `NotSupported`.
    fn release_hooks(&self) -> Option<&crate::release_hooks::ReleaseHooks> {
        None
    }
    /// Allocates `size` bytes of device memory, synchronously (`cuMemAlloc`).
    fn malloc(&self, device: DeviceId, size: u64) -> Result<DevicePtr>;
    /// The allocation that contains `ptr` (from [`Backend::malloc`] or
    /// [`Backend::ipc_open_mem_handle`]): its base and size (`cuMemGetAddressRange`). An
    /// importer checks an offer's window against it. `NotSupported` where the backend has no
    /// such query.
    fn mem_address_range(&self, ptr: DevicePtr) -> Result<(DevicePtr, u64)> {
        let _ = ptr;
        Err(crate::error::BackendError::NotSupported(
            "mem_address_range".into(),
        ))
    }
    /// Lets work on `device` access memory allocated on `peer` (`cuCtxEnablePeerAccess` in
    /// `device`'s context; enabling it twice is not an error). Ordinary allocations are then
    /// reachable at once; virtual-memory mappings also need [`Backend::set_access`] for
    /// `device`, which the allocator grants (`Allocator::enable_peer_access`). Defaults to
    /// doing nothing (backends whose memory every device reaches).
    fn enable_peer_access(&self, device: DeviceId, peer: DeviceId) -> Result<()> {
        let _ = (device, peer);
        Ok(())
    }
    /// Frees memory from [`Backend::malloc`], after synchronizing the device: when it
    /// returns, no work queued before it on any stream of `device` still uses the memory. The
    /// cache's release path relies on this. (CUDA documents only that `cuMemFree` *may*
    /// synchronize; the CUDA backend synchronizes the context itself first.)
    fn free(&self, device: DeviceId, ptr: DevicePtr) -> Result<()>;
    /// Blocks until all work on all streams of `device` is done.
    fn device_synchronize(&self, device: DeviceId) -> Result<()>;

    // ---- streams ----

    /// Creates a stream on `device`.
    fn stream_create(&self, device: DeviceId) -> Result<StreamHandle>;
    /// Destroys a stream and returns at once (`cuStreamDestroy`): the work queued on it still
    /// runs, events recorded on it complete, and device-wide synchronizations wait for it;
    /// the handle is invalid from the call on.
    fn stream_destroy(&self, stream: StreamHandle) -> Result<()>;
    /// Blocks until all work queued on `stream` is done.
    fn stream_synchronize(&self, stream: StreamHandle) -> Result<()>;
    /// True when all work queued on `stream` so far is done (`cuStreamQuery`); never blocks.
    /// Defaults to `Ok(false)` for backends that cannot tell: callers then record an event.
    fn stream_query(&self, stream: StreamHandle) -> Result<bool> {
        let _ = stream;
        Ok(false)
    }
    /// Makes future work on `stream` wait until `event` (as last recorded) completes.
    fn stream_wait_event(&self, stream: StreamHandle, event: EventHandle) -> Result<()>;
    /// Streams of `stream`'s device, other than `stream`, with queued work not yet finished
    /// that touches `[ptr, ptr + len)` and that `stream` has not been made to wait for (by
    /// [`Backend::stream_wait_event`] on an event recorded after that work). `None` where the
    /// backend cannot tell (a real driver does not say what queued work touches). For the
    /// allocator's debug check of frees that race other streams (`debug_cross_stream_frees`).
    fn unordered_users(
        &self,
        stream: StreamHandle,
        ptr: DevicePtr,
        len: u64,
    ) -> Result<Option<Vec<StreamHandle>>> {
        let _ = (stream, ptr, len);
        Ok(None)
    }
    /// Enqueues `f` on `stream`; it runs on a backend thread after the work before it.
    fn launch_host_func(&self, stream: StreamHandle, f: HostFn) -> Result<()>;
    /// Copies `len` bytes from `src` to `dst` in stream order. Both are device or
    /// page-locked host addresses (unified addressing).
    ///
    /// # Safety
    /// On a GPU the copy writes and reads host memory by address, later, from the copy
    /// engine: nothing can check a host side. The caller guarantees that each side that is
    /// host memory is page-locked memory of this process (from [`Backend::host_alloc`] or
    /// registered with [`Backend::host_register`]), stays allocated and registered until the
    /// stream has passed the copy, and that nothing else reads `dst` or writes either range
    /// meanwhile. Device sides are checked by the backend (unknown device addresses are
    /// errors).
    ///
    /// Safe code cannot make such a copy (nor free or (un)register host memory) through the
    /// trait:
    /// ```compile_fail,E0133
    /// fn overwrite(b: &dyn gpualloc_runtime::Backend, s: gpualloc_runtime::StreamHandle) {
    ///     let _ = b.memcpy_async(s, 0x1000, 0x2000, 64);
    /// }
    /// ```
    unsafe fn memcpy_async(&self, stream: StreamHandle, dst: u64, src: u64, len: u64)
        -> Result<()>;
    /// Sets `len` bytes at `dst` to `value` in stream order.
    fn memset_async(&self, stream: StreamHandle, dst: DevicePtr, value: u8, len: u64)
        -> Result<()>;
    /// Copies host bytes into device memory and waits for the copy (stream-ordered).
    fn copy_to_device(&self, stream: StreamHandle, dst: DevicePtr, src: &[u8]) -> Result<()>;
    /// Copies device memory into host bytes and waits for the copy (stream-ordered).
    fn copy_from_device(&self, stream: StreamHandle, dst: &mut [u8], src: DevicePtr) -> Result<()>;

    // ---- events ----

    /// Creates an event on `device` (timing disabled).
    fn event_create(&self, device: DeviceId) -> Result<EventHandle>;
    /// Records `event` on `stream`; both must belong to the same device.
    fn event_record(&self, event: EventHandle, stream: StreamHandle) -> Result<()>;
    /// True when the event's last record has completed (or it was never recorded).
    fn event_query(&self, event: EventHandle) -> Result<bool>;
    /// Blocks until the event's last record has completed.
    fn event_synchronize(&self, event: EventHandle) -> Result<()>;
    /// Destroys an event; a pending record still completes for the streams waiting on it.
    fn event_destroy(&self, event: EventHandle) -> Result<()>;

    // ---- stream capture and graphs (see `crate::capture`) ----

    /// Begins capturing `stream` in `mode` (`cuStreamBeginCapture`): work enqueued on it (and
    /// on streams that wait on events recorded in it) is recorded into a graph, not run.
    /// A backend without graphs answers `NotSupported`.
    fn stream_begin_capture(&self, stream: StreamHandle, mode: CaptureMode) -> Result<()> {
        let _ = (stream, mode);
        Err(no_graphs(self.name()))
    }
    /// Ends the capture begun on `stream` and returns its graph (`cuStreamEndCapture`).
    fn stream_end_capture(&self, stream: StreamHandle) -> Result<GraphHandle> {
        let _ = stream;
        Err(no_graphs(self.name()))
    }
    /// Whether `stream` is capturing (`cuStreamGetCaptureInfo`). A backend without graphs
    /// never captures: `CaptureStatus::None`.
    fn stream_capture_status(&self, stream: StreamHandle) -> Result<CaptureStatus> {
        let _ = stream;
        Ok(CaptureStatus::None)
    }
    /// False when no stream capture can be under way in this process right now (a backend
    /// without graphs, or the sim with none begun): callers may then skip the capture-mode
    /// exchanges that guard their unsafe calls (`crate::capture_safe`). A driver cannot tell
    /// cheaply: the CUDA backend answers true.
    fn capture_may_be_underway(&self) -> bool {
        false
    }
    /// Sets the calling thread's capture mode and returns the one it replaces
    /// (`cuThreadExchangeStreamCaptureMode`). A backend without graphs has no modes to
    /// keep: it answers `Global`, every thread's default, and keeps nothing.
    fn exchange_capture_mode(&self, mode: CaptureMode) -> Result<CaptureMode> {
        let _ = mode;
        Ok(CaptureMode::Global)
    }
    /// Makes a captured graph runnable (`cuGraphInstantiate`).
    fn graph_instantiate(&self, graph: GraphHandle) -> Result<GraphExecHandle> {
        let _ = graph;
        Err(no_graphs(self.name()))
    }
    /// Enqueues the whole graph on `stream` as one unit of work (`cuGraphLaunch`).
    fn graph_launch(&self, exec: GraphExecHandle, stream: StreamHandle) -> Result<()> {
        let _ = (exec, stream);
        Err(no_graphs(self.name()))
    }
    /// Destroys a captured graph (`cuGraphDestroy`); its instantiations live on.
    fn graph_destroy(&self, graph: GraphHandle) -> Result<()> {
        let _ = graph;
        Err(no_graphs(self.name()))
    }
    /// Destroys an instantiated graph (`cuGraphExecDestroy`); launches already enqueued
    /// still run.
    fn graph_exec_destroy(&self, exec: GraphExecHandle) -> Result<()> {
        let _ = exec;
        Err(no_graphs(self.name()))
    }

    // ---- pinned and registered host memory ----

    /// Allocates `size` bytes of page-locked host memory (`cuMemHostAlloc`).
    fn host_alloc(&self, size: u64) -> Result<*mut u8>;
    /// Frees memory from [`Backend::host_alloc`].
    ///
    /// # Safety
    /// `ptr` came from this backend's `host_alloc` and is not freed yet, nothing refers to
    /// the memory any more (no reference, no copy queued that the streams have not passed):
    /// freeing unmaps it.
    unsafe fn host_free(&self, ptr: *mut u8) -> Result<()>;
    /// Page-locks existing host memory `[ptr, ptr + len)` (`cuMemHostRegister`), any byte
    /// range (the driver locks the pages it touches).
    ///
    /// # Safety
    /// The range is memory of this process that stays mapped until
    /// [`Backend::host_unregister`]: copies queued into a registered range write it by
    /// address.
    unsafe fn host_register(&self, ptr: *mut u8, len: u64, flags: HostRegisterFlags) -> Result<()>;
    /// Undoes [`Backend::host_register`] of the range starting at `ptr`.
    ///
    /// # Safety
    /// No copy queued on the range is still pending (the streams have passed them all).
    unsafe fn host_unregister(&self, ptr: *mut u8) -> Result<()>;

    // ---- virtual memory ----

    /// Granularity of physical allocations and mappings on `device` (2 MiB on current GPUs).
    fn vmm_granularity(&self, device: DeviceId) -> Result<u64>;
    /// Whether `device` has virtual memory (expandable segments can run on it), asked without
    /// making the device current: the allocator asks it of every device when it is built,
    /// and a CUDA context on a device nobody allocates on costs hundreds of MiB. Default:
    /// whether [`Backend::vmm_granularity`] answers.
    fn has_vmm(&self, device: DeviceId) -> bool {
        self.vmm_granularity(device).is_ok()
    }
    /// Reserves `size` bytes of device virtual address space aligned to `alignment`.
    fn va_reserve(&self, device: DeviceId, size: u64, alignment: u64) -> Result<DevicePtr>;
    /// Releases a reservation; nothing may still be mapped in it.
    fn va_free(&self, device: DeviceId, ptr: DevicePtr, size: u64) -> Result<()>;
    /// Creates `size` bytes (a multiple of the granularity) of physical memory on `device`.
    fn phys_create(&self, device: DeviceId, size: u64) -> Result<PhysHandle>;
    /// Releases physical memory; it lives on while a mapping of it remains.
    fn phys_release(&self, handle: PhysHandle) -> Result<()>;
    /// Maps `size` bytes of `handle` starting at `offset` at `ptr` inside a reservation. The
    /// CUDA driver maps from offset 0 only (its docs: the offset "currently must be zero") and
    /// the CUDA backend refuses any other; the sim and the accounting backend take any
    /// granular offset.
    fn map(&self, ptr: DevicePtr, size: u64, offset: u64, handle: PhysHandle) -> Result<()>;
    /// Unmaps `[ptr, ptr + size)`, which must be exactly mapped ranges.
    fn unmap(&self, ptr: DevicePtr, size: u64) -> Result<()>;
    /// Grants `device` read/write access to the mapped range `[ptr, ptr + size)`.
    fn set_access(&self, device: DeviceId, ptr: DevicePtr, size: u64) -> Result<()>;
    /// Exports physical memory as a POSIX file descriptor another process can import.
    fn phys_export_fd(&self, handle: PhysHandle) -> Result<OwnedFd>;
    /// Imports physical memory from an fd made by [`Backend::phys_export_fd`].
    fn phys_import_fd(&self, device: DeviceId, fd: OwnedFd) -> Result<PhysHandle>;

    // ---- legacy IPC ----

    /// A handle another process can open for the allocation containing `ptr` (the whole
    /// allocation from [`Backend::malloc`]; callers add their own offset, as PyTorch does).
    fn ipc_get_mem_handle(&self, ptr: DevicePtr) -> Result<IpcMemHandle>;
    /// Opens a handle made by another process; returns the allocation's base in this process.
    fn ipc_open_mem_handle(&self, device: DeviceId, handle: &IpcMemHandle) -> Result<DevicePtr>;
    /// Closes what [`Backend::ipc_open_mem_handle`] opened.
    fn ipc_close_mem_handle(&self, ptr: DevicePtr) -> Result<()>;
}

/// What a backend without stream capture and graphs answers to their calls.
fn no_graphs(backend: &str) -> crate::error::BackendError {
    crate::error::BackendError::NotSupported(format!(
        "stream capture and graphs on the {backend} backend"
    ))
}
