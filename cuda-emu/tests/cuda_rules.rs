//! The CUDA backend's rules of use, on the emulated driver with four devices
//! (`GPUALLOC_EMU_DEVICES=4`). Each scenario runs in a child process (this binary re-executed
//! with the emulator first on `LD_LIBRARY_PATH`). With `GPUALLOC_RULES_ON_DRIVER=1`
//! (`scripts/gpu-check.sh` on a GPU machine) they run against the machine's driver instead:
//! every scenario that reads no emulator-only knob and finds the GPUs it needs; the others
//! print why they are skipped (see `needs`).
//! - a process retains a primary context only on the devices it allocates on, and pinned
//!   host memory, unmaps and pointer queries use a context it already holds;
//! - cudarc's per-thread default stream cannot be adopted (it names another stream on each
//!   thread, and the allocator records events from its own threads); the legacy default
//!   stream can;
//! - `Backend::free` waits for the device's queued work even where `cuMemFree` does not
//!   synchronize (`GPUALLOC_EMU_FREE_NO_SYNC`);
//! - registered host memory is pinned for every device's context, not only the one current
//!   when it was registered (the emulator counts copies whose host side is not pinned for the
//!   copying context: the driver stages those, synchronously);
//! - a legacy IPC handle opened on another device than the memory's is closed in the context
//!   that opened it;
//! - a buffer from an expandable segment of device 0 is usable on device 1 once
//!   `Allocator::enable_peer_access(1, 0)` ran, for pages mapped before and after (the
//!   emulator refuses work of a device the mapping's `cuMemSetAccess` did not name);
//! - with every device in `EXCLUSIVE_PROCESS` mode, a second process builds its allocator and
//!   works on the devices the first does not use (building touches no device);
//! - after a sticky error (the emulator's faulting kernel, after which the driver runs no
//!   host function), completion futures pending on the device fail with `DeviceLost`
//!   promptly instead of hanging, their closures are freed, later calls on the device say it
//!   is lost, the allocator hands out none of its memory, and other devices work on.

use std::process::Command;
use std::sync::Arc;

use gpualloc::{Allocator, AllocatorConfig, DeviceId};
use gpualloc_cuda::CudaBackend;
use gpualloc_runtime::{Backend, BackendError, HostRegisterFlags};

const ROLE: &str = "GPUALLOC_CUDA_EMU_MULTI_ROLE";
const DEVICES: u32 = 4;

/// Which devices' primary contexts this process holds, as the driver reports them.
fn active_contexts(devices: u32) -> Vec<bool> {
    (0..devices as i32)
        .map(|d| {
            let (mut flags, mut active) = (0u32, 0i32);
            // SAFETY: both out-pointers are valid for the call; the driver is initialized
            // (the backend was built).
            let r = unsafe {
                cudarc::driver::sys::cuDevicePrimaryCtxGetState(d, &mut flags, &mut active)
            };
            assert_eq!(r, cudarc::driver::sys::CUresult::CUDA_SUCCESS);
            active != 0
        })
        .collect()
}

/// One of the emulator's counters (a function exported for tests, taking nothing).
fn emu_counter(symbol: &[u8]) -> u64 {
    // SAFETY: the library cudarc loaded is the emulator (this child's LD_LIBRARY_PATH), which
    // exports each `gpualloc_emu_*` counter with exactly this signature; it takes nothing and
    // reads a count.
    unsafe {
        let lib = cudarc::driver::sys::culib();
        let f = lib
            .get::<unsafe extern "C" fn() -> u64>(symbol)
            .expect("the emulator's counter");
        f()
    }
}

/// Copies whose host side was not pinned for the copying context.
fn pageable_copies() -> u64 {
    emu_counter(b"gpualloc_emu_pageable_copies\0")
}

/// Host waits on events that would spin a CPU on a driver.
fn spinning_waits() -> u64 {
    emu_counter(b"gpualloc_emu_spinning_waits\0")
}

/// Driver calls this process made as a forked child.
fn calls_in_forked_child() -> u64 {
    emu_counter(b"gpualloc_emu_calls_in_forked_child\0")
}

/// Streams created and not destroyed.
fn live_streams() -> u64 {
    emu_counter(b"gpualloc_emu_live_streams\0")
}

/// The sticky error the `sticky-fault` role raises: `STICKY_CODE` (default 700), and its name.
fn sticky_code() -> (u32, &'static str) {
    match std::env::var("STICKY_CODE").as_deref() {
        Ok("710") => (710, "CUDA_ERROR_ASSERT"),
        Ok("911") => (911, "CUDA_ERROR_EXTERNAL_DEVICE"),
        Ok("220") => (220, "CUDA_ERROR_NVLINK_UNCORRECTABLE"),
        _ => (700, "CUDA_ERROR_ILLEGAL_ADDRESS"),
    }
}

/// Queues the emulator's faulting kernel on `stream`: when the stream reaches it, the context
/// of the stream's device hits sticky error [`sticky_code`].
fn fault_stream(cuda: &CudaBackend, stream: &gpualloc::Stream) {
    let s = cuda.cudarc_stream(stream.handle()).unwrap();
    s.context().bind_to_thread().unwrap();
    // SAFETY: the library cudarc loaded is the emulator (this child's LD_LIBRARY_PATH), which
    // exports this function with exactly this signature; the stream is live and its context
    // current on this thread.
    let r = unsafe {
        let lib = cudarc::driver::sys::culib();
        let f = lib
            .get::<unsafe extern "C" fn(*mut std::ffi::c_void, u32) -> u32>(
                b"gpualloc_emu_fault_stream_code\0",
            )
            .expect("the emulator's fault knob");
        f(s.cu_stream().cast(), sticky_code().0)
    };
    assert_eq!(r, 0, "gpualloc_emu_fault_stream_code");
}

