//! [`CudaBackend`]: construction (driver and device discovery, never a panic) and the
//! [`Backend`] impl, which delegates to the per-concern files (`memory`, `streams`, `vmm`).

use std::ffi::{c_int, c_void};
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use cudarc::driver::safe::CudaStream;
use cudarc::driver::sys::{self, CUresult};

use super::context::{bind, Contexts, KeepCurrent};
use super::error::{catch, check, drv};
use super::graphs::{CuGraph, CuGraphExec};
use super::health::Health;
use super::registry::Registry;
use super::streams::CuEvent;
use gpualloc_runtime::capture::{CaptureMode, CaptureStatus, GraphExecHandle, GraphHandle};
use gpualloc_runtime::error::{BackendError, Result};
use gpualloc_runtime::types::{
    DeviceId, DevicePtr, EventHandle, HostFn, HostRegisterFlags, IpcMemHandle, MemInfo, PhysHandle,
    StreamHandle,
};
use gpualloc_runtime::Backend;

/// The [`Backend`] on NVIDIA's driver API, through cudarc (dynamically loaded: it builds
/// without a toolkit and fails with a typed error, not a panic, without a driver).
///
/// Each device's primary context is retained on first use and bound on the calling thread
/// before every raw call. Streams are cudarc [`CudaStream`]s, so they convert both ways
/// (see [`CudaBackend::adopt_stream`] and [`CudaBackend::cudarc_stream`]); events are
/// created with timing disabled. Streams and events are looked up in a registry before the
/// driver sees them, so an unknown or destroyed handle is an [`BackendError::InvalidHandle`].
///
/// Differences from the sim worth knowing:
/// - a handle from [`Backend::phys_import_fd`] has `size == 0` (the driver does not report
///   the size of imported memory); callers that know it may set it;
/// - empty copies and memsets are no-ops, as in CUDA.
pub struct CudaBackend {
    pub(crate) contexts: Arc<Contexts>,
    /// Lost devices, the host functions pending per device and the watchdog (`health.rs`).
    pub(crate) health: Arc<Health>,
    pub(crate) streams: Registry<CudaStream>,
    pub(crate) events: Registry<CuEvent>,
    /// Captured graphs and their instantiations (`graphs.rs`).
    pub(crate) graphs: Registry<CuGraph>,
    pub(crate) graph_execs: Registry<CuGraphExec>,
    pub(crate) granularity: Vec<OnceLock<u64>>,
    /// Legacy IPC mappings this backend opened, by address (see [`IpcOpened`]).
    pub(crate) ipc_opened: std::sync::Mutex<std::collections::BTreeMap<u64, IpcOpened>>,
    /// Run around every unmap and free (`gpualloc_runtime::release_hooks`).
    pub(crate) release_hooks: gpualloc_runtime::release_hooks::ReleaseHooks,
    /// The process that made this backend: see [`CudaBackend::forked`].
    pub(crate) pid: u32,
    /// The driver was initialized (`new`): calls then keep the caller's current context
    /// ([`KeepCurrent`]). A backend that never touched the driver (tests of input checks)
    /// asks it nothing.
    pub(crate) initialized: bool,
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBackend")
            .field("devices", &self.contexts.count())
            .field("streams", &self.streams.len())
            .field("events", &self.events.len())
            .finish()
    }
}

