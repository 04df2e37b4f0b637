//! Memory objects to map: anonymous shared memory (memfd, or POSIX `shm_open` with a random
//! name that is unlinked right after mapping), an fd received from another process, or a
//! file. This is PyTorch's `MapAllocator` open/resize steps, each a function instead of a
//! flag; the mapping itself is [`crate::map`].
//!
//! Every path checks the object with `fstat` first: an fd that is not a regular or
//! shared-memory file is [`IpcError::NotSharedMemory`], and a mapping longer than the object
//! is [`IpcError::SizeMismatch`] (mapping past the end would SIGBUS the reader). Objects are
//! created with mode 0600 (this user only); sizes are set with `ftruncate` only on objects
//! opened writable.
//!
//! Sealing: a process that holds an fd of a memory object can `ftruncate` it, and every other
//! process's mapping of the truncated part then faults (SIGBUS) on its next access. So a
//! memfd from [`create`] is sealed at its size ([`SIZE_SEALS`]: no shrink, no grow, no more
//! seals) before anyone else can see it, [`ensure_sealed`] refuses to hand out what cannot be
//! sealed, and [`check_sealed`] refuses to map what a peer sent unsealed.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::Path;

use rustix::fs::{FileType, Mode, OFlags, SealFlags};

use crate::error::{IpcError, Result};
use crate::map::{Access, MapOptions, SharedMapping};

/// Which kernel object backs anonymous shared memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backing {
    /// `memfd_create`: never has a name.
    Memfd,
    /// `shm_open(O_CREAT | O_EXCL)` under a random name in `/dev/shm`, unlinked right after
    /// mapping (PyTorch's `SHAREDMEM | EXCLUSIVE | UNLINK`).
    ///
    /// **Not for peers.** POSIX shared memory cannot be sealed: any process holding its fd
    /// could truncate it and crash every process mapping it (SIGBUS). The connections
    /// therefore refuse to send it ([`IpcError::Unsealable`]); use [`Backing::Memfd`] for
    /// memory shared with another process.
    PosixShm,
}

/// What `fstat` says about an object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ObjectInfo {
    /// Its size in bytes.
    pub size: u64,
}

/// Checks that `fd` names a mappable memory object (a regular file, which memfds and POSIX
/// shared memory are) and returns its size.
pub fn inspect(fd: BorrowedFd<'_>) -> Result<ObjectInfo> {
    let st = rustix::fs::fstat(fd).map_err(|e| IpcError::os("fstat", e))?;
    let kind = match FileType::from_raw_mode(st.st_mode) {
        FileType::RegularFile => None,
        FileType::Fifo => Some("pipe"),
        FileType::Socket => Some("socket"),
        FileType::Directory => Some("directory"),
        FileType::CharacterDevice => Some("character device"),
        FileType::BlockDevice => Some("block device"),
        FileType::Symlink => Some("symlink"),
        FileType::Unknown => Some("unknown file type"),
    };
    if let Some(kind) = kind {
        return Err(IpcError::NotSharedMemory { kind });
    }
    let size = u64::try_from(st.st_size).map_err(|_| IpcError::InvalidSize(0))?;
    Ok(ObjectInfo { size })
}

/// Creates `len` bytes of anonymous shared memory and maps it read/write, shared, with the
/// fd kept (to send it to another process) unless `options` says otherwise. A memfd is
/// sealed at `len` ([`SIZE_SEALS`]), so no holder of its fd can resize it. A
/// [`Backing::PosixShm`] name is unlinked right after mapping (and on every error path), so
/// nothing is left in `/dev/shm` whatever happens.
pub fn create(len: u64, backing: Backing, options: MapOptions) -> Result<SharedMapping> {
    if len == 0 {
        return Err(IpcError::InvalidSize(len));
    }
    let options = MapOptions {
        access: Access::ReadWrite,
        ..options
    };
    match backing {
        Backing::Memfd => {
            let fd = rustix::fs::memfd_create(
                "gpualloc-shm",
                rustix::fs::MemfdFlags::CLOEXEC | rustix::fs::MemfdFlags::ALLOW_SEALING,
            )
            .map_err(|e| IpcError::os("memfd_create", e))?;
            resize(fd.as_fd(), len)?;
            rustix::fs::fcntl_add_seals(&fd, SIZE_SEALS)
                .map_err(|e| IpcError::os("fcntl(F_ADD_SEALS)", e))?;
            SharedMapping::map(fd, len, options)
        }
        Backing::PosixShm => {
            let name = random_name()?;
            let fd = rustix::shm::open(
                name.as_str(),
                rustix::shm::OFlags::CREATE | rustix::shm::OFlags::EXCL | rustix::shm::OFlags::RDWR,
                Mode::RUSR | Mode::WUSR,
            )
            .map_err(|e| IpcError::os("shm_open", e))?;
            let unlink = Unlink(name);
            resize(fd.as_fd(), len)?;
            let mapping = SharedMapping::map(fd, len, options);
            drop(unlink);
            mapping
        }
    }
}

