//! Host-side helpers of the sim: checking and costing ranges for `host_register` against this
//! process's memory map (parsed by [`gpualloc_runtime::procmaps`]).

use gpualloc_runtime::error::{BackendError, Result};
use gpualloc_runtime::procmaps::{mappings_crossed, parse_maps};

/// Counts the mappings of this process that `[start, end)` crosses, or errors when part of
/// the range is not mapped, or not readable (and writable, when `need_write`): the device must
/// be able to access all of it, or a copy would fault.
pub(crate) fn count_own_mappings(start: u64, end: u64, need_write: bool) -> Result<u64> {
    let text = std::fs::read_to_string("/proc/self/maps")
        .map_err(|e| BackendError::os("read /proc/self/maps", e))?;
    mappings_crossed(&parse_maps(&text), &(start..end), need_write).map_err(|at| {
        BackendError::invalid(format!(
            "host range {start:#x}..{end:#x}: {at:#x} is not mapped accessible memory"
        ))
    })
}
