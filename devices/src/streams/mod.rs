//! Which streams the core still names in a backend call it may make later.
//!
//! The core keeps streams as plain handles: it never owns them. Its owner must keep every
//! stream that [`DeviceCore::streams_in_use`] returns alive (not destroyed in the backend):
//! an expandable segment synchronizes its stream before unmapping pages (on release, in the
//! out-of-memory chain, on shutdown), and a block used on other streams records an event on
//! each of them when it is freed. A stream no longer returned can be destroyed: events
//! already recorded on it stay valid in the backend (as in CUDA).

pub(crate) mod loan_table;
pub(crate) mod loans;
pub mod orphans;
pub(crate) mod retiring;

use std::collections::BTreeSet;

use gpualloc_runtime::StreamHandle;

use crate::core::DeviceCore;

impl DeviceCore {
    /// The streams of every segment (ordinary or expandable), every stream a live block was
    /// recorded on (`record_stream`), which its free will record an event on, and every
    /// retiring stream, which [`DeviceCore::orphan_retired`] queries until its work is done
    /// (its segments may be gone before that). O(segments + blocks): for the owner's slow
    /// paths, not per request.
    pub fn streams_in_use(&self) -> BTreeSet<StreamHandle> {
        let mut out: BTreeSet<StreamHandle> = self.segments.values().map(|s| s.stream).collect();
        out.extend(self.retiring.streams());
        for (_, b) in self.blocks.iter() {
            out.extend(b.stream_uses().iter().copied());
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use gpualloc_accounting::AccountingBackend;
    use gpualloc_runtime::{Backend, DeviceId};

    use crate::config::AllocatorConfig;
    use crate::core::DeviceCore;

    #[test]
    fn segments_and_recorded_uses_name_their_streams_until_released() {
        for expandable in [false, true] {
            let backend: Arc<dyn Backend> = Arc::new(AccountingBackend::new(1, 1 << 30));
            let config = AllocatorConfig {
                expandable_segments: expandable,
                ..AllocatorConfig::default()
            };
            let mut core = DeviceCore::new(backend.clone(), DeviceId(0), config).unwrap();
            let a = backend.stream_create(DeviceId(0)).unwrap();
            let b = backend.stream_create(DeviceId(0)).unwrap();
            assert!(core.streams_in_use().is_empty());
            let x = core.malloc(3 << 20, a).unwrap();
            assert_eq!(
                core.streams_in_use().into_iter().collect::<Vec<_>>(),
                vec![a]
            );
            core.record_stream(x.ptr, b).unwrap();
            assert_eq!(
                core.streams_in_use().into_iter().collect::<Vec<_>>(),
                vec![a, b],
                "expandable: {expandable}"
            );
            core.free(x.ptr).unwrap();
            core.empty_cache().unwrap();
            assert!(
                core.streams_in_use().is_empty(),
                "expandable: {expandable}: {:?}",
                core.streams_in_use()
            );
        }
    }
}
