//! The sim's OS layer: memfds and memory mappings, and the raw byte copies between
//! validated ranges. All of the sim's `unsafe` lives in this file.
//!
//! A [`Mapping`] owns an address range of this process and unmaps it on drop. Sub-ranges of
//! a reservation are re-mapped in place with `MAP_FIXED`, which is only sound inside a range
//! this process owns: [`Mapping::map_fixed`] and friends check that the target lies inside
//! `self`, so callers cannot clobber unrelated memory.

use std::ffi::c_void;
use std::os::fd::{AsFd, OwnedFd};

use rustix::fs::{MemfdFlags, SealFlags};
use rustix::mm::{MapFlags, MprotectFlags, ProtFlags};

use gpualloc_runtime::error::{BackendError, Result};

/// The system page size in bytes.
pub(crate) fn page_size() -> u64 {
    rustix::param::page_size() as u64
}

/// Maps an errno from a memory call to a typed error (`ENOMEM` becomes `OutOfMemory`).
fn mem_err(op: &'static str, requested: u64, what: &str, e: rustix::io::Errno) -> BackendError {
    if e == rustix::io::Errno::NOMEM || e == rustix::io::Errno::NOSPC {
        BackendError::OutOfMemory {
            requested,
            what: what.to_string(),
        }
    } else {
        BackendError::os(op, e)
    }
}

fn to_usize(len: u64) -> Result<usize> {
    usize::try_from(len).map_err(|_| BackendError::invalid(format!("length {len} too large")))
}

/// Seals that fix a memory file's size for good: nobody holding an fd of it (another process
/// it was exported to, included) can truncate it under a mapping, which would make the next
/// access through that mapping a SIGBUS.
pub(crate) const SIZE_SEALS: SealFlags = SealFlags::SHRINK
    .union(SealFlags::GROW)
    .union(SealFlags::SEAL);

/// Creates a memfd of `size` bytes (sparse: pages are consumed only when touched), sealed at
/// that size ([`SIZE_SEALS`]): device memory is exported to other processes, which must not
/// be able to shrink it under this one.
pub(crate) fn memfd(size: u64, what: &str) -> Result<OwnedFd> {
    let fd = rustix::fs::memfd_create(
        "gpualloc-sim",
        MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING,
    )
    .map_err(|e| mem_err("memfd_create", size, what, e))?;
    rustix::fs::ftruncate(&fd, size).map_err(|e| mem_err("ftruncate", size, what, e))?;
    rustix::fs::fcntl_add_seals(&fd, SIZE_SEALS).map_err(|e| BackendError::os("add seals", e))?;
    Ok(fd)
}

/// Checks that `fd` is a memory file (a memfd) sealed against resizing, and returns its size.
/// Anything else (a pipe, a socket, `/dev/null`, a regular file, a memfd its owner could still
/// shrink under our mapping) is `InvalidValue`.
pub(crate) fn memory_file_size(fd: impl AsFd) -> Result<u64> {
    let fd = fd.as_fd();
    let seals: SealFlags = rustix::fs::fcntl_get_seals(fd)
        .map_err(|_| BackendError::invalid("fd is not a memory handle (no memfd seals)"))?;
    if !seals.contains(SealFlags::SHRINK | SealFlags::GROW) {
        return Err(BackendError::invalid(
            "memory handle is not sealed against resizing (its owner could truncate it)",
        ));
    }
    let stat = rustix::fs::fstat(fd).map_err(|e| BackendError::os("fstat", e))?;
    u64::try_from(stat.st_size)
        .map_err(|_| BackendError::invalid("memory handle has a negative size"))
}

/// An owned range of this process's address space, unmapped on drop.
#[derive(Debug)]
pub(crate) struct Mapping {
    addr: u64,
    len: u64,
}

