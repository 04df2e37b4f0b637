//! A fault campaign on the CUDA backend under the emulated driver: each seed runs a workload of
//! the allocator (mallocs, writes, read-backs, frees, stream-crossing frees, `empty_cache`,
//! under the default config and with expandable segments) in a child process whose driver
//! fails chosen calls (`GPUALLOC_EMU_FAULTS`, drawn from the seed: the entry points the
//! backend calls, with error codes the driver documents for each, sticky ones included).
//!
//! Every run must end within a bound (no hang), fail only with typed errors (no panic),
//! never read back wrong bytes from a buffer whose write succeeded, and, where no device was
//! lost, leave no stream alive after shutdown. CI runs `GPUALLOC_FAULT_SEEDS` seeds (default
//! 12); the figures of a long run are in `BENCHMARKS.md`.

use std::collections::BTreeMap;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpualloc::{Allocator, AllocatorConfig, DeviceId};
use gpualloc_runtime::cuda::CudaBackend;
use gpualloc_runtime::Backend;

const SEED: &str = "GPUALLOC_FAULT_CAMPAIGN_SEED";
const D0: DeviceId = DeviceId(0);
/// How long a run may take before it counts as a hang.
const BOUND: Duration = Duration::from_secs(60);

/// Driver entry points the backend calls, and error codes their docs list.
const ENTRY_POINTS: &[(&str, &[u32])] = &[
    ("cuMemAlloc_v2", &[2]),
    ("cuMemFree_v2", &[1, 700]),
    ("cuMemCreate", &[2]),
    ("cuMemMap", &[2, 1]),
    ("cuMemSetAccess", &[1, 2]),
    ("cuMemUnmap", &[1]),
    ("cuMemAddressReserve", &[2]),
    ("cuMemRelease", &[1]),
    ("cuStreamCreate", &[2]),
    ("cuEventCreate", &[2]),
    ("cuEventRecord", &[1, 700]),
    ("cuEventQuery", &[700, 719]),
    ("cuEventSynchronize", &[700]),
    ("cuStreamWaitEvent", &[1]),
    ("cuLaunchHostFunc", &[1, 2]),
    ("cuMemcpyHtoDAsync_v2", &[1, 700]),
    ("cuMemcpyDtoHAsync_v2", &[1, 710]),
    ("cuStreamSynchronize", &[700, 719]),
    ("cuCtxSynchronize", &[700, 710]),
];

/// A small deterministic generator (xorshift), so a seed names one run.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// The faults of `seed`: two or three entries, `function:nth+count:code`.
fn faults_of(seed: u64) -> Vec<(&'static str, u64, u64, u32)> {
    let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
    (0..2 + rng.below(2))
        .map(|_| {
            let (name, codes) = ENTRY_POINTS[rng.below(ENTRY_POINTS.len() as u64) as usize];
            let code = codes[rng.below(codes.len() as u64) as usize];
            (name, 1 + rng.below(40), 1 + rng.below(3), code)
        })
        .collect()
}

/// What a run ended with (the child's last stdout line says).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Outcome {
    /// Every operation succeeded.
    Clean,
    /// Some operations failed, each with a typed error.
    TypedErrors,
    /// The device was lost (a sticky code), every later call failed typed.
    DeviceLost,
    /// The backend could not start (the fault hit its initialization): a typed error.
    NoBackend,
}

// ---------------------------------------------------------------- the child process

/// The workload, when this binary runs as the child; a no-op in the normal run.
#[test]
fn campaign_child() {
    let Ok(seed) = std::env::var(SEED) else {
        return;
    };
    let seed: u64 = seed.parse().unwrap();
    let cuda = match CudaBackend::new() {
        Ok(c) => c,
        Err(e) => {
            println!("OUTCOME NoBackend ({e})");
            return;
        }
    };
    let backend: Arc<dyn Backend> = cuda;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut errors = 0u64;
    let mut lost = false;
    for config in [
        AllocatorConfig::default().with_expandable_segments(false),
        AllocatorConfig::default().with_expandable_segments(true),
    ] {
        let r = rt.block_on(async {
            tokio::time::timeout(BOUND / 2, workload(&backend, config, seed, &mut errors)).await
        });
        match r {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                errors += 1;
                lost |= e.is_device_lost();
            }
            Err(_) => {
                println!("HANG in the workload");
                std::process::exit(11);
            }
        }
        lost |= backend.device_lost(D0).is_some();
    }
    if !lost {
        // Everything went back: no stream of the run is alive after its shutdown.
        // SAFETY: the library cudarc loaded is the emulator (this child's LD_LIBRARY_PATH),
        // which exports this function with exactly this signature.
        let live = unsafe {
            let lib = cudarc::driver::sys::culib();
            let f = lib
                .get::<unsafe extern "C" fn() -> u64>(b"gpualloc_emu_live_streams\0")
                .expect("the emulator's count");
            f()
        };
        if live != 0 {
            println!("LEAK: {live} streams alive after shutdown");
            std::process::exit(12);
        }
    }
    let outcome = if lost {
        Outcome::DeviceLost
    } else if errors > 0 {
        Outcome::TypedErrors
    } else {
        Outcome::Clean
    };
    println!("OUTCOME {outcome:?} ({errors} typed errors)");
}

