//! [`AsyncRegistry`] on the sim: metadata recorded at once, backend calls off the async
//! runtime, one shared backend call for concurrent registrations of one range, failures
//! delivered to every sharer, releases and unregisters racing registrations.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpualloc_host::mapping::{page_size, PageMapping};
use gpualloc_host_register::{AsyncRegistry, RegisterError, RegistrationMode};
use gpualloc_runtime::{Backend, BackendError, HostRegisterFlags};
use gpualloc_sim::{Fault, LatencyModel, Op, SimBackend, SimConfig};

const MIB: u64 = 1 << 20;
const RW: HostRegisterFlags = HostRegisterFlags {
    portable: false,
    device_map: false,
    read_only: false,
};

/// A sim whose `host_register` takes `register` and `host_unregister` takes `unregister`.
fn slow_sim(register: Duration, unregister: Duration) -> (Arc<SimBackend>, Arc<dyn Backend>) {
    let sim = SimBackend::new(SimConfig {
        latency: LatencyModel {
            host_register_base: register,
            host_unregister: unregister,
            ..LatencyModel::zero()
        },
        ..SimConfig::default()
    })
    .unwrap();
    let backend: Arc<dyn Backend> = sim.clone();
    (sim, backend)
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_time()
        .build()
        .unwrap()
}

async fn settle(reg: &AsyncRegistry) {
    for _ in 0..500 {
        if reg.in_flight() == 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    panic!("backend calls still in flight");
}

#[test]
fn sixty_four_concurrent_registrations_of_one_range_share_one_backend_call() {
    let (sim, backend) = slow_sim(Duration::from_millis(30), Duration::ZERO);
    let mem = Arc::new(PageMapping::new(64 * MIB as usize).unwrap());
    runtime().block_on(async {
        let reg = AsyncRegistry::new(backend).unwrap();
        let mut tasks = Vec::new();
        for _ in 0..64 {
            let reg = reg.clone();
            let mem = mem.clone();
            tasks.push(tokio::spawn(async move {
                // SAFETY: this test's own mapped memory, which outlives the registration; no copy
                // is queued on it.
                unsafe { reg.register(mem.as_ptr(), 64 * MIB, RW) }
                    .unwrap()
                    .await
            }));
        }
        let mut ids = Vec::new();
        for t in tasks {
            ids.push(t.await.unwrap().unwrap());
        }
        assert_eq!(sim.counts().get(Op::HostRegister), 1);
        ids.sort();
        ids.dedup();
        assert_eq!(ids.len(), 64);
        let ranges = reg.backend_ranges();
        assert_eq!(ranges.len(), 1);
        assert_eq!(ranges[0].users.len(), 64);
        assert!(ranges[0].ready);
        assert_eq!(reg.stats().cache_hits, 63);
        for id in ids {
            reg.release(id).unwrap().await.unwrap();
        }
        assert_eq!(sim.counts().get(Op::HostUnregister), 1);
        assert!(reg.backend_ranges().is_empty());
    });
}

#[test]
fn metadata_is_recorded_at_once_and_the_future_resolves_when_usable() {
    let (sim, backend) = slow_sim(Duration::from_millis(80), Duration::ZERO);
    let mem = PageMapping::new(8 * MIB as usize).unwrap();
    runtime().block_on(async {
        let reg = AsyncRegistry::new(backend).unwrap();
        let started = Instant::now();
        // SAFETY: this test's own mapped memory, which outlives the registration; no copy is queued
        // on it.
        let pending = unsafe { reg.register(mem.as_ptr(), 8 * MIB, RW) }.unwrap();
        let recorded = started.elapsed();
        assert!(
            recorded < Duration::from_millis(40),
            "register blocked {recorded:?}"
        );
        let info = reg.query(mem.as_ptr()).unwrap();
        assert_eq!(info.id, pending.id());
        assert!(!info.ready);
        assert_eq!(reg.in_flight(), 1);
        let id = pending.await.unwrap();
        assert!(started.elapsed() >= Duration::from_millis(80));
        assert!(reg.query(mem.as_ptr()).unwrap().ready);
        assert_eq!(reg.in_flight(), 0);
        assert_eq!(sim.counts().get(Op::HostRegister), 1);
        reg.release(id).unwrap().await.unwrap();
    });
}

#[test]
fn a_failed_call_fails_every_sharer_and_leaves_nothing() {
    let (sim, backend) = slow_sim(Duration::ZERO, Duration::ZERO);
    let mem = PageMapping::new(4 * MIB as usize).unwrap();
    let upper = mem.as_ptr().wrapping_add(2 * MIB as usize);
    // Single-threaded runtime: spawned registration tasks start only when this task awaits,
    // so the second registration surely joins the first one's call in flight.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    rt.block_on(async {
        let reg = AsyncRegistry::new(backend).unwrap();
        // SAFETY: this test's own mapped memory, which outlives the registration; no copy is queued
        // on it.
        let b = unsafe { reg.register(upper, 2 * MIB, RW) }
            .unwrap()
            .await
            .unwrap();
        sim.inject(
            Op::HostRegister,
            Fault::FailNext {
                skip: 0,
                count: 2,
                error: BackendError::Injected("host_register"),
            },
        );
        // a: the lower half, whose call fails (and its retry); c: both halves, sharing a's
        // call in flight and b's registered range.
        // SAFETY: this test's own mapped memory, which outlives the registration; no copy is queued
        // on it.
        let a = unsafe { reg.register(mem.as_ptr(), 2 * MIB, RW) }.unwrap();
        // SAFETY: this test's own mapped memory, which outlives the registration; no copy is queued
        // on it.
        let c = unsafe { reg.register(mem.as_ptr(), 4 * MIB, RW) }.unwrap();
        let (a_id, c_id) = (a.id(), c.id());
        assert_eq!(reg.backend_ranges()[0].users.len(), 2, "c joined a's range");
        let (ra, rc) = tokio::join!(a, c);
        let err = ra.unwrap_err();
        assert!(
            matches!(
                err,
                RegisterError::Backend {
                    op: "host_register",
                    ..
                }
            ),
            "{err:?}"
        );
        assert_eq!(rc.unwrap_err(), err, "the sharer gets the same error");
        settle(&reg).await;
        assert!(reg.info(a_id).is_none() && reg.info(c_id).is_none());
        let ranges = reg.backend_ranges();
        assert_eq!(ranges.len(), 1);
        assert_eq!(ranges[0].users.iter().copied().collect::<Vec<_>>(), vec![b]);
        assert_eq!(
            reg.release(a_id).map(|_| ()),
            Err(RegisterError::UnknownRegistration(a_id))
        );
        reg.release(b).unwrap().await.unwrap();
        assert!(reg.backend_ranges().is_empty());
        let counts = sim.counts();
        assert_eq!(counts.get(Op::HostRegister), 3);
        assert_eq!(counts.get(Op::HostUnregister), 1);
    });
}

