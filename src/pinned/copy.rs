//! Asynchronous copies between pinned and device buffers on a stream
//! ([`HostAllocator::copy_h2d`], [`HostAllocator::copy_d2h`]).
//!
//! A copy runs on the stream after the call returns, reading or writing the pinned bytes.
//! Safe code must not touch those bytes meanwhile (that would be a data race with the copy),
//! so a copy **takes the pinned buffer** and hands it back through a [`PinnedCopy`] that
//! resolves once the stream has passed the copy ([`PinnedCopy::finish`], or
//! [`PinnedCopy::finish_blocking`] off the async runtime). Dropping a `PinnedCopy` unawaited is
//! safe too: the buffer is freed, and its memory is reused only after the stream passed the
//! copy (the stream is recorded on the buffer, and on the device buffer when the stream is not
//! its allocation stream). A copy that cannot be enqueued gives the buffer back inside its
//! [`CopyError`]. Users who order their accesses themselves (e.g. with their own events) have
//! the `unsafe` [`HostAllocator::copy_h2d_unchecked`] / [`HostAllocator::copy_d2h_unchecked`],
//! which borrow instead.
//!
//! The buffer is out of reach while the copy runs; this does not compile:
//!
//! ```compile_fail
//! # async fn demo(alloc: gpualloc::Allocator, dev: gpualloc::DeviceBuffer, s: gpualloc::Stream) -> Result<(), gpualloc::Error> {
//! let dst = alloc.host().malloc(dev.len()).await?;
//! let copy = alloc.host().copy_d2h(&dev, dst, &s)?;
//! let first = dst[0]; // error: `dst` was moved into the copy
//! # Ok(()) }
//! ```
//!
//! ```no_run
//! # async fn demo(alloc: gpualloc::Allocator, dev: gpualloc::DeviceBuffer, s: gpualloc::Stream) -> Result<(), gpualloc::Error> {
//! let dst = alloc.host().malloc(dev.len()).await?;
//! let copy = alloc.host().copy_d2h(&dev, dst, &s)?;
//! let dst = copy.finish().await?; // the stream has passed the copy
//! let first = dst[0];
//! # Ok(()) }
//! ```

use std::fmt;
use std::sync::Arc;

use gpualloc_devices::AllocError;
use gpualloc_runtime::{Event, Stream};

use crate::buffer::DeviceBuffer;
use crate::error::Error;
use crate::pinned::buffer::PinnedBuffer;
use crate::pinned::handle::HostAllocator;

/// A copy enqueued on a stream, holding its pinned buffer until the stream has passed it.
#[must_use = "dropping it frees the pinned buffer; call finish() to get the buffer back"]
pub struct PinnedCopy {
    buffer: PinnedBuffer,
    /// Recorded right after the copy (`None` for an empty copy: nothing was enqueued).
    done: Option<Event>,
}

impl fmt::Debug for PinnedCopy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PinnedCopy")
            .field("buffer", &self.buffer)
            .field("done", &self.done)
            .finish()
    }
}

impl PinnedCopy {
    /// True once the stream has passed the copy (never blocks).
    pub fn is_done(&self) -> Result<bool, Error> {
        match &self.done {
            Some(e) => Ok(e.query()?),
            None => Ok(true),
        }
    }

    /// Waits (without blocking the thread) until the stream has passed the copy, then hands
    /// the buffer back. A failed copy on the stream is reported as the backend's error (the
    /// buffer is freed then).
    pub async fn finish(self) -> Result<PinnedBuffer, Error> {
        if let Some(e) = &self.done {
            e.completed().await?;
        }
        Ok(self.buffer)
    }

    /// [`PinnedCopy::finish`], **blocking the calling thread** (for code outside an async
    /// runtime; from async code await `finish`).
    pub fn finish_blocking(self) -> Result<PinnedBuffer, Error> {
        if let Some(e) = &self.done {
            e.synchronize()?;
        }
        Ok(self.buffer)
    }
}

/// A copy that could not be enqueued: why, and the pinned buffer it took, untouched.
#[derive(Debug, thiserror::Error)]
#[error("{error}")]
pub struct CopyError {
    /// Why the copy was refused.
    pub error: Error,
    /// The buffer, handed back.
    pub buffer: PinnedBuffer,
}

impl From<CopyError> for Error {
    /// Keeps the reason and frees the buffer.
    fn from(e: CopyError) -> Error {
        e.error
    }
}

