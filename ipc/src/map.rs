//! [`SharedMapping`]: one `mmap` of a memory object (shared memory or a file), unmapped on
//! drop, with the choices PyTorch's `MapAllocator` encodes as flags spelled out as types:
//! [`Access`], [`Sharing`], [`FdAfterMap`] and [`Advice`].
//!
//! This is one of the two files of the crate with `unsafe` (the other is
//! [`crate::refcount`]): every `mmap`, `munmap`, `madvise` and raw copy lives here. The size
//! checks that keep a mapping inside its object (fstat) happen in [`crate::shm`] before a
//! mapping is made; [`SharedMapping::map`] checks them again, so no caller can map past the
//! end of an object and die of SIGBUS.

use std::ffi::c_void;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::ptr::NonNull;

use rustix::mm::{MapFlags, ProtFlags};

use crate::error::{IpcError, Result};
use crate::shm::inspect;

/// Whether the mapping may be written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// `PROT_READ`.
    ReadOnly,
    /// `PROT_READ | PROT_WRITE`.
    ReadWrite,
}

/// Whether writes reach the object (and other processes) or stay private.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sharing {
    /// `MAP_SHARED`: writes are visible to every process mapping the object.
    Shared,
    /// `MAP_PRIVATE`: copy-on-write; writes stay in this mapping, the object is unchanged.
    Private,
}

/// What happens to the fd once the mapping exists (PyTorch's `KEEPFD`). The mapping keeps
/// the object alive on its own; keep the fd only to send it to another process later.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FdAfterMap {
    /// Keep it in the mapping ([`SharedMapping::fd`]); closed on drop.
    Keep,
    /// Close it right after mapping (saves an fd).
    Close,
}

/// An `madvise` hint for the whole mapping.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Advice {
    /// No special treatment.
    Normal,
    /// Expect sequential reads: read ahead aggressively.
    Sequential,
    /// Expect random access: no read-ahead.
    Random,
    /// Expect access soon: start faulting pages in.
    WillNeed,
}

/// How to map an object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MapOptions {
    /// Read-only or read/write.
    pub access: Access,
    /// Shared or private (copy-on-write).
    pub sharing: Sharing,
    /// Keep or close the fd.
    pub fd: FdAfterMap,
    /// An optional `madvise` hint.
    pub advice: Option<Advice>,
}

impl MapOptions {
    /// Read/write, shared, fd kept: what the producer of shared memory wants.
    pub fn shared_rw() -> Self {
        MapOptions {
            access: Access::ReadWrite,
            sharing: Sharing::Shared,
            fd: FdAfterMap::Keep,
            advice: None,
        }
    }

    /// Read-only, shared, fd closed.
    pub fn shared_ro() -> Self {
        MapOptions {
            access: Access::ReadOnly,
            sharing: Sharing::Shared,
            fd: FdAfterMap::Close,
            advice: None,
        }
    }

    /// Builder: the `madvise` hint.
    pub fn with_advice(mut self, advice: Advice) -> Self {
        self.advice = Some(advice);
        self
    }

    /// Builder: keep or close the fd.
    pub fn with_fd(mut self, fd: FdAfterMap) -> Self {
        self.fd = fd;
        self
    }
}

/// One mapping of a memory object into this process; unmapped (and its kept fd closed) on
/// drop. The object lives on while any process holds an fd or a mapping of it.
#[derive(Debug)]
pub struct SharedMapping {
    ptr: NonNull<u8>,
    len: usize,
    fd: Option<OwnedFd>,
    options: MapOptions,
}

// SAFETY: the mapping is plain memory owned by this value; nothing in it is tied to a
// thread. Concurrent access through `read_at`/`write_at` copies bytes, like any shared
// memory another process may also touch.
unsafe impl Send for SharedMapping {}
// SAFETY: shared references only allow byte copies in and out (see `Send`).
unsafe impl Sync for SharedMapping {}

