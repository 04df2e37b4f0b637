//! Runs the backend conformance suite on a two-device sim with zero latency, on both
//! devices, and reports every check by name.
#![cfg(not(loom))] // the sim runs real threads; loom builds run only the loom models

use std::sync::Arc;

use gpualloc_runtime::{Backend, DeviceId};
use gpualloc_sim::{SimBackend, SimConfig};
use gpualloc_testkit::conformance::checks;

#[test]
fn sim_passes_every_conformance_check() {
    let sim = SimBackend::new(SimConfig::fast(2)).unwrap();
    let backend: Arc<dyn Backend> = sim.clone();
    let mut failures = Vec::new();
    assert_eq!(
        gpualloc_testkit::capture_is_supported(&backend, DeviceId(0)),
        Ok(true)
    );
    for device in [DeviceId(0), DeviceId(1)] {
        for check in checks() {
            let result = (check.run)(&backend, device);
            println!(
                "{device} {:<45} {}",
                check.name,
                if result.is_ok() { "ok" } else { "FAILED" }
            );
            if let Err(e) = result {
                failures.push(format!("{device} {}: {e}", check.name));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "conformance failures:\n{}",
        failures.join("\n")
    );
    assert!(checks().len() >= 16);
    // Every check cleans up after itself.
    assert_eq!(sim.live_allocations(), 0);
    assert_eq!(sim.live_streams(), 0);
    assert_eq!(sim.live_graphs(), (0, 0));
    assert_eq!(sim.live_reservations(), 0);
    assert_eq!(sim.live_phys(), 0);
    assert_eq!(sim.used_bytes(DeviceId(0)).unwrap(), 0);
    assert_eq!(sim.used_bytes(DeviceId(1)).unwrap(), 0);
}

#[test]
fn sim_passes_the_suite_with_real_latencies() {
    // The default (real-hardware) latency model must not change any outcome.
    let sim = SimBackend::new(SimConfig {
        devices: 2,
        ..SimConfig::default()
    })
    .unwrap();
    let backend: Arc<dyn Backend> = sim;
    for check in checks() {
        if let Err(e) = (check.run)(&backend, DeviceId(0)) {
            panic!("{}: {e}", check.name);
        }
    }
}
