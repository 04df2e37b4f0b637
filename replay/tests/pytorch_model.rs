//! An independent model of PyTorch's `CUDACachingAllocator` rules for ordinary (not
//! expandable) segments, written from PyTorch's source, not from gpualloc's core: rounding
//! (`round_size`, `roundup_power2_divisions`), pools, segment sizes, best fit by (stream,
//! size, address), `max_split_size` and `max_non_split_rounding`, splitting, merging, deferred
//! frees and `empty_cache`. It asks the same accounting backend for segment addresses (first
//! fit), so its decisions can be compared address for address.
//!
//! The check: each shared trace, cold, through the model and through the replay's core under
//! `--policy pytorch`, in the configs `default`, `max_split_size_mb:128` and
//! `roundup_power2_divisions:4`: the same sequence of segment allocations, allocations (with
//! their addresses) and segment frees, event for event.
//!
//! Not modelled here, and checked otherwise (see the README's replay section): expandable
//! segments (their rules are pinned by `devices/tests/expandable.rs` and `growth.rs`; the
//! policy test in `real_traces.rs` shows where `pytorch` and `gpualloc` part), and the OOM
//! chain with `garbage_collection_threshold` (`devices/tests/oom_chain*.rs`).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

mod common;

use common::all_traces;
use gpualloc_accounting::AccountingBackend;
use gpualloc_devices::{AllocatorConfig, Policy, TraceAction};
use gpualloc_replay::analysis::{deferred_frees, live_at_start};
use gpualloc_replay::{replay_core, ReplayOptions, Trace};
use gpualloc_runtime::{Backend, DeviceId, DevicePtr};
use gpualloc_trace::Action;

const KMIN_BLOCK: u64 = 512;
const KSMALL_SIZE: u64 = 1 << 20;
const KSMALL_BUFFER: u64 = 2 << 20;
const KLARGE_BUFFER: u64 = 20 << 20;
const KMIN_LARGE_ALLOC: u64 = 10 << 20;
const KROUND_LARGE: u64 = 2 << 20;
const INTERVALS: usize = 16;
const DEV: DeviceId = DeviceId(0);

/// The rule parameters the model reads (PyTorch's `CUDAAllocatorConfig`).
struct Rules {
    max_split_size: u64,
    max_non_split_rounding: u64,
    /// Divisions per power-of-two interval from 1 MiB up (index 0: below 2 MiB).
    divisions: [u64; INTERVALS],
}

impl Rules {
    fn from_conf(conf: &str) -> Rules {
        let mut r = Rules {
            max_split_size: u64::MAX,
            max_non_split_rounding: 20 << 20,
            divisions: [0; INTERVALS],
        };
        for entry in conf.split(',').filter(|e| !e.is_empty()) {
            let (k, v) = entry.split_once(':').unwrap();
            match k {
                "max_split_size_mb" => r.max_split_size = v.parse::<u64>().unwrap() << 20,
                "roundup_power2_divisions" => r.divisions = [v.parse().unwrap(); INTERVALS],
                other => panic!("the model does not know {other}"),
            }
        }
        r
    }

    /// `roundup_power2_divisions(size)`.
    fn divisions_for(&self, size: u64) -> u64 {
        let log_size = 63 - u64::from(size.leading_zeros());
        let start = 20; // log2(1 MiB)
        let index = log_size.saturating_sub(start);
        self.divisions[(index as usize).min(INTERVALS - 1)]
    }

    /// `round_size`.
    fn round_size(&self, size: u64) -> u64 {
        if size < KMIN_BLOCK {
            return KMIN_BLOCK;
        }
        let divisions = self.divisions_for(size);
        if divisions > 1 && size > KMIN_BLOCK * divisions {
            roundup_power2_next_division(size, divisions)
        } else {
            KMIN_BLOCK * size.div_ceil(KMIN_BLOCK)
        }
    }

    /// `get_allocation_size`.
    fn allocation_size(size: u64) -> u64 {
        if size <= KSMALL_SIZE {
            KSMALL_BUFFER
        } else if size < KMIN_LARGE_ALLOC {
            KLARGE_BUFFER
        } else {
            KROUND_LARGE * size.div_ceil(KROUND_LARGE)
        }
    }
}

/// `roundup_power2_next_division`.
fn roundup_power2_next_division(size: u64, divisions: u64) -> u64 {
    if size.is_power_of_two() {
        return size;
    }
    let floor = 1u64 << (63 - size.leading_zeros());
    let division = floor >> (63 - divisions.leading_zeros());
    if division == 0 {
        return floor << 1;
    }
    let round_floor = size & !(division - 1);
    if round_floor == size {
        size
    } else {
        round_floor + division
    }
}

