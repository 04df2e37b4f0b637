//! Expandable segments (`expandable_segments:True`): one large virtual address range per
//! stream and pool kind, with physical memory mapped into it page by page on demand and
//! unmapped when released, so a growing workload keeps extending one segment instead of
//! leaving holes between many (PyTorch's `ExpandableSegment`).
//!
//! - The range reserved is 9/8 of the device's memory, rounded to pages; a page is 2 MiB for
//!   the small pool, and for the large pool `large_segment_size` (20 MiB) under PyTorch's
//!   policy, 2 MiB under gpualloc's (`map_ahead.rs`). Physical memory comes in runs: one
//!   handle mapped over one or more pages (PyTorch: one page each; gpualloc: the pages
//!   wholly inside the request, up to 20 MiB, then two pages a handle each, then the pages
//!   ahead in one handle: `map_ahead.rs`), unmapped and released only whole, since CUDA can
//!   neither unmap nor release part of a handle.
//! - Unmapped ranges are blocks too (`mapped == false`), kept per pool ordered by (stream,
//!   address). An allocation looks for a run of free and unmapped blocks that together fit
//!   (`find_expandable_block`), maps what is missing and merges it into one free block.
//! - Releasing unmaps the whole runs inside free blocks after waiting for the segment's
//!   stream (unlike `cuMemFree`, `cuMemUnmap` does not synchronize); the parts of partly
//!   covered pages stay mapped as free blocks.
//! - A map that fails part way releases the pages it had created and mapped, and reports
//!   out-of-memory: the state is as before the call.
//!
//! Departure from PyTorch, on purpose: `max_split_size` does not apply to blocks of expandable
//! segments. In PyTorch a free mapped block of at least `max_split_size` is never given to a
//! smaller request, which then maps fresh pages instead, so reserved memory grows without
//! bound in alloc/free cycles (PyTorch PR #193400: 220 MiB → 14 GiB over 100 cycles with
//! allocated under 300 MiB). Here free expandable pages can always be unmapped, so there is
//! nothing for the limit to protect. `tests/expandable.rs` runs that cycle.
//!
//! Here: the segment itself (its runs of physical memory) and mapping and unmapping pages; the
//! core's side (finding a run of blocks, mapping what a request lacks, booking, releasing) is
//! in `mod.rs`.

use std::collections::BTreeMap;

use gpualloc_runtime::{Backend, BackendError, DeviceId, DevicePtr, PhysHandle, StreamHandle};

/// One reserved range and its mapped pages.
#[derive(Debug)]
pub(crate) struct ExpandableSegment {
    pub base: u64,
    pub page: u64,
    /// Pages in the reserved range.
    pub pages: usize,
    /// The runs by first page: one physical handle each, mapped over `.1` pages, unmapped and
    /// released only whole. Pages in no run are unmapped. (A map, not a slot per page: a
    /// reservation of 9/8 of the device has hundreds of thousands of 2 MiB pages.)
    pub runs: BTreeMap<usize, (PhysHandle, usize)>,
    pub stream: StreamHandle,
    /// While its pool sleeps (`sleep.rs`): the runs it had, whose handles are released; the
    /// wake maps new handles over the same pages. `runs` is empty meanwhile.
    pub slept: Option<BTreeMap<usize, (PhysHandle, usize)>>,
}

impl ExpandableSegment {
    pub fn size(&self) -> u64 {
        self.page * self.pages as u64
    }

    /// Installs `mapped` (its first page at `first`) as runs of this segment.
    pub(crate) fn install(&mut self, first: usize, mapped: &MappedPages) {
        let mut at = first;
        for &(h, n) in &mapped.pieces {
            debug_assert!(self.pages_are(self.page_addr(at), n as u64 * self.page, false));
            self.runs.insert(at, (h, n));
            at += n;
        }
    }

    /// Takes out of the segment the runs lying wholly inside pages `[first, last)` (all
    /// mapped): they are contiguous, since only the runs at the two ends can reach outside.
    /// Returns their first page and the runs, in order.
    pub(crate) fn take_runs_inside(&mut self, first: usize, last: usize) -> MappedPages {
        let inside = self.runs_inside(first, last);
        let start = inside.first().copied().unwrap_or(first);
        let pieces = inside
            .into_iter()
            .filter_map(|s| self.take_run(s))
            .collect();
        MappedPages {
            start: self.page_addr(start),
            page: self.page,
            pieces,
        }
    }

