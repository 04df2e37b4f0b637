//! What the conformance checks share: results as reasons, streams and allocations released on
//! drop, a host function that holds its stream until told.

use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

use gpualloc_runtime::types::{DeviceId, DevicePtr, StreamHandle};
use gpualloc_runtime::Backend;
use gpualloc_runtime::BackendError;

/// How long a gate waits before a check gives up (a hung backend fails, never hangs).
pub(crate) const GATE_TIMEOUT: Duration = Duration::from_secs(10);

pub(crate) fn ok<T>(r: Result<T, BackendError>, what: &str) -> Result<T, String> {
    r.map_err(|e| format!("{what}: {e}"))
}

pub(crate) fn ensure(cond: bool, msg: impl FnOnce() -> String) -> Result<(), String> {
    if cond {
        Ok(())
    } else {
        Err(msg())
    }
}

pub(crate) fn expect_err<T: std::fmt::Debug>(
    r: Result<T, BackendError>,
    what: &str,
    accept: impl Fn(&BackendError) -> bool,
) -> Result<(), String> {
    match r {
        Ok(v) => Err(format!("{what}: expected an error, got Ok({v:?})")),
        Err(e) if accept(&e) => Ok(()),
        Err(e) => Err(format!("{what}: wrong error {e:?}")),
    }
}

pub(crate) fn is_invalid(e: &BackendError) -> bool {
    matches!(
        e,
        BackendError::InvalidValue(_) | BackendError::InvalidHandle(_)
    )
}

/// What a rejected import may fail with: the driver's code for "not exported memory" varies
/// (the sim says `InvalidValue`, which its own tests assert).
pub(crate) fn is_rejected_import(e: &BackendError) -> bool {
    is_invalid(e)
        || matches!(
            e,
            BackendError::NotSupported(_) | BackendError::Driver { .. }
        )
}

pub(crate) fn is_oom_or_invalid(e: &BackendError) -> bool {
    e.is_oom() || matches!(e, BackendError::InvalidValue(_))
}

pub(crate) fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// A stream destroyed on drop (errors ignored: checks report their own).
pub(crate) struct TestStream<'a> {
    b: &'a Arc<dyn Backend>,
    pub(crate) h: StreamHandle,
}

impl<'a> TestStream<'a> {
    pub(crate) fn new(b: &'a Arc<dyn Backend>, d: DeviceId) -> Result<Self, String> {
        Ok(TestStream {
            b,
            h: ok(b.stream_create(d), "stream_create")?,
        })
    }
}

impl Drop for TestStream<'_> {
    fn drop(&mut self) {
        let _ = self.b.stream_destroy(self.h);
    }
}

/// A device allocation freed on drop.
pub(crate) struct TestAlloc<'a> {
    b: &'a Arc<dyn Backend>,
    d: DeviceId,
    pub(crate) p: DevicePtr,
}

impl<'a> TestAlloc<'a> {
    pub(crate) fn new(b: &'a Arc<dyn Backend>, d: DeviceId, size: u64) -> Result<Self, String> {
        Ok(TestAlloc {
            b,
            d,
            p: ok(b.malloc(d, size), "malloc")?,
        })
    }
}

impl Drop for TestAlloc<'_> {
    fn drop(&mut self) {
        let _ = self.b.free(self.d, self.p);
    }
}

/// A host function that blocks its stream until the returned sender is used (or dropped).
pub(crate) fn gate(b: &Arc<dyn Backend>, s: StreamHandle) -> Result<mpsc::Sender<()>, String> {
    let (tx, rx) = mpsc::channel::<()>();
    ok(
        b.launch_host_func(
            s,
            Box::new(move |_| {
                let _ = rx.recv_timeout(GATE_TIMEOUT);
            }),
        ),
        "launch_host_func (gate)",
    )?;
    Ok(tx)
}