#[derive(Debug, Clone, Copy)]
struct Block {
    size: u64,
    stream: u64,
    small: bool,
    allocated: bool,
    /// Freed, waiting for its stream uses to finish (`free_completed`).
    pending: bool,
    prev: Option<u64>,
    next: Option<u64>,
}

/// PyTorch's `DeviceCachingAllocator`, ordinary segments only.
struct Model {
    rules: Rules,
    backend: Arc<AccountingBackend>,
    blocks: BTreeMap<u64, Block>,
    /// Free blocks per pool, ordered as PyTorch's `BlockComparatorSize`.
    pools: [BTreeSet<(u64, u64, u64)>; 2],
    /// What happened, in PyTorch's trace vocabulary.
    log: Vec<(Action, u64, u64)>,
}

impl Model {
    fn new(conf: &str) -> Model {
        Model {
            rules: Rules::from_conf(conf),
            backend: Arc::new(AccountingBackend::new(1, 1 << 40)),
            blocks: BTreeMap::new(),
            pools: [BTreeSet::new(), BTreeSet::new()],
            log: Vec::new(),
        }
    }

    fn pool(small: bool) -> usize {
        usize::from(small)
    }

    fn insert_free(&mut self, addr: u64) {
        let b = self.blocks[&addr];
        self.pools[Self::pool(b.small)].insert((b.stream, b.size, addr));
    }

    fn remove_free(&mut self, addr: u64) {
        let b = self.blocks[&addr];
        self.pools[Self::pool(b.small)].remove(&(b.stream, b.size, addr));
    }

    /// `malloc`: the block's address.
    fn malloc(&mut self, requested: u64, stream: u64) -> u64 {
        let size = self.rules.round_size(requested);
        let small = size <= KSMALL_SIZE;
        let addr = match self.get_free_block(size, stream, small) {
            Some(addr) => addr,
            None => {
                let alloc = Rules::allocation_size(size);
                let base = self.backend.malloc(DEV, alloc).expect("1 TiB is enough").0;
                self.log.push((Action::SegmentAlloc, base, alloc));
                self.blocks.insert(
                    base,
                    Block {
                        size: alloc,
                        stream,
                        small,
                        allocated: false,
                        pending: false,
                        prev: None,
                        next: None,
                    },
                );
                base
            }
        };
        // `should_split`.
        let remaining = self.blocks[&addr].size - size;
        let split = if small {
            remaining >= KMIN_BLOCK
        } else {
            size < self.rules.max_split_size && remaining > KSMALL_SIZE
        };
        if split {
            let rest = addr + size;
            let next = self.blocks[&addr].next;
            self.blocks.insert(
                rest,
                Block {
                    size: remaining,
                    stream,
                    small,
                    allocated: false,
                    pending: false,
                    prev: Some(addr),
                    next,
                },
            );
            if let Some(n) = next {
                self.blocks.get_mut(&n).unwrap().prev = Some(rest);
            }
            let b = self.blocks.get_mut(&addr).unwrap();
            b.size = size;
            b.next = Some(rest);
            self.insert_free(rest);
        }
        self.blocks.get_mut(&addr).unwrap().allocated = true;
        self.log.push((Action::Alloc, addr, requested));
        addr
    }

    /// `get_free_block` (no garbage collection: the model has no memory cap).
    fn get_free_block(&mut self, size: u64, stream: u64, small: bool) -> Option<u64> {
        let pool = &self.pools[Self::pool(small)];
        let &(s, block_size, addr) = pool.range((stream, size, 0)..).next()?;
        if s != stream {
            return None;
        }
        let max_split = self.rules.max_split_size;
        if size < max_split && block_size >= max_split {
            return None;
        }
        if size >= max_split && block_size >= size.saturating_add(self.rules.max_non_split_rounding)
        {
            return None;
        }
        self.remove_free(addr);
        Some(addr)
    }

    /// `free`: deferred while other streams use the block.
    fn free(&mut self, addr: u64, deferred: bool) {
        let b = self.blocks.get_mut(&addr).unwrap();
        assert!(b.allocated, "free of a block that is not allocated");
        b.allocated = false;
        if deferred {
            b.pending = true;
        } else {
            self.free_block(addr);
        }
    }

