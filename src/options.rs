//! Per-call options of [`Allocator::malloc_with`](crate::Allocator::malloc_with).

use std::time::Duration;

/// Options of one malloc.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MallocOptions {
    /// When the device is full even after the out-of-memory chain, wait up to this long for
    /// other buffers to be freed instead of failing at once. Waiters are served first come,
    /// first served, except that a later waiter that fits may overtake a head that does not
    /// (at most `MAX_OVERTAKES` = 8 times per head, then memory waits for the head alone:
    /// `gpualloc_actor::waiters`). A request larger than the device (or its
    /// `per_process_memory_fraction` cap) fails at once: no free can make room for it. A
    /// cancelled waiter leaves the queue cleanly; on timeout the result is the same
    /// out-of-memory error as without waiting. `None` (the default): fail at once.
    pub wait_for_memory: Option<Duration>,
}

impl MallocOptions {
    /// Wait up to `timeout` for memory.
    pub fn wait_for(timeout: Duration) -> Self {
        MallocOptions {
            wait_for_memory: Some(timeout),
        }
    }
}
