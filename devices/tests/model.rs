//! Property test: random malloc / free / record_stream / event completion / empty_cache on
//! several streams, checked after every step against a simple reference model:
//! - no live allocation overlaps another, or a freed block whose stream events are pending;
//! - the core's structure and stats are consistent (`check_invariants`: blocks tile segments,
//!   stats equal what the pools hold);
//! - after everything is freed and `empty_cache` runs, nothing is reserved and the backend
//!   holds no memory.
//!
//! Configs name no policy except one, so they run the allocator's default, `gpualloc`, with its
//! rules on (the placement rule of expandable segments included); `expandable_pytorch_policy`
//! runs PyTorch's.

use std::collections::BTreeMap;
use std::sync::Arc;

use gpualloc_accounting::AccountingBackend;
use gpualloc_devices::{AllocatorConfig, DeviceCore};
use gpualloc_runtime::{Backend, DeviceId, DevicePtr, StreamHandle};
use proptest::prelude::*;

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;

#[derive(Debug, Clone)]
enum Op {
    Malloc { size: u64, stream: usize },
    Free { pick: usize },
    RecordStream { pick: usize, stream: usize },
    CompleteEvents,
    ProcessEvents,
    EmptyCache,
}

fn size_strategy() -> impl Strategy<Value = u64> {
    prop_oneof![
        4 => 1u64..=MIB,               // small pool
        3 => (MIB + 1)..=(10 * MIB),   // 20 MiB segments
        2 => (10 * MIB)..=(80 * MIB),  // own segments
        1 => Just(512u64),
        1 => (1u64..=8).prop_map(|k| k * 256 * KIB),
    ]
}

fn op_strategy() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (size_strategy(), 0usize..3).prop_map(|(size, stream)| Op::Malloc { size, stream }),
        5 => any::<usize>().prop_map(|pick| Op::Free { pick }),
        2 => (any::<usize>(), 0usize..3).prop_map(|(pick, stream)| Op::RecordStream { pick, stream }),
        1 => Just(Op::CompleteEvents),
        1 => Just(Op::ProcessEvents),
        1 => Just(Op::EmptyCache),
    ]
}

/// The reference: live allocations and ranges that must not be reused yet.
#[derive(Default)]
struct Model {
    live: BTreeMap<u64, (u64, usize)>,
    /// Freed with recorded uses, events not yet completed: (addr, len).
    pending: Vec<(u64, u64)>,
}

impl Model {
    fn overlaps(&self, addr: u64, len: u64) -> Option<String> {
        let end = addr + len;
        for (&a, &(l, _)) in &self.live {
            if a < end && addr < a + l {
                return Some(format!("[{addr:#x},+{len}) overlaps live [{a:#x},+{l})"));
            }
        }
        for &(a, l) in &self.pending {
            if a < end && addr < a + l {
                return Some(format!("[{addr:#x},+{len}) reuses pending [{a:#x},+{l})"));
            }
        }
        None
    }
}