    /// `free_block`: merge with free neighbours, back to the pool.
    fn free_block(&mut self, mut addr: u64) {
        self.blocks.get_mut(&addr).unwrap().pending = false;
        let is_free = |m: &Model, a: Option<u64>| {
            a.filter(|a| {
                let b = m.blocks[a];
                !b.allocated && !b.pending
            })
        };
        if let Some(prev) = is_free(self, self.blocks[&addr].prev) {
            self.remove_free(prev);
            let b = self.blocks.remove(&addr).unwrap();
            let p = self.blocks.get_mut(&prev).unwrap();
            p.size += b.size;
            p.next = b.next;
            if let Some(n) = b.next {
                self.blocks.get_mut(&n).unwrap().prev = Some(prev);
            }
            addr = prev;
        }
        if let Some(next) = is_free(self, self.blocks[&addr].next) {
            self.remove_free(next);
            let n = self.blocks.remove(&next).unwrap();
            let b = self.blocks.get_mut(&addr).unwrap();
            b.size += n.size;
            b.next = n.next;
            if let Some(nn) = n.next {
                self.blocks.get_mut(&nn).unwrap().prev = Some(addr);
            }
        }
        self.insert_free(addr);
    }

    /// `empty_cache` (`release_cached_blocks`): finish every deferred free, then release
    /// each free whole segment, the large pool's first and then the small pool's, each pool
    /// in its own order (`release_blocks` walks `pool.blocks`, sorted by
    /// `BlockComparatorSize`: stream, size, address).
    fn empty_cache(&mut self) {
        let pending: Vec<u64> = self
            .blocks
            .iter()
            .filter(|(_, b)| b.pending)
            .map(|(a, _)| *a)
            .collect();
        for a in pending {
            self.free_block(a);
        }
        let whole: Vec<u64> = [Self::pool(false), Self::pool(true)]
            .into_iter()
            .flat_map(|pool| self.pools[pool].iter().map(|&(_, _, addr)| addr))
            .filter(|a| {
                let b = self.blocks[a];
                b.prev.is_none() && b.next.is_none()
            })
            .collect();
        for a in whole {
            self.remove_free(a);
            let b = self.blocks.remove(&a).unwrap();
            self.backend.free(DEV, DevicePtr(a)).unwrap();
            self.log.push((Action::SegmentFree, a, b.size));
        }
    }
}

/// The model's log of a cold replay of `trace` (recording from the first event, as the
/// replay's own history does).
fn model_replay(trace: &Trace, conf: &str) -> Vec<(Action, u64, u64)> {
    let mut m = Model::new(conf);
    let (initial, _) = live_at_start(trace);
    let mut order: Vec<_> = initial.iter().collect();
    order.sort_by_key(|l| (std::cmp::Reverse(l.requested), l.addr));
    let mut addrs: HashMap<u64, u64> = HashMap::new();
    for l in order {
        let a = m.malloc(l.requested, l.stream);
        addrs.insert(l.addr, a);
    }
    m.log.clear();
    let deferred = deferred_frees(trace);
    let mut pending: HashMap<u64, u64> = HashMap::new();
    for (i, e) in trace.events.iter().enumerate() {
        match e.action {
            Action::Alloc => {
                if let Some(old) = addrs.remove(&e.addr) {
                    m.free(old, false);
                }
                if e.size == 0 {
                    continue;
                }
                let a = m.malloc(e.size, e.stream);
                addrs.insert(e.addr, a);
            }
            Action::FreeRequested => {
                if let Some(a) = addrs.remove(&e.addr) {
                    let later = deferred.contains(&i);
                    m.free(a, later);
                    if later {
                        pending.insert(e.addr, a);
                    }
                }
            }
            Action::FreeCompleted => {
                if let Some(a) = pending.remove(&e.addr) {
                    if m.blocks.get(&a).is_some_and(|b| b.pending) {
                        m.free_block(a);
                    }
                } else if let Some(a) = addrs.remove(&e.addr) {
                    m.free(a, false);
                }
            }
            // A run of releases (`segment_free`, or `segment_unmap` in a run recorded with
            // expandable segments) is a release of the cache, as the replay reads it.
            Action::SegmentFree | Action::SegmentUnmap
                if i == 0 || !trace.events[i - 1].action.releases_memory() =>
            {
                m.empty_cache();
                pending.clear();
            }
            _ => {}
        }
    }
    m.log
}

