//! cudarc interop (feature `cuda`): a [`DeviceBuffer`] is a cudarc device slice of bytes
//! (`DeviceSlice<u8>`, `DevicePtr<u8>`, `DevicePtrMut<u8>`), so cudarc's `memcpy_*` and
//! `memset_zeros` take it, and it is a kernel-launch argument (`launch_builder(..).arg(&buf)`);
//! [`Allocator`] converts between our [`Stream`] and cudarc's `Arc<CudaStream>`.
//!
//! ```ignore
//! let stream = alloc.new_stream(DeviceId(0))?;
//! let cu = alloc.to_cudarc_stream(&stream)?; // the same driver stream, as cudarc sees it
//! let mut buf = alloc.malloc(4096, &stream).await?;
//! cu.memcpy_htod(&[7u8; 4096], &mut buf)?;
//! cu.launch_builder(&kernel).arg(&mut buf).arg(&n).launch(cfg)?;
//! ```
//!
//! # Streams: call `record_stream` (as in PyTorch)
//! cudarc tracks which streams read and wrote the `CudaSlice`s it allocated. It cannot do
//! that for memory it did not allocate. A `DeviceBuffer` belongs to the stream it was
//! allocated on: work queued there is ordered by the stream itself, and when the buffer is
//! dropped its memory is reused for work queued on that stream afterwards. When you use a
//! buffer on **another** stream, call [`DeviceBuffer::record_stream`] with that stream (it
//! must be one of this allocator's: [`Allocator::wrap_cudarc_stream`] makes one from a
//! cudarc stream); otherwise the memory may be handed out again while that stream still
//! uses it. What the cudarc traits do for you: when cudarc asks for the pointer for another
//! stream of a context that manages stream synchronization, that stream first waits for the
//! work queued so far on the buffer's own stream (cudarc's contract for `device_ptr`);
//! kernel launches get only the pointer (cudarc gives foreign types no hook to wait).

use std::sync::Arc;

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{
    CudaContext, CudaStream, DevicePtr as CuDevicePtr, DevicePtrMut as CuDevicePtrMut, DeviceSlice,
    LaunchArgs, PushKernelArg, SyncOnDrop,
};
use gpualloc_cuda::CudaBackend;
use gpualloc_runtime::{Backend, BackendError, DeviceId, Stream};

use crate::allocator::Allocator;
use crate::buffer::DeviceBuffer;
use crate::error::Error;

/// The [`CudaBackend`] behind `backend`, or an error naming the backend it is instead.
pub(crate) fn cuda_of(backend: &Arc<dyn Backend>) -> Result<&CudaBackend, Error> {
    backend
        .as_any()
        .and_then(|a| a.downcast_ref::<CudaBackend>())
        .ok_or_else(|| {
            BackendError::invalid(format!(
                "cudarc interop needs the cuda backend; this allocator runs on the {} backend",
                backend.name()
            ))
            .into()
        })
}

/// The cudarc stream behind `stream` (which must be on the CUDA backend).
pub(crate) fn cudarc_stream_of(stream: &Stream) -> Result<Arc<CudaStream>, Error> {
    Ok(cuda_of(stream.backend())?.cudarc_stream(stream.handle())?)
}

impl Allocator {
    /// The CUDA backend this allocator runs on (an error on any other backend).
    pub fn cuda(&self) -> Result<&CudaBackend, Error> {
        cuda_of(self.backend())
    }

    /// The primary context of `device` as cudarc's `CudaContext`: load modules there to
    /// launch kernels on this allocator's memory.
    pub fn cudarc_context(&self, device: DeviceId) -> Result<Arc<CudaContext>, Error> {
        self.device_actor(device)?;
        Ok(self.cuda()?.cudarc_context(device)?)
    }

    /// The cudarc stream behind `stream` (the same driver stream; both sides share it).
    pub fn to_cudarc_stream(&self, stream: &Stream) -> Result<Arc<CudaStream>, Error> {
        if !Arc::ptr_eq(stream.backend(), self.backend()) {
            return Err(Error::ForeignStream);
        }
        Ok(self.cuda()?.cudarc_stream(stream.handle())?)
    }

    /// Wraps a cudarc stream (of a device's primary context, e.g. made from
    /// [`Allocator::cudarc_context`]) as a [`Stream`] of this allocator: allocate on it,
    /// `record_stream` it. The cudarc stream lives while either side holds it.
    pub fn wrap_cudarc_stream(&self, stream: &Arc<CudaStream>) -> Result<Stream, Error> {
        let handle = self.cuda()?.adopt_stream(stream)?;
        let wrapped = Stream::from_handle(self.backend().clone(), handle);
        self.device_actor(handle.device)?;
        Ok(wrapped)
    }
}