    /// First pages of the runs lying wholly inside pages `[first, last)`, in order.
    pub(crate) fn runs_inside(&self, first: usize, last: usize) -> Vec<usize> {
        self.runs
            .range(first..last)
            .filter(|(s, (_, n))| **s + *n <= last)
            .map(|(s, _)| *s)
            .collect()
    }

    /// Takes run `first` out of the segment (its pages become unmapped).
    pub(crate) fn take_run(&mut self, first: usize) -> Option<(PhysHandle, usize)> {
        self.runs.remove(&first)
    }

    pub(crate) fn page_left(&self, addr: u64) -> usize {
        ((addr - self.base) / self.page) as usize
    }

    pub(crate) fn page_right(&self, addr: u64) -> usize {
        (addr - self.base).div_ceil(self.page) as usize
    }

    /// The pages lying wholly inside `[addr, end)`, as `(first, last)` page indices with
    /// `first < last`; `None` when no whole page does.
    pub(crate) fn pages_inside(&self, addr: u64, end: u64) -> Option<(usize, usize)> {
        let (first, last) = (self.page_right(addr), self.page_left(end));
        (first < last).then_some((first, last))
    }

    pub(crate) fn page_addr(&self, i: usize) -> u64 {
        self.base + i as u64 * self.page
    }

    /// Bytes of mapped pages.
    pub fn mapped_bytes(&self) -> u64 {
        self.runs.values().map(|r| r.1 as u64).sum::<u64>() * self.page
    }

    /// [`ExpandableSegment::mapped_bytes`] up to `cap`: the smaller of the two. Counts runs
    /// only until `cap` is reached, so a large segment's growth (`map_ahead.rs`, which needs
    /// no more than whether 1/8 of it reaches `large_segment_size`) does not walk its
    /// hundreds of runs: that walk was a sixth of the replay's instructions on
    /// transformer-lm-train with expandable segments.
    pub fn mapped_bytes_capped(&self, cap: u64) -> u64 {
        let mut bytes = 0u64;
        for &(_, n) in self.runs.values() {
            bytes = bytes.saturating_add((n as u64).saturating_mul(self.page));
            if bytes >= cap {
                return cap;
            }
        }
        bytes
    }

    /// The run mapping page `i`: (its first page, its handle, its pages).
    pub(crate) fn run_at(&self, i: usize) -> Option<(usize, PhysHandle, usize)> {
        run_at(&self.runs, i)
    }

    /// Stretches of mapped pages (adjacent runs joined) as (first page, pages), in order.
    pub(crate) fn mapped_stretches(&self) -> Vec<(usize, usize)> {
        let mut out: Vec<(usize, usize)> = Vec::new();
        for (&s, &(_, n)) in &self.runs {
            match out.last_mut() {
                Some(last) if last.0 + last.1 == s => last.1 += n,
                _ => out.push((s, n)),
            }
        }
        out
    }

    /// True when `[addr, addr + len)` lies on pages that all have (`want`) or all lack
    /// (`!want`) physical memory.
    pub fn pages_are(&self, addr: u64, len: u64, want: bool) -> bool {
        self.pages_of_are(&self.runs, addr, len, want)
    }

    /// [`ExpandableSegment::pages_are`] by the runs the segment has, or, while its pool
    /// sleeps, had: what its blocks' books describe.
    pub(crate) fn booked_pages_are(&self, addr: u64, len: u64, want: bool) -> bool {
        self.pages_of_are(self.slept.as_ref().unwrap_or(&self.runs), addr, len, want)
    }

    fn pages_of_are(
        &self,
        runs: &BTreeMap<usize, (PhysHandle, usize)>,
        addr: u64,
        len: u64,
        want: bool,
    ) -> bool {
        let (first, last) = (self.page_left(addr), self.page_right(addr + len));
        if last > self.pages {
            return false;
        }
        if !want {
            // No run reaches into [first, last).
            return runs
                .range(..last)
                .next_back()
                .is_none_or(|(s, (_, n))| s + n <= first);
        }
        let mut i = first;
        while i < last {
            match run_at(runs, i) {
                Some((s, _, n)) => i = s + n,
                None => return false,
            }
        }
        true
    }
}

