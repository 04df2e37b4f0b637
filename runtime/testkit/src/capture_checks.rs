//! Conformance checks of stream capture and graphs (`gpualloc_runtime::capture`), written
//! against the `Backend` trait alone. A backend that answers `NotSupported` to
//! `stream_begin_capture` passes them vacuously; the sim's and the emulated driver's own
//! tests assert that they support capture.

use std::sync::Arc;

use gpualloc_runtime::capture::{CaptureError, CaptureMode, CaptureStatus, GraphHandle};
use gpualloc_runtime::types::{DeviceId, DevicePtr, StreamHandle};
use gpualloc_runtime::{Backend, BackendError};

use crate::conformance::{ensure, expect_err, is_invalid, ok, TestAlloc, TestStream};

/// True when the backend captures streams (an empty capture on a new stream of `d` ends in a
/// graph): the sim's and the CUDA backend's conformance runs assert it, so the capture checks
/// cannot pass there by having nothing to test.
pub fn capture_is_supported(b: &Arc<dyn Backend>, d: DeviceId) -> Result<bool, String> {
    let s = TestStream::new(b, d)?;
    supports_capture(b, s.h)
}

/// False when the backend has no capture (the check then has nothing to test).
fn supports_capture(b: &Arc<dyn Backend>, s: StreamHandle) -> Result<bool, String> {
    match b.stream_begin_capture(s, CaptureMode::Global) {
        Ok(()) => {
            let g = ok(b.stream_end_capture(s), "stream_end_capture (empty)")?;
            ok(b.graph_destroy(g), "graph_destroy (empty)")?;
            Ok(true)
        }
        Err(BackendError::NotSupported(_)) => Ok(false),
        Err(e) => Err(format!("stream_begin_capture: {e}")),
    }
}

fn is_capture(e: &BackendError, want: CaptureError) -> bool {
    e.capture() == Some(want)
}

/// Ends a capture that a check expects to have failed, and checks how.
fn end_fails(
    b: &Arc<dyn Backend>,
    s: StreamHandle,
    want: CaptureError,
    what: &str,
) -> Result<(), String> {
    expect_err(b.stream_end_capture(s), what, |e| is_capture(e, want))
}

fn read(
    b: &Arc<dyn Backend>,
    s: StreamHandle,
    p: DevicePtr,
    len: usize,
) -> Result<Vec<u8>, String> {
    let mut v = vec![0u8; len];
    ok(b.copy_from_device(s, &mut v, p), "copy_from_device")?;
    Ok(v)
}

