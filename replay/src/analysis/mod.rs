//! What a trace says by itself, before any replay: the allocations that were alive when
//! recording began, the segments PyTorch held then, and PyTorch's own peaks.
//!
//! Allocations alive at the start are (a) frees of addresses the trace never allocated, and
//! (b) blocks active in the final segments that the trace never allocated. The segments at the
//! start are the final segments walked back through the trace: undo each `segment_alloc`
//! (remove) and `segment_free` (add), last event first.

use std::collections::{BTreeMap, HashSet};

use gpualloc_runtime::addr_map::{AddrMap, AddrSet};

use gpualloc_devices::sizes::{round_size, MIN_BLOCK_SIZE, SMALL_SIZE};
use gpualloc_devices::{AllocatorConfig, RestoredBlock};
use gpualloc_trace::{Action, TraceEntry};

use crate::input::Trace;

mod reservations;

pub use reservations::{reservations, Reservation};

/// An allocation that existed before the trace begins.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LiveAtStart {
    /// Address PyTorch gave it.
    pub addr: u64,
    /// Bytes requested.
    pub requested: u64,
    /// Stream id.
    pub stream: u64,
    /// Block size, when the final snapshot shows the block.
    pub block_size: Option<u64>,
    /// Its memory pool, when the final snapshot shows the block (else the default pools).
    pub pool: PoolKey,
}

/// A memory pool as a snapshot names it (`segment_pool_id`).
pub type PoolKey = (i64, i64);

/// The `segment_pool_id` of the default pools.
pub const DEFAULT_POOL: PoolKey = (0, 0);

/// The memory pool of a trace's `alloc` or segment event: the one it names (gpualloc's
/// events in a private pool), else the default pools.
pub fn event_pool(e: &TraceEntry) -> PoolKey {
    e.pool_id.unwrap_or(DEFAULT_POOL)
}

/// A segment PyTorch held when recording began.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StartSegment {
    /// Base address.
    pub addr: u64,
    /// Bytes.
    pub size: u64,
    /// Stream id.
    pub stream: u64,
    /// Small pool.
    pub small: bool,
    /// Memory pool (`segment_pool_id`; `(0, 0)`: the default pools).
    pub pool: PoolKey,
}

/// PyTorch's own figures for the traced span.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TorchFigures {
    /// Peak reserved bytes (None when the source has no segment list).
    pub peak_reserved: Option<u64>,
    /// Peak of requested bytes in use.
    pub peak_requested: Option<u64>,
    /// Reserved bytes when recording began.
    pub start_reserved: Option<u64>,
    /// `segment_alloc` events.
    pub segment_allocs: u64,
    /// `segment_free` events.
    pub segment_frees: u64,
    /// `oom` events.
    pub ooms: u64,
}

/// Allocations alive before the first event, sorted by address; and the number of frees that
/// could not be explained (double frees of traced allocations).
pub fn live_at_start(trace: &Trace) -> (Vec<LiveAtStart>, u64) {
    let mut live = AddrSet::default();
    let mut ever_allocated = AddrSet::default();
    let mut initial: BTreeMap<u64, LiveAtStart> = BTreeMap::new();
    let mut unexplained = 0;
    for e in &trace.events {
        match e.action {
            Action::Alloc => {
                live.insert(e.addr);
                ever_allocated.insert(e.addr);
            }
            Action::FreeRequested if !live.remove(&e.addr) => {
                if ever_allocated.contains(&e.addr) || initial.contains_key(&e.addr) {
                    unexplained += 1;
                } else {
                    let l = LiveAtStart {
                        addr: e.addr,
                        requested: e.size,
                        stream: e.stream,
                        block_size: None,
                        pool: DEFAULT_POOL,
                    };
                    initial.insert(e.addr, l);
                }
            }
            _ => {}
        }
    }
    for seg in trace.final_segments.iter().flatten() {
        for b in seg.blocks.iter().filter(|b| b.active) {
            // Allocated in the trace (alive at the end, or freed with the free still pending
            // at the end, `active_pending_free`): the trace explains it.
            if ever_allocated.contains(&b.addr) {
                continue;
            }
            initial
                .entry(b.addr)
                .and_modify(|l| {
                    l.block_size = Some(b.size);
                    l.pool = seg.pool;
                })
                .or_insert(LiveAtStart {
                    addr: b.addr,
                    requested: b.requested,
                    stream: seg.stream,
                    block_size: Some(b.size),
                    pool: seg.pool,
                });
        }
    }
    (initial.into_values().collect(), unexplained)
}