impl HostAllocator {
    /// Copies all of `src` (host) into the start of `dst` (device) on `stream`; `src` comes
    /// back from the returned [`PinnedCopy`] once the stream has passed the copy.
    /// Errors (with `src` handed back): `dst` shorter than `src` ([`Error::CopyLength`]), a
    /// stream or buffer of another backend ([`Error::ForeignStream`]), a stream of another
    /// device than `dst`'s, a forked child, shutdown, or the backend's refusal.
    pub fn copy_h2d(
        &self,
        src: PinnedBuffer,
        dst: &DeviceBuffer,
        stream: &Stream,
    ) -> Result<PinnedCopy, CopyError> {
        // SAFETY: `src` is moved into the returned `PinnedCopy` (or the error), which gives
        // safe code no access to its bytes until `finish` has waited for the event recorded
        // after the copy; dropping it frees the block, whose reuse waits for the stream too.
        let r = unsafe { self.copy_h2d_unchecked(&src, dst, stream) };
        self.guard(r, src, stream)
    }

    /// Copies all of `src` (device) into the start of `dst` (host) on `stream`; `dst` comes
    /// back from the returned [`PinnedCopy`], holding the bytes, once the stream has passed
    /// the copy. Same errors as [`HostAllocator::copy_h2d`], with `dst` shorter than `src` as
    /// [`Error::CopyLength`].
    pub fn copy_d2h(
        &self,
        src: &DeviceBuffer,
        mut dst: PinnedBuffer,
        stream: &Stream,
    ) -> Result<PinnedCopy, CopyError> {
        // SAFETY: as in `copy_h2d`: `dst` is held by the `PinnedCopy` until the stream passed
        // the copy that writes it.
        let r = unsafe { self.copy_d2h_unchecked(src, &mut dst, stream) };
        self.guard(r, dst, stream)
    }

    /// Records the completion of an enqueued copy, or hands the buffer back with the error.
    fn guard(
        &self,
        enqueued: Result<bool, Error>,
        buffer: PinnedBuffer,
        stream: &Stream,
    ) -> Result<PinnedCopy, CopyError> {
        match enqueued {
            Ok(false) => Ok(PinnedCopy { buffer, done: None }),
            Ok(true) => match stream.record_event() {
                Ok(e) => Ok(PinnedCopy {
                    buffer,
                    done: Some(e),
                }),
                // The copy is enqueued and the buffer recorded on the stream: without an
                // event to wait on, synchronize the stream before handing the buffer back.
                Err(_) => match stream.synchronize() {
                    Ok(()) => Ok(PinnedCopy { buffer, done: None }),
                    Err(e) => Err(CopyError {
                        error: e.into(),
                        buffer,
                    }),
                },
            },
            Err(error) => Err(CopyError { error, buffer }),
        }
    }

    /// [`HostAllocator::copy_h2d`] borrowing `src`.
    ///
    /// # Safety
    /// The copy reads `src`'s bytes after this returns, until `stream` has passed it: the
    /// caller must not write them (through `DerefMut` or otherwise) before then, e.g. by
    /// synchronizing the stream or an event recorded after the copy. Dropping `src` meanwhile
    /// is fine (its reuse waits for the stream).
    ///
    /// Returns whether a copy was enqueued (false for an empty `src`).
    pub unsafe fn copy_h2d_unchecked(
        &self,
        src: &PinnedBuffer,
        dst: &DeviceBuffer,
        stream: &Stream,
    ) -> Result<bool, Error> {
        self.check_copy(src, dst, stream, src.len(), dst.len())?;
        if src.is_empty() {
            return Ok(false);
        }
        self.record(src, dst, stream)?;
        // SAFETY: `src` is pinned memory of the host pool, held past the copy by the event
        // just recorded (its reuse waits for the stream); this function's contract keeps the
        // caller off its bytes until then.
        self.actor()
            .backend
            .memcpy_async(stream.handle(), dst.ptr().0, src.ptr().0, src.len())?;
        Ok(true)
    }

    /// [`HostAllocator::copy_d2h`] borrowing `dst`.
    ///
    /// # Safety
    /// The copy writes `dst`'s bytes after this returns, until `stream` has passed it: the
    /// caller must neither read nor write them before then (synchronize the stream or an
    /// event recorded after the copy first). Dropping `dst` meanwhile is fine.
    ///
    /// Returns whether a copy was enqueued (false for an empty `src`).
    pub unsafe fn copy_d2h_unchecked(
        &self,
        src: &DeviceBuffer,
        dst: &mut PinnedBuffer,
        stream: &Stream,
    ) -> Result<bool, Error> {
        self.check_copy(dst, src, stream, src.len(), dst.len())?;
        if src.is_empty() {
            return Ok(false);
        }
        self.record(dst, src, stream)?;
        // SAFETY: as in `copy_h2d_unchecked`, for `dst`.
        self.actor()
            .backend
            .memcpy_async(stream.handle(), dst.ptr().0, src.ptr().0, src.len())?;
        Ok(true)
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
