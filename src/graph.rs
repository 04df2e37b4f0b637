//! CUDA graphs: capturing a stream's work with the allocator's buffers in it, into graph
//! memory pools (PyTorch's `torch.cuda.graph(g, pool=...)` and `graph_pool_handle()`).
//!
//! A graph bakes in the device pointers its work was captured with. So every buffer
//! allocated during a capture comes from a [`GraphPool`], whose memory no request outside it
//! ever gets, and stays reserved while anything holds the pool: a [`GraphPool`] handle, a
//! [`Capture`] under way, or a [`Graph`] captured into it, which holds it until it is dropped
//! and its launches, on whichever streams, have run ([`Graph`]). Several graphs captured one
//! after another into one pool share its memory (PyTorch's `pool=` sharing): a buffer one
//! capture freed serves the next capture's request of the same size on the same stream, so
//! graphs that run one at a time need the memory of the largest, not of all. When the last
//! holder goes, the pool is released and its free segments go back to the device at once
//! (a buffer still alive keeps its segment until it is dropped and the cache is emptied).
//!
//! ```no_run
//! # async fn demo(alloc: gpualloc::Allocator, stream: gpualloc::Stream) -> Result<(), gpualloc::Error> {
//! use gpualloc::CaptureMode;
//! let pool = alloc.graph_pool(stream.device()).await?;
//! let capture = pool.begin_capture(&stream, CaptureMode::Relaxed).await?;
//! let out = alloc.malloc(4 << 20, &stream).await?; // from the pool
//! // ... enqueue the step's work on `stream` (kernels through cudarc, copies) ...
//! let graph = capture.end().await?;
//! for _ in 0..100 {
//!     graph.launch(&stream)?; // no allocator call
//! }
//! # drop(out); Ok(()) }
//! ```
//!
//! A capture begins once the work queued on its stream has run (awaited, as PyTorch's
//! `torch.cuda.graph` synchronizes the device before it): a block freed on the stream may
//! serve the capture, and the graph, launched on any stream, must not write it while that
//! work still uses it. The same holds for a stream that joins the capture later (through an
//! event) and gets its own free blocks of the pool there: once the capture is announced,
//! `begin_capture` also waits for the queued work of every other stream with segments in the
//! pool, and until the capture ends a free of the pool's blocks on a stream outside it is
//! held back (made when the capture ends), and so is a free, after that stream joined the
//! capture, of a block the stream got before it joined (its work queued between the begin
//! and the join is eager, not the graph's).
//!
//! While a capture is under way (PyTorch's rules, `gpualloc_devices`' `pools/capture.rs`):
//! allocations on the capturing stream, and on streams that joined the capture through an
//! event recorded in it, come from the capture's pool; the thread cache is bypassed (a
//! parked block of the default pools must not serve a captured request); no event is
//! recorded on a capturing stream or queried, a free of a buffer used on other streams waits
//! until no capture is under way; the out-of-memory chain does not synchronize, and
//! [`Allocator::empty_cache`] is refused ([`AllocError::CaptureUnderway`]). Every driver
//! call of the allocator runs in relaxed capture mode, so it never invalidates a capture,
//! this one or a user's own on another thread.
//!
//! **The capture mode from async code.** CUDA binds a capture begun in global or
//! thread-local mode to the OS thread that began it: only that thread may end it
//! (`CaptureError::WrongThread` elsewhere), and while it lasts, unsafe driver calls made on
//! that thread (by any task a runtime worker runs there) invalidate it. A task on a
//! multi-threaded runtime moves between threads at each `.await`, so from async code use
//! `CaptureMode::Relaxed` (the allocator's own calls never invalidate a capture in any mode).
//! The strict modes are for a capture begun and ended on one thread: a current-thread
//! runtime, or a `block_on` thread. A capture the driver would not end (ended from the wrong
//! thread) stays under way on its stream: [`Capture::end`] reports the error and drops the
//! capture's record in the allocator, and the stream captures until it is ended on its
//! thread or destroyed.
//!
//! A named [`Pool`] takes captures too ([`Pool::begin_capture`], PyTorch's
//! `torch.cuda.graph(g, pool=mempool)`): while a capture into it is under way or a graph
//! captured into it lives, it cannot sleep ([`AllocError::PoolInGraph`]).
//!
//! A malloc on a stream that captures without a [`Capture`] of ours (begun through the
//! backend or cudarc directly) gets PyTorch's behaviour: the request is served from the
//! default pools, and what the graph captured may be handed out again after the buffer is
//! dropped. Capture through a graph pool to keep a graph's memory.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, PoisonError};

