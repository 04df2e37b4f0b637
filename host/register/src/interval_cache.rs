//! [`IntervalCache`]: the user-space interval cache of host registrations (seed §3.1).
//!
//! Pure data structure, no backend and no I/O: it decides which backend calls a registration
//! or a release needs, and its owner ([`super::HostRegistry`] or [`super::AsyncRegistry`])
//! makes them and reports back ([`IntervalCache::range_done`], [`IntervalCache::range_failed`]).
//!
//! Two maps, both `BTreeMap`s:
//! - *backend ranges*: the disjoint, page-aligned ranges registered (or being registered) at
//!   the backend, keyed by start, each with the set of registrations using it;
//! - *registrations*: what each user asked for (`user_range`), its page-aligned extent, its
//!   flags, and the backend ranges it holds.
//!
//! Rules (seed §3.1):
//! - a registration already covered by backend ranges makes no backend call: it only joins
//!   their user sets (reference counting per backend range);
//! - an overlapping or adjacent registration asks the backend only for the missing parts
//!   (the gaps between existing backend ranges);
//! - backend ranges are never merged or split: a registration holds the whole of every backend
//!   range it touches, so releasing any registration never needs to split one;
//! - a backend range is unregistered when its last user releases it.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::ops::Range;

use gpualloc_runtime::HostRegisterFlags;

use super::error::{RegisterError, RegisterResult};

/// Handle of one registration, as [`super::HostRegistry::register`] returns it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RegistrationId(pub u64);

impl fmt::Display for RegistrationId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "registration #{}", self.0)
    }
}

/// What the cache knows about one registration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegistrationInfo {
    /// The handle.
    pub id: RegistrationId,
    /// Exactly what the user asked for: `ptr..ptr + len`.
    pub user_range: Range<u64>,
    /// `user_range` rounded out to page boundaries.
    pub page_range: Range<u64>,
    /// The span of the backend registrations this registration holds. It contains
    /// `page_range` and may be larger: a backend range registered earlier by another
    /// registration is shared whole, never split.
    pub backend_range: Range<u64>,
    /// The flags the user asked for.
    pub flags: HostRegisterFlags,
    /// True once every backend range it holds is registered (always true for the sync
    /// [`super::HostRegistry`]).
    pub ready: bool,
}

/// One backend registration, as the cache sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackendRange {
    /// Page-aligned range registered at the backend.
    pub range: Range<u64>,
    /// The flags it was registered with.
    pub flags: HostRegisterFlags,
    /// Registrations holding it (its reference count is `users.len()`).
    pub users: BTreeSet<RegistrationId>,
    /// False while the backend call that registers it is in flight.
    pub ready: bool,
}

#[derive(Debug, Clone)]
struct Entry {
    end: u64,
    flags: HostRegisterFlags,
    users: BTreeSet<RegistrationId>,
    ready: bool,
}

#[derive(Debug, Clone)]
struct Registration {
    user: Range<u64>,
    pages: Range<u64>,
    flags: HostRegisterFlags,
    /// Starts of the backend ranges it holds, ascending.
    ranges: Vec<u64>,
}

/// What a registration needs, as [`IntervalCache::plan_register`] recorded it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// The new registration's handle (already recorded).
    pub id: RegistrationId,
    /// Backend ranges to register now (the missing parts), recorded as not ready yet.
    pub new_ranges: Vec<Range<u64>>,
    /// Starts of existing backend ranges it shares whose registration is still in flight.
    pub wait_on: Vec<u64>,
}

/// What a finished backend registration means, from [`IntervalCache::range_done`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RangeDone {
    /// The range is registered and in use.
    Live,
    /// Every user released it while the call was in flight: it was removed from the cache
    /// and the caller must unregister it at the backend.
    Unused(Range<u64>),
    /// The cache does not know the range (it was reset after a fork).
    Unknown,
}

/// What a failed backend registration dropped, from [`IntervalCache::range_failed`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RangeFailed {
    /// Registrations that held the failed range; they are gone from the cache.
    pub dropped: Vec<RegistrationId>,
    /// Registered ranges that lost their last user: the caller unregisters them.
    pub unregister: Vec<Range<u64>>,
}

