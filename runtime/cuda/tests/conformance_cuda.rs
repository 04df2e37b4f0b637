//! Runs the backend conformance suite, unchanged, on the CUDA backend. Without a GPU (or a
//! driver) it prints why it skipped, and fails if `GPUALLOC_REQUIRE_GPU` is set, as
//! `scripts/gpu-check.sh` does.
#![cfg(not(loom))]

use std::sync::Arc;

use gpualloc_cuda::CudaBackend;
use gpualloc_runtime::{Backend, DeviceId};
use gpualloc_testkit::conformance::checks;

#[test]
fn cuda_passes_every_conformance_check() {
    let backend: Arc<dyn Backend> = match CudaBackend::new() {
        Ok(b) => b,
        Err(e) => {
            assert!(
                std::env::var_os("GPUALLOC_REQUIRE_GPU").is_none(),
                "GPUALLOC_REQUIRE_GPU is set but the CUDA backend is unavailable: {e}"
            );
            println!("skipped: {e}");
            return;
        }
    };
    // `GPUALLOC_TEST_DEVICE=N` checks device N (default 0): scripts/gpu-check.sh runs every GPU.
    let device = DeviceId(std::env::var("GPUALLOC_TEST_DEVICE").map_or(0, |d| d.parse().unwrap()));
    println!("conformance on {device}");
    assert_eq!(
        gpualloc_testkit::capture_is_supported(&backend, device),
        Ok(true),
        "the driver captures streams (CUDA 10+), so the capture checks must run"
    );
    let mut failures = Vec::new();
    for check in checks() {
        let result = (check.run)(&backend, device);
        println!(
            "{:<45} {}",
            check.name,
            if result.is_ok() { "ok" } else { "FAILED" }
        );
        if let Err(e) = result {
            failures.push(format!("{}: {e}", check.name));
        }
    }
    assert!(
        failures.is_empty(),
        "conformance failures on CUDA:\n{}",
        failures.join("\n")
    );
}
