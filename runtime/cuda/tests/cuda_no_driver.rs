//! `CudaBackend::new()` on whatever machine runs the tests: without a driver or a GPU it must
//! return the typed `Unavailable` error (never panic); with a GPU it must work, and a short
//! smoke test runs. The test prints which case it saw; with `GPUALLOC_REQUIRE_GPU` set (as
//! `scripts/gpu-check.sh` does) the no-GPU case fails instead.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use gpualloc_cuda::CudaBackend;
use gpualloc_runtime::{Backend, BackendError, DeviceId, Stream};

#[test]
fn new_is_typed_unavailable_without_a_gpu_and_ok_with_one() {
    let first = CudaBackend::new();
    match &first {
        Err(BackendError::Unavailable(msg)) => {
            println!("no GPU here: CudaBackend::new() -> Unavailable({msg:?})");
            // scripts/gpu-check.sh sets this on GPU machines, where a skip would hide a bug.
            assert!(
                std::env::var_os("GPUALLOC_REQUIRE_GPU").is_none(),
                "GPUALLOC_REQUIRE_GPU is set but the CUDA backend is unavailable: {msg}"
            );
            assert!(
                msg.starts_with("no CUDA driver found")
                    || msg.starts_with("no CUDA device")
                    || msg.starts_with("CUDA driver failed to initialize"),
                "unexpected message {msg:?}"
            );
            if !CudaBackend::driver_present() {
                assert!(msg.starts_with("no CUDA driver found"), "{msg}");
            }
            // Asking again gives the same answer (no half-initialized global state, no panic).
            assert_eq!(CudaBackend::new().err(), first.clone().err());
        }
        Ok(b) => {
            let n = b.device_count().expect("device_count");
            println!("GPU present: CudaBackend::new() -> Ok with {n} device(s)");
            assert!(n >= 1);
            smoke(b);
        }
        Err(e) => panic!("CudaBackend::new() failed with a non-Unavailable error: {e}"),
    }
}

/// A few operations end to end on device 0 (only runs where a GPU is present).
fn smoke(b: &Arc<CudaBackend>) {
    let d = DeviceId(0);
    let info = b.mem_info(d).expect("mem_info");
    assert!(info.total > 0 && info.free <= info.total);
    let dynb: Arc<dyn Backend> = b.clone();
    let s = Stream::new(&dynb, d).expect("stream");
    let p = b.malloc(d, 1 << 20).expect("malloc");
    let src: Vec<u8> = (0..4096u32).map(|i| (i % 251) as u8).collect();
    b.copy_to_device(s.handle(), p, &src)
        .expect("copy_to_device");
    b.memset_async(s.handle(), p, 0xab, 16).expect("memset");
    let mut back = vec![0u8; 4096];
    b.copy_from_device(s.handle(), &mut back, p)
        .expect("copy_from_device");
    assert!(back[..16].iter().all(|&x| x == 0xab));
    assert_eq!(back[16..], src[16..]);

    let hits = Arc::new(AtomicUsize::new(0));
    let h = hits.clone();
    b.launch_host_func(
        s.handle(),
        Box::new(move |_| {
            h.fetch_add(1, Ordering::SeqCst);
        }),
    )
    .expect("launch_host_func");
    let ev = s.record_event().expect("record_event");
    ev.synchronize().expect("event sync");
    assert!(ev.query().expect("query"));
    s.synchronize().expect("stream sync");
    assert_eq!(hits.load(Ordering::SeqCst), 1);

    // Interop: our stream as cudarc's and back.
    let theirs = b.to_cudarc_stream(&s).expect("to_cudarc_stream");
    let again = b.wrap_cudarc_stream(&theirs).expect("wrap_cudarc_stream");
    assert_eq!(again.handle(), s.handle());
    drop(again);
    s.synchronize().expect("still alive after the wrapper went");
    b.free(d, p).expect("free");
    assert!(matches!(b.malloc(d, 0), Err(BackendError::InvalidValue(_))));
}
