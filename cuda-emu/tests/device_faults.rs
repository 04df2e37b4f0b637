//! Work a GPU turns into a sticky fault, and what one process's memory means to another: each
//! scenario in a process of its own (a sticky error lasts for the life of the process).
//!
//! - work on freed memory, on a reserved but unmapped range, or on a mapping the device was
//!   not given access to is `CUDA_ERROR_ILLEGAL_ADDRESS`, and every later call in that
//!   context fails with it, even after the primary context is released and retained again;
//! - calls on a stream or event report its own context's sticky error, whichever context is
//!   current; an event is recorded only on a stream of its own device, and a launch goes only
//!   to a stream of the current context;
//! - an exporter's `cuMemFree` of an allocation another process has open through its IPC
//!   handle (undefined behaviour on the driver) aborts the exporter;
//! - `cuStreamDestroy` with work queued returns at once, the work still runs, and the handle
//!   is gone (in a process of its own: the driver reuses a destroyed handle's value, which a
//!   test on another thread could take at once).

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};

mod common;

use common::bind;
use gpualloc_cuda_emu::*;

const ROLE: &str = "GPUALLOC_EMU_DEVICE_FAULTS_ROLE";
const MIB: usize = 1 << 20;

fn alloc(bytes: usize) -> CUdeviceptr {
    let mut p = 0;
    // SAFETY: a valid out-pointer.
    assert_eq!(unsafe { cuMemAlloc_v2(&mut p, bytes) }, CUDA_SUCCESS);
    p
}

/// After a fault: every call needing the context fails with `code`, a release and a retain
/// of the primary context do not clear it.
fn sticky_for_good(code: CUresult) {
    let mut p = 0;
    // SAFETY: valid out-pointers.
    unsafe {
        assert_eq!(cuMemAlloc_v2(&mut p, 4096), code);
        assert_eq!(cuCtxSynchronize(), code);
        assert_eq!(cuDevicePrimaryCtxRelease_v2(0), CUDA_SUCCESS);
        let mut ctx: CUcontext = std::ptr::null_mut();
        assert_eq!(cuDevicePrimaryCtxRetain(&mut ctx, 0), CUDA_SUCCESS);
        assert_eq!(cuCtxSetCurrent(ctx), CUDA_SUCCESS);
        assert_eq!(cuMemAlloc_v2(&mut p, 4096), code, "relaunch, not release");
    }
}

fn vmm_prop(device: i32) -> CUmemAllocationProp {
    CUmemAllocationProp {
        type_: 1,
        requested_handle_types: 1,
        location: CUmemLocation {
            type_: 1,
            id: device,
        },
        win32_handle_meta_data: std::ptr::null_mut(),
        alloc_flags: [0; 8],
    }
}

/// A reservation of `2 * gran` bytes with one granule mapped (no access set yet).
fn half_mapped() -> (CUdeviceptr, usize) {
    let p = vmm_prop(0);
    let mut gran = 0usize;
    let (mut h, mut va) = (0u64, 0u64);
    // SAFETY: valid pointers.
    unsafe {
        assert_eq!(
            cuMemGetAllocationGranularity(&mut gran, &p, 0),
            CUDA_SUCCESS
        );
        assert_eq!(cuMemCreate(&mut h, gran, &p, 0), CUDA_SUCCESS);
        assert_eq!(
            cuMemAddressReserve(&mut va, 2 * gran, 0, 0, 0),
            CUDA_SUCCESS
        );
        assert_eq!(cuMemMap(va, gran, 0, h, 0), CUDA_SUCCESS);
    }
    (va, gran)
}

fn grant(va: CUdeviceptr, len: usize, device: i32) {
    let desc = CUmemAccessDesc {
        location: CUmemLocation {
            type_: 1,
            id: device,
        },
        flags: 3,
    };
    // SAFETY: a valid descriptor.
    assert_eq!(unsafe { cuMemSetAccess(va, len, &desc, 1) }, CUDA_SUCCESS);
}

/// Binds device `d`'s primary context on this thread.
fn bind_device(d: i32) -> CUcontext {
    let mut ctx: CUcontext = std::ptr::null_mut();
    // SAFETY: a valid out-pointer.
    assert_eq!(
        unsafe { cuDevicePrimaryCtxRetain(&mut ctx, d) },
        CUDA_SUCCESS
    );
    assert_eq!(cuCtxSetCurrent(ctx), CUDA_SUCCESS);
    ctx
}

