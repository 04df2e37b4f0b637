//! Fork detection: the allocator remembers the process that created it; a call from a
//! forked child gets [`Error::Forked`](crate::Error::Forked) instead of touching device
//! state and threads that did not survive the fork (which could hang).

use crate::error::Error;

/// The process an allocator belongs to.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ProcessGuard {
    pid: u32,
}

impl ProcessGuard {
    /// Remembers the current process.
    pub fn current() -> Self {
        ProcessGuard {
            pid: std::process::id(),
        }
    }

    /// True in a forked child.
    pub fn forked(&self) -> bool {
        std::process::id() != self.pid
    }

    /// `Err(Forked)` in a forked child.
    pub fn check(&self) -> Result<(), Error> {
        let now = std::process::id();
        if now == self.pid {
            Ok(())
        } else {
            Err(Error::Forked {
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
    fn a_guard_from_another_process_reports_a_fork() {
        let here = ProcessGuard::current();
        assert!(!here.forked());
        assert!(here.check().is_ok());
        let parent = ProcessGuard {
            pid: std::process::id().wrapping_add(1),
        };
        assert!(parent.forked());
        let err = parent.check().unwrap_err();
        assert_eq!(
            err,
            Error::Forked {
                parent: std::process::id().wrapping_add(1),
                child: std::process::id()
            }
        );
        assert!(err.to_string().contains("fork"));
    }
}
