//! Property test of `HostCore` against a reference model: random sequences of malloc, free,
//! record_stream, event completion, event processing and empty_cache, under random configs,
//! on the accounting backend with manual events (and real mappings on the register path).
//!
//! Checked after every step: no two live blocks overlap; a block whose events are pending is
//! never handed out; the stats equal what the model holds; the backend holds exactly the
//! segments the stats report. At the end, after freeing everything, completing every event and
//! emptying the cache, only the reserve segment (if one was made) is still held.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use gpualloc_accounting::AccountingBackend;
use gpualloc_host::{HostConfig, HostCore, HostError, HostPtr, ManualClock};
use gpualloc_runtime::{Backend, DeviceId, StreamHandle};
use proptest::prelude::*;

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const SIZES: [u64; 12] = [
    1,
    100,
    KIB,
    KIB + 1,
    4 * KIB,
    5000,
    64 * KIB,
    100 * KIB,
    MIB,
    MIB + 1,
    3 * MIB / 2,
    3 * MIB,
];

#[derive(Debug, Clone)]
enum Op {
    Malloc(usize),
    Free(usize),
    RecordStream(usize, usize),
    CompleteOne(usize),
    CompleteAll,
    Process,
    EmptyCache,
    FreeUnknown(u64),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0..SIZES.len()).prop_map(Op::Malloc),
        4 => any::<usize>().prop_map(Op::Free),
        4 => (any::<usize>(), 0..2usize).prop_map(|(i, s)| Op::RecordStream(i, s)),
        2 => any::<usize>().prop_map(Op::CompleteOne),
        1 => Just(Op::CompleteAll),
        1 => Just(Op::Process),
        1 => Just(Op::EmptyCache),
        1 => any::<u64>().prop_map(Op::FreeUnknown),
    ]
}

fn config() -> impl Strategy<Value = HostConfig> {
    (
        any::<bool>(),
        prop::option::of(Just(1u64)),
        prop::option::of(0..3u64),
        0..2u64,
        any::<bool>(),
    )
        .prop_map(
            |(register, threshold, cap, reserve, background)| HostConfig {
                pinned_use_cuda_host_register: register,
                pinned_num_register_threads: 2,
                pinned_max_round_threshold_mb: threshold,
                pinned_max_cached_size_mb: cap,
                pinned_reserve_segment_size_mb: reserve,
                pinned_use_background_threads: background,
            },
        )
}

#[derive(Default)]
struct Model {
    /// addr → (size, streams recorded).
    live: BTreeMap<u64, (u64, BTreeSet<usize>)>,
    /// addr → (size, events not yet completed in the backend).
    pending: BTreeMap<u64, (u64, usize)>,
}

impl Model {
    fn overlaps(map: impl Iterator<Item = (u64, u64)>, addr: u64, size: u64) -> bool {
        map.into_iter()
            .any(|(a, s)| a < addr + size && addr < a + s)
    }

    /// The core has processed every completed event: drop pending blocks with none left.
    fn processed(&mut self) {
        self.pending.retain(|_, (_, remaining)| *remaining > 0);
    }
}

struct Harness {
    backend: Arc<AccountingBackend>,
    core: HostCore,
    streams: [StreamHandle; 2],
    model: Model,
    config: HostConfig,
}

impl Harness {
    fn new(config: HostConfig) -> Self {
        let backend =
            Arc::new(AccountingBackend::manual_events(1, 1 << 30).with_host_capacity(12 * MIB));
        let streams = [
            backend.stream_create(DeviceId(0)).unwrap(),
            backend.stream_create(DeviceId(0)).unwrap(),
        ];
        let clock = Arc::new(ManualClock::default());
        let core = HostCore::new(backend.clone(), config.clone(), clock).unwrap();
        Harness {
            backend,
            core,
            streams,
            model: Model::default(),
            config,
        }
    }

    fn nth_live(&self, i: usize) -> Option<u64> {
        let n = self.model.live.len();
        (n > 0).then(|| *self.model.live.keys().nth(i % n).unwrap())
    }

