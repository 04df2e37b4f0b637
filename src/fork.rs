//! Fork detection: the allocator remembers the process that created it; a call from a
//! forked child gets [`Error::Forked`](crate::Error::Forked) instead of touching device
//! state and threads that did not survive the fork (which could hang).
//!
//! The check itself costs one memory load (see `gpualloc_actor::fork`).

use gpualloc_actor::ForkGuard;

use crate::error::Error;

/// The process an allocator belongs to.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ProcessGuard {
    guard: ForkGuard,
    #[cfg(test)]
    fake_parent: Option<u32>,
}

impl ProcessGuard {
    /// Remembers the current process.
    pub fn current() -> Self {
        ProcessGuard {
            guard: ForkGuard::current(),
            #[cfg(test)]
            fake_parent: None,
        }
    }

    /// True in a forked child.
    #[inline]
    pub fn forked(&self) -> bool {
        #[cfg(test)]
        if self.fake_parent.is_some() {
            return true;
        }
        self.guard.forked()
    }

    /// `Err(Forked)` in a forked child.
    #[inline]
    pub fn check(&self) -> Result<(), Error> {
        if !self.forked() {
            return Ok(());
        }
        #[cfg(test)]
        let parent = self.fake_parent.unwrap_or(self.guard.pid());
        #[cfg(not(test))]
        let parent = self.guard.pid();
        Err(Error::Forked {
            parent,
            child: std::process::id(),
        })
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
            fake_parent: Some(std::process::id().wrapping_add(1)),
            ..here
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