/// Awaits `fut`, failing the test if it takes longer than 5 s (a hang).
async fn within_5s<F: std::future::Future>(what: &str, fut: F) -> F::Output {
    tokio::time::timeout(std::time::Duration::from_secs(5), fut)
        .await
        .unwrap_or_else(|_| panic!("{what}: still pending after 5 s"))
}

/// Builds an allocator with `config` on `backend` (building must touch no device), runs
/// `body` with it on a current-thread runtime, then shuts it down.
fn with_allocator<F, Fut>(backend: &Arc<dyn Backend>, config: AllocatorConfig, body: F)
where
    F: FnOnce(Allocator) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let alloc = Allocator::builder()
            .config(config)
            .backend_instance(backend.clone())
            .build()
            .expect("building touches no device");
        body(alloc.clone()).await;
        alloc.shutdown().await.unwrap();
    });
}

/// Reads `child`'s output up to a line with `marker`; returns what follows the marker.
fn read_until(out: &mut impl std::io::BufRead, marker: &str) -> String {
    loop {
        let mut line = String::new();
        assert!(
            out.read_line(&mut line).unwrap() > 0,
            "the child ended before saying {marker:?}"
        );
        if let Some(i) = line.find(marker) {
            return line[i + marker.len()..].trim().to_string();
        }
    }
}