use gpualloc_devices::{free_detached, AllocError, MemPoolId};
use gpualloc_runtime::capture::{CaptureMode, GraphExecHandle};
use gpualloc_runtime::{Backend, DeviceId, EventHandle, Stream, StreamHandle};

use crate::actor::DeviceActor;
use crate::{Allocator, Error, Pool};

/// A graph memory pool on one device. Cheap to clone; see the module docs.
#[derive(Clone, Debug)]
pub struct GraphPool {
    inner: Arc<GraphPoolInner>,
}

#[derive(Debug)]
struct GraphPoolInner {
    alloc: Allocator,
    device: DeviceId,
    id: MemPoolId,
}

impl Drop for GraphPoolInner {
    /// The last holder went: the pool is released and its free segments are freed, off the
    /// caller's thread (a driver call per segment).
    fn drop(&mut self) {
        let Ok(actor) = self.alloc.device_actor(self.device) else {
            return;
        };
        let (actor, id) = (actor.clone(), self.id);
        let runtime = actor.runtime.clone();
        drop(runtime.spawn_blocking(move || release_graph_pool(&actor, id)));
    }
}

/// Releases pool `id` and frees its whole free segments.
fn release_graph_pool(actor: &Arc<DeviceActor>, id: MemPoolId) {
    let (detached, in_flight) = {
        let mut held = actor.mailbox.hold_blocking();
        let core = &mut held.state().core;
        let detached = core
            .release_pool(id)
            .and_then(|()| core.detach_pool_segments(id));
        // Shutdown waits for these frees, and a request out of memory meanwhile for their end.
        let in_flight = actor.segment_frees_begin(&detached);
        (detached, in_flight)
    };
    match detached {
        Ok(segments) => {
            if let Err(e) = free_detached(actor.backend.as_ref(), actor.device, &segments) {
                tracing::warn!(pool = id.0, error = %e, "freeing a graph pool's segments");
            }
            // Back with the device: no longer counted against the cap.
            actor
                .mailbox
                .hold_blocking()
                .state()
                .core
                .finish_segment_frees(&segments);
            drop(in_flight);
            if !segments.is_empty() {
                actor.signals.waiters.wake_head();
            }
        }
        Err(AllocError::Shutdown) => {}
        Err(e) => tracing::warn!(pool = id.0, error = %e, "releasing a graph pool"),
    }
}

impl Allocator {
    /// A new graph memory pool on `device` (PyTorch's `graph_pool_handle()`).
    pub async fn graph_pool(&self, device: DeviceId) -> Result<GraphPool, Error> {
        self.check()?;
        let actor = self.device_actor(device)?;
        let id = actor.call(|st| st.core.create_pool(false)).await?;
        Ok(GraphPool {
            inner: Arc::new(GraphPoolInner {
                alloc: self.clone(),
                device,
                id,
            }),
        })
    }
}

impl GraphPool {
    /// The pool's id on its device (as stats, snapshots and the history name it:
    /// `segment_pool_id`).
    pub fn id(&self) -> MemPoolId {
        self.inner.id
    }

    /// The pool's device.
    pub fn device(&self) -> DeviceId {
        self.inner.device
    }

    /// Begins capturing `stream` (of this pool's device and allocator) in `mode`: until
    /// [`Capture::end`], its work is recorded into a graph instead of running, and every
    /// allocation on it (and on streams that join the capture) comes from this pool.
    /// From async code use `CaptureMode::Relaxed` (see the module docs: the strict modes
    /// bind the capture to the OS thread that began it).
    pub async fn begin_capture(
        &self,
        stream: &Stream,
        mode: CaptureMode,
    ) -> Result<Capture, Error> {
        if stream.device() != self.inner.device {
            return Err(AllocError::WrongDevice {
                expected: self.inner.device,
                got: stream.device(),
            }
            .into());
        }
        begin(Holder::Graph(self.clone()), self.inner.id, stream, mode).await
    }
}