/// A step captured on two streams (a fork through an event and a join back) replays 100
/// times, each launch doing the whole step on that launch's input, with the captured
/// pointers; nothing captured runs during the capture.
pub(crate) fn graph_replays_captured_work(b: &Arc<dyn Backend>, d: DeviceId) -> Result<(), String> {
    let s1 = TestStream::new(b, d)?;
    let s2 = TestStream::new(b, d)?;
    if !supports_capture(b, s1.h)? {
        return Ok(());
    }
    let len = 4096u64;
    let (x, y, z) = (
        TestAlloc::new(b, d, len)?,
        TestAlloc::new(b, d, len)?,
        TestAlloc::new(b, d, len)?,
    );
    ok(b.copy_to_device(s1.h, y.p, &[0xEE; 4096]), "copy_to_device")?;
    let fork = ok(b.event_create(d), "event_create")?;
    let join = ok(b.event_create(d), "event_create")?;
    ok(b.stream_begin_capture(s1.h, CaptureMode::Global), "begin")?;
    // y = x on s1; fork s2 after it; z = y on s2; join s1 back; x = 0 on s1.
    // SAFETY: device memory on both sides, checked by the backend.
    ok(
        unsafe { b.memcpy_async(s1.h, y.p.0, x.p.0, len) },
        "memcpy x->y",
    )?;
    ok(b.event_record(fork, s1.h), "event_record (fork)")?;
    ok(b.stream_wait_event(s2.h, fork), "stream_wait_event (fork)")?;
    let status = ok(b.stream_capture_status(s2.h), "capture status")?;
    let own = ok(b.stream_capture_status(s1.h), "capture status")?;
    ensure(status.is_capturing() && status == own, || {
        format!("a stream that waits on a captured event joins the capture: {status:?} vs {own:?}")
    })?;
    // SAFETY: as above.
    ok(
        unsafe { b.memcpy_async(s2.h, z.p.0, y.p.0, len) },
        "memcpy y->z",
    )?;
    ok(b.event_record(join, s2.h), "event_record (join)")?;
    ok(b.stream_wait_event(s1.h, join), "stream_wait_event (join)")?;
    ok(b.memset_async(s1.h, x.p, 0, len), "memset x")?;
    let graph = ok(b.stream_end_capture(s1.h), "stream_end_capture")?;
    for s in [s1.h, s2.h] {
        let st = ok(b.stream_capture_status(s), "capture status")?;
        ensure(st == CaptureStatus::None, || {
            format!("after the end: {st:?}")
        })?;
    }
    ensure(read(b, s1.h, y.p, 16)? == vec![0xEE; 16], || {
        "captured work ran during the capture".into()
    })?;
    let exec = ok(b.graph_instantiate(graph), "graph_instantiate")?;
    ok(b.graph_destroy(graph), "graph_destroy")?;
    for round in 0..100u8 {
        let input = vec![round.wrapping_mul(7).wrapping_add(1); len as usize];
        ok(
            b.copy_to_device(s1.h, x.p, &input),
            "copy_to_device (input)",
        )?;
        ok(b.graph_launch(exec, s1.h), "graph_launch")?;
        ok(b.stream_synchronize(s1.h), "stream_synchronize")?;
        ensure(read(b, s1.h, z.p, len as usize)? == input, || {
            format!("launch {round}: z is not the input")
        })?;
        ensure(read(b, s1.h, x.p, 8)? == vec![0; 8], || {
            format!("launch {round}: x was not cleared")
        })?;
    }
    ok(b.graph_exec_destroy(exec), "graph_exec_destroy")?;
    expect_err(b.graph_exec_destroy(exec), "exec destroyed twice", |e| {
        matches!(e, BackendError::InvalidHandle(_))
    })?;
    expect_err(
        b.graph_launch(exec, s1.h),
        "launch of a destroyed exec",
        |e| matches!(e, BackendError::InvalidHandle(_)),
    )?;
    ok(b.event_destroy(fork), "event_destroy")?;
    ok(b.event_destroy(join), "event_destroy")
}

