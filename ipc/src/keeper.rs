//! What happens to exports still out when the exporter drops its connection.
//!
//! The crate's promise is that an exported block stays alive until the importer releases it
//! or dies. Taking the blocks back the moment the exporter drops its connection (or the
//! moment `serve` fails on a malformed frame or a read timeout) would break it: the importer
//! still has the memory mapped, and its writes would land in whatever the cache hands the
//! block to next. So a connection dropped with exports out hands them to the keeper, which
//! collects what the importer releases and takes the rest back only at the importer's end:
//! when it closed its connection and every buffer of it, or died.
//!
//! - **One keeper for all kept connections**: a thread polling their sockets (and an
//!   eventfd that wakes it for new ones), started with the first connection and gone once no
//!   connection is open or kept. It reads with `MSG_DONTWAIT`, so a timeout or a non-blocking
//!   flag the caller put on its socket means "nothing yet", never "gone": only a zero-byte
//!   read (EOF) or a reset is the importer's end. It also reads the shared counters every
//!   [`COLLECT_EVERY`], so a release made through the counter alone is not held up until the
//!   importer's next byte.
//! - **It shuts down its sending side** when it takes a connection: the importer's `recv`
//!   sees `Closed` at once (its consumer loop ends and releases what it held), while the
//!   keeper still reads the releases.
//! - **Everything it needs is taken when the connection is made** (`KeeperSlot::reserve`):
//!   the socket's duplicate, the keeper's thread and eventfd, and a place under the bounds
//!   below. A connection that cannot have them is refused then, with a typed error; dropping
//!   one can never fail into freeing memory a peer still maps.
//! - **Bounds**: at most [`MAX_CONNECTIONS`] exporter connections are open or kept at once
//!   in the process, at most [`MAX_CONNECTIONS_PER_PEER`] for one peer process; past them a
//!   new connection is refused ([`IpcError::KeeperLimit`]). Each holds at most its slots'
//!   exports ([`crate::refcount::DEFAULT_SLOTS`]), so a peer can make the exporter keep at
//!   most that many connections' exports, for as long as it keeps them (that is, as long as
//!   it holds the memory it was given, or lives).

use std::collections::BTreeMap;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use rustix::event::{EventfdFlags, PollFd, PollFlags, Timespec};
use rustix::io::Errno;
use rustix::net::{RecvFlags, Shutdown};

use crate::error::{IpcError, Result};
use crate::exporter::ExporterState;
use crate::peer::PeerCred;

/// Exporter connections open or kept at once, in the whole process.
pub const MAX_CONNECTIONS: usize = 4096;
/// Exporter connections open or kept at once for one peer process.
pub const MAX_CONNECTIONS_PER_PEER: usize = 1024;
/// How often the keeper reads the shared counters of the connections it keeps, besides
/// whenever bytes arrive.
pub const COLLECT_EVERY: Duration = Duration::from_millis(200);

/// A connection the keeper holds: the socket's duplicate, and the exports still out.
struct Kept {
    sock: OwnedFd,
    state: ExporterState,
}

struct Keeper {
    /// The running thread's wake-up eventfd; `None` while no thread runs.
    wake: Option<Arc<OwnedFd>>,
    /// Connections open (with a [`KeeperSlot`]) or kept.
    connections: usize,
    per_peer: BTreeMap<u32, usize>,
    /// Connections handed over, not yet taken by the thread.
    incoming: Vec<Kept>,
}

static KEEPER: Mutex<Keeper> = Mutex::new(Keeper {
    wake: None,
    connections: 0,
    per_peer: BTreeMap::new(),
    incoming: Vec::new(),
});

fn keeper() -> MutexGuard<'static, Keeper> {
    // The keeper's state stays consistent at every await-free step; a panic elsewhere while
    // holding the lock leaves nothing half-done worth refusing over.
    KEEPER.lock().unwrap_or_else(|p| p.into_inner())
}

impl Keeper {
    /// A connection of `pid` is gone (closed with nothing out, or its exports all back).
    fn forget(&mut self, pid: u32) {
        self.connections -= 1;
        if let Some(n) = self.per_peer.get_mut(&pid) {
            *n -= 1;
            if *n == 0 {
                self.per_peer.remove(&pid);
            }
        }
    }

    fn wake(&self) {
        if let Some(fd) = &self.wake {
            // An eventfd write fails only when the counter would overflow: it is then
            // nonzero, and the thread wakes anyway.
            let _ = rustix::io::write(fd.as_fd(), &1u64.to_ne_bytes());
        }
    }
}

/// A connection's place with the keeper, taken when the connection is made: dropping the
/// connection hands its exports over ([`KeeperSlot::keep`]) or gives the place back.
pub(crate) struct KeeperSlot {
    /// The socket's duplicate; `None` once handed over.
    sock: Option<OwnedFd>,
    pid: u32,
}