impl Pool {
    /// Begins capturing `stream` into this named pool on the stream's device (PyTorch's
    /// `torch.cuda.graph(g, pool=mempool)`), as [`GraphPool::begin_capture`] does. While a
    /// graph captured into the pool lives, or a capture into it is under way, the pool
    /// cannot sleep ([`AllocError::PoolInGraph`]): its addresses are baked into the graph.
    pub async fn begin_capture(
        &self,
        stream: &Stream,
        mode: CaptureMode,
    ) -> Result<Capture, Error> {
        let id = self.id(stream.device())?;
        begin(Holder::Named(self.clone()), id, stream, mode).await
    }
}

/// What keeps a capture's pool: a graph pool, or a named pool.
#[derive(Clone, Debug)]
enum Holder {
    Graph(GraphPool),
    Named(Pool),
}

impl Holder {
    fn alloc(&self) -> &Allocator {
        match self {
            Holder::Graph(g) => &g.inner.alloc,
            Holder::Named(p) => p.allocator(),
        }
    }
}

/// Begins the backend's capture of `stream` and announces it to the core with pool `pool`.
async fn begin(
    holder: Holder,
    pool: MemPoolId,
    stream: &Stream,
    mode: CaptureMode,
) -> Result<Capture, Error> {
    let alloc = holder.alloc().clone();
    alloc.check()?;
    if !Arc::ptr_eq(stream.backend(), alloc.backend()) {
        return Err(Error::ForeignStream);
    }
    let actor = alloc.device_actor(stream.device())?.clone();
    let backend = alloc.backend().clone();
    let h = stream.handle();
    // The capture begins once the stream's queued work has run (PyTorch's `torch.cuda.graph`
    // synchronizes the device there): a block freed on the stream may serve the capture, and
    // the graph, launched on any stream, must not write it while that work still uses it.
    // (On a stream that captures already, the backend refuses the begin below; an event
    // recorded there would be the other capture's.)
    completed_unless_capturing(backend.as_ref(), stream).await?;
    // No page release that would synchronize the stream starts from now, and none is in
    // flight when the backend's capture begins (`DeviceCore::prepare_capture`).
    let prepared = Prepared(actor.clone(), h);
    while !actor.call(move |st| st.core.prepare_capture(h)).await? {
        tokio::time::sleep(PREPARE_RETRY).await;
    }
    // The thread cache is bypassed from before the capture starts.
    actor.signals.captures.fetch_add(1, Ordering::AcqRel);
    let announced = async {
        backend.stream_begin_capture(h, mode)?;
        let id = match backend.stream_capture_status(h)?.id() {
            Some(id) => id,
            None => {
                return Err(Error::Internal(
                    "a stream began capturing but reports no capture".into(),
                ))
            }
        };
        let announce = actor
            .call(move |st| st.core.begin_capture(id, pool, h))
            .await
            .and_then(|r| r.map_err(Error::from));
        if let Err(e) = announce {
            if let Ok(g) = backend.stream_end_capture(h) {
                let _ = backend.graph_destroy(g);
            }
            return Err(e);
        }
        Ok(id)
    }
    .await;
    match announced {
        Ok(id) => {
            drop(prepared);
            let capture = Capture {
                holder,
                pool,
                stream: stream.clone(),
                id,
                ended: false,
            };
            // The pool's memory on other streams: their queued work must have run before
            // the capture can hand it out (`DeviceCore::streams_before_capture`). Those
            // streams do not capture (one that does is skipped: an event there would be its
            // capture's). A failure drops the capture, which ends it.
            let others = actor
                .call(move |st| {
                    let handles = st.core.streams_before_capture(id);
                    handles
                        .into_iter()
                        .filter_map(|h| st.streams.get(h))
                        .collect::<Vec<Stream>>()
                })
                .await?;
            for other in others {
                completed_unless_capturing(backend.as_ref(), &other).await?;
            }
            Ok(capture)
        }
        Err(e) => {
            actor.signals.captures.fetch_sub(1, Ordering::AcqRel);
            Err(e)
        }
    }
}

