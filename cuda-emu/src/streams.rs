//! Streams, events and host functions.

use std::ffi::{c_int, c_uint, c_void};

use gpualloc_runtime::Backend;

use crate::abi::*;
use crate::errors::sim_err;
use crate::state::{call, in_host_fn, lock, out, EmuStream, Needs};

/// `cuStreamCreate` (flags: default, which orders the stream with the legacy default stream
/// as the driver does, or `CU_STREAM_NON_BLOCKING`; see `Emu::work_stream`).
///
/// # Safety
/// `ph_stream` must be null or writable.
#[no_mangle]
pub unsafe extern "C" fn cuStreamCreate(ph_stream: *mut CUstream, flags: c_uint) -> CUresult {
    call("cuStreamCreate", Needs::Context, |emu, d| {
        if flags & !CU_STREAM_NON_BLOCKING != 0 || ph_stream.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let h = emu.sim.stream_create(d).map_err(sim_err)?;
        let blocking = flags & CU_STREAM_NON_BLOCKING == 0;
        // Like a driver's pointer, the handle is never null, CU_STREAM_LEGACY (0x1) or
        // CU_STREAM_PER_THREAD (0x2), and a destroyed stream's value is used again.
        let cu = lock(&emu.stream_values).take();
        lock(&emu.streams).insert(
            cu,
            EmuStream {
                handle: h,
                blocking,
            },
        );
        out(ph_stream, cu as CUstream)
    })
}

/// `cuStreamCreateWithPriority` (the priority is accepted and ignored).
///
/// # Safety
/// `ph_stream` must be null or writable.
#[no_mangle]
pub unsafe extern "C" fn cuStreamCreateWithPriority(
    ph_stream: *mut CUstream,
    flags: c_uint,
    _priority: c_int,
) -> CUresult {
    // SAFETY: forwarded with the caller's guarantee.
    unsafe { cuStreamCreate(ph_stream, flags) }
}

/// `cuStreamDestroy_v2`: legal with work pending (it completes first).
#[no_mangle]
pub extern "C" fn cuStreamDestroy_v2(stream: CUstream) -> CUresult {
    call("cuStreamDestroy_v2", Needs::Context, |emu, _| {
        if stream.is_null() {
            return Err(CUDA_ERROR_INVALID_HANDLE);
        }
        let h = lock(&emu.streams)
            .remove(&(stream as u64))
            .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        lock(&emu.stream_values).give(stream as u64);
        // Docs: "In case the device is still doing work in the stream hStream when
        // cuStreamDestroy() is called, the function will return immediately and the resources
        // associated with hStream will be released automatically once the device has
        // completed all work in hStream." The sim's destroy waits for the stream's work: it
        // runs on a thread of its own, and this call returns at once.
        let sim = emu.sim.clone();
        let spawned = std::thread::Builder::new()
            .name("cuda-emu-stream-destroy".into())
            .spawn(move || {
                if let Err(e) = sim.stream_destroy(h.handle) {
                    tracing::warn!(error = %e, "emulated stream destroy failed");
                }
            });
        if spawned.is_err() {
            emu.sim.stream_destroy(h.handle).map_err(sim_err)?;
        }
        Ok(())
    })
}

/// `cuStreamSynchronize`.
#[no_mangle]
pub extern "C" fn cuStreamSynchronize(stream: CUstream) -> CUresult {
    call("cuStreamSynchronize", Needs::Context, |emu, d| {
        let s = emu.stream(stream, d)?;
        emu.sim.stream_synchronize(s).map_err(sim_err)
    })
}

/// `cuStreamQuery`: `CUDA_ERROR_NOT_READY` while work is queued.
#[no_mangle]
pub extern "C" fn cuStreamQuery(stream: CUstream) -> CUresult {
    call("cuStreamQuery", Needs::Context, |emu, d| {
        let s = emu.stream(stream, d)?;
        // Through the trait: a capturing stream's query is refused (and invalidates it).
        match emu.sim.stream_query(s).map_err(sim_err)? {
            true => Ok(()),
            false => Err(CUDA_ERROR_NOT_READY),
        }
    })
}

/// Not a driver function: the streams created and not yet destroyed, in every context (for
/// tests: a destroy the driver refused leaves one behind). Tests reach it through `dlsym`.
#[no_mangle]
pub extern "C" fn gpualloc_emu_live_streams() -> u64 {
    crate::state::emu().map_or(0, |e| lock(&e.streams).len() as u64)
}

