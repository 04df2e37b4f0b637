//! [`PageMapping`]: page-aligned anonymous memory from the OS, for the register path.
//!
//! `pinned_use_cuda_host_register` allocates ordinary memory, faults it in
//! ([`crate::prefault()`]), then page-locks it with `Backend::host_register`. The memory comes
//! from an anonymous private `mmap` (zero-filled, page aligned, not yet backed by pages) and
//! goes back with `munmap` when the mapping is dropped. This file and nowhere else in the crate
//! holds `unsafe` code.

use std::ptr::NonNull;

use gpualloc_runtime::BackendError;
use rustix::mm::{mmap_anonymous, munmap, MapFlags, ProtFlags};

/// The system page size.
pub fn page_size() -> usize {
    rustix::param::page_size()
}

/// An anonymous read/write mapping of whole pages, unmapped on drop.
#[derive(Debug)]
pub struct PageMapping {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: a PageMapping exclusively owns its pages (no one else can unmap them), so moving it to
// another thread is sound; shared access only hands out `&[u8]`, which is Sync for plain bytes.
unsafe impl Send for PageMapping {}
// SAFETY: see above; `&PageMapping` only allows reads of initialized bytes.
unsafe impl Sync for PageMapping {}

impl PageMapping {
    /// Maps `len` bytes rounded up to whole pages. `len` 0 or too large: `InvalidValue`;
    /// mmap failure (e.g. `ENOMEM`): `Os`.
    pub fn new(len: usize) -> Result<Self, BackendError> {
        let page = page_size();
        let len = len
            .checked_next_multiple_of(page)
            .filter(|l| *l > 0 && *l <= isize::MAX as usize)
            .ok_or_else(|| BackendError::invalid(format!("mapping of {len} bytes")))?;
        // SAFETY: a new anonymous private mapping at an address of the kernel's choosing
        // (null hint, no MAP_FIXED) cannot alias any existing Rust object.
        let raw = unsafe {
            mmap_anonymous(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::PRIVATE,
            )
        }
        .map_err(|e| BackendError::os("mmap", std::io::Error::from(e)))?;
        let ptr = NonNull::new(raw.cast::<u8>())
            .ok_or_else(|| BackendError::invalid("mmap returned null"))?;
        Ok(PageMapping { ptr, len })
    }

    /// Start address.
    pub fn addr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }

    /// Start as a raw pointer (for the backend's register calls).
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Length in bytes (a whole number of pages).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: a mapping has at least one page.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The mapped bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr..ptr+len` is a live read/write mapping owned by self (zero-filled by the
        // kernel, so initialized); the borrow of self keeps it mapped and unaliased by `&mut`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The mapped bytes, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`; `&mut self` guarantees this is the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for PageMapping {
    fn drop(&mut self) {
        // SAFETY: `ptr..ptr+len` is exactly the mapping made in `new`, unmapped only here; no
        // slice borrowed from self outlives this `&mut self`.
        if let Err(e) = unsafe { munmap(self.ptr.as_ptr().cast(), self.len) } {
            tracing::warn!(addr = self.addr(), len = self.len, error = %e, "munmap failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mapping_is_page_aligned_zeroed_and_writable() {
        let page = page_size();
        let mut m = PageMapping::new(page + 1).unwrap();
        assert_eq!(m.len(), 2 * page);
        assert_eq!(m.addr() % page as u64, 0);
        assert!(m.as_slice().iter().all(|b| *b == 0));
        m.as_mut_slice()[page] = 7;
        assert_eq!(m.as_slice()[page], 7);
        assert!(PageMapping::new(0).is_err());
        assert!(PageMapping::new(usize::MAX - 10).is_err());
    }
}
