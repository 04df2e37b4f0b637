//! `gpualloc summary FILE`: a PyTorch-style memory summary (the table
//! `torch.cuda.memory_summary()` prints) of a snapshot.
//!
//! When the snapshot has a recorded history, the summary is of a warm replay of it under the
//! config and policy it records (PyTorch's rules for PyTorch's snapshots, which places every
//! allocation of the shared traces at PyTorch's address; PyTorch's defaults where it records
//! none):
//! "Cur Usage" is the state at the end, and "Peak Usage", "Tot Alloc" and "Tot Freed" cover
//! the whole recording, counting the allocations alive when it began as allocated then (what
//! happened before recording began is not in the file). Without a history it is the final
//! state alone, restored into a device core, and the header says so.

use std::sync::Arc;

use gpualloc_accounting::AccountingBackend;
use gpualloc_devices::{memory_summary, AllocatorConfig, DeviceCore, RestorePool, RestoredBlock};
use gpualloc_runtime::{Backend, DeviceId};

use crate::input::{FinalSegment, Trace};
use crate::run::{replay_core, ReplayError, ReplayOptions};

/// The summary of `trace`: of its whole history where it has one, else of its final state.
pub fn summarize(trace: &Trace) -> Result<String, ReplayError> {
    let (what, core) = summary_core(trace)?;
    Ok(format!(
        "{} ({what})\n{}",
        trace.name,
        memory_summary(DeviceId(trace.device as u32), core.stats())
    ))
}

/// The core whose statistics the summary prints, and what they cover.
pub fn summary_core(trace: &Trace) -> Result<(String, DeviceCore), ReplayError> {
    let Some(segments) = trace.final_segments.as_ref() else {
        return Err(ReplayError::Format(format!(
            "{}: a summary needs a PyTorch snapshot (its segments); this trace has none",
            trace.name
        )));
    };
    if trace.events.is_empty() {
        return Ok((
            "final state only: no recorded history".to_string(),
            final_state(segments)?,
        ));
    }
    let options = ReplayOptions {
        warm: true,
        config: trace.config_as_recorded(),
        ..ReplayOptions::default()
    };
    let (_, core) = replay_core(trace, &options)?;
    Ok((
        format!("over the recorded history of {} events", trace.events.len()),
        core,
    ))
}

/// A core holding `segments` and their live blocks.
fn final_state(segments: &[FinalSegment]) -> Result<DeviceCore, ReplayError> {
    let backend = Arc::new(AccountingBackend::new(1, 1 << 40));
    let dynb: Arc<dyn Backend> = backend.clone();
    let mut core = DeviceCore::new(dynb, DeviceId(0), AllocatorConfig::default())
        .map_err(|source| ReplayError::Alloc { index: 0, source })?;
    for seg in segments {
        let stream = backend
            .register_stream(DeviceId(0), seg.stream)
            .map_err(|e| ReplayError::Format(e.to_string()))?;
        let live: Vec<RestoredBlock> = seg
            .blocks
            .iter()
            .filter(|b| b.active)
            .map(|b| RestoredBlock {
                addr: b.addr,
                size: b.size,
                requested: b.requested,
            })
            .collect();
        backend.place_next(DeviceId(0), seg.addr);
        core.restore_segment(
            seg.addr,
            seg.size,
            stream,
            RestorePool::default_pool(seg.small),
            &live,
        )
        .map_err(|source| ReplayError::Alloc { index: 0, source })?;
    }
    Ok(core)
}
