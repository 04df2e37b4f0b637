//! Interop with cudarc users: our [`Stream`] to and from cudarc's `Arc<CudaStream>`, and the
//! shared primary [`CudaContext`] of a device.
//!
//! Both sides hold the same `Arc<CudaStream>`, so a stream lives until the last holder on
//! either side lets go, and the driver stream is destroyed only if cudarc created it.

use std::sync::Arc;

use cudarc::driver::safe::{CudaContext, CudaStream};

use super::backend::CudaBackend;
use gpualloc_runtime::error::{BackendError, Result};
use gpualloc_runtime::stream::Stream;
use gpualloc_runtime::types::{DeviceId, StreamHandle};
use gpualloc_runtime::Backend;

/// The driver's `CU_STREAM_PER_THREAD` handle value.
const CU_STREAM_PER_THREAD: usize = 0x2;

impl CudaBackend {
    /// The primary context of `device` as cudarc's [`CudaContext`] (retained on first use):
    /// the context this backend works in, so cudarc code using it shares memory and streams
    /// with the allocator.
    pub fn cudarc_context(&self, device: DeviceId) -> Result<Arc<CudaContext>> {
        self.contexts.get(device).cloned()
    }

    /// Registers a cudarc stream with this backend and returns its handle. The stream must
    /// belong to a device's primary context (e.g. made from [`CudaBackend::cudarc_context`]
    /// or `CudaContext::new`). The backend keeps the stream alive until the handle is passed
    /// to [`Backend::stream_destroy`] (once per adoption), which never destroys a stream
    /// that cudarc does not own.
    ///
    /// cudarc's per-thread default stream (`CU_STREAM_PER_THREAD`, from
    /// `CudaContext::per_thread_stream`) is refused with [`BackendError::InvalidValue`]: it names
    /// a different stream on each thread, and the allocator records and queries events from
    /// its own threads, where it would name their idle streams (a `record_stream` would then
    /// complete at once and the block be reused under the user's work). The legacy default
    /// stream (`CudaContext::default_stream`, null or `CU_STREAM_LEGACY`) is one stream per
    /// context, from any thread, and is accepted.
    pub fn adopt_stream(&self, stream: &Arc<CudaStream>) -> Result<StreamHandle> {
        if stream.cu_stream() as usize == CU_STREAM_PER_THREAD {
            return Err(BackendError::invalid(
                "adopt_stream: the per-thread default stream (CU_STREAM_PER_THREAD) names another \
                 stream on each thread, and the allocator works from its own threads; adopt a \
                 stream of your own (CudaContext::new_stream) or the legacy default stream",
            ));
        }
        let ordinal = stream.context().ordinal();
        let device =
            DeviceId(u32::try_from(ordinal).map_err(|_| BackendError::InvalidDevice(u32::MAX))?);
        let ours = self.contexts.get(device)?;
        if ours.cu_ctx() != stream.context().cu_ctx() {
            return Err(BackendError::invalid(format!(
                "adopt_stream: the stream belongs to a non-primary context of {device}"
            )));
        }
        // The same cudarc stream adopted again is the same handle (one more reference).
        let ptr = stream.cu_stream();
        let raw = self
            .streams
            .find(device, |s| s.cu_stream() == ptr)
            .unwrap_or_else(|| self.streams.fresh());
        self.streams.insert(device, raw, stream.clone())?;
        Ok(StreamHandle { device, raw })
    }

    /// The cudarc stream behind `handle` (a clone of the `Arc` both sides share), for
    /// cudarc memcpys and kernel launches on the allocator's streams.
    pub fn cudarc_stream(&self, handle: StreamHandle) -> Result<Arc<CudaStream>> {
        self.streams.get(handle.device, handle.raw)
    }

    /// Wraps a cudarc stream as our RAII [`Stream`] (adopting it; dropping the last clone of
    /// the `Stream` releases the adoption).
    pub fn wrap_cudarc_stream(self: &Arc<Self>, stream: &Arc<CudaStream>) -> Result<Stream> {
        let handle = self.adopt_stream(stream)?;
        let backend: Arc<dyn Backend> = self.clone();
        Ok(Stream::from_handle(backend, handle))
    }

    /// The cudarc stream behind our [`Stream`], which must belong to this backend.
    pub fn to_cudarc_stream(&self, stream: &Stream) -> Result<Arc<CudaStream>> {
        let theirs = Arc::as_ptr(stream.backend()) as *const ();
        if !std::ptr::eq(theirs, self as *const Self as *const ()) {
            return Err(BackendError::invalid(format!(
                "to_cudarc_stream: the stream belongs to the {} backend, not this one",
                stream.backend().name()
            )));
        }
        self.cudarc_stream(stream.handle())
    }
}
