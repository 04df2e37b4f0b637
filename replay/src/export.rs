//! Export of the allocator's state as a PyTorch memory snapshot pickle: the writer lives in
//! `gpualloc-devices` (`snapshot_pickle`), shared with the allocator's own `snapshot_pickle`.

pub use gpualloc_devices::snapshot_pickle::{to_pickle, to_snapshot};