impl SharedMapping {
    /// Maps the first `len` bytes of `fd`'s object. Errors: `InvalidSize` for 0,
    /// `NotSharedMemory` for an fd that is not a regular or shared-memory file,
    /// `SizeMismatch` if the object (fstat) is shorter than `len`.
    pub fn map(fd: OwnedFd, len: u64, options: MapOptions) -> Result<SharedMapping> {
        let info = inspect(fd.as_fd())?;
        if len == 0 {
            return Err(IpcError::InvalidSize(len));
        }
        if len > info.size {
            return Err(IpcError::SizeMismatch {
                requested: len,
                actual: info.size,
            });
        }
        let ulen = usize::try_from(len).map_err(|_| IpcError::InvalidSize(len))?;
        let prot = match options.access {
            Access::ReadOnly => ProtFlags::READ,
            Access::ReadWrite => ProtFlags::READ | ProtFlags::WRITE,
        };
        let flags = match options.sharing {
            Sharing::Shared => MapFlags::SHARED,
            Sharing::Private => MapFlags::PRIVATE,
        };
        // SAFETY: a fresh mapping at an address the kernel picks (null hint, no MAP_FIXED),
        // so it cannot replace any existing memory of this process. `len` is non-zero and
        // within the object's size (checked above), so every page of it is backed and no
        // access inside it can raise SIGBUS unless another process shrinks the object,
        // which only the owner of a writable fd can do.
        let raw = unsafe { rustix::mm::mmap(std::ptr::null_mut(), ulen, prot, flags, &fd, 0) }
            .map_err(|e| IpcError::os("mmap", e))?;
        let ptr = NonNull::new(raw.cast::<u8>()).ok_or(IpcError::InvalidSize(len))?;
        let mapping = SharedMapping {
            ptr,
            len: ulen,
            fd: match options.fd {
                FdAfterMap::Keep => Some(fd),
                FdAfterMap::Close => None,
            },
            options,
        };
        if let Some(advice) = options.advice {
            mapping.advise(advice)?;
        }
        Ok(mapping)
    }

    /// Applies an `madvise` hint to the whole mapping.
    pub fn advise(&self, advice: Advice) -> Result<()> {
        let a = match advice {
            Advice::Normal => rustix::mm::Advice::Normal,
            Advice::Sequential => rustix::mm::Advice::Sequential,
            Advice::Random => rustix::mm::Advice::Random,
            Advice::WillNeed => rustix::mm::Advice::WillNeed,
        };
        // SAFETY: `[ptr, ptr + len)` is exactly this mapping; these hints only change
        // read-ahead and paging policy, never the contents or validity of memory.
        unsafe { rustix::mm::madvise(self.ptr.as_ptr().cast::<c_void>(), self.len, a) }
            .map_err(|e| IpcError::os("madvise", e))
    }

    /// Bytes mapped.
    pub fn len(&self) -> u64 {
        self.len as u64
    }

    /// Always false: a mapping has at least one byte.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Start address. Valid for [`SharedMapping::len`] bytes while `self` lives; writes
    /// through it need [`Access::ReadWrite`].
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// The options it was mapped with.
    pub fn options(&self) -> MapOptions {
        self.options
    }

    /// The kept fd ([`FdAfterMap::Keep`]), to send to another process.
    pub fn fd(&self) -> Option<BorrowedFd<'_>> {
        self.fd.as_ref().map(|f| f.as_fd())
    }

    /// Copies `dst.len()` bytes at `offset` out of the mapping.
    pub fn read_at(&self, offset: u64, dst: &mut [u8]) -> Result<()> {
        let start = self.check_range(offset, dst.len())?;
        // SAFETY: `[start, start + dst.len())` lies inside this live mapping (checked), and
        // `dst` is a distinct buffer of this process, so the ranges do not overlap. Another
        // process may write concurrently; the copy then sees some mix of bytes, never UB
        // in this process's own memory.
        unsafe {
            std::ptr::copy_nonoverlapping(self.ptr.as_ptr().add(start), dst.as_mut_ptr(), dst.len())
        };
        Ok(())
    }

    /// Copies `src` into the mapping at `offset`. Errors with `ReadOnly` on a read-only
    /// mapping.
    pub fn write_at(&self, offset: u64, src: &[u8]) -> Result<()> {
        if self.options.access == Access::ReadOnly {
            return Err(IpcError::ReadOnly);
        }
        let start = self.check_range(offset, src.len())?;
        // SAFETY: the range lies inside this live, writable mapping (checked above) and `src`
        // is a distinct buffer; see `read_at` for concurrent writers in other processes.
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.as_ptr().add(start), src.len())
        };
        Ok(())
    }

    /// Reads the whole mapping into a vector.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = vec![0u8; self.len];
        // Cannot fail: the range is the whole mapping.
        let _ = self.read_at(0, &mut v);
        v
    }

    fn check_range(&self, offset: u64, n: usize) -> Result<usize> {
        let start = usize::try_from(offset).map_err(|_| IpcError::InvalidSize(offset))?;
        match start.checked_add(n) {
            Some(end) if end <= self.len => Ok(start),
            _ => Err(IpcError::SizeMismatch {
                requested: offset.saturating_add(n as u64),
                actual: self.len as u64,
            }),
        }
    }
}

impl Drop for SharedMapping {
    fn drop(&mut self) {
        // SAFETY: `[ptr, ptr + len)` is exactly the mapping this value created and owns;
        // no reference into it outlives `self` (the API hands out copies and raw pointers
        // documented as valid only while `self` lives).
        let _ = unsafe { rustix::mm::munmap(self.ptr.as_ptr().cast::<c_void>(), self.len) };
    }
}
