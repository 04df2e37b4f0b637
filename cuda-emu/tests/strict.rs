//! The emulator refuses what the driver refuses: one test per rule. Each test binds the
//! device's primary context on its own thread (tests run in parallel threads).

use std::ffi::c_void;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::mpsc;

mod common;

use common::{bind, hold, stream_with};
use gpualloc_cuda_emu::*;

const MIB: usize = 1 << 20;

fn alloc(bytes: usize) -> (CUresult, CUdeviceptr) {
    let mut p = 0;
    // SAFETY: a valid out-pointer.
    let r = unsafe { cuMemAlloc_v2(&mut p, bytes) };
    (r, p)
}

/// A non-blocking stream of the current context.
fn stream() -> CUstream {
    stream_with(CU_STREAM_NON_BLOCKING)
}

#[test]
fn a_thread_without_a_current_context_gets_invalid_context() {
    assert_eq!(cuInit(0), CUDA_SUCCESS);
    std::thread::spawn(|| {
        assert_eq!(alloc(4096).0, CUDA_ERROR_INVALID_CONTEXT);
        assert_eq!(cuCtxSynchronize(), CUDA_ERROR_INVALID_CONTEXT);
        // A context value that is not one of ours.
        assert_eq!(
            cuCtxSetCurrent(0x42 as CUcontext),
            CUDA_ERROR_INVALID_CONTEXT
        );
        let ctx = bind();
        let (r, p) = alloc(4096);
        assert_eq!(r, CUDA_SUCCESS);
        assert_eq!(cuMemFree_v2(p), CUDA_SUCCESS);
        // Unbound again (null), the thread has no context.
        assert_eq!(cuCtxSetCurrent(std::ptr::null_mut()), CUDA_SUCCESS);
        assert_eq!(alloc(4096).0, CUDA_ERROR_INVALID_CONTEXT);
        assert_eq!(cuCtxSetCurrent(ctx), CUDA_SUCCESS);
    })
    .join()
    .unwrap();
}

#[test]
fn freeing_an_unknown_pointer_or_twice_is_invalid_value() {
    std::thread::spawn(|| {
        bind();
        let (r, p) = alloc(MIB);
        assert_eq!(r, CUDA_SUCCESS);
        assert_eq!(
            cuMemFree_v2(p + 4096),
            CUDA_ERROR_INVALID_VALUE,
            "not a base"
        );
        assert_eq!(cuMemFree_v2(p), CUDA_SUCCESS);
        assert_eq!(cuMemFree_v2(p), CUDA_ERROR_INVALID_VALUE, "twice");
        assert_eq!(cuMemFree_v2(0xdead_0000), CUDA_ERROR_INVALID_VALUE);
        assert_eq!(alloc(0).0, CUDA_ERROR_INVALID_VALUE);
    })
    .join()
    .unwrap();
}

#[test]
fn event_query_is_not_ready_until_the_stream_passes_it() {
    std::thread::spawn(|| {
        bind();
        let s = stream();
        let mut e: CUevent = std::ptr::null_mut();
        // SAFETY: a valid out-pointer.
        assert_eq!(unsafe { cuEventCreate(&mut e, 2) }, CUDA_SUCCESS);
        assert_eq!(cuEventQuery(e), CUDA_SUCCESS, "never recorded: complete");
        let gate = hold(s);
        assert_eq!(cuEventRecord(e, s), CUDA_SUCCESS);
        assert_eq!(cuEventQuery(e), CUDA_ERROR_NOT_READY);
        assert_eq!(cuStreamQuery(s), CUDA_ERROR_NOT_READY);
        drop(gate);
        assert_eq!(cuEventSynchronize(e), CUDA_SUCCESS);
        assert_eq!(cuEventQuery(e), CUDA_SUCCESS);
        assert_eq!(cuEventDestroy_v2(e), CUDA_SUCCESS);
        assert_eq!(cuEventQuery(e), CUDA_ERROR_INVALID_HANDLE);
        assert_eq!(cuStreamDestroy_v2(s), CUDA_SUCCESS);
    })
    .join()
    .unwrap();
}

