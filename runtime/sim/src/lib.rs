//! The simulated GPU: the embedded default backend, made of real OS memory.
//!
//! - Device memory is real: each `malloc` is a memfd of that size mapped read/write into
//!   this process (pages are consumed only when touched), and a [`DevicePtr`] is the real
//!   address. Capacity is enforced per device.
//! - Virtual memory is real: a reservation is `mmap(PROT_NONE)`, a physical handle is a
//!   memfd, `map` is `MAP_FIXED` over the reservation, exported handles are `dup`ed memfds.
//! - Streams are worker threads running in-order queues (kernels, copies, event records and
//!   waits, host functions); events complete when their stream reaches them. Destroying a
//!   stream returns at once, as `cuStreamDestroy` does: its queued work still runs, and
//!   `device_synchronize` and `free` wait for it.
//! - Stream capture records a stream's work into a graph instead, and a graph launch runs it
//!   again, with the driver's refusals of calls that conflict with a capture (`capture.rs`).
//! - A region table validates every access by kernels and copies, so a stale pointer is a
//!   typed error, never a SIGSEGV. It is stricter than a GPU: an access may cross from one
//!   VMM mapping into the next (they tile a reservation) but never run off one allocation
//!   into a neighbouring one, a mapping without `set_access` is inaccessible, and host memory
//!   registered `read_only` cannot be written by device work. `host_register` refuses ranges
//!   that are not mapped readable (and writable, unless `read_only`).
//! - A [`LatencyModel`] makes driver calls cost what they cost on real hardware; every call
//!   is counted ([`SimBackend::counts`]) and can be made to fail ([`SimBackend::inject`]).
//!
//! Differences from CUDA, on purpose: an IPC handle may be opened in the process that made
//! it (useful in tests); kernels are Rust closures launched with [`SimBackend::launch_kernel`].
//!
//! The sim uses `std::sync` directly (not [`gpualloc_runtime::sync`]): its threads are real OS threads
//! and it is not itself model-checked.

mod backend_impl;
mod capture;
mod counters;
mod faults;
mod host;
mod ipc;
mod kernel;
mod latency;
mod memory;
mod os;
mod queue;
mod vmm;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use crossbeam_channel::Sender;

pub use counters::{CallCounts, Op};
pub use faults::Fault;
pub use kernel::KernelMemory;
pub use latency::{sleeping_now, LatencyModel, SLEEP_QUANTUM};

use gpualloc_runtime::error::{BackendError, Result};
use gpualloc_runtime::types::{DeviceId, DevicePtr, EventHandle, StreamHandle};
use memory::{Memory, RegionKind};
use queue::{RetiredStream, SimEvent, SimStream, StreamShared, Task};
use vmm::VmmState;

/// Configuration of a [`SimBackend`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SimConfig {
    /// Number of devices (default 1).
    pub devices: u32,
    /// Memory per device in bytes (default 16 GiB; address space, consumed only when touched).
    pub capacity_per_device: u64,
    /// VMM granularity in bytes (default 2 MiB, as on current GPUs). A power of two, at
    /// least the page size.
    pub granularity: u64,
    /// What calls cost (default: real-hardware latencies).
    pub latency: LatencyModel,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            devices: 1,
            capacity_per_device: 16 << 30,
            granularity: 2 << 20,
            latency: LatencyModel::default(),
        }
    }
}

