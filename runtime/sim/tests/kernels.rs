//! Simulated kernels: real reads and writes of device memory, in stream order, with
//! invalid accesses turned into sticky stream errors instead of crashes.
#![cfg(not(loom))] // the sim runs real threads; loom builds run only the loom models

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpualloc_runtime::{Backend, BackendError, DeviceId, DevicePtr};
use gpualloc_sim::{SimBackend, SimConfig};

const D0: DeviceId = DeviceId(0);

fn sim() -> Arc<SimBackend> {
    SimBackend::new(SimConfig::fast(1)).unwrap()
}

#[test]
fn kernels_read_and_write_device_memory_in_order() {
    let sim = sim();
    let s = sim.stream_create(D0).unwrap();
    let a = sim.malloc(D0, 1 << 20).unwrap();
    let b = sim.malloc(D0, 1 << 20).unwrap();
    sim.launch_kernel(s, Duration::from_millis(20), move |m| m.fill(a, 1 << 20, 9))
        .unwrap();
    // A second kernel, queued behind the first, sees its result and copies it.
    sim.launch_kernel(s, Duration::ZERO, move |m| {
        let bytes = m.read(a, 1 << 20)?;
        assert!(bytes.iter().all(|x| *x == 9));
        m.write(b, &bytes[..4096])?;
        m.write(DevicePtr(b.0 + 4096), b"hello")
    })
    .unwrap();
    sim.stream_synchronize(s).unwrap();
    let mut out = vec![0u8; 4101];
    sim.copy_from_device(s, &mut out, b).unwrap();
    assert!(out[..4096].iter().all(|x| *x == 9));
    assert_eq!(&out[4096..], b"hello");
    let seen = Arc::new(AtomicU64::new(0));
    let seen2 = seen.clone();
    sim.launch_kernel(s, Duration::ZERO, move |m| {
        seen2.store(
            u64::from(m.check(b, 4096, 9)?) + 10 * u64::from(m.check(b, 4097, 9)?),
            Ordering::SeqCst,
        );
        Ok(())
    })
    .unwrap();
    sim.stream_synchronize(s).unwrap();
    assert_eq!(
        seen.load(Ordering::SeqCst),
        1,
        "check: first 4096 bytes are 9, byte 4096 is not"
    );
    sim.free(D0, a).unwrap();
    sim.free(D0, b).unwrap();
    sim.stream_destroy(s).unwrap();
}

#[test]
fn kernel_duration_delays_the_stream() {
    let sim = sim();
    let s = sim.stream_create(D0).unwrap();
    let t = Instant::now();
    sim.launch_kernel(s, Duration::from_millis(30), |_| Ok(()))
        .unwrap();
    sim.launch_kernel(s, Duration::from_millis(30), |_| Ok(()))
        .unwrap();
    assert!(
        t.elapsed() < Duration::from_millis(30),
        "launch must not block"
    );
    sim.stream_synchronize(s).unwrap();
    assert!(t.elapsed() >= Duration::from_millis(60));
    sim.stream_destroy(s).unwrap();
}

#[test]
fn invalid_access_is_a_sticky_error_not_a_crash() {
    let sim = sim();
    let s = sim.stream_create(D0).unwrap();
    let a = sim.malloc(D0, 8192).unwrap();
    // Past the end of the allocation (rounded to a page): a typed error.
    sim.launch_kernel(s, Duration::ZERO, move |m| m.fill(a, 8193, 1))
        .unwrap();
    // Later work still runs.
    sim.launch_kernel(s, Duration::ZERO, move |m| m.fill(a, 8192, 2))
        .unwrap();
    let err = sim.stream_synchronize(s).unwrap_err();
    assert!(matches!(err, BackendError::InvalidValue(_)), "{err:?}");
    assert_eq!(sim.kernel_failures(), 1);
    // The error was consumed.
    sim.stream_synchronize(s).unwrap();
    let mut out = [0u8; 8];
    sim.copy_from_device(s, &mut out, a).unwrap();
    assert_eq!(out, [2u8; 8]);

    // A freed pointer: the kernel gets an error instead of touching unmapped memory.
    sim.free(D0, a).unwrap();
    sim.launch_kernel(s, Duration::ZERO, move |m| m.read(a, 1).map(drop))
        .unwrap();
    assert!(sim.stream_synchronize(s).is_err());
    assert_eq!(sim.kernel_failures(), 2);

    // A panicking kernel is a failure of the stream, not of the process.
    sim.launch_kernel(s, Duration::ZERO, |_| panic!("kernel bug"))
        .unwrap();
    assert!(matches!(
        sim.stream_synchronize(s),
        Err(BackendError::Driver { .. })
    ));
    assert_eq!(sim.kernel_failures(), 3);
    sim.stream_destroy(s).unwrap();
}

