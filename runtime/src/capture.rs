//! Stream capture and graphs, as the [`Backend`](crate::Backend) speaks of them.
//!
//! CUDA's stream capture turns the work enqueued on a stream (and on the streams it joins
//! through events) into a graph instead of running it; an instantiated graph is then launched
//! as one unit, as often as wanted, with the device pointers it was captured with baked in.
//! These are the plain types of that protocol: the mode a capture and a thread run in, what a
//! stream's capture looks like, and the graph handles. Their rules (which calls a capture
//! refuses and which it is invalidated by) are the driver's: see `cuStreamBeginCapture` and
//! `cuThreadExchangeStreamCaptureMode`, and the sim's `capture` module, which keeps them.

use crate::types::DeviceId;

/// How strictly a capture, or a thread, guards against "potentially unsafe" driver calls
/// (allocation, freeing, mapping, synchronization) made while a capture is under way
/// (`CUstreamCaptureMode`).
///
/// A thread's mode decides what that thread may call:
/// - [`CaptureMode::Global`] (every thread's default): no unsafe call while this thread has a
///   capture of its own begun in a mode other than relaxed, or while any other thread has a
///   capture begun in global mode;
/// - [`CaptureMode::ThreadLocal`]: no unsafe call while this thread has a capture of its own
///   begun in a mode other than relaxed; other threads' captures are ignored;
/// - [`CaptureMode::Relaxed`]: unsafe calls are allowed (calls that conflict with a capture
///   by their nature, such as synchronizing a capturing stream, are still refused).
///
/// A refused call fails with [`CaptureError::Unsupported`] and invalidates the capture it
/// conflicts with: that capture's end then fails with [`CaptureError::Invalidated`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum CaptureMode {
    /// `CU_STREAM_CAPTURE_MODE_GLOBAL`, the default.
    #[default]
    Global,
    /// `CU_STREAM_CAPTURE_MODE_THREAD_LOCAL`.
    ThreadLocal,
    /// `CU_STREAM_CAPTURE_MODE_RELAXED`.
    Relaxed,
}

/// A stream's capture status (`CUstreamCaptureStatus` with the capture's id).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum CaptureStatus {
    /// The stream is not capturing: work enqueued on it runs.
    #[default]
    None,
    /// The stream is part of the capture `id` (begun on it, or joined to it through an event).
    Active {
        /// The capture sequence's id, unique in the process.
        id: u64,
    },
    /// The stream is part of capture `id`, which a refused call has invalidated: its end will
    /// fail, and work enqueued on it meanwhile is refused.
    Invalidated {
        /// The capture sequence's id.
        id: u64,
    },
}

impl CaptureStatus {
    /// True while the stream is part of a capture, valid or invalidated: its work is not run.
    pub fn is_capturing(self) -> bool {
        !matches!(self, CaptureStatus::None)
    }

    /// The capture's id, if the stream is part of one.
    pub fn id(self) -> Option<u64> {
        match self {
            CaptureStatus::None => None,
            CaptureStatus::Active { id } | CaptureStatus::Invalidated { id } => Some(id),
        }
    }
}

/// A captured graph (`CUgraph`): what a capture recorded, not yet runnable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct GraphHandle {
    /// The device whose streams were captured.
    pub device: DeviceId,
    /// Backend's raw handle.
    pub raw: u64,
}

/// An instantiated graph (`CUgraphExec`): launched on a stream as one unit of work.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct GraphExecHandle {
    /// The device it runs on.
    pub device: DeviceId,
    /// Backend's raw handle.
    pub raw: u64,
}

