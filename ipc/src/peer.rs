//! Who may connect: the peer's credentials (SO_PEERCRED) against a [`PeerPolicy`]. By
//! default only processes of this user may share memory with us; the allowed uid is
//! configurable (a service sharing with a known other account, and the tests of the
//! rejection path).

use std::os::fd::BorrowedFd;

use crate::error::{IpcError, Result};

/// The peer process, as the kernel reports it for a connected Unix socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerCred {
    /// Its pid (at connect time).
    pub pid: u32,
    /// Its effective uid.
    pub uid: u32,
    /// Its effective gid.
    pub gid: u32,
}

/// Which peers are accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerPolicy {
    /// The one uid allowed to connect.
    pub allowed_uid: u32,
}

impl Default for PeerPolicy {
    /// Only this process's effective user.
    fn default() -> Self {
        PeerPolicy::same_user()
    }
}

impl PeerPolicy {
    /// Only this process's effective user.
    pub fn same_user() -> Self {
        PeerPolicy {
            allowed_uid: rustix::process::geteuid().as_raw(),
        }
    }

    /// Only `uid`.
    pub fn allow_uid(uid: u32) -> Self {
        PeerPolicy { allowed_uid: uid }
    }

    /// Reads the peer's credentials from `sock` and checks them: another uid is
    /// [`IpcError::PeerNotAllowed`].
    pub fn check(&self, sock: BorrowedFd<'_>) -> Result<PeerCred> {
        let cred = peer_cred(sock)?;
        if cred.uid != self.allowed_uid {
            tracing::warn!(uid = cred.uid, pid = cred.pid, "ipc peer rejected");
            return Err(IpcError::PeerNotAllowed {
                uid: cred.uid,
                pid: cred.pid,
                allowed: self.allowed_uid,
            });
        }
        Ok(cred)
    }
}

/// The peer's credentials (SO_PEERCRED).
pub fn peer_cred(sock: BorrowedFd<'_>) -> Result<PeerCred> {
    let c = rustix::net::sockopt::socket_peercred(sock)
        .map_err(|e| IpcError::os("getsockopt(SO_PEERCRED)", e))?;
    Ok(PeerCred {
        pid: c.pid.as_raw_nonzero().get() as u32,
        uid: c.uid.as_raw(),
        gid: c.gid.as_raw(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    #[test]
    fn same_user_passes_and_another_uid_is_rejected() {
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        let me = rustix::process::geteuid().as_raw();
        let cred = PeerPolicy::default().check(a.as_fd()).unwrap();
        assert_eq!(cred.uid, me);
        assert_eq!(cred.pid, std::process::id());
        let other = me.wrapping_add(4242);
        match PeerPolicy::allow_uid(other).check(a.as_fd()) {
            Err(IpcError::PeerNotAllowed { uid, allowed, .. }) => {
                assert_eq!((uid, allowed), (me, other))
            }
            r => panic!("{r:?}"),
        }
    }
}