impl DeviceBuffer {
    /// The cudarc stream of the stream this buffer was allocated on; an error if the
    /// allocator does not run on the CUDA backend (then the cudarc traits cannot be used).
    pub fn cudarc_stream(&self) -> Result<&Arc<CudaStream>, Error> {
        match self
            .cudarc
            .get_or_init(|| cudarc_stream_of(self.stream()).ok())
        {
            Some(s) => Ok(s),
            None => Err(cudarc_stream_of(self.stream())
                .err()
                .unwrap_or_else(|| BackendError::invalid("no cudarc stream").into())),
        }
    }

    /// Makes `stream` wait for the work queued so far on the buffer's own stream, when it
    /// is another stream of a context that manages stream synchronization (as cudarc does
    /// for its own slices). Errors go to the context's error state, as in cudarc.
    fn order_after_own_stream(&self, stream: &CudaStream) {
        let Ok(own) = self.cudarc_stream() else {
            return;
        };
        if own.cu_stream() == stream.cu_stream()
            || !stream.context().is_managing_stream_synchronization()
        {
            return;
        }
        let waited = own.record_event(None).and_then(|e| stream.wait(&e));
        stream.context().record_err(waited);
    }
}

/// Bytes, as cudarc sees them.
impl DeviceSlice<u8> for DeviceBuffer {
    fn len(&self) -> usize {
        usize::try_from(DeviceBuffer::len(self)).unwrap_or(usize::MAX)
    }

    /// The cudarc stream the buffer was allocated on.
    ///
    /// # Panics
    /// If the allocator does not run on the CUDA backend: a sim or accounting buffer is not
    /// device memory cudarc can use. Check with [`DeviceBuffer::cudarc_stream`] first when
    /// the backend is not known.
    fn stream(&self) -> &Arc<CudaStream> {
        match self.cudarc_stream() {
            Ok(s) => s,
            Err(e) => panic!("a DeviceBuffer used with cudarc: {e}"),
        }
    }
}

/// The pointer for reading on `stream`. See the module docs: use on a stream other than the
/// buffer's own needs [`DeviceBuffer::record_stream`].
impl CuDevicePtr<u8> for DeviceBuffer {
    fn device_ptr<'a>(&'a self, stream: &'a CudaStream) -> (CUdeviceptr, SyncOnDrop<'a>) {
        self.order_after_own_stream(stream);
        (self.ptr().0, SyncOnDrop::Record(None))
    }
}

/// The pointer for writing on `stream`. See the module docs: use on a stream other than the
/// buffer's own needs [`DeviceBuffer::record_stream`].
impl CuDevicePtrMut<u8> for DeviceBuffer {
    fn device_ptr_mut<'a>(&'a mut self, stream: &'a CudaStream) -> (CUdeviceptr, SyncOnDrop<'a>) {
        self.order_after_own_stream(stream);
        (self.ptr().0, SyncOnDrop::Record(None))
    }
}

// SAFETY: the argument pushed is a reference to the buffer's pointer field (a `u64`, which
// is `DeviceRepr`), through cudarc's own `PushKernelArg<&u64>`; it lives for `'b`, which
// outlives the launch builder `'a`, so the kernel parameter stays valid until the launch.
unsafe impl<'a, 'b: 'a> PushKernelArg<&'b DeviceBuffer> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b DeviceBuffer) -> &mut Self {
        self.arg(arg.ptr_ref())
    }
}

// SAFETY: as for `&DeviceBuffer` above; `&mut` only states that the kernel writes.
unsafe impl<'a, 'b: 'a> PushKernelArg<&'b mut DeviceBuffer> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b mut DeviceBuffer) -> &mut Self {
        let shared: &'b DeviceBuffer = arg;
        self.arg(shared.ptr_ref())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpualloc_accounting::AccountingBackend;

    fn takes_cudarc_slices<T: CuDevicePtr<u8> + CuDevicePtrMut<u8>>() {}

    /// Compiles only if a buffer is a kernel argument, by reference and by `&mut`.
    #[allow(dead_code)]
    fn launch_args_take_buffers(
        s: &CudaStream,
        f: &cudarc::driver::CudaFunction,
        a: &DeviceBuffer,
        b: &mut DeviceBuffer,
    ) {
        let n = 7u32;
        let mut launch = s.launch_builder(f);
        launch.arg(a).arg(b).arg(&n);
    }

    #[tokio::test]
    async fn a_buffer_off_cuda_reports_a_typed_error_not_a_stream() {
        takes_cudarc_slices::<DeviceBuffer>();
        let alloc = Allocator::builder()
            .backend_instance(Arc::new(AccountingBackend::new(1, 1 << 30)))
            .build()
            .unwrap();
        let s = alloc.new_stream(DeviceId(0)).unwrap();
        let buf = alloc.malloc(4096, &s).await.unwrap();
        let err = buf.cudarc_stream().unwrap_err();
        assert!(err.to_string().contains("accounting"), "{err}");
        assert_eq!(DeviceSlice::<u8>::len(&buf), 4096);
        assert!(alloc.to_cudarc_stream(&s).is_err());
        assert!(alloc.cudarc_context(DeviceId(0)).is_err());
        assert!(alloc.cuda().is_err());
        drop(buf);
        alloc.shutdown().await.unwrap();
    }
}
