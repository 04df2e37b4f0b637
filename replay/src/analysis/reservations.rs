//! Where a warm replay makes the expandable segments' reservations: planned from the history
//! alone ([`reservations`]), as the allocator keeps them.

use std::collections::BTreeMap;

use gpualloc_devices::sizes::SMALL_SIZE;
use gpualloc_trace::{Action, TraceEntry};

use super::{event_pool, PoolKey, StartSegment};
use crate::input::Trace;

/// An expandable segment's reservation as a warm replay makes it (see [`reservations`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reservation {
    /// Stream id.
    pub stream: u64,
    /// Small pool.
    pub small: bool,
    /// Memory pool (`(0, 0)`: the default pools).
    pub pool: PoolKey,
    /// Base address.
    pub base: u64,
    /// Bytes.
    pub size: u64,
    /// The event that maps its first page; `None` when it was held when recording began.
    pub first_map: Option<usize>,
    /// The event that unmaps its last page (the allocator releases it then); `None` when it
    /// is held to the end.
    pub released_at: Option<usize>,
}

impl Reservation {
    /// True when `addr` of `stream` lies in this reservation (of either pool kind).
    pub fn contains(&self, stream: u64, addr: u64) -> bool {
        stream == self.stream && addr >= self.base && addr - self.base < self.size
    }

    /// True when start segment `s` (a mapped run) lies in this reservation, held when
    /// recording began.
    pub fn holds(&self, s: &StartSegment) -> bool {
        self.first_map.is_none()
            && s.small == self.small
            && s.pool == self.pool
            && self.contains(s.stream, s.addr)
    }

    /// The events it is held over: from its first map (or the start) to its release (or the
    /// end).
    fn held(&self) -> (usize, usize) {
        (
            self.first_map.unwrap_or(0),
            self.released_at.unwrap_or(usize::MAX),
        )
    }
}

/// The reservations of an expandable history, as the allocator keeps them: one per memory
/// pool, stream and pool kind at a time, held from its first page mapped (or from the start)
/// until its last page is unmapped (the allocator releases a reservation with nothing mapped;
/// a later page of the same kind is a new reservation, which may be made where another one
/// was). Each spans from the lowest page it mapped, `full` bytes (the reservation a device of
/// the replay's capacity gets), less where a reservation held at the same time starts sooner,
/// but never short of its highest page. The recording does not show where a reservation
/// began; its lowest page is the nearest guess that holds everything the history did in it.
/// Sorted by base, then first map.
pub fn reservations(trace: &Trace, start: &[StartSegment], full: u64) -> Vec<Reservation> {
    let finals = trace.final_segments.as_deref().unwrap_or_default();
    let mut plan = Planner {
        out: Vec::new(),
        open: BTreeMap::new(),
        full,
    };
    for seg in start {
        plan.widen((seg.pool, seg.stream, seg.small), None, seg.addr, seg.size);
    }
    for (i, e) in trace.events.iter().enumerate() {
        match e.action {
            Action::SegmentMap => {
                // The pool kind: a reservation of the stream held now whose span holds the
                // page; else the first block the history puts on the page (a block of at most
                // 1 MiB is a small-pool block); else the nearest reservation of the stream
                // held now that the page fits in with (pages mapped ahead, which no block
                // lands on); else a run of the stream's at the start, or a segment at the end
                // (which may be a later reservation at the same addresses), holding it.
                let (spanning, nearest) = plan.held_kind(e);
                let small = spanning
                    .or_else(|| first_block_on(&trace.events[i + 1..], e))
                    .or(nearest)
                    .or_else(|| {
                        kind_holding(
                            start
                                .iter()
                                .map(|s| (s.addr, s.size, s.small, s.stream, s.pool)),
                            e,
                        )
                    })
                    .or_else(|| {
                        kind_holding(
                            finals
                                .iter()
                                .map(|f| (f.addr, f.size, f.small, f.stream, f.pool)),
                            e,
                        )
                    })
                    .unwrap_or(false);
                plan.widen((event_pool(e), e.stream, small), Some(i), e.addr, e.size);
            }
            Action::SegmentUnmap => plan.unmap(e, i),
            _ => {}
        }
    }
    plan.sized()
}

/// A reservation's key: memory pool, stream, small pool.
type ReservationKey = (PoolKey, u64, bool);

/// [`reservations`] as the history goes.
struct Planner {
    out: Vec<Reservation>,
    /// The reservation (index in `out`) held now per key, with its mapped bytes.
    open: BTreeMap<ReservationKey, (usize, u64)>,
    /// A whole reservation's bytes.
    full: u64,
}