/// The segments held when recording began (None without a final segment list): the final
/// segments, with the trace's segment events undone from the last to the first. An
/// expandable segment shows as one segment per mapped run (as PyTorch's snapshots have it):
/// undoing a `segment_map` takes its range out of the run holding it (which may split it or
/// remove it), undoing a `segment_unmap` puts its range back as a run of its own.
pub fn start_segments(trace: &Trace) -> Option<Vec<StartSegment>> {
    let finals = trace.final_segments.as_ref()?;
    let mut set: BTreeMap<u64, StartSegment> = finals
        .iter()
        .map(|s| {
            (
                s.addr,
                StartSegment {
                    addr: s.addr,
                    size: s.size,
                    stream: s.stream,
                    small: s.small,
                    pool: s.pool,
                },
            )
        })
        .collect();
    for e in trace.events.iter().rev() {
        match e.action {
            Action::SegmentAlloc => {
                set.remove(&e.addr);
            }
            Action::SegmentFree | Action::SegmentUnmap => {
                let next_to = neighbour(&set, e.addr, e.size);
                let small = match e.action {
                    Action::SegmentFree => e.size == gpualloc_devices::sizes::SMALL_BUFFER,
                    // A run next to it tells its pool; else a small pool maps 2 MiB pages.
                    _ => {
                        next_to.map_or(e.size == gpualloc_devices::sizes::SMALL_BUFFER, |n| n.small)
                    }
                };
                // gpualloc's events name a private pool (PyTorch's private pools do not
                // expand, and its events name none).
                let pool = event_pool(e);
                set.insert(
                    e.addr,
                    StartSegment {
                        addr: e.addr,
                        size: e.size,
                        stream: e.stream,
                        small,
                        pool,
                    },
                );
            }
            Action::SegmentMap => take_range(&mut set, e.addr, e.size),
            _ => {}
        }
    }
    Some(set.into_values().collect())
}

/// A segment that ends where `[addr, addr + size)` starts or starts where it ends.
fn neighbour(set: &BTreeMap<u64, StartSegment>, addr: u64, size: u64) -> Option<&StartSegment> {
    let before = set
        .range(..addr)
        .next_back()
        .map(|(_, s)| s)
        .filter(|s| s.addr + s.size == addr);
    before.or_else(|| set.get(&(addr + size)))
}

/// Takes `[addr, addr + size)` out of the segments it overlaps: their parts before and after
/// it stay. (One map may be undone by several unmaps, each a run of its own by then.)
fn take_range(set: &mut BTreeMap<u64, StartSegment>, addr: u64, size: u64) {
    let end = addr.saturating_add(size);
    let first = set
        .range(..=addr)
        .next_back()
        .filter(|(_, s)| s.addr + s.size > addr)
        .map(|(&a, _)| a)
        .unwrap_or(addr);
    let overlapping: Vec<u64> = set.range(first..end).map(|(&a, _)| a).collect();
    for base in overlapping {
        let seg = set.remove(&base).expect("just listed");
        let seg_end = seg.addr + seg.size;
        if seg.addr < addr {
            set.insert(
                seg.addr,
                StartSegment {
                    size: addr - seg.addr,
                    ..seg
                },
            );
        }
        if end < seg_end {
            set.insert(
                end,
                StartSegment {
                    addr: end,
                    size: seg_end - end,
                    ..seg
                },
            );
        }
    }
}

/// PyTorch's reserved bytes after event `e`, from `reserved` before it (segment and page
/// events move it).
pub fn torch_reserved_after(reserved: u64, e: &TraceEntry) -> u64 {
    match e.action {
        Action::SegmentAlloc | Action::SegmentMap => reserved + e.size,
        Action::SegmentFree | Action::SegmentUnmap => reserved.saturating_sub(e.size),
        _ => reserved,
    }
}