impl Mapping {
    /// Anonymous read/write memory (pinned host memory).
    pub(crate) fn anonymous(len: u64) -> Result<Mapping> {
        let ulen = to_usize(len)?;
        // SAFETY: a null hint lets the kernel choose a fresh range; nothing else refers to it.
        let ptr = unsafe {
            rustix::mm::mmap_anonymous(
                std::ptr::null_mut(),
                ulen,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::PRIVATE,
            )
        }
        .map_err(|e| mem_err("mmap", len, "pinned host", e))?;
        Ok(Mapping {
            addr: ptr as u64,
            len,
        })
    }

    /// A shared read/write mapping of `len` bytes of `fd` from offset 0.
    pub(crate) fn shared(fd: impl AsFd, len: u64, what: &str) -> Result<Mapping> {
        let ulen = to_usize(len)?;
        // SAFETY: a null hint lets the kernel choose a fresh range; the file stays referenced
        // by the mapping itself, whatever happens to `fd` later.
        let ptr = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                ulen,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED,
                fd,
                0,
            )
        }
        .map_err(|e| mem_err("mmap", len, what, e))?;
        Ok(Mapping {
            addr: ptr as u64,
            len,
        })
    }

    /// Reserves `len` bytes of inaccessible address space aligned to `align` (a power of
    /// two, at least a page): `mmap(PROT_NONE, MAP_NORESERVE)`, trimmed to the alignment.
    pub(crate) fn reserve(len: u64, align: u64) -> Result<Mapping> {
        let total = len
            .checked_add(align)
            .ok_or_else(|| BackendError::invalid("reservation size overflows"))?;
        let utotal = to_usize(total)?;
        // SAFETY: a null hint lets the kernel choose a fresh range; nothing else refers to it.
        let base = unsafe {
            rustix::mm::mmap_anonymous(
                std::ptr::null_mut(),
                utotal,
                ProtFlags::empty(),
                MapFlags::PRIVATE | MapFlags::NORESERVE,
            )
        }
        .map_err(|e| mem_err("mmap", len, "virtual address space", e))? as u64;
        let start = base.div_ceil(align) * align;
        let head = start - base;
        let tail = total - head - len;
        if head > 0 {
            // SAFETY: `[base, start)` is the unaligned head of the range mapped just above,
            // which nothing refers to.
            unsafe { rustix::mm::munmap(base as *mut c_void, head as usize) }
                .map_err(|e| BackendError::os("munmap", e))?;
        }
        if tail > 0 {
            // SAFETY: `[start + len, base + total)` is the tail of the same fresh range.
            unsafe { rustix::mm::munmap((start + len) as *mut c_void, tail as usize) }
                .map_err(|e| BackendError::os("munmap", e))?;
        }
        Ok(Mapping { addr: start, len })
    }

    /// Start address.
    pub(crate) fn addr(&self) -> u64 {
        self.addr
    }

    /// Length in bytes.
    pub(crate) fn len(&self) -> u64 {
        self.len
    }

    fn check_inside(&self, addr: u64, len: u64) -> Result<()> {
        let end = addr
            .checked_add(len)
            .ok_or_else(|| BackendError::invalid("range overflows"))?;
        if len == 0 || addr < self.addr || end > self.addr + self.len {
            return Err(BackendError::invalid(format!(
                "range {addr:#x}+{len:#x} is not inside the mapping {:#x}+{:#x}",
                self.addr, self.len
            )));
        }
        Ok(())
    }

    /// Maps `len` bytes of `fd` at `offset` over `[addr, addr + len)` inside this range,
    /// shared and inaccessible (`PROT_NONE`) until [`Mapping::protect_rw`].
    pub(crate) fn map_fixed(&self, addr: u64, len: u64, fd: impl AsFd, offset: u64) -> Result<()> {
        self.check_inside(addr, len)?;
        // SAFETY: `[addr, addr + len)` lies inside this mapping, which this process owns; the
        // caller (the VMM table) only maps over sub-ranges that are not mapped and not in the
        // region table, so no live access or Rust reference points into them.
        unsafe {
            rustix::mm::mmap(
                addr as *mut c_void,
                len as usize,
                ProtFlags::empty(),
                MapFlags::SHARED | MapFlags::FIXED,
                fd,
                offset,
            )
        }
        .map_err(|e| mem_err("mmap", len, "device mapping", e))?;
        Ok(())
    }

    /// Makes `[addr, addr + len)` inside this range readable and writable.
    pub(crate) fn protect_rw(&self, addr: u64, len: u64) -> Result<()> {
        self.check_inside(addr, len)?;
        // SAFETY: the range lies inside this mapping; adding access cannot invalidate any
        // reference.
        unsafe {
            rustix::mm::mprotect(
                addr as *mut c_void,
                len as usize,
                MprotectFlags::READ | MprotectFlags::WRITE,
            )
        }
        .map_err(|e| BackendError::os("mprotect", e))
    }

    /// Replaces `[addr, addr + len)` inside this range with inaccessible anonymous memory
    /// (the "unmapped" state of a reservation).
    pub(crate) fn reset_none(&self, addr: u64, len: u64) -> Result<()> {
        self.check_inside(addr, len)?;
        // SAFETY: the range lies inside this mapping; the caller removed it from the region
        // table under the write lock first, so no access is in progress in it.
        unsafe {
            rustix::mm::mmap_anonymous(
                addr as *mut c_void,
                len as usize,
                ProtFlags::empty(),
                MapFlags::PRIVATE | MapFlags::FIXED | MapFlags::NORESERVE,
            )
        }
        .map_err(|e| BackendError::os("mmap", e))?;
        Ok(())
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: this mapping owns `[addr, addr + len)`; whoever drops it has removed it from
        // the region table, so no access is in progress and no reference points into it.
        if let Err(e) = unsafe { rustix::mm::munmap(self.addr as *mut c_void, self.len as usize) } {
            tracing::warn!(addr = self.addr, len = self.len, error = %e, "munmap failed");
        }
    }
}

