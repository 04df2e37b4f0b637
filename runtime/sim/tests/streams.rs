//! Sim streams and events through the RAII wrappers and the completion futures.
#![cfg(not(loom))] // the sim runs real threads; loom builds run only the loom models

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpualloc_runtime::{Backend, BackendError, DeviceId, Stream};
use gpualloc_sim::{Op, SimBackend, SimConfig};

const D0: DeviceId = DeviceId(0);

/// A stream's events are watched by a stream of the library's own (its watcher), made at the
/// first record and shared by the stream's events: the user's stream gets no host function,
/// and the watcher goes with the last of the stream and its events.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_are_watched_on_one_stream_of_ours_that_goes_with_them() {
    let sim = SimBackend::new(SimConfig::fast(1)).unwrap();
    let backend: Arc<dyn Backend> = sim.clone();
    let before = sim.live_streams();
    let stream = Stream::new(&backend, D0).unwrap();
    assert_eq!(sim.live_streams(), before + 1);
    sim.reset_counts();
    let first = stream.record_event().unwrap();
    let second = stream.record_event().unwrap();
    assert_eq!(
        sim.live_streams(),
        before + 2,
        "one watcher for both events"
    );
    assert_eq!(
        sim.counts().get(Op::LaunchHostFunc),
        0,
        "recording queues no host function"
    );
    first.completed().await.unwrap();
    second.completed().await.unwrap();
    stream.completed().await.unwrap();
    assert_eq!(
        sim.counts().get(Op::LaunchHostFunc),
        3,
        "one per future asked for, on the watcher"
    );
    drop(stream);
    assert_eq!(
        sim.live_streams(),
        before + 1,
        "the events hold the watcher"
    );
    drop((first, second));
    assert_eq!(sim.live_streams(), before, "the watcher went with them");
}

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

/// `cuStreamDestroy` returns at once with work queued: the work still runs (its event
/// completes after it, its writes land), the handle is refused from the call on, and the
/// device-wide synchronizations (`device_synchronize`, and `free`, which synchronizes the
/// device as `cuMemFree` does) wait for it.
#[test]
fn destroying_a_stream_returns_at_once_and_device_syncs_wait_for_its_work() {
    let sim = SimBackend::new(SimConfig::fast(1)).unwrap();
    let p = sim.malloc(D0, 4096).unwrap();
    let other = sim.stream_create(D0).unwrap();
    let s = sim.stream_create(D0).unwrap();
    sim.launch_kernel(s, Duration::from_millis(300), move |m| m.fill(p, 4096, 7))
        .unwrap();
    let ev = sim.event_create(D0).unwrap();
    sim.event_record(ev, s).unwrap();
    let t = Instant::now();
    sim.stream_destroy(s).unwrap();
    let took = t.elapsed();
    assert!(
        took < Duration::from_millis(150),
        "the destroy waited {took:?}"
    );
    assert!(!sim.event_query(ev).unwrap(), "the work still runs");
    assert!(sim.stream_query(s).is_err(), "the handle is gone");
    sim.stream_wait_event(other, ev).unwrap();
    let mut v = [0u8; 16];
    sim.copy_from_device(other, &mut v, p).unwrap();
    assert_eq!(v, [7; 16], "the destroyed stream's kernel ran");
    assert!(t.elapsed() >= Duration::from_millis(250));

    for free in [false, true] {
        let s = sim.stream_create(D0).unwrap();
        sim.launch_kernel(s, Duration::from_millis(300), move |m| m.fill(p, 4096, 9))
            .unwrap();
        let t = Instant::now();
        sim.stream_destroy(s).unwrap();
        if free {
            sim.free(D0, p).unwrap();
        } else {
            sim.device_synchronize(D0).unwrap();
        }
        let took = t.elapsed();
        assert!(
            took >= Duration::from_millis(250),
            "free {free}: did not wait for the destroyed stream's work ({took:?})"
        );
    }
    assert_eq!(sim.kernel_failures(), 0, "no kernel ran on freed memory");
    sim.event_destroy(ev).unwrap();
    sim.stream_destroy(other).unwrap();
}

