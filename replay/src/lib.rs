//! Offline replay of recorded memory traces through the device core: "how much memory would my
//! training job need under this allocator config?" — answered without a GPU.
//!
//! - [`input`]: loads PyTorch snapshots, RMM CSV logs and JSON Lines traces into one
//!   normalized [`input::Trace`] per device.
//! - [`analysis`]: what a trace says by itself: allocations alive before recording began,
//!   the segments PyTorch held at the start, PyTorch's own peaks.
//! - [`run`]: replays a trace through a `DeviceCore` on the accounting backend (addresses and
//!   byte counts only, so a 60 GiB trace replays on a laptop), cold or warm (PyTorch's exact
//!   start state, comparing every address PyTorch chose).
//! - [`report`]: results as a table and JSON; [`plot`]: memory over time as an SVG or PNG.
//! - [`summary`]: a PyTorch-style memory summary of a snapshot's final state.

pub mod analysis;
pub mod export;
pub mod input;
pub mod plot;
mod recorded_miss;
mod replayer;
pub mod report;
pub mod run;
pub mod summary;
pub mod waste;

pub use input::{load, Trace};
pub use report::ReplayReport;
pub use run::{replay, replay_core, ReplayError, ReplayOptions};