/// Does a backend range registered with `have` give what `want` asks for?
pub fn flags_satisfy(have: HostRegisterFlags, want: HostRegisterFlags) -> bool {
    (!want.portable || have.portable)
        && (!want.device_map || have.device_map)
        && (want.read_only || !have.read_only)
}

/// Checks `ptr..ptr + len` and rounds it out to pages: `(user_range, page_range)`.
pub fn normalize(ptr: u64, len: u64, page: u64) -> RegisterResult<(Range<u64>, Range<u64>)> {
    if ptr == 0 {
        return Err(RegisterError::NullPointer);
    }
    if len == 0 {
        return Err(RegisterError::ZeroLength { ptr });
    }
    let page = page.max(1);
    let end = ptr
        .checked_add(len)
        .ok_or(RegisterError::Wraps { ptr, len })?;
    let page_end = end
        .checked_next_multiple_of(page)
        .ok_or(RegisterError::Wraps { ptr, len })?;
    Ok((ptr..end, ptr - ptr % page..page_end))
}

/// The interval cache. See the module docs.
#[derive(Debug, Clone)]
pub struct IntervalCache {
    page: u64,
    ranges: BTreeMap<u64, Entry>,
    regs: BTreeMap<RegistrationId, Registration>,
    next_id: u64,
}

impl IntervalCache {
    /// An empty cache for pages of `page` bytes.
    pub fn new(page: u64) -> Self {
        IntervalCache {
            page: page.max(1),
            ranges: BTreeMap::new(),
            regs: BTreeMap::new(),
            next_id: 1,
        }
    }

    /// The page size ranges are rounded to.
    pub fn page_size(&self) -> u64 {
        self.page
    }

    /// Live registrations.
    pub fn len(&self) -> usize {
        self.regs.len()
    }

    /// True when no registration is live.
    pub fn is_empty(&self) -> bool {
        self.regs.is_empty()
    }

    /// Backend ranges the cache holds (registered or in flight), ascending.
    pub fn backend_ranges(&self) -> Vec<BackendRange> {
        self.ranges
            .iter()
            .map(|(start, e)| BackendRange {
                range: *start..e.end,
                flags: e.flags,
                users: e.users.clone(),
                ready: e.ready,
            })
            .collect()
    }

    /// Starts of the backend ranges overlapping `r`, ascending.
    fn overlapping(&self, r: &Range<u64>) -> Vec<u64> {
        let mut out = Vec::new();
        if let Some((s, e)) = self.ranges.range(..r.start).next_back() {
            if e.end > r.start {
                out.push(*s);
            }
        }
        out.extend(self.ranges.range(r.start..r.end).map(|(s, _)| *s));
        out
    }

    /// Records a registration of `ptr..ptr + len` and returns what the backend must do.
    /// Errors (bad input, a flag conflict) leave the cache unchanged.
    pub fn plan_register(
        &mut self,
        ptr: u64,
        len: u64,
        flags: HostRegisterFlags,
    ) -> RegisterResult<Plan> {
        let (user, pages) = normalize(ptr, len, self.page)?;
        let shared = self.overlapping(&pages);
        let mut gaps = Vec::new();
        let mut cur = pages.start;
        for s in &shared {
            let Some(e) = self.ranges.get(s) else {
                continue;
            };
            if !flags_satisfy(e.flags, flags) {
                return Err(RegisterError::FlagConflict {
                    range: *s..e.end,
                    existing: e.flags,
                    requested: flags,
                });
            }
            if *s > cur {
                gaps.push(cur..*s);
            }
            cur = cur.max(e.end);
        }
        if cur < pages.end {
            gaps.push(cur..pages.end);
        }
        let id = RegistrationId(self.next_id);
        self.next_id += 1;
        let mut wait_on = Vec::new();
        for s in &shared {
            if let Some(e) = self.ranges.get_mut(s) {
                e.users.insert(id);
                if !e.ready {
                    wait_on.push(*s);
                }
            }
        }
        for g in &gaps {
            self.ranges.insert(
                g.start,
                Entry {
                    end: g.end,
                    flags,
                    users: BTreeSet::from([id]),
                    ready: false,
                },
            );
        }
        let mut ranges: Vec<u64> = shared
            .into_iter()
            .chain(gaps.iter().map(|g| g.start))
            .collect();
        ranges.sort_unstable();
        self.regs.insert(
            id,
            Registration {
                user,
                pages,
                flags,
                ranges,
            },
        );
        Ok(Plan {
            id,
            new_ranges: gaps,
            wait_on,
        })
    }

