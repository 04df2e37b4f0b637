//! The emulator's state: the simulated GPU behind it, the handles it gave out, the current
//! context of each thread, and [`call`], the prologue every driver entry point runs.

use std::cell::Cell;
use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use gpualloc_runtime::{DeviceId, EventHandle, PhysHandle, StreamHandle};
use gpualloc_sim::{LatencyModel, SimBackend, SimConfig};

use crate::abi::*;
use crate::faults::Faults;

/// A page-locked host range: pinned for every context when `portable`, else only for the
/// context (device) it was allocated or registered in.
#[derive(Clone, Copy)]
pub(crate) struct PinnedRange {
    pub(crate) start: usize,
    pub(crate) len: usize,
    pub(crate) portable: bool,
    pub(crate) device: u32,
}

/// A stream made by `cuStreamCreate`.
#[derive(Clone, Copy)]
pub(crate) struct EmuStream {
    pub(crate) handle: StreamHandle,
    /// Created without `CU_STREAM_NON_BLOCKING`: ordered with the legacy default stream.
    pub(crate) blocking: bool,
}

/// Everything `cuInit` set up.
pub(crate) struct Emu {
    /// The process that initialized the emulator: a forked child's calls are refused.
    pub(crate) pid: u32,
    /// Calls a forked child made (each refused), read by `gpualloc_emu_calls_in_forked_child`.
    pub(crate) forked_calls: std::sync::atomic::AtomicU64,
    pub(crate) sim: Arc<SimBackend>,
    pub(crate) devices: u32,
    /// Primary-context retain counts per device.
    pub(crate) retained: Mutex<Vec<u32>>,
    /// Each device's default (null) stream, made on first use.
    pub(crate) default_streams: Mutex<HashMap<u32, StreamHandle>>,
    pub(crate) streams: Mutex<HashMap<u64, EmuStream>>,
    pub(crate) events: Mutex<HashMap<u64, EventHandle>>,
    /// The `CUstream` and `CUevent` values handed out: a destroyed object's value is handed
    /// out again (the most recent first), as the driver's pointers are.
    pub(crate) stream_values: Mutex<HandleValues>,
    pub(crate) event_values: Mutex<HandleValues>,
    /// Events created with `CU_EVENT_BLOCKING_SYNC`: a host wait on one sleeps; on any other
    /// the driver spins a CPU core until it completes.
    pub(crate) blocking_events: Mutex<std::collections::HashSet<u64>>,
    /// `cuEventSynchronize` calls on events without `CU_EVENT_BLOCKING_SYNC` (each a spinning
    /// wait on a driver), read by `gpualloc_emu_spinning_waits`.
    pub(crate) spinning_waits: std::sync::atomic::AtomicU64,
    pub(crate) phys: Mutex<HashMap<u64, PhysHandle>>,
    pub(crate) faults: Faults,
    /// Page-locked host ranges (allocated or registered), with who may treat them as pinned.
    pub(crate) pinned: Mutex<Vec<PinnedRange>>,
    /// Async copies whose host side was not pinned for the copying context (the driver stages
    /// them through a bounce buffer, synchronously); read by `gpualloc_emu_pageable_copies`.
    pub(crate) pageable_copies: std::sync::atomic::AtomicU64,
    /// Mappings opened by `cuIpcOpenMemHandle`, by address (see [`IpcOpened`]).
    pub(crate) ipc_opened: Mutex<HashMap<u64, IpcOpened>>,
    /// Pairs (device, peer) whose peer access was enabled.
    pub(crate) peer_access: Mutex<std::collections::HashSet<(u32, u32)>>,
    /// Virtual-memory mappings by start: (length, bit mask of the devices given access by
    /// `cuMemSetAccess`). Work of a device outside the mask on the range faults.
    pub(crate) vmm_access: Mutex<std::collections::BTreeMap<u64, (u64, u64)>>,
    /// `GPUALLOC_EMU_EXCLUSIVE_PROCESS=DIR`: every device is in `EXCLUSIVE_PROCESS` compute
    /// mode, shared by the processes given the same folder: a primary context holds an
    /// exclusive lock on `DIR/device-N.lock` while retained, and a second process's retain
    /// fails with `CUDA_ERROR_DEVICE_UNAVAILABLE`.
    pub(crate) exclusive_dir: Option<std::path::PathBuf>,
    /// The lock files held, per device (while its primary context is retained).
    pub(crate) exclusive_locks: Mutex<HashMap<u32, std::fs::File>>,
    /// `GPUALLOC_EMU_FREE_NO_SYNC`: `cuMemFree` does not synchronize (the driver says it
    /// *may*), so a caller relying on it frees memory queued work still uses.
    pub(crate) free_without_sync: bool,
    /// Per device, the sticky error its context hit (`gpualloc_emu_fault_stream_code`; 0:
    /// none): every call that needs the context fails with it and no host function runs, for
    /// the life of the process (releasing the primary context does not clear it: the driver's
    /// docs say the process must be relaunched).
    pub(crate) faulted: Vec<std::sync::atomic::AtomicU32>,
    /// Device memory a retained primary context takes (`GPUALLOC_EMU_CONTEXT_MIB`, default
    /// [`CONTEXT_MIB`]): held from the first retain to the last release, so it shows in
    /// `cuMemGetInfo` and in what is left to allocate, as a real context's code, heap and
    /// local memory do.
    pub(crate) context_bytes: u64,
    /// The sim allocation standing for each retained primary context's memory.
    pub(crate) context_memory: Mutex<HashMap<u32, gpualloc_runtime::DevicePtr>>,
}

