//! PyTorch memory snapshots (`torch.cuda.memory._snapshot()` / `_dump_snapshot()`), typed.
//!
//! A snapshot pickle is a dict: `segments` (the allocator's state when the snapshot was
//! taken: one dict per segment with its blocks), `device_traces` (per device, the recorded
//! history of alloc / free_requested / free_completed / segment_alloc / ... events) and, in
//! newer versions, `allocator_settings` and `external_annotations`. [`Snapshot::from_pickle`]
//! reads every shape seen in the wild (with or without `time_us`, `allocator_settings`,
//! `external_annotations`; blocks without `address` or `requested_size`; unknown keys are
//! ignored) through the safe reader; [`Snapshot::to_pickle`] writes a pickle MemoryViz.js
//! (PyTorch's memory viewer) opens.

mod doc;
mod export;
mod import;

use std::collections::BTreeMap;

use crate::event::{Action, Frame, TraceEntry};
use crate::pickle::Value;

/// A memory snapshot: final allocator state plus the recorded event history.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Snapshot {
    /// Segments alive when the snapshot was taken.
    pub segments: Vec<Segment>,
    /// Per device index, the recorded events in order.
    pub device_traces: Vec<Vec<TraceEntry>>,
    /// The allocator's settings (`PYTORCH_CUDA_ALLOC_CONF` and friends), when recorded.
    pub allocator_settings: Option<BTreeMap<String, Value>>,
    /// `external_annotations` (e.g. profiler ranges), kept as-is when present.
    pub external_annotations: Option<Value>,
}

/// Which pool a segment belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SegmentType {
    /// The small pool (blocks of at most 1 MiB, 2 MiB segments).
    Small,
    /// The large pool.
    Large,
}

impl SegmentType {
    /// PyTorch's name: `"small"` or `"large"`.
    pub fn as_str(self) -> &'static str {
        match self {
            SegmentType::Small => "small",
            SegmentType::Large => "large",
        }
    }
}

/// State of a block inside a segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BlockState {
    /// In use by the program.
    ActiveAllocated,
    /// Freed by the program, waiting for streams that used it.
    ActivePendingFree,
    /// Free (cached).
    Inactive,
}

impl BlockState {
    /// PyTorch's name.
    pub fn as_str(self) -> &'static str {
        match self {
            BlockState::ActiveAllocated => "active_allocated",
            BlockState::ActivePendingFree => "active_pending_free",
            BlockState::Inactive => "inactive",
        }
    }

    /// Parses PyTorch's name.
    pub fn from_name(name: &str) -> Option<BlockState> {
        match name {
            "active_allocated" => Some(BlockState::ActiveAllocated),
            "active_pending_free" => Some(BlockState::ActivePendingFree),
            "inactive" => Some(BlockState::Inactive),
            _ => None,
        }
    }
}

/// One segment (one cudaMalloc, or one expandable segment) and its blocks.
#[derive(Debug, Clone, PartialEq)]
pub struct Segment {
    /// Device index.
    pub device: i64,
    /// Start address.
    pub address: u64,
    /// Size in bytes.
    pub total_size: u64,
    /// Bytes in `active_allocated` blocks.
    pub allocated_size: u64,
    /// Bytes in active (allocated or pending-free) blocks.
    pub active_size: u64,
    /// Bytes the program asked for in active blocks (before rounding).
    pub requested_size: u64,
    /// The stream the segment was allocated for.
    pub stream: u64,
    /// Small or large pool.
    pub segment_type: SegmentType,
    /// The memory pool id (`(0, 0)` for the default pool; CUDA graph pools otherwise).
    pub segment_pool_id: (i64, i64),
    /// Whether this is an expandable segment.
    pub is_expandable: bool,
    /// Call stack of the segment's allocation, when recorded.
    pub frames: Vec<Frame>,
    /// The blocks, in address order.
    pub blocks: Vec<Block>,
}

/// One block of a segment.
#[derive(Debug, Clone, PartialEq)]
pub struct Block {
    /// Start address.
    pub address: u64,
    /// Size in bytes (rounded).
    pub size: u64,
    /// Bytes the program asked for.
    pub requested_size: u64,
    /// Allocated, pending free, or free.
    pub state: BlockState,
    /// Call stack of the allocation, when recorded.
    pub frames: Vec<Frame>,
}

impl Snapshot {
    /// Total number of trace events over all devices.
    pub fn event_count(&self) -> usize {
        self.device_traces.iter().map(Vec::len).sum()
    }

    /// Number of trace events with `action`, over all devices.
    pub fn count(&self, action: Action) -> usize {
        self.device_traces
            .iter()
            .flatten()
            .filter(|e| e.action == action)
            .count()
    }
}
