//! End-to-end checks of the CUDA backend's less common paths (virtual memory, fd export and
//! import, pinned and registered host memory, events across streams, IPC handles, stream
//! interop). They need a GPU: without one each test prints why it skipped (and fails if
//! `GPUALLOC_REQUIRE_GPU` is set, as `scripts/gpu-check.sh` does).

use std::sync::Arc;

use gpualloc_cuda::CudaBackend;
use gpualloc_runtime::{Backend, BackendError, DeviceId, HostRegisterFlags, Stream};

const D0: DeviceId = DeviceId(0);

fn gpu() -> Option<Arc<CudaBackend>> {
    match CudaBackend::new() {
        Ok(b) => Some(b),
        Err(e) => {
            assert!(
                std::env::var_os("GPUALLOC_REQUIRE_GPU").is_none(),
                "GPUALLOC_REQUIRE_GPU is set but the CUDA backend is unavailable: {e}"
            );
            println!("skipped: {e}");
            None
        }
    }
}

fn stream(b: &Arc<CudaBackend>) -> Stream {
    let dynb: Arc<dyn Backend> = b.clone();
    Stream::new(&dynb, D0).expect("stream")
}

/// Prints the file the driver was loaded from: scripts/gpu-check.sh reads this line to check
/// that a GPU run used NVIDIA's driver (`libcuda.so.<driver version>`), not a test double.
#[test]
fn the_loaded_driver_library_is_named() {
    let Some(_b) = gpu() else { return };
    let lib = CudaBackend::driver_library().expect("the driver library's file");
    assert!(lib.is_file(), "{} is not a file", lib.display());
    println!("driver library: {}", lib.display());
}

#[test]
fn vmm_map_write_export_import_read() {
    let Some(b) = gpu() else { return };
    let g = b.vmm_granularity(D0).expect("granularity");
    assert!(g.is_power_of_two() && g >= 4096, "granularity {g}");
    let s = stream(&b);
    let size = 2 * g;
    let va = b.va_reserve(D0, 2 * size, 0).expect("reserve");
    let phys = b.phys_create(D0, size).expect("phys_create");
    assert_eq!(phys.size, size);
    b.map(va, size, 0, phys).expect("map");
    b.set_access(D0, va, size).expect("set_access");
    let pattern: Vec<u8> = (0..8192u32).map(|i| (i * 7 % 256) as u8).collect();
    b.copy_to_device(s.handle(), va, &pattern).expect("write");

    // A second mapping of the same memory, through an exported and imported fd.
    let fd = b.phys_export_fd(phys).expect("export");
    let imported = b.phys_import_fd(D0, fd).expect("import");
    let second = va.checked_add(size).expect("va");
    b.map(second, size, 0, imported).expect("map imported");
    b.set_access(D0, second, size).expect("set_access imported");
    let mut back = vec![0u8; pattern.len()];
    b.copy_from_device(s.handle(), &mut back, second)
        .expect("read");
    assert_eq!(back, pattern);

    b.unmap(second, size).expect("unmap imported");
    // Unmapping what is no longer mapped is a typed error.
    assert!(b.unmap(second, size).is_err());
    b.unmap(va, size).expect("unmap");
    b.phys_release(imported).expect("release imported");
    b.phys_release(phys).expect("release");
    b.va_free(D0, va, 2 * size).expect("va_free");
    // Not a multiple of the granularity.
    assert!(matches!(
        b.phys_create(D0, g + 1),
        Err(BackendError::InvalidValue(_))
    ));
}

#[test]
fn importing_an_fd_that_is_not_memory_fails_typed() {
    let Some(b) = gpu() else { return };
    let file = std::fs::File::open("/dev/null").expect("open");
    let r = b.phys_import_fd(D0, file.into());
    assert!(r.is_err(), "imported /dev/null: {r:?}");
}