/// Waits until the work queued on `stream` so far has run, unless it captures (an event
/// recorded there would be its capture's, and its work does not run until a launch).
async fn completed_unless_capturing(backend: &dyn Backend, stream: &Stream) -> Result<(), Error> {
    if !backend
        .stream_capture_status(stream.handle())?
        .is_capturing()
    {
        stream.completed().await?;
    }
    Ok(())
}

/// How long `begin` waits before asking the core again whether a page release of the stream
/// is still in flight (a driver call or two).
const PREPARE_RETRY: std::time::Duration = std::time::Duration::from_millis(1);

/// A capture prepared on a stream (`DeviceCore::prepare_capture`), given up when dropped:
/// a refused begin, a dropped future, or (a no-op then) a begin the core heard of, which
/// ended the preparation itself.
struct Prepared(Arc<DeviceActor>, StreamHandle);

impl Drop for Prepared {
    fn drop(&mut self) {
        let h = self.1;
        self.0.post_core(move |core| core.unprepare_capture(h));
    }
}

/// A capture under way into a [`GraphPool`] or a named [`Pool`]. End it with
/// [`Capture::end`]; dropping it instead ends the capture and discards its graph.
#[derive(Debug)]
pub struct Capture {
    holder: Holder,
    pool: MemPoolId,
    stream: Stream,
    id: u64,
    ended: bool,
}

impl Capture {
    /// The backend's id of the capture.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The stream the capture began on.
    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    /// Ends the capture and instantiates its graph. A capture the driver invalidated (a
    /// refused call during it) or one with a stream not joined back fails here, with the
    /// driver's capture error ([`gpualloc_runtime::CaptureError`] in
    /// [`Error::Backend`]); the pool keeps what was allocated for it until its buffers are
    /// dropped.
    pub async fn end(mut self) -> Result<Graph, Error> {
        self.ended = true;
        let alloc = self.holder.alloc().clone();
        let backend = alloc.backend().clone();
        let ended = backend.stream_end_capture(self.stream.handle());
        let exec = ended.and_then(|graph| {
            let exec = backend.graph_instantiate(graph);
            if let Err(e) = backend.graph_destroy(graph) {
                tracing::warn!(error = %e, "destroying a captured graph after its instantiation");
            }
            exec
        });
        // The core hears of the end either way; of the graph only if there is one.
        let actor = alloc.device_actor(self.stream.device())?.clone();
        let (id, pool, made) = (self.id, self.pool, exec.is_ok());
        let told = actor
            .call(move |st| {
                st.core.end_capture(id)?;
                if made {
                    st.core.graph_captured(pool)?;
                }
                Ok::<(), AllocError>(())
            })
            .await
            .and_then(|r| r.map_err(Error::from));
        actor.signals.captures.fetch_sub(1, Ordering::AcqRel);
        let exec = exec?;
        if let Err(e) = told {
            let _ = backend.graph_exec_destroy(exec);
            return Err(e);
        }
        Ok(Graph {
            holder: self.holder.clone(),
            device: self.stream.device(),
            pool,
            exec,
            launches: Mutex::new(Vec::new()),
        })
    }
}

impl Drop for Capture {
    fn drop(&mut self) {
        if self.ended {
            return;
        }
        let alloc = self.holder.alloc();
        let backend = alloc.backend();
        if let Ok(g) = backend.stream_end_capture(self.stream.handle()) {
            let _ = backend.graph_destroy(g);
        }
        if let Ok(actor) = alloc.device_actor(self.stream.device()) {
            actor.end_capture_later(self.id);
        }
    }
}