impl CudaBackend {
    /// Loads the driver, initializes it and counts the devices.
    ///
    /// Fails with [`BackendError::Unavailable`] ("no CUDA driver found ..." when the driver
    /// library cannot be loaded, "no CUDA device" when it finds none); never panics.
    /// Contexts are retained lazily, on a device's first use.
    pub fn new() -> Result<Arc<CudaBackend>> {
        if !Self::driver_present() {
            return Err(BackendError::Unavailable(
                "no CUDA driver found (the libcuda shared library could not be loaded)".into(),
            ));
        }
        let init = catch("cuInit", || {
            // SAFETY: cuInit takes no pointers; the library is present (checked above).
            unsafe { sys::cuInit(0) }
        })?;
        match init {
            CUresult::CUDA_SUCCESS => {}
            CUresult::CUDA_ERROR_NO_DEVICE => {
                return Err(BackendError::Unavailable("no CUDA device".into()))
            }
            other => {
                let e = check("cuInit", other)
                    .err()
                    .map(|e| e.to_string())
                    .unwrap_or_default();
                return Err(BackendError::Unavailable(format!(
                    "CUDA driver failed to initialize: {e}"
                )));
            }
        }
        let mut count: c_int = 0;
        drv("cuDeviceGetCount", || {
            // SAFETY: `count` is a valid, writable out-pointer for the duration of the call.
            unsafe { sys::cuDeviceGetCount(&mut count) }
        })?;
        let count = u32::try_from(count).unwrap_or(0);
        if count == 0 {
            return Err(BackendError::Unavailable("no CUDA device".into()));
        }
        let mut backend = Self::with_devices(count);
        backend.initialized = true;
        Ok(Arc::new(backend))
    }

    /// True when the CUDA driver library can be loaded (no other driver call is made).
    pub fn driver_present() -> bool {
        catch("is_culib_present", || {
            // SAFETY: only tries to `dlopen` the driver library under its usual names; loading
            // it runs its initializers, which is what any CUDA program does.
            unsafe { sys::is_culib_present() }
        })
        .unwrap_or(false)
    }

    /// The file the driver library was loaded from: the mapping of this process that holds
    /// `cuInit`, as `/proc/self/maps` names it (links resolved). For NVIDIA's driver it is
    /// `libcuda.so.<driver version>`; `None` when no driver library can be loaded or the map
    /// cannot be read. For diagnostics ("which driver did this process load?"), and for
    /// `scripts/gpu-check.sh`'s proof that a GPU run used NVIDIA's driver.
    pub fn driver_library() -> Option<PathBuf> {
        if !Self::driver_present() {
            return None;
        }
        let addr = catch("dlsym(cuInit)", || {
            // SAFETY: `culib` returns the library cudarc loaded (present: checked above) and
            // lives for the program; the symbol is only read as an address, never called or
            // dereferenced.
            unsafe { sys::culib().get::<*const c_void>(b"cuInit\0") }
                .ok()
                .map(|sym| *sym as usize)
        })
        .ok()??;
        let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
        mapping_file_of(&maps, addr)
    }

    /// A backend for `count` devices that has not touched the driver yet.
    pub(crate) fn with_devices(count: u32) -> CudaBackend {
        CudaBackend {
            contexts: Arc::new(Contexts::new(count)),
            health: Health::new(count),
            streams: Registry::new("stream"),
            events: Registry::new("event"),
            graphs: Registry::new("graph"),
            graph_execs: Registry::new("graph instantiation"),
            granularity: (0..count).map(|_| OnceLock::new()).collect(),
            ipc_opened: std::sync::Mutex::new(std::collections::BTreeMap::new()),
            release_hooks: Default::default(),
            pid: std::process::id(),
            initialized: false,
        }
    }

    /// Keeps the caller's current context across one backend call (see [`KeepCurrent`]); not
    /// in a forked child, which makes no driver call.
    fn keep_current(&self) -> Option<KeepCurrent> {
        (self.initialized && !self.forked()).then(KeepCurrent::new)
    }

    /// True in a process forked from the one that made this backend. The driver's state does
    /// not survive a fork (CUDA in a forked child is undefined; drivers refuse it with an
    /// initialization error): a child holds the parent's objects (an inherited `Stream`,
    /// `Event`, imported buffer) but must not give them back through the driver. Their
    /// releases are no-ops there (the objects are forgotten, never destroyed), and the
    /// backend's own drop touches nothing.
    pub(crate) fn forked(&self) -> bool {
        std::process::id() != self.pid
    }

