//! `gpualloc summary FILE`: a PyTorch-style memory summary of a snapshot's final state. The
//! final segments and blocks are restored into a device core, whose statistics then give the
//! table `torch.cuda.memory_summary()` prints.

use std::sync::Arc;

use gpualloc_devices::{memory_summary, AllocatorConfig, DeviceCore, RestoredBlock};
use gpualloc_runtime::accounting::AccountingBackend;
use gpualloc_runtime::{Backend, DeviceId};

use crate::input::Trace;
use crate::run::ReplayError;

/// The summary of `trace`'s final state.
pub fn summarize(trace: &Trace) -> Result<String, ReplayError> {
    let segments = trace
        .final_segments
        .as_ref()
        .ok_or_else(|| ReplayError::NoSegments(trace.name.clone()))?;
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
        core.restore_segment(seg.addr, seg.size, stream, seg.small, &live)
            .map_err(|source| ReplayError::Alloc { index: 0, source })?;
    }
    Ok(format!(
        "{}\n{}",
        trace.name,
        memory_summary(DeviceId(trace.device as u32), core.stats())
    ))
}
