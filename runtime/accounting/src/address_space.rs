//! One address window of the accounting backend: the ranges handed out in it, and the gaps
//! between them indexed by size class, so that finding the lowest (or highest) aligned gap of
//! a size takes a few tree lookups instead of a walk over every range. A replay of a long
//! trace holds thousands of segments; the walk was 4–8% of the replay bench.
//!
//! The answer is exactly the walk's (kept in the tests as the oracle): ranges are ordered by
//! start, only those that start inside the window count, and the gap after a range starts at
//! the highest end seen so far. The ranges never overlap when the backend makes them (every
//! address comes from a gap, or from a placement checked free); if they ever did, the index
//! is rebuilt by that same walk on every change, so the answer stays the walk's.

use std::collections::{BTreeMap, BTreeSet};

/// Size classes: class `c` holds gaps of `2^c ..= 2^(c+1) - 1` bytes.
const CLASSES: usize = 64;

/// The ranges of one window and the index of the gaps between them.
#[derive(Debug)]
pub(super) struct AddressSpace {
    lo: u64,
    hi: u64,
    /// Every range: start → length (some may start outside the window: placed addresses).
    ranges: BTreeMap<u64, u64>,
    /// Non-empty gaps between the ranges that start in the window: start → end.
    gaps: BTreeMap<u64, u64>,
    /// The starts of `gaps`, by the size class of their length.
    classes: Vec<BTreeSet<u64>>,
    /// Bit `c` set: class `c` holds a gap.
    occupied: u64,
    /// Some ranges overlap (not made by the backend): the index is rebuilt on each change.
    tangled: bool,
}

fn class(len: u64) -> usize {
    debug_assert!(len > 0);
    63 - len.leading_zeros() as usize
}

impl AddressSpace {
    /// An empty window `[lo, hi)`.
    pub(super) fn new(lo: u64, hi: u64) -> Self {
        let mut space = AddressSpace {
            lo,
            hi,
            ranges: BTreeMap::new(),
            gaps: BTreeMap::new(),
            classes: vec![BTreeSet::new(); CLASSES],
            occupied: 0,
            tangled: false,
        };
        space.add_gap(lo, hi);
        space
    }

    /// Every range, by start.
    pub(super) fn ranges(&self) -> &BTreeMap<u64, u64> {
        &self.ranges
    }

    /// Whether `[start, start + len)` overlaps no range that starts before its end.
    pub(super) fn is_free(&self, start: u64, len: u64) -> bool {
        self.ranges
            .range(..start.saturating_add(len))
            .next_back()
            .is_none_or(|(s, l)| s + l <= start)
    }

    /// Records the range `[start, start + len)`.
    pub(super) fn insert(&mut self, start: u64, len: u64) {
        if self.ranges.insert(start, len).is_some() {
            // A range replaced in place: the gaps are found again from the ranges.
            self.tangled = true;
        }
        if self.tangled || !self.in_window(start) {
            if self.tangled {
                self.rebuild();
            }
            return;
        }
        let end = start.saturating_add(len);
        match self.gaps.range(..=start).next_back().map(|(&s, &e)| (s, e)) {
            Some((gs, ge)) if end <= ge => {
                self.remove_gap(gs);
                self.add_gap(gs, start);
                self.add_gap(end, ge);
            }
            // Not inside one gap: it overlaps a range, or reaches past the window's end.
            _ => self.rebuild(),
        }
    }

    /// Forgets the range that starts at `start`; its length, if there was one.
    pub(super) fn remove(&mut self, start: u64) -> Option<u64> {
        let len = self.ranges.remove(&start)?;
        if self.tangled {
            self.rebuild();
        } else if self.in_window(start) {
            // The gap now runs from the end of the range before (or the window's start) to
            // the start of the range after (or the window's end).
            let from = self
                .ranges
                .range(self.lo..start)
                .next_back()
                .map_or(self.lo, |(s, l)| s.saturating_add(*l));
            let to = self
                .ranges
                .range(start..self.hi)
                .next()
                .map_or(self.hi, |(s, _)| *s);
            // The gaps on either side of the range, if not empty.
            self.remove_gap(from);
            self.remove_gap(start.saturating_add(len));
            self.add_gap(from, to);
        }
        Some(len)
    }