#[test]
fn unordered_users_names_streams_with_pending_work_on_a_range_until_waited_for() {
    let sim = SimBackend::new(SimConfig::fast(1)).unwrap();
    let a = sim.stream_create(D0).unwrap();
    let b = sim.stream_create(D0).unwrap();
    let c = sim.stream_create(D0).unwrap();
    let buf = sim.malloc(D0, 1 << 20).unwrap();
    let (open, gate) = crossbeam_channel::bounded::<()>(0);
    // b is held by a kernel, then has a memset of [buf + 4096, buf + 8192) and a kernel that
    // declares [buf + 64 KiB, + 4 KiB) queued behind it.
    sim.launch_kernel(b, Duration::ZERO, move |_| {
        let _ = gate.recv();
        Ok(())
    })
    .unwrap();
    sim.memset_async(b, gpualloc_runtime::DevicePtr(buf.0 + 4096), 7, 4096)
        .unwrap();
    sim.launch_kernel_touching(
        b,
        Duration::ZERO,
        &[(gpualloc_runtime::DevicePtr(buf.0 + 65536), 4096)],
        |_| Ok(()),
    )
    .unwrap();
    let users = |s, off: u64, len| {
        sim.unordered_users(s, gpualloc_runtime::DevicePtr(buf.0 + off), len)
            .unwrap()
    };
    assert_eq!(users(a, 0, 1 << 20), Some(vec![b]));
    assert_eq!(users(a, 8191, 1), Some(vec![b]), "last byte of the memset");
    assert_eq!(users(a, 8192, 4096), Some(vec![]), "just past the memset");
    assert_eq!(users(a, 0, 4096), Some(vec![]), "just before it");
    assert_eq!(
        users(a, 65536 + 4095, 1),
        Some(vec![b]),
        "declared by the kernel"
    );
    assert_eq!(
        users(b, 0, 1 << 20),
        Some(vec![]),
        "a stream's own work is ordered"
    );
    // a waits for an event recorded on b after that work: ordered, no longer reported for a.
    let e = sim.event_create(D0).unwrap();
    sim.event_record(e, b).unwrap();
    sim.stream_wait_event(a, e).unwrap();
    assert_eq!(users(a, 0, 1 << 20), Some(vec![]));
    assert_eq!(users(c, 0, 1 << 20), Some(vec![b]), "c did not wait");
    // Work b queues after the record is not covered by a's wait.
    sim.memset_async(b, buf, 1, 16).unwrap();
    assert_eq!(users(a, 0, 16), Some(vec![b]));
    drop(open);
    sim.stream_synchronize(b).unwrap();
    assert_eq!(
        users(c, 0, 1 << 20),
        Some(vec![]),
        "finished work is not pending"
    );
    assert_eq!(sim.counts().get(Op::UnorderedUsers), 10);
    sim.event_destroy(e).unwrap();
    for s in [a, b, c] {
        sim.stream_destroy(s).unwrap();
    }
    sim.free(D0, buf).unwrap();
}

/// `stream_idle` answers without queueing anything: false while work is queued, true once it
/// has run (the emulated driver's `cuStreamQuery`).
#[test]
fn stream_idle_says_whether_queued_work_has_run() {
    let sim = SimBackend::new(SimConfig::fast(1)).unwrap();
    let s = sim.stream_create(DeviceId(0)).unwrap();
    assert!(sim.stream_idle(s).unwrap());
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    sim.launch_host_func(
        s,
        Box::new(move |_| {
            let _ = rx.recv();
        }),
    )
    .unwrap();
    assert!(!sim.stream_idle(s).unwrap());
    assert!(!sim.stream_idle(s).unwrap(), "asking queued nothing");
    drop(tx);
    sim.stream_synchronize(s).unwrap();
    assert!(sim.stream_idle(s).unwrap());
    sim.stream_destroy(s).unwrap();
    assert!(
        sim.stream_idle(s).is_err(),
        "a destroyed stream is an error"
    );
}

/// An event recorded on a capturing stream forks and joins streams inside the capture, but
/// has no completion future: arming the watcher on it would pull the watcher into the
/// capture. The future fails with the driver's `CapturedEvent`, the capture ends cleanly,
/// and the stream's futures work again after it (fails on the code before: the watcher
/// joined the capture and the sim refused its host function).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_recorded_in_a_capture_forks_and_joins_but_has_no_future() {
    use gpualloc_runtime::capture::{CaptureError, CaptureMode};
    let sim = SimBackend::new(SimConfig::fast(1)).unwrap();
    let backend: Arc<dyn Backend> = sim.clone();
    let s = Stream::new(&backend, D0).unwrap();
    let other = Stream::new(&backend, D0).unwrap();
    backend
        .stream_begin_capture(s.handle(), CaptureMode::ThreadLocal)
        .unwrap();
    let fork = s.record_event().unwrap();
    other.wait_event(&fork).unwrap();
    let join = other.record_event().unwrap();
    s.wait_event(&join).unwrap();
    let captured = Err(BackendError::Capture(CaptureError::CapturedEvent));
    assert_eq!(fork.completed().await, captured);
    assert_eq!(s.completed().await, captured);
    let g = backend
        .stream_end_capture(s.handle())
        .expect("the capture ends: no watcher joined it");
    backend.graph_destroy(g).unwrap();
    s.completed().await.unwrap();
    other.completed().await.unwrap();
}

/// Calls that name a destroyed or never-made stream or event fail with `InvalidHandle` and are
/// counted, so a test can tell that its allocator kept every stream it used alive.
#[test]
fn calls_on_unknown_streams_and_events_are_refused_and_counted() {
    let sim = SimBackend::new(SimConfig::fast(1)).unwrap();
    let s = sim.stream_create(D0).unwrap();
    let e = sim.event_create(D0).unwrap();
    sim.event_record(e, s).unwrap();
    sim.stream_synchronize(s).unwrap();
    assert_eq!(sim.unknown_handle_calls(), 0);
    sim.stream_destroy(s).unwrap();
    sim.event_destroy(e).unwrap();
    for result in [
        sim.stream_synchronize(s),
        sim.stream_query(s).map(|_| ()),
        sim.stream_destroy(s),
        sim.event_query(e).map(|_| ()),
        sim.event_destroy(e),
    ] {
        assert!(
            matches!(result, Err(BackendError::InvalidHandle(_))),
            "{result:?}"
        );
    }
    assert_eq!(sim.unknown_handle_calls(), 5);
}