/// Copies `len` bytes from `src` to `dst` (the ranges may overlap).
///
/// # Safety
/// Both ranges must be mapped readable/writable for the whole call (the caller holds the
/// region table's read lock over ranges it validated, so no unmap can run concurrently).
pub(crate) unsafe fn copy_raw(dst: u64, src: u64, len: usize) {
    // SAFETY: guaranteed by the caller, see above; `copy` tolerates overlap.
    unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, len) }
}

/// Fills `len` bytes at `dst` with `value`.
///
/// # Safety
/// As for [`copy_raw`]: the range must be validated and kept mapped for the call.
pub(crate) unsafe fn fill_raw(dst: u64, value: u8, len: usize) {
    // SAFETY: guaranteed by the caller.
    unsafe { std::ptr::write_bytes(dst as *mut u8, value, len) }
}

/// Reads `len` bytes at `src` into a new vector.
///
/// # Safety
/// As for [`copy_raw`].
pub(crate) unsafe fn read_raw(src: u64, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    // SAFETY: `src` is valid for `len` bytes (caller), `out` has exactly `len` bytes and does
    // not overlap device memory.
    unsafe { std::ptr::copy_nonoverlapping(src as *const u8, out.as_mut_ptr(), len) };
    out
}

/// Writes `data` at `dst`.
///
/// # Safety
/// As for [`copy_raw`].
pub(crate) unsafe fn write_raw(dst: u64, data: &[u8]) {
    // SAFETY: `dst` is valid for `data.len()` bytes (caller); `copy` tolerates overlap.
    unsafe { std::ptr::copy(data.as_ptr(), dst as *mut u8, data.len()) }
}

/// True when every one of `len` bytes at `src` equals `value`.
///
/// # Safety
/// As for [`copy_raw`].
pub(crate) unsafe fn check_raw(src: u64, len: usize, value: u8) -> bool {
    // SAFETY: `src` is valid for `len` bytes for the duration of the call (caller); the slice
    // does not outlive it.
    let bytes = unsafe { std::slice::from_raw_parts(src as *const u8, len) };
    bytes.iter().all(|b| *b == value)
}