#[test]
fn pinned_and_registered_host_memory_copy() {
    let Some(b) = gpu() else { return };
    let s = stream(&b);
    let n = 1u64 << 20;
    let pinned = b.host_alloc(n).expect("host_alloc");
    let dev = b.malloc(D0, n).expect("malloc");
    b.memset_async(s.handle(), dev, 0x5a, n).expect("memset");
    // SAFETY: `pinned` is `n` bytes from host_alloc, untouched until the sync below.
    unsafe { b.memcpy_async(s.handle(), pinned as u64, dev.0, n) }.expect("memcpy d2h");
    s.synchronize().expect("sync");
    // SAFETY: `pinned` is `n` bytes from host_alloc and the copy into it has completed.
    let host = unsafe { std::slice::from_raw_parts(pinned, n as usize) };
    assert!(host.iter().all(|&x| x == 0x5a));
    // SAFETY: from host_alloc above; `host` is not used after this and the copy is done.
    unsafe { b.host_free(pinned) }.expect("host_free");

    // The host's page: 4 KiB on x86-64, 64 KiB on some aarch64 hosts (GH200).
    let page = rustix::param::page_size();
    assert!(4 * page as u64 <= n, "the device buffer holds four pages");
    let layout = std::alloc::Layout::from_size_align(4 * page, page).expect("layout");
    // SAFETY: non-zero size layout.
    let mem = unsafe { std::alloc::alloc_zeroed(layout) };
    assert!(!mem.is_null());
    let flags = HostRegisterFlags {
        portable: true,
        ..Default::default()
    };
    // SAFETY: `mem` is 4 pages of ours, freed only after the unregister below.
    unsafe { b.host_register(mem, 4 * page as u64, flags) }.expect("register");
    // SAFETY: the registered range, untouched until the sync below.
    unsafe { b.memcpy_async(s.handle(), mem as u64, dev.0, 4 * page as u64) }
        .expect("memcpy to registered");
    s.synchronize().expect("sync");
    // SAFETY: `mem` is 4 pages we allocated; the copy into it has completed.
    let host = unsafe { std::slice::from_raw_parts(mem, 4 * page) };
    assert!(host.iter().all(|&x| x == 0x5a));
    // SAFETY: the copy into it has completed.
    unsafe { b.host_unregister(mem) }.expect("unregister");
    // SAFETY: allocated above with this layout, no longer registered or used.
    unsafe { std::alloc::dealloc(mem, layout) };
    b.free(D0, dev).expect("free");
}

#[test]
fn events_order_work_across_streams() {
    let Some(b) = gpu() else { return };
    let (s1, s2) = (stream(&b), stream(&b));
    let n = 64u64 << 20;
    let a = b.malloc(D0, n).expect("malloc a");
    let c = b.malloc(D0, n).expect("malloc c");
    b.memset_async(s1.handle(), a, 0x11, n).expect("memset");
    let ev = s1.record_event().expect("record");
    s2.wait_event(&ev).expect("wait");
    // SAFETY: device memory on both sides (checked by the backend).
    unsafe { b.memcpy_async(s2.handle(), c.0, a.0, n) }.expect("copy on s2");
    let mut back = vec![0u8; 4096];
    let last_page = c.checked_add(n - 4096).expect("ptr");
    b.copy_from_device(s2.handle(), &mut back, last_page)
        .expect("read");
    assert!(back.iter().all(|&x| x == 0x11));
    assert!(ev.query().expect("query"));
    b.free(D0, a).expect("free a");
    b.free(D0, c).expect("free c");
}

#[test]
fn ipc_handle_of_an_allocation() {
    let Some(b) = gpu() else { return };
    let p = b.malloc(D0, 2 << 20).expect("malloc");
    match b.ipc_get_mem_handle(p) {
        Ok(h) => {
            assert_ne!(h.0, [0u8; 64]);
            // The driver refuses to open a handle in the process that made it.
            assert!(b.ipc_open_mem_handle(D0, &h).is_err());
        }
        Err(e) => println!("ipc handles unsupported here: {e}"),
    }
    b.free(D0, p).expect("free");
}

#[test]
fn cudarc_streams_convert_both_ways() {
    let Some(b) = gpu() else { return };
    let ctx = b.cudarc_context(D0).expect("context");
    let theirs = ctx.new_stream().expect("cudarc stream");
    let ours = b.wrap_cudarc_stream(&theirs).expect("wrap");
    assert!(Arc::ptr_eq(
        &b.to_cudarc_stream(&ours).expect("back"),
        &theirs
    ));
    drop(theirs);
    // Our wrapper keeps the stream alive after cudarc's handle is gone.
    ours.synchronize()
        .expect("sync after cudarc dropped its Arc");
    let h = ours.handle();
    drop(ours);
    assert!(matches!(
        b.stream_synchronize(h),
        Err(BackendError::InvalidHandle(_))
    ));
}
