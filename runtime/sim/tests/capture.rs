//! Stream capture on the sim, beyond the conformance checks: kernels in graphs, the sim's
//! own departures (host functions), stale pointers in a replay, a capture's stream destroyed
//! under it, graphs launched inside a capture.
#![cfg(not(loom))] // the sim runs real threads; loom builds run only the loom models

use std::sync::Arc;
use std::time::Duration;

use gpualloc_runtime::capture::{CaptureError, CaptureMode, CaptureStatus};
use gpualloc_runtime::{Backend, BackendError, DeviceId, DevicePtr};
use gpualloc_sim::{SimBackend, SimConfig};

const D0: DeviceId = DeviceId(0);

fn sim() -> Arc<SimBackend> {
    SimBackend::new(SimConfig::fast(1)).unwrap()
}

/// A kernel that adds one to the little-endian counter at `p`.
fn increment(sim: &SimBackend, s: gpualloc_runtime::StreamHandle, p: DevicePtr) {
    sim.launch_kernel_touching(s, Duration::ZERO, &[(p, 8)], move |m| {
        let v = u64::from_le_bytes(m.read(p, 8)?.try_into().unwrap());
        m.write(p, &(v + 1).to_le_bytes())
    })
    .unwrap();
}

fn counter(sim: &SimBackend, s: gpualloc_runtime::StreamHandle, p: DevicePtr) -> u64 {
    let mut b = [0u8; 8];
    sim.copy_from_device(s, &mut b, p).unwrap();
    u64::from_le_bytes(b)
}

#[test]
fn a_captured_kernel_runs_once_per_launch_and_never_during_the_capture() {
    let sim = sim();
    let s = sim.stream_create(D0).unwrap();
    let p = sim.malloc(D0, 4096).unwrap();
    sim.memset_async(s, p, 0, 8).unwrap();
    sim.stream_begin_capture(s, CaptureMode::Global).unwrap();
    increment(&sim, s, p);
    increment(&sim, s, p);
    let g = sim.stream_end_capture(s).unwrap();
    assert_eq!(
        counter(&sim, s, p),
        0,
        "captured kernels ran during the capture"
    );
    let exec = sim.graph_instantiate(g).unwrap();
    for _ in 0..100 {
        sim.graph_launch(exec, s).unwrap();
    }
    sim.stream_synchronize(s).unwrap();
    assert_eq!(counter(&sim, s, p), 200);
    sim.graph_exec_destroy(exec).unwrap();
    sim.graph_destroy(g).unwrap();
    assert_eq!(sim.live_graphs(), (0, 0));
    sim.free(D0, p).unwrap();
    sim.stream_destroy(s).unwrap();
}

#[test]
fn a_graph_launched_in_a_capture_becomes_part_of_the_outer_graph() {
    let sim = sim();
    let s = sim.stream_create(D0).unwrap();
    let p = sim.malloc(D0, 4096).unwrap();
    sim.memset_async(s, p, 0, 8).unwrap();
    sim.stream_begin_capture(s, CaptureMode::Global).unwrap();
    increment(&sim, s, p);
    let inner = sim
        .graph_instantiate(sim.stream_end_capture(s).unwrap())
        .unwrap();
    sim.stream_begin_capture(s, CaptureMode::Global).unwrap();
    sim.graph_launch(inner, s).unwrap();
    sim.graph_launch(inner, s).unwrap();
    increment(&sim, s, p);
    let outer = sim
        .graph_instantiate(sim.stream_end_capture(s).unwrap())
        .unwrap();
    sim.graph_launch(outer, s).unwrap();
    sim.stream_synchronize(s).unwrap();
    assert_eq!(counter(&sim, s, p), 3);
    // The outer graph keeps the inner's work after the inner is destroyed.
    sim.graph_exec_destroy(inner).unwrap();
    sim.graph_launch(outer, s).unwrap();
    sim.stream_synchronize(s).unwrap();
    assert_eq!(counter(&sim, s, p), 6);
    sim.graph_exec_destroy(outer).unwrap();
    sim.free(D0, p).unwrap();
}