    /// The backend registered the range starting at `start`.
    pub fn range_done(&mut self, start: u64) -> RangeDone {
        let Some(e) = self.ranges.get_mut(&start) else {
            return RangeDone::Unknown;
        };
        e.ready = true;
        if e.users.is_empty() {
            let end = e.end;
            self.ranges.remove(&start);
            return RangeDone::Unused(start..end);
        }
        RangeDone::Live
    }

    /// The backend refused the range starting at `start` (or its call was abandoned): the
    /// range and every registration holding it are dropped, so the cache again says only
    /// what the backend holds.
    pub fn range_failed(&mut self, start: u64) -> RangeFailed {
        let mut out = RangeFailed::default();
        let Some(e) = self.ranges.remove(&start) else {
            return out;
        };
        for id in e.users {
            out.unregister.extend(self.drop_registration(id));
            out.dropped.push(id);
        }
        out
    }

    /// Removes registration `id` and its references; returns the registered ranges that
    /// lost their last user (removed from the cache). In-flight ranges that lose their last
    /// user stay until their call finishes ([`RangeDone::Unused`]).
    fn drop_registration(&mut self, id: RegistrationId) -> Vec<Range<u64>> {
        let mut unregister = Vec::new();
        let Some(reg) = self.regs.remove(&id) else {
            return unregister;
        };
        for s in reg.ranges {
            let Some(e) = self.ranges.get_mut(&s) else {
                continue;
            };
            e.users.remove(&id);
            if e.users.is_empty() && e.ready {
                unregister.push(s..e.end);
                self.ranges.remove(&s);
            }
        }
        unregister
    }

    /// Releases registration `id`; returns the backend ranges to unregister now (they are
    /// already gone from the cache). Releasing twice is [`RegisterError::UnknownRegistration`].
    pub fn release(&mut self, id: RegistrationId) -> RegisterResult<Vec<Range<u64>>> {
        if !self.regs.contains_key(&id) {
            return Err(RegisterError::UnknownRegistration(id));
        }
        Ok(self.drop_registration(id))
    }

    /// What the cache knows about registration `id`.
    pub fn info(&self, id: RegistrationId) -> Option<RegistrationInfo> {
        let reg = self.regs.get(&id)?;
        let mut span: Option<Range<u64>> = None;
        let mut ready = true;
        for s in &reg.ranges {
            if let Some(e) = self.ranges.get(s) {
                ready &= e.ready;
                span = Some(match span {
                    None => *s..e.end,
                    Some(r) => r.start.min(*s)..r.end.max(e.end),
                });
            }
        }
        Some(RegistrationInfo {
            id,
            user_range: reg.user.clone(),
            page_range: reg.pages.clone(),
            backend_range: span.unwrap_or_else(|| reg.pages.clone()),
            flags: reg.flags,
            ready,
        })
    }

    /// Is `ptr` registered? Answers from the cache alone: the registration whose pages
    /// contain `ptr` (the oldest when several do), or, when the backend range containing
    /// `ptr` is only held by registrations around it, the oldest of those.
    pub fn query(&self, ptr: u64) -> Option<RegistrationInfo> {
        let (_, e) = self
            .ranges
            .range(..=ptr)
            .next_back()
            .filter(|(_, e)| e.end > ptr)?;
        let covering = e.users.iter().find(|id| {
            self.regs
                .get(id)
                .is_some_and(|r| r.pages.start <= ptr && ptr < r.pages.end)
        });
        let id = covering.or_else(|| e.users.iter().next())?;
        self.info(*id)
    }