/// What a primary context costs in device memory by default, in MiB. A CUDA 12 context with
/// lazy module loading takes a few hundred MiB on a data-center GPU; the figure is round and
/// small enough for tests' emulated devices.
pub const CONTEXT_MIB: u64 = 64;

static EMU: OnceLock<Emu> = OnceLock::new();

/// Where the emulator's `CUstream` values start (a stream's is this plus its sim id).
pub(crate) const STREAM_HANDLE_BASE: u64 = 0x5_0000_0000;

/// Where the emulator's `CUevent` values start.
pub(crate) const EVENT_HANDLE_BASE: u64 = 0x6_0000_0000;

/// Handle values of one kind: fresh ones from `base` on, and those of destroyed objects again
/// (the driver reuses its pointers: a stale handle may name a newer object).
#[derive(Debug)]
pub(crate) struct HandleValues {
    next: u64,
    free: Vec<u64>,
}

impl HandleValues {
    fn new(base: u64) -> Self {
        HandleValues {
            next: base,
            free: Vec::new(),
        }
    }

    /// A value for a new object: the most recently given back, else a fresh one.
    pub(crate) fn take(&mut self) -> u64 {
        self.free.pop().unwrap_or_else(|| {
            self.next += 8;
            self.next
        })
    }

    /// The object named `value` was destroyed.
    pub(crate) fn give(&mut self, value: u64) {
        self.free.push(value);
    }
}

/// `CU_STREAM_LEGACY`: the legacy default stream, named explicitly.
pub(crate) const CU_STREAM_LEGACY: usize = 0x1;
/// `CU_STREAM_PER_THREAD`: the calling thread's own default stream.
pub(crate) const CU_STREAM_PER_THREAD: usize = 0x2;