/// PyTorch's peaks over the trace, from the segment history and the requested sizes
/// (`initial`: the allocations alive at the start, from [`live_at_start`]).
pub fn torch_figures(trace: &Trace, initial: &[LiveAtStart]) -> TorchFigures {
    let mut f = TorchFigures {
        segment_allocs: trace.count(Action::SegmentAlloc) as u64,
        segment_frees: trace.count(Action::SegmentFree) as u64,
        ooms: trace.count(Action::Oom) as u64,
        ..TorchFigures::default()
    };
    if let Some(start) = start_segments(trace) {
        let mut reserved: u64 = start.iter().map(|s| s.size).sum();
        f.start_reserved = Some(reserved);
        let mut peak = reserved;
        for e in &trace.events {
            reserved = torch_reserved_after(reserved, e);
            peak = peak.max(reserved);
        }
        f.peak_reserved = Some(peak);
    }
    let mut in_use: u64 = initial.iter().map(|l| l.requested).sum();
    let mut peak = in_use;
    for e in &trace.events {
        match e.action {
            Action::Alloc => in_use += e.size,
            Action::FreeRequested => in_use = in_use.saturating_sub(e.size),
            _ => {}
        }
        peak = peak.max(in_use);
    }
    f.peak_requested = Some(peak);
    f
}

/// Block sizes of the allocations alive in one start segment, as PyTorch's default rules made
/// them: the rounded request, extended to the next block when the gap is too small to have
/// been split off. For an ordinary segment's large pool that is up to 1 MiB (a free
/// large-pool block is always over 1 MiB); in an expandable segment (`expandable`: a mapped
/// stretch of one) and in the small pool, under 512 bytes.
pub fn start_blocks(
    seg: &StartSegment,
    live: &[LiveAtStart],
    expandable: bool,
) -> Vec<RestoredBlock> {
    let defaults = AllocatorConfig::default();
    let inside: Vec<&LiveAtStart> = live
        .iter()
        .filter(|l| l.addr >= seg.addr && l.addr < seg.addr + seg.size)
        .collect();
    let mut out = Vec::with_capacity(inside.len());
    for (i, l) in inside.iter().enumerate() {
        let next = inside.get(i + 1).map_or(seg.addr + seg.size, |n| n.addr);
        let size = match l.block_size {
            Some(s) => s,
            None => {
                let rounded = round_size(l.requested, &defaults).unwrap_or(l.requested);
                let gap = next.saturating_sub(l.addr + rounded);
                let unsplit = if seg.small || expandable {
                    gap < MIN_BLOCK_SIZE
                } else {
                    gap <= SMALL_SIZE
                };
                if gap > 0 && unsplit {
                    next - l.addr
                } else {
                    rounded
                }
            }
        };
        out.push(RestoredBlock {
            addr: l.addr,
            size: size.min(next - l.addr),
            requested: l.requested,
        });
    }
    out
}