    /// Forgets everything (after a fork: the child's backend holds none of it); returns what
    /// was forgotten.
    pub fn clear(&mut self) -> Vec<RegistrationInfo> {
        let infos = self.regs.keys().filter_map(|id| self.info(*id)).collect();
        self.ranges.clear();
        self.regs.clear();
        infos
    }

    /// Removes every registration; returns the registered backend ranges (for a final
    /// unregister at shutdown). In-flight ranges are dropped from the cache too.
    pub fn drain(&mut self) -> Vec<Range<u64>> {
        self.regs.clear();
        let out = self
            .ranges
            .iter()
            .filter(|(_, e)| e.ready)
            .map(|(s, e)| *s..e.end)
            .collect();
        self.ranges.clear();
        out
    }

    /// Checks the cache's invariants; returns the first violation found.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut prev_end = 0u64;
        for (s, e) in &self.ranges {
            if *s < prev_end || e.end <= *s {
                return Err(format!("range {s:#x}..{:#x} overlaps or is empty", e.end));
            }
            if s % self.page != 0 || e.end % self.page != 0 {
                return Err(format!("range {s:#x}..{:#x} not page aligned", e.end));
            }
            if e.ready && e.users.is_empty() {
                return Err(format!("registered range {s:#x} has no user"));
            }
            for id in &e.users {
                match self.regs.get(id) {
                    Some(r) if r.ranges.contains(s) => {}
                    _ => return Err(format!("range {s:#x} lists {id}, which does not hold it")),
                }
            }
            prev_end = e.end;
        }
        for (id, r) in &self.regs {
            let mut cur = r.pages.start;
            for s in &r.ranges {
                let e = self
                    .ranges
                    .get(s)
                    .ok_or_else(|| format!("{id} holds missing range {s:#x}"))?;
                if !e.users.contains(id) {
                    return Err(format!("{id} holds {s:#x}, which does not list it"));
                }
                if *s > cur {
                    return Err(format!("{id} has a hole at {cur:#x}"));
                }
                cur = cur.max(e.end);
            }
            if cur < r.pages.end {
                return Err(format!("{id} not covered from {cur:#x}"));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: u64 = 4096;
    const RW: HostRegisterFlags = HostRegisterFlags {
        portable: false,
        device_map: false,
        read_only: false,
    };

    fn ranges(c: &IntervalCache) -> Vec<(u64, u64, usize)> {
        c.backend_ranges()
            .into_iter()
            .map(|b| (b.range.start / P, b.range.end / P, b.users.len()))
            .collect()
    }

    fn done_all(c: &mut IntervalCache, plan: &Plan) {
        for r in &plan.new_ranges {
            assert_eq!(c.range_done(r.start), RangeDone::Live);
        }
    }

    #[test]
    fn normalizes_to_pages_and_keeps_the_user_range() {
        assert_eq!(
            normalize(P + 10, 100, P).unwrap(),
            (P + 10..P + 110, P..2 * P)
        );
        assert_eq!(normalize(0, 1, P), Err(RegisterError::NullPointer));
        assert_eq!(
            normalize(P, 0, P),
            Err(RegisterError::ZeroLength { ptr: P })
        );
        assert!(matches!(
            normalize(u64::MAX - 10, 11, P),
            Err(RegisterError::Wraps { .. })
        ));
        assert!(matches!(
            normalize(u64::MAX - 10, 5, P),
            Err(RegisterError::Wraps { .. })
        ));
    }

    #[test]
    fn covered_overlapping_and_adjacent() {
        let mut c = IntervalCache::new(P);
        let a = c.plan_register(10 * P, 4 * P, RW).unwrap();
        assert_eq!(a.new_ranges, vec![10 * P..14 * P]);
        done_all(&mut c, &a);
        // covered: no backend call
        let b = c.plan_register(11 * P + 7, 100, RW).unwrap();
        assert!(b.new_ranges.is_empty() && b.wait_on.is_empty());
        // overlapping: only the missing part
        let o = c.plan_register(12 * P, 6 * P, RW).unwrap();
        assert_eq!(o.new_ranges, vec![14 * P..18 * P]);
        done_all(&mut c, &o);
        // adjacent: its own range, not merged
        let d = c.plan_register(18 * P, 2 * P, RW).unwrap();
        assert_eq!(d.new_ranges, vec![18 * P..20 * P]);
        done_all(&mut c, &d);
        // spanning a gap between two ranges and beyond
        let g = c.plan_register(8 * P, 14 * P, RW).unwrap();
        assert_eq!(g.new_ranges, vec![8 * P..10 * P, 20 * P..22 * P]);
        done_all(&mut c, &g);
        assert_eq!(
            ranges(&c),
            vec![
                (8, 10, 1),
                (10, 14, 4),
                (14, 18, 2),
                (18, 20, 2),
                (20, 22, 1)
            ]
        );
        c.check_invariants().unwrap();
        let info = c.info(o.id).unwrap();
        assert_eq!(info.user_range, 12 * P..18 * P);
        assert_eq!(info.backend_range, 10 * P..18 * P);
        assert_eq!(c.query(11 * P).unwrap().id, a.id);
        assert_eq!(c.query(15 * P).unwrap().id, o.id);
        assert!(c.query(22 * P).is_none());
        // releasing never splits: a's range stays for b, o, g
        assert_eq!(c.release(a.id).unwrap(), vec![]);
        assert_eq!(
            c.release(g.id).unwrap(),
            vec![8 * P..10 * P, 20 * P..22 * P]
        );
        assert_eq!(c.release(b.id).unwrap(), vec![]);
        assert_eq!(
            c.release(o.id).unwrap(),
            vec![10 * P..14 * P, 14 * P..18 * P]
        );
        assert_eq!(
            c.release(o.id),
            Err(RegisterError::UnknownRegistration(o.id))
        );
        assert_eq!(c.release(d.id).unwrap(), vec![18 * P..20 * P]);
        assert!(c.backend_ranges().is_empty());
        c.check_invariants().unwrap();
    }

    #[test]
    fn flag_conflicts_leave_the_cache_unchanged() {
        let mut c = IntervalCache::new(P);
        let ro = HostRegisterFlags {
            read_only: true,
            ..RW
        };
        let a = c.plan_register(P, 2 * P, ro).unwrap();
        done_all(&mut c, &a);
        let before = ranges(&c);
        assert!(matches!(
            c.plan_register(P, P, RW),
            Err(RegisterError::FlagConflict { .. })
        ));
        assert_eq!(ranges(&c), before);
        // a read-only request is satisfied by a writable range and the reverse is not
        assert!(flags_satisfy(RW, ro));
        assert!(!flags_satisfy(ro, RW));
        assert!(c.plan_register(P, P, ro).unwrap().new_ranges.is_empty());
    }

    #[test]
    fn failure_drops_every_holder_and_returns_ranges_to_undo() {
        let mut c = IntervalCache::new(P);
        let a = c.plan_register(P, 2 * P, RW).unwrap();
        done_all(&mut c, &a);
        let b = c.plan_register(0x100 * P, 6 * P, RW).unwrap();
        // b shares nothing; a second registration joins b's in-flight range
        let b2 = c.plan_register(0x101 * P, P, RW).unwrap();
        assert_eq!(b2.wait_on, vec![0x100 * P]);
        assert_eq!(c.info(b2.id).map(|i| i.ready), Some(false));
        let failed = c.range_failed(0x100 * P);
        assert_eq!(failed.dropped, vec![b.id, b2.id]);
        assert!(failed.unregister.is_empty());
        assert_eq!(
            c.release(b.id),
            Err(RegisterError::UnknownRegistration(b.id))
        );
        assert_eq!(ranges(&c), vec![(1, 3, 1)]);
        c.check_invariants().unwrap();
    }

    #[test]
    fn release_while_in_flight_unregisters_on_completion() {
        let mut c = IntervalCache::new(P);
        let a = c.plan_register(P, P, RW).unwrap();
        assert_eq!(c.release(a.id).unwrap(), vec![]);
        assert_eq!(c.range_done(P), RangeDone::Unused(P..2 * P));
        assert!(c.backend_ranges().is_empty());
        assert_eq!(c.range_done(P), RangeDone::Unknown);
    }
}