thread_local! {
    /// This thread's per-thread default streams (`CU_STREAM_PER_THREAD`), by device.
    static PER_THREAD: std::cell::RefCell<HashMap<u32, StreamHandle>> =
        std::cell::RefCell::new(HashMap::new());
    /// The device whose primary context is current on this thread.
    static CURRENT: Cell<Option<u32>> = const { Cell::new(None) };
    /// True while this thread runs a host function (which may not call the driver).
    static IN_HOST_FN: Cell<bool> = const { Cell::new(false) };
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// `cuInit`: builds the simulated GPU once.
pub(crate) fn init() -> Result<(), CUresult> {
    if EMU.get().is_some() {
        return Ok(());
    }
    if std::env::var_os("GPUALLOC_FORBID_EMULATOR").is_some() {
        // A run on a real GPU (scripts/gpu-check.sh) must never load the test double.
        eprintln!("gpualloc emulated CUDA driver loaded although GPUALLOC_FORBID_EMULATOR is set");
        return Err(CUDA_ERROR_NOT_PERMITTED);
    }
    let devices = u32::try_from(env_u64("GPUALLOC_EMU_DEVICES", 1)).unwrap_or(1);
    if devices == 0 {
        return Err(CUDA_ERROR_NO_DEVICE);
    }
    let faults =
        Faults::parse(&std::env::var("GPUALLOC_EMU_FAULTS").unwrap_or_default()).map_err(|e| {
            eprintln!("gpualloc emulated CUDA driver: GPUALLOC_EMU_FAULTS: {e}");
            CUDA_ERROR_INVALID_VALUE
        })?;
    let latency = match std::env::var("GPUALLOC_EMU_LATENCY").as_deref() {
        Ok("hardware") => LatencyModel::default(),
        Ok("zero") | Err(_) => LatencyModel::zero(),
        Ok(other) => {
            eprintln!("gpualloc emulated CUDA driver: GPUALLOC_EMU_LATENCY={other}: expected hardware or zero");
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
    };
    let config = SimConfig {
        devices,
        capacity_per_device: env_u64("GPUALLOC_EMU_MEMORY_MIB", 16 << 10) << 20,
        latency,
        ..SimConfig::default()
    };
    let sim = SimBackend::new(config).map_err(crate::errors::sim_err)?;
    let free_without_sync = std::env::var_os("GPUALLOC_EMU_FREE_NO_SYNC").is_some();
    let _ = EMU.set(Emu {
        pinned: Mutex::new(Vec::new()),
        vmm_access: Mutex::new(std::collections::BTreeMap::new()),
        peer_access: Mutex::new(std::collections::HashSet::new()),
        exclusive_dir: std::env::var_os("GPUALLOC_EMU_EXCLUSIVE_PROCESS").map(Into::into),
        exclusive_locks: Mutex::new(HashMap::new()),
        ipc_opened: Mutex::new(HashMap::new()),
        pageable_copies: std::sync::atomic::AtomicU64::new(0),
        free_without_sync,
        faulted: (0..devices)
            .map(|_| std::sync::atomic::AtomicU32::new(0))
            .collect(),
        pid: std::process::id(),
        blocking_events: Mutex::new(std::collections::HashSet::new()),
        spinning_waits: std::sync::atomic::AtomicU64::new(0),
        forked_calls: std::sync::atomic::AtomicU64::new(0),
        sim,
        devices,
        retained: Mutex::new(vec![0; devices as usize]),
        default_streams: Mutex::new(HashMap::new()),
        streams: Mutex::new(HashMap::new()),
        events: Mutex::new(HashMap::new()),
        stream_values: Mutex::new(HandleValues::new(STREAM_HANDLE_BASE)),
        event_values: Mutex::new(HandleValues::new(EVENT_HANDLE_BASE)),
        phys: Mutex::new(HashMap::new()),
        faults,
        context_bytes: env_u64("GPUALLOC_EMU_CONTEXT_MIB", CONTEXT_MIB) << 20,
        context_memory: Mutex::new(HashMap::new()),
    });
    Ok(())
}

/// What an entry point needs: just the emulator, or also the thread's current context.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Needs {
    Init,
    Context,
}

/// Runs the body of driver entry point `name`: refuses calls from a host function
/// (`CUDA_ERROR_NOT_PERMITTED`), before `cuInit` (`CUDA_ERROR_NOT_INITIALIZED`), and, where
/// a context is needed, without a current one (`CUDA_ERROR_INVALID_CONTEXT`); a panic is
/// `CUDA_ERROR_UNKNOWN`, never an unwind into C.
pub(crate) fn call(
    name: &'static str,
    needs: Needs,
    body: impl FnOnce(&Emu, DeviceId) -> Result<(), CUresult>,
) -> CUresult {
    let run = || {
        if IN_HOST_FN.with(Cell::get) {
            return Err(CUDA_ERROR_NOT_PERMITTED);
        }
        let emu = EMU.get().ok_or(CUDA_ERROR_NOT_INITIALIZED)?;
        // The driver's state does not survive a fork: a child's calls fail with the
        // initialization error (the driver's own answer), and are counted for tests.
        if std::process::id() != emu.pid {
            emu.forked_calls
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            return Err(CUDA_ERROR_NOT_INITIALIZED);
        }
        let device = match needs {
            Needs::Init => DeviceId(0),
            Needs::Context => {
                // The current context must still be retained (a released primary context
                // is destroyed under the thread that had it current).
                let d = current().ok_or(CUDA_ERROR_INVALID_CONTEXT)?;
                if lock(&emu.retained).get(d as usize).copied().unwrap_or(0) == 0 {
                    return Err(CUDA_ERROR_INVALID_CONTEXT);
                }
                if let Some(code) = emu.sticky(d) {
                    return Err(code);
                }
                DeviceId(d)
            }
        };
        emu.faults.check(name)?;
        body(emu, device)
    };
    match catch_unwind(AssertUnwindSafe(run)) {
        Ok(Ok(())) => CUDA_SUCCESS,
        Ok(Err(code)) => {
            tracing::debug!(function = name, code, "emulated driver call failed");
            code
        }
        Err(_) => {
            tracing::error!(function = name, "emulated driver call panicked");
            CUDA_ERROR_UNKNOWN
        }
    }
}

/// The emulator, once `cuInit` succeeded.
pub(crate) fn emu() -> Option<&'static Emu> {
    EMU.get()
}

