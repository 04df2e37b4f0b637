//! The real CUDA backend, unchanged, on the emulated driver: this test binary re-executes
//! itself with the emulator first on `LD_LIBRARY_PATH` (as `libcuda.so`), and the child runs
//! the backend conformance suite on `CudaBackend` through cudarc's dynamic loading: on device
//! 0 of one device, and on device 3 of four.

use std::process::Command;
use std::sync::Arc;

use gpualloc_cuda::CudaBackend;
use gpualloc_runtime::{Backend, DeviceId};
use gpualloc_testkit::conformance::run_all;

const ROLE: &str = "GPUALLOC_CUDA_EMU_CHILD";
/// The device the child checks (its ordinal).
const DEVICE: &str = "GPUALLOC_CUDA_EMU_CHECK_DEVICE";

/// The child: runs every conformance check on the CUDA backend, printing each.
#[test]
fn child_entry() {
    if std::env::var_os(ROLE).is_none() {
        return;
    }
    let backend: Arc<dyn Backend> = CudaBackend::new().expect("the emulated driver loads");
    // What cudarc loaded as `libcuda.so` is the emulator's own file (the link resolved).
    let lib = CudaBackend::driver_library().expect("the driver library's file");
    assert!(
        lib.ends_with("libgpualloc_cuda_emu.so"),
        "loaded {}",
        lib.display()
    );
    let device = DeviceId(std::env::var(DEVICE).map_or(0, |d| d.parse().unwrap()));
    let results = run_all(&backend, device);
    let ran = results.len();
    let mut failures = Vec::new();
    for (name, result) in results {
        println!(
            "{name:<45} {}",
            if result.is_ok() { "ok" } else { "FAILED" }
        );
        if let Err(e) = result {
            failures.push(format!("{name}: {e}"));
        }
    }
    println!("conformance on CudaBackend (emulated driver, {device}): {ran} checks run");
    assert!(failures.is_empty(), "failures:\n{}", failures.join("\n"));
}

fn conformance_in_child(devices: u32, device: u32) {
    let dir = gpualloc_cuda_emu::emulator_dir().expect("the emulator library is built");
    let path = match std::env::var_os("LD_LIBRARY_PATH") {
        Some(old) => {
            let mut p = dir.clone().into_os_string();
            p.push(":");
            p.push(old);
            p
        }
        None => dir.clone().into_os_string(),
    };
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child_entry", "--nocapture", "--test-threads=1"])
        .env(ROLE, "1")
        .env(DEVICE, device.to_string())
        .env("GPUALLOC_EMU_DEVICES", devices.to_string())
        .env("LD_LIBRARY_PATH", path)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("{stdout}");
    assert!(out.status.success(), "child failed:\n{stdout}\n{stderr}");
    assert!(stdout.contains("checks run"), "{stdout}");
}

#[test]
fn cuda_backend_passes_conformance_on_the_emulated_driver() {
    conformance_in_child(1, 0);
}

#[test]
fn cuda_backend_passes_conformance_on_device_3_of_4() {
    conformance_in_child(4, 3);
}