/// An instantiated graph captured into a [`GraphPool`] or a named [`Pool`]: it holds the
/// pool (its pointers are baked in; a named pool cannot sleep meanwhile) until dropped and
/// until its launches have run.
///
/// **Launches.** A launch makes no allocator request. It records an event on its stream
/// after the graph (one event per stream, recorded again at each launch there), because the
/// pool's memory belongs to the capture's streams, and a release that waits for those alone
/// (unmapping pages waits for the segment's stream) would free memory a launch on another
/// stream still writes. Dropping the graph keeps its pool, and the streams it was launched
/// on, until those events are complete (off the caller's thread): until then the pool is
/// not released, not emptied, and a named pool's sleep waits. A launch into a stream that
/// is capturing is refused ([`Error::LaunchIntoCapture`]).
#[derive(Debug)]
pub struct Graph {
    holder: Holder,
    device: DeviceId,
    pool: MemPoolId,
    exec: GraphExecHandle,
    launches: Mutex<Vec<Launched>>,
}

/// A stream the graph was launched on, and the event recorded there after its last launch.
#[derive(Debug)]
struct Launched {
    stream: Stream,
    event: EventHandle,
}

impl Graph {
    /// Enqueues the whole graph on `stream` (of the pool's device and allocator), and an
    /// event after it (see [`Graph`]).
    pub fn launch(&self, stream: &Stream) -> Result<(), Error> {
        let alloc = self.holder.alloc();
        let backend = alloc.backend();
        if !Arc::ptr_eq(stream.backend(), backend) {
            return Err(Error::ForeignStream);
        }
        if stream.device() != self.device {
            return Err(AllocError::WrongDevice {
                expected: self.device,
                got: stream.device(),
            }
            .into());
        }
        // The allocator's backend: its calls never invalidate a capture of the user's.
        let own = &alloc.device_actor(self.device)?.backend;
        let h = stream.handle();
        if own.capture_may_be_underway() && own.stream_capture_status(h)?.is_capturing() {
            return Err(Error::LaunchIntoCapture);
        }
        let mut launches = self.launches.lock().unwrap_or_else(PoisonError::into_inner);
        let event = match launches.iter().find(|l| l.stream == *stream) {
            Some(l) => l.event,
            None => {
                let event = own.event_create(self.device)?;
                launches.push(Launched {
                    stream: stream.clone(),
                    event,
                });
                event
            }
        };
        backend.graph_launch(self.exec, h)?;
        if let Err(e) = own.event_record(event, h) {
            // A launch nothing can wait for: wait for it here instead.
            tracing::warn!(error = %e, "recording an event after a graph launch; synchronizing");
            own.stream_synchronize(h)?;
        }
        Ok(())
    }

    /// The id of the pool the graph was captured into, on its device.
    pub fn pool_id(&self) -> MemPoolId {
        self.pool
    }

    /// The graph's device.
    pub fn device(&self) -> DeviceId {
        self.device
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        let alloc = self.holder.alloc();
        // Launches already enqueued still run (the driver's rule, and the sim's).
        if let Err(e) = alloc.backend().graph_exec_destroy(self.exec) {
            tracing::warn!(error = %e, "destroying a graph");
        }
        let launches = std::mem::take(
            self.launches
                .get_mut()
                .unwrap_or_else(PoisonError::into_inner),
        );
        let Ok(actor) = alloc.device_actor(self.device).cloned() else {
            // No allocator left to keep the pool for.
            for l in &launches {
                let _ = alloc.backend().event_destroy(l.event);
            }
            return;
        };
        let running = launches
            .iter()
            .any(|l| !matches!(actor.backend.event_query(l.event), Ok(true)));
        if !running {
            for l in &launches {
                let _ = actor.backend.event_destroy(l.event);
            }
            actor.graph_dropped_later(self.pool, false);
            return;
        }
        // The pool stays the graph's until its launches have run: this holder keeps it,
        // and the core hears when they have.
        actor.graph_dropped_later(self.pool, true);
        let (holder, pool, runtime) = (self.holder.clone(), self.pool, actor.runtime.clone());
        drop(runtime.spawn_blocking(move || {
            for l in &launches {
                if let Err(e) = actor.backend.event_synchronize(l.event) {
                    tracing::warn!(error = %e, "waiting for a dropped graph's launches");
                }
                let _ = actor.backend.event_destroy(l.event);
            }
            actor.graph_launches_done_later(pool);
            drop((launches, holder));
        }));
    }
}
