//! Sim streams and events through the RAII wrappers and the completion futures.
#![cfg(not(loom))] // the sim runs real threads; loom builds run only the loom models

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpualloc_runtime::sim::{Op, SimBackend, SimConfig};
use gpualloc_runtime::{Backend, BackendError, DeviceId, Stream};

const D0: DeviceId = DeviceId(0);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn event_completed_future_wakes_after_the_kernel() {
    let sim = SimBackend::new(SimConfig::fast(1)).unwrap();
    let backend: Arc<dyn Backend> = sim.clone();
    let stream = Stream::new(&backend, D0).unwrap();
    let done = Arc::new(AtomicBool::new(false));
    let flag = done.clone();
    sim.launch_kernel(stream.handle(), Duration::from_millis(30), move |_| {
        flag.store(true, Ordering::SeqCst);
        Ok(())
    })
    .unwrap();
    let t = Instant::now();
    let event = stream.record_event().unwrap();
    assert!(!event.query().unwrap());
    event.completed().await.unwrap();
    assert!(done.load(Ordering::SeqCst));
    assert!(t.elapsed() >= Duration::from_millis(25));
    assert!(event.query().unwrap());
    stream.completed().await.unwrap();
    // Woken by a host callback, not by polling the event.
    assert_eq!(sim.counts().get(Op::EventQuery), 2);
}

#[test]
fn destroying_an_event_with_a_pending_record_releases_its_waiters() {
    let sim = SimBackend::new(SimConfig::fast(1)).unwrap();
    let a = sim.stream_create(D0).unwrap();
    let b = sim.stream_create(D0).unwrap();
    let e = sim.event_create(D0).unwrap();
    sim.launch_kernel(a, Duration::from_millis(20), |_| Ok(()))
        .unwrap();
    sim.event_record(e, a).unwrap();
    sim.stream_wait_event(b, e).unwrap();
    sim.event_destroy(e).unwrap();
    assert!(matches!(
        sim.event_query(e),
        Err(BackendError::InvalidHandle(_))
    ));
    let t = Instant::now();
    sim.stream_synchronize(b).unwrap();
    assert!(
        t.elapsed() >= Duration::from_millis(10),
        "b waited for a's record"
    );
    sim.stream_destroy(a).unwrap();
    sim.stream_destroy(b).unwrap();
}

#[test]
fn rerecording_tracks_only_the_last_record() {
    let sim = SimBackend::new(SimConfig::fast(1)).unwrap();
    let slow = sim.stream_create(D0).unwrap();
    let fast = sim.stream_create(D0).unwrap();
    let e = sim.event_create(D0).unwrap();
    sim.launch_kernel(slow, Duration::from_millis(50), |_| Ok(()))
        .unwrap();
    sim.event_record(e, slow).unwrap();
    assert!(!sim.event_query(e).unwrap());
    // Re-recorded on an idle stream: the event now tracks that record only.
    sim.event_record(e, fast).unwrap();
    sim.event_synchronize(e).unwrap();
    assert!(sim.event_query(e).unwrap());
    sim.stream_destroy(slow).unwrap();
    sim.stream_destroy(fast).unwrap();
    sim.event_destroy(e).unwrap();
}

#[test]
fn device_synchronize_waits_for_every_stream_of_the_device_only() {
    let sim = SimBackend::new(SimConfig::fast(2)).unwrap();
    let s0 = sim.stream_create(D0).unwrap();
    let s1 = sim.stream_create(DeviceId(1)).unwrap();
    sim.launch_kernel(s0, Duration::from_millis(30), |_| Ok(()))
        .unwrap();
    sim.launch_kernel(s1, Duration::from_millis(300), |_| Ok(()))
        .unwrap();
    let t = Instant::now();
    sim.device_synchronize(D0).unwrap();
    let took = t.elapsed();
    assert!(
        took >= Duration::from_millis(25) && took < Duration::from_millis(250),
        "{took:?}"
    );
    sim.stream_destroy(s0).unwrap();
    sim.stream_destroy(s1).unwrap();
}