    /// Binds the primary context of `device` on this thread and returns it.
    pub(crate) fn bind_device(
        &self,
        device: DeviceId,
    ) -> Result<&Arc<cudarc::driver::safe::CudaContext>> {
        self.health.check(device)?;
        let ctx = self.contexts.get(device)?;
        bind(ctx)?;
        Ok(ctx)
    }

    /// Binds a context for calls that need *a* context but no particular device (pinned host
    /// memory, allocated and registered portable, works in every context; unmaps and pointer
    /// queries name their memory by address): one of a device not lost, and one the process
    /// already holds if it holds any (a process that works only on GPU k never makes one on
    /// another GPU; a faulted GPU's context, where every call fails, is never used for memory
    /// of the healthy ones). Holding none, it retains the first device that gives one (a
    /// device another process holds in `EXCLUSIVE_PROCESS` mode is passed over).
    pub(crate) fn bind_any(&self) -> Result<()> {
        let healthy = || {
            (0..self.contexts.count())
                .map(DeviceId)
                .filter(|d| self.health.lost(*d).is_none())
        };
        if let Some(ctx) = healthy().find_map(|d| self.contexts.retained(d)) {
            return bind(ctx);
        }
        let mut last = None;
        for d in healthy() {
            match self.bind_device(d) {
                Ok(_) => return Ok(()),
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| {
            BackendError::NotSupported("no device left to hold a context: every one is lost".into())
        }))
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        if self.forked() {
            // Nothing of the parent's may be destroyed from here, and its threads (the
            // watchdog's) are not in this process to be joined.
            std::mem::forget(self.events.drain());
            std::mem::forget(self.streams.drain());
            return;
        }
        // Drop events, then streams, while the contexts they name are certainly retained
        // (each also holds its own `Arc` of its context, so this order is belt and braces).
        drop(self.events.drain());
        drop(self.streams.drain());
        self.health.shutdown();
    }
}

