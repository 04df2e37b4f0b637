//! Memory-trace formats for gpualloc.
//!
//! - [`pickle`]: a safe pickle reader (plain data only; GLOBAL, REDUCE and every other
//!   code-running opcode is refused), a writer restricted to the opcodes PyTorch's
//!   MemoryViz.js understands, and an opcode scanner.
//! - [`snapshot`]: PyTorch memory snapshots (`torch.cuda.memory._dump_snapshot()`), typed,
//!   imported from and exported to pickles MemoryViz.js opens.
//! - [`rmm_csv`]: RMM's `logging_resource_adaptor` CSV logs.
//! - [`jsonl`]: a documented JSON Lines trace format.
//!
//! All of them produce [`TraceEntry`] lists. A leaf: it knows nothing of the allocator; the
//! allocator's own snapshots are written in these formats by
//! `gpualloc_devices::snapshot_pickle`.
//!
//! ```no_run
//! use gpualloc_trace::{Action, Snapshot};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let bytes = std::fs::read("memory_snapshot.pickle")?;
//! // Refuses code-running pickles; typed errors name the bad field.
//! let snapshot = Snapshot::from_pickle(&bytes)?;
//! println!("{} events, {} segment_alloc", snapshot.event_count(), snapshot.count(Action::SegmentAlloc));
//! // Write it back as a pickle PyTorch's memory viewer opens.
//! std::fs::write("for_memory_viz.pickle", snapshot.to_pickle()?)?;
//! # Ok(())
//! # }
//! ```

mod error;
mod event;
pub mod jsonl;
pub mod pickle;
pub mod rmm_csv;
pub mod snapshot;

pub use error::{PickleError, TraceError};
pub use event::{Action, Frame, TraceEntry};
pub use snapshot::{Block, BlockState, Segment, SegmentType, Snapshot};