/// The run of `runs` mapping page `i`: (its first page, its handle, its pages).
fn run_at(
    runs: &BTreeMap<usize, (PhysHandle, usize)>,
    i: usize,
) -> Option<(usize, PhysHandle, usize)> {
    runs.range(..=i)
        .next_back()
        .filter(|(s, (_, n))| *s + n > i)
        .map(|(s, (h, n))| (*s, *h, *n))
}

/// How [`DeviceCore::book_pages`] counts pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Booking {
    Mapped,
    Released,
    Restored,
}

/// Physical memory mapped contiguously from an address, as (handle, pages) pieces in address
/// order: what a growth mapped off the core, or what a release unmaps.
#[derive(Debug)]
pub struct MappedPages {
    pub(crate) start: u64,
    pub(crate) page: u64,
    pub(crate) pieces: Vec<(PhysHandle, usize)>,
}

impl MappedPages {
    /// Bytes mapped.
    pub fn bytes(&self) -> u64 {
        self.pieces.iter().map(|p| p.1 as u64).sum::<u64>() * self.page
    }

    /// Physical handles (driver allocations) behind them.
    pub fn handles(&self) -> usize {
        self.pieces.len()
    }
}

/// How the pages of one map are grouped into physical handles: the first `grouped` pages at
/// most `per_handle` to a handle, the `singles` pages after them a handle each, and the rest
/// again at most `per_handle` to a handle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Handles {
    pub per_handle: usize,
    pub grouped: usize,
    pub singles: usize,
}

impl Handles {
    /// Every page in handles of at most `per_handle` pages.
    pub fn of(per_handle: usize) -> Handles {
        Handles {
            per_handle,
            grouped: usize::MAX,
            singles: 0,
        }
    }

    /// Pages in the handle that starts `at` pages into a map of `pages` pages.
    pub fn at(self, at: usize, pages: usize) -> usize {
        let per_handle = self.per_handle.max(1);
        let singles_end = self.grouped.saturating_add(self.singles);
        let n = if at < self.grouped {
            per_handle.min(self.grouped - at)
        } else if at < singles_end {
            1
        } else {
            per_handle
        };
        n.min(pages - at)
    }
}

/// Creates and maps `pages` pages of `page` bytes from `start` on, in physical handles as
/// `handles` groups them (one `cuMemCreate` and one `cuMemMap` each), then gives the device
/// and its `peers` access to them: the slow driver calls of growing an expandable segment,
/// with no state of the core (so an owner can run them off it). On failure every handle this
/// call created is unmapped and released again.
pub(crate) fn map_pages(
    backend: &dyn Backend,
    device: DeviceId,
    peers: &[DeviceId],
    start: u64,
    pages: usize,
    page: u64,
    handles: Handles,
) -> Result<MappedPages, BackendError> {
    let mut done = MappedPages {
        start,
        page,
        pieces: Vec::new(),
    };
    let mut failure = None;
    let mut at = 0usize;
    while at < pages {
        let n = handles.at(at, pages);
        let bytes = n as u64 * page;
        let ptr = DevicePtr(start + at as u64 * page);
        let step =
            backend
                .phys_create(device, bytes)
                .and_then(|h| match backend.map(ptr, bytes, 0, h) {
                    Ok(()) => Ok(h),
                    Err(e) => {
                        let _ = backend.phys_release(h);
                        Err(e)
                    }
                });
        match step {
            Ok(h) => done.pieces.push((h, n)),
            Err(e) => {
                failure = Some(e);
                break;
            }
        }
        at += n;
    }
    let bytes = pages as u64 * page;
    if failure.is_none() {
        for d in std::iter::once(device).chain(peers.iter().copied()) {
            if let Err(e) = backend.set_access(d, DevicePtr(start), bytes) {
                failure = Some(e);
                break;
            }
        }
    }
    if let Some(e) = failure {
        unmap_pages(backend, &done);
        tracing::warn!(device = device.0, addr = start, bytes, error = %e, "expandable map failed; rolled back");
        return Err(e);
    }
    Ok(done)
}

