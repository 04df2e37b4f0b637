//! [`Stream`] and [`Event`]: the RAII handles users hold, over any [`Backend`].
//!
//! A `Stream` is cheap to clone (the clones share one backend stream, destroyed when the last
//! goes). `Stream::record_event` returns an [`Event`] whose [`Event::completed`] future is
//! woken by a host callback, never by polling. The callback is not queued on the user's
//! stream: a host function stops its stream until the driver's one callback thread has run
//! it (and that thread serves every stream of the process, one function at a time), so a
//! host function per event would stall the user's work behind every other library's
//! callbacks. It goes to the stream's *watcher*, a stream of our own on the same device that
//! waits for the event and then runs the callback; the user's stream only records events.
//! The watcher is made on the stream's first `record_event` (or `completed`) and shared by
//! the stream's clones and events.

use std::fmt;
use std::sync::Arc;

use crate::backend::Backend;
use crate::completion::{Completion, CompletionCell};
use crate::error::{BackendError, Result};
use crate::types::{DeviceId, EventHandle, StreamHandle};

/// On cache lines of its own (two, for adjacent-line prefetch): every buffer clones its
/// stream, and the reference counts of streams created one after another would otherwise
/// share a line, so tasks on different threads using different streams would still take
/// that line from each other on every allocation.
#[repr(align(128))]
struct StreamInner {
    backend: Arc<dyn Backend>,
    handle: StreamHandle,
    /// Made on the first event recorded (see the module's docs).
    watcher: std::sync::OnceLock<Arc<Watcher>>,
}

/// A stream of ours beside a user's stream, on the same device: it waits for the user's
/// events and runs the host functions that complete their futures, so that the user's stream
/// never stops at one. Destroyed when the stream and all of its events are gone.
struct Watcher {
    backend: Arc<dyn Backend>,
    handle: StreamHandle,
}

impl Drop for Watcher {
    fn drop(&mut self) {
        if let Err(e) = self.backend.stream_destroy(self.handle) {
            tracing::warn!(stream = ?self.handle, error = %e, "watcher stream_destroy failed");
        }
    }
}

impl Watcher {
    /// Completes `cell` once the stream has passed `event` (recorded already).
    fn complete_after(&self, event: EventHandle, cell: &crate::sync::Arc<CompletionCell>) {
        let waker = cell.clone();
        let armed = self
            .backend
            .stream_wait_event(self.handle, event)
            .and_then(|()| {
                self.backend
                    .launch_host_func(self.handle, Box::new(move |r| waker.complete(r)))
            });
        if let Err(e) = armed {
            cell.complete(Err(e));
        }
    }
}

impl StreamInner {
    /// The stream's watcher, made on first use.
    fn watcher(&self) -> Result<Arc<Watcher>> {
        if let Some(w) = self.watcher.get() {
            return Ok(w.clone());
        }
        let handle = self.backend.stream_create(self.handle.device)?;
        let made = Arc::new(Watcher {
            backend: self.backend.clone(),
            handle,
        });
        // Two threads may race here: the loser's watcher is dropped (and destroyed).
        Ok(self.watcher.get_or_init(|| made).clone())
    }
}

impl Drop for StreamInner {
    fn drop(&mut self) {
        if let Err(e) = self.backend.stream_destroy(self.handle) {
            tracing::warn!(stream = ?self.handle, error = %e, "stream_destroy failed");
        }
    }
}

/// An in-order queue of work on one device.
///
/// Clones share one backend stream; it is destroyed when the last clone goes. The allocator
/// holds clones where it needs the stream after the call that named it, so dropping a stream
/// is always safe, even with its blocks cached or its buffers still live:
/// - a buffer holds its allocation stream until it is dropped;
/// - the device actor keeps every stream that its cache still names (segments of that stream,
///   and streams a live buffer was `record_stream`ed on, whose event its free records) and
///   lets go of it once nothing cached names it: after `empty_cache` or the out-of-memory
///   chain released its segments. So a dropped stream's backend stream may live on until
///   then. Its cached blocks are not stranded (unlike PyTorch's, which serve only that stream
///   forever): once its work is done, the allocator's next miss hands its wholly free
///   segments to other streams, and gives back the free pages of its expandable segment
///   (`gpualloc_devices::orphans`).
#[derive(Clone)]
pub struct Stream {
    inner: Arc<StreamInner>,
}

impl fmt::Debug for Stream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Stream")
            .field("backend", &self.inner.backend.name())
            .field("handle", &self.inner.handle)
            .finish()
    }
}

impl PartialEq for Stream {
    fn eq(&self, other: &Self) -> bool {
        self.inner.handle == other.inner.handle
            && Arc::ptr_eq(&self.inner.backend, &other.inner.backend)
    }
}

impl Eq for Stream {}

impl Stream {
    /// Creates a new stream on `device`.
    pub fn new(backend: &Arc<dyn Backend>, device: DeviceId) -> Result<Stream> {
        let handle = backend.stream_create(device)?;
        Ok(Stream {
            inner: Arc::new(StreamInner {
                backend: backend.clone(),
                handle,
                watcher: std::sync::OnceLock::new(),
            }),
        })
    }