/// Not a driver function: host waits (`cuEventSynchronize`) on events created without
/// `CU_EVENT_BLOCKING_SYNC`, each a spinning wait on a driver. Tests reach it through `dlsym`.
#[no_mangle]
pub extern "C" fn gpualloc_emu_spinning_waits() -> u64 {
    crate::state::emu().map_or(0, |e| {
        e.spinning_waits.load(std::sync::atomic::Ordering::Relaxed)
    })
}

/// Not a driver function: the driver calls a forked child made (each refused with
/// `CUDA_ERROR_NOT_INITIALIZED`). Tests reach it through `dlsym`.
#[no_mangle]
pub extern "C" fn gpualloc_emu_calls_in_forked_child() -> u64 {
    crate::state::emu().map_or(0, |e| {
        e.forked_calls.load(std::sync::atomic::Ordering::Relaxed)
    })
}

/// `cuStreamWaitEvent`.
#[no_mangle]
pub extern "C" fn cuStreamWaitEvent(stream: CUstream, event: CUevent, flags: c_uint) -> CUresult {
    call("cuStreamWaitEvent", Needs::Context, |emu, d| {
        if flags != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let s = emu.work_stream(stream, d)?;
        let e = emu.event(event)?;
        emu.sim.stream_wait_event(s, e).map_err(sim_err)
    })
}

/// A host function's user data, handed to the stream's thread as the driver does.
struct UserData(*mut c_void);
// SAFETY: the driver API passes `userData` to another thread by contract; what it points to
// is the caller's to make safe to use from there.
unsafe impl Send for UserData {}

/// A job for the callback thread.
type CallbackJob = Box<dyn FnOnce() + Send>;

/// The driver's callback thread: host functions of every stream of every context run on it,
/// one at a time. The driver's docs: host functions "without a mandated order (in
/// independent streams) execute in undefined order and may be serialized" — real drivers do
/// serialize them, so a host function that blocks stalls every stream's host functions, and
/// the emulator does the same (a stream waits at its host function until it has run).
fn on_callback_thread(job: impl FnOnce() + Send + 'static) {
    static CALLBACKS: std::sync::OnceLock<Option<std::sync::mpsc::Sender<CallbackJob>>> =
        std::sync::OnceLock::new();
    let sender = CALLBACKS.get_or_init(|| {
        let (tx, rx) = std::sync::mpsc::channel::<CallbackJob>();
        std::thread::Builder::new()
            .name("cuda-emu-callbacks".into())
            .spawn(move || {
                for job in rx {
                    // A panicking host function must not take the thread (and every later
                    // host function) with it.
                    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
                }
            })
            .ok()
            .map(|_| tx)
    });
    let Some(sender) = sender else {
        // No callback thread could be started: run it here (the stream's own thread).
        job();
        return;
    };
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let sent = sender.send(Box::new(move || {
        job();
        let _ = done_tx.send(());
    }));
    if sent.is_ok() {
        let _ = done_rx.recv();
    }
}

/// `cuLaunchHostFunc`: `f` runs after the work before it on the stream, on the emulator's
/// one callback thread (shared by every stream, see `on_callback_thread`), and may not call
/// the driver (such calls return `CUDA_ERROR_NOT_PERMITTED`). Once the context has hit a
/// sticky error (`gpualloc_emu_fault_stream`) it never runs, as on the driver, and
/// `user_data` is never given back.
#[no_mangle]
pub extern "C" fn cuLaunchHostFunc(
    stream: CUstream,
    f: CUhostFn,
    user_data: *mut c_void,
) -> CUresult {
    call("cuLaunchHostFunc", Needs::Context, |emu, d| {
        let f = f.ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let s = emu.work_stream(stream, d)?;
        // A launch goes to a stream of the current context (the programming guide: "A kernel
        // launch will fail if it is issued to a stream that is not associated to the current
        // device"); the emulator holds host-function launches to the same rule.
        if s.device != d {
            return Err(CUDA_ERROR_INVALID_HANDLE);
        }
        let data = UserData(user_data);
        emu.sim
            .launch_host_func(
                s,
                Box::new(move |_| {
                    let data = data;
                    on_callback_thread(move || {
                        let data = data;
                        if crate::state::emu().is_some_and(|e| e.is_faulted(d.0)) {
                            return;
                        }
                        // SAFETY: calling the user's host function with its own data, as the
                        // driver does; its safety is the caller's contract.
                        in_host_fn(|| unsafe { f(data.0) });
                    });
                }),
            )
            .map_err(sim_err)
    })
}