/// The scenarios, when this binary runs as a child.
#[test]
fn child_entry() {
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    let cuda = CudaBackend::new().expect("the emulated driver loads");
    let backend: Arc<dyn Backend> = cuda.clone();
    if on_driver() {
        assert!(backend.device_count().unwrap() >= needs(&role).0);
    } else {
        assert_eq!(backend.device_count().unwrap(), DEVICES);
    }
    match role.as_str() {
        // Building the allocator touches no context; allocating on device 2 retains device
        // 2's only.
        "only-device-2" => {
            let b = backend.clone();
            with_allocator(&backend, AllocatorConfig::default(), |alloc| async move {
                assert_eq!(
                    active_contexts(DEVICES),
                    [false; 4],
                    "building the allocator retained contexts"
                );
                // It asked every device for virtual memory (the gpualloc policy's default of
                // expandable segments), without a context.
                assert!(alloc.config().expandable_segments);
                assert!((0..DEVICES).all(|d| b.has_vmm(DeviceId(d))));
                let count = b.device_count().unwrap();
                assert!(!b.has_vmm(DeviceId(count)), "no such device");
                assert_eq!(active_contexts(DEVICES), [false; 4], "has_vmm retained one");
                // A pool of unsplit blocks checks its granularity on every device, which
                // needs no context either.
                let pool = alloc
                    .pool(
                        "unsplit",
                        gpualloc::PoolOptions {
                            unsplit: Some(2 << 20),
                            ..Default::default()
                        },
                    )
                    .await
                    .unwrap();
                assert_eq!(
                    active_contexts(DEVICES),
                    [false; 4],
                    "the unsplit pool retained one"
                );
                drop(pool);
                let stream = alloc.new_stream(DeviceId(2)).unwrap();
                let buf = alloc.malloc(1 << 20, &stream).await.unwrap();
                assert_eq!(active_contexts(DEVICES), [false, false, true, false]);
                drop(buf);
            });
        }
        "per-thread-stream" => {
            let ctx = cuda.cudarc_context(DeviceId(0)).unwrap();
            match cuda.adopt_stream(&ctx.per_thread_stream()) {
                Err(BackendError::InvalidValue(m)) => assert!(m.contains("per-thread"), "{m}"),
                other => panic!("the per-thread default stream was adopted: {other:?}"),
            }
            let legacy = cuda.adopt_stream(&ctx.default_stream()).unwrap();
            cuda.stream_synchronize(legacy).unwrap();
            cuda.stream_destroy(legacy).unwrap();
        }
        "free-waits" => {
            let d = DeviceId(0);
            let ptr = backend.malloc(d, 1 << 20).unwrap();
            let s = backend.stream_create(d).unwrap();
            // Queued work on the block, behind a gate: a host function waiting on a channel,
            // then a memset of the block.
            let (gate, rx) = std::sync::mpsc::channel::<()>();
            backend
                .launch_host_func(
                    s,
                    Box::new(move |_| {
                        let _ = rx.recv();
                    }),
                )
                .unwrap();
            backend.memset_async(s, ptr, 0xab, 1 << 20).unwrap();
            let freed = Arc::new(std::sync::atomic::AtomicBool::new(false));
            let (b, f) = (backend.clone(), freed.clone());
            let freeing = std::thread::spawn(move || {
                b.free(d, ptr).unwrap();
                f.store(true, std::sync::atomic::Ordering::SeqCst);
            });
            std::thread::sleep(std::time::Duration::from_millis(200));
            assert!(
                !freed.load(std::sync::atomic::Ordering::SeqCst),
                "free returned while queued work still used the memory"
            );
            drop(gate);
            freeing.join().unwrap();
            backend
                .stream_synchronize(s)
                .expect("the queued memset ran on live memory");
            backend.stream_destroy(s).unwrap();
        }
        "portable-registration" => {
            const LEN: usize = 1 << 20;
            let layout = std::alloc::Layout::from_size_align(LEN, 4096).unwrap();
            // SAFETY: a non-zero size; freed below with the same layout.
            let host = unsafe { std::alloc::alloc_zeroed(layout) };
            assert!(!host.is_null());
            // SAFETY: this test's own host memory, kept until its copies completed.
            unsafe { backend.host_register(host, LEN as u64, HostRegisterFlags::default()) }
                .unwrap();
            let d1 = DeviceId(1);
            let s = backend.stream_create(d1).unwrap();
            let dst = backend.malloc(d1, LEN as u64).unwrap();
            // SAFETY: `host` holds LEN initialized (zeroed) bytes, alive until freed below.
            let bytes = unsafe { std::slice::from_raw_parts(host, LEN) };
            let before = pageable_copies();
            backend.copy_to_device(s, dst, bytes).unwrap();
            assert_eq!(
                pageable_copies() - before,
                0,
                "registered memory was not pinned for device 1's context"
            );
            // The count does see a copy from memory that was never registered.
            let pageable = vec![1u8; 4096];
            backend.copy_to_device(s, dst, &pageable).unwrap();
            assert_eq!(pageable_copies() - before, 1);
            // SAFETY: this test's own host memory, kept until its copies completed.
            unsafe { backend.host_unregister(host) }.unwrap();
            // SAFETY: allocated above with this layout, unregistered, no longer used.
            unsafe { std::alloc::dealloc(host, layout) };
            backend.free(d1, dst).unwrap();
            backend.stream_destroy(s).unwrap();
        }
        "host-on-device-3" => {
            let d3 = DeviceId(3);
            let s = backend.stream_create(d3).unwrap();
            // Pinned host memory, registered host memory, a pointer query (IPC handle) and a
            // VMM map/unmap, all by a process that works on device 3 only.
            let pinned = backend.host_alloc(1 << 20).unwrap();
            let layout = std::alloc::Layout::from_size_align(1 << 16, 4096).unwrap();
            // SAFETY: a non-zero size; freed below with the same layout.
            let host = unsafe { std::alloc::alloc_zeroed(layout) };
            // SAFETY: this test's own host memory, kept until its copies completed.
            unsafe { backend.host_register(host, 1 << 16, HostRegisterFlags::default()) }.unwrap();
            let p = backend.malloc(d3, 1 << 20).unwrap();
            backend.ipc_get_mem_handle(p).unwrap();
            let g = backend.vmm_granularity(d3).unwrap();
            let va = backend.va_reserve(d3, g, g).unwrap();
            let phys = backend.phys_create(d3, g).unwrap();
            backend.map(va, g, 0, phys).unwrap();
            backend.set_access(d3, va, g).unwrap();
            backend.unmap(va, g).unwrap();
            backend.phys_release(phys).unwrap();
            backend.va_free(d3, va, g).unwrap();
            // SAFETY: this test's own host memory, kept until its copies completed.
            unsafe { backend.host_unregister(host) }.unwrap();
            // SAFETY: allocated above with this layout, unregistered, no longer used.
            unsafe { std::alloc::dealloc(host, layout) };
            // SAFETY: this test's own host memory, kept until its copies completed.
            unsafe { backend.host_free(pinned) }.unwrap();
            backend.free(d3, p).unwrap();
            backend.stream_destroy(s).unwrap();
            assert_eq!(
                active_contexts(DEVICES),
                [false, false, false, true],
                "a context other than device 3's was retained"
            );
        }
        // Exports an allocation of device 1: prints its IPC handle, holds it until stdin ends.
        // The handle is asked for with a pointer inside the allocation: `ipc_get_mem_handle`
        // promises the containing allocation's (the driver takes base pointers only).
        "ipc-export" => {
            let p = backend.malloc(DeviceId(1), 1 << 20).unwrap();
            let h = backend
                .ipc_get_mem_handle(p.checked_add(4096).unwrap())
                .unwrap();
            let hex: String = h.0.iter().map(|b| format!("{b:02x}")).collect();
            println!("HANDLE {hex}");
            let mut rest = String::new();
            let _ = std::io::Read::read_to_string(&mut std::io::stdin(), &mut rest);
            backend.free(DeviceId(1), p).unwrap();
        }
        // Opens that handle in device 2's context and closes it again.
        "ipc-open-elsewhere" => {
            let mut exporter = child_command("ipc-export")
                .stdin(std::process::Stdio::piped())
                .stdout(std::process::Stdio::piped())
                .spawn()
                .unwrap();
            let mut out = std::io::BufReader::new(exporter.stdout.take().unwrap());
            let hex = read_until(&mut out, "HANDLE ");
            let mut bytes = [0u8; 64];
            for (i, b) in bytes.iter_mut().enumerate() {
                *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap();
            }
            let handle = gpualloc_runtime::IpcMemHandle(bytes);
            let p = backend.ipc_open_mem_handle(DeviceId(2), &handle).unwrap();
            assert_eq!(backend.mem_address_range(p).unwrap(), (p, 1 << 20));
            if std::env::var_os("TWICE").is_some() {
                // The driver counts opens of one handle per context and returns the same
                // pointer: two imports from one segment, each closed once.
                let q = backend.ipc_open_mem_handle(DeviceId(2), &handle).unwrap();
                assert_eq!(q, p, "the driver's pointer of the handle already open");
                backend.ipc_close_mem_handle(q).expect("the first close");
            }
            backend
                .ipc_close_mem_handle(p)
                .expect("closed in the context that opened it");
            // The memory is device 1's, but this process used only device 2: querying its
            // range needs the importer's context, not one on the exporter's GPU.
            assert_eq!(
                active_contexts(DEVICES),
                [false, false, true, false],
                "a context on the exporter's device"
            );
            drop(exporter.stdin.take());
            assert!(exporter.wait().unwrap().success());
        }
        // Exclusive mode: hold device `HOLD_DEVICE` (default 2) until stdin ends.
        "exclusive-hold" => {
            let held: u32 = std::env::var("HOLD_DEVICE").map_or(2, |d| d.parse().unwrap());
            with_allocator(&backend, AllocatorConfig::default(), |alloc| async move {
                let stream = alloc.new_stream(DeviceId(held)).unwrap();
                let buf = alloc.malloc(1 << 20, &stream).await.unwrap();
                println!("READY");
                let mut rest = String::new();
                let _ = std::io::Read::read_to_string(&mut std::io::stdin(), &mut rest);
                drop(buf);
                drop(stream);
            });
        }
        // Exclusive mode, while another process holds device 2: build, work on device 1, and
        // get a typed error (not a hang or a crash) on device 2.
        "exclusive-other" => {
            with_allocator(&backend, AllocatorConfig::default(), |alloc| async move {
                let s1 = alloc.new_stream(DeviceId(1)).unwrap();
                let buf = alloc.malloc(1 << 20, &s1).await.unwrap();
                drop(buf);
                // A pool of unsplit blocks, while device 2 is the other process's: its
                // granularity needs no context, so nothing is refused for it.
                let pool = alloc
                    .pool(
                        "unsplit",
                        gpualloc::PoolOptions {
                            unsplit: Some(2 << 20),
                            ..Default::default()
                        },
                    )
                    .await
                    .expect("an unsplit pool while another process holds device 2");
                drop(pool);
                let busy = alloc.new_stream(DeviceId(2));
                assert!(busy.is_err(), "device 2 belongs to the other process");
                let msg = busy.err().unwrap().to_string();
                assert!(msg.contains("CUDA_ERROR_DEVICE_UNAVAILABLE"), "{msg}");
                drop(s1);
            });
        }
        // Exclusive mode, while another process holds device 0: pinned host memory, this
        // process's first call, takes the context of a device it can have.
        "exclusive-host-first" => {
            let pinned = backend
                .host_alloc(1 << 20)
                .expect("pinned host memory while device 0 is another process's");
            // SAFETY: this test's own host memory, kept until its copies completed.
            unsafe { backend.host_free(pinned) }.unwrap();
            assert_eq!(active_contexts(DEVICES), [false, true, false, false]);
        }
        // A host function's closure holds the last clone of a stream: its drop destroys the
        // stream, which the driver refuses on its callback thread; the backend runs closures
        // on a thread of its own, where it works.
        "drop-in-host-fn" => {
            with_allocator(&backend, AllocatorConfig::default(), |alloc| async move {
                let backend = alloc.backend().clone();
                let s1 = alloc.new_stream(DeviceId(0)).unwrap();
                let s2 = alloc.new_stream(DeviceId(0)).unwrap();
                let before = live_streams();
                let (tx, rx) = std::sync::mpsc::channel();
                backend
                    .launch_host_func(
                        s1.handle(),
                        Box::new(move |_| {
                            drop(s2);
                            let _ = tx.send(());
                        }),
                    )
                    .unwrap();
                rx.recv_timeout(std::time::Duration::from_secs(5)).unwrap();
                backend.stream_synchronize(s1.handle()).unwrap();
                assert_eq!(live_streams(), before - 1, "the stream was not destroyed");
                // And the context carries no error a later call would find.
                let s3 = alloc.new_stream(DeviceId(0)).unwrap();
                let buf = alloc.malloc(1 << 20, &s3).await.unwrap();
                drop(buf);
            });
        }
        // The driver reuses a destroyed object's handle value: a stale handle of ours must
        // not name the newer object.
        "stale-handles" => {
            let s = backend.stream_create(DeviceId(0)).unwrap();
            let old_event = backend.event_create(DeviceId(0)).unwrap();
            backend.event_destroy(old_event).unwrap();
            let new_event = backend.event_create(DeviceId(0)).unwrap();
            assert!(
                matches!(
                    backend.event_record(old_event, s),
                    Err(BackendError::InvalidHandle(_))
                ),
                "a destroyed event's handle named a newer one"
            );
            let old_stream = backend.stream_create(DeviceId(0)).unwrap();
            backend.stream_destroy(old_stream).unwrap();
            let new_stream = backend.stream_create(DeviceId(0)).unwrap();
            assert!(
                matches!(
                    backend.stream_query(old_stream),
                    Err(BackendError::InvalidHandle(_))
                ),
                "a destroyed stream's handle named a newer one"
            );
            backend.event_record(new_event, new_stream).unwrap();
            backend.event_synchronize(new_event).unwrap();
            backend.event_destroy(new_event).unwrap();
            backend.stream_destroy(new_stream).unwrap();
            backend.stream_destroy(s).unwrap();
        }
        // A user thread with device 1's context current (as the CUDA runtime leaves it after
        // cudaSetDevice(1)) calls the backend on devices 2 and 3: its context is still
        // device 1's afterwards.
        "keep-current" => {
            let ctx1 = cuda.cudarc_context(DeviceId(1)).unwrap();
            ctx1.bind_to_thread().unwrap();
            let current = || {
                let mut c: cudarc::driver::sys::CUcontext = std::ptr::null_mut();
                // SAFETY: a valid out-pointer; the driver is initialized.
                let r = unsafe { cudarc::driver::sys::cuCtxGetCurrent(&mut c) };
                assert_eq!(r, cudarc::driver::sys::CUresult::CUDA_SUCCESS);
                c
            };
            assert_eq!(current(), ctx1.cu_ctx());
            let p = backend.malloc(DeviceId(2), 1 << 20).unwrap();
            let s = backend.stream_create(DeviceId(3)).unwrap();
            let q = backend.malloc(DeviceId(3), 4096).unwrap();
            backend.memset_async(s, q, 0, 4096).unwrap();
            let pinned = backend.host_alloc(4096).unwrap();
            assert_eq!(
                current(),
                ctx1.cu_ctx(),
                "the caller's context was switched"
            );
            // SAFETY: this test's own host memory, kept until its copies completed.
            unsafe { backend.host_free(pinned) }.unwrap();
            backend.stream_synchronize(s).unwrap();
            backend.stream_destroy(s).unwrap();
            backend.free(DeviceId(3), q).unwrap();
            backend.free(DeviceId(2), p).unwrap();
            assert_eq!(
                current(),
                ctx1.cu_ctx(),
                "the caller's context was switched"
            );
        }
        // An earlier cudarc drop left an error in the context; a stream is then destroyed
        // from a thread with no current context (a runtime worker): it must still go.
        "destroy-after-cudarc-error" => {
            let s = backend.stream_create(DeviceId(0)).unwrap();
            let before = live_streams();
            let ctx = cuda.cudarc_context(DeviceId(0)).unwrap();
            ctx.record_err::<()>(Err(cudarc::driver::DriverError(
                cudarc::driver::sys::CUresult::CUDA_ERROR_INVALID_VALUE,
            )));
            let b = backend.clone();
            std::thread::spawn(move || b.stream_destroy(s).unwrap())
                .join()
                .unwrap();
            assert_eq!(live_streams(), before - 1, "the stream was not destroyed");
        }
        // A unified-addressing copy (`memcpy_async`, cuMemcpyAsync) records its host side
        // like the typed copies: from pinned memory nothing, from pageable memory a staged copy.
        "memcpy-host-side" => {
            let s = backend.stream_create(DeviceId(0)).unwrap();
            let dev = backend.malloc(DeviceId(0), 1 << 20).unwrap();
            let pinned = backend.host_alloc(4096).unwrap();
            let before = pageable_copies();
            // SAFETY: this test's own host memory, kept until its copies completed.
            unsafe { backend.memcpy_async(s, dev.0, pinned as u64, 4096) }.unwrap();
            backend.stream_synchronize(s).unwrap();
            assert_eq!(
                pageable_copies(),
                before,
                "pinned memory counted as pageable"
            );
            let pageable = vec![0u8; 4096];
            // The emulator's sim may refuse a pageable address for an async copy; the record
            // is what is checked.
            // SAFETY: a pageable Vec, against the contract on purpose (the emulator counts
            // it): a driver stages a copy from pageable memory before the call returns, and
            // the Vec outlives the synchronize below.
            let _ = unsafe { backend.memcpy_async(s, dev.0, pageable.as_ptr() as u64, 4096) };
            backend.stream_synchronize(s).unwrap();
            assert_eq!(
                pageable_copies(),
                before + 1,
                "a pageable host side unrecorded"
            );
            // SAFETY: this test's own host memory, kept until its copies completed.
            unsafe { backend.host_free(pinned) }.unwrap();
            backend.free(DeviceId(0), dev).unwrap();
            backend.stream_destroy(s).unwrap();
        }
        // The backend's host waits on events sleep: its events have CU_EVENT_BLOCKING_SYNC.
        "event-waits" => {
            let stream = backend.stream_create(DeviceId(0)).unwrap();
            let event = backend.event_create(DeviceId(0)).unwrap();
            backend.event_record(event, stream).unwrap();
            backend.event_synchronize(event).unwrap();
            assert_eq!(spinning_waits(), 0, "a host wait spun a CPU");
            backend.event_destroy(event).unwrap();
            backend.stream_destroy(stream).unwrap();
        }
        // A forked child drops what it inherited (a stream, an event, the backend) without a
        // driver call: CUDA does not survive a fork.
        "fork-drops" => {
            let stream = backend.stream_create(DeviceId(0)).unwrap();
            let event = backend.event_create(DeviceId(0)).unwrap();
            backend.event_record(event, stream).unwrap();
            backend.stream_synchronize(stream).unwrap();
            let shared = gpualloc_runtime::Stream::from_handle(backend.clone(), stream);
            drop(cuda);
            // SAFETY: the child only drops objects and reads a counter through `dlsym`, then
            // leaves with `_exit`, never returning into the test harness.
            let pid = unsafe { libc::fork() };
            assert!(pid >= 0, "fork failed");
            if pid == 0 {
                let _ = backend.event_destroy(event);
                drop(shared);
                drop(backend);
                let code = i32::from(calls_in_forked_child() != 0);
                // SAFETY: ends the child at once, without the parent's destructors.
                unsafe { libc::_exit(code) };
            }
            let mut status = 0;
            // SAFETY: waits for our own child; `status` is a valid out-pointer.
            assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
            assert!(
                libc::WIFEXITED(status),
                "the child did not exit: {status:#x}"
            );
            assert_eq!(libc::WEXITSTATUS(status), 0, "the child called the driver");
            backend.event_destroy(event).unwrap();
        }
        "peer-expandable" => {
            with_allocator(
                &backend,
                AllocatorConfig::default().with_expandable_segments(true),
                |alloc| async move {
                    let backend = alloc.backend().clone();
                    let s0 = alloc.new_stream(DeviceId(0)).unwrap();
                    let before = alloc.malloc(4 << 20, &s0).await.unwrap();
                    let s1 = backend.stream_create(DeviceId(1)).unwrap();
                    // (Device 1's work on device 0's mapping before the grant would fault
                    // device 1 for good: device 2 shows that rule below.)
                    alloc
                        .enable_peer_access(DeviceId(1), DeviceId(0))
                        .await
                        .unwrap();
                    alloc
                        .enable_peer_access(DeviceId(1), DeviceId(0))
                        .await
                        .expect("enabling twice is not an error");
                    assert!(alloc
                        .enable_peer_access(DeviceId(1), DeviceId(1))
                        .await
                        .is_err());
                    backend.memset_async(s1, before.ptr(), 1, 4096).unwrap();
                    // Pages mapped after the grant.
                    let after = alloc.malloc(64 << 20, &s0).await.unwrap();
                    backend.memset_async(s1, after.ptr(), 2, 4096).unwrap();
                    backend
                        .memset_async(
                            s1,
                            gpualloc::DevicePtr(after.ptr().0 + (64 << 20) - 4096),
                            3,
                            4096,
                        )
                        .unwrap();
                    backend.stream_synchronize(s1).unwrap();
                    // Device 2 was given nothing: its work there is an illegal-address
                    // fault, sticky for device 2's context (as on a GPU), and only for it.
                    let s2 = backend.stream_create(DeviceId(2)).unwrap();
                    // The emulator reports the fault at the call, a GPU at the next
                    // synchronization: either way the device is lost.
                    let faulted = backend.memset_async(s2, after.ptr(), 1, 4096);
                    assert!(
                        matches!(faulted, Ok(()) | Err(BackendError::DeviceLost { .. })),
                        "{faulted:?}"
                    );
                    let synced = backend.stream_synchronize(s2);
                    assert!(
                        matches!(synced, Err(BackendError::DeviceLost { .. })),
                        "{synced:?}"
                    );
                    backend.memset_async(s1, after.ptr(), 4, 4096).unwrap();
                    backend.stream_synchronize(s1).unwrap();
                    backend.stream_destroy(s1).unwrap();
                    let _ = backend.stream_destroy(s2);
                    drop((before, after, s0));
                },
            );
        }
        // The driver's one callback thread is held by another stream's host function: a
        // stream whose events are recorded and awaited still runs its work (no host function
        // of ours is queued on it), and the futures complete once the callback thread is free.
        "events-do-not-stall" => {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async {
                let a = gpualloc::Stream::new(&backend, DeviceId(0)).unwrap();
                let b = gpualloc::Stream::new(&backend, DeviceId(0)).unwrap();
                let (release, held) = std::sync::mpsc::channel::<()>();
                backend
                    .launch_host_func(
                        b.handle(),
                        Box::new(move |_| {
                            let _ = held.recv();
                        }),
                    )
                    .unwrap();
                let first = a.record_event().unwrap();
                let first_done = first.completed();
                let all_done = a.completed();
                let p = backend.malloc(DeviceId(0), 1 << 20).unwrap();
                backend.memset_async(a.handle(), p, 7, 1 << 20).unwrap();
                let last = a.record_event().unwrap();
                let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
                while !last.query().unwrap() {
                    assert!(
                        std::time::Instant::now() < deadline,
                        "stream a stalled behind the held callback thread"
                    );
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
                release.send(()).unwrap();
                within_5s("the first event's future", first_done)
                    .await
                    .unwrap();
                within_5s("the stream's future", all_done).await.unwrap();
                within_5s("the last event's future", last.completed())
                    .await
                    .unwrap();
                drop((first, last, a, b));
                backend.free(DeviceId(0), p).unwrap();
            });
        }
        // A kernel faults on a device's stream: what was queued before it completes; what was
        // queued after it fails with DeviceLost within the watchdog's period; the device is
        // lost for every later call and for the allocator; another device works on.
        "sticky-fault" => {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            // Two allocators, each losing a device of its own: the default config on device
            // 1 (device 2 works on), expandable segments without the thread cache on device 3
            // (device 0 works on).
            let runs = [
                (1, 2, AllocatorConfig::default()),
                (
                    3,
                    0,
                    AllocatorConfig::parse("expandable_segments:True,thread_cache:False").unwrap(),
                ),
            ];
            for (lost, healthy, config) in runs {
                rt.block_on(async {
                    let alloc = Allocator::builder()
                        .config(config)
                        .backend_instance(backend.clone())
                        .build()
                        .unwrap();
                    let d = DeviceId(lost);
                    let stream = alloc.new_stream(d).unwrap();
                    let other = alloc.new_stream(DeviceId(healthy)).unwrap();
                    let buf = alloc.malloc(1 << 20, &stream).await.unwrap();
                    // Everything below is queued behind a gate, so it is pending at the fault.
                    let (gate, rx) = std::sync::mpsc::channel::<()>();
                    backend
                        .launch_host_func(
                            stream.handle(),
                            Box::new(move |_| {
                                let _ = rx.recv();
                            }),
                        )
                        .unwrap();
                    let before = stream.completed();
                    let event_before = stream.record_event().unwrap();
                    fault_stream(&cuda, &stream);
                    let after = stream.completed();
                    let event_after = stream.record_event().unwrap();
                    let capture = Arc::new(());
                    let (held, (tx, results)) = (capture.clone(), std::sync::mpsc::channel());
                    backend
                        .launch_host_func(
                            stream.handle(),
                            Box::new(move |r| {
                                let _held = held;
                                let _ = tx.send(r);
                            }),
                        )
                        .unwrap();
                    assert!(!after.is_done() && !before.is_done());
                    drop(gate);
                    let start = std::time::Instant::now();
                    // Work before the fault finished, but its future is completed by a host
                    // function on the stream's watcher (not on the stream itself, which it
                    // would stall), and the driver runs none once the context faulted: it
                    // resolves, Ok or with the loss, never hangs.
                    let lost_or_ok = |r: Result<(), BackendError>| match r {
                        Ok(()) => true,
                        Err(BackendError::DeviceLost { device, .. }) => device == lost,
                        Err(_) => false,
                    };
                    assert!(lost_or_ok(within_5s("work before the fault", before).await));
                    assert!(lost_or_ok(
                        within_5s("an event before the fault", event_before.completed()).await
                    ));
                    let err = within_5s("a future pending on a lost device", after)
                        .await
                        .unwrap_err();
                    println!(
                        "a pending future failed {:?} after the fault",
                        start.elapsed()
                    );
                    match &err {
                        BackendError::DeviceLost { device, cause } if *device == lost => {
                            assert!(cause.contains(sticky_code().1), "{cause}")
                        }
                        other => panic!("expected DeviceLost of device {lost}, got {other:?}"),
                    }
                    assert_eq!(
                        within_5s("an event after the fault", event_after.completed()).await,
                        Err(err.clone())
                    );
                    assert_eq!(
                        results.recv_timeout(std::time::Duration::from_secs(5)),
                        Ok(Err(err.clone())),
                        "a raw host function is called with the error"
                    );
                    // The closure (and what it captured) is freed once it returns.
                    let freed_by = std::time::Instant::now() + std::time::Duration::from_secs(5);
                    while Arc::strong_count(&capture) > 1 && std::time::Instant::now() < freed_by {
                        std::thread::sleep(std::time::Duration::from_millis(1));
                    }
                    assert_eq!(
                        Arc::strong_count(&capture),
                        1,
                        "the failed closure was freed"
                    );
                    // Later calls on the device say it is lost, without waiting.
                    assert_eq!(stream.completed().await, Err(err.clone()));
                    assert_eq!(backend.stream_create(d), Err(err.clone()));
                    assert_eq!(backend.malloc(d, 4096), Err(err.clone()));
                    assert_eq!(backend.device_lost(d), Some(err.clone()));
                    // The hit paths' watch says so with a load, and so does asking.
                    match backend.lost_watch(d) {
                        gpualloc_runtime::LostWatch::Cell(cell) => {
                            assert_eq!(cell.get(), Some(&err))
                        }
                        other => panic!("the CUDA backend shares its cell, got {other:?}"),
                    }
                    assert!(gpualloc_runtime::LostWatch::Ask.is_lost(&*backend, d));
                    assert!(!backend
                        .lost_watch(DeviceId(healthy))
                        .is_lost(&*backend, DeviceId(healthy)));
                    // The allocator hands out none of its memory, cached blocks included.
                    drop(buf);
                    for size in [1 << 20, 512] {
                        let e = alloc.malloc(size, &stream).await.unwrap_err();
                        assert!(e.is_device_lost(), "{e}");
                        assert!(
                            e.to_string().contains(&format!("device {lost} is lost")),
                            "{e}"
                        );
                    }
                    // Other devices are not affected.
                    assert_eq!(backend.device_lost(DeviceId(healthy)), None);
                    let b2 = alloc.malloc(1 << 20, &other).await.unwrap();
                    backend
                        .memset_async(other.handle(), b2.ptr(), 7, b2.len())
                        .unwrap();
                    within_5s("device 2", other.completed()).await.unwrap();
                    drop(b2);
                    // Pinned host memory (any context will do) works on, through a healthy
                    // device's context, not the lost one's.
                    let pinned = backend
                        .host_alloc(1 << 20)
                        .expect("pinned host memory with a device lost");
                    // SAFETY: this test's own host memory, kept until its copies completed.
                    unsafe { backend.host_free(pinned) }.unwrap();
                    // Shutting down reports the lost device and does not hang.
                    match within_5s("shutdown", alloc.shutdown()).await {
                        Ok(()) => {}
                        Err(e) => assert!(e.is_device_lost(), "{e}"),
                    }
                });
            }
        }
        other => panic!("unknown role {other}"),
    }
}

