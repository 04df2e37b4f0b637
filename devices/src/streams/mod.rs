//! Which streams the core still names in a backend call it may make later.
//!
//! The core keeps streams as plain handles: it never owns them. Its owner must keep every
//! stream that [`DeviceCore::streams_in_use`] returns alive (not destroyed in the backend):
//! an expandable segment synchronizes its stream before unmapping pages (on release, in the
//! out-of-memory chain, on shutdown), a block used on other streams records an event on
//! each of them when it is freed, a pool's sleep records one on every stream a free of the
//! pool still waits on, and a retiring stream is queried until its work is done. A stream no
//! longer returned can be destroyed: events already recorded on it stay valid in the backend
//! (as in CUDA).

pub(crate) mod loan_table;
pub(crate) mod loans;
pub mod orphans;
pub(crate) mod retiring;

use std::collections::BTreeSet;

use gpualloc_runtime::StreamHandle;

use crate::core::DeviceCore;

impl DeviceCore {
    /// The streams of every segment (ordinary or expandable), every stream a live block was
    /// recorded on (`record_stream`), which its free will record an event on, every stream a
    /// free waits on (its uses were taken at the free; a pool's sleep records an event on
    /// them), and every retiring stream, which [`DeviceCore::orphan_retired`] queries until
    /// its work is done (its segments may be gone before that). O(segments + blocks): for the
    /// owner's slow paths, not per request.
    pub fn streams_in_use(&self) -> BTreeSet<StreamHandle> {
        let mut out: BTreeSet<StreamHandle> = self.segments.values().map(|s| s.stream).collect();
        out.extend(self.pending.streams());
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

    /// A free recorded on another stream waits on an event there, and the block's uses are
    /// taken at the free: until the event completes, that stream is named by the waiting free
    /// alone. A pool's sleep records an event on it then (`begin_sleep`), so it stays named.
    #[test]
    fn a_stream_a_pending_free_waits_on_is_named_until_the_free_completes() {
        let backend = Arc::new(AccountingBackend::manual_events(1, 1 << 30));
        let dynb: Arc<dyn Backend> = backend.clone();
        let mut core =
            DeviceCore::new(dynb.clone(), DeviceId(0), AllocatorConfig::default()).unwrap();
        let a = dynb.stream_create(DeviceId(0)).unwrap();
        let b = dynb.stream_create(DeviceId(0)).unwrap();
        let x = core.malloc(3 << 20, a).unwrap();
        core.record_stream(x.ptr, b).unwrap();
        core.free(x.ptr).unwrap();
        core.process_events().unwrap();
        assert_eq!(
            core.streams_in_use().into_iter().collect::<Vec<_>>(),
            vec![a, b],
            "the free waits on b"
        );
        backend.complete_stream(b);
        core.process_events().unwrap();
        assert_eq!(
            core.streams_in_use().into_iter().collect::<Vec<_>>(),
            vec![a],
            "the free is done"
        );
    }
}
