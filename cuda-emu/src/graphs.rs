//! Stream capture and graphs: `cuStreamBeginCapture_v2`, `cuStreamEndCapture`,
//! `cuStreamIsCapturing`, `cuStreamGetCaptureInfo(_v2)`, `cuThreadExchangeStreamCaptureMode`,
//! `cuGraphInstantiateWithFlags`, `cuGraphLaunch`, `cuGraphDestroy`, `cuGraphExecDestroy`.
//!
//! The sim keeps the captures and their rules (`gpualloc_sim`'s `capture` module): unsafe
//! calls refused by the thread's mode, each invalidating the capture; synchronizing or
//! querying a capturing stream; captured events; isolation, merge, unmatched, unjoined and
//! wrong-thread ends, each with the driver's code. Here: the C signatures, the legacy default
//! stream (it cannot be captured, and a blocking stream's capture keeps it out: 906), and the
//! handles. `CUgraph` and `CUgraphExec` values are the sim's ids (never null), with the
//! device they belong to.
//!
//! Stricter than the driver, said plainly: instantiation flags are refused
//! (`CUDA_ERROR_NOT_SUPPORTED`: no auto-free, upload or device launch); `cuStreamGetCaptureInfo_v2`
//! answers the status and id only, and refuses (`CUDA_ERROR_NOT_SUPPORTED`) a caller that
//! asks for the graph being built or its dependencies; a host function cannot be captured
//! (the sim runs a host function once: `CUDA_ERROR_NOT_SUPPORTED`, the capture goes on).

use std::collections::HashMap;
use std::ffi::{c_uint, c_ulonglong};
use std::sync::{Mutex, OnceLock};

use gpualloc_runtime::capture::{CaptureMode, CaptureStatus, GraphExecHandle, GraphHandle};
use gpualloc_runtime::types::DeviceId;
use gpualloc_runtime::Backend;

use crate::abi::*;
use crate::errors::sim_err;
use crate::state::{call, lock, out, Emu, Needs, CU_STREAM_LEGACY, CU_STREAM_PER_THREAD};

/// Graphs and instantiations alive, by value, with their device.
#[derive(Default)]
struct Handles {
    graphs: HashMap<u64, DeviceId>,
    execs: HashMap<u64, DeviceId>,
}

fn handles() -> &'static Mutex<Handles> {
    static HANDLES: OnceLock<Mutex<Handles>> = OnceLock::new();
    HANDLES.get_or_init(Default::default)
}

/// `CUstreamCaptureMode` as the sim's mode.
fn mode_of(mode: c_uint) -> Result<CaptureMode, CUresult> {
    match mode {
        0 => Ok(CaptureMode::Global),
        1 => Ok(CaptureMode::ThreadLocal),
        2 => Ok(CaptureMode::Relaxed),
        _ => Err(CUDA_ERROR_INVALID_VALUE),
    }
}

fn mode_value(mode: CaptureMode) -> c_uint {
    match mode {
        CaptureMode::Global => 0,
        CaptureMode::ThreadLocal => 1,
        CaptureMode::Relaxed => 2,
    }
}

/// `CUstreamCaptureStatus`: none 0, active 1, invalidated 2.
fn status_value(status: CaptureStatus) -> c_uint {
    match status {
        CaptureStatus::None => 0,
        CaptureStatus::Active { .. } => 1,
        CaptureStatus::Invalidated { .. } => 2,
    }
}

fn is_default_stream(stream: CUstream) -> bool {
    stream.is_null()
        || stream as usize == CU_STREAM_LEGACY
        || stream as usize == CU_STREAM_PER_THREAD
}

/// The capture status of `stream` (the legacy and per-thread default streams never capture).
fn status_of(emu: &Emu, stream: CUstream, d: DeviceId) -> Result<CaptureStatus, CUresult> {
    if is_default_stream(stream) {
        return Ok(CaptureStatus::None);
    }
    let s = emu.stream(stream, d)?;
    emu.sim.stream_capture_status(s).map_err(sim_err)
}

/// `cuStreamBeginCapture_v2`: the default streams cannot be captured.
#[no_mangle]
pub extern "C" fn cuStreamBeginCapture_v2(stream: CUstream, mode: c_uint) -> CUresult {
    call("cuStreamBeginCapture_v2", Needs::Context, |emu, d| {
        let mode = mode_of(mode)?;
        if is_default_stream(stream) {
            return Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
        }
        let s = emu.stream(stream, d)?;
        emu.sim.stream_begin_capture(s, mode).map_err(sim_err)
    })
}

/// `cuStreamEndCapture`: `*ph_graph` is null when the capture fails.
///
/// # Safety
/// `ph_graph` must be null or writable.
#[no_mangle]
pub unsafe extern "C" fn cuStreamEndCapture(stream: CUstream, ph_graph: *mut CUgraph) -> CUresult {
    call("cuStreamEndCapture", Needs::Context, |emu, d| {
        if ph_graph.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        out(ph_graph, std::ptr::null_mut())?;
        if is_default_stream(stream) {
            return Err(CUDA_ERROR_ILLEGAL_STATE);
        }
        let s = emu.stream(stream, d)?;
        let g = emu.sim.stream_end_capture(s).map_err(sim_err)?;
        lock(handles()).graphs.insert(g.raw, g.device);
        out(ph_graph, g.raw as CUgraph)
    })
}