    fn step(&mut self, op: &Op) {
        match *op {
            Op::Malloc(k) => {
                let size = SIZES[k];
                match self.core.malloc(size) {
                    Ok(b) => {
                        let (addr, bsize) = (b.ptr.0, b.size);
                        assert!(bsize >= size);
                        let live = self.model.live.iter().map(|(a, (s, _))| (*a, *s));
                        assert!(!Model::overlaps(live, addr, bsize), "overlaps a live block");
                        let busy = self.model.pending.iter().filter(|(_, (_, r))| *r > 0);
                        assert!(
                            !Model::overlaps(busy.map(|(a, (s, _))| (*a, *s)), addr, bsize),
                            "handed out a block with pending events"
                        );
                        self.model.pending.remove(&addr);
                        self.model.live.insert(addr, (bsize, BTreeSet::new()));
                    }
                    Err(e) => assert!(e.is_oom(), "{e}"),
                }
                if !self.config.pinned_use_background_threads {
                    self.model.processed();
                }
            }
            Op::Free(i) => {
                if let Some(addr) = self.nth_live(i) {
                    self.core.free(HostPtr(addr)).unwrap();
                    let (size, streams) = self.model.live.remove(&addr).unwrap();
                    if !streams.is_empty() {
                        self.model.pending.insert(addr, (size, streams.len()));
                    }
                    // Cached or pending: a double free; released over the cap: unknown.
                    let again = self.core.free(HostPtr(addr));
                    assert!(
                        matches!(
                            again,
                            Err(HostError::DoubleFree(_) | HostError::UnknownPointer(_))
                        ),
                        "{again:?}"
                    );
                }
            }
            Op::RecordStream(i, s) => {
                if let Some(addr) = self.nth_live(i) {
                    self.core
                        .record_stream(HostPtr(addr), self.streams[s])
                        .unwrap();
                    self.model.live.get_mut(&addr).unwrap().1.insert(s);
                }
            }
            Op::CompleteOne(i) => {
                let list = self.core.pending_event_list();
                if !list.is_empty() {
                    let (ev, ptr) = list[i % list.len()];
                    assert!(
                        self.model.pending.contains_key(&ptr.0),
                        "event for a block not pending"
                    );
                    if !self.backend.event_query(ev).unwrap() {
                        self.backend.complete_event(ev);
                        self.model.pending.get_mut(&ptr.0).unwrap().1 -= 1;
                    }
                }
            }
            Op::CompleteAll => {
                self.backend.complete_all_events();
                self.model.pending.values_mut().for_each(|(_, r)| *r = 0);
            }
            Op::Process => {
                self.core.process_events().unwrap();
                self.model.processed();
                let remaining: usize = self.model.pending.values().map(|(_, r)| r).sum();
                assert_eq!(self.core.pending_events(), remaining);
            }
            Op::EmptyCache => {
                self.core.empty_cache().unwrap();
                self.model.processed();
            }
            Op::FreeUnknown(a) => {
                let a = a | 1; // never a block start: blocks are at least 2-aligned... or 1 byte
                if !self.model.live.contains_key(&a) {
                    assert!(self.core.free(HostPtr(a)).is_err());
                }
            }
        }
        self.check();
    }

    fn check(&self) {
        let s = self.core.stats();
        assert_eq!(
            s.reserved_bytes.current,
            s.allocated_bytes.current + s.cached_bytes + s.reserve_unused_bytes
        );
        let live_bytes: u64 = self.model.live.values().map(|(s, _)| s).sum();
        let busy = self.model.pending.values().filter(|(_, r)| *r > 0);
        let busy_bytes: u64 = busy.clone().map(|(s, _)| s).sum();
        let all_pending_bytes: u64 = self.model.pending.values().map(|(s, _)| s).sum();
        let lo = self.model.live.len() + busy.count();
        let hi = self.model.live.len() + self.model.pending.len();
        assert!(
            (lo..=hi).contains(&(s.allocation.current as usize)),
            "{s:?}"
        );
        assert!(s.allocated_bytes.current >= live_bytes + busy_bytes);
        assert!(s.allocated_bytes.current <= live_bytes + all_pending_bytes);
        assert_eq!(self.core.live_blocks(), self.model.live.len());
        let n = self.backend.counts();
        assert_eq!(
            s.segment.current,
            n.host_allocs + n.host_registers - n.host_frees - n.host_unregisters
        );
        assert_eq!(s.num_host_alloc, n.host_allocs + n.host_registers);
        if let (Some(cap), 0) = (
            self.config.pinned_max_cached_size_mb,
            self.config.pinned_reserve_segment_size_mb,
        ) {
            assert!(s.cached_bytes <= cap * MIB);
        }
    }

    fn finish(mut self) {
        for addr in self.model.live.keys().copied().collect::<Vec<_>>() {
            self.core.free(HostPtr(addr)).unwrap();
        }
        self.backend.complete_all_events();
        self.core.empty_cache().unwrap();
        assert_eq!(self.core.pending_events(), 0);
        assert_eq!(self.backend.pending_events(), 0);
        let s = self.core.stats();
        let reserve = s.reserve_unused_bytes;
        assert!(reserve == 0 || reserve == MIB);
        assert_eq!(s.segment.current, u64::from(reserve > 0));
        assert_eq!(
            (
                s.allocation.current,
                s.allocated_bytes.current,
                s.cached_bytes
            ),
            (0, 0, 0)
        );
        assert_eq!(s.reserved_bytes.current, reserve);
        assert_eq!(self.backend.host_used(), reserve);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn core_matches_the_reference_model(config in config(), ops in prop::collection::vec(op(), 1..80)) {
        let mut h = Harness::new(config);
        for op in &ops {
            h.step(op);
        }
        h.finish();
    }
}