    /// The lowest `align`-aligned start of `size` free bytes in the window (the highest with
    /// `highest_first`).
    pub(super) fn find(&self, size: u64, align: u64, highest_first: bool) -> Option<u64> {
        if size == 0 || align == 0 {
            return None;
        }
        let lowest_in = |gs: u64, ge: u64| {
            gs.checked_next_multiple_of(align)
                .filter(|x| x.checked_add(size).is_some_and(|e| e <= ge))
        };
        let highest_in = |gs: u64, ge: u64| {
            ge.checked_sub(size)
                .map(|x| x / align * align)
                .filter(|x| *x >= gs)
        };
        let fits = |gs: &u64| {
            let ge = self.gaps[gs];
            if highest_first {
                highest_in(*gs, ge).is_some()
            } else {
                lowest_in(*gs, ge).is_some()
            }
        };
        // A gap of at least `size + align - 1` bytes holds an aligned start whatever its own.
        let sure = size.saturating_add(align - 1);
        let mut best: Option<u64> = None;
        let mut classes = self.occupied >> class(size) << class(size);
        while classes != 0 {
            let c = classes.trailing_zeros() as usize;
            classes &= classes - 1;
            let bucket = &self.classes[c];
            let certain = c >= 63 || (1u64 << c) >= sure;
            let found = match (highest_first, certain) {
                (false, true) => bucket.range(..best.unwrap_or(u64::MAX)).next(),
                (false, false) => bucket.range(..best.unwrap_or(u64::MAX)).find(|gs| fits(gs)),
                (true, true) => bucket.range(best.map_or(0, |b| b + 1)..).next_back(),
                (true, false) => bucket
                    .range(best.map_or(0, |b| b + 1)..)
                    .rev()
                    .find(|gs| fits(gs)),
            };
            if let Some(&gs) = found {
                best = Some(gs);
            }
        }
        let gs = best?;
        let ge = self.gaps[&gs];
        if highest_first {
            highest_in(gs, ge)
        } else {
            lowest_in(gs, ge)
        }
    }

    fn in_window(&self, start: u64) -> bool {
        (self.lo..self.hi).contains(&start)
    }

    fn add_gap(&mut self, start: u64, end: u64) {
        if end > start {
            self.gaps.insert(start, end);
            let c = class(end - start);
            self.classes[c].insert(start);
            self.occupied |= 1 << c;
        }
    }

    fn remove_gap(&mut self, start: u64) {
        if let Some(end) = self.gaps.remove(&start) {
            let c = class(end - start);
            self.classes[c].remove(&start);
            if self.classes[c].is_empty() {
                self.occupied &= !(1 << c);
            }
        }
    }