/// True once `cuInit` succeeded.
pub(crate) fn initialized() -> bool {
    EMU.get().is_some()
}

pub(crate) fn current() -> Option<u32> {
    CURRENT.with(Cell::get)
}

pub(crate) fn set_current(device: Option<u32>) {
    CURRENT.with(|c| c.set(device));
}

/// Marks this thread as running a host function while `f` runs.
pub(crate) fn in_host_fn<R>(f: impl FnOnce() -> R) -> R {
    IN_HOST_FN.with(|c| c.set(true));
    let r = f();
    IN_HOST_FN.with(|c| c.set(false));
    r
}

/// Writes `value` through an out-pointer, or `CUDA_ERROR_INVALID_VALUE` for null.
pub(crate) fn out<T>(ptr: *mut T, value: T) -> Result<(), CUresult> {
    if ptr.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: non-null, and the driver API's contract is that an out-pointer points to
    // writable storage of its type.
    unsafe { ptr.write(value) };
    Ok(())
}

/// The context value of `device`'s primary context: an opaque, non-null tag.
pub(crate) fn context_of(device: u32) -> CUcontext {
    (0x1000 + device as usize * 0x10) as CUcontext
}

/// The device of a context value, if it is one of ours.
pub(crate) fn device_of_context(ctx: CUcontext, devices: u32) -> Option<u32> {
    let v = (ctx as usize).checked_sub(0x1000)?;
    (v % 0x10 == 0 && v / 0x10 < devices as usize).then_some((v / 0x10) as u32)
}

impl Emu {
    /// The sticky error device `d`'s context hit, if any.
    pub(crate) fn sticky(&self, d: u32) -> Option<CUresult> {
        self.faulted
            .get(d as usize)
            .map(|f| f.load(std::sync::atomic::Ordering::Acquire))
            .filter(|code| *code != 0)
    }

    /// True once device `d`'s context hit a sticky error.
    pub(crate) fn is_faulted(&self, d: u32) -> bool {
        self.sticky(d).is_some()
    }

    /// Device `d`'s context hits sticky error `code` (the first one stays: it is what every
    /// later call reports).
    pub(crate) fn fault(&self, d: u32, code: CUresult, why: &str) {
        tracing::info!(device = d, code, why, "emulated device fault: sticky error");
        if let Some(slot) = self.faulted.get(d as usize) {
            let _ = slot.compare_exchange(
                0,
                code,
                std::sync::atomic::Ordering::AcqRel,
                std::sync::atomic::Ordering::Acquire,
            );
        }
    }

    /// Fails with the sticky error of the object's device `d`, if its context hit one: a call
    /// on a stream or event reports its own context's error, whichever context is current.
    pub(crate) fn object_ok(&self, d: DeviceId) -> Result<(), CUresult> {
        match self.sticky(d.0) {
            Some(code) => Err(code),
            None => Ok(()),
        }
    }

