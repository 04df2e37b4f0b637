//! Stream capture at the emulated driver's C interface: what the conformance checks (through
//! the CUDA backend) cannot reach: the legacy default stream, the optional outputs of
//! `cuStreamGetCaptureInfo_v2`, instantiation flags, and null out-pointers. A binary of its
//! own: the null stream is one per device and process.

mod common;

use common::{bind, event, stream_with as stream};
use gpualloc_cuda_emu::*;

const NULL: CUstream = std::ptr::null_mut();

fn status(s: CUstream) -> u32 {
    let mut st = 99u32;
    // SAFETY: `st` is writable.
    assert_eq!(unsafe { cuStreamIsCapturing(s, &mut st) }, CUDA_SUCCESS);
    st
}

fn end(s: CUstream) -> (CUresult, CUgraph) {
    let mut g: CUgraph = 1 as CUgraph;
    // SAFETY: `g` is writable.
    let r = unsafe { cuStreamEndCapture(s, &mut g) };
    (r, g)
}

#[test]
fn the_legacy_stream_stays_out_of_captures() {
    bind();
    // It cannot be captured.
    assert_eq!(
        cuStreamBeginCapture_v2(NULL, 0),
        CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
    );
    assert_eq!(status(NULL), 0);
    // While a blocking stream captures, work on the legacy stream would depend on it.
    let blocking = stream(0);
    assert_eq!(cuStreamBeginCapture_v2(blocking, 2), CUDA_SUCCESS);
    let e = event();
    assert_eq!(cuEventRecord(e, NULL), CUDA_ERROR_STREAM_CAPTURE_IMPLICIT);
    // The blocking stream's own captured work does not wait for the legacy stream.
    assert_eq!(cuEventRecord(e, blocking), CUDA_SUCCESS);
    let (r, g) = end(blocking);
    assert_eq!(r, CUDA_SUCCESS);
    assert_eq!(cuGraphDestroy(g), CUDA_SUCCESS);
    // Once it ends, the legacy stream works again.
    assert_eq!(cuEventRecord(e, NULL), CUDA_SUCCESS);
    assert_eq!(cuEventDestroy_v2(e), CUDA_SUCCESS);
    assert_eq!(cuStreamDestroy_v2(blocking), CUDA_SUCCESS);
}

#[test]
fn capture_info_instantiation_flags_and_out_pointers_are_checked() {
    bind();
    let s = stream(CU_STREAM_NON_BLOCKING);
    assert_eq!(
        cuStreamBeginCapture_v2(s, 7),
        CUDA_ERROR_INVALID_VALUE,
        "unknown mode"
    );
    assert_eq!(cuStreamBeginCapture_v2(s, 0), CUDA_SUCCESS);
    assert_eq!(
        cuStreamBeginCapture_v2(s, 0),
        CUDA_ERROR_ILLEGAL_STATE,
        "already capturing"
    );
    assert_eq!(status(s), 1);
    let (mut st, mut id) = (0u32, 0u64);
    // SAFETY: both out-pointers are writable; the optional ones are null.
    let r = unsafe {
        cuStreamGetCaptureInfo_v2(
            s,
            &mut st,
            &mut id,
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
        )
    };
    assert_eq!((r, st), (CUDA_SUCCESS, 1));
    assert_ne!(id, 0);
    let mut graph_out: CUgraph = std::ptr::null_mut();
    // SAFETY: as above, and `graph_out` is writable.
    let r = unsafe {
        cuStreamGetCaptureInfo_v2(
            s,
            &mut st,
            &mut id,
            &mut graph_out,
            std::ptr::null_mut(),
            std::ptr::null_mut(),
        )
    };
    assert_eq!(r, CUDA_ERROR_NOT_SUPPORTED, "never a made-up graph");
    // A null out-pointer for the graph is refused, and the capture goes on.
    // SAFETY: null is allowed by the signature (the call refuses it).
    assert_eq!(
        unsafe { cuStreamEndCapture(s, std::ptr::null_mut()) },
        CUDA_ERROR_INVALID_VALUE
    );
    let (r, g) = end(s);
    assert_eq!(r, CUDA_SUCCESS);
    let mut exec: CUgraphExec = std::ptr::null_mut();
    // SAFETY: `exec` is writable.
    assert_eq!(
        unsafe { cuGraphInstantiateWithFlags(&mut exec, g, 1) },
        CUDA_ERROR_NOT_SUPPORTED
    );
    // SAFETY: as above.
    assert_eq!(
        unsafe { cuGraphInstantiateWithFlags(&mut exec, g, 0) },
        CUDA_SUCCESS
    );
    assert_eq!(cuGraphLaunch(exec, s), CUDA_SUCCESS);
    assert_eq!(cuStreamSynchronize(s), CUDA_SUCCESS);
    assert_eq!(cuGraphExecDestroy(exec), CUDA_SUCCESS);
    assert_eq!(cuGraphExecDestroy(exec), CUDA_ERROR_INVALID_VALUE);
    assert_eq!(cuGraphDestroy(g), CUDA_SUCCESS);
    // A failed end writes a null graph.
    assert_eq!(cuStreamBeginCapture_v2(s, 0), CUDA_SUCCESS);
    assert_eq!(
        cuStreamSynchronize(s),
        CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
    );
    let (r, g) = end(s);
    assert_eq!(
        (r, g),
        (CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, std::ptr::null_mut())
    );
    // The thread's mode is exchanged, and an unknown one refused.
    let mut mode = 2u32;
    // SAFETY: `mode` is readable and writable.
    assert_eq!(
        unsafe { cuThreadExchangeStreamCaptureMode(&mut mode) },
        CUDA_SUCCESS
    );
    assert_eq!(mode, 0, "every thread starts in global mode");
    let mut bad = 9u32;
    // SAFETY: as above.
    assert_eq!(
        unsafe { cuThreadExchangeStreamCaptureMode(&mut bad) },
        CUDA_ERROR_INVALID_VALUE
    );
    // SAFETY: as above (restores global).
    assert_eq!(
        unsafe { cuThreadExchangeStreamCaptureMode(&mut mode) },
        CUDA_SUCCESS
    );
    assert_eq!(mode, 2);
    assert_eq!(cuStreamDestroy_v2(s), CUDA_SUCCESS);
}
