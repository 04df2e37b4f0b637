//! Asking for CUDA: without a GPU (or in a build without the `cuda` feature) building an
//! `Allocator` with the CUDA backend requested is the typed `Unavailable` error ("no CUDA
//! driver found" / "no CUDA device"), never a panic and never a silent fallback to the sim,
//! while the default still builds (the sim here). With a GPU (or `GPUALLOC_REQUIRE_GPU=1`,
//! as scripts/gpu-check.sh sets) CUDA must build and allocate. `GPUALLOC_BACKEND` is checked
//! in child processes of this test binary, so no test changes its own environment.

use std::process::Command;

use gpualloc::runtime::BackendError;
use gpualloc::{Allocator, AllocatorConfig, BackendKind, DeviceId, Error};

const CHILD: &str = "GPUALLOC_CUDA_REQUEST_CHILD";

fn gpu_required() -> bool {
    std::env::var("GPUALLOC_REQUIRE_GPU").is_ok_and(|v| v == "1")
}

fn gpu_present() -> bool {
    gpualloc::cuda_backend().is_ok()
}

/// Builds and allocates 1 MiB, writes and reads it back through the backend.
async fn build_and_use(kind: BackendKind) -> Result<&'static str, Error> {
    let alloc = Allocator::builder()
        .config(AllocatorConfig::default())
        .backend(kind)
        .build()?;
    let name = alloc.backend().name();
    let stream = alloc.new_stream(DeviceId(0))?;
    let buf = alloc.malloc(1 << 20, &stream).await?;
    assert_eq!(buf.len(), 1 << 20);
    assert_ne!(buf.ptr().0, 0);
    let data: Vec<u8> = (0..4096u32).map(|i| (i * 13 % 251) as u8).collect();
    let backend = alloc.backend();
    backend.copy_to_device(stream.handle(), buf.ptr(), &data)?;
    let mut back = vec![0u8; data.len()];
    backend.copy_from_device(stream.handle(), &mut back, buf.ptr())?;
    assert_eq!(back, data);
    drop(buf);
    alloc.shutdown().await?;
    Ok(name)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cuda_requested_is_a_typed_error_without_a_gpu_and_works_with_one() {
    let result = build_and_use(BackendKind::Cuda).await;
    if gpu_present() || gpu_required() {
        assert_eq!(result, Ok("cuda"), "a GPU is present or required");
        return;
    }
    match result {
        Err(Error::Backend(BackendError::Unavailable(msg))) => {
            println!("no GPU here, as expected: {msg}");
            let expected: &[&str] = if cfg!(feature = "cuda") {
                &[
                    "no CUDA driver found",
                    "no CUDA device",
                    "failed to initialize",
                ]
            } else {
                &["no cuda backend"]
            };
            assert!(expected.iter().any(|e| msg.contains(e)), "{msg}");
        }
        other => panic!("expected the typed Unavailable error, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sim_and_the_default_still_work() {
    assert_eq!(build_and_use(BackendKind::Sim).await, Ok("sim"));
    let default = build_and_use(BackendKind::Auto).await.unwrap();
    let env = std::env::var("GPUALLOC_BACKEND").unwrap_or_default();
    let expected = if env == "cuda" || (env != "sim" && gpu_present()) {
        "cuda"
    } else {
        "sim"
    };
    assert_eq!(default, expected);
}

/// Runs this binary's `child_entry` with `GPUALLOC_BACKEND=value`; returns its stdout.
fn child(value: &str) -> String {
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child_entry", "--nocapture", "--test-threads=1"])
        .env(CHILD, "1")
        .env("GPUALLOC_BACKEND", value)
        .env_remove("GPUALLOC_REQUIRE_GPU")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "child with GPUALLOC_BACKEND={value} failed (a panic?):\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// In a child: builds the default allocator and prints the outcome on one line.
#[test]
fn child_entry() {
    if std::env::var(CHILD).is_err() {
        return;
    }
    let rt = tokio::runtime::Runtime::new().unwrap();
    let line = match rt.block_on(build_and_use(BackendKind::Auto)) {
        Ok(name) => format!("OUTCOME built {name}"),
        Err(Error::Backend(BackendError::Unavailable(m))) => format!("OUTCOME unavailable {m}"),
        Err(Error::Backend(BackendError::InvalidValue(m))) => format!("OUTCOME invalid {m}"),
        Err(e) => format!("OUTCOME other {e}"),
    };
    println!("{line}");
}

fn outcome(stdout: &str) -> &str {
    stdout
        .lines()
        .find_map(|l| l.split_once("OUTCOME ").map(|(_, o)| o))
        .unwrap_or_else(|| panic!("no outcome in {stdout}"))
}

#[test]
fn gpualloc_backend_chooses_for_the_default_builder() {
    let cuda = child("cuda");
    if gpu_present() {
        assert_eq!(outcome(&cuda), "built cuda");
    } else {
        assert!(
            outcome(&cuda).starts_with("unavailable "),
            "GPUALLOC_BACKEND=cuda without a GPU must fail, not fall back: {cuda}"
        );
    }
    assert_eq!(outcome(&child("sim")), "built sim");
    assert_eq!(outcome(&child("SIM")), "built sim");
    let bogus = child("tpu");
    assert!(
        outcome(&bogus).starts_with("invalid ") && bogus.contains("tpu"),
        "{bogus}"
    );
}
