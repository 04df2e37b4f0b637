//! The registry against a naive reference model, on the sim with real memory: 10,000 random
//! overlapping, adjacent and nested registrations and releases (seeded, reproducible).
//!
//! After every step the cache's backend ranges (bounds and users) equal the model's, and the
//! sim's call counters equal the calls the model predicts; every 250 steps the sim's own
//! region table is probed page by page (a 1-byte device read succeeds only on registered
//! memory, a 2-byte read across a page boundary only inside one registration), and must
//! equal the model too. At the end, after releasing everything, the sim holds nothing.
//! A second run injects random `host_register` failures: a failed registration must leave
//! the cache exactly as before, and the backend must still match.

use std::collections::{BTreeMap, BTreeSet};
use std::ops::Range;
use std::sync::Arc;

use gpualloc_host::mapping::{page_size, PageMapping};
use gpualloc_host_register::{HostRegistry, RegistrationId};
use gpualloc_runtime::{Backend, BackendError, DeviceId, DevicePtr, HostRegisterFlags, Stream};
use gpualloc_sim::{Fault, Op, SimBackend, SimConfig};

const PAGES: u64 = 256;
const FLAGS: HostRegisterFlags = HostRegisterFlags {
    portable: false,
    device_map: false,
    read_only: false,
};

/// splitmix64.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// The reference: backend ranges in page units, found by scanning page by page.
#[derive(Default)]
struct Model {
    /// start page -> (end page, users)
    ranges: BTreeMap<u64, (u64, BTreeSet<u64>)>,
    /// id -> (pages, range starts held)
    regs: BTreeMap<u64, (Range<u64>, Vec<u64>)>,
    registers: u64,
    unregisters: u64,
}

impl Model {
    fn containing(&self, page: u64) -> Option<u64> {
        self.ranges
            .iter()
            .find(|(s, (e, _))| **s <= page && page < *e)
            .map(|(s, _)| *s)
    }

    fn register(&mut self, id: u64, pages: Range<u64>) {
        let mut held = BTreeSet::new();
        let mut gaps: Vec<Range<u64>> = Vec::new();
        for page in pages.clone() {
            match self.containing(page) {
                Some(s) => {
                    held.insert(s);
                }
                None => match gaps.last_mut() {
                    Some(g) if g.end == page => g.end += 1,
                    _ => gaps.push(page..page + 1),
                },
            }
        }
        for g in gaps {
            self.registers += 1;
            self.ranges.insert(g.start, (g.end, BTreeSet::new()));
            held.insert(g.start);
        }
        for s in &held {
            if let Some((_, users)) = self.ranges.get_mut(s) {
                users.insert(id);
            }
        }
        self.regs.insert(id, (pages, held.into_iter().collect()));
    }

    fn release(&mut self, id: u64) {
        let (_, held) = self.regs.remove(&id).unwrap();
        for s in held {
            let (_, users) = self.ranges.get_mut(&s).unwrap();
            users.remove(&id);
            if users.is_empty() {
                self.ranges.remove(&s);
                self.unregisters += 1;
            }
        }
    }

    fn query(&self, page: u64) -> Option<u64> {
        let (_, users) = self.ranges.get(&self.containing(page)?)?;
        users
            .iter()
            .find(|id| self.regs[id].0.contains(&page))
            .or_else(|| users.iter().next())
            .copied()
    }

    fn bounds(&self) -> Vec<(u64, u64)> {
        self.ranges.iter().map(|(s, (e, _))| (*s, *e)).collect()
    }
}

struct Harness {
    sim: Arc<SimBackend>,
    stream: Stream,
    mem: PageMapping,
    p: u64,
    reg: HostRegistry,
    model: Model,
    live: Vec<RegistrationId>,
}

impl Harness {
    fn new() -> Self {
        let sim = SimBackend::new(SimConfig::fast(1)).unwrap();
        let backend: Arc<dyn Backend> = sim.clone();
        let stream = Stream::new(&backend, DeviceId(0)).unwrap();
        let p = page_size() as u64;
        Harness {
            sim,
            stream,
            mem: PageMapping::new((PAGES * p) as usize).unwrap(),
            p,
            reg: HostRegistry::new(backend),
            model: Model::default(),
            live: Vec::new(),
        }
    }

    fn page_of(&self, addr: u64) -> u64 {
        (addr - self.mem.addr()) / self.p
    }

    /// The cache's ranges, in page units with their users.
    fn cache_view(&self) -> Vec<(u64, u64, BTreeSet<u64>)> {
        self.reg
            .backend_ranges()
            .into_iter()
            .map(|r| {
                (
                    self.page_of(r.range.start),
                    self.page_of(r.range.end),
                    r.users.iter().map(|u| u.0).collect(),
                )
            })
            .collect()
    }

