//! The trace event model every format maps to: [`TraceEntry`], [`Action`], [`Frame`].

use std::fmt;
use std::sync::Arc;

/// What a trace event records. The names are PyTorch's (`device_traces[..]["action"]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Action {
    /// `alloc`: a block was handed to the program.
    Alloc,
    /// `free_requested`: the program freed a block (it may still be in use by streams).
    FreeRequested,
    /// `free_completed`: the block went back to the allocator's cache.
    FreeCompleted,
    /// `segment_alloc`: the allocator got a new segment from the driver (cudaMalloc).
    SegmentAlloc,
    /// `segment_free`: the allocator gave a segment back (cudaFree, e.g. `empty_cache()`).
    SegmentFree,
    /// `segment_map`: pages mapped into an expandable segment.
    SegmentMap,
    /// `segment_unmap`: pages unmapped from an expandable segment.
    SegmentUnmap,
    /// `oom`: an allocation failed; `device_free` tells how much the device had free.
    Oom,
    /// `snapshot`: a snapshot was taken at this point.
    Snapshot,
}

impl Action {
    /// Every action, in declaration order.
    pub const ALL: [Action; 9] = [
        Action::Alloc,
        Action::FreeRequested,
        Action::FreeCompleted,
        Action::SegmentAlloc,
        Action::SegmentFree,
        Action::SegmentMap,
        Action::SegmentUnmap,
        Action::Oom,
        Action::Snapshot,
    ];

    /// PyTorch's name for the action.
    pub fn as_str(self) -> &'static str {
        match self {
            Action::Alloc => "alloc",
            Action::FreeRequested => "free_requested",
            Action::FreeCompleted => "free_completed",
            Action::SegmentAlloc => "segment_alloc",
            Action::SegmentFree => "segment_free",
            Action::SegmentMap => "segment_map",
            Action::SegmentUnmap => "segment_unmap",
            Action::Oom => "oom",
            Action::Snapshot => "snapshot",
        }
    }

    /// Parses PyTorch's name for an action.
    pub fn from_name(name: &str) -> Option<Action> {
        Action::ALL.into_iter().find(|a| a.as_str() == name)
    }

    /// Whether the action gives device memory back to the driver: a segment freed, or an
    /// expandable segment's pages unmapped (`empty_cache()`, or the out-of-memory chain).
    pub fn releases_memory(self) -> bool {
        matches!(self, Action::SegmentFree | Action::SegmentUnmap)
    }

    /// Whether the action changes the device memory the allocator holds: a segment
    /// allocated or freed, pages mapped or unmapped.
    pub fn changes_segments(self) -> bool {
        matches!(
            self,
            Action::SegmentAlloc | Action::SegmentFree | Action::SegmentMap | Action::SegmentUnmap
        )
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One stack frame of the call stack that caused an event (Python or C++).
/// Strings are shared: a trace repeats the same file and function names very often.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Frame {
    /// Source file (`"??"` for C++ frames without debug info).
    pub filename: Arc<str>,
    /// Line number (0 when unknown).
    pub line: i64,
    /// Function name.
    pub name: Arc<str>,
}

impl Frame {
    /// A frame.
    pub fn new(filename: &str, line: i64, name: &str) -> Frame {
        Frame {
            filename: Arc::from(filename),
            line,
            name: Arc::from(name),
        }
    }
}

/// One event of a memory trace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceEntry {
    /// What happened.
    pub action: Action,
    /// Address of the block or segment (0 for `oom` and `snapshot`).
    pub addr: u64,
    /// Size in bytes (for `alloc`/`free_*`, PyTorch records the rounded block size).
    pub size: u64,
    /// The stream (a `cudaStream_t` as an integer; 0 is the default stream).
    pub stream: u64,
    /// Microseconds since the epoch, when the recorder had timestamps.
    pub time_us: Option<i64>,
    /// For `oom`: the bytes the device reported free.
    pub device_free: Option<u64>,
    /// The call stack, innermost first (empty when not recorded).
    pub frames: Vec<Frame>,
    /// The memory pool of the block or segment, as a segment's `segment_pool_id`: present
    /// on gpualloc's `alloc` and segment events in a private pool (the key is gpualloc's
    /// own: PyTorch's events have none, and its readers ignore it). `None`: the default
    /// pools, or not recorded.
    pub pool_id: Option<(i64, i64)>,
    /// gpualloc's `alloc` served by a block its policy passes over, because the segment
    /// could not grow then (`gpualloc_devices::TraceEntry::passed_over`): written as
    /// `gpualloc_passed_over: True`, only where set.
    pub passed_over: bool,
    /// gpualloc's `alloc` served by a loan, a free block of another stream lent to the
    /// entry's stream (`gpualloc_devices::TraceEntry::borrowed`): written as
    /// `gpualloc_borrowed: True`, only where set.
    pub borrowed: bool,
    /// gpualloc's `alloc` of a small request served by a free block of the large pool (the
    /// spill, `gpualloc_devices::TraceEntry::spilled`): written as `gpualloc_spilled: True`,
    /// only where set.
    pub spilled: bool,
    /// gpualloc's `segment_map` whose first `n` pages share physical handles and whose
    /// later pages are a handle each, or as `single_pages` says
    /// (`gpualloc_devices::TraceEntry::grouped_pages`): written as
    /// `gpualloc_grouped_pages: n`, only where set. `None`: every page grouped.
    pub grouped_pages: Option<u64>,
    /// With `grouped_pages`: the pages after the grouped ones that are a handle each, the
    /// rest sharing handles again (`gpualloc_devices::TraceEntry::single_pages`): written as
    /// `gpualloc_single_pages: n`, only where set. `None`: every later page a handle each.
    pub single_pages: Option<u64>,
}

impl TraceEntry {
    /// An event without timestamp, stack or `device_free`.
    pub fn new(action: Action, addr: u64, size: u64, stream: u64) -> TraceEntry {
        TraceEntry {
            action,
            addr,
            size,
            stream,
            time_us: None,
            device_free: None,
            frames: Vec::new(),
            pool_id: None,
            passed_over: false,
            borrowed: false,
            spilled: false,
            grouped_pages: None,
            single_pages: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn action_names_round_trip() {
        for a in Action::ALL {
            assert_eq!(Action::from_name(a.as_str()), Some(a));
        }
        assert_eq!(Action::from_name("free"), None);
        assert_eq!(Action::SegmentUnmap.to_string(), "segment_unmap");
    }
}