#[test]
fn a_host_function_on_a_capturing_stream_is_refused_and_the_capture_goes_on() {
    let sim = sim();
    let s = sim.stream_create(D0).unwrap();
    sim.stream_begin_capture(s, CaptureMode::Global).unwrap();
    let r = sim.launch_host_func(s, Box::new(|_| {}));
    assert!(matches!(r, Err(BackendError::NotSupported(_))), "{r:?}");
    assert!(matches!(
        sim.stream_capture_status(s).unwrap(),
        CaptureStatus::Active { .. }
    ));
    let g = sim.stream_end_capture(s).unwrap();
    sim.graph_destroy(g).unwrap();
}

#[test]
fn a_replay_over_freed_memory_is_a_sticky_stream_error_not_a_crash() {
    let sim = sim();
    let s = sim.stream_create(D0).unwrap();
    let p = sim.malloc(D0, 4096).unwrap();
    sim.stream_begin_capture(s, CaptureMode::Global).unwrap();
    sim.memset_async(s, p, 7, 4096).unwrap();
    let exec = sim
        .graph_instantiate(sim.stream_end_capture(s).unwrap())
        .unwrap();
    sim.free(D0, p).unwrap();
    let failures = sim.kernel_failures();
    sim.graph_launch(exec, s).unwrap();
    let r = sim.stream_synchronize(s);
    assert!(matches!(r, Err(BackendError::InvalidValue(_))), "{r:?}");
    assert_eq!(sim.kernel_failures(), failures + 1);
    sim.graph_exec_destroy(exec).unwrap();
}

#[test]
fn destroying_a_capturing_stream_ends_or_invalidates_its_capture() {
    let sim = sim();
    let (s1, s2) = (
        sim.stream_create(D0).unwrap(),
        sim.stream_create(D0).unwrap(),
    );
    let e = sim.event_create(D0).unwrap();
    // The joined stream goes: the capture is invalidated.
    sim.stream_begin_capture(s1, CaptureMode::Global).unwrap();
    sim.event_record(e, s1).unwrap();
    sim.stream_wait_event(s2, e).unwrap();
    sim.stream_destroy(s2).unwrap();
    assert!(matches!(
        sim.stream_capture_status(s1).unwrap(),
        CaptureStatus::Invalidated { .. }
    ));
    assert_eq!(
        sim.stream_end_capture(s1).unwrap_err().capture(),
        Some(CaptureError::Invalidated)
    );
    // The origin goes: the capture ends, and its other stream runs its work again.
    let s2 = sim.stream_create(D0).unwrap();
    sim.stream_begin_capture(s1, CaptureMode::Global).unwrap();
    sim.event_record(e, s1).unwrap();
    sim.stream_wait_event(s2, e).unwrap();
    sim.stream_destroy(s1).unwrap();
    assert_eq!(sim.stream_capture_status(s2).unwrap(), CaptureStatus::None);
    let p = sim.malloc(D0, 4096).unwrap();
    sim.memset_async(s2, p, 3, 16).unwrap();
    sim.stream_synchronize(s2).unwrap();
    assert_eq!(sim.live_graphs(), (0, 0));
    sim.free(D0, p).unwrap();
}

#[test]
fn a_thread_local_thread_ignores_another_threads_global_capture() {
    let sim = sim();
    let s = sim.stream_create(D0).unwrap();
    sim.stream_begin_capture(s, CaptureMode::Global).unwrap();
    let p = std::thread::scope(|sc| {
        sc.spawn(|| {
            let before = sim.exchange_capture_mode(CaptureMode::ThreadLocal).unwrap();
            assert_eq!(
                before,
                CaptureMode::Global,
                "every thread starts in global mode"
            );
            let p = sim.malloc(D0, 4096);
            sim.exchange_capture_mode(before).unwrap();
            p
        })
        .join()
        .unwrap()
    })
    .unwrap();
    let g = sim.stream_end_capture(s).unwrap();
    sim.graph_destroy(g).unwrap();
    sim.free(D0, p).unwrap();
}