    fn model_view(&self) -> Vec<(u64, u64, BTreeSet<u64>)> {
        self.model
            .ranges
            .iter()
            .map(|(s, (e, u))| (*s, *e, u.clone()))
            .collect()
    }

    /// What the sim itself holds, probed with device reads.
    fn sim_view(&self) -> Vec<(u64, u64)> {
        let backend = self.stream.backend();
        let readable = |addr: u64, len: usize| {
            let mut buf = vec![0u8; len];
            backend
                .copy_from_device(self.stream.handle(), &mut buf, DevicePtr(addr))
                .is_ok()
        };
        let base = self.mem.addr();
        let mut out: Vec<(u64, u64)> = Vec::new();
        for page in 0..PAGES {
            if !readable(base + page * self.p, 1) {
                continue;
            }
            let joined = page > 0
                && out.last().is_some_and(|l| l.1 == page)
                && readable(base + page * self.p - 1, 2);
            match out.last_mut() {
                Some(l) if joined => l.1 = page + 1,
                _ => out.push((page, page + 1)),
            }
        }
        out
    }

    /// One random step, then the checks.
    fn step(&mut self, rng: &mut Rng, faults: bool) {
        let release = !self.live.is_empty() && (self.live.len() > 48 || rng.below(2) == 0);
        if release {
            let i = rng.below(self.live.len() as u64) as usize;
            let id = self.live.swap_remove(i);
            self.reg.release(id).unwrap();
            self.model.release(id.0);
            if rng.below(20) == 0 {
                assert!(self.reg.release(id).is_err(), "double release");
            }
        } else {
            let pages = 1 + rng.below(24);
            let first = rng.below(PAGES - pages + 1);
            let offset = rng.below(self.p);
            let len = (pages * self.p - offset)
                .saturating_sub(rng.below(self.p / 2))
                .max(1);
            let ptr = self.mem.addr() + first * self.p + offset;
            let end_page = (ptr + len - self.mem.addr()).div_ceil(self.p);
            // SAFETY: a range inside `self.mem`, which outlives the registry; no copy is ever
            // queued on it.
            match unsafe { self.reg.register(ptr as *const u8, len, FLAGS) } {
                Ok(id) => {
                    self.model.register(id.0, first..end_page);
                    let info = self.reg.info(id).unwrap();
                    assert_eq!(info.user_range, ptr..ptr + len);
                    self.live.push(id);
                }
                Err(e) => assert!(faults, "unexpected {e:?}"),
            }
        }
        if !faults {
            let counts = self.sim.counts();
            assert_eq!(counts.get(Op::HostRegister), self.model.registers);
            assert_eq!(counts.get(Op::HostUnregister), self.model.unregisters);
        }
        assert_eq!(self.cache_view(), self.model_view());
        let page = rng.below(PAGES);
        let q = self
            .reg
            .query((self.mem.addr() + page * self.p + 7) as *const u8);
        assert_eq!(
            q.map(|i| i.id.0),
            self.model.query(page),
            "query page {page}"
        );
    }

    fn run(&mut self, seed: u64, steps: usize, faults: bool) {
        let mut rng = Rng(seed);
        for step in 0..steps {
            self.step(&mut rng, faults);
            if step % 250 == 0 {
                self.reg.cache().check_invariants().unwrap();
                assert_eq!(self.sim_view(), self.model.bounds(), "step {step}");
            }
        }
        assert!(!self.model.ranges.is_empty());
        for id in std::mem::take(&mut self.live) {
            self.reg.release(id).unwrap();
            self.model.release(id.0);
        }
        assert!(self.reg.backend_ranges().is_empty());
        assert!(
            self.sim_view().is_empty(),
            "the sim still holds registrations"
        );
        let counts = self.sim.counts();
        assert!(counts.get(Op::HostRegister) > 1000, "{counts:?}");
        if !faults {
            assert_eq!(counts.get(Op::HostRegister), counts.get(Op::HostUnregister));
        }
    }
}

#[test]
fn ten_thousand_random_registrations_match_the_model_and_leave_nothing() {
    let mut h = Harness::new();
    h.run(0x5eed, 10_000, false);
    let stats = h.reg.stats();
    assert!(stats.cache_hits > 100, "{stats:?}");
}

#[test]
fn injected_register_failures_never_make_the_cache_drift() {
    let mut h = Harness::new();
    h.sim.inject(
        Op::HostRegister,
        Fault::Random {
            probability: 0.3,
            seed: 42,
            error: BackendError::Injected("host_register"),
        },
    );
    h.run(0xfa11, 3_000, true);
    let stats = h.reg.stats().clone();
    assert!(stats.backend_failures > 20, "{stats:?}");
    // the retry rescued most failures: failed calls exceed failed registrations
    let calls = h.sim.counts().get(Op::HostRegister);
    assert!(calls > stats.backend_failures * 3, "{calls} {stats:?}");
}