/// Synchronizing or querying a capturing stream, and an unsafe call from the capturing
/// thread, are refused and invalidate the capture; querying a captured event is refused
/// without invalidating it.
pub(crate) fn capture_refuses_conflicting_calls(
    b: &Arc<dyn Backend>,
    d: DeviceId,
) -> Result<(), String> {
    let s = TestStream::new(b, d)?;
    if !supports_capture(b, s.h)? {
        return Ok(());
    }
    let unsupported = |e: &BackendError| is_capture(e, CaptureError::Unsupported);
    // Synchronizing the capturing stream.
    ok(b.stream_begin_capture(s.h, CaptureMode::Relaxed), "begin")?;
    expect_err(
        b.stream_synchronize(s.h),
        "synchronize a capturing stream",
        unsupported,
    )?;
    let st = ok(b.stream_capture_status(s.h), "status")?;
    ensure(matches!(st, CaptureStatus::Invalidated { .. }), || {
        format!("after a refused call the capture reads {st:?}")
    })?;
    expect_err(
        b.memset_async(s.h, DevicePtr(0), 0, 0),
        "work on an invalidated capture",
        |_| true,
    )
    .or(Ok::<(), String>(()))?;
    end_fails(b, s.h, CaptureError::Invalidated, "end after synchronize")?;
    // Querying it.
    ok(b.stream_begin_capture(s.h, CaptureMode::Relaxed), "begin")?;
    expect_err(b.stream_query(s.h), "query a capturing stream", unsupported)?;
    end_fails(b, s.h, CaptureError::Invalidated, "end after query")?;
    // A malloc from the capturing thread in global mode.
    ok(b.stream_begin_capture(s.h, CaptureMode::Global), "begin")?;
    expect_err(
        b.malloc(d, 4096),
        "malloc during the thread's own capture",
        unsupported,
    )?;
    end_fails(b, s.h, CaptureError::Invalidated, "end after malloc")?;
    // The same malloc in relaxed thread mode is allowed and leaves the capture valid.
    ok(b.stream_begin_capture(s.h, CaptureMode::Global), "begin")?;
    let before = ok(
        b.exchange_capture_mode(CaptureMode::Relaxed),
        "exchange mode",
    )?;
    let p = b.malloc(d, 4096);
    let restored = ok(b.exchange_capture_mode(before), "exchange mode back")?;
    ensure(restored == CaptureMode::Relaxed, || {
        format!("exchange returned {restored:?}, the mode it replaced was Relaxed")
    })?;
    let p = ok(p, "malloc in relaxed mode during a capture")?;
    let g = ok(b.stream_end_capture(s.h), "end after a relaxed malloc")?;
    ok(b.graph_destroy(g), "graph_destroy")?;
    ok(b.free(d, p), "free")?;
    // A captured event may not be queried or synchronized; the capture stays valid.
    let e = ok(b.event_create(d), "event_create")?;
    ok(b.stream_begin_capture(s.h, CaptureMode::Relaxed), "begin")?;
    ok(b.event_record(e, s.h), "event_record")?;
    let captured = |e: &BackendError| is_capture(e, CaptureError::CapturedEvent);
    expect_err(b.event_query(e), "query a captured event", captured)?;
    expect_err(
        b.event_synchronize(e),
        "synchronize a captured event",
        captured,
    )?;
    let g = ok(b.stream_end_capture(s.h), "end after event refusals")?;
    ok(b.graph_destroy(g), "graph_destroy")?;
    ok(b.event_destroy(e), "event_destroy")
}

/// Another thread's unsafe call invalidates a global-mode capture unless that thread is in
/// relaxed mode; a thread-local capture ignores other threads.
pub(crate) fn capture_modes_across_threads(
    b: &Arc<dyn Backend>,
    d: DeviceId,
) -> Result<(), String> {
    let s = TestStream::new(b, d)?;
    if !supports_capture(b, s.h)? {
        return Ok(());
    }
    let other = |relaxed: bool| -> Result<Result<DevicePtr, BackendError>, String> {
        std::thread::scope(|scope| {
            scope
                .spawn(|| {
                    if relaxed {
                        let before = b.exchange_capture_mode(CaptureMode::Relaxed)?;
                        let r = b.malloc(d, 4096);
                        b.exchange_capture_mode(before)?;
                        r
                    } else {
                        b.malloc(d, 4096)
                    }
                })
                .join()
                .map_err(|_| "the other thread panicked".to_string())
        })
    };
    let free = |r: Result<DevicePtr, BackendError>, what: &str| -> Result<(), String> {
        let p = ok(r, what)?;
        ok(b.free(d, p), "free")
    };
    // The pointers are freed once each capture is over: a free from this thread during its
    // own capture would be refused.
    ok(
        b.stream_begin_capture(s.h, CaptureMode::ThreadLocal),
        "begin",
    )?;
    let p = other(false)?;
    let g = b.stream_end_capture(s.h);
    free(p, "another thread's malloc during a thread-local capture")?;
    ok(
        b.graph_destroy(ok(g, "end of the thread-local capture")?),
        "graph_destroy",
    )?;
    ok(b.stream_begin_capture(s.h, CaptureMode::Global), "begin")?;
    let p = other(true)?;
    let refused = other(false)?;
    let end = b.stream_end_capture(s.h);
    free(p, "a relaxed thread's malloc during a global capture")?;
    expect_err(
        refused,
        "another thread's malloc during a global capture",
        |e| is_capture(e, CaptureError::Unsupported),
    )?;
    expect_err(end, "end after another thread's malloc", |e| {
        is_capture(e, CaptureError::Invalidated)
    })
}

