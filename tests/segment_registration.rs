//! Segment registration through the public API (what the `nccl`
//! feature's adapter is built on): a fake registrar is kept equal to the chosen pool's
//! ranges, never holds a registration of memory being unmapped or freed (a second release
//! hook checks at every release), survives a registrar that fails or panics, catches up after
//! falling behind the events, and is refused by a backend without release hooks.

mod common;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use common::{build, joined, sim, MIB};
use gpualloc::runtime::release_hooks::{Release, ReleaseHook};
use gpualloc::{
    Allocator, BackendError, BackendKind, DeviceId, Error, Pool, PoolOptions, RegistrationStats,
    SegmentRegistrar, SegmentRegistration, SleepMode,
};

const D0: DeviceId = DeviceId(0);

/// What the fake registrar holds: registered ranges by address.
type Books = Arc<Mutex<BTreeMap<u64, u64>>>;

/// Registers into [`Books`]; optionally fails or panics on some calls, or blocks until let go.
#[derive(Default)]
struct Fake {
    books: Books,
    calls: u64,
    fail_every: Option<u64>,
    panic_at: Option<u64>,
    /// While true, `register` waits (the follow task stalls).
    hold: Option<Arc<(Mutex<bool>, Condvar)>>,
}

impl SegmentRegistrar for Fake {
    type Handle = (u64, u64);
    fn register(&mut self, addr: u64, size: u64) -> Result<(u64, u64), String> {
        if let Some(h) = &self.hold {
            let mut held = h.0.lock().unwrap();
            while *held {
                held = h.1.wait(held).unwrap();
            }
        }
        self.calls += 1;
        if self.panic_at == Some(self.calls) {
            panic!("registrar bug");
        }
        if self.fail_every.is_some_and(|n| self.calls % n == 0) {
            return Err("refused".into());
        }
        let mut b = self.books.lock().unwrap();
        assert!(b.insert(addr, size).is_none(), "registered {addr:#x} twice");
        Ok((addr, size))
    }
    fn deregister(&mut self, addr: u64, size: u64, handle: (u64, u64)) -> Result<(), String> {
        assert_eq!(handle, (addr, size));
        let mut b = self.books.lock().unwrap();
        assert_eq!(
            b.remove(&addr),
            Some(size),
            "deregistered what was not registered"
        );
        Ok(())
    }
}

/// A release hook installed after the registration's: counts releases that find a fake
/// registration still touching the memory being released.
struct Checker {
    books: Books,
    releases: AtomicU64,
    violations: AtomicU64,
}

impl ReleaseHook for Checker {
    fn before_release(&self, release: Release) {
        self.releases.fetch_add(1, Ordering::SeqCst);
        let b = self.books.lock().unwrap();
        if b.iter().any(|(&a, &s)| release.touches(a, s)) {
            self.violations.fetch_add(1, Ordering::SeqCst);
        }
    }
}

/// The pool's ranges now, joined where they touch.
async fn pool_ranges(alloc: &Allocator, pool: &Pool) -> Vec<(u64, u64)> {
    let id = Some(pool.id(D0).unwrap());
    let w = alloc.watch_segments(D0).await.unwrap();
    joined(
        w.ranges
            .iter()
            .filter(|r| r.pool == id)
            .map(|r| (r.addr, r.size)),
    )
}