    /// The gaps again from the ranges, as the walk sees them: the gap after a range starts at
    /// the highest end so far.
    fn rebuild(&mut self) {
        self.gaps.clear();
        for c in &mut self.classes {
            c.clear();
        }
        self.occupied = 0;
        let mut cursor = self.lo;
        let mut tangled = false;
        let mut gaps = Vec::new();
        for (&s, &len) in self.ranges.range(self.lo..self.hi) {
            tangled |= s < cursor;
            gaps.push((cursor, s));
            cursor = cursor.max(s.saturating_add(len));
        }
        gaps.push((cursor, self.hi));
        for (s, e) in gaps {
            self.add_gap(s, e);
        }
        self.tangled = tangled;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The walk the index replaces: the backend's search before it, kept as the oracle.
    fn walk(
        ranges: &BTreeMap<u64, u64>,
        lo: u64,
        hi: u64,
        size: u64,
        align: u64,
        highest_first: bool,
    ) -> Option<u64> {
        if highest_first {
            let mut top = hi;
            for (&s, &len) in ranges.range(lo..hi).rev() {
                let start = top.checked_sub(size)? / align * align;
                if start >= s + len {
                    return (start >= lo).then_some(start);
                }
                top = top.min(s);
            }
            let start = top.checked_sub(size)? / align * align;
            return (start >= lo).then_some(start);
        }
        let mut cursor = lo.next_multiple_of(align);
        for (&s, &len) in ranges.range(lo..hi) {
            if s >= cursor + size {
                break;
            }
            cursor = cursor.max((s + len).next_multiple_of(align));
        }
        (cursor + size <= hi).then_some(cursor)
    }

    /// The index is tidy: each gap in the class of its length and nowhere else, the class
    /// bits set exactly for the classes that hold gaps, and no rebuild on every change unless
    /// the ranges in the window overlap.
    fn assert_tidy(space: &AddressSpace) {
        for (c, bucket) in space.classes.iter().enumerate() {
            assert_eq!(
                space.occupied >> c & 1 == 1,
                !bucket.is_empty(),
                "class {c}"
            );
            for gs in bucket {
                assert_eq!(class(space.gaps[gs] - gs), c, "gap at {gs:#x}");
            }
        }
        let indexed: usize = space.classes.iter().map(BTreeSet::len).sum();
        assert_eq!(indexed, space.gaps.len());
        let windowed: Vec<(u64, u64)> = space
            .ranges
            .range(space.lo..space.hi)
            .map(|(s, l)| (*s, *l))
            .collect();
        let overlap = windowed.windows(2).any(|w| w[0].0 + w[0].1 > w[1].0);
        assert_eq!(space.tangled, overlap);
    }

    const LO: u64 = 1 << 30;
    const HI: u64 = LO + (1 << 30);
    const UNIT: u64 = 1 << 20;

    #[derive(Debug, Clone)]
    enum Op {
        /// Take a gap found for this many units at this alignment (units), from the bottom or
        /// the top.
        Find(u64, u64, bool),
        /// Place a range at this offset (units; out of the window too) if it is free.
        Place(u64, u64),
        /// Remove the n-th range (modulo their count).
        Remove(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (1u64..64, prop::sample::select(vec![1u64, 2, 4, 8]), any::<bool>())
                .prop_map(|(n, a, h)| Op::Find(n, a, h)),
            2 => (0u64..1200, 1u64..40).prop_map(|(at, n)| Op::Place(at, n)),
            3 => any::<usize>().prop_map(Op::Remove),
        ]
    }

    proptest! {
        /// After any sequence of takes, placements (some outside the window, some not
        /// 2 MiB-aligned) and removals, the index answers every query as the walk does.
        #[test]
        fn the_index_answers_as_the_walk(ops in prop::collection::vec(op(), 1..120)) {
            let mut space = AddressSpace::new(LO, HI);
            for op in ops {
                match op {
                    Op::Find(n, a, h) => {
                        let (size, align) = (n * UNIT - 4096, a * UNIT);
                        let got = space.find(size, align, h);
                        prop_assert_eq!(got, walk(space.ranges(), LO, HI, size, align, h));
                        if let Some(at) = got {
                            space.insert(at, size);
                        }
                    }
                    Op::Place(at, n) => {
                        let (start, len) = (LO - 100 * UNIT + at * UNIT + 512, n * UNIT);
                        if space.is_free(start, len) {
                            space.insert(start, len);
                        }
                    }
                    Op::Remove(i) => {
                        let keys: Vec<u64> = space.ranges().keys().copied().collect();
                        if !keys.is_empty() {
                            prop_assert!(space.remove(keys[i % keys.len()]).is_some());
                        }
                    }
                }
                assert_tidy(&space);
                for (size, align) in [(UNIT, UNIT), (3 * UNIT + 1, 2 * UNIT), (40 * UNIT, 8 * UNIT)] {
                    for h in [false, true] {
                        prop_assert_eq!(
                            space.find(size, align, h),
                            walk(space.ranges(), LO, HI, size, align, h)
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn a_length_falls_in_the_class_of_its_highest_bit() {
        let classes: Vec<usize> = [1, 2, 3, 4, 4095, 4096, 1 << 40, u64::MAX]
            .into_iter()
            .map(class)
            .collect();
        assert_eq!(classes, [0, 1, 1, 2, 11, 12, 40, 63]);
    }

    #[test]
    fn is_free_sees_the_range_before_and_the_range_inside() {
        let mut space = AddressSpace::new(LO, HI);
        space.insert(LO + 4 * UNIT, 2 * UNIT);
        assert!(space.is_free(LO, 4 * UNIT));
        assert!(!space.is_free(LO, 4 * UNIT + 1));
        assert!(!space.is_free(LO + 5 * UNIT, UNIT));
        assert!(space.is_free(LO + 6 * UNIT, UNIT));
        assert_tidy(&space);
    }

    #[test]
    fn overlapping_ranges_answer_as_the_walk() {
        let mut space = AddressSpace::new(LO, HI);
        space.insert(LO, 10 * UNIT);
        // Overlaps the first: the gap after both starts at the higher end.
        space.insert(LO + 2 * UNIT, 20 * UNIT);
        space.insert(LO + 5 * UNIT, 2 * UNIT);
        for h in [false, true] {
            assert_eq!(
                space.find(UNIT, UNIT, h),
                walk(space.ranges(), LO, HI, UNIT, UNIT, h)
            );
        }
        assert_eq!(space.find(UNIT, UNIT, false), Some(LO + 22 * UNIT));
        assert_tidy(&space);
        space.remove(LO + 2 * UNIT);
        assert_tidy(&space);
        assert_eq!(space.find(UNIT, UNIT, false), Some(LO + 10 * UNIT));
        assert_eq!(space.find(UNIT, UNIT, true), Some(HI - UNIT));
    }

    #[test]
    fn a_range_past_the_windows_end_leaves_no_gap_after_it() {
        let mut space = AddressSpace::new(LO, HI);
        space.insert(HI - UNIT, 4 * UNIT);
        assert_eq!(space.find(2 * UNIT, UNIT, true), Some(HI - 3 * UNIT));
        assert_eq!(space.find(HI - LO - UNIT, UNIT, false), Some(LO));
        assert_eq!(space.find(HI - LO, UNIT, false), None);
        assert_eq!(space.remove(HI - UNIT), Some(4 * UNIT));
        assert_eq!(space.find(HI - LO, UNIT, false), Some(LO));
    }
}
