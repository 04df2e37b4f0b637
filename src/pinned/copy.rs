//! Asynchronous copies between pinned and device buffers on a stream
//! ([`HostAllocator::copy_h2d`], [`HostAllocator::copy_d2h`]).
//!
//! Each copy records the stream on the pinned buffer before it is enqueued (and on the device
//! buffer too when the stream is not the one it was allocated on), so dropping either buffer
//! right after the call is safe: its memory is reused only once the stream has passed the
//! copy. The call returns as soon as the copy is enqueued; read a copy's destination only
//! after the stream passed it (e.g. `stream.synchronize()`).

use std::sync::Arc;

use gpualloc_devices::AllocError;
use gpualloc_runtime::Stream;

use crate::buffer::DeviceBuffer;
use crate::error::Error;
use crate::pinned::buffer::PinnedBuffer;
use crate::pinned::handle::HostAllocator;

impl HostAllocator {
    /// Copies all of `src` (host) into the start of `dst` (device) on `stream`.
    /// Errors: `dst` shorter than `src` ([`Error::CopyLength`]), a stream of another backend
    /// ([`Error::ForeignStream`]) or of another device than `dst`'s, a forked child, shutdown,
    /// or the backend's refusal.
    pub fn copy_h2d(
        &self,
        src: &PinnedBuffer,
        dst: &DeviceBuffer,
        stream: &Stream,
    ) -> Result<(), Error> {
        self.check_copy(src, dst, stream, src.len(), dst.len())?;
        self.record(src, dst, stream)?;
        Ok(self.actor().backend.memcpy_async(
            stream.handle(),
            dst.ptr().0,
            src.ptr().0,
            src.len(),
        )?)
    }

    /// Copies all of `src` (device) into the start of `dst` (host) on `stream`. Same errors
    /// as [`HostAllocator::copy_h2d`], with `dst` shorter than `src` as [`Error::CopyLength`].
    pub fn copy_d2h(
        &self,
        src: &DeviceBuffer,
        dst: &mut PinnedBuffer,
        stream: &Stream,
    ) -> Result<(), Error> {
        self.check_copy(dst, src, stream, src.len(), dst.len())?;
        self.record(dst, src, stream)?;
        Ok(self.actor().backend.memcpy_async(
            stream.handle(),
            dst.ptr().0,
            src.ptr().0,
            src.len(),
        )?)
    }

    fn check_copy(
        &self,
        pinned: &PinnedBuffer,
        device: &DeviceBuffer,
        stream: &Stream,
        src_len: u64,
        dst_len: u64,
    ) -> Result<(), Error> {
        let actor = self.actor();
        actor.check()?;
        if !Arc::ptr_eq(stream.backend(), &actor.backend)
            || !Arc::ptr_eq(pinned.actor(), actor)
            || !Arc::ptr_eq(device.stream().backend(), &actor.backend)
        {
            return Err(Error::ForeignStream);
        }
        if stream.device() != device.device() {
            return Err(AllocError::WrongDevice {
                expected: device.device(),
                got: stream.device(),
            }
            .into());
        }
        if dst_len < src_len {
            return Err(Error::CopyLength {
                src: src_len,
                dst: dst_len,
            });
        }
        Ok(())
    }

    fn record(
        &self,
        pinned: &PinnedBuffer,
        device: &DeviceBuffer,
        stream: &Stream,
    ) -> Result<(), Error> {
        pinned.record_stream(stream)?;
        if device.stream() != stream {
            device.record_stream(stream)?;
        }
        Ok(())
    }
}