/// `cuStreamIsCapturing`.
///
/// # Safety
/// `status` must be null or writable.
#[no_mangle]
pub unsafe extern "C" fn cuStreamIsCapturing(stream: CUstream, status: *mut c_uint) -> CUresult {
    call("cuStreamIsCapturing", Needs::Context, |emu, d| {
        let st = status_of(emu, stream, d)?;
        out(status, status_value(st))
    })
}

/// `cuStreamGetCaptureInfo` (the status and the capture's id; the id is left as it is when
/// the stream does not capture).
///
/// # Safety
/// `status` must be null or writable; `id` null or writable.
#[no_mangle]
pub unsafe extern "C" fn cuStreamGetCaptureInfo(
    stream: CUstream,
    status: *mut c_uint,
    id: *mut u64,
) -> CUresult {
    call("cuStreamGetCaptureInfo", Needs::Context, |emu, d| {
        let st = status_of(emu, stream, d)?;
        out(status, status_value(st))?;
        match (st.id(), id.is_null()) {
            (Some(v), false) => out(id, v),
            _ => Ok(()),
        }
    })
}

/// `cuStreamGetCaptureInfo_v2`: the status and id; asking for the graph being built or its
/// dependencies is `CUDA_ERROR_NOT_SUPPORTED` (never a made-up answer).
///
/// # Safety
/// Every non-null pointer must be writable.
#[no_mangle]
pub unsafe extern "C" fn cuStreamGetCaptureInfo_v2(
    stream: CUstream,
    status: *mut c_uint,
    id: *mut u64,
    graph_out: *mut CUgraph,
    dependencies_out: *mut *const std::ffi::c_void,
    count_out: *mut usize,
) -> CUresult {
    if !graph_out.is_null() || !dependencies_out.is_null() || !count_out.is_null() {
        crate::unsupported::once("cuStreamGetCaptureInfo_v2 (graph or dependencies)");
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    // SAFETY: forwarded with the caller's guarantee.
    unsafe { cuStreamGetCaptureInfo(stream, status, id) }
}

/// `cuThreadExchangeStreamCaptureMode`.
///
/// # Safety
/// `mode` must be null or point to a readable and writable mode.
#[no_mangle]
pub unsafe extern "C" fn cuThreadExchangeStreamCaptureMode(mode: *mut c_uint) -> CUresult {
    call(
        "cuThreadExchangeStreamCaptureMode",
        Needs::Init,
        |emu, _| {
            if mode.is_null() {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
            // SAFETY: non-null, and the caller's contract makes it readable.
            let wanted = mode_of(unsafe { mode.read() })?;
            let before = emu.sim.exchange_capture_mode(wanted).map_err(sim_err)?;
            out(mode, mode_value(before))
        },
    )
}

/// `cuGraphInstantiateWithFlags` (flags must be 0).
///
/// # Safety
/// `ph_exec` must be null or writable.
#[no_mangle]
pub unsafe extern "C" fn cuGraphInstantiateWithFlags(
    ph_exec: *mut CUgraphExec,
    graph: CUgraph,
    flags: c_ulonglong,
) -> CUresult {
    call("cuGraphInstantiateWithFlags", Needs::Context, |emu, _| {
        if flags != 0 {
            crate::unsupported::once("cuGraphInstantiateWithFlags (flags)");
            return Err(CUDA_ERROR_NOT_SUPPORTED);
        }
        let device = *lock(handles())
            .graphs
            .get(&(graph as u64))
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let exec = emu
            .sim
            .graph_instantiate(GraphHandle {
                device,
                raw: graph as u64,
            })
            .map_err(sim_err)?;
        lock(handles()).execs.insert(exec.raw, device);
        out(ph_exec, exec.raw as CUgraphExec)
    })
}

/// `cuGraphLaunch`: the whole graph, in stream order on `stream`.
#[no_mangle]
pub extern "C" fn cuGraphLaunch(exec: CUgraphExec, stream: CUstream) -> CUresult {
    call("cuGraphLaunch", Needs::Context, |emu, d| {
        let device = *lock(handles())
            .execs
            .get(&(exec as u64))
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let s = emu.work_stream(stream, d)?;
        if s.device != device {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let h = GraphExecHandle {
            device,
            raw: exec as u64,
        };
        emu.sim.graph_launch(h, s).map_err(sim_err)
    })
}

/// `cuGraphDestroy`: its instantiations live on.
#[no_mangle]
pub extern "C" fn cuGraphDestroy(graph: CUgraph) -> CUresult {
    call("cuGraphDestroy", Needs::Init, |emu, _| {
        let device = lock(handles())
            .graphs
            .remove(&(graph as u64))
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let h = GraphHandle {
            device,
            raw: graph as u64,
        };
        emu.sim.graph_destroy(h).map_err(sim_err)
    })
}

/// `cuGraphExecDestroy`: launches already enqueued still run.
#[no_mangle]
pub extern "C" fn cuGraphExecDestroy(exec: CUgraphExec) -> CUresult {
    call("cuGraphExecDestroy", Needs::Init, |emu, _| {
        let device = lock(handles())
            .execs
            .remove(&(exec as u64))
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let h = GraphExecHandle {
            device,
            raw: exec as u64,
        };
        emu.sim.graph_exec_destroy(h).map_err(sim_err)
    })
}