#[test]
fn device_synchronize_reports_without_consuming() {
    let sim = sim();
    let s = sim.stream_create(D0).unwrap();
    sim.launch_kernel(s, Duration::ZERO, |_| Err(BackendError::invalid("bad")))
        .unwrap();
    assert_eq!(
        sim.device_synchronize(D0),
        Err(BackendError::invalid("bad"))
    );
    assert_eq!(sim.stream_synchronize(s), Err(BackendError::invalid("bad")));
    assert_eq!(sim.device_synchronize(D0), Ok(()));
    sim.stream_destroy(s).unwrap();
}

#[test]
fn kernels_respect_vmm_access() {
    let sim = sim();
    let s = sim.stream_create(D0).unwrap();
    let g = sim.vmm_granularity(D0).unwrap();
    let va = sim.va_reserve(D0, 2 * g, 0).unwrap();
    let h = sim.phys_create(D0, g).unwrap();
    // Reserved but unmapped: error.
    sim.launch_kernel(s, Duration::ZERO, move |m| m.fill(va, 16, 1))
        .unwrap();
    assert!(sim.stream_synchronize(s).is_err());
    // Mapped but no access yet: error (and no SIGSEGV).
    sim.map(va, g, 0, h).unwrap();
    sim.launch_kernel(s, Duration::ZERO, move |m| m.fill(va, 16, 1))
        .unwrap();
    assert!(sim.stream_synchronize(s).is_err());
    assert!(
        sim.memset_async(s, va, 0, 16).is_err(),
        "memset validates at enqueue"
    );
    // With access: fine, up to the end of the mapping only.
    sim.set_access(D0, va, g).unwrap();
    sim.launch_kernel(s, Duration::ZERO, move |m| m.fill(va, g, 1))
        .unwrap();
    sim.stream_synchronize(s).unwrap();
    sim.launch_kernel(s, Duration::ZERO, move |m| m.fill(va, g + 1, 1))
        .unwrap();
    assert!(sim.stream_synchronize(s).is_err());
    // After unmap: error again.
    sim.unmap(va, g).unwrap();
    sim.launch_kernel(s, Duration::ZERO, move |m| m.check(va, 1, 1).map(drop))
        .unwrap();
    assert!(sim.stream_synchronize(s).is_err());
    assert_eq!(sim.kernel_failures(), 4);
    sim.va_free(D0, va, 2 * g).unwrap();
    sim.phys_release(h).unwrap();
    sim.stream_destroy(s).unwrap();
}

#[test]
fn unknown_stream_is_an_invalid_handle() {
    let sim = sim();
    let s = sim.stream_create(D0).unwrap();
    sim.stream_destroy(s).unwrap();
    assert!(matches!(
        sim.launch_kernel(s, Duration::ZERO, |_| Ok(())),
        Err(BackendError::InvalidHandle(_))
    ));
    assert!(matches!(
        sim.stream_destroy(s),
        Err(BackendError::InvalidHandle(_))
    ));
    assert!(matches!(
        sim.stream_synchronize(s),
        Err(BackendError::InvalidHandle(_))
    ));
}
