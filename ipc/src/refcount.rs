//! [`RefCountFile`]: a small shared mapping of 8-byte reference counters, one slot per
//! exported buffer, that exporter and importer both map (PyTorch's ref-counter file). The
//! protocol on a slot is [`crate::counter`]; this file only turns the mapping into atomics,
//! which is why it holds `unsafe`.

use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::atomic::AtomicU64;

use crate::error::{IpcError, Result};
use crate::map::{MapOptions, SharedMapping};
use crate::shm::{self, Backing};

/// Slots a connection gets by default (one page of counters).
pub const DEFAULT_SLOTS: usize = 512;

/// See the module docs.
#[derive(Debug)]
pub struct RefCountFile {
    mapping: SharedMapping,
    slots: usize,
}

impl RefCountFile {
    /// Creates a zeroed file of `slots` counters (memfd, fd kept to send it).
    pub fn create(slots: usize) -> Result<RefCountFile> {
        let bytes = (slots as u64)
            .checked_mul(8)
            .filter(|b| *b > 0)
            .ok_or(IpcError::InvalidSize(slots as u64))?;
        let mapping = shm::create(bytes, Backing::Memfd, MapOptions::shared_rw())?;
        Ok(RefCountFile { mapping, slots })
    }

    /// Maps a file received from the exporter (fd closed after mapping). It must be sealed
    /// against resizing ([`IpcError::NotSealed`]) and its size a non-zero multiple of 8.
    pub fn open(fd: OwnedFd) -> Result<RefCountFile> {
        shm::check_sealed(std::os::fd::AsFd::as_fd(&fd))?;
        let mapping = shm::open_fd(
            fd,
            None,
            MapOptions::shared_rw().with_fd(crate::map::FdAfterMap::Close),
        )?;
        if mapping.len() % 8 != 0 {
            return Err(IpcError::Malformed(format!(
                "reference-count file of {} bytes is not a whole number of slots",
                mapping.len()
            )));
        }
        let slots = (mapping.len() / 8) as usize;
        Ok(RefCountFile { mapping, slots })
    }

    /// The kept fd (exporter side), to send to the importer.
    pub fn fd(&self) -> Option<BorrowedFd<'_>> {
        self.mapping.fd()
    }

    /// The counters.
    pub fn counters(&self) -> &[AtomicU64] {
        // SAFETY: the mapping is page aligned (so 8-aligned), read/write, and exactly
        // `slots * 8` bytes long (checked in `create`/`open`); it lives as long as `&self`.
        // `AtomicU64` has the size and alignment of `u64`, and every access to these bytes,
        // in this process and in the peer, goes through atomic instructions, so no
        // non-atomic reference to them exists.
        unsafe { std::slice::from_raw_parts(self.mapping.as_ptr().cast::<AtomicU64>(), self.slots) }
    }

    /// Number of slots.
    pub fn slots(&self) -> usize {
        self.slots
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::counter::SharedCounter;

    #[test]
    fn two_mappings_see_the_same_counters() {
        let a = RefCountFile::create(16).unwrap();
        let b = RefCountFile::open(a.fd().unwrap().try_clone_to_owned().unwrap()).unwrap();
        assert_eq!(b.slots(), 16);
        a.counters()[3].arm(1);
        assert!(!b.counters()[3].is_free());
        assert!(b.counters()[3].release_one());
        assert!(a.counters()[3].is_free());
        assert!(RefCountFile::create(0).is_err());
    }
}