fn run_child(role: &str) {
    run_child_with(role, &[]);
}

/// True when the rules run against the machine's own driver (`GPUALLOC_RULES_ON_DRIVER=1`,
/// as `scripts/gpu-check.sh` sets on a GPU machine) instead of the emulator.
fn on_driver() -> bool {
    std::env::var_os("GPUALLOC_RULES_ON_DRIVER").is_some_and(|v| v == "1")
}

/// What a scenario needs: GPUs, and whether it reads an emulator-only knob (then the reason
/// it cannot run on a driver).
fn needs(role: &str) -> (u32, Option<&'static str>) {
    const COUNTER: &str = "it reads a counter only the emulator keeps";
    match role {
        "per-thread-stream" | "free-waits" | "stale-handles" | "events-do-not-stall" => (1, None),
        "ipc-open-elsewhere" | "ipc-export" | "peer-expandable" => (3, None),
        "only-device-2" | "host-on-device-3" | "keep-current" => (4, None),
        "portable-registration"
        | "drop-in-host-fn"
        | "destroy-after-cudarc-error"
        | "memcpy-host-side"
        | "event-waits"
        | "fork-drops" => (1, Some(COUNTER)),
        "exclusive-hold" | "exclusive-other" | "exclusive-host-first" => (
            3,
            Some("EXCLUSIVE_PROCESS mode is the emulator's knob here (a GPU's is its admin's)"),
        ),
        "sticky-fault" => (4, Some("the faulting kernel is the emulator's")),
        other => panic!("scenario {other} has no entry in needs()"),
    }
}