/// Waits (up to 5 s) until the fake's registrations are exactly the pool's ranges.
async fn until_registered(alloc: &Allocator, pool: &Pool, books: &Books, what: &str) {
    let mut last = (Vec::new(), Vec::new());
    for _ in 0..1000 {
        let want = pool_ranges(alloc, pool).await;
        let have = joined(books.lock().unwrap().iter().map(|(&a, &s)| (a, s)));
        if want == have {
            return;
        }
        last = (want, have);
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!(
        "{what}: the pool holds {:x?}, registered {:x?}",
        last.0, last.1
    );
}

/// Waits (up to 5 s) until the registration's stats satisfy `done` (the caller asserts).
async fn until_stats(reg: &SegmentRegistration, done: impl Fn(&RegistrationStats) -> bool) {
    for _ in 0..1000 {
        if done(&reg.stats()) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn install_checker(alloc: &Allocator, books: &Books) -> Arc<Checker> {
    let checker = Arc::new(Checker {
        books: books.clone(),
        releases: AtomicU64::new(0),
        violations: AtomicU64::new(0),
    });
    alloc
        .backend()
        .release_hooks()
        .unwrap()
        .add(checker.clone());
    checker
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pools_ranges_are_registered_and_dropped_before_each_release() {
    for conf in [
        "expandable_segments:True",
        "",
        "expandable_segments:True,thread_cache:False",
    ] {
        let alloc = build(sim(4 << 30), conf);
        let s = alloc.new_stream(D0).unwrap();
        let other = alloc.pool("other", PoolOptions::default()).await.unwrap();
        let comm = alloc.pool("comm", PoolOptions::default()).await.unwrap();
        let mut others = Vec::new();
        let mut bufs = Vec::new();
        for i in 0..3u64 {
            others.push(other.malloc(3 * MIB + i, &s).await.unwrap());
            others.push(alloc.malloc(5 * MIB, &s).await.unwrap());
            bufs.push(comm.malloc((i + 1) * 7 * MIB, &s).await.unwrap());
        }
        let books = Books::default();
        let fake = Fake {
            books: books.clone(),
            ..Fake::default()
        };
        let reg = alloc
            .register_segments(D0, Some(&comm), fake)
            .await
            .unwrap();
        let checker = install_checker(&alloc, &books);
        // What the pool held before: registered before register_segments returned.
        let registered = joined(books.lock().unwrap().iter().map(|(&a, &s)| (a, s)));
        assert_eq!(
            registered,
            pool_ranges(&alloc, &comm).await,
            "[{conf}] the ranges held at the start"
        );
        for i in 0..40u64 {
            bufs.push(
                comm.malloc((i % 11) * MIB + 512 * (i + 1), &s)
                    .await
                    .unwrap(),
            );
            others.push(other.malloc((i % 3) * MIB + 1, &s).await.unwrap());
        }
        until_registered(&alloc, &comm, &books, conf).await;
        let st = reg.stats();
        assert_eq!(st.failures, 0, "[{conf}]");
        assert_eq!(
            st.live_bytes,
            comm.usage(D0).await.unwrap().reserved.all().current,
            "[{conf}] registered bytes = the pool's reserved bytes"
        );

        // Other pools give memory back: the registration is untouched (PyTorch's rule: a
        // live named pool keeps its cached segments through `empty_cache`).
        others.clear();
        bufs.truncate(5);
        alloc.empty_cache().await.unwrap();
        assert!(checker.releases.load(Ordering::SeqCst) > 0, "[{conf}]");
        assert_eq!(reg.stats().deregistered, 0, "[{conf}]");
        for i in 0..10u64 {
            bufs.push(comm.malloc(i * 3 * MIB + 4096, &s).await.unwrap());
        }
        until_registered(&alloc, &comm, &books, conf).await;

        if conf.starts_with("expandable") {
            let (live, before) = (reg.stats().live as u64, reg.stats().deregistered);
            comm.sleep(SleepMode::Offload).await.unwrap();
            assert_eq!(reg.stats().deregistered, before + live, "[{conf}]");
            assert!(
                books.lock().unwrap().is_empty(),
                "[{conf}] a sleeping pool has no registration left"
            );
            comm.wake().await.unwrap();
            until_registered(&alloc, &comm, &books, conf).await;
        }
        assert_eq!(
            checker.violations.load(Ordering::SeqCst),
            0,
            "[{conf}] a registration outlived the start of its release"
        );
        // The pool goes: every registration is dropped before its memory is (each at least
        // once: a release of part of one drops it whole and registers the rest again).
        let live = reg.stats().live as u64;
        let before = reg.stats().deregistered;
        drop((bufs, comm));
        alloc.empty_cache().await.unwrap();
        assert!(
            books.lock().unwrap().is_empty(),
            "[{conf}] {:?}",
            reg.stats()
        );
        assert!(reg.stats().deregistered >= before + live, "[{conf}]");
        let end = reg.close();
        assert_eq!(end.live, 0);
        assert!(
            books.lock().unwrap().is_empty(),
            "[{conf}] close deregisters"
        );
        assert_eq!(end.registered, end.deregistered, "[{conf}] {end:?}");
        assert_eq!(checker.violations.load(Ordering::SeqCst), 0, "[{conf}]");
        alloc.shutdown().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registering_every_segment_of_a_device_and_a_shutdown_dropping_them() {
    let alloc = build(sim(2 << 30), "expandable_segments:True");
    let s = alloc.new_stream(D0).unwrap();
    let kv = alloc.pool("kv", PoolOptions::default()).await.unwrap();
    let books = Books::default();
    let reg = alloc
        .register_segments(
            D0,
            None,
            Fake {
                books: books.clone(),
                ..Fake::default()
            },
        )
        .await
        .unwrap();
    let checker = install_checker(&alloc, &books);
    let _a = alloc.malloc(30 * MIB, &s).await.unwrap();
    let _b = kv.malloc(50 * MIB, &s).await.unwrap();
    let reserved = alloc.stats(D0).await.unwrap().reserved_bytes.all().current;
    until_stats(&reg, |st| st.live_bytes == reserved).await;
    assert_eq!(reg.stats().live_bytes, reserved, "both pools registered");
    // A shutdown releases every segment without events: only the release hook can have
    // dropped the registrations, each just before its memory went.
    alloc.shutdown().await.unwrap();
    assert!(books.lock().unwrap().is_empty(), "{:?}", reg.stats());
    let st = reg.stats();
    assert_eq!(st.deregistered_before_release, st.registered, "{st:?}");
    assert_eq!(checker.violations.load(Ordering::SeqCst), 0);
    drop(reg);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registrar_that_fails_or_panics_is_counted_and_the_allocator_goes_on() {
    let alloc = build(sim(2 << 30), "expandable_segments:True");
    let s = alloc.new_stream(D0).unwrap();
    let comm = alloc.pool("comm", PoolOptions::default()).await.unwrap();
    let books = Books::default();
    let reg = alloc
        .register_segments(
            D0,
            Some(&comm),
            Fake {
                books: books.clone(),
                fail_every: Some(3),
                panic_at: Some(2),
                ..Fake::default()
            },
        )
        .await
        .unwrap();
    let checker = install_checker(&alloc, &books);
    let mut bufs = Vec::new();
    for i in 0..9u64 {
        // Each a growth of its own: 9 maps, so 9 register calls.
        bufs.push(comm.malloc(20 * MIB + i, &s).await.unwrap());
    }
    until_stats(&reg, |st| st.registered + st.failures == 9).await;
    let st = reg.stats();
    // Calls 2 (panic), 3, 6 and 9 (refused) fail.
    assert_eq!((st.registered, st.failures), (5, 4), "{st:?}");
    assert_eq!(books.lock().unwrap().len(), 5);
    drop((bufs, comm));
    alloc.empty_cache().await.unwrap();
    assert!(books.lock().unwrap().is_empty());
    assert_eq!(reg.stats().deregistered, 5);
    assert_eq!(checker.violations.load(Ordering::SeqCst), 0);
    // The allocator still serves.
    let b = alloc.malloc(MIB, &s).await.unwrap();
    drop(b);
    alloc.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registration_that_fell_behind_the_events_catches_up() {
    let alloc = build(sim(8 << 30), "expandable_segments:True");
    let s = alloc.new_stream(D0).unwrap();
    let comm = alloc.pool("comm", PoolOptions::default()).await.unwrap();
    let books = Books::default();
    let hold = Arc::new((Mutex::new(true), Condvar::new()));
    let reg = alloc
        .register_segments(
            D0,
            Some(&comm),
            Fake {
                books: books.clone(),
                hold: Some(hold.clone()),
                ..Fake::default()
            },
        )
        .await
        .unwrap();
    // The follow task stalls in its first registration...
    let first = comm.malloc(2 * MIB, &s).await.unwrap();
    // ... while more events than the channel keeps go by (maps in the default pool, and
    // in the registered pool).
    let mut bufs = Vec::new();
    for i in 0..(gpualloc::SEGMENT_EVENTS_BUFFERED as u64 + 50) {
        bufs.push(alloc.malloc(2 * MIB, &s).await.unwrap());
        if i % 100 == 0 {
            bufs.push(comm.malloc(2 * MIB, &s).await.unwrap());
        }
    }
    {
        *hold.0.lock().unwrap() = false;
        hold.1.notify_all();
    }
    until_registered(&alloc, &comm, &books, "after a lag").await;
    assert_eq!(reg.stats().failures, 0);
    drop((first, bufs));
    alloc.shutdown().await.unwrap();
    assert!(books.lock().unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_without_release_hooks_refuses_registration() {
    let alloc = Allocator::builder()
        .backend(BackendKind::Accounting {
            devices: 1,
            capacity: 1 << 30,
        })
        .build()
        .unwrap();
    let r: Result<SegmentRegistration, Error> =
        alloc.register_segments(D0, None, Fake::default()).await;
    match r {
        Err(Error::Backend(BackendError::NotSupported(m))) => {
            assert!(m.contains("release hooks"), "{m}")
        }
        other => panic!("{other:?}"),
    }
    let e = alloc
        .register_segments(DeviceId(3), None, Fake::default())
        .await
        .unwrap_err();
    assert!(matches!(e, Error::InvalidDevice { device: 3, .. }), "{e:?}");
}

/// A release of part of a registered range (pages of an expandable segment that
/// `empty_cache` unmaps) drops the registration whole, as a registrar cannot shrink one, and
/// registers the part that stays mapped again once the release has returned. Before, that
/// part stayed unregistered (correct, but NCCL then copies through its own buffers).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_mapped_rest_of_a_partly_released_range_is_registered_again() {
    let alloc = build(sim(1 << 30), "expandable_segments:True");
    let s = alloc.new_stream(D0).unwrap();
    // Two growths side by side: one mapped stretch, registered as one range at the start.
    let a = alloc.malloc(6 * MIB, &s).await.unwrap();
    let b = alloc.malloc(6 * MIB, &s).await.unwrap();
    let (a_at, b_at) = (a.ptr().0, b.ptr().0);
    assert_eq!(b_at, a_at + 6 * MIB);
    let books = Books::default();
    let fake = Fake {
        books: books.clone(),
        ..Fake::default()
    };
    let reg = alloc.register_segments(D0, None, fake).await.unwrap();
    let checker = install_checker(&alloc, &books);
    let covering = |from: u64, to: u64| {
        books
            .lock()
            .unwrap()
            .iter()
            .any(|(&at, &size)| at <= from && to <= at + size)
    };
    assert!(
        covering(a_at, b_at + 6 * MIB),
        "{:x?}",
        books.lock().unwrap()
    );
    assert_eq!(reg.stats().live, 1);
    drop(a);
    s.synchronize().unwrap();
    alloc.empty_cache().await.unwrap();
    let st = reg.stats();
    assert_eq!(st.deregistered, 1, "{st:?}");
    assert!(
        covering(b_at, b_at + 6 * MIB),
        "{:x?}",
        books.lock().unwrap()
    );
    assert!(!covering(a_at, a_at + 1), "a's pages are gone");
    assert_eq!(st.registered, 2, "{st:?}");
    assert_eq!(st.failures, 0);
    assert_eq!(checker.violations.load(Ordering::SeqCst), 0);
    drop(b);
    alloc.empty_cache().await.unwrap();
    assert!(books.lock().unwrap().is_empty(), "{:?}", reg.stats());
    assert_eq!(checker.violations.load(Ordering::SeqCst), 0);
    alloc.shutdown().await.unwrap();
}
