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
//! All of them produce [`TraceEntry`] lists.

mod error;
mod event;
pub mod jsonl;
pub mod pickle;
pub mod rmm_csv;
pub mod snapshot;

pub use error::{PickleError, TraceError};
pub use event::{Action, Frame, TraceEntry};
pub use snapshot::{Block, BlockState, Segment, SegmentType, Snapshot};