#[test]
fn a_host_function_may_not_call_the_driver() {
    static SEEN: AtomicU32 = AtomicU32::new(u32::MAX);
    unsafe extern "C" fn calls_cuda(_: *mut c_void) {
        let mut p = 0;
        // SAFETY: a valid out-pointer.
        SEEN.store(unsafe { cuMemAlloc_v2(&mut p, 4096) }, Ordering::SeqCst);
    }
    std::thread::spawn(|| {
        bind();
        let s = stream();
        assert_eq!(
            cuLaunchHostFunc(s, Some(calls_cuda), std::ptr::null_mut()),
            CUDA_SUCCESS
        );
        assert_eq!(cuStreamSynchronize(s), CUDA_SUCCESS);
        assert_eq!(SEEN.load(Ordering::SeqCst), CUDA_ERROR_NOT_PERMITTED);
        assert_eq!(
            cuLaunchHostFunc(s, None, std::ptr::null_mut()),
            CUDA_ERROR_INVALID_VALUE
        );
        assert_eq!(cuStreamDestroy_v2(s), CUDA_SUCCESS);
    })
    .join()
    .unwrap();
}

fn prop() -> CUmemAllocationProp {
    CUmemAllocationProp {
        type_: 1,
        requested_handle_types: 1,
        location: CUmemLocation { type_: 1, id: 0 },
        win32_handle_meta_data: std::ptr::null_mut(),
        alloc_flags: [0; 8],
    }
}

/// The VMM granularity for `p`.
fn granularity(p: &CUmemAllocationProp) -> usize {
    let mut gran = 0usize;
    // SAFETY: valid pointers.
    let r = unsafe { cuMemGetAllocationGranularity(&mut gran, p, 0) };
    assert_eq!(r, CUDA_SUCCESS);
    gran
}

#[test]
fn vmm_sizes_unmaps_access_and_deferred_release_follow_the_driver() {
    std::thread::spawn(|| {
        bind();
        let p = prop();
        let gran = granularity(&p);
        // SAFETY: valid pointers for every call below.
        unsafe {
            let mut h = 0u64;
            assert_eq!(
                cuMemCreate(&mut h, gran / 2, &p, 0),
                CUDA_ERROR_INVALID_VALUE
            );
            assert_eq!(cuMemCreate(&mut h, 2 * gran, &p, 0), CUDA_SUCCESS);
            let mut va = 0u64;
            assert_eq!(
                cuMemAddressReserve(&mut va, 4 * gran, 0, 0, 0),
                CUDA_SUCCESS
            );
            assert_eq!(
                cuMemMap(va + 4096, 2 * gran, 0, h, 0),
                CUDA_ERROR_INVALID_VALUE,
                "unaligned"
            );
            // "offset ... currently must be zero".
            assert_eq!(
                cuMemMap(va, gran, gran, h, 0),
                CUDA_ERROR_INVALID_VALUE,
                "a non-zero offset"
            );
            assert_eq!(cuMemMap(va, 2 * gran, 0, h, 0), CUDA_SUCCESS);
            // (Work on it before cuMemSetAccess is a sticky fault: tests/device_faults.rs.)
            let mut host = vec![0u8; 16];
            let desc = CUmemAccessDesc {
                location: CUmemLocation { type_: 1, id: 0 },
                flags: 3,
            };
            assert_eq!(cuMemSetAccess(va, 2 * gran, &desc, 1), CUDA_SUCCESS);
            assert_eq!(
                cuMemsetD8Async(va, 0x5a, 16, std::ptr::null_mut()),
                CUDA_SUCCESS
            );
            // Released while mapped: deferred until the unmap, the memory stays usable.
            assert_eq!(cuMemRelease(h), CUDA_SUCCESS);
            assert_eq!(
                cuMemcpyDtoHAsync_v2(host.as_mut_ptr().cast(), va, 16, std::ptr::null_mut()),
                CUDA_SUCCESS
            );
            assert_eq!(host, vec![0x5a; 16]);
            assert_eq!(cuMemRelease(h), CUDA_ERROR_INVALID_VALUE, "released twice");
            // Unmapping only part of a mapping is refused.
            assert_ne!(cuMemUnmap(va, gran), CUDA_SUCCESS);
            assert_eq!(cuMemUnmap(va, 2 * gran), CUDA_SUCCESS);
            assert_eq!(cuMemAddressFree(va, 4 * gran), CUDA_SUCCESS);
        }
    })
    .join()
    .unwrap();
}