/// This binary as the child in `role`: with the emulator first on the library path, or,
/// [`on_driver`], with the machine's driver.
fn child_command(role: &str) -> Command {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(["--exact", "child_entry", "--nocapture", "--test-threads=1"])
        .env(ROLE, role);
    if on_driver() {
        return cmd;
    }
    let dir = gpualloc_cuda_emu::emulator_dir().expect("the emulator library is built");
    let mut path = dir.into_os_string();
    if let Some(old) = std::env::var_os("LD_LIBRARY_PATH") {
        path.push(":");
        path.push(old);
    }
    cmd.env("GPUALLOC_EMU_DEVICES", DEVICES.to_string())
        .env("LD_LIBRARY_PATH", path);
    cmd
}

/// True (and says why) when scenario `role` cannot run on this machine's driver.
fn skipped_on_driver(role: &str) -> bool {
    if !on_driver() {
        return false;
    }
    let (gpus, emulator_only) = needs(role);
    if let Some(why) = emulator_only {
        println!("skipped on the driver: {role}: {why}");
        return true;
    }
    let have = CudaBackend::new()
        .and_then(|b| b.device_count())
        .expect("the driver loads");
    if have < gpus {
        println!("skipped on the driver: {role} needs {gpus} GPUs, this machine has {have}");
        return true;
    }
    false
}

