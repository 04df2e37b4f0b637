//! The sim's latency model: real-hardware defaults, changeable at run time.
#![cfg(not(loom))] // the sim runs real threads; loom builds run only the loom models

use std::time::{Duration, Instant};

use gpualloc_runtime::{Backend, DeviceId, HostRegisterFlags};
use gpualloc_sim::{LatencyModel, SimBackend, SimConfig};

const D0: DeviceId = DeviceId(0);

fn timed<T>(f: impl FnOnce() -> T) -> (T, Duration) {
    let t = Instant::now();
    let v = f();
    (v, t.elapsed())
}

#[test]
fn defaults_model_real_hardware() {
    let m = LatencyModel::default();
    assert_eq!(m.malloc, Duration::from_micros(50));
    assert_eq!(m.event, Duration::from_micros(1));
    assert_eq!(
        m.host_alloc_cost(10 << 20),
        Duration::from_micros(10 + 3000)
    );
    assert!(m.host_register_cost(1 << 30, 10) > m.host_register_cost(1 << 30, 1));
    assert_eq!(SimConfig::default().latency, m);
    assert_eq!(SimConfig::default().capacity_per_device, 16 << 30);
    assert_eq!(SimConfig::default().granularity, 2 << 20);
}

#[test]
fn malloc_costs_what_the_model_says_and_can_be_changed() {
    let sim = SimBackend::new(SimConfig::default()).unwrap();
    // 40 mallocs at 50 us each: at least 2 ms.
    let (ptrs, took) = timed(|| {
        (0..40)
            .map(|_| sim.malloc(D0, 4096).unwrap())
            .collect::<Vec<_>>()
    });
    assert!(
        took >= Duration::from_micros(1_900),
        "40 mallocs took {took:?}"
    );
    sim.set_latency(LatencyModel {
        malloc: Duration::from_millis(5),
        ..LatencyModel::zero()
    });
    assert_eq!(sim.latency().malloc, Duration::from_millis(5));
    let (p, took) = timed(|| sim.malloc(D0, 4096).unwrap());
    assert!(
        took >= Duration::from_millis(5),
        "slow malloc took {took:?}"
    );
    sim.set_latency(LatencyModel::zero());
    let (more, took) = timed(|| {
        (0..40)
            .map(|_| sim.malloc(D0, 4096).unwrap())
            .collect::<Vec<_>>()
    });
    assert!(
        took < Duration::from_millis(500),
        "zero-latency mallocs took {took:?}"
    );
    for q in ptrs.into_iter().chain(more).chain([p]) {
        sim.free(D0, q).unwrap();
    }
}

#[test]
fn free_waits_for_the_device() {
    let sim = SimBackend::new(SimConfig::fast(1)).unwrap();
    let s = sim.stream_create(D0).unwrap();
    let p = sim.malloc(D0, 4096).unwrap();
    sim.launch_kernel(s, Duration::from_millis(60), |_| Ok(()))
        .unwrap();
    let ((), took) = timed(|| sim.free(D0, p).unwrap());
    assert!(
        took >= Duration::from_millis(50),
        "free returned after {took:?}"
    );
    sim.stream_destroy(s).unwrap();
}

#[test]
fn host_costs_scale_with_size_and_mappings() {
    let sim = SimBackend::new(SimConfig::fast(1)).unwrap();
    sim.set_latency(LatencyModel {
        host_alloc_per_mib: Duration::from_millis(1),
        host_register_per_mapping: Duration::from_millis(5),
        ..LatencyModel::zero()
    });
    let (p, took) = timed(|| sim.host_alloc(16 << 20).unwrap());
    assert!(
        took >= Duration::from_millis(16),
        "16 MiB host_alloc took {took:?}"
    );
    sim.host_free(p).unwrap();

    // Pinned memory is already page-locked: registering it again is an error.
    let page = rustix::param::page_size() as u64;
    let a = sim.host_alloc(page).unwrap();
    // SAFETY: the sim's own pinned memory, freed below; the call is refused.
    assert!(unsafe { sim.host_register(a, page, HostRegisterFlags::default()) }.is_err());
    sim.host_free(a).unwrap();

    // Build host ranges with a known number of OS mappings from another sim's VMM: three
    // physical handles mapped side by side are three mappings; one handle is one.
    let other = SimBackend::new(SimConfig::fast(1)).unwrap();
    let g = other.vmm_granularity(D0).unwrap();
    let va = other.va_reserve(D0, 6 * g, 0).unwrap();
    let mut handles = Vec::new();
    for i in 0..3 {
        let h = other.phys_create(D0, g).unwrap();
        other.map(va.checked_add(i * g).unwrap(), g, 0, h).unwrap();
        handles.push(h);
    }
    let one = other.phys_create(D0, 3 * g).unwrap();
    let single = va.checked_add(3 * g).unwrap();
    other.map(single, 3 * g, 0, one).unwrap();
    other.set_access(D0, va, 6 * g).unwrap();

    let flags = HostRegisterFlags::default();
    // SAFETY: the range is this test's own buffer, which outlives it and every copy.
    let ((), three_took) =
        timed(|| unsafe { sim.host_register(va.0 as *mut u8, 3 * g, flags) }.unwrap());
    let ((), one_took) = timed(|| {
        // SAFETY: the range is this test's own buffer, which outlives it and every copy.
        unsafe { sim.host_register(single.0 as *mut u8, 3 * g, flags) }.unwrap()
    });
    assert!(
        three_took >= Duration::from_millis(15),
        "3 mappings took {three_took:?}"
    );
    assert!(
        one_took >= Duration::from_millis(5),
        "1 mapping took {one_took:?}"
    );
    sim.host_unregister(va.0 as *mut u8).unwrap();
    sim.host_unregister(single.0 as *mut u8).unwrap();

    other.unmap(va, 6 * g).unwrap();
    other.va_free(D0, va, 6 * g).unwrap();
    for h in handles.into_iter().chain([one]) {
        other.phys_release(h).unwrap();
    }
}
