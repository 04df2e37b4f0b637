//! Bad input gets a typed error before any driver call: these run on a backend that has never
//! touched the driver, so they pass on machines without a GPU (and with one).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use super::CudaBackend;
use gpualloc_runtime::error::BackendError;
use gpualloc_runtime::types::{
    DeviceId, DevicePtr, EventHandle, HostRegisterFlags, PhysHandle, StreamHandle,
};
use gpualloc_runtime::Backend;

const D0: DeviceId = DeviceId(0);
const G: u64 = 2 << 20;

fn detached() -> CudaBackend {
    CudaBackend::with_devices(2)
}

fn invalid<T: std::fmt::Debug>(r: gpualloc_runtime::Result<T>) {
    assert!(
        matches!(r, Err(BackendError::InvalidValue(_))),
        "expected InvalidValue, got {r:?}"
    );
}

fn bad_handle<T: std::fmt::Debug>(r: gpualloc_runtime::Result<T>) {
    assert!(
        matches!(r, Err(BackendError::InvalidHandle(_))),
        "expected InvalidHandle, got {r:?}"
    );
}

#[test]
fn identity() {
    let b = detached();
    assert_eq!(b.name(), "cuda");
    assert_eq!(b.device_count(), Ok(2));
}

#[test]
fn device_memory_input() {
    let b = detached();
    assert_eq!(
        b.malloc(DeviceId(2), 1 << 20),
        Err(BackendError::InvalidDevice(2))
    );
    invalid(b.malloc(D0, 0));
    invalid(b.free(D0, DevicePtr(0)));
    assert_eq!(
        b.free(DeviceId(9), DevicePtr(0x1000)),
        Err(BackendError::InvalidDevice(9))
    );
    assert_eq!(b.mem_info(DeviceId(3)), Err(BackendError::InvalidDevice(3)));
}

#[test]
fn unknown_streams_and_events() {
    let b = detached();
    let s = StreamHandle {
        device: D0,
        raw: 0xdead,
    };
    let e = EventHandle {
        device: D0,
        raw: 0xbeef,
    };
    bad_handle(b.stream_destroy(s));
    bad_handle(b.stream_synchronize(s));
    bad_handle(b.stream_wait_event(s, e));
    bad_handle(b.event_query(e));
    bad_handle(b.event_synchronize(e));
    bad_handle(b.event_destroy(e));
    bad_handle(b.event_record(e, s));
    // SAFETY: no driver: refused before any call, nothing is touched.
    bad_handle(unsafe { b.memcpy_async(s, 0x1000, 0x2000, 64) });
    bad_handle(b.memset_async(s, DevicePtr(0x1000), 0, 64));
    bad_handle(b.copy_to_device(s, DevicePtr(0x1000), &[1, 2, 3]));
    bad_handle(b.copy_from_device(s, &mut [0; 3], DevicePtr(0x1000)));
    bad_handle(b.cudarc_stream(s));
}

#[test]
fn an_event_of_another_device() {
    let b = detached();
    let s = StreamHandle { device: D0, raw: 1 };
    let e = EventHandle {
        device: DeviceId(1),
        raw: 2,
    };
    invalid(b.event_record(e, s));
}

#[test]
fn a_refused_host_func_is_freed_not_leaked() {
    let b = detached();
    let hits = Arc::new(AtomicUsize::new(0));
    let h = hits.clone();
    let s = StreamHandle {
        device: D0,
        raw: 0xdead,
    };
    bad_handle(b.launch_host_func(
        s,
        Box::new(move |_| {
            h.fetch_add(1, Ordering::SeqCst);
        }),
    ));
    assert_eq!(hits.load(Ordering::SeqCst), 0);
    assert_eq!(Arc::strong_count(&hits), 1);
}

#[test]
fn copies() {
    let b = detached();
    let s = StreamHandle {
        device: D0,
        raw: 0xdead,
    };
    // Empty copies are no-ops, as in CUDA (even on an unknown stream: nothing is enqueued).
    // SAFETY: no driver: refused before any call, nothing is touched.
    assert_eq!(unsafe { b.memcpy_async(s, 0x1000, 0x2000, 0) }, Ok(()));
    assert_eq!(b.memset_async(s, DevicePtr(0x1000), 7, 0), Ok(()));
    assert_eq!(b.copy_to_device(s, DevicePtr(0x1000), &[]), Ok(()));
    assert_eq!(b.copy_from_device(s, &mut [], DevicePtr(0x1000)), Ok(()));
    // SAFETY: no driver: refused before any call, nothing is touched.
    invalid(unsafe { b.memcpy_async(s, u64::MAX - 8, 0x2000, 64) });
    // SAFETY: no driver: refused before any call, nothing is touched.
    invalid(unsafe { b.memcpy_async(s, 0x1000, 0, 64) });
    invalid(b.memset_async(s, DevicePtr(0), 0, 64));
    invalid(b.copy_to_device(s, DevicePtr(u64::MAX), &[1, 2]));
    invalid(b.copy_from_device(s, &mut [0; 2], DevicePtr(0)));
}

