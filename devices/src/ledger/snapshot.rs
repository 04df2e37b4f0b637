//! A point-in-time picture of the allocator: segments and their blocks, in the shape of
//! PyTorch's `torch.cuda.memory._snapshot()` `segments` list.

use crate::ledger::trace::TraceEntry;
use crate::pools::pool_records::PoolOptions;

/// State of one block, with PyTorch's names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockStateName {
    /// `"active_allocated"`: handed to a user.
    ActiveAllocated,
    /// `"active_pending_free"`: freed, waiting on stream events.
    ActivePendingFree,
    /// `"inactive"`: cached, free.
    Inactive,
}

impl BlockStateName {
    /// PyTorch's string for the state.
    pub fn as_str(self) -> &'static str {
        match self {
            BlockStateName::ActiveAllocated => "active_allocated",
            BlockStateName::ActivePendingFree => "active_pending_free",
            BlockStateName::Inactive => "inactive",
        }
    }
}

/// One block of a segment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockInfo {
    /// Start address.
    pub address: u64,
    /// Bytes.
    pub size: u64,
    /// Bytes the user asked for (0 when inactive).
    pub requested_size: u64,
    /// State.
    pub state: BlockStateName,
    /// False for unmapped parts of an expandable segment.
    pub mapped: bool,
    /// Where it was allocated, for a live block whose frames were attached
    /// (`DeviceCore::attach_frames`).
    pub frames: Option<crate::ledger::trace::Frames>,
}

/// One segment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentInfo {
    /// Device ordinal.
    pub device: u32,
    /// Start address.
    pub address: u64,
    /// Bytes (mapped bytes for an expandable segment's reservation).
    pub total_size: u64,
    /// Bytes of allocated blocks.
    pub allocated_size: u64,
    /// Bytes of allocated and pending-free blocks.
    pub active_size: u64,
    /// Bytes requested by users in active blocks.
    pub requested_size: u64,
    /// Raw handle of the segment's stream.
    pub stream: u64,
    /// True for small-pool segments (`"small"`), else `"large"`.
    pub is_small: bool,
    /// Private pool id, `(0, 0)` for the default pools (PyTorch's `segment_pool_id`).
    pub pool_id: (u64, u64),
    /// True for an expandable segment.
    pub is_expandable: bool,
    /// Blocks in address order.
    pub blocks: Vec<BlockInfo>,
}

/// Segments of one device and its trace history.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeviceSnapshot {
    /// Segments sorted by address.
    pub segments: Vec<SegmentInfo>,
    /// The trace ring's entries, oldest first (empty unless history is recorded).
    pub trace: Vec<TraceEntry>,
    /// The device's private pools not yet released, by id: what a replay needs to make them
    /// again (their segments and entries name them by id).
    pub pools: Vec<PoolInfo>,
}

/// A private pool of a [`DeviceSnapshot`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolInfo {
    /// Its id (`MemPoolId`; `(0, id)` as a segment's `pool_id`).
    pub id: u64,
    /// Its name.
    pub name: String,
    /// Made by `create_named_pool` (else PyTorch's unnamed `create_pool`, whose pools take
    /// whole segments even under `expandable_segments`).
    pub named: bool,
    /// Its quota, `use_on_oom` and the granularity of its unsplit blocks (where the device
    /// has one).
    pub options: PoolOptions,
}
