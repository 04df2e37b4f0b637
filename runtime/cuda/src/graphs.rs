//! Stream capture and graphs of the CUDA backend: `cuStreamBeginCapture_v2`,
//! `cuStreamEndCapture`, `cuStreamGetCaptureInfo_v2`, `cuThreadExchangeStreamCaptureMode`,
//! `cuGraphInstantiateWithFlags`, `cuGraphLaunch`, `cuGraphDestroy`, `cuGraphExecDestroy`.
//!
//! Graphs and their instantiations live in registries, as streams and events do: a handle is
//! passed to the driver only after it is found there, and the driver object is destroyed when
//! the last reference goes (an instantiation being launched on another thread keeps it).
//! The capture errors (900–908) come back as `BackendError::Capture` (`error.rs`).

use std::sync::Arc;

use cudarc::driver::safe::CudaContext;
use cudarc::driver::sys;

use super::backend::CudaBackend;
use super::context::bind;
use super::error::drv;
use gpualloc_runtime::capture::{CaptureMode, CaptureStatus, GraphExecHandle, GraphHandle};
use gpualloc_runtime::error::{BackendError, Result};
use gpualloc_runtime::types::StreamHandle;

/// A captured driver graph and the context it was captured in.
pub(crate) struct CuGraph {
    raw: sys::CUgraph,
    ctx: Arc<CudaContext>,
}

/// An instantiated driver graph and its context.
pub(crate) struct CuGraphExec {
    raw: sys::CUgraphExec,
    ctx: Arc<CudaContext>,
}

// SAFETY: CUgraph and CUgraphExec are opaque driver handles that any thread may pass to the
// driver; we never dereference them, and `Arc<CudaContext>` is Send + Sync.
unsafe impl Send for CuGraph {}
// SAFETY: as above; every use is a driver call on the handle.
unsafe impl Sync for CuGraph {}
// SAFETY: as for `CuGraph`.
unsafe impl Send for CuGraphExec {}
// SAFETY: as for `CuGraph`.
unsafe impl Sync for CuGraphExec {}

impl Drop for CuGraph {
    fn drop(&mut self) {
        let raw = self.raw;
        let r = bind(&self.ctx).and_then(|()| {
            drv("cuGraphDestroy", || {
                // SAFETY: `raw` came from cuStreamEndCapture and this is its only destroy
                // (the last registry reference is going); instantiations do not need it.
                unsafe { sys::cuGraphDestroy(raw) }
            })
        });
        if let Err(e) = r {
            tracing::warn!(error = %e, "cuGraphDestroy failed");
        }
    }
}

impl Drop for CuGraphExec {
    fn drop(&mut self) {
        let raw = self.raw;
        let r = bind(&self.ctx).and_then(|()| {
            drv("cuGraphExecDestroy", || {
                // SAFETY: `raw` came from cuGraphInstantiateWithFlags and this is its only
                // destroy; launches already enqueued complete, as the driver documents.
                unsafe { sys::cuGraphExecDestroy(raw) }
            })
        });
        if let Err(e) = r {
            tracing::warn!(error = %e, "cuGraphExecDestroy failed");
        }
    }
}

fn mode_of(mode: CaptureMode) -> sys::CUstreamCaptureMode {
    match mode {
        CaptureMode::Global => sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL,
        CaptureMode::ThreadLocal => sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
        CaptureMode::Relaxed => sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED,
    }
}

fn mode_from(mode: sys::CUstreamCaptureMode) -> CaptureMode {
    match mode {
        sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL => CaptureMode::Global,
        sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL => CaptureMode::ThreadLocal,
        sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED => CaptureMode::Relaxed,
    }
}

impl CudaBackend {
    pub(crate) fn cu_begin_capture(&self, stream: StreamHandle, mode: CaptureMode) -> Result<()> {
        let s = self.bound_stream(stream)?;
        drv("cuStreamBeginCapture", || {
            // SAFETY: `s` is a live stream (we hold an `Arc`) of the bound context.
            unsafe { sys::cuStreamBeginCapture_v2(s.cu_stream(), mode_of(mode)) }
        })
    }