impl KeeperSlot {
    /// Takes a place for a connection over `sock` with `peer`: refused past the bounds, or
    /// when the socket cannot be duplicated or the keeper's thread cannot be started.
    pub(crate) fn reserve(sock: BorrowedFd<'_>, peer: PeerCred) -> Result<KeeperSlot> {
        let mut k = keeper();
        if k.connections >= MAX_CONNECTIONS {
            return Err(IpcError::KeeperLimit {
                what: "exporter connections in this process",
                limit: MAX_CONNECTIONS,
            });
        }
        if k.per_peer.get(&peer.pid).copied().unwrap_or(0) >= MAX_CONNECTIONS_PER_PEER {
            return Err(IpcError::KeeperLimit {
                what: "exporter connections for one peer process",
                limit: MAX_CONNECTIONS_PER_PEER,
            });
        }
        let dup = sock
            .try_clone_to_owned()
            .map_err(|e| IpcError::os("dup (the keeper's socket)", e))?;
        if k.wake.is_none() {
            let wake = rustix::event::eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)
                .map_err(|e| IpcError::os("eventfd (the keeper's)", e))?;
            let wake = Arc::new(wake);
            let theirs = wake.clone();
            std::thread::Builder::new()
                .name("gpualloc-ipc-keeper".into())
                .spawn(move || run(theirs))
                .map_err(|e| IpcError::os("spawn (the keeper's thread)", e))?;
            k.wake = Some(wake);
        }
        k.connections += 1;
        *k.per_peer.entry(peer.pid).or_insert(0) += 1;
        Ok(KeeperSlot {
            sock: Some(dup),
            pid: peer.pid,
        })
    }

    /// Hands `state`'s exports to the keeper. Cannot fail: everything was taken at
    /// [`KeeperSlot::reserve`].
    pub(crate) fn keep(mut self, state: ExporterState) {
        let Some(sock) = self.sock.take() else {
            return;
        };
        let mut k = keeper();
        k.incoming.push(Kept { sock, state });
        k.wake();
    }
}

impl Drop for KeeperSlot {
    fn drop(&mut self) {
        if self.sock.take().is_some() {
            let mut k = keeper();
            k.forget(self.pid);
            // The thread ends once nothing is open or kept.
            k.wake();
        }
    }
}

/// Reads (and drops) everything the importer sent, without blocking; true at the importer's
/// end (EOF, or its socket reset), false when nothing more is there for now.
fn drained_to_end(sock: BorrowedFd<'_>) -> bool {
    let mut buf = [0u8; 4096];
    loop {
        // A plain recv: fds a peer attaches are closed by the kernel, bytes are ignored
        // (only the shared counters say what was released).
        match rustix::net::recv(sock, &mut buf, RecvFlags::DONTWAIT) {
            Ok((0, _)) => return true,
            Ok(_) | Err(Errno::INTR) => {}
            Err(Errno::AGAIN) => return false,
            Err(_) => return true,
        }
    }
}

/// The keeper's thread: polls the kept sockets until no connection is open or kept.
fn run(wake: Arc<OwnedFd>) {
    let mut kept: Vec<Kept> = Vec::new();
    let every = Timespec {
        tv_sec: COLLECT_EVERY.as_secs() as _,
        tv_nsec: COLLECT_EVERY.subsec_nanos() as _,
    };
    loop {
        {
            let mut k = keeper();
            for mut new in k.incoming.drain(..) {
                // The importer sees `Closed` at once; releases still come in.
                let _ = rustix::net::shutdown(&new.sock, Shutdown::Write);
                new.state.collect();
                kept.push(new);
            }
            if kept.is_empty() && k.connections == 0 {
                k.wake = None;
                return;
            }
        }
        let mut fds: Vec<PollFd<'_>> = Vec::with_capacity(kept.len() + 1);
        fds.push(PollFd::new(&*wake, PollFlags::IN));
        fds.extend(kept.iter().map(|c| PollFd::new(&c.sock, PollFlags::IN)));
        let timeout = (!kept.is_empty()).then_some(&every);
        let ready: Vec<bool> = match rustix::event::poll(&mut fds, timeout) {
            Ok(_) => fds[1..].iter().map(|f| !f.revents().is_empty()).collect(),
            // EINTR, or (never seen) a poll that cannot run: look at every socket.
            Err(_) => vec![true; kept.len()],
        };
        drop(fds);
        let mut count = [0u8; 8];
        let _ = rustix::io::read(wake.as_fd(), &mut count);
        let mut gone = Vec::new();
        // Backwards, so that `swap_remove` moves only entries already looked at.
        for (i, is_ready) in ready.into_iter().enumerate().rev() {
            let c = &mut kept[i];
            let ended = is_ready && drained_to_end(c.sock.as_fd());
            c.state.collect();
            if ended || c.state.outstanding() == 0 {
                // Dropping the state takes back whatever is still out.
                gone.push(kept.swap_remove(i).state.peer.pid);
            }
        }
        if !gone.is_empty() {
            let mut k = keeper();
            for pid in gone {
                k.forget(pid);
            }
        }
    }
}

/// Exporter connections open or kept at this moment, in the whole process (what
/// [`MAX_CONNECTIONS`] bounds).
pub fn connections() -> usize {
    keeper().connections
}

/// Whether the keeper's thread runs (it does while an exporter connection is open or kept).
pub fn running() -> bool {
    keeper().wake.is_some()
}
