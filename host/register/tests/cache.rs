//! The interval cache against the sim, with real memory: 100 registrations of one 512 MiB
//! range make one backend call; overlapping and adjacent ranges register only what is
//! missing; failed backend calls are retried once, then dropped from the cache so it matches
//! the backend; slow registrations are logged with the number of mappings they cross.

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use gpualloc_host::mapping::{page_size, PageMapping};
use gpualloc_host_register::{HostRegistry, RegisterError};
use gpualloc_runtime::{Backend, BackendError, HostRegisterFlags};
use gpualloc_sim::{Fault, Op, SimBackend, SimConfig};

const MIB: u64 = 1 << 20;
const RW: HostRegisterFlags = HostRegisterFlags {
    portable: false,
    device_map: false,
    read_only: false,
};

fn sim() -> (Arc<SimBackend>, Arc<dyn Backend>) {
    let sim = SimBackend::new(SimConfig::fast(1)).unwrap();
    let dyn_backend: Arc<dyn Backend> = sim.clone();
    (sim, dyn_backend)
}

#[test]
fn hundred_registrations_of_one_512_mib_range_make_one_backend_call() {
    let (sim, backend) = sim();
    // A real 512 MiB anonymous mapping; its pages are never touched.
    let mem = PageMapping::new(512 * MIB as usize).unwrap();
    let mut reg = HostRegistry::new(backend);
    // SAFETY: this test's own mapped memory, which outlives the registration; no copy is queued on
    // it.
    let ids: Vec<_> = (0..100)
        .map(|_| unsafe { reg.register(mem.as_ptr(), 512 * MIB, RW) }.unwrap())
        .collect();
    assert_eq!(sim.counts().get(Op::HostRegister), 1);
    assert_eq!(reg.stats().cache_hits, 99);
    let ranges = reg.backend_ranges();
    assert_eq!(ranges.len(), 1);
    assert_eq!(ranges[0].range, mem.addr()..mem.addr() + 512 * MIB);
    assert_eq!(ranges[0].users.len(), 100);
    // queries come from the cache: no backend call
    let calls_before = sim.counts().total();
    let info = reg.query(mem.as_ptr().wrapping_add(300 << 20)).unwrap();
    assert_eq!(info.id, ids[0]);
    assert_eq!(info.user_range, mem.addr()..mem.addr() + 512 * MIB);
    assert!(info.ready);
    assert_eq!(sim.counts().total(), calls_before);
    // the backend range lives until its last user releases it
    for id in &ids[..99] {
        reg.release(*id).unwrap();
    }
    assert_eq!(sim.counts().get(Op::HostUnregister), 0);
    reg.release(ids[99]).unwrap();
    assert_eq!(sim.counts().get(Op::HostUnregister), 1);
    assert!(reg.backend_ranges().is_empty());
    assert!(reg.query(mem.as_ptr()).is_none());
    // nothing is left at the backend: registering the range directly succeeds
    // SAFETY: this test's own mapped memory, which outlives the registration; no copy is queued on
    // it.
    unsafe { sim.host_register(mem.as_ptr(), 512 * MIB, RW) }.unwrap();
    sim.host_unregister(mem.as_ptr()).unwrap();
}