fn run(config: &str, capacity: u64, ops: Vec<Op>) -> Result<(), TestCaseError> {
    let backend = Arc::new(AccountingBackend::manual_events(1, capacity));
    let dynb: Arc<dyn Backend> = backend.clone();
    let streams: Vec<StreamHandle> = (0..3)
        .map(|_| dynb.stream_create(DeviceId(0)).unwrap())
        .collect();
    let mut core =
        DeviceCore::new(dynb, DeviceId(0), AllocatorConfig::parse(config).unwrap()).unwrap();
    let mut model = Model::default();
    let mut uses: BTreeMap<u64, bool> = BTreeMap::new();
    for op in ops {
        match op {
            Op::Malloc { size, stream } => {
                let syncs = core.stats().num_sync_all_streams;
                let frees = backend.counts().frees;
                let result = core.malloc(size, streams[stream]);
                if core.stats().num_sync_all_streams != syncs || backend.counts().frees != frees {
                    // The OOM chain waited for every pending event, or released a segment
                    // (a device free synchronizes the device): reuse is legal now.
                    model.pending.clear();
                }
                match result {
                    Ok(a) => {
                        prop_assert!(a.block_size >= size);
                        if let Some(msg) = model.overlaps(a.ptr.0, a.block_size) {
                            return Err(TestCaseError::fail(msg));
                        }
                        model.live.insert(a.ptr.0, (a.block_size, stream));
                    }
                    Err(e) => prop_assert!(e.is_oom(), "unexpected error {e}"),
                }
            }
            Op::Free { pick } => {
                if model.live.is_empty() {
                    continue;
                }
                let addr = *model.live.keys().nth(pick % model.live.len()).unwrap();
                let (len, _) = model.live.remove(&addr).unwrap();
                core.free(DevicePtr(addr)).unwrap();
                if uses.remove(&addr).unwrap_or(false) {
                    model.pending.push((addr, len));
                }
            }
            Op::RecordStream { pick, stream } => {
                if model.live.is_empty() {
                    continue;
                }
                let addr = *model.live.keys().nth(pick % model.live.len()).unwrap();
                let own = model.live[&addr].1;
                core.record_stream(DevicePtr(addr), streams[stream])
                    .unwrap();
                if stream != own {
                    uses.insert(addr, true);
                }
            }
            Op::CompleteEvents => {
                backend.complete_all_events();
                model.pending.clear();
            }
            Op::ProcessEvents => {
                core.process_events().unwrap();
            }
            Op::EmptyCache => {
                core.empty_cache().unwrap();
                model.pending.clear(); // empty_cache synchronizes every pending event
                prop_assert_eq!(core.pending_frees(), 0);
            }
        }
        if let Err(msg) = core.check_invariants() {
            return Err(TestCaseError::fail(msg));
        }
    }
    // Free everything that is left; after empty_cache nothing may be held.
    for addr in std::mem::take(&mut model.live).into_keys() {
        core.free(DevicePtr(addr)).unwrap();
    }
    core.empty_cache().unwrap();
    prop_assert_eq!(core.reserved_bytes(), 0);
    prop_assert_eq!(core.stats().reserved_bytes[0].current, 0);
    prop_assert_eq!(core.stats().allocated_bytes[0].current, 0);
    prop_assert_eq!(core.stats().active_bytes[0].current, 0);
    prop_assert_eq!(backend.used(DeviceId(0)), 0);
    let c = backend.counts();
    prop_assert_eq!(c.mallocs, c.frees);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn default_config(ops in prop::collection::vec(op_strategy(), 1..300)) {
        run("", 512 * MIB, ops)?;
    }

    #[test]
    fn max_split_and_divisions(ops in prop::collection::vec(op_strategy(), 1..300)) {
        run("max_split_size_mb:40,roundup_power2_divisions:[2:4,16:2,>:8]", 384 * MIB, ops)?;
    }

    #[test]
    fn expandable_segments(ops in prop::collection::vec(op_strategy(), 1..300)) {
        run("expandable_segments:True", 512 * MIB, ops)?;
    }

    #[test]
    fn expandable_with_max_split(ops in prop::collection::vec(op_strategy(), 1..300)) {
        run("expandable_segments:True,max_split_size_mb:40,large_segment_size_mb:8", 256 * MIB, ops)?;
    }

    /// 2 MiB pages and a device that fills up: the `gpualloc` policy's placement rule
    /// (`placement.rs`) passes over blocks, grows tails and falls back when it cannot grow.
    #[test]
    fn expandable_small_pages_tight(ops in prop::collection::vec(op_strategy(), 1..300)) {
        run("expandable_segments:True,large_segment_size_mb:2", 96 * MIB, ops)?;
    }

    #[test]
    fn expandable_pytorch_policy(ops in prop::collection::vec(op_strategy(), 1..300)) {
        run("expandable_segments:True,policy:pytorch", 512 * MIB, ops)?;
    }

    #[test]
    fn tight_memory_with_gc(ops in prop::collection::vec(op_strategy(), 1..300)) {
        run("garbage_collection_threshold:0.5,per_process_memory_fraction:0.9", 200 * MIB, ops)?;
    }
}