/// Index of each `free_requested` whose `free_completed` comes later but not at once (the
/// block waited for other streams), or, in a trace that records `free_completed`s, never:
/// the free was still pending when the snapshot was taken (a lent block whose borrower's
/// work was not done, a block used on a stream that had not reached the free). In a trace
/// with no `free_completed` at all (a format that records only one free event) every free
/// is immediate.
pub fn deferred_frees(trace: &Trace) -> HashSet<usize> {
    let mut requested: AddrMap<usize> = AddrMap::default();
    let mut deferred = HashSet::new();
    for (i, e) in trace.events.iter().enumerate() {
        match e.action {
            Action::FreeRequested => {
                requested.insert(e.addr, i);
            }
            Action::FreeCompleted => {
                if let Some(j) = requested.remove(&e.addr) {
                    if j + 1 != i {
                        deferred.insert(j);
                    }
                }
            }
            Action::Alloc => {
                requested.remove(&e.addr);
            }
            _ => {}
        }
    }
    if trace.count(Action::FreeCompleted) > 0 {
        deferred.extend(requested.into_values());
    }
    deferred
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::input::{FinalBlock, FinalSegment};

    const MIB: u64 = 1 << 20;

    fn run(addr: u64, size: u64) -> FinalSegment {
        FinalSegment {
            addr,
            size,
            stream: 7,
            small: false,
            expandable: true,
            pool: DEFAULT_POOL,
            blocks: Vec::new(),
        }
    }

    /// An expandable segment's runs at the start: its maps undone, its unmaps put back, a map
    /// undone across the runs two unmaps left.
    #[test]
    fn start_segments_undo_the_pages_an_expandable_segment_mapped() {
        let base = 0x7000_0000_0000;
        let trace = Trace {
            name: "t".into(),
            device: 0,
            events: vec![
                TraceEntry::new(Action::SegmentMap, base + 2 * MIB, 6 * MIB, 7),
                TraceEntry::new(Action::SegmentUnmap, base + 4 * MIB, 2 * MIB, 7),
                TraceEntry::new(Action::SegmentMap, base + 10 * MIB, 2 * MIB, 7),
                TraceEntry::new(Action::SegmentUnmap, base + 12 * MIB, 4 * MIB, 7),
            ],
            // [base, +4) and [base + 6, +12) mapped at the end.
            final_segments: Some(vec![run(base, 4 * MIB), run(base + 6 * MIB, 6 * MIB)]),
            recorded_config: None,
            pools: Vec::new(),
        };
        let start: Vec<(u64, u64)> = start_segments(&trace)
            .unwrap()
            .iter()
            .map(|s| (s.addr - base, s.size / MIB))
            .collect();
        // Mapped during the trace: [base + 2, +6) and [base + 10, +2). So before it:
        // [base, +2), [base + 8, +2) and the [base + 12, +4) unmapped at the end.
        assert_eq!(start, vec![(0, 2), (8 * MIB, 2), (12 * MIB, 4)]);
        let s = start_segments(&trace).unwrap();
        assert!(s.iter().all(|s| s.stream == 7 && !s.small));
    }

    /// A free that completes at once is immediate, one that completes later is deferred,
    /// and one that never completes is deferred to the end where the trace records
    /// completions (pending when the snapshot was taken), immediate where it records none.
    #[test]
    fn a_free_never_completed_is_pending_to_the_end() {
        let base = 0x7000_0000_0000;
        let e = |action, addr| TraceEntry::new(action, addr, MIB, 7);
        let events = vec![
            e(Action::Alloc, base),
            e(Action::Alloc, base + MIB),
            e(Action::Alloc, base + 2 * MIB),
            e(Action::FreeRequested, base),
            e(Action::FreeCompleted, base),
            e(Action::FreeRequested, base + MIB),
            e(Action::FreeRequested, base + 2 * MIB),
            e(Action::FreeCompleted, base + MIB),
        ];
        let mut trace = Trace {
            name: "t".into(),
            device: 0,
            events,
            final_segments: None,
            recorded_config: None,
            pools: Vec::new(),
        };
        let deferred = |t: &Trace| {
            let mut d: Vec<usize> = deferred_frees(t).into_iter().collect();
            d.sort_unstable();
            d
        };
        assert_eq!(deferred(&trace), [5, 6]);
        trace.events.retain(|e| e.action != Action::FreeCompleted);
        assert_eq!(deferred(&trace), Vec::<usize>::new());
    }

    /// A block freed in the trace whose free had not completed when the snapshot was taken
    /// (`active_pending_free` at the end, a free waiting on stream events) was not alive at
    /// the start: the trace allocated it. One alive at the start and freed the same way is.
    #[test]
    fn a_free_still_pending_at_the_end_is_not_alive_at_the_start() {
        let base = 0x7000_0000_0000;
        let block = |addr, size| FinalBlock {
            addr,
            size,
            requested: size,
            active: true,
        };
        let mut seg = run(base, 20 * MIB);
        seg.expandable = false;
        seg.blocks = vec![block(base, 2 * MIB), block(base + 2 * MIB, 4 * MIB)];
        let trace = Trace {
            name: "t".into(),
            device: 0,
            events: vec![
                TraceEntry::new(Action::Alloc, base, 2 * MIB, 7),
                TraceEntry::new(Action::FreeRequested, base, 2 * MIB, 7),
                TraceEntry::new(Action::FreeRequested, base + 2 * MIB, 4 * MIB, 7),
            ],
            final_segments: Some(vec![seg]),
            recorded_config: None,
            pools: Vec::new(),
        };
        let (live, unexplained) = live_at_start(&trace);
        let live: Vec<(u64, Option<u64>)> =
            live.iter().map(|l| (l.addr - base, l.block_size)).collect();
        assert_eq!(live, vec![(2 * MIB, Some(4 * MIB))]);
        assert_eq!(unexplained, 0);
    }

    /// A reservation the history releases (its last page unmapped) and whose addresses
    /// another stream's reservation takes later: two reservations, one after the other, each
    /// of its own stream and pool kind, the first made at its first `segment_map`, the second
    /// at its own, neither cut short by the other (they are not held at the same time).
    /// Before, one reservation per stream for the whole history: the later one's final run
    /// made the first map a small-pool page, and both started at the same base.
    #[test]
    fn a_reservation_released_and_its_addresses_taken_again_are_two_reservations() {
        let base = 0x7000_0000_0000;
        let map = |addr, size, stream| TraceEntry::new(Action::SegmentMap, addr, size, stream);
        let unmap = |addr, size, stream| TraceEntry::new(Action::SegmentUnmap, addr, size, stream);
        let alloc = |addr, size, stream| TraceEntry::new(Action::Alloc, addr, size, stream);
        let mut small_run = run(base, 2 * MIB);
        small_run.stream = 3;
        small_run.small = true;
        let trace = Trace {
            name: "t".into(),
            device: 0,
            events: vec![
                map(base, 16 * MIB, 4),
                alloc(base, 15 * MIB, 4),
                map(base + 16 * MIB, 6 * MIB, 4),
                unmap(base, 22 * MIB, 4),
                map(base, 2 * MIB, 3),
                alloc(base, 4096, 3),
            ],
            final_segments: Some(vec![small_run]),
            recorded_config: None,
            pools: Vec::new(),
        };
        let start = start_segments(&trace).unwrap();
        assert!(start.is_empty());
        let plan = reservations(&trace, &start, 100 * MIB);
        let got: Vec<_> = plan
            .iter()
            .map(|r| {
                (
                    r.stream,
                    r.small,
                    r.base,
                    r.size / MIB,
                    r.first_map,
                    r.released_at,
                )
            })
            .collect();
        assert_eq!(
            got,
            vec![
                (4, false, base, 100, Some(0), Some(3)),
                (3, true, base, 100, Some(4), None),
            ]
        );
    }

    /// A page's pool kind comes from the first block the history puts on it (another request
    /// on its stream may be served from the cache first), and a page no block lands on
    /// belongs to the reservation of its stream whose span it extends.
    #[test]
    fn a_pages_pool_kind_is_the_kind_of_the_block_put_on_it() {
        let base = 0x7000_0000_0000;
        let map = |addr, size| TraceEntry::new(Action::SegmentMap, addr, size, 4);
        let alloc = |addr, size| TraceEntry::new(Action::Alloc, addr, size, 4);
        let trace = Trace {
            name: "t".into(),
            device: 0,
            events: vec![
                map(base, 2 * MIB),
                // A large request on the same stream, served from the cache elsewhere.
                alloc(base + 500 * MIB, 8 * MIB),
                alloc(base, 4096),
                // Pages mapped ahead, next to the small run: no block lands on them.
                map(base + 2 * MIB, 2 * MIB),
            ],
            final_segments: Some(Vec::new()),
            recorded_config: None,
            pools: Vec::new(),
        };
        let plan = reservations(&trace, &[], 100 * MIB);
        let got: Vec<_> = plan
            .iter()
            .map(|r| (r.small, r.base, r.first_map))
            .collect();
        assert_eq!(got, vec![(true, base, Some(0))]);
    }
}