impl SimConfig {
    /// `devices` devices with default capacity and zero latency: the usual test setup.
    pub fn fast(devices: u32) -> Self {
        SimConfig {
            devices,
            latency: LatencyModel::zero(),
            ..SimConfig::default()
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The simulated GPU. Create it with [`SimBackend::new`]; use it as an
/// `Arc<dyn Backend>`. Dropping the last `Arc` drains and joins every stream (destroyed ones
/// too), unmaps all memory and closes every fd it opened.
#[derive(Debug)]
pub struct SimBackend {
    config: SimConfig,
    latency: Mutex<LatencyModel>,
    counters: counters::Counters,
    faults: faults::Faults,
    failures: Arc<AtomicU64>,
    /// Calls that named a stream or an event the sim does not know (never made, or destroyed).
    unknown_handles: AtomicU64,
    mem: Arc<Memory>,
    used: Mutex<Vec<u64>>,
    streams: Mutex<HashMap<u64, SimStream>>,
    /// Destroyed streams whose workers may still run queued work (`cuStreamDestroy` returns
    /// at once); reaped once done.
    retired: Mutex<Vec<RetiredStream>>,
    events: Mutex<HashMap<u64, Arc<SimEvent>>>,
    vmm: Mutex<VmmState>,
    captures: capture::Captures,
    next_id: AtomicU64,
    page: u64,
    release_hooks: gpualloc_runtime::release_hooks::ReleaseHooks,
}

impl SimBackend {
    /// A simulated machine as `config` describes. Errors with `InvalidValue` for zero
    /// devices, a zero capacity or a granularity that is not a power-of-two multiple of the
    /// page size.
    pub fn new(config: SimConfig) -> Result<Arc<SimBackend>> {
        let page = os::page_size();
        if config.devices == 0 {
            return Err(BackendError::invalid("a sim needs at least one device"));
        }
        if config.capacity_per_device == 0 {
            return Err(BackendError::invalid("capacity_per_device must be > 0"));
        }
        if !config.granularity.is_power_of_two() || config.granularity < page {
            return Err(BackendError::invalid(format!(
                "granularity {} must be a power of two >= the page size {page}",
                config.granularity
            )));
        }
        raise_fd_limit();
        Ok(Arc::new(SimBackend {
            config,
            latency: Mutex::new(config.latency),
            counters: counters::Counters::default(),
            faults: faults::Faults::default(),
            failures: Arc::new(AtomicU64::new(0)),
            unknown_handles: AtomicU64::new(0),
            mem: Arc::new(Memory::default()),
            used: Mutex::new(vec![0; config.devices as usize]),
            streams: Mutex::new(HashMap::new()),
            retired: Mutex::new(Vec::new()),
            events: Mutex::new(HashMap::new()),
            vmm: Mutex::new(VmmState::default()),
            captures: capture::Captures::default(),
            next_id: AtomicU64::new(1),
            page,
            release_hooks: Default::default(),
        }))
    }

    /// The configuration, with the current latency model.
    pub fn config(&self) -> SimConfig {
        SimConfig {
            latency: self.latency(),
            ..self.config
        }
    }

    /// The current latency model.
    pub fn latency(&self) -> LatencyModel {
        *lock(&self.latency)
    }

    /// Replaces the latency model; takes effect for the next call.
    pub fn set_latency(&self, latency: LatencyModel) {
        *lock(&self.latency) = latency;
    }

    /// A snapshot of the per-operation call counters.
    pub fn counts(&self) -> CallCounts {
        self.counters.snapshot()
    }

    /// Sets every call counter to zero.
    pub fn reset_counts(&self) {
        self.counters.reset();
    }

    /// Makes calls of `op` fail as `fault` says (replacing an earlier fault for `op`).
    pub fn inject(&self, op: Op, fault: Fault) {
        self.faults.inject(op, fault);
    }

    /// Removes every injected fault.
    pub fn clear_faults(&self) {
        self.faults.clear();
    }

    /// Stream work (kernels, copies) that has failed since creation.
    pub fn kernel_failures(&self) -> u64 {
        self.failures.load(Ordering::Relaxed)
    }

    /// Calls since creation that named a stream or an event this sim does not know: never
    /// created, or destroyed already (each fails with `InvalidHandle`). On a driver such a
    /// call is an error too, or worse: a destroyed stream's handle may name a newer stream. A
    /// caller that keeps its streams alive while it uses them makes none.
    pub fn unknown_handle_calls(&self) -> u64 {
        self.unknown_handles.load(Ordering::Relaxed)
    }

    /// Counts a call that named an unknown stream or event, and returns its error.
    pub(crate) fn unknown_handle(&self, what: String) -> BackendError {
        self.unknown_handles.fetch_add(1, Ordering::Relaxed);
        BackendError::InvalidHandle(what)
    }

    /// Bytes of device memory in use on `device` (allocations and physical handles).
    pub fn used_bytes(&self, device: DeviceId) -> Result<u64> {
        self.used_on(device)
    }

    /// Live streams on all devices.
    pub fn live_streams(&self) -> usize {
        lock(&self.streams).len()
    }

    /// The device of the allocation, mapped range or opened IPC handle that contains `ptr`
    /// (`None` for host memory or an unknown address): `cuPointerGetAttribute`'s device
    /// ordinal, for the emulated driver.
    pub fn pointer_device(&self, ptr: DevicePtr) -> Option<DeviceId> {
        self.mem.find_containing(ptr.0, |_, r| r.device).flatten()
    }

    /// True when `[addr, addr + len)` lies in live device memory right now (an allocation, a
    /// mapped and accessible range, or an opened IPC handle): what work on a device may touch.
    /// The emulated driver turns work outside it into the sticky fault a GPU raises.
    pub fn device_memory_covers(&self, addr: u64, len: u64) -> bool {
        self.pointer_device(DevicePtr(addr)).is_some()
            && self.mem.validate(addr, len.max(1)).is_ok()
    }

    /// True when the allocation starting at `ptr` is open in another process through its IPC
    /// handle right now (an importer holds a shared lock on the memory's file while it has it
    /// open, see `ipc_open_mem_handle`; the kernel drops it when the importer closes the
    /// handle or dies). The emulated driver reports a `cuMemFree` then: undefined behaviour on
    /// the driver.
    pub fn opened_by_another_process(&self, ptr: DevicePtr) -> bool {
        use rustix::fs::{flock, FlockOperation};
        self.mem
            .with_region(ptr.0, RegionKind::Device, |r| {
                r.fd.as_ref().is_some_and(|fd| {
                    match flock(fd, FlockOperation::NonBlockingLockExclusive) {
                        Ok(()) => {
                            let _ = flock(fd, FlockOperation::Unlock);
                            false
                        }
                        Err(e) => e == rustix::io::Errno::WOULDBLOCK,
                    }
                })
            })
            .unwrap_or(false)
    }

    /// The process a sim IPC handle comes from (`None`: not a sim handle). The emulated
    /// driver refuses, as the real one does, to open a handle in the process that made it.
    pub fn ipc_handle_pid(&self, handle: &gpualloc_runtime::types::IpcMemHandle) -> Option<u32> {
        ipc::IpcInfo::decode(handle).ok().map(|i| i.pid)
    }

    /// The device whose memory a legacy IPC handle names (as `ipc_handle_pid`, for the
    /// emulated driver).
    pub fn ipc_handle_device(
        &self,
        handle: &gpualloc_runtime::types::IpcMemHandle,
    ) -> Option<DeviceId> {
        ipc::IpcInfo::decode(handle)
            .ok()
            .map(|i| DeviceId(i.device))
    }

    /// Frees an allocation of `device` without synchronizing the device first: work still
    /// queued that touches it then fails with the stream's sticky error. The driver documents
    /// only that `cuMemFree` *may* synchronize; the emulated driver frees this way in its
    /// no-sync mode, so a caller that relies on the synchronization is caught.
    pub fn free_without_sync(&self, device: DeviceId, ptr: DevicePtr) -> Result<()> {
        self.captures.check_unsafe_call()?;
        self.check_allocation_of(device, ptr)?;
        self.free_region(device, ptr)
    }

    /// `ptr` starts a `malloc` allocation of `device` (what `free` may release).
    pub(crate) fn check_allocation_of(&self, device: DeviceId, ptr: DevicePtr) -> Result<()> {
        self.check_device(device)?;
        let owner = self
            .mem
            .with_region(ptr.0, RegionKind::Device, |r| r.device)?;
        if owner != Some(device) {
            return Err(BackendError::invalid(format!(
                "{ptr} is not an allocation of {device}"
            )));
        }
        Ok(())
    }

    /// Removes allocation `ptr` of `device` and gives its capacity back (no synchronization).
    pub(crate) fn free_region(&self, device: DeviceId, ptr: DevicePtr) -> Result<()> {
        let region = self.mem.remove(ptr.0, RegionKind::Device)?;
        let len = region.len;
        drop(region); // munmap + close, outside the table lock
        self.give_capacity(device, len);
        latency::pay(self.latency().free);
        Ok(())
    }

    /// True when all work queued on `stream` so far has run (as `cuStreamQuery` answers; the
    /// `Backend` trait asks through events instead).
    pub fn stream_idle(&self, stream: StreamHandle) -> Result<bool> {
        Ok(self.stream(stream)?.0.idle())
    }

    /// Live device allocations from `malloc` on all devices.
    pub fn live_allocations(&self) -> usize {
        self.mem.count(RegionKind::Device)
    }

    /// Enqueues a simulated kernel on `stream`: when the stream reaches it, it takes
    /// `duration`, then runs `f` over device memory. An error from `f` (or a panic) becomes
    /// the stream's sticky error, returned by the next `stream_synchronize`, and is counted
    /// in [`SimBackend::kernel_failures`]. On a capturing stream the kernel is captured, not
    /// run: it runs at each launch of the graph, hence `FnMut`.
    pub fn launch_kernel(
        &self,
        stream: StreamHandle,
        duration: Duration,
        f: impl FnMut(&mut KernelMemory) -> Result<()> + Send + 'static,
    ) -> Result<()> {
        self.launch_kernel_touching(stream, duration, &[], f)
    }

    /// [`SimBackend::launch_kernel`] for a kernel that declares the device ranges
    /// `(ptr, len)` it reads or writes. The sim remembers them until the kernel has run, so
    /// the allocator's `debug_cross_stream_frees` check can tell that a buffer freed meanwhile
    /// is still in use on this stream. (A kernel may touch memory it did not declare; the
    /// check then cannot see it.)
    pub fn launch_kernel_touching(
        &self,
        stream: StreamHandle,
        duration: Duration,
        touches: &[(DevicePtr, u64)],
        mut f: impl FnMut(&mut KernelMemory) -> Result<()> + Send + 'static,
    ) -> Result<()> {
        self.enter(Op::LaunchKernel)?;
        let (shared, tx) = self.stream(stream)?;
        let mem = self.mem.clone();
        latency::pay(self.latency().launch);
        let touches: Vec<(u64, u64)> = touches.iter().map(|&(p, len)| (p.0, len)).collect();
        self.submit(&shared, &tx, &touches, move || {
            if !duration.is_zero() {
                std::thread::sleep(duration);
            }
            f(&mut KernelMemory::new(mem.clone()))
        })
    }

    /// Graphs and graph instantiations alive (captured and not destroyed yet).
    pub fn live_graphs(&self) -> (usize, usize) {
        self.captures.live()
    }

    // ---- helpers for the Backend impl ----

    fn enter(&self, op: Op) -> Result<()> {
        self.counters.bump(op);
        self.faults.check(op)?;
        if op.is_capture_unsafe() {
            self.captures.check_unsafe_call()?;
        }
        Ok(())
    }

    /// [`SimBackend::enter`] for a query or synchronization of `event`: an event last
    /// recorded in a capture is refused as such (`CapturedEvent`) before the call is weighed
    /// as an unsafe one.
    fn enter_event(&self, op: Op, event: EventHandle) -> Result<Arc<SimEvent>> {
        self.counters.bump(op);
        self.faults.check(op)?;
        let ev = self.event(event)?;
        self.captures.check_event(event.raw)?;
        self.captures.check_unsafe_call()?;
        Ok(ev)
    }

    fn check_device(&self, device: DeviceId) -> Result<()> {
        if device.0 < self.config.devices {
            Ok(())
        } else {
            Err(BackendError::InvalidDevice(device.0))
        }
    }

    fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Takes `bytes` of `device`'s capacity, or fails with `OutOfMemory`.
    fn take_capacity(&self, device: DeviceId, bytes: u64) -> Result<()> {
        let mut used = lock(&self.used);
        let slot = used
            .get_mut(device.0 as usize)
            .ok_or(BackendError::InvalidDevice(device.0))?;
        match slot.checked_add(bytes) {
            Some(n) if n <= self.config.capacity_per_device => {
                *slot = n;
                Ok(())
            }
            _ => Err(BackendError::OutOfMemory {
                requested: bytes,
                what: device.to_string(),
            }),
        }
    }

    fn used_on(&self, device: DeviceId) -> Result<u64> {
        lock(&self.used)
            .get(device.0 as usize)
            .copied()
            .ok_or(BackendError::InvalidDevice(device.0))
    }

    fn give_capacity(&self, device: DeviceId, bytes: u64) {
        if let Some(slot) = lock(&self.used).get_mut(device.0 as usize) {
            *slot = slot.saturating_sub(bytes);
        }
    }

    fn stream(&self, h: StreamHandle) -> Result<(Arc<StreamShared>, Sender<Task>)> {
        let streams = lock(&self.streams);
        match streams.get(&h.raw) {
            Some(s) if s.shared.device == h.device => Ok((s.shared.clone(), s.tx.clone())),
            _ => Err(self.unknown_handle(format!("unknown stream {h:?}"))),
        }
    }

    /// Enqueues stream work that a capture may take: on a capturing stream it becomes a node
    /// of the capture's graph (run at each launch), elsewhere it is queued to run once.
    fn submit(
        &self,
        shared: &StreamShared,
        tx: &Sender<Task>,
        touches: &[(u64, u64)],
        work: impl FnMut() -> Result<()> + Send + 'static,
    ) -> Result<()> {
        match self.captures.add_node(shared.raw, touches, work) {
            Ok(captured) => captured,
            Err(work) => shared
                .enqueue_touching(tx, Box::new(work), touches)
                .map(|_| ()),
        }
    }

    /// Enqueues a memory operation of `len` bytes on a stream (or captures it): it costs the
    /// latency model's copy time, then runs `work`.
    fn enqueue_timed(
        &self,
        shared: &StreamShared,
        tx: &Sender<Task>,
        len: u64,
        touches: &[(u64, u64)],
        mut work: impl FnMut() -> Result<()> + Send + 'static,
    ) -> Result<()> {
        let cost = self.latency().copy_cost(len);
        self.submit(shared, tx, touches, move || {
            latency::pay(cost);
            work()
        })
    }

    /// Like [`SimBackend::enqueue_timed`], then waits for the stream to reach the operation
    /// and returns its result (a synchronous copy in stream order).
    fn run_timed<T: Send + 'static>(
        &self,
        shared: &StreamShared,
        tx: Sender<Task>,
        len: u64,
        work: impl FnOnce() -> Result<T> + Send + 'static,
    ) -> Result<T> {
        self.captures.check_stream_sync(shared.raw)?;
        let (done_tx, done_rx) = crossbeam_channel::bounded(1);
        let cost = self.latency().copy_cost(len);
        shared.enqueue(
            &tx,
            Box::new(move || {
                latency::pay(cost);
                let _ = done_tx.send(work());
                Ok(())
            }),
        )?;
        drop(tx);
        done_rx
            .recv()
            .map_err(|_| BackendError::Unavailable("stream worker is gone".into()))?
    }

    fn event(&self, h: EventHandle) -> Result<Arc<SimEvent>> {
        let events = lock(&self.events);
        match events.get(&h.raw) {
            Some(e) if e.device == h.device => Ok(e.clone()),
            _ => Err(self.unknown_handle(format!("unknown event {h:?}"))),
        }
    }

    /// The device's streams, and those destroyed whose work may still be running (a driver's
    /// device-wide synchronization waits for that work too).
    fn device_streams(&self, device: DeviceId) -> Vec<Arc<StreamShared>> {
        let mut all: Vec<Arc<StreamShared>> = lock(&self.streams)
            .values()
            .filter(|s| s.shared.device == device)
            .map(|s| s.shared.clone())
            .collect();
        all.extend(
            lock(&self.retired)
                .iter()
                .filter(|s| s.shared.device == device)
                .map(|s| s.shared.clone()),
        );
        all
    }

    /// Keeps destroyed stream `s` until its queued work is done, and joins the workers of
    /// those done already.
    fn retire_stream(&self, s: SimStream) {
        let done: Vec<RetiredStream> = {
            let mut retired = lock(&self.retired);
            retired.push(s.retire());
            let (done, running) = std::mem::take(&mut *retired)
                .into_iter()
                .partition(RetiredStream::finished);
            *retired = running;
            done
        };
        for s in done {
            s.join();
        }
    }

    /// Waits for all work on `device`'s streams, leaving sticky errors in place.
    fn drain_device(&self, device: DeviceId) {
        for s in self.device_streams(device) {
            s.drain();
        }
    }

    /// Rounds `size` up to whole pages.
    fn page_round(&self, size: u64) -> Option<u64> {
        size.checked_next_multiple_of(self.page)
    }

    fn host_ptr(ptr: *mut u8) -> DevicePtr {
        DevicePtr(ptr as u64)
    }
}

impl Drop for SimBackend {
    fn drop(&mut self) {
        let streams: Vec<SimStream> = lock(&self.streams).drain().map(|(_, s)| s).collect();
        for s in streams {
            s.shutdown();
        }
        let retired = std::mem::take(&mut *lock(&self.retired));
        for s in retired {
            s.join();
        }
        lock(&self.events).clear();
        // Regions own their mappings and fds: dropping them unmaps and closes.
        drop(self.mem.drain());
        lock(&self.vmm).clear();
    }
}

/// Raises the soft open-file limit to the hard one: every device allocation is a memfd.
fn raise_fd_limit() {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let lim = getrlimit(Resource::Nofile);
    if lim.current != lim.maximum {
        let _ = setrlimit(
            Resource::Nofile,
            Rlimit {
                current: lim.maximum,
                maximum: lim.maximum,
            },
        );
    }
}