    /// Work of `device` touching device memory `[addr, addr + n)`: it must be live device
    /// memory that `device` may reach. Otherwise it is what a kernel or copy engine touching
    /// freed, unmapped or inaccessible memory does on a GPU: an illegal-address fault, sticky
    /// for the context (the driver reports it at this or a later call; the emulator at once).
    pub(crate) fn device_work(&self, addr: u64, n: u64, device: DeviceId) -> Result<(), CUresult> {
        if n == 0 {
            return Ok(());
        }
        let why = if !self.sim.device_memory_covers(addr, n) {
            "work on memory that is not live device memory (freed, unmapped or never allocated)"
        } else if !self.accessible(addr, n, device) {
            "work on a virtual-memory mapping without access for the device running it"
        } else {
            return Ok(());
        };
        self.fault(device.0, CUDA_ERROR_ILLEGAL_ADDRESS, why);
        Err(CUDA_ERROR_ILLEGAL_ADDRESS)
    }

    /// The primary context of device `d` was retained for the first time: its memory is taken.
    pub(crate) fn take_context_memory(&self, d: u32) -> Result<(), CUresult> {
        if self.context_bytes == 0 {
            return Ok(());
        }
        use gpualloc_runtime::Backend;
        let p = self
            .sim
            .malloc(DeviceId(d), self.context_bytes)
            .map_err(crate::errors::sim_err)?;
        lock(&self.context_memory).insert(d, p);
        Ok(())
    }

    /// The primary context of device `d` was released for the last time.
    pub(crate) fn give_context_memory(&self, d: u32) {
        if let Some(p) = lock(&self.context_memory).remove(&d) {
            let _ = self.sim.free_without_sync(DeviceId(d), p);
        }
    }

    /// The sim stream behind a `CUstream` (null: `device`'s default stream).
    pub(crate) fn stream(&self, s: CUstream, device: DeviceId) -> Result<StreamHandle, CUresult> {
        if s as usize == CU_STREAM_PER_THREAD {
            // Each thread's own default stream of the device, made on the thread's first use.
            let known = PER_THREAD.with(|m| m.borrow().get(&device.0).copied());
            if let Some(h) = known {
                return Ok(h);
            }
            let h = self.sim_stream_create(device)?;
            PER_THREAD.with(|m| m.borrow_mut().insert(device.0, h));
            return Ok(h);
        }
        if s.is_null() || s as usize == CU_STREAM_LEGACY {
            let mut defaults = lock(&self.default_streams);
            if let Some(h) = defaults.get(&device.0) {
                return Ok(*h);
            }
            let h = self.sim_stream_create(device)?;
            defaults.insert(device.0, h);
            return Ok(h);
        }
        let h = lock(&self.streams)
            .get(&(s as u64))
            .map(|e| e.handle)
            .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        self.object_ok(h.device)?;
        Ok(h)
    }

    /// The sim stream for new work on `s`, ordered as the legacy default stream is: work on
    /// the null stream first waits for all work queued on the device's blocking streams, and
    /// work on a blocking stream first waits for the work queued on the null stream.
    /// Non-blocking streams (`CU_STREAM_NON_BLOCKING`, as every stream cudarc and the CUDA
    /// backend create) are not ordered with it. Synchronize and query use [`Emu::stream`]:
    /// they add no work.
    pub(crate) fn work_stream(
        &self,
        s: CUstream,
        device: DeviceId,
    ) -> Result<StreamHandle, CUresult> {
        use gpualloc_runtime::Backend;
        let h = self.stream(s, device)?;
        let capturing = |h: StreamHandle| {
            self.sim
                .stream_capture_status(h)
                .is_ok_and(|c| c.is_capturing())
        };
        if s.is_null() || s as usize == CU_STREAM_LEGACY {
            let blocking: Vec<StreamHandle> = lock(&self.streams)
                .values()
                .filter(|e| e.blocking && e.handle.device == device)
                .map(|e| e.handle)
                .collect();
            // The driver: work on the legacy stream may not depend on a capturing blocking
            // stream (CUDA_ERROR_STREAM_CAPTURE_IMPLICIT).
            if blocking.iter().any(|b| capturing(*b)) {
                return Err(CUDA_ERROR_STREAM_CAPTURE_IMPLICIT);
            }
            for earlier in blocking {
                self.order_after(h, earlier)?;
            }
        } else if (s as usize == CU_STREAM_PER_THREAD
            || lock(&self.streams)
                .get(&(s as u64))
                .is_some_and(|e| e.blocking))
            // A capturing blocking stream's work does not wait for the legacy stream: that
            // would be a dependency on work outside the capture (only the stream's own order
            // crosses a capture's boundary).
            && !capturing(h)
        {
            // A per-thread default stream is ordered after the legacy one as a blocking stream
            // is (the legacy stream does not wait for per-thread ones here: a simplification
            // no test relies on).
            let legacy = lock(&self.default_streams).get(&h.device.0).copied();
            if let Some(legacy) = legacy {
                self.order_after(h, legacy)?;
            }
        }
        Ok(h)
    }

