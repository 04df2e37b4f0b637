//! Fork detection without a system call on the hot path.
//!
//! After `fork` the child's copy of an allocator is dead: its threads (actor tasks, sim
//! streams, the blocking pool) did not survive, and a gate held by one of them stays held
//! forever. Every call must therefore know whether it runs in the process that created the
//! allocator; `getpid` costs ~140 ns (glibc no longer caches it), more than a cache hit.
//!
//! So the process keeps one page mapped with `MADV_WIPEONFORK`, holding its pid: the kernel
//! zeroes that page in a forked child, so a guard compares one relaxed atomic load with the
//! pid it was created under. A guard created in the child re-stamps the page with the
//! child's pid. Where the kernel lacks `MADV_WIPEONFORK` (before Linux 4.14) the guard falls
//! back to comparing `getpid`.
//!
//! This is a memory mapping, hence the `unsafe` here (see the `SAFETY` comments).

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::OnceLock;

static MARKER: OnceLock<Option<&'static AtomicU32>> = OnceLock::new();

fn map_marker() -> Option<&'static AtomicU32> {
    let len = rustix::param::page_size();
    // SAFETY: a fresh anonymous private mapping at an address the kernel chooses: it aliases
    // nothing in this process. It is never unmapped (leaked on purpose: one page).
    let ptr = unsafe {
        rustix::mm::mmap_anonymous(
            std::ptr::null_mut(),
            len,
            rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
            rustix::mm::MapFlags::PRIVATE,
        )
    }
    .ok()?;
    // SAFETY: `ptr..ptr+len` is the mapping just created, owned by this function.
    let advised = unsafe { rustix::mm::madvise(ptr, len, rustix::mm::Advice::LinuxWipeOnFork) };
    if advised.is_err() {
        // SAFETY: unmapping the mapping created above, which nothing else references.
        let _ = unsafe { rustix::mm::munmap(ptr, len) };
        return None;
    }
    // SAFETY: the page is readable and writable for the rest of the process's life (never
    // unmapped), page aligned (so aligned for a u32), zero-initialized (a valid AtomicU32),
    // and only ever accessed through this atomic reference.
    Some(unsafe { &*(ptr as *const AtomicU32) })
}

fn marker() -> Option<&'static AtomicU32> {
    *MARKER.get_or_init(map_marker)
}

/// Remembers the process it was created in and tells, cheaply, whether it is now used in a
/// forked child. See the module docs.
#[derive(Debug, Clone, Copy)]
pub struct ForkGuard {
    pid: u32,
    marker: Option<&'static AtomicU32>,
}

impl ForkGuard {
    /// A guard for the current process.
    pub fn current() -> Self {
        let pid = std::process::id();
        let marker = marker();
        if let Some(m) = marker {
            // In a fork child the page reads 0 (or an older pid): stamp it with ours.
            if m.load(Ordering::Relaxed) != pid {
                m.store(pid, Ordering::Relaxed);
            }
        }
        ForkGuard { pid, marker }
    }

    /// The process the guard was created in.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// True when running in a forked child of that process. One atomic load.
    #[inline]
    pub fn forked(&self) -> bool {
        match self.marker {
            Some(m) => m.load(Ordering::Relaxed) != self.pid,
            None => std::process::id() != self.pid,
        }
    }

    /// True when the cheap (no system call) check is in use.
    pub fn is_cheap(&self) -> bool {
        self.marker.is_some()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn not_forked_here_and_cheap_on_this_kernel() {
        let g = ForkGuard::current();
        assert!(!g.forked());
        assert_eq!(g.pid(), std::process::id());
        assert!(
            g.is_cheap(),
            "MADV_WIPEONFORK is available on Linux >= 4.14"
        );
        let stale = ForkGuard {
            pid: g.pid().wrapping_add(1),
            marker: g.marker,
        };
        assert!(stale.forked(), "a guard of another pid reads as forked");
    }
}
