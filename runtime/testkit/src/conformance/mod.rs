//! The backend conformance suite: checks written once against `Arc<dyn Backend>`, using
//! only trait methods, that every backend must pass. The sim runs them in
//! `runtime/sim/tests/conformance.rs`; the CUDA backend runs the same list in
//! `runtime/cuda/tests/conformance_cuda.rs` (on a GPU, or the emulated driver in CI).
//!
//! Delays are made with host functions that block (on a gate or a short sleep), which is
//! legal on every backend; no check calls the backend from a host function.

//! The checks live by what they test: `stream_order.rs` (memory, copies, events, host
//! functions and the order work runs in), `memory_rules.rs` (virtual memory, IPC, sizes the
//! driver refuses, host registration, release hooks); `rig.rs` holds what they share.

mod memory_rules;
mod rig;
mod stream_order;

use std::sync::Arc;

use gpualloc_runtime::types::DeviceId;
use gpualloc_runtime::Backend;

use memory_rules::*;
pub(crate) use rig::{ensure, expect_err, is_invalid, ok, TestAlloc, TestStream};
use stream_order::*;

/// One conformance check: a name and a function that returns `Err(reason)` on failure.
pub struct Check {
    /// Short name, e.g. `"memory_read_write"`.
    pub name: &'static str,
    /// Runs the check on `device` of the backend.
    pub run: fn(&Arc<dyn Backend>, DeviceId) -> Result<(), String>,
}

impl std::fmt::Debug for Check {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Check").field("name", &self.name).finish()
    }
}

/// Every check, in a stable order.
pub fn checks() -> &'static [Check] {
    CHECKS
}

/// Runs every check on `device`; returns `(name, result)` for each.
pub fn run_all(
    backend: &Arc<dyn Backend>,
    device: DeviceId,
) -> Vec<(&'static str, Result<(), String>)> {
    checks()
        .iter()
        .map(|c| (c.name, (c.run)(backend, device)))
        .collect()
}

static CHECKS: &[Check] = &[
    Check {
        name: "graph_replays_captured_work",
        run: crate::capture_checks::graph_replays_captured_work,
    },
    Check {
        name: "capture_refuses_conflicting_calls",
        run: crate::capture_checks::capture_refuses_conflicting_calls,
    },
    Check {
        name: "capture_modes_across_threads",
        run: crate::capture_checks::capture_modes_across_threads,
    },
    Check {
        name: "capture_keeps_its_boundaries",
        run: crate::capture_checks::capture_keeps_its_boundaries,
    },
    Check {
        name: "memory_read_write",
        run: memory_read_write,
    },
    Check {
        name: "memset_and_memcpy_async",
        run: memset_and_memcpy_async,
    },
    Check {
        name: "events_order_across_streams",
        run: events_order_across_streams,
    },
    Check {
        name: "host_callback_runs_after_preceding_work",
        run: host_callback_after_work,
    },
    Check {
        name: "event_query_tracks_progress",
        run: event_query_tracks_progress,
    },
    Check {
        name: "stream_wait_event_uses_record_at_call_time",
        run: wait_uses_current_record,
    },
    Check {
        name: "free_synchronizes_the_device",
        run: free_synchronizes,
    },
    Check {
        name: "vmm_map_export_import_roundtrip",
        run: vmm_roundtrip,
    },
    Check {
        name: "vmm_bad_mappings_are_rejected",
        run: vmm_bad_mappings,
    },
    Check {
        name: "oom_at_capacity",
        run: oom_at_capacity,
    },
    Check {
        name: "zero_sizes_are_invalid",
        run: zero_sizes,
    },
    Check {
        name: "overflowing_sizes_are_rejected",
        run: overflowing_sizes,
    },
    Check {
        name: "unmapping_what_is_not_mapped",
        run: unmap_not_mapped,
    },
    Check {
        name: "event_of_another_device",
        run: event_other_device,
    },
    Check {
        name: "importing_a_non_memory_fd",
        run: import_non_memory_fd,
    },
    Check {
        name: "host_register_takes_any_byte_range",
        run: host_register_byte_ranges,
    },
    Check {
        name: "free_runs_release_hooks_after_queued_work",
        run: free_runs_release_hooks_after_queued_work,
    },
];
