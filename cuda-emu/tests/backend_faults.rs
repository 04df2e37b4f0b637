//! The allocator core on the real CUDA backend, with driver calls failed by the emulator
//! (`GPUALLOC_EMU_FAULTS`): each scenario runs in a child process (this binary re-executed
//! with the emulator on `LD_LIBRARY_PATH` and the fault in its environment), so the
//! rollback paths of the backend and the core run against driver errors.

use std::process::Command;
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpualloc_cuda::CudaBackend;
use gpualloc_devices::{AllocatorConfig, DeviceCore};
use gpualloc_runtime::{Backend, DeviceId};

const ROLE: &str = "GPUALLOC_CUDA_EMU_FAULT_ROLE";
const D0: DeviceId = DeviceId(0);
const MIB: u64 = 1 << 20;

fn core(conf: &str) -> (Arc<dyn Backend>, DeviceCore) {
    let backend: Arc<dyn Backend> = CudaBackend::new().expect("the emulated driver loads");
    let core = DeviceCore::new(backend.clone(), D0, AllocatorConfig::parse(conf).unwrap()).unwrap();
    (backend, core)
}

fn used(backend: &Arc<dyn Backend>) -> u64 {
    let info = backend.mem_info(D0).unwrap();
    info.total - info.free
}

/// The scenarios, when this binary runs as a child.
#[test]
fn child_entry() {
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    match role.as_str() {
        // The 2nd page map of a growth fails: the pages mapped so far are rolled back, and
        // the core's retry maps them all.
        "growth" => {
            let (backend, mut core) = core("expandable_segments:True");
            let s = backend.stream_create(D0).unwrap();
            // The primary context's own memory (the emulator's `CONTEXT_MIB`).
            let context = used(&backend);
            assert_eq!(context, gpualloc_cuda_emu::CONTEXT_MIB * MIB);
            let a = core.malloc(40 * MIB, s).unwrap();
            let stats = core.stats();
            assert_eq!(
                stats.num_alloc_retries, 1,
                "the failed map made the core retry"
            );
            assert_eq!(
                core.reserved_bytes(),
                40 * MIB,
                "nothing of the failed try is kept"
            );
            assert_eq!(
                used(&backend) - context,
                40 * MIB,
                "no mapping or handle of it is left"
            );
            core.free(a.ptr).unwrap();
            core.empty_cache().unwrap();
            assert_eq!(used(&backend), context);
        }
        // cuMemAlloc runs out of memory once: the OOM chain frees the cache and retries.
        "oom" => {
            let (backend, mut core) = core("");
            let s = backend.stream_create(D0).unwrap();
            let a = core.malloc(4 * MIB, s).unwrap();
            core.free(a.ptr).unwrap();
            assert_eq!(core.reserved_bytes(), 20 * MIB, "a 20 MiB segment cached");
            let b = core.malloc(30 * MIB, s).unwrap();
            let stats = core.stats();
            assert_eq!(stats.num_alloc_retries, 1);
            assert_eq!(stats.num_device_free, 1, "the cached segment was freed");
            assert_eq!(core.reserved_bytes(), 30 * MIB);
            core.free(b.ptr).unwrap();
            core.shutdown().unwrap();
        }
        // cuEventRecord fails on a cross-stream free: the block is not reused before the
        // other stream's work is done (the core synchronizes instead).
        "event" => {
            let (backend, mut core) = core("");
            let (s0, s1) = (
                backend.stream_create(D0).unwrap(),
                backend.stream_create(D0).unwrap(),
            );
            let a = core.malloc(MIB, s0).unwrap();
            core.record_stream(a.ptr, s1).unwrap();
            let (open, gate) = mpsc::channel::<()>();
            backend
                .launch_host_func(
                    s1,
                    Box::new(move |_| {
                        let _ = gate.recv_timeout(Duration::from_secs(5));
                    }),
                )
                .unwrap();
            let opener = std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(200));
                drop(open);
            });
            let t = Instant::now();
            core.free(a.ptr).unwrap();
            assert!(
                t.elapsed() >= Duration::from_millis(150),
                "the free returned before the other stream's work was done"
            );
            opener.join().unwrap();
            let b = core.malloc(MIB, s0).unwrap();
            assert_eq!(b.ptr, a.ptr, "the block is free once that work is done");
            core.free(b.ptr).unwrap();
            core.shutdown().unwrap();
        }
        other => panic!("unknown role {other}"),
    }
    println!("scenario {role}: ok");
}

/// Runs scenario `role` in a child with the emulator on its library path and `env` set.
fn child(role: &str, env: &[(&str, &str)]) -> std::process::Output {
    let dir = gpualloc_cuda_emu::emulator_dir().expect("the emulator library is built");
    Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child_entry", "--nocapture", "--test-threads=1"])
        .env(ROLE, role)
        .envs(env.iter().copied())
        .env("LD_LIBRARY_PATH", &dir)
        .output()
        .unwrap()
}

/// Runs scenario `role` with the faults `faults`; it must pass.
fn run(role: &str, faults: &str) {
    let out = child(role, &[("GPUALLOC_EMU_FAULTS", faults)]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stdout.contains(&format!("scenario {role}: ok")),
        "{role}:\n{stdout}\n{stderr}"
    );
}

#[test]
fn a_half_failed_expandable_growth_rolls_back_and_the_retry_succeeds() {
    run("growth", "cuMemMap:2:CUDA_ERROR_OUT_OF_MEMORY");
}

#[test]
fn an_oom_from_cu_mem_alloc_runs_the_oom_chain() {
    run("oom", "cuMemAlloc_v2:2:CUDA_ERROR_OUT_OF_MEMORY");
}

#[test]
fn a_failing_event_record_keeps_the_block_until_synchronized() {
    // A non-sticky code: a sticky one (`CUDA_ERROR_LAUNCH_FAILED`) loses the device, which
    // `cuda_rules.rs` covers.
    run("event", "cuEventRecord:1:CUDA_ERROR_UNKNOWN");
}

#[test]
fn the_emulator_refuses_to_start_where_it_is_forbidden() {
    let out = child("oom", &[("GPUALLOC_FORBID_EMULATOR", "1")]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "the CUDA backend started on the emulator"
    );
    assert!(stderr.contains("GPUALLOC_FORBID_EMULATOR"), "{stderr}");
}

#[test]
fn a_malformed_fault_spec_stops_the_run() {
    let out = child("oom", &[("GPUALLOC_EMU_FAULTS", "cuMemAlloc_v2:0:2")]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("GPUALLOC_EMU_FAULTS"), "{stderr}");
}