#[test]
fn overlapping_and_adjacent_ranges_register_only_the_missing_parts() {
    let (sim, backend) = sim();
    let p = page_size() as u64;
    let mem = PageMapping::new(64 * p as usize).unwrap();
    let base = mem.addr();
    let at = |page: u64| (base + page * p) as *const u8;
    let mut reg = HostRegistry::new(backend);
    // an unaligned user range: pages 4..8 are registered, the handle keeps the user range
    // SAFETY: this test's own mapped memory, which outlives the registration; no copy is
    // queued on it.
    let a = unsafe { reg.register(at(4).wrapping_add(100), 4 * p - 200, RW) }.unwrap();
    let info = reg.info(a).unwrap();
    assert_eq!(info.user_range, base + 4 * p + 100..base + 8 * p - 100);
    assert_eq!(info.page_range, base + 4 * p..base + 8 * p);
    // overlapping: only pages 8..12 are new
    // SAFETY: this test's own mapped memory, which outlives the registration; no copy is queued on
    // it.
    let b = unsafe { reg.register(at(6), 6 * p, RW) }.unwrap();
    // adjacent: its own backend range, not merged
    // SAFETY: this test's own mapped memory, which outlives the registration; no copy is queued on
    // it.
    let c = unsafe { reg.register(at(12), 2 * p, RW) }.unwrap();
    // covered by a and b together: no call
    // SAFETY: this test's own mapped memory, which outlives the registration; no copy is queued on
    // it.
    let d = unsafe { reg.register(at(5), 6 * p, RW) }.unwrap();
    let ranges: Vec<_> = reg
        .backend_ranges()
        .iter()
        .map(|r| {
            (
                (r.range.start - base) / p,
                (r.range.end - base) / p,
                r.users.len(),
            )
        })
        .collect();
    assert_eq!(ranges, vec![(4, 8, 3), (8, 12, 2), (12, 14, 1)]);
    assert_eq!(sim.counts().get(Op::HostRegister), 3);
    assert_eq!(
        reg.info(b).unwrap().backend_range,
        base + 4 * p..base + 12 * p
    );
    // release a: pages 4..8 stay (b and d hold them whole); nothing is split
    reg.release(a).unwrap();
    reg.release(b).unwrap();
    assert_eq!(sim.counts().get(Op::HostUnregister), 0);
    reg.release(d).unwrap();
    assert_eq!(sim.counts().get(Op::HostUnregister), 2);
    reg.release(c).unwrap();
    assert_eq!(sim.counts().get(Op::HostUnregister), 3);
    reg.cache().check_invariants().unwrap();
}

#[test]
fn a_failed_call_is_retried_once_then_dropped_from_the_cache() {
    let (sim, backend) = sim();
    let p = page_size() as u64;
    let mem = PageMapping::new(32 * p as usize).unwrap();
    let at = |page: u64| (mem.addr() + page * p) as *const u8;
    let mut reg = HostRegistry::new(backend);
    let injected = || BackendError::Injected("host_register");

    // one failure: the retry succeeds
    sim.inject(
        Op::HostRegister,
        Fault::FailNext {
            skip: 0,
            count: 1,
            error: injected(),
        },
    );
    // SAFETY: this test's own mapped memory, which outlives the registration; no copy is queued on
    // it.
    let a = unsafe { reg.register(at(0), 4 * p, RW) }.unwrap();
    assert_eq!(sim.counts().get(Op::HostRegister), 2);

    // two failures: typed error, cache and backend as before
    sim.inject(
        Op::HostRegister,
        Fault::FailNext {
            skip: 0,
            count: 2,
            error: injected(),
        },
    );
    // SAFETY: this test's own mapped memory, which outlives the registration; no copy is queued on
    // it.
    let err = unsafe { reg.register(at(8), 4 * p, RW) }.unwrap_err();
    assert!(
        matches!(&err, RegisterError::Backend { op: "host_register", source, .. } if *source == injected()),
        "{err:?}"
    );
    assert_eq!(sim.counts().get(Op::HostRegister), 4);
    assert_eq!(reg.len(), 1);
    assert_eq!(reg.backend_ranges().len(), 1);

    // a registration with two gaps whose second gap fails: the first is unregistered again
    // SAFETY: this test's own mapped memory, which outlives the registration; no copy is queued on
    // it.
    let mid = unsafe { reg.register(at(6), 2 * p, RW) }.unwrap();
    sim.reset_counts();
    sim.inject(
        Op::HostRegister,
        Fault::FailNext {
            skip: 1,
            count: 2,
            error: injected(),
        },
    );
    let before = reg.backend_ranges();
    // SAFETY: this test's own mapped memory, which outlives the registration; no copy is queued on
    // it.
    assert!(unsafe { reg.register(at(2), 10 * p, RW) }.is_err()); // gaps: pages 4..6 ok, 8..12 fails
    assert_eq!(sim.counts().get(Op::HostRegister), 3);
    assert_eq!(sim.counts().get(Op::HostUnregister), 1);
    assert_eq!(reg.backend_ranges(), before);
    reg.cache().check_invariants().unwrap();
    // the backend agrees: pages 4..6 and 8..12 are free to register directly
    for (page, n) in [(4, 2), (8, 4)] {
        // SAFETY: this test's own mapped memory, which outlives the registration; no copy is queued
        // on it.
        unsafe { sim.host_register(at(page) as *mut u8, n * p, RW) }.unwrap();
        sim.host_unregister(at(page) as *mut u8).unwrap();
    }
    reg.release(mid).unwrap();

    // an unregister refused twice: the range leaves the cache and the error is typed
    sim.inject(
        Op::HostUnregister,
        Fault::FailNext {
            skip: 0,
            count: 2,
            error: BackendError::Injected("host_unregister"),
        },
    );
    let err = reg.release(a).unwrap_err();
    assert!(
        matches!(
            err,
            RegisterError::Backend {
                op: "host_unregister",
                ..
            }
        ),
        "{err:?}"
    );
    assert!(reg.backend_ranges().is_empty());
    assert_eq!(reg.release(a), Err(RegisterError::UnknownRegistration(a)));
    sim.clear_faults();
    sim.host_unregister(at(0) as *mut u8).unwrap(); // what the injected faults left behind
}