    pub(crate) fn cu_end_capture(&self, stream: StreamHandle) -> Result<GraphHandle> {
        let s = self.bound_stream(stream)?;
        let mut raw: sys::CUgraph = std::ptr::null_mut();
        drv("cuStreamEndCapture", || {
            // SAFETY: `s` is live and `raw` a valid out-pointer.
            unsafe { sys::cuStreamEndCapture(s.cu_stream(), &mut raw) }
        })?;
        if raw.is_null() {
            return Err(BackendError::invalid(
                "cuStreamEndCapture returned no graph",
            ));
        }
        let graph = Arc::new(CuGraph {
            raw,
            ctx: s.context().clone(),
        });
        let handle = GraphHandle {
            device: stream.device,
            raw: self.graphs.fresh(),
        };
        self.graphs.insert(stream.device, handle.raw, graph)?;
        Ok(handle)
    }

    pub(crate) fn cu_capture_status(&self, stream: StreamHandle) -> Result<CaptureStatus> {
        let s = self.bound_stream(stream)?;
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        let mut id: u64 = 0;
        drv("cuStreamGetCaptureInfo_v2", || {
            // SAFETY: `s` is live; the status and id out-pointers are valid, and the graph
            // and dependency outputs are optional (null: not asked for).
            unsafe {
                sys::cuStreamGetCaptureInfo_v2(
                    s.cu_stream(),
                    &mut status,
                    &mut id,
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                )
            }
        })?;
        Ok(match status {
            sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE => CaptureStatus::None,
            sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE => {
                CaptureStatus::Active { id }
            }
            sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_INVALIDATED => {
                CaptureStatus::Invalidated { id }
            }
        })
    }

    pub(crate) fn cu_exchange_capture_mode(&self, mode: CaptureMode) -> Result<CaptureMode> {
        let mut m = mode_of(mode);
        drv("cuThreadExchangeStreamCaptureMode", || {
            // SAFETY: `m` is a valid, initialized in/out pointer.
            unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut m) }
        })?;
        Ok(mode_from(m))
    }

    pub(crate) fn cu_graph_instantiate(&self, graph: GraphHandle) -> Result<GraphExecHandle> {
        self.health.check(graph.device)?;
        let g = self.graphs.get(graph.device, graph.raw)?;
        bind(&g.ctx)?;
        let mut raw: sys::CUgraphExec = std::ptr::null_mut();
        drv("cuGraphInstantiateWithFlags", || {
            // SAFETY: `g` is a live graph (we hold an `Arc`); `raw` a valid out-pointer.
            unsafe { sys::cuGraphInstantiateWithFlags(&mut raw, g.raw, 0) }
        })?;
        let exec = Arc::new(CuGraphExec {
            raw,
            ctx: g.ctx.clone(),
        });
        let handle = GraphExecHandle {
            device: graph.device,
            raw: self.graph_execs.fresh(),
        };
        self.graph_execs.insert(graph.device, handle.raw, exec)?;
        Ok(handle)
    }

    pub(crate) fn cu_graph_launch(
        &self,
        exec: GraphExecHandle,
        stream: StreamHandle,
    ) -> Result<()> {
        if exec.device != stream.device {
            return Err(BackendError::invalid(format!(
                "graph_launch: a graph of {} on a stream of {}",
                exec.device, stream.device
            )));
        }
        let e = self.graph_execs.get(exec.device, exec.raw)?;
        let s = self.bound_stream(stream)?;
        drv("cuGraphLaunch", || {
            // SAFETY: both handles are live (we hold `Arc`s) and of the same, bound context.
            unsafe { sys::cuGraphLaunch(e.raw, s.cu_stream()) }
        })
    }

    pub(crate) fn cu_graph_destroy(&self, graph: GraphHandle) -> Result<()> {
        // The driver graph goes with the last reference (an unknown handle is an error).
        drop(self.graphs.remove(graph.device, graph.raw)?);
        Ok(())
    }

    pub(crate) fn cu_graph_exec_destroy(&self, exec: GraphExecHandle) -> Result<()> {
        drop(self.graph_execs.remove(exec.device, exec.raw)?);
        Ok(())
    }
}
