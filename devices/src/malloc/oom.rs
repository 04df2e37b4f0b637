//! Out of memory: the report a failed request gets (PyTorch's message and figures), its count
//! in the statistics and the history, and the last resort before it: a private pool marked
//! `use_on_oom`.

use gpualloc_runtime::StreamHandle;

use crate::blocks::pool::PoolOwner;
use crate::config::sizes::{is_small, round_size};
use crate::core::{AllocParams, DeviceCore};
use crate::error::{AllocError, OomReport};
use crate::ledger::books::Counted;
use crate::ledger::trace::TraceAction;
use crate::pools::pool_state::PoolState;

impl DeviceCore {
    pub(crate) fn out_of_memory(&mut self, size: u64, params: &AllocParams) -> AllocError {
        let info = self.backend.mem_info(self.device).unwrap_or_default();
        let report = OomReport {
            device: self.device,
            requested: size,
            alloc_size: params.alloc_size,
            device_total: if info.total > 0 {
                info.total
            } else {
                self.budget.device_total()
            },
            device_free: info.free,
            allowed: self.budget.allowed(),
            allocated: self.stats().allocated_bytes[0].current,
            reserved: self.stats().reserved_bytes[0].current,
            in_flight: self.budget.in_flight(),
            releasing: self.budget.releasing(),
            process_used: self.backend.process_used(self.device).ok().flatten(),
            expandable_segments: self.config.expandable_segments,
        };
        let error = AllocError::OutOfMemory(Box::new(report));
        if !params.quiet_oom {
            self.count_oom_of(&error, params.size, params.stream);
        }
        error
    }

    /// Counts `error`, an out-of-memory error of a malloc on `stream`, as PyTorch does when a
    /// malloc fails: `num_ooms`, an `oom` entry in the history (with the device's free bytes
    /// and the rounded request) and a warning; a private pool's quota error counts in
    /// `num_ooms` only. Other errors count nothing. The core does this itself for every
    /// request except those an owner marked with [`SegmentRequest::quiet_oom`](crate::SegmentRequest::quiet_oom): an owner that
    /// retries a request (waiting for memory, for misses in flight) calls this once, for the
    /// failure its user sees.
    pub fn count_oom(&mut self, error: &AllocError, stream: StreamHandle) {
        let requested = match error {
            AllocError::OutOfMemory(report) => report.requested,
            _ => 0,
        };
        let rounded = round_size(requested, &self.config).unwrap_or(requested);
        self.count_oom_of(error, rounded, stream);
    }

    /// [`DeviceCore::count_oom`], the history entry naming `size` bytes.
    pub(crate) fn count_oom_of(&mut self, error: &AllocError, size: u64, stream: StreamHandle) {
        match error {
            AllocError::OutOfMemory(report) => {
                self.count(Counted::Oom);
                self.record(TraceAction::Oom, report.device_free, size, stream.raw);
                tracing::warn!(
                    device = self.device.0,
                    requested = report.requested,
                    reserved = report.reserved,
                    "out of memory"
                );
            }
            AllocError::PoolQuota {
                quota, reserved, ..
            } => {
                self.count(Counted::Oom);
                // An out-of-memory error for its user: in the history too, with the bytes the
                // pool had left in place of the device's free bytes.
                let left = quota.saturating_sub(*reserved);
                self.record(TraceAction::Oom, left, size, stream.raw);
            }
            _ => {}
        }
    }

    pub(crate) fn use_private_pool_on_oom(&mut self, params: &mut AllocParams) -> bool {
        if matches!(self.pools[params.pool].owner, PoolOwner::Private(_)) {
            return false;
        }
        // A graph's memory is not the pool's to lend (`pools/capture.rs`).
        let candidates: Vec<usize> = self
            .private
            .values()
            .filter(|p| p.use_on_oom && !p.released && p.usage.state == PoolState::Awake)
            .map(|p| {
                if is_small(params.size) {
                    p.small
                } else {
                    p.large
                }
            })
            .filter(|&pool| !self.pool_in_graph_use(pool))
            .collect();
        let original = params.pool;
        for pool in candidates {
            params.pool = pool;
            if self.get_free_block(params) {
                return true;
            }
        }
        params.pool = original;
        false
    }
}