/// Not a driver function: [`gpualloc_emu_fault_stream_code`] with
/// `CUDA_ERROR_ILLEGAL_ADDRESS`, the most common kernel fault. Tests reach it through `dlsym`.
#[no_mangle]
pub extern "C" fn gpualloc_emu_fault_stream(stream: CUstream) -> CUresult {
    gpualloc_emu_fault_stream_code(stream, CUDA_ERROR_ILLEGAL_ADDRESS)
}

/// Not a driver function: queues on `stream` what a faulting kernel does. When the stream
/// reaches it, the context of the current device hits sticky error `code` (one of
/// [`STICKY_CODES`]: 710 is a device-side `assert`): from then on every call that needs that
/// context fails with it, for the life of the process (releasing the primary context does
/// not clear it), and no host function queued on any of its streams runs (work before it
/// completes). Another code is `CUDA_ERROR_INVALID_VALUE`. Tests reach it through `dlsym`.
#[no_mangle]
pub extern "C" fn gpualloc_emu_fault_stream_code(stream: CUstream, code: CUresult) -> CUresult {
    call(
        "gpualloc_emu_fault_stream_code",
        Needs::Context,
        |emu, d| {
            if !STICKY_CODES.contains(&code) {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
            let s = emu.work_stream(stream, d)?;
            if s.device != d {
                return Err(CUDA_ERROR_INVALID_HANDLE);
            }
            emu.sim
                .launch_host_func(
                    s,
                    Box::new(move |_| {
                        if let Some(emu) = crate::state::emu() {
                            emu.fault(d.0, code, "emulated kernel fault");
                        }
                    }),
                )
                .map_err(sim_err)
        },
    )
}

/// `cuEventCreate` (timing flags accepted; the emulator keeps no timestamps).
///
/// # Safety
/// `ph_event` must be null or writable.
#[no_mangle]
pub unsafe extern "C" fn cuEventCreate(ph_event: *mut CUevent, flags: c_uint) -> CUresult {
    call("cuEventCreate", Needs::Context, |emu, d| {
        if flags & !0x7 != 0 || ph_event.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let h = emu.sim.event_create(d).map_err(sim_err)?;
        // A destroyed event's value is used again, as the driver's pointers are.
        let cu = lock(&emu.event_values).take();
        lock(&emu.events).insert(cu, h);
        if flags & CU_EVENT_BLOCKING_SYNC != 0 {
            lock(&emu.blocking_events).insert(h.raw);
        }
        out(ph_event, cu as CUevent)
    })
}

/// `cuEventRecord`.
#[no_mangle]
pub extern "C" fn cuEventRecord(event: CUevent, stream: CUstream) -> CUresult {
    call("cuEventRecord", Needs::Context, |emu, d| {
        let e = emu.event(event)?;
        let s = emu.work_stream(stream, d)?;
        // The programming guide: "cudaEventRecord() will fail if the input event and input
        // stream are associated to different devices."
        if e.device != s.device {
            return Err(CUDA_ERROR_INVALID_HANDLE);
        }
        emu.sim.event_record(e, s).map_err(sim_err)
    })
}

/// `cuEventQuery`: `CUDA_ERROR_NOT_READY` until the stream has passed the event.
#[no_mangle]
pub extern "C" fn cuEventQuery(event: CUevent) -> CUresult {
    call("cuEventQuery", Needs::Context, |emu, _| {
        let e = emu.event(event)?;
        match emu.sim.event_query(e).map_err(sim_err)? {
            true => Ok(()),
            false => Err(CUDA_ERROR_NOT_READY),
        }
    })
}

/// `cuEventSynchronize`.
#[no_mangle]
pub extern "C" fn cuEventSynchronize(event: CUevent) -> CUresult {
    call("cuEventSynchronize", Needs::Context, |emu, _| {
        let e = emu.event(event)?;
        if !lock(&emu.blocking_events).contains(&e.raw) {
            // The driver busy-waits on such an event (a CPU core at 100% for the wait).
            emu.spinning_waits
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        emu.sim.event_synchronize(e).map_err(sim_err)
    })
}

/// `cuEventDestroy_v2`.
#[no_mangle]
pub extern "C" fn cuEventDestroy_v2(event: CUevent) -> CUresult {
    call("cuEventDestroy_v2", Needs::Context, |emu, _| {
        let e = lock(&emu.events)
            .remove(&(event as u64))
            .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        lock(&emu.blocking_events).remove(&e.raw);
        lock(&emu.event_values).give(event as u64);
        emu.sim.event_destroy(e).map_err(sim_err)
    })
}
