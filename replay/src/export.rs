//! Export of the allocator's state as a PyTorch memory snapshot pickle: the writer lives in
//! `gpualloc-trace` (`from_allocator`), shared with the allocator's own `snapshot_pickle`.

pub use gpualloc_trace::from_allocator::{to_pickle, to_snapshot};