/// The replay's core, same trace and config, PyTorch's policy: its recorded history.
fn core_replay(trace: &Trace, conf: &str) -> Vec<(Action, u64, u64)> {
    let options = ReplayOptions {
        config: AllocatorConfig::parse(conf)
            .unwrap()
            .with_policy(Policy::Pytorch),
        record_history: true,
        ..ReplayOptions::default()
    };
    let (_, core) = replay_core(trace, &options).unwrap();
    core.snapshot()
        .trace
        .iter()
        .filter_map(|e| match e.action {
            TraceAction::SegmentAlloc => Some((Action::SegmentAlloc, e.addr, e.size)),
            TraceAction::Alloc => Some((Action::Alloc, e.addr, e.size)),
            TraceAction::SegmentFree => Some((Action::SegmentFree, e.addr, e.size)),
            _ => None,
        })
        .collect()
}

#[test]
fn the_core_under_pytorch_policy_decides_as_the_model_of_pytorchs_rules() {
    for trace in all_traces() {
        for conf in ["", "max_split_size_mb:128", "roundup_power2_divisions:4"] {
            let model = model_replay(&trace, conf);
            let core = core_replay(&trace, conf);
            let allocs = model.iter().filter(|e| e.0 == Action::Alloc).count();
            eprintln!(
                "{} [{conf}]: {} events compared ({allocs} allocations)",
                trace.name,
                model.len()
            );
            // Every allocation of the trace is compared (qwen3's device 1 has only 199).
            let traced = trace
                .events
                .iter()
                .filter(|e| e.action == Action::Alloc && e.size > 0)
                .count();
            assert_eq!(allocs, traced, "{} [{conf}]", trace.name);
            if let Some(i) = (0..model.len().min(core.len())).find(|&i| model[i] != core[i]) {
                panic!(
                    "{} [{conf}]: event {i} differs: model {:?}, core {:?}",
                    trace.name, model[i], core[i]
                );
            }
            assert_eq!(model.len(), core.len(), "{} [{conf}]", trace.name);
        }
    }
}

#[test]
fn the_model_rounds_as_pytorch_documents() {
    // PyTorch's docs: with 4 divisions, 1200 MiB rounds to 1280 MiB (between 1024 and 2048,
    // in steps of 256 MiB).
    let r = Rules::from_conf("roundup_power2_divisions:4");
    assert_eq!(r.round_size(1200 << 20), 1280 << 20);
    assert_eq!(r.round_size(1024 << 20), 1024 << 20);
    assert_eq!(r.round_size(100), 512);
    let d = Rules::from_conf("");
    assert_eq!(d.round_size(1000), 1024);
    assert_eq!(Rules::allocation_size(512), 2 << 20);
    assert_eq!(Rules::allocation_size(5 << 20), 20 << 20);
    assert_eq!(Rules::allocation_size((10 << 20) + 1), 12 << 20);
}

/// PyTorch's `release_cached_blocks` frees the large pool's whole segments before the small
/// pool's, each pool in its `BlockComparatorSize` order (stream, then size, then address), not
/// in address order: on a hand-built trace, four segments on streams 7 and 3, the model and
/// the core both release 20 MiB (stream 3), 32 MiB (stream 3), 12 MiB (stream 7), then the
/// small pool's 2 MiB (stream 7). By address the order would be 12, 32, 20, 2 MiB.
#[test]
fn empty_cache_releases_the_large_pool_first_then_by_stream_size_address() {
    use gpualloc_trace::TraceEntry;
    const MIB: u64 = 1 << 20;
    let requests = [(7, 12 * MIB), (3, 32 * MIB), (3, 20 * MIB), (7, 1000)];
    let mut events = Vec::new();
    let addr = |i: usize| 0x7f00_0000_0000 + (i as u64) * 64 * MIB;
    for (i, &(stream, size)) in requests.iter().enumerate() {
        events.push(TraceEntry::new(Action::Alloc, addr(i), size, stream));
    }
    for (i, &(stream, size)) in requests.iter().enumerate() {
        for action in [Action::FreeRequested, Action::FreeCompleted] {
            events.push(TraceEntry::new(action, addr(i), size, stream));
        }
    }
    events.push(TraceEntry::new(Action::SegmentFree, addr(0), 12 * MIB, 7));
    let trace = Trace {
        name: "four segments, two streams (hand-built)".into(),
        device: 0,
        events,
        final_segments: None,
        recorded_config: None,
        pools: Vec::new(),
    };
    let released = |log: &[(Action, u64, u64)]| -> Vec<u64> {
        log.iter()
            .filter(|e| e.0 == Action::SegmentFree)
            .map(|e| e.2 / MIB)
            .collect()
    };
    let model = model_replay(&trace, "");
    let core = core_replay(&trace, "");
    assert_eq!(released(&model), [20, 32, 12, 2]);
    assert_eq!(released(&core), [20, 32, 12, 2]);
    assert_eq!(model, core);
}
