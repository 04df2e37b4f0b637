//! Driver-call helpers the emulator's direct tests share (each test file is its own crate and
//! uses only some of them).
#![allow(dead_code)]

use std::ffi::c_void;
use std::sync::mpsc;

use gpualloc_cuda_emu::*;

/// Initializes, retains device 0's primary context and makes it current on this thread.
pub fn bind() -> CUcontext {
    assert_eq!(cuInit(0), CUDA_SUCCESS);
    let mut ctx: CUcontext = std::ptr::null_mut();
    // SAFETY: a valid out-pointer.
    assert_eq!(
        unsafe { cuDevicePrimaryCtxRetain(&mut ctx, 0) },
        CUDA_SUCCESS
    );
    assert_eq!(cuCtxSetCurrent(ctx), CUDA_SUCCESS);
    ctx
}

/// A stream of the current context, created with `flags`.
pub fn stream_with(flags: u32) -> CUstream {
    let mut s: CUstream = std::ptr::null_mut();
    // SAFETY: a valid out-pointer.
    assert_eq!(unsafe { cuStreamCreate(&mut s, flags) }, CUDA_SUCCESS);
    s
}

/// An event of the current context.
pub fn event() -> CUevent {
    let mut e: CUevent = std::ptr::null_mut();
    // SAFETY: a valid out-pointer.
    assert_eq!(unsafe { cuEventCreate(&mut e, 0) }, CUDA_SUCCESS);
    e
}

/// Blocks `s` until the returned sender is dropped (a host function waiting on a channel).
pub fn hold(s: CUstream) -> mpsc::Sender<()> {
    let (tx, rx) = mpsc::channel::<()>();
    unsafe extern "C" fn wait(data: *mut c_void) {
        // SAFETY: `data` is the boxed receiver leaked below, used exactly once.
        let rx = unsafe { Box::from_raw(data.cast::<mpsc::Receiver<()>>()) };
        let _ = rx.recv();
    }
    let data = Box::into_raw(Box::new(rx)).cast::<c_void>();
    assert_eq!(cuLaunchHostFunc(s, Some(wait), data), CUDA_SUCCESS);
    tx
}
