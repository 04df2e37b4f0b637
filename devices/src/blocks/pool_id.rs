//! The id of a private memory pool: a leaf, so the modules that name pools (the observer's
//! events, the pools' records) need not import the core.

/// Id of a private memory pool (PyTorch's `MempoolId_t`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct MemPoolId(pub u64);