impl Planner {
    /// Maps `[addr, addr + size)` in the reservation of `key` held now, or a new one.
    fn widen(&mut self, key: ReservationKey, first_map: Option<usize>, addr: u64, size: u64) {
        let out = &mut self.out;
        let (at, mapped) = self.open.entry(key).or_insert_with(|| {
            let (pool, stream, small) = key;
            out.push(Reservation {
                stream,
                small,
                pool,
                base: addr,
                size,
                first_map,
                released_at: None,
            });
            (out.len() - 1, 0)
        });
        let r = &mut out[*at];
        let end = (r.base + r.size).max(addr + size);
        r.base = r.base.min(addr);
        r.size = end - r.base;
        *mapped += size;
    }

    /// Unmaps the pages of event `e` (the `i`-th) from the reservation of its stream held now
    /// that spans them; with nothing mapped left, that reservation is released there.
    fn unmap(&mut self, e: &TraceEntry, i: usize) {
        let pool = event_pool(e);
        let key = self
            .open
            .iter()
            .find(|((p, s, _), (at, _))| {
                *p == pool && *s == e.stream && self.out[*at].contains(e.stream, e.addr)
            })
            .map(|(k, _)| *k);
        let Some(key) = key else {
            return;
        };
        let (at, mapped) = self.open.get_mut(&key).expect("just found");
        *mapped = mapped.saturating_sub(e.size);
        if *mapped == 0 {
            self.out[*at].released_at = Some(i);
            self.open.remove(&key);
        }
    }

    /// The kind of the reservation of `e`'s pool and stream held now whose span holds the
    /// page, and of the nearest one the page fits in with (their span and the page within
    /// one reservation's bytes).
    fn held_kind(&self, e: &TraceEntry) -> (Option<bool>, Option<bool>) {
        let pool = event_pool(e);
        // (distance, outside the span, kind), nearest first.
        let nearest = self
            .open
            .iter()
            .filter(|((p, st, _), _)| *p == pool && *st == e.stream)
            .filter_map(|((_, _, small), (at, _))| {
                let r = &self.out[*at];
                let (end, page_end) = (r.base + r.size, e.addr + e.size);
                let fits = end.max(page_end) - r.base.min(e.addr) <= self.full;
                let inside = e.addr >= r.base && e.addr < end;
                let distance = if page_end <= r.base {
                    r.base - page_end
                } else {
                    e.addr.saturating_sub(end)
                };
                fits.then_some((distance, !inside, *small))
            })
            .min();
        let spanning = nearest.filter(|&(_, outside, _)| !outside);
        (
            spanning.map(|(_, _, small)| small),
            nearest.map(|(_, _, small)| small),
        )
    }

    /// The reservations, sorted by base then first map, each `full` bytes less where one
    /// held at the same time starts sooner, never short of its own span.
    fn sized(self) -> Vec<Reservation> {
        let mut out = self.out;
        out.sort_by_key(|r| (r.base, r.first_map));
        let held: Vec<(u64, (usize, usize))> = out.iter().map(|r| (r.base, r.held())).collect();
        for r in &mut out {
            let (from, until) = r.held();
            let room = held
                .iter()
                .filter(|&&(base, (qf, qu))| base > r.base && qf <= until && from <= qu)
                .map(|&(base, _)| base - r.base)
                .min()
                .unwrap_or(self.full);
            r.size = r.size.max(self.full.min(room));
        }
        out
    }
}

/// The pool kind (small) of the first block allocated on the pages `map` mapped, among
/// `after` (the events after it), before they are unmapped: a block of at most 1 MiB is a
/// small-pool block. (Not the next alloc on its stream: another request on the stream may be
/// served from the cache before the one the pages were mapped for.)
fn first_block_on(after: &[TraceEntry], map: &TraceEntry) -> Option<bool> {
    let overlaps = |n: &TraceEntry| n.addr < map.addr + map.size && n.addr + n.size > map.addr;
    after
        .iter()
        .take_while(|n| !(n.action == Action::SegmentUnmap && overlaps(n)))
        .find(|n| n.action == Action::Alloc && overlaps(n))
        .map(|n| n.size <= SMALL_SIZE)
}

/// The pool kind (small) of the segment of `e`'s stream and pool holding `e.addr`, among
/// `segments` as (address, size, small, stream, pool).
fn kind_holding(
    mut segments: impl Iterator<Item = (u64, u64, bool, u64, PoolKey)>,
    e: &TraceEntry,
) -> Option<bool> {
    segments
        .find(|&(addr, size, _, stream, pool)| {
            stream == e.stream && pool == event_pool(e) && e.addr >= addr && e.addr < addr + size
        })
        .map(|h| h.2)
}