/// Unmaps and releases what [`map_pages`] mapped (best effort: a handle that cannot be
/// unmapped is logged, never released while mapped).
pub(crate) fn unmap_pages(backend: &dyn Backend, mapped: &MappedPages) {
    let mut at = mapped.start;
    for &(h, n) in &mapped.pieces {
        let bytes = n as u64 * mapped.page;
        match backend.unmap(DevicePtr(at), bytes) {
            Ok(()) => {
                if let Err(e) = backend.phys_release(h) {
                    tracing::warn!(addr = at, error = %e, "releasing a page failed");
                }
            }
            Err(e) => tracing::warn!(addr = at, error = %e, "unmapping a page failed"),
        }
        at += bytes;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The handles of a map, as sizes in pages: grouped pages `per_handle` at a time, then
    /// `singles` pages one each, then the rest `per_handle` at a time; never past the map's
    /// end.
    #[test]
    fn handles_group_their_first_pages_then_take_one_page_each_then_group_the_rest() {
        let sizes = |h: Handles, pages: usize| {
            let (mut at, mut out) = (0, Vec::new());
            while at < pages {
                let n = h.at(at, pages);
                out.push(n);
                at += n;
            }
            out
        };
        assert_eq!(sizes(Handles::of(10), 13), [10, 3]);
        assert_eq!(sizes(Handles::of(10), 3), [3]);
        assert_eq!(sizes(Handles::of(1), 3), [1, 1, 1]);
        let split = |grouped, singles| Handles {
            per_handle: 10,
            grouped,
            singles,
        };
        assert_eq!(sizes(split(14, usize::MAX), 17), [10, 4, 1, 1, 1]);
        assert_eq!(
            sizes(split(14, usize::MAX), 12),
            [10, 2],
            "a map shorter than its grouped pages"
        );
        assert_eq!(sizes(split(0, usize::MAX), 3), [1, 1, 1]);
        assert_eq!(sizes(split(14, 2), 24), [10, 4, 1, 1, 8]);
        assert_eq!(sizes(split(1, 2), 10), [1, 1, 1, 7]);
        assert_eq!(sizes(split(0, 2), 25), [1, 1, 10, 10, 3]);
        assert_eq!(
            sizes(split(3, 2), 4),
            [3, 1],
            "a map ending in its single pages"
        );
        assert_eq!(sizes(split(2, 0), 5), [2, 3]);
    }

    #[test]
    fn stretches_join_adjacent_runs_and_pages_are_checked_by_run() {
        let h = PhysHandle {
            device: DeviceId(0),
            raw: 1,
            size: 0,
        };
        let mut es = ExpandableSegment {
            base: 0,
            page: 1,
            pages: 10,
            runs: BTreeMap::new(),
            stream: StreamHandle {
                device: DeviceId(0),
                raw: 0,
            },
            slept: None,
        };
        assert_eq!(es.mapped_stretches(), vec![]);
        for (s, n) in [(1, 1), (2, 1), (5, 1), (7, 2), (9, 1)] {
            es.runs.insert(s, (h, n));
        }
        assert_eq!(es.mapped_stretches(), vec![(1, 2), (5, 1), (7, 3)]);
        assert_eq!(es.run_at(8).map(|r| r.0), Some(7));
        assert_eq!(es.run_at(4), None);
        assert!(es.pages_are(7, 3, true));
        assert!(es.pages_are(1, 2, true));
        assert!(!es.pages_are(1, 3, true));
        assert!(es.pages_are(3, 2, false));
        assert!(!es.pages_are(3, 3, false));
        assert!(!es.pages_are(0, 2, false));
        assert!(!es.pages_are(9, 2, true), "past the reservation");
        assert_eq!(es.mapped_bytes(), 6);
        assert_eq!(es.mapped_bytes_capped(7), 6, "under the cap: exact");
        assert_eq!(es.mapped_bytes_capped(6), 6);
        assert_eq!(es.mapped_bytes_capped(4), 4, "over the cap: the cap");
        assert_eq!(es.mapped_bytes_capped(0), 0);
        assert_eq!(es.runs_inside(6, 10), vec![7, 9]);
        assert_eq!(es.runs_inside(8, 10), vec![9]);
        // Asleep: no runs, the books follow the layout kept.
        es.slept = Some(std::mem::take(&mut es.runs));
        assert!(!es.pages_are(7, 3, true));
        assert!(es.booked_pages_are(7, 3, true));
        assert!(!es.booked_pages_are(1, 3, true));
        assert!(es.booked_pages_are(3, 2, false));
        assert!(!es.booked_pages_are(3, 3, false));
    }
}