impl Backend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }

    fn device_lost(&self, device: DeviceId) -> Option<BackendError> {
        self.health.lost(device)
    }
    fn lost_watch(&self, device: DeviceId) -> gpualloc_runtime::LostWatch {
        match self.health.lost_cell(device) {
            Some(cell) => gpualloc_runtime::LostWatch::Cell(cell),
            // No such device: `device_lost` answers (`None`), as for any backend.
            None => gpualloc_runtime::LostWatch::Ask,
        }
    }
    fn device_count(&self) -> Result<u32> {
        Ok(self.contexts.count())
    }
    fn mem_info(&self, device: DeviceId) -> Result<MemInfo> {
        let _keep = self.keep_current();
        self.health.seen(device, self.cu_mem_info(device))
    }
    fn total_memory(&self, device: DeviceId) -> Result<u64> {
        let _keep = self.keep_current();
        self.cu_total_memory(device)
    }
    fn enable_peer_access(&self, device: DeviceId, peer: DeviceId) -> Result<()> {
        let _keep = self.keep_current();
        self.health
            .seen(device, self.cu_enable_peer_access(device, peer))
    }
    fn malloc(&self, device: DeviceId, size: u64) -> Result<DevicePtr> {
        let _keep = self.keep_current();
        self.health.seen(device, self.cu_malloc(device, size))
    }
    fn free(&self, device: DeviceId, ptr: DevicePtr) -> Result<()> {
        let _keep = self.keep_current();
        if self.forked() {
            return Ok(());
        }
        self.health.seen(device, self.cu_free(device, ptr))
    }
    fn device_synchronize(&self, device: DeviceId) -> Result<()> {
        let _keep = self.keep_current();
        self.health.seen(device, self.cu_device_synchronize(device))
    }

    fn stream_create(&self, device: DeviceId) -> Result<StreamHandle> {
        let _keep = self.keep_current();
        self.health.seen(device, self.cu_stream_create(device))
    }
    fn stream_destroy(&self, stream: StreamHandle) -> Result<()> {
        let _keep = self.keep_current();
        if self.forked() {
            std::mem::forget(self.streams.remove(stream.device, stream.raw)?);
            return Ok(());
        }
        self.health
            .seen(stream.device, self.cu_stream_destroy(stream))
    }
    fn stream_synchronize(&self, stream: StreamHandle) -> Result<()> {
        let _keep = self.keep_current();
        self.health
            .seen(stream.device, self.cu_stream_synchronize(stream))
    }
    fn stream_query(&self, stream: StreamHandle) -> Result<bool> {
        let _keep = self.keep_current();
        self.health
            .seen(stream.device, self.cu_stream_query(stream))
    }
    fn stream_wait_event(&self, stream: StreamHandle, event: EventHandle) -> Result<()> {
        let _keep = self.keep_current();
        self.health
            .seen(stream.device, self.cu_stream_wait_event(stream, event))
    }
    fn launch_host_func(&self, stream: StreamHandle, f: HostFn) -> Result<()> {
        let _keep = self.keep_current();
        self.health
            .seen(stream.device, self.cu_launch_host_func(stream, f))
    }
    unsafe fn memcpy_async(
        &self,
        stream: StreamHandle,
        dst: u64,
        src: u64,
        len: u64,
    ) -> Result<()> {
        let _keep = self.keep_current();
        self.health
            .seen(stream.device, self.cu_memcpy_async(stream, dst, src, len))
    }
    fn memset_async(
        &self,
        stream: StreamHandle,
        dst: DevicePtr,
        value: u8,
        len: u64,
    ) -> Result<()> {
        let _keep = self.keep_current();
        self.health
            .seen(stream.device, self.cu_memset_async(stream, dst, value, len))
    }
    fn copy_to_device(&self, stream: StreamHandle, dst: DevicePtr, src: &[u8]) -> Result<()> {
        let _keep = self.keep_current();
        self.health
            .seen(stream.device, self.cu_copy_to_device(stream, dst, src))
    }
    fn copy_from_device(&self, stream: StreamHandle, dst: &mut [u8], src: DevicePtr) -> Result<()> {
        let _keep = self.keep_current();
        self.health
            .seen(stream.device, self.cu_copy_from_device(stream, dst, src))
    }

    fn event_create(&self, device: DeviceId) -> Result<EventHandle> {
        let _keep = self.keep_current();
        self.health.seen(device, self.cu_event_create(device))
    }
    fn event_record(&self, event: EventHandle, stream: StreamHandle) -> Result<()> {
        let _keep = self.keep_current();
        self.health
            .seen(stream.device, self.cu_event_record(event, stream))
    }
    fn event_query(&self, event: EventHandle) -> Result<bool> {
        let _keep = self.keep_current();
        self.health.seen(event.device, self.cu_event_query(event))
    }
    fn event_synchronize(&self, event: EventHandle) -> Result<()> {
        let _keep = self.keep_current();
        self.health
            .seen(event.device, self.cu_event_synchronize(event))
    }
    fn event_destroy(&self, event: EventHandle) -> Result<()> {
        let _keep = self.keep_current();
        if self.forked() {
            std::mem::forget(self.events.remove(event.device, event.raw)?);
            return Ok(());
        }
        self.health.seen(event.device, self.cu_event_destroy(event))
    }

    fn stream_begin_capture(&self, stream: StreamHandle, mode: CaptureMode) -> Result<()> {
        let _keep = self.keep_current();
        self.health
            .seen(stream.device, self.cu_begin_capture(stream, mode))
    }
    fn stream_end_capture(&self, stream: StreamHandle) -> Result<GraphHandle> {
        let _keep = self.keep_current();
        self.health.seen(stream.device, self.cu_end_capture(stream))
    }
    fn stream_capture_status(&self, stream: StreamHandle) -> Result<CaptureStatus> {
        let _keep = self.keep_current();
        self.health
            .seen(stream.device, self.cu_capture_status(stream))
    }
    /// The driver does not say cheaply whether some thread captures: true, except in a
    /// forked child, which makes no driver call (not even a mode exchange).
    fn capture_may_be_underway(&self) -> bool {
        !self.forked()
    }
    fn exchange_capture_mode(&self, mode: CaptureMode) -> Result<CaptureMode> {
        self.cu_exchange_capture_mode(mode)
    }
    fn graph_instantiate(&self, graph: GraphHandle) -> Result<GraphExecHandle> {
        let _keep = self.keep_current();
        self.health
            .seen(graph.device, self.cu_graph_instantiate(graph))
    }
    fn graph_launch(&self, exec: GraphExecHandle, stream: StreamHandle) -> Result<()> {
        let _keep = self.keep_current();
        self.health
            .seen(stream.device, self.cu_graph_launch(exec, stream))
    }
    fn graph_destroy(&self, graph: GraphHandle) -> Result<()> {
        let _keep = self.keep_current();
        if self.forked() {
            std::mem::forget(self.graphs.remove(graph.device, graph.raw)?);
            return Ok(());
        }
        self.cu_graph_destroy(graph)
    }
    fn graph_exec_destroy(&self, exec: GraphExecHandle) -> Result<()> {
        let _keep = self.keep_current();
        if self.forked() {
            std::mem::forget(self.graph_execs.remove(exec.device, exec.raw)?);
            return Ok(());
        }
        self.cu_graph_exec_destroy(exec)
    }

    fn host_alloc(&self, size: u64) -> Result<*mut u8> {
        let _keep = self.keep_current();
        self.cu_host_alloc(size)
    }
    unsafe fn host_free(&self, ptr: *mut u8) -> Result<()> {
        let _keep = self.keep_current();
        if self.forked() {
            return Ok(());
        }
        self.cu_host_free(ptr)
    }
    unsafe fn host_register(&self, ptr: *mut u8, len: u64, flags: HostRegisterFlags) -> Result<()> {
        let _keep = self.keep_current();
        self.cu_host_register(ptr, len, flags)
    }
    unsafe fn host_unregister(&self, ptr: *mut u8) -> Result<()> {
        let _keep = self.keep_current();
        if self.forked() {
            return Ok(());
        }
        self.cu_host_unregister(ptr)
    }

    fn vmm_granularity(&self, device: DeviceId) -> Result<u64> {
        let _keep = self.keep_current();
        self.health.seen(device, self.cu_granularity(device))
    }
    fn has_vmm(&self, device: DeviceId) -> bool {
        let _keep = self.keep_current();
        self.cu_has_vmm(device)
    }
    fn va_reserve(&self, device: DeviceId, size: u64, alignment: u64) -> Result<DevicePtr> {
        let _keep = self.keep_current();
        self.health
            .seen(device, self.cu_va_reserve(device, size, alignment))
    }
    fn va_free(&self, device: DeviceId, ptr: DevicePtr, size: u64) -> Result<()> {
        let _keep = self.keep_current();
        if self.forked() {
            return Ok(());
        }
        self.health.seen(device, self.cu_va_free(device, ptr, size))
    }
    fn phys_create(&self, device: DeviceId, size: u64) -> Result<PhysHandle> {
        let _keep = self.keep_current();
        self.health.seen(device, self.cu_phys_create(device, size))
    }
    fn phys_release(&self, handle: PhysHandle) -> Result<()> {
        let _keep = self.keep_current();
        if self.forked() {
            return Ok(());
        }
        self.health
            .seen(handle.device, self.cu_phys_release(handle))
    }
    fn map(&self, ptr: DevicePtr, size: u64, offset: u64, handle: PhysHandle) -> Result<()> {
        let _keep = self.keep_current();
        self.health
            .seen(handle.device, self.cu_map(ptr, size, offset, handle))
    }
    fn release_hooks(&self) -> Option<&gpualloc_runtime::release_hooks::ReleaseHooks> {
        Some(&self.release_hooks)
    }
    fn unmap(&self, ptr: DevicePtr, size: u64) -> Result<()> {
        let _keep = self.keep_current();
        if self.forked() {
            return Ok(());
        }
        self.cu_unmap(ptr, size)
    }
    fn set_access(&self, device: DeviceId, ptr: DevicePtr, size: u64) -> Result<()> {
        let _keep = self.keep_current();
        self.health
            .seen(device, self.cu_set_access(device, ptr, size))
    }
    fn phys_export_fd(&self, handle: PhysHandle) -> Result<OwnedFd> {
        let _keep = self.keep_current();
        self.cu_phys_export_fd(handle)
    }
    fn phys_import_fd(&self, device: DeviceId, fd: OwnedFd) -> Result<PhysHandle> {
        let _keep = self.keep_current();
        self.health.seen(device, self.cu_phys_import_fd(device, fd))
    }

    fn ipc_get_mem_handle(&self, ptr: DevicePtr) -> Result<IpcMemHandle> {
        let _keep = self.keep_current();
        self.cu_ipc_get_mem_handle(ptr)
    }
    fn ipc_open_mem_handle(&self, device: DeviceId, handle: &IpcMemHandle) -> Result<DevicePtr> {
        let _keep = self.keep_current();
        self.health
            .seen(device, self.cu_ipc_open_mem_handle(device, handle))
    }
    fn ipc_close_mem_handle(&self, ptr: DevicePtr) -> Result<()> {
        let _keep = self.keep_current();
        if self.forked() {
            return Ok(());
        }
        self.cu_ipc_close_mem_handle(ptr)
    }
    fn mem_address_range(&self, ptr: DevicePtr) -> Result<(DevicePtr, u64)> {
        let _keep = self.keep_current();
        self.cu_mem_address_range(ptr)
    }
}