/// Seals that fix an object's size for good: no shrink, no grow, no further seals (so nobody
/// can add a write seal either).
pub const SIZE_SEALS: SealFlags = SealFlags::SHRINK
    .union(SealFlags::GROW)
    .union(SealFlags::SEAL);

/// Makes sure `fd`'s object carries [`SIZE_SEALS`], adding them if it can: for what this
/// process hands to a peer. An object that cannot be sealed (POSIX shared memory, a file, a
/// memfd created without `MFD_ALLOW_SEALING` or already sealed otherwise) is
/// [`IpcError::Unsealable`].
pub fn ensure_sealed(fd: BorrowedFd<'_>) -> Result<()> {
    let seals = rustix::fs::fcntl_get_seals(fd)
        .map_err(|e| IpcError::Unsealable(format!("not a memfd: {}", std::io::Error::from(e))))?;
    if seals.contains(SIZE_SEALS) {
        return Ok(());
    }
    rustix::fs::fcntl_add_seals(fd, SIZE_SEALS)
        .map_err(|e| IpcError::Unsealable(format!("F_ADD_SEALS: {}", std::io::Error::from(e))))
}

/// Checks that an object a peer sent cannot change size under our mapping (it carries the
/// shrink and grow seals): else [`IpcError::NotSealed`]. Something that is not a memory
/// object at all is [`IpcError::NotSharedMemory`] first.
pub fn check_sealed(fd: BorrowedFd<'_>) -> Result<()> {
    inspect(fd)?;
    let seals = rustix::fs::fcntl_get_seals(fd).unwrap_or(SealFlags::empty());
    if seals.contains(SealFlags::SHRINK | SealFlags::GROW) {
        Ok(())
    } else {
        Err(IpcError::NotSealed {
            seals: seals.bits(),
        })
    }
}

/// Maps shared memory from an fd received from another process (PyTorch's
/// `SHAREDMEM | NOCREATE | FROMFD`). `len` of `None` maps the whole object; a `len` larger
/// than the object is [`IpcError::SizeMismatch`]; a pipe or socket is
/// [`IpcError::NotSharedMemory`]. Never resizes.
pub fn open_fd(fd: OwnedFd, len: Option<u64>, options: MapOptions) -> Result<SharedMapping> {
    let info = inspect(fd.as_fd())?;
    let len = len.unwrap_or(info.size);
    SharedMapping::map(fd, len, options)
}

/// Maps a file: shared (writes reach the file) or private (copy-on-write), read-only or
/// read/write. `set_len` resizes the file first with `ftruncate`, which needs
/// [`Access::ReadWrite`] (else [`IpcError::ReadOnly`]); without it the whole file is mapped.
/// A writable open creates the file with mode 0600 if it does not exist.
pub fn open_file(path: &Path, set_len: Option<u64>, options: MapOptions) -> Result<SharedMapping> {
    let writable = options.access == Access::ReadWrite;
    if set_len.is_some() && !writable {
        return Err(IpcError::ReadOnly);
    }
    // A private mapping may be written (copy-on-write) through a read-only fd.
    let open_rw = (writable && options.sharing == crate::map::Sharing::Shared) || set_len.is_some();
    let flags = if open_rw {
        OFlags::RDWR | OFlags::CREATE | OFlags::CLOEXEC
    } else {
        OFlags::RDONLY | OFlags::CLOEXEC
    };
    let fd = rustix::fs::open(path, flags, Mode::RUSR | Mode::WUSR)
        .map_err(|e| IpcError::os("open", e))?;
    if let Some(len) = set_len {
        resize(fd.as_fd(), len)?;
    }
    let len = inspect(fd.as_fd())?.size;
    SharedMapping::map(fd, len, options)
}

/// Sets the object's size with `ftruncate` (the fd must be writable).
pub fn resize(fd: BorrowedFd<'_>, len: u64) -> Result<()> {
    if len == 0 {
        return Err(IpcError::InvalidSize(len));
    }
    rustix::fs::ftruncate(fd, len).map_err(|e| IpcError::os("ftruncate", e))
}

/// Names of POSIX shared memory objects this crate creates start with this.
pub const SHM_PREFIX: &str = "gpualloc-";

/// `/gpualloc-<pid>-<16 random hex digits>`.
fn random_name() -> Result<String> {
    let mut bytes = [0u8; 8];
    rustix::rand::getrandom(&mut bytes, rustix::rand::GetRandomFlags::empty())
        .map_err(|e| IpcError::os("getrandom", e))?;
    let pid = rustix::process::getpid().as_raw_nonzero().get();
    Ok(format!(
        "/{SHM_PREFIX}{pid}-{:016x}",
        u64::from_le_bytes(bytes)
    ))
}

/// Unlinks a POSIX shared memory name when dropped.
struct Unlink(String);