/// Runs scenario `role` in a child; on a driver, only where it can run there (else says why
/// it is skipped).
fn run_child_with(role: &str, env: &[(&str, &str)]) {
    if skipped_on_driver(role) {
        return;
    }
    let out = child_command(role)
        .envs(env.iter().copied())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{role}:\n{stdout}\n{stderr}");
}

#[test]
fn a_process_retains_a_context_only_on_the_devices_it_allocates_on() {
    run_child("only-device-2");
}

#[test]
fn the_per_thread_default_stream_is_refused_and_the_legacy_one_adopted() {
    run_child("per-thread-stream");
}

#[test]
fn free_waits_for_queued_work_where_cumemfree_does_not_synchronize() {
    run_child_with("free-waits", &[("GPUALLOC_EMU_FREE_NO_SYNC", "1")]);
}

#[test]
fn registered_host_memory_is_pinned_for_every_device() {
    run_child("portable-registration");
}

#[test]
fn host_memory_unmaps_and_pointer_queries_use_a_context_the_process_holds() {
    run_child("host-on-device-3");
}

#[test]
fn an_ipc_handle_is_closed_in_the_context_that_opened_it() {
    run_child("ipc-open-elsewhere");
}

/// Two imports of one handle (two buffers of one exported segment): the driver returns the
/// same pointer and counts; each import closes once, and both closes succeed.
#[test]
fn an_ipc_handle_opened_twice_is_closed_twice() {
    run_child_with("ipc-open-elsewhere", &[("TWICE", "1")]);
}

