//! Fork detection: registrations do not survive into a child process (seed §2.3).
//!
//! After `fork()`, the child has a copy of the parent's address space but none of its
//! device-side state: page-locked registrations, the CUDA context and its streams belong to
//! the parent. A registry inherited by the child would answer from a cache that describes the
//! parent's backend.
//!
//! **Choice: a clear typed error, not silent re-registration.** Every registry records the
//! process id at creation; any operation in another process returns
//! [`RegisterError::Forked`] (and `query` answers `None`:
//! nothing is registered in the child). We do not re-register on demand because the backend
//! handle itself was inherited: CUDA does not support using a context created before
//! `fork()` in the child, so a re-registration through it would fail or corrupt state. The
//! child calls `reset_after_fork(new_backend)`, which forgets the parent's entries (no
//! backend call: the child holds none of them), adopts the child's pid, and returns what was
//! forgotten so the child can re-register what it needs with its own backend.

use super::error::{RegisterError, RegisterResult};

/// The id of the calling process.
pub fn current_pid() -> u32 {
    rustix::process::getpid()
        .as_raw_nonzero()
        .get()
        .unsigned_abs()
}

/// Remembers the process that created a registry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcessGuard {
    pid: u32,
}

impl Default for ProcessGuard {
    fn default() -> Self {
        Self::new()
    }
}

impl ProcessGuard {
    /// A guard for the calling process.
    pub fn new() -> Self {
        ProcessGuard { pid: current_pid() }
    }

    /// The process the guard was created in.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// True when called from a process other than the creator (a forked child).
    pub fn is_forked(&self) -> bool {
        current_pid() != self.pid
    }

    /// `Ok` in the creating process, [`RegisterError::Forked`] elsewhere.
    pub fn check(&self) -> RegisterResult<()> {
        let now = current_pid();
        if now == self.pid {
            Ok(())
        } else {
            Err(RegisterError::Forked {
                parent: self.pid,
                child: now,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_process_is_not_forked() {
        let g = ProcessGuard::new();
        assert_eq!(g.pid(), std::process::id());
        assert!(!g.is_forked());
        assert_eq!(g.check(), Ok(()));
        let other = ProcessGuard { pid: g.pid() + 1 };
        assert!(other.is_forked());
        assert!(matches!(other.check(), Err(RegisterError::Forked { .. })));
    }
}