/// Collects what `tracing` writes.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn a_slow_registration_logs_the_mappings_it_crosses() {
    let slow_sim = SimBackend::new(SimConfig::default()).unwrap(); // real-hardware latencies
    let backend: Arc<dyn Backend> = slow_sim;
    let p = page_size() as u64;
    let mut mem = PageMapping::new(64 * p as usize).unwrap();
    mem.as_mut_slice()[0] = 1;
    // Fragment the range: every other page read-only, so it crosses 64 OS mappings.
    for i in (1..64).step_by(2) {
        // SAFETY: the pages belong to `mem`, which nothing borrows now; making them read-only
        // only forbids writes, and nothing writes them until `mem` is dropped.
        unsafe {
            rustix::mm::mprotect(
                mem.as_ptr().add(i * p as usize).cast(),
                p as usize,
                rustix::mm::MprotectFlags::READ,
            )
        }
        .unwrap();
    }
    let ro = HostRegisterFlags {
        read_only: true,
        ..RW
    };
    let captured = Captured::default();
    let writer = captured.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .finish();
    let mut reg = HostRegistry::new(backend).with_slow_threshold(Duration::from_micros(500));
    // SAFETY: this test's own mapped memory, which outlives the registration; no copy is queued on
    // it.
    let id = tracing::subscriber::with_default(subscriber, || unsafe {
        reg.register(mem.as_ptr(), 64 * p, ro)
    })
    .unwrap();
    // 20 µs base + 64 mappings × 10 µs: 660 µs on the sim's model
    let slow = reg.stats().slowest.clone().unwrap();
    assert_eq!(slow.mappings, Some(64));
    assert!(slow.took >= Duration::from_micros(600), "{:?}", slow.took);
    let log = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
    assert!(log.contains("WARN"), "{log}");
    assert!(log.contains("crosses 64 OS mappings"), "{log}");
    reg.release(id).unwrap();
    // a fast one (one mapping, zero latency) is not logged as slow
    let (_, fast) = sim();
    let small = PageMapping::new(p as usize).unwrap();
    let mut reg = HostRegistry::new(fast).with_slow_threshold(Duration::from_secs(1));
    // SAFETY: this test's own mapped memory, which outlives the registration; no copy is queued on
    // it.
    unsafe { reg.register(small.as_ptr(), p, RW) }.unwrap();
    assert_eq!(reg.stats().slow_registrations, 0);
}