impl Drop for Unlink {
    fn drop(&mut self) {
        if let Err(e) = rustix::shm::unlink(self.0.as_str()) {
            tracing::warn!(name = %self.0, error = %e, "shm_unlink failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::map::{FdAfterMap, Sharing};

    /// Serializes the tests that create POSIX names, so the "no name left" check does not
    /// see another test's name in its short open-to-unlink window.
    static SHM_LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());

    fn shm_names() -> Vec<String> {
        let pid = rustix::process::getpid().as_raw_nonzero().get();
        let prefix = format!("{SHM_PREFIX}{pid}-");
        std::fs::read_dir("/dev/shm")
            .map(|d| {
                d.filter_map(|e| e.ok())
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .filter(|n| n.starts_with(&prefix))
                    .collect()
            })
            .unwrap_or_default()
    }

    #[test]
    fn memfd_and_shm_share_between_mappings_and_leave_no_name() {
        let _g = SHM_LOCK.lock().unwrap_or_else(|p| p.into_inner());
        for backing in [Backing::Memfd, Backing::PosixShm] {
            let a = create(8192, backing, MapOptions::shared_rw()).unwrap();
            assert_eq!(a.len(), 8192);
            let fd = a.fd().unwrap().try_clone_to_owned().unwrap();
            let b = open_fd(fd, None, MapOptions::shared_rw()).unwrap();
            a.write_at(4000, b"hello").unwrap();
            let mut got = [0u8; 5];
            b.read_at(4000, &mut got).unwrap();
            assert_eq!(&got, b"hello");
            assert!(shm_names().is_empty(), "{:?}", shm_names());
        }
    }

    #[test]
    fn mode_is_0600_and_size_checked_against_fstat() {
        let _g = SHM_LOCK.lock().unwrap_or_else(|p| p.into_inner());
        let a = create(4096, Backing::PosixShm, MapOptions::shared_rw()).unwrap();
        let st = rustix::fs::fstat(a.fd().unwrap()).unwrap();
        assert_eq!(st.st_mode & 0o777, 0o600);
        let fd = a.fd().unwrap().try_clone_to_owned().unwrap();
        match open_fd(fd, Some(4097), MapOptions::shared_ro()) {
            Err(IpcError::SizeMismatch { requested, actual }) => {
                assert_eq!((requested, actual), (4097, 4096))
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn pipe_is_not_shared_memory() {
        let (r, _w) = rustix::pipe::pipe().unwrap();
        match open_fd(r, Some(4096), MapOptions::shared_ro()) {
            Err(IpcError::NotSharedMemory { kind }) => assert_eq!(kind, "pipe"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn private_mapping_is_copy_on_write_and_read_only_refuses_writes() {
        let a = create(4096, Backing::Memfd, MapOptions::shared_rw()).unwrap();
        a.write_at(0, &[7; 16]).unwrap();
        let fd = a.fd().unwrap().try_clone_to_owned().unwrap();
        let private = MapOptions {
            access: Access::ReadWrite,
            sharing: Sharing::Private,
            fd: FdAfterMap::Close,
            advice: Some(crate::map::Advice::Sequential),
        };
        let p = open_fd(fd, None, private).unwrap();
        assert!(p.fd().is_none());
        p.write_at(0, &[9; 16]).unwrap();
        assert_eq!(a.to_vec()[..16], [7; 16]);
        assert_eq!(p.to_vec()[..16], [9; 16]);
        let ro = open_fd(
            a.fd().unwrap().try_clone_to_owned().unwrap(),
            None,
            MapOptions::shared_ro(),
        )
        .unwrap();
        assert!(matches!(ro.write_at(0, &[1]), Err(IpcError::ReadOnly)));
        assert!(matches!(
            ro.read_at(4090, &mut [0; 7]),
            Err(IpcError::SizeMismatch { .. })
        ));
    }

    #[test]
    fn file_shared_writes_through_and_read_only_cannot_resize() {
        let dir = std::env::temp_dir().join(format!(
            "gpualloc-ipc-test-{}",
            rustix::process::getpid().as_raw_nonzero().get()
        ));
        let m = open_file(&dir, Some(4096), MapOptions::shared_rw()).unwrap();
        m.write_at(10, b"abc").unwrap();
        drop(m);
        let bytes = std::fs::read(&dir).unwrap();
        assert_eq!(bytes.len(), 4096);
        assert_eq!(&bytes[10..13], b"abc");
        assert!(matches!(
            open_file(&dir, Some(8192), MapOptions::shared_ro()),
            Err(IpcError::ReadOnly)
        ));
        let ro = open_file(&dir, None, MapOptions::shared_ro()).unwrap();
        assert_eq!(ro.len(), 4096);
        std::fs::remove_file(&dir).unwrap();
        assert!(matches!(
            create(0, Backing::Memfd, MapOptions::shared_rw()),
            Err(IpcError::InvalidSize(0))
        ));
    }
}