/// The boundaries of a capture: ends on the stream it began on, from its thread, with its
/// forks joined; no dependency crosses into it or merges two captures.
pub(crate) fn capture_keeps_its_boundaries(
    b: &Arc<dyn Backend>,
    d: DeviceId,
) -> Result<(), String> {
    let s1 = TestStream::new(b, d)?;
    let s2 = TestStream::new(b, d)?;
    if !supports_capture(b, s1.h)? {
        return Ok(());
    }
    let e = ok(b.event_create(d), "event_create")?;
    let outside = ok(b.event_create(d), "event_create")?;
    ok(b.event_record(outside, s2.h), "event_record outside")?;
    let fork = |what: &str| -> Result<(), String> {
        ok(b.stream_begin_capture(s1.h, CaptureMode::Global), what)?;
        ok(b.event_record(e, s1.h), what)?;
        ok(b.stream_wait_event(s2.h, e), what)?;
        ok(b.memset_async(s2.h, DevicePtr(0), 0, 0), what)
    };
    // Already capturing.
    ok(b.stream_begin_capture(s1.h, CaptureMode::Global), "begin")?;
    expect_err(
        b.stream_begin_capture(s1.h, CaptureMode::Global),
        "begin twice",
        |_| true,
    )?;
    destroy(b, ok(b.stream_end_capture(s1.h), "end")?)?;
    // A fork not joined back.
    fork("fork")?;
    end_fails(b, s1.h, CaptureError::Unjoined, "end with s2 unjoined")?;
    ensure(
        ok(b.stream_capture_status(s2.h), "status")? == CaptureStatus::None,
        || "an ended capture's joined stream still captures".into(),
    )?;
    // Ending on the joined stream, and from another thread.
    fork("fork")?;
    expect_err(b.stream_end_capture(s2.h), "end on a joined stream", |e| {
        is_capture(e, CaptureError::Unmatched)
    })?;
    let from_other = std::thread::scope(|sc| sc.spawn(|| b.stream_end_capture(s1.h)).join());
    let from_other = from_other.map_err(|_| "the other thread panicked".to_string())?;
    expect_err(from_other, "end from another thread", |e| {
        is_capture(e, CaptureError::WrongThread)
    })?;
    ok(b.event_record(e, s2.h), "join record")?;
    ok(b.stream_wait_event(s1.h, e), "join wait")?;
    destroy(b, ok(b.stream_end_capture(s1.h), "end once joined")?)?;
    // Ending a stream that is not capturing.
    expect_err(b.stream_end_capture(s1.h), "end without a capture", |e| {
        is_capture(e, CaptureError::Unmatched)
    })?;
    // Waiting, inside a capture, on an event recorded outside it.
    ok(b.stream_begin_capture(s1.h, CaptureMode::Global), "begin")?;
    expect_err(
        b.stream_wait_event(s1.h, outside),
        "wait on an outside event",
        |e| is_capture(e, CaptureError::Isolation),
    )?;
    end_fails(b, s1.h, CaptureError::Invalidated, "end after isolation")?;
    // Waiting on an event of another capture.
    ok(b.stream_begin_capture(s1.h, CaptureMode::Global), "begin")?;
    ok(
        b.stream_begin_capture(s2.h, CaptureMode::Global),
        "begin second",
    )?;
    ok(b.event_record(e, s1.h), "record in the first")?;
    expect_err(b.stream_wait_event(s2.h, e), "wait across captures", |e| {
        is_capture(e, CaptureError::Merge)
    })?;
    end_fails(b, s2.h, CaptureError::Invalidated, "end of the merged one")?;
    destroy(b, ok(b.stream_end_capture(s1.h), "end of the first")?)?;
    ok(b.event_destroy(e), "event_destroy")?;
    ok(b.event_destroy(outside), "event_destroy")
}

fn destroy(b: &Arc<dyn Backend>, g: GraphHandle) -> Result<(), String> {
    ok(b.graph_destroy(g), "graph_destroy")?;
    expect_err(b.graph_destroy(g), "graph destroyed twice", is_invalid)
}