#[test]
fn in_exclusive_process_mode_a_second_process_works_on_the_other_devices() {
    with_exclusive_holder("exclusive", None, "exclusive-other");
}

/// Pinned host memory needs some context: with device 0 another process's in
/// `EXCLUSIVE_PROCESS` mode, a process that holds none yet takes device 1's.
#[test]
fn pinned_memory_first_takes_a_device_this_process_can_have() {
    with_exclusive_holder("excl0", Some("0"), "exclusive-host-first");
}

/// Runs scenario `role` while another process (`exclusive-hold`, holding device
/// `hold_device`, or its default) holds devices in `EXCLUSIVE_PROCESS` mode; both share a
/// lock folder named after `tag`.
fn with_exclusive_holder(tag: &str, hold_device: Option<&str>, role: &str) {
    if skipped_on_driver("exclusive-hold") {
        return;
    }
    let dir = std::env::temp_dir().join(format!("gpualloc-emu-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let shared = dir.to_str().unwrap().to_string();
    let mut holder = child_command("exclusive-hold");
    holder.env("GPUALLOC_EMU_EXCLUSIVE_PROCESS", &shared);
    if let Some(d) = hold_device {
        holder.env("HOLD_DEVICE", d);
    }
    let mut holder = holder
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = std::io::BufReader::new(holder.stdout.take().unwrap());
    read_until(&mut out, "READY");
    run_child_with(role, &[("GPUALLOC_EMU_EXCLUSIVE_PROCESS", &shared)]);
    drop(holder.stdin.take());
    assert!(holder.wait().unwrap().success());
    std::fs::remove_dir_all(&dir).ok();
}

/// A closure that drops the last clone of a stream runs where the driver allows that.
#[test]
fn a_host_functions_closure_may_drop_the_last_stream() {
    run_child("drop-in-host-fn");
}

/// A stream is destroyed even when cudarc holds an error of an earlier drop in its context.
#[test]
fn a_stream_goes_even_after_a_cudarc_error() {
    run_child("destroy-after-cudarc-error");
}

/// A backend call leaves the calling thread's current context as it found it.
#[test]
fn a_call_keeps_the_callers_current_context() {
    run_child("keep-current");
}

/// `cuMemcpyAsync`'s host side is recorded, pinned or pageable, as the typed copies' are.
#[test]
fn a_unified_copy_records_its_host_side() {
    run_child("memcpy-host-side");
}

/// Handles the driver reuses after destroy never make a stale handle of ours valid again.
#[test]
fn a_stale_handle_does_not_name_a_newer_object() {
    run_child("stale-handles");
}

/// Recording and awaiting events puts no host function on the user's stream.
#[test]
fn a_recorded_event_does_not_stall_its_stream() {
    run_child("events-do-not-stall");
}

/// A host wait on an event sleeps instead of spinning a CPU core.
#[test]
fn host_waits_on_events_do_not_spin() {
    run_child("event-waits");
}

/// A forked child's drops of what it inherited make no driver call.
#[test]
fn a_forked_child_drops_what_it_inherited_without_the_driver() {
    run_child("fork-drops");
}

#[test]
fn after_a_sticky_error_pending_futures_fail_and_the_device_is_lost() {
    run_child("sticky-fault");
}

/// The same after a device-side `assert` (710, the most common kernel fault in ML), an
/// external device's error (911) and an uncorrectable NVLink error (220): sticky too.
#[test]
fn every_sticky_code_loses_the_device() {
    for code in ["710", "911", "220"] {
        run_child_with("sticky-fault", &[("STICKY_CODE", code)]);
    }
}

#[test]
fn expandable_memory_is_usable_on_a_peer_once_peer_access_is_enabled() {
    run_child("peer-expandable");
}