fn child(role: &str) {
    let null = std::ptr::null_mut();
    match role {
        "freed" => {
            bind();
            let p = alloc(MIB);
            assert_eq!(cuMemsetD8Async(p, 1, 4096, null), CUDA_SUCCESS);
            assert_eq!(cuMemFree_v2(p), CUDA_SUCCESS);
            assert_eq!(
                cuMemsetD8Async(p, 1, 4096, null),
                CUDA_ERROR_ILLEGAL_ADDRESS
            );
            sticky_for_good(CUDA_ERROR_ILLEGAL_ADDRESS);
        }
        "unmapped" => {
            bind();
            let (va, gran) = half_mapped();
            grant(va, gran, 0);
            let mut host = vec![0u8; 16];
            // SAFETY: `host` is writable for 16 bytes.
            unsafe {
                let mapped = cuMemcpyDtoHAsync_v2(host.as_mut_ptr().cast(), va, 16, null);
                assert_eq!(mapped, CUDA_SUCCESS);
                let beyond =
                    cuMemcpyDtoHAsync_v2(host.as_mut_ptr().cast(), va + gran as u64, 16, null);
                assert_eq!(beyond, CUDA_ERROR_ILLEGAL_ADDRESS);
            }
            sticky_for_good(CUDA_ERROR_ILLEGAL_ADDRESS);
        }
        "no-access" => {
            bind();
            let (va, _) = half_mapped();
            assert_eq!(cuMemsetD8Async(va, 1, 16, null), CUDA_ERROR_ILLEGAL_ADDRESS);
            sticky_for_good(CUDA_ERROR_ILLEGAL_ADDRESS);
        }
        "per-object" => {
            assert_eq!(cuInit(0), CUDA_SUCCESS);
            let ctx1 = bind_device(1);
            let s1 = common::stream_with(CU_STREAM_NON_BLOCKING);
            let e1 = common::event();
            let p1 = alloc(MIB);
            bind_device(0);
            let s0 = common::stream_with(CU_STREAM_NON_BLOCKING);
            let e0 = common::event();
            // An event is recorded only on a stream of its own device.
            assert_eq!(cuEventRecord(e0, s1), CUDA_ERROR_INVALID_HANDLE);
            assert_eq!(cuEventRecord(e0, s0), CUDA_SUCCESS);
            // Waits may cross devices (the programming guide: they "can therefore be used to
            // synchronize multiple devices with each other").
            assert_eq!(cuStreamWaitEvent(s0, e1, 0), CUDA_SUCCESS);
            // A launch goes only to a stream of the current context.
            unsafe extern "C" fn nothing(_: *mut std::ffi::c_void) {}
            assert_eq!(
                cuLaunchHostFunc(s1, Some(nothing), null.cast()),
                CUDA_ERROR_INVALID_HANDLE
            );
            // Device 1 faults; device 0 is current: calls on device 1's objects report
            // device 1's error, device 0's own work goes on.
            // The fault: work on device 1's freed memory, which no live allocation can cover
            // (none is made after the free). An address past the end of a live allocation
            // could fall in another one, such as a context's memory, depending on where the
            // kernel placed the mappings: that failed a CI run.
            assert_eq!(cuCtxSetCurrent(ctx1), CUDA_SUCCESS);
            assert_eq!(cuMemFree_v2(p1), CUDA_SUCCESS);
            assert_eq!(cuMemsetD8Async(p1, 0, 16, s1), CUDA_ERROR_ILLEGAL_ADDRESS);
            bind_device(0);
            assert_eq!(cuStreamSynchronize(s1), CUDA_ERROR_ILLEGAL_ADDRESS);
            assert_eq!(cuStreamQuery(s1), CUDA_ERROR_ILLEGAL_ADDRESS);
            assert_eq!(cuEventQuery(e1), CUDA_ERROR_ILLEGAL_ADDRESS);
            assert_eq!(cuStreamWaitEvent(s0, e1, 0), CUDA_ERROR_ILLEGAL_ADDRESS);
            assert_eq!(cuEventRecord(e0, s0), CUDA_SUCCESS);
            assert_eq!(cuStreamSynchronize(s0), CUDA_SUCCESS);
            let p0 = alloc(MIB);
            assert_eq!(cuMemsetD8Async(p0, 1, 16, s0), CUDA_SUCCESS);
            assert_eq!(cuMemFree_v2(p0), CUDA_SUCCESS);
        }
        // Docs of `cuStreamDestroy`: with work still queued "the function will return
        // immediately and the resources associated with hStream will be released
        // automatically once the device has completed all work in hStream".
        "destroy" => {
            static RAN: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
            unsafe extern "C" fn mark(_: *mut std::ffi::c_void) {
                std::thread::sleep(std::time::Duration::from_millis(200));
                RAN.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            }
            bind();
            let s = common::stream_with(CU_STREAM_NON_BLOCKING);
            assert_eq!(cuLaunchHostFunc(s, Some(mark), null.cast()), CUDA_SUCCESS);
            let t = std::time::Instant::now();
            assert_eq!(cuStreamDestroy_v2(s), CUDA_SUCCESS);
            assert!(
                t.elapsed() < std::time::Duration::from_millis(150),
                "cuStreamDestroy waited for the stream's work"
            );
            assert_eq!(cuStreamSynchronize(s), CUDA_ERROR_INVALID_HANDLE, "gone");
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
            while RAN.load(std::sync::atomic::Ordering::SeqCst) == 0
                && std::time::Instant::now() < deadline
            {
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            assert_eq!(
                RAN.load(std::sync::atomic::Ordering::SeqCst),
                1,
                "the queued work still ran"
            );
        }
        // Exports an allocation to an importer (a child of this process), which opens it
        // and says so; then frees it while the importer has it open, or once it closed it
        // when `GPUALLOC_EMU_TEST_CLOSE_FIRST` is set.
        "exporter" => {
            bind();
            let p = alloc(2 * MIB);
            let mut h = CUipcMemHandle { reserved: [0; 64] };
            // SAFETY: a valid out-pointer.
            assert_eq!(unsafe { cuIpcGetMemHandle(&mut h, p) }, CUDA_SUCCESS);
            let hex: String = h.reserved.iter().map(|b| format!("{b:02x}")).collect();
            let mut importer = Command::new(std::env::current_exe().unwrap())
                .args(["--exact", "child_entry", "--nocapture", "--test-threads=1"])
                .env(ROLE, "importer")
                .env("GPUALLOC_EMU_TEST_HANDLE", hex)
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .spawn()
                .unwrap();
            let mut out = BufReader::new(importer.stdout.take().unwrap());
            let mut stdin = importer.stdin.take().unwrap();
            let mut line = String::new();
            while !line.contains("opened") {
                line.clear();
                assert!(out.read_line(&mut line).unwrap() > 0, "importer ended");
            }
            if std::env::var_os("GPUALLOC_EMU_TEST_CLOSE_FIRST").is_some() {
                writeln!(stdin, "close").unwrap();
                line.clear();
                while !line.contains("closed") {
                    line.clear();
                    assert!(out.read_line(&mut line).unwrap() > 0, "importer ended");
                }
            }
            let freed = cuMemFree_v2(p);
            println!("freed {freed}");
            drop(stdin);
            assert!(importer.wait().unwrap().success());
            assert_eq!(freed, CUDA_SUCCESS);
        }
        "importer" => {
            bind();
            let hex = std::env::var("GPUALLOC_EMU_TEST_HANDLE").unwrap();
            let mut h = CUipcMemHandle { reserved: [0; 64] };
            for (i, b) in h.reserved.iter_mut().enumerate() {
                *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap();
            }
            let mut p = 0u64;
            // SAFETY: a valid out-pointer.
            assert_eq!(unsafe { cuIpcOpenMemHandle_v2(&mut p, h, 1) }, CUDA_SUCCESS);
            println!("opened");
            let mut line = String::new();
            let _ = std::io::stdin().read_line(&mut line);
            if line.contains("close") {
                assert_eq!(cuIpcCloseMemHandle(p), CUDA_SUCCESS);
                println!("closed");
                let _ = std::io::stdin().read_line(&mut line);
            }
        }
        other => panic!("unknown role {other}"),
    }
}

#[test]
fn child_entry() {
    if let Ok(role) = std::env::var(ROLE) {
        child(&role);
    }
}

fn run(role: &str, env: &[(&str, &str)]) -> std::process::Output {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(["--exact", "child_entry", "--nocapture", "--test-threads=1"])
        .env(ROLE, role)
        .env("GPUALLOC_EMU_DEVICES", "2");
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().unwrap()
}

fn passes(role: &str) {
    let out = run(role, &[]);
    assert!(
        out.status.success(),
        "{role}: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn work_on_freed_memory_is_a_sticky_fault() {
    passes("freed");
}

#[test]
fn work_on_an_unmapped_range_is_a_sticky_fault() {
    passes("unmapped");
}

#[test]
fn work_on_a_mapping_without_access_is_a_sticky_fault() {
    passes("no-access");
}

#[test]
fn destroying_a_stream_with_pending_work_returns_at_once_and_lets_it_complete() {
    passes("destroy");
}

#[test]
fn context_checks_are_per_object() {
    passes("per-object");
}

#[test]
fn freeing_memory_another_process_has_open_aborts_the_exporter() {
    use std::os::unix::process::ExitStatusExt;
    let out = run("exporter", &[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.signal(), Some(6), "SIGABRT: {stderr}");
    assert!(
        stderr.contains("while another process has the allocation open"),
        "{stderr}"
    );
    // Closed first: the free is legal.
    passes_with_close_first();
}

fn passes_with_close_first() {
    let out = run("exporter", &[("GPUALLOC_EMU_TEST_CLOSE_FIRST", "1")]);
    assert!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("freed 0"));
}