#[test]
fn host_memory_input() {
    let b = detached();
    invalid(b.host_alloc(0));
    // SAFETY: no driver: refused before any call, nothing is touched.
    invalid(unsafe { b.host_free(std::ptr::null_mut()) });
    // SAFETY: no driver: refused before any call, nothing is touched.
    invalid(unsafe { b.host_unregister(std::ptr::null_mut()) });
    let f = HostRegisterFlags::default();
    // SAFETY: no driver: refused before any call, nothing is touched.
    invalid(unsafe { b.host_register(std::ptr::null_mut(), 4096, f) });
    // SAFETY: no driver: refused before any call, nothing is touched.
    invalid(unsafe { b.host_register(0x10000 as *mut u8, 0, f) });
    // SAFETY: as above (a range that wraps).
    invalid(unsafe { b.host_register((u64::MAX - 100) as usize as *mut u8, 4096, f) });
    // (An unaligned range is the driver's to take: it asks for no alignment.)
}

#[test]
fn virtual_memory_input() {
    let b = detached();
    invalid(b.va_reserve(D0, 0, 0));
    invalid(b.va_reserve(D0, G, 3 << 20));
    assert_eq!(
        b.va_reserve(DeviceId(2), G, 0),
        Err(BackendError::InvalidDevice(2))
    );
    invalid(b.va_free(D0, DevicePtr(0x1000), 0));
    invalid(b.va_free(D0, DevicePtr(0), G));
    invalid(b.phys_create(D0, 0));
    assert_eq!(
        b.vmm_granularity(DeviceId(2)),
        Err(BackendError::InvalidDevice(2))
    );
    let null = PhysHandle {
        device: D0,
        raw: 0,
        size: G,
    };
    bad_handle(b.phys_release(null));
    bad_handle(b.phys_export_fd(null));
    bad_handle(b.map(DevicePtr(G), G, 0, null));
    let h = PhysHandle {
        device: D0,
        raw: 1,
        size: G,
    };
    invalid(b.map(DevicePtr(G), 0, 0, h));
    invalid(b.map(DevicePtr(0), G, 0, h));
    invalid(b.map(DevicePtr(u64::MAX - G + 2), G, 0, h));
    // cuMemMap's offset "currently must be zero": refused before the driver is asked.
    let two = PhysHandle { size: 2 * G, ..h };
    invalid(b.map(DevicePtr(G), G, G, two));
    invalid(b.unmap(DevicePtr(G), 0));
    invalid(b.unmap(DevicePtr(u64::MAX), G));
    invalid(b.set_access(D0, DevicePtr(G), 0));
    invalid(b.set_access(D0, DevicePtr(0), G));
    assert_eq!(
        b.set_access(DeviceId(4), DevicePtr(G), G),
        Err(BackendError::InvalidDevice(4))
    );
}

#[test]
fn ipc_input() {
    let b = detached();
    invalid(b.ipc_get_mem_handle(DevicePtr(0)));
    invalid(b.ipc_close_mem_handle(DevicePtr(0)));
    let h = gpualloc_runtime::types::IpcMemHandle([0; 64]);
    assert_eq!(
        b.ipc_open_mem_handle(DeviceId(2), &h),
        Err(BackendError::InvalidDevice(2))
    );
}

#[test]
fn without_a_driver_valid_calls_fail_typed_not_panic() {
    if CudaBackend::driver_present() {
        println!("skipped: a CUDA driver is present on this machine");
        return;
    }
    let b = detached();
    // These pass validation and reach the driver layer, where cudarc would panic.
    for r in [
        b.mem_info(D0).map(|_| ()),
        b.malloc(D0, 4096).map(|_| ()),
        b.device_synchronize(D0),
    ] {
        assert!(matches!(r, Err(BackendError::Unavailable(_))), "got {r:?}");
    }
    assert!(matches!(
        b.cudarc_context(D0),
        Err(BackendError::Unavailable(_))
    ));
}