#[test]
fn release_during_the_call_unregisters_when_it_finishes() {
    let (sim, backend) = slow_sim(Duration::from_millis(40), Duration::ZERO);
    let mem = PageMapping::new(4 * MIB as usize).unwrap();
    runtime().block_on(async {
        let reg = AsyncRegistry::new(backend).unwrap();
        // SAFETY: this test's own mapped memory, which outlives the registration; no copy is queued
        // on it.
        let pending = unsafe { reg.register(mem.as_ptr(), 4 * MIB, RW) }.unwrap();
        let id = pending.id();
        drop(pending); // cancels nothing: the registration stays recorded
        reg.release(id).unwrap().await.unwrap();
        assert_eq!(sim.counts().get(Op::HostUnregister), 0);
        settle(&reg).await;
        assert_eq!(sim.counts().get(Op::HostRegister), 1);
        assert_eq!(sim.counts().get(Op::HostUnregister), 1);
        assert!(reg.backend_ranges().is_empty());
    });
}

#[test]
fn a_registration_waits_for_an_overlapping_unregister_in_flight() {
    let (sim, backend) = slow_sim(Duration::ZERO, Duration::from_millis(40));
    let mem = PageMapping::new(4 * MIB as usize).unwrap();
    runtime().block_on(async {
        let reg = AsyncRegistry::new(backend).unwrap();
        // SAFETY: this test's own mapped memory, which outlives the registration; no copy is queued
        // on it.
        let a = unsafe { reg.register(mem.as_ptr(), 4 * MIB, RW) }
            .unwrap()
            .await
            .unwrap();
        // SAFETY: this test's own mapped memory, which outlives the registration; no copy is queued
        // on it.
        let released = reg.release(a).unwrap(); // 40 ms unregister, in flight
        let b = unsafe { reg.register(mem.as_ptr().wrapping_add(MIB as usize), MIB, RW) }
            .unwrap()
            .await
            .unwrap();
        released.await.unwrap();
        let stats = reg.stats();
        assert_eq!(stats.backend_failures, 0, "{stats:?}");
        assert_eq!(sim.counts().get(Op::HostRegister), 2, "no retry was needed");
        reg.release(b).unwrap().await.unwrap();
        assert_eq!(sim.counts().get(Op::HostUnregister), 2);
    });
}

/// Ticks a 1 ms timer while a 100 ms registration runs on a single-threaded runtime.
fn ticks_during_registration(mode: RegistrationMode) -> u64 {
    let (_sim, backend) = slow_sim(Duration::from_millis(100), Duration::ZERO);
    let mem = PageMapping::new(page_size()).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    rt.block_on(async {
        let reg = AsyncRegistry::with_mode(backend, mode).unwrap();
        let ticks = Arc::new(AtomicU64::new(0));
        let t = ticks.clone();
        let ticker = tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(1)).await;
                t.fetch_add(1, Ordering::Relaxed);
            }
        });
        tokio::task::yield_now().await;
        // SAFETY: this test's own mapped memory, which outlives the registration; no copy is queued
        // on it.
        let id = unsafe { reg.register(mem.as_ptr(), page_size() as u64, RW) }
            .unwrap()
            .await
            .unwrap();
        let n = ticks.load(Ordering::Relaxed);
        ticker.abort();
        reg.release(id).unwrap().await.unwrap();
        n
    })
}

#[test]
fn the_backend_call_does_not_block_the_async_runtime() {
    let background = ticks_during_registration(RegistrationMode::Background);
    let inline = ticks_during_registration(RegistrationMode::Inline);
    assert!(background >= 10, "background: {background} ticks in 100 ms");
    assert!(inline <= 2, "inline: {inline} ticks");
}