/// One allocator's share of the run: 80 operations drawn from `seed`. Errors are counted
/// (they are typed: `gpualloc::Error`); wrong bytes read back exit the process with 10.
async fn workload(
    backend: &Arc<dyn Backend>,
    config: AllocatorConfig,
    seed: u64,
    errors: &mut u64,
) -> Result<(), gpualloc::Error> {
    let alloc = Allocator::builder()
        .config(config)
        .backend_instance(backend.clone())
        .build()?;
    let streams = [alloc.new_stream(D0)?, alloc.new_stream(D0)?];
    let mut rng = Rng(seed ^ 0xdead_beef);
    // Buffers whose write succeeded, with the byte written.
    let mut live: Vec<(gpualloc::DeviceBuffer, u8)> = Vec::new();
    for step in 0..80u64 {
        match rng.below(6) {
            0..=1 => {
                let size = [512, 4096, 1 << 20, 3 << 20, 12 << 20][rng.below(5) as usize];
                let s = &streams[rng.below(2) as usize];
                match alloc.malloc(size, s).await {
                    Ok(buf) => {
                        let byte = (step as u8).wrapping_mul(37) | 1;
                        match backend.copy_to_device(s.handle(), buf.ptr(), &vec![byte; 512]) {
                            Ok(()) => live.push((buf, byte)),
                            Err(_) => *errors += 1,
                        }
                    }
                    Err(_) => *errors += 1,
                }
            }
            2 => {
                if let Some((buf, byte)) = live.pop() {
                    let mut back = vec![0u8; 512];
                    match backend.copy_from_device(buf.stream().handle(), &mut back, buf.ptr()) {
                        Ok(()) if back != vec![byte; 512] => {
                            println!("DATA MISMATCH at step {step}");
                            std::process::exit(10);
                        }
                        Ok(()) => {}
                        Err(_) => *errors += 1,
                    }
                }
            }
            3 => {
                if !live.is_empty() {
                    let (buf, _) = live.swap_remove(rng.below(live.len() as u64) as usize);
                    // Used on the other stream too before it goes.
                    let other = if buf.stream() == &streams[0] {
                        &streams[1]
                    } else {
                        &streams[0]
                    };
                    if buf.record_stream(other).is_err() {
                        *errors += 1;
                    }
                    drop(buf);
                }
            }
            4 => {
                if alloc.empty_cache().await.is_err() {
                    *errors += 1;
                }
            }
            _ => {
                let s = &streams[rng.below(2) as usize];
                if s.completed().await.is_err() {
                    *errors += 1;
                }
            }
        }
    }
    drop(live);
    drop(streams);
    alloc.shutdown().await
}

// ---------------------------------------------------------------- the parent process

/// Runs seed `seed` in a child with its faults; its outcome, or why it failed.
fn run_seed(seed: u64) -> Result<Outcome, String> {
    let dir = gpualloc_cuda_emu::emulator_dir().expect("the emulator library is built");
    let mut path = dir.into_os_string();
    if let Some(old) = std::env::var_os("LD_LIBRARY_PATH") {
        path.push(":");
        path.push(old);
    }
    let spec: Vec<String> = faults_of(seed)
        .iter()
        .map(|(f, n, c, code)| format!("{f}:{n}+{c}:{code}"))
        .collect();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "campaign_child",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(SEED, seed.to_string())
        .env("GPUALLOC_EMU_FAULTS", spec.join(","))
        .env("LD_LIBRARY_PATH", path)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if start.elapsed() > BOUND {
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!(
                "seed {seed} [{}]: no end within {BOUND:?}",
                spec.join(",")
            ));
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let mut out = String::new();
    let mut err = String::new();
    use std::io::Read;
    let _ = child.stdout.take().unwrap().read_to_string(&mut out);
    let _ = child.stderr.take().unwrap().read_to_string(&mut err);
    let outcome = out
        .lines()
        .find_map(|l| l.split_once("OUTCOME ").map(|(_, rest)| rest))
        .and_then(|l| l.split_whitespace().next());
    let outcome = match (status.success(), outcome) {
        (true, Some("Clean")) => Outcome::Clean,
        (true, Some("TypedErrors")) => Outcome::TypedErrors,
        (true, Some("DeviceLost")) => Outcome::DeviceLost,
        (true, Some("NoBackend")) => Outcome::NoBackend,
        _ => {
            return Err(format!(
                "seed {seed} [{}]: {status}\n{out}\n{}",
                spec.join(","),
                err.lines().rev().take(15).collect::<Vec<_>>().join("\n")
            ))
        }
    };
    Ok(outcome)
}

#[test]
fn the_allocator_survives_injected_driver_faults() {
    let seeds: u64 = std::env::var("GPUALLOC_FAULT_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(12);
    let mut outcomes: BTreeMap<Outcome, u64> = BTreeMap::new();
    let mut per_entry: BTreeMap<&str, u64> = BTreeMap::new();
    let mut failures = Vec::new();
    for seed in 1..=seeds {
        for (f, _, _, _) in faults_of(seed) {
            *per_entry.entry(f).or_default() += 1;
        }
        match run_seed(seed) {
            Ok(o) => *outcomes.entry(o).or_default() += 1,
            Err(e) => failures.push(e),
        }
    }
    println!("{seeds} runs: {outcomes:?}; failed: {}", failures.len());
    println!("faults injected per entry point: {per_entry:?}");
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}