    /// In exclusive-process mode, takes device `d`'s lock for this process (a no-op when it
    /// already holds it, or outside that mode).
    pub(crate) fn claim_exclusive(&self, d: u32) -> Result<(), CUresult> {
        let Some(dir) = &self.exclusive_dir else {
            return Ok(());
        };
        let mut locks = lock(&self.exclusive_locks);
        if locks.contains_key(&d) {
            return Ok(());
        }
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(dir.join(format!("device-{d}.lock")))
            .map_err(|_| CUDA_ERROR_UNKNOWN)?;
        rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive)
            .map_err(|_| CUDA_ERROR_DEVICE_UNAVAILABLE)?;
        locks.insert(d, file);
        Ok(())
    }

    /// Gives device `d`'s exclusive-process lock back (its primary context is gone).
    pub(crate) fn release_exclusive(&self, d: u32) {
        lock(&self.exclusive_locks).remove(&d);
    }

    /// Whether work of `device` may touch `[addr, addr + n)`: outside virtual-memory mappings
    /// always (ordinary allocations follow peer access, which the emulator does not limit);
    /// inside, only where `cuMemSetAccess` named the device ([`Emu::device_work`] turns a
    /// `false` into the context's sticky fault).
    fn accessible(&self, addr: u64, n: u64, device: DeviceId) -> bool {
        let end = addr.saturating_add(n.max(1));
        let maps = lock(&self.vmm_access);
        let first = maps
            .range(..=addr)
            .next_back()
            .map(|(s, _)| *s)
            .unwrap_or(addr);
        maps.range(first..end).all(|(start, (len, mask))| {
            let overlaps = *start < end && start + len > addr;
            !overlaps || mask & (1u64 << device.0.min(63)) != 0
        })
    }

    /// Counts an async copy whose host side `[p, p + n)` is not pinned for `device`'s context.
    pub(crate) fn note_host_side(&self, p: usize, n: usize, device: DeviceId) {
        let pinned = lock(&self.pinned).iter().any(|r| {
            p >= r.start && p + n <= r.start + r.len && (r.portable || r.device == device.0)
        });
        if !pinned {
            self.pageable_copies
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// Work queued on `later` from now on waits for the work queued on `earlier` so far.
    fn order_after(&self, later: StreamHandle, earlier: StreamHandle) -> Result<(), CUresult> {
        use gpualloc_runtime::Backend;
        let e = self
            .sim
            .event_create(earlier.device)
            .map_err(crate::errors::sim_err)?;
        let ordered = self
            .sim
            .event_record(e, earlier)
            .and_then(|()| self.sim.stream_wait_event(later, e));
        // The wait holds what it needs of the event; destroying it now is legal.
        let _ = self.sim.event_destroy(e);
        ordered.map_err(crate::errors::sim_err)
    }

    fn sim_stream_create(&self, device: DeviceId) -> Result<StreamHandle, CUresult> {
        use gpualloc_runtime::Backend;
        self.sim
            .stream_create(device)
            .map_err(crate::errors::sim_err)
    }

    pub(crate) fn event(&self, e: CUevent) -> Result<EventHandle, CUresult> {
        let h = lock(&self.events)
            .get(&(e as u64))
            .copied()
            .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        self.object_ok(h.device)?;
        Ok(h)
    }
}

/// One mapping opened by `cuIpcOpenMemHandle`. The driver counts opens of a handle per
/// context: "If the handle was already opened by the current context, the reference count on
/// the handle is incremented by 1 and the existing device pointer is returned", and each
/// `cuIpcCloseMemHandle` decrements it; the mapping goes at zero.
#[derive(Debug, Clone, Copy)]
pub(crate) struct IpcOpened {
    /// The device whose context opened it (only that context may close it).
    pub opener: u32,
    /// The device whose memory it is (what `CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL` reports).
    pub owner: u32,
    /// The handle's bytes.
    pub handle: [u8; 64],
    /// Opens not yet closed.
    pub count: u32,
}