    /// Wraps a stream handle the caller already owns (e.g. one a backend adopted from
    /// another library); the backend's `stream_destroy` runs when the last clone goes.
    pub fn from_handle(backend: Arc<dyn Backend>, handle: StreamHandle) -> Stream {
        Stream {
            inner: Arc::new(StreamInner {
                backend,
                handle,
                watcher: std::sync::OnceLock::new(),
            }),
        }
    }

    /// The backend's handle.
    pub fn handle(&self) -> StreamHandle {
        self.inner.handle
    }

    /// The device this stream runs on.
    pub fn device(&self) -> DeviceId {
        self.inner.handle.device
    }

    /// How many clones of this stream exist, this one included. An allocator that keeps a
    /// clone of a stream its cache names finds its own the last one once the stream's users
    /// dropped theirs (and no buffer holds it).
    pub fn clone_count(&self) -> usize {
        Arc::strong_count(&self.inner)
    }

    /// The backend the stream belongs to.
    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.inner.backend
    }

    /// **Blocks the calling thread** until the stream's queued work is done. Never call it on
    /// an async runtime's worker thread: from async code await [`Stream::completed`] instead
    /// (or use `tokio::task::spawn_blocking`).
    pub fn synchronize(&self) -> Result<()> {
        self.inner.backend.stream_synchronize(self.inner.handle)
    }

    /// A future that resolves when all work queued so far has finished (an event recorded
    /// now, watched by the stream's watcher: nothing is queued on this stream but the
    /// record).
    pub fn completed(&self) -> Completion {
        match self.record_event() {
            Ok(event) => event.completed(),
            Err(e) => Completion::ready(Err(e)),
        }
    }

    /// Records a new event at the current end of the stream. Its completion future is armed
    /// on the first [`Event::completed`], on the stream's watcher (made by the stream's first
    /// record): the stream itself gets no host function.
    ///
    /// On a capturing stream the event is a point of the graph being captured: other streams
    /// may wait on it (they join the capture), but it has no completion future
    /// ([`Event::completed`] fails with `CaptureError::CapturedEvent`): its work runs when
    /// the graph is launched, and arming the watcher on it would pull the watcher into the
    /// capture (a fork never joined back, which fails the capture's end).
    pub fn record_event(&self) -> Result<Event> {
        let backend = &self.inner.backend;
        let watcher = self.inner.watcher()?;
        let captured = backend.capture_may_be_underway()
            && backend
                .stream_capture_status(self.inner.handle)?
                .is_capturing();
        let handle = backend.event_create(self.device())?;
        let event = Event {
            backend: backend.clone(),
            handle,
            cell: CompletionCell::new(),
            watcher,
            armed: std::sync::Once::new(),
            captured,
        };
        backend.event_record(handle, self.inner.handle)?;
        Ok(event)
    }

    /// Makes later work on this stream wait for `event`.
    pub fn wait_event(&self, event: &Event) -> Result<()> {
        self.inner
            .backend
            .stream_wait_event(self.inner.handle, event.handle)
    }
}

/// A recorded event. Dropping it destroys the backend event.
pub struct Event {
    backend: Arc<dyn Backend>,
    handle: EventHandle,
    cell: crate::sync::Arc<CompletionCell>,
    /// The watcher of the stream it was recorded on (not the stream: an event does not keep
    /// its stream alive).
    watcher: Arc<Watcher>,
    /// The completion is armed on the watcher once, on the first `completed()`.
    armed: std::sync::Once,
    /// Recorded on a capturing stream: a point of a graph, with no completion.
    captured: bool,
}

impl fmt::Debug for Event {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Event")
            .field("handle", &self.handle)
            .finish()
    }
}

impl Event {
    /// The backend's handle.
    pub fn handle(&self) -> EventHandle {
        self.handle
    }

    /// True when the stream has passed the event.
    pub fn query(&self) -> Result<bool> {
        self.backend.event_query(self.handle)
    }

    /// Blocks until the stream has passed the event.
    pub fn synchronize(&self) -> Result<()> {
        self.backend.event_synchronize(self.handle)
    }

    /// A future that resolves when the stream has passed the event (woken by a host
    /// callback on the stream's watcher, no polling). After a sticky device fault (a kernel's
    /// illegal address or `assert`) a future whose work finished just before the fault may
    /// resolve with `DeviceLost`: the driver runs no host function once the context faulted,
    /// and nothing tells finished from lost work then.
    pub fn completed(&self) -> Completion {
        if self.captured {
            return Completion::ready(Err(BackendError::Capture(
                crate::capture::CaptureError::CapturedEvent,
            )));
        }
        self.armed
            .call_once(|| self.watcher.complete_after(self.handle, &self.cell));
        Completion::new(self.cell.clone())
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        if let Err(e) = self.backend.event_destroy(self.handle) {
            tracing::warn!(event = ?self.handle, error = %e, "event_destroy failed");
        }
    }
}