#[test]
fn unimplemented_functions_are_not_supported_never_silent() {
    assert_eq!(cuInit(0), CUDA_SUCCESS);
    assert_eq!(cuLaunchKernel(), CUDA_ERROR_NOT_SUPPORTED);
    assert_eq!(cuModuleLoadData(), CUDA_ERROR_NOT_SUPPORTED);
    assert_eq!(cuMemAllocAsync(), CUDA_ERROR_NOT_SUPPORTED);
}

#[test]
fn an_ipc_handle_cannot_be_opened_by_the_process_that_made_it() {
    std::thread::spawn(|| {
        bind();
        let (r, p) = alloc(2 * MIB);
        assert_eq!(r, CUDA_SUCCESS);
        let mut h = CUipcMemHandle { reserved: [0; 64] };
        let mut opened = 0u64;
        // SAFETY: valid out-pointers.
        unsafe {
            assert_eq!(cuIpcGetMemHandle(&mut h, p), CUDA_SUCCESS);
            assert_eq!(
                cuIpcOpenMemHandle_v2(&mut opened, h, 1),
                CUDA_ERROR_INVALID_CONTEXT
            );
            assert_eq!(
                cuIpcGetMemHandle(&mut h, p + 4096 * 1024 * 1024),
                CUDA_ERROR_INVALID_VALUE
            );
            // "a pointer to the base of an existing device memory allocation": not inside.
            assert_eq!(
                cuIpcGetMemHandle(&mut h, p + 4096),
                CUDA_ERROR_INVALID_VALUE
            );
        }
        assert_eq!(cuMemFree_v2(p), CUDA_SUCCESS);
    })
    .join()
    .unwrap();
}

#[test]
fn vmm_reservations_and_access_need_granular_mapped_ranges() {
    std::thread::spawn(|| {
        bind();
        let p = prop();
        let gran = granularity(&p);
        // SAFETY: valid pointers for every call below.
        unsafe {
            let mut va = 0u64;
            assert_eq!(
                cuMemAddressReserve(&mut va, gran + 4096, 0, 0, 0),
                CUDA_ERROR_INVALID_VALUE,
                "size not a multiple of the granularity"
            );
            assert_eq!(
                cuMemAddressReserve(&mut va, 2 * gran, 0, 0, 0),
                CUDA_SUCCESS
            );
            let desc = CUmemAccessDesc {
                location: CUmemLocation { type_: 1, id: 0 },
                flags: 3,
            };
            assert_ne!(
                cuMemSetAccess(va, gran, &desc, 1),
                CUDA_SUCCESS,
                "access to a range with nothing mapped"
            );
            assert_eq!(
                cuMemAddressFree(va + 4096, 2 * gran),
                CUDA_ERROR_INVALID_VALUE
            );
            assert_eq!(cuMemAddressFree(va, 2 * gran), CUDA_SUCCESS);
            assert_eq!(
                cuMemAddressFree(va, 2 * gran),
                CUDA_ERROR_INVALID_VALUE,
                "twice"
            );
        }
    })
    .join()
    .unwrap();
}

/// `CU_STREAM_PER_THREAD` names each thread's own stream: work held on one thread's does not
/// hold another thread's.
#[test]
fn per_thread_default_streams_are_per_thread() {
    // `CU_STREAM_PER_THREAD`, made on each thread (a raw pointer is not `Send`).
    let per_thread = || 0x2 as CUstream;
    let (ready_tx, ready_rx) = mpsc::channel();
    let (done_tx, done_rx) = mpsc::channel::<()>();
    let holder = std::thread::spawn(move || {
        bind();
        let gate = hold(per_thread());
        ready_tx.send(()).unwrap();
        let _ = done_rx.recv();
        drop(gate);
        assert_eq!(cuStreamSynchronize(per_thread()), CUDA_SUCCESS);
    });
    ready_rx.recv().unwrap();
    std::thread::spawn(move || {
        bind();
        // This thread's per-thread stream is idle: synchronizing it returns at once.
        assert_eq!(cuStreamSynchronize(per_thread()), CUDA_SUCCESS);
        assert_eq!(cuStreamQuery(per_thread()), CUDA_SUCCESS);
    })
    .join()
    .unwrap();
    done_tx.send(()).unwrap();
    holder.join().unwrap();
}
