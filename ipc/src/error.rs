//! Typed errors of the ipc crate: one enum, one variant per way sharing can go wrong.
//!
//! Everything that crosses a process boundary is untrusted: a bad fd, a lying size, a
//! truncated or garbage message and a peer of another user each get their own variant, so a
//! caller can tell an attack or a bug from an OS hiccup.

use gpualloc_runtime::BackendError;

/// Result of an ipc operation.
pub type Result<T, E = IpcError> = std::result::Result<T, E>;

/// What sharing memory between processes can fail with.
#[derive(Debug, thiserror::Error)]
pub enum IpcError {
    /// An OS call failed.
    #[error("os error in {op}: {source}")]
    Os {
        /// The call that failed.
        op: &'static str,
        /// The error it returned.
        #[source]
        source: std::io::Error,
    },
    /// The fd is not a shared-memory object (a pipe, a socket, a directory...).
    #[error("fd is not shared memory: it is a {kind}")]
    NotSharedMemory {
        /// What it is instead.
        kind: &'static str,
    },
    /// A mapping asked for more bytes than the object has (mapping past the end would
    /// crash the reader with SIGBUS).
    #[error("asked to map {requested} bytes of an object of {actual} bytes")]
    SizeMismatch {
        /// Bytes asked for.
        requested: u64,
        /// Bytes the object really has (fstat).
        actual: u64,
    },
    /// A zero or unrepresentable size.
    #[error("invalid size {0}")]
    InvalidSize(u64),
    /// Resizing needs a writable object.
    #[error("cannot resize a read-only object")]
    ReadOnly,
    /// The peer process runs as a user the policy does not allow.
    #[error("peer uid {uid} (pid {pid}) is not allowed (allowed: {allowed})")]
    PeerNotAllowed {
        /// The peer's uid (SO_PEERCRED).
        uid: u32,
        /// The peer's pid.
        pid: u32,
        /// The uid the policy allows.
        allowed: u32,
    },
    /// The peer closed the connection.
    #[error("connection closed by the peer")]
    Closed,
    /// The connection ended in the middle of a message.
    #[error("truncated message: got {got} of {expected} bytes")]
    Truncated {
        /// Bytes received.
        got: usize,
        /// Bytes the message needed.
        expected: usize,
    },
    /// The bytes are not a message of this protocol.
    #[error("malformed message: {0}")]
    Malformed(String),
    /// The peer speaks another version of the protocol.
    #[error("protocol version {got}, this side speaks {expected}")]
    Version {
        /// The peer's version.
        got: u16,
        /// Ours.
        expected: u16,
    },
    /// A message arrived that this side did not expect now.
    #[error("unexpected message: expected {expected}, got {got}")]
    Unexpected {
        /// What was expected.
        expected: &'static str,
        /// What came.
        got: String,
    },
    /// The message carried the wrong number of fds.
    #[error("message carries {got} fds, expected {expected}")]
    FdCount {
        /// Fds received.
        got: usize,
        /// Fds the header announced.
        expected: usize,
    },
    /// Too many fds for one message.
    #[error("{0} fds do not fit in one message")]
    TooManyFds(usize),
    /// The description of a device buffer to export is inconsistent.
    #[error("invalid export: {0}")]
    InvalidExport(String),
    /// A shared-memory object another process sent is not sealed against resizing: its
    /// owner could truncate it under our mapping (a SIGBUS on the next access).
    #[error("shared memory from a peer is not sealed against resizing (seals {seals:#x})")]
    NotSealed {
        /// The seals it has (`F_GET_SEALS`).
        seals: u32,
    },
    /// The object cannot be sealed (a POSIX shared-memory object or a file), so it is not
    /// handed to a peer, which could truncate it under this process's mapping.
    #[error("cannot seal this object against resizing ({0}): only memfds are shared with peers")]
    Unsealable(String),
    /// The exporter took the offered buffer back (its connection ended) before this importer
    /// accepted it: the buffer is refused, its memory may already belong to someone else.
    #[error("offer {0} was withdrawn: the exporter took the buffer back before it was accepted")]
    Withdrawn(u64),
    /// No such export (unknown id).
    #[error("unknown export id {0}")]
    UnknownExport(u64),
    /// Every reference-count slot of the connection is in use.
    #[error("all {0} reference-count slots are in use")]
    SlotsExhausted(usize),
    /// A new exporter connection would pass one of the keeper's bounds (`keeper`): the
    /// connection is refused before anything is exported on it.
    #[error("too many {what} (at most {limit}): connection refused")]
    KeeperLimit {
        /// Which bound.
        what: &'static str,
        /// Its value.
        limit: usize,
    },
    /// The GPU runtime failed.
    #[error(transparent)]
    Backend(#[from] BackendError),
}

impl IpcError {
    /// Maps an OS error from `op`.
    pub fn os(op: &'static str, err: impl Into<std::io::Error>) -> Self {
        IpcError::Os {
            op,
            source: err.into(),
        }
    }
}