/// Why the driver refused a call for a stream capture's sake (`CUDA_ERROR_STREAM_CAPTURE_*`,
/// 900 to 908).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CaptureError {
    /// 900: the call is not allowed while the stream (or, for an unsafe call, a capture the
    /// calling thread's mode guards against) is capturing; the capture is invalidated.
    Unsupported,
    /// 901: the capture was invalidated by an earlier refused call.
    Invalidated,
    /// 902: the call would merge two independent captures (waiting, inside one, on an event
    /// recorded in the other).
    Merge,
    /// 903: the capture was not begun on this stream (an end on a joined stream, or on a
    /// stream that is not capturing).
    Unmatched,
    /// 904: a stream the capture forked to was not joined back to the stream it began on.
    Unjoined,
    /// 905: the call would make a dependency cross the capture's boundary (waiting, inside a
    /// capture, on an event recorded outside it or in another capture).
    Isolation,
    /// 906: the call would make the legacy default stream depend on a capturing blocking
    /// stream (the emulated driver's legacy stream).
    Implicit,
    /// 907: the operation is not allowed on an event last recorded in a capturing stream.
    CapturedEvent,
    /// 908: a capture not begun in relaxed mode was ended from another thread.
    WrongThread,
}

impl CaptureError {
    /// The driver's error code.
    pub fn code(self) -> i32 {
        match self {
            CaptureError::Unsupported => 900,
            CaptureError::Invalidated => 901,
            CaptureError::Merge => 902,
            CaptureError::Unmatched => 903,
            CaptureError::Unjoined => 904,
            CaptureError::Isolation => 905,
            CaptureError::Implicit => 906,
            CaptureError::CapturedEvent => 907,
            CaptureError::WrongThread => 908,
        }
    }

    /// The driver's name for it.
    pub fn name(self) -> &'static str {
        match self {
            CaptureError::Unsupported => "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
            CaptureError::Invalidated => "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED",
            CaptureError::Merge => "CUDA_ERROR_STREAM_CAPTURE_MERGE",
            CaptureError::Unmatched => "CUDA_ERROR_STREAM_CAPTURE_UNMATCHED",
            CaptureError::Unjoined => "CUDA_ERROR_STREAM_CAPTURE_UNJOINED",
            CaptureError::Isolation => "CUDA_ERROR_STREAM_CAPTURE_ISOLATION",
            CaptureError::Implicit => "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT",
            CaptureError::CapturedEvent => "CUDA_ERROR_CAPTURED_EVENT",
            CaptureError::WrongThread => "CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD",
        }
    }

    /// The capture error a driver code stands for (`None` for other codes).
    pub fn from_code(code: i32) -> Option<CaptureError> {
        Some(match code {
            900 => CaptureError::Unsupported,
            901 => CaptureError::Invalidated,
            902 => CaptureError::Merge,
            903 => CaptureError::Unmatched,
            904 => CaptureError::Unjoined,
            905 => CaptureError::Isolation,
            906 => CaptureError::Implicit,
            907 => CaptureError::CapturedEvent,
            908 => CaptureError::WrongThread,
            _ => return None,
        })
    }
}

impl std::fmt::Display for CaptureError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.name(), self.code())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capture_errors_round_trip_through_their_driver_codes() {
        for e in [
            CaptureError::Unsupported,
            CaptureError::Invalidated,
            CaptureError::Merge,
            CaptureError::Unmatched,
            CaptureError::Unjoined,
            CaptureError::Isolation,
            CaptureError::Implicit,
            CaptureError::CapturedEvent,
            CaptureError::WrongThread,
        ] {
            assert_eq!(CaptureError::from_code(e.code()), Some(e));
        }
        assert_eq!(CaptureError::from_code(909), None);
        assert_eq!(CaptureError::Unsupported.code(), 900);
        assert_eq!(
            CaptureError::Invalidated.to_string(),
            "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED (901)"
        );
    }

    #[test]
    fn a_status_names_its_capture() {
        assert!(!CaptureStatus::None.is_capturing());
        assert_eq!(CaptureStatus::None.id(), None);
        assert!(CaptureStatus::Active { id: 3 }.is_capturing());
        assert_eq!(CaptureStatus::Invalidated { id: 4 }.id(), Some(4));
    }
}