/// The file of the mapping in `maps` (the format of `/proc/<pid>/maps`) that contains `addr`.
fn mapping_file_of(maps: &str, addr: usize) -> Option<PathBuf> {
    maps.lines().find_map(|line| {
        let (start, end) = line.split_whitespace().next()?.split_once('-')?;
        let start = usize::from_str_radix(start, 16).ok()?;
        let end = usize::from_str_radix(end, 16).ok()?;
        // The path is the rest of the line from its first '/' (it may hold spaces; the
        // fields before it never hold a '/').
        let path = &line[line.find('/')?..];
        (start <= addr && addr < end).then(|| PathBuf::from(path))
    })
}

#[cfg(test)]
mod maps_tests {
    use super::*;

    const MAPS: &str = "\
5581c000-5581d000 r--p 00000000 fd:01 1234      /usr/bin/app
7f00a000-7f00c000 r-xp 00002000 fd:01 99        /usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15
7f00c000-7f00d000 rw-p 00000000 00:00 0
7f00d000-7f00e000 r-xp 00000000 fd:01 77        /opt/my libs/libcuda.so.1
7ffd0000-7ffd1000 rw-p 00000000 00:00 0         [stack]
";

    #[test]
    fn the_mapping_that_holds_an_address_names_its_file() {
        let at = |a: usize| mapping_file_of(MAPS, a);
        assert_eq!(
            at(0x7f00a000),
            Some(PathBuf::from(
                "/usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15"
            ))
        );
        assert_eq!(
            at(0x7f00bfff),
            Some(PathBuf::from(
                "/usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15"
            ))
        );
        assert_eq!(
            at(0x7f00d800),
            Some(PathBuf::from("/opt/my libs/libcuda.so.1"))
        );
        // Anonymous memory, the stack, and addresses outside every mapping have no file.
        assert_eq!(at(0x7f00c000), None);
        assert_eq!(at(0x7ffd0000), None);
        assert_eq!(at(0x1000), None);
        assert_eq!(at(0x7f00e000), None);
    }
}

/// A legacy IPC mapping this backend opened.
#[derive(Debug, Clone, Copy)]
pub(crate) struct IpcOpened {
    /// The device whose context opened it: only that context may close it, and queries of
    /// its addresses use it (the pointer's own device is the exporter's, whose context this
    /// process need not hold).
    pub(crate) opener: DeviceId,
    /// Its size.
    pub(crate) size: u64,
    /// Opens not yet closed (the driver returns one pointer per handle and context).
    pub(crate) count: usize,
}
