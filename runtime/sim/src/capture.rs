//! Stream capture and graphs in the sim, with the driver's refusals.
//!
//! While a stream is capturing, the work enqueued on it does not run: it becomes a node of
//! the capture's graph, depending on the work enqueued on the same stream before it and on
//! the events that stream was made to wait for. An event recorded on a capturing stream
//! marks a point of the graph; another stream that waits on it joins the capture (its work
//! is captured too, from then on), and must be joined back (the stream the capture began on
//! waits on an event recorded on it) before the capture ends. An ended capture is a graph;
//! an instantiated graph is launched on a stream as one unit of work, as often as wanted:
//! its nodes run in the order they were captured (a valid order of the graph's
//! dependencies), with the pointers they were captured with.
//!
//! The driver's rules, kept here (`cuStreamBeginCapture`, `cuThreadExchangeStreamCaptureMode`):
//! - a *potentially unsafe* call (allocating, freeing or mapping memory, synchronizing, and
//!   querying streams or events) is refused with `CaptureError::Unsupported` when the calling
//!   thread's mode guards against a capture under way ([`CaptureMode`]'s rules), and that
//!   capture is invalidated: its work is refused from then on and its end fails with
//!   `CaptureError::Invalidated`;
//! - synchronizing or querying a capturing stream, or a synchronous copy on it, is refused
//!   and invalidates its capture whatever the mode;
//! - querying or synchronizing an event last recorded in a capture is refused with
//!   `CaptureError::CapturedEvent`;
//! - a capturing stream that waits on an event recorded outside any capture is refused with
//!   `CaptureError::Isolation`, on an event of another capture with `CaptureError::Merge`;
//!   both invalidate the capture;
//! - a capture ends on the stream it began on (`Unmatched` elsewhere), from the thread that
//!   began it unless it was begun relaxed (`WrongThread`), once every stream it forked to has
//!   been joined back (`Unjoined`: the capture ends, its graph is lost).
//!
//! Where the sim differs: a host function cannot be captured (`Backend::launch_host_func`
//! takes a function that runs once), so one launched on a capturing stream is refused with
//! `NotSupported` and the capture goes on; an event recorded in a capture is a point of the
//! graph, not a node, so after the capture it reads as it did before it.

use std::cell::Cell;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::ThreadId;

use gpualloc_runtime::capture::{CaptureError, CaptureMode, CaptureStatus};
use gpualloc_runtime::error::{BackendError, Result};
use gpualloc_runtime::types::DeviceId;

use crate::lock;

/// A captured unit of stream work: runs each time its graph is launched. The mutex lets a
/// graph hold work that is `Send` but not `Sync` (two launches of one graph on two streams
/// take turns on each node, as a GPU runs a graph's launches in turn).
pub(crate) type NodeFn = Arc<Mutex<Box<dyn FnMut() -> Result<()> + Send>>>;

thread_local! {
    /// The calling thread's capture mode (`cuThreadExchangeStreamCaptureMode`), per thread
    /// of the process as on the driver.
    static THREAD_MODE: Cell<CaptureMode> = const { Cell::new(CaptureMode::Global) };
}

/// Sets the calling thread's mode; returns the one it replaces.
pub(crate) fn exchange_thread_mode(mode: CaptureMode) -> CaptureMode {
    THREAD_MODE.with(|m| m.replace(mode))
}

fn thread_mode() -> CaptureMode {
    THREAD_MODE.with(Cell::get)
}

fn refused(e: CaptureError) -> BackendError {
    BackendError::Capture(e)
}

/// A node of a graph being captured.
struct Node {
    /// `None` for the empty node a stream's join starts with (so that the join must be
    /// undone before the end, even when no work follows it on that stream).
    run: Option<NodeFn>,
    /// Nodes it depends on (indices of earlier nodes).
    deps: Vec<usize>,
    touches: Vec<(u64, u64)>,
}

/// A capture under way.
struct Capture {
    device: DeviceId,
    /// The stream it began on (raw id).
    origin: u64,
    mode: CaptureMode,
    thread: ThreadId,
    invalidated: bool,
    nodes: Vec<Node>,
    /// Per stream in the capture (raw id): the nodes its next node depends on.
    tails: HashMap<u64, Vec<usize>>,
}

impl Capture {
    fn status(&self, id: u64) -> CaptureStatus {
        if self.invalidated {
            CaptureStatus::Invalidated { id }
        } else {
            CaptureStatus::Active { id }
        }
    }

    /// True when every other stream's tail is among the origin's ancestors.
    fn joined(&self) -> bool {
        let mut seen = HashSet::new();
        let mut todo: Vec<usize> = self.tails.get(&self.origin).cloned().unwrap_or_default();
        while let Some(n) = todo.pop() {
            if seen.insert(n) {
                todo.extend(self.nodes.get(n).map(|x| x.deps.as_slice()).unwrap_or(&[]));
            }
        }
        self.tails
            .iter()
            .filter(|(s, _)| **s != self.origin)
            .all(|(_, tail)| tail.iter().all(|n| seen.contains(n)))
    }
}

/// A captured graph: its nodes in capture order, which respects their dependencies.
pub(crate) struct Graph {
    pub(crate) device: DeviceId,
    nodes: Vec<(NodeFn, Vec<(u64, u64)>)>,
}

impl Graph {
    /// Runs every node in order; the first error stops the launch.
    pub(crate) fn run(&self) -> Result<()> {
        self.nodes.iter().try_for_each(|(run, _)| (lock(run))())
    }

    /// The address ranges its nodes touch.
    pub(crate) fn touches(&self) -> Vec<(u64, u64)> {
        self.nodes
            .iter()
            .flat_map(|(_, t)| t.iter().copied())
            .collect()
    }
}

#[derive(Default)]
struct Table {
    next_id: u64,
    /// Captures under way by id.
    captures: HashMap<u64, Capture>,
    /// Capturing streams (raw id) and their capture.
    streams: HashMap<u64, u64>,
    /// Events (raw id) last recorded in a capture: the capture and the nodes the record
    /// follows.
    events: HashMap<u64, (u64, Vec<usize>)>,
    graphs: HashMap<u64, Arc<Graph>>,
    execs: HashMap<u64, Arc<Graph>>,
}

impl Table {
    fn invalidate(&mut self, id: u64) {
        if let Some(c) = self.captures.get_mut(&id) {
            c.invalidated = true;
        }
    }

    /// Ends capture `id`: its streams leave it and its events are forgotten.
    fn remove(&mut self, id: u64) -> Option<Capture> {
        let c = self.captures.remove(&id)?;
        self.streams.retain(|_, cap| *cap != id);
        self.events.retain(|_, (cap, _)| *cap != id);
        Some(c)
    }
}

/// Graph (or instantiation) `id` of `map`, if it belongs to `device`.
fn of_device<'a>(
    map: &'a HashMap<u64, Arc<Graph>>,
    id: u64,
    device: DeviceId,
    what: &str,
) -> Result<&'a Arc<Graph>> {
    map.get(&id)
        .filter(|g| g.device == device)
        .ok_or_else(|| BackendError::InvalidHandle(format!("unknown {what} {id}")))
}

/// The sim's captures and graphs.
#[derive(Default)]
pub(crate) struct Captures {
    /// Captures under way: zero lets every call skip the table.
    active: AtomicUsize,
    table: Mutex<Table>,
}

impl std::fmt::Debug for Captures {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Captures")
            .field("active", &self.active.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl Captures {
    fn quiet(&self) -> bool {
        self.active.load(Ordering::Acquire) == 0
    }

    /// True while a capture is under way (begun and not ended).
    pub(crate) fn any(&self) -> bool {
        !self.quiet()
    }

    fn table(&self) -> std::sync::MutexGuard<'_, Table> {
        lock(&self.table)
    }

    fn set_active(&self, t: &Table) {
        self.active.store(t.captures.len(), Ordering::Release);
    }

    /// Begins capturing stream `stream` of `device` in `mode`.
    pub(crate) fn begin(&self, device: DeviceId, stream: u64, mode: CaptureMode) -> Result<()> {
        let mut t = self.table();
        if t.streams.contains_key(&stream) {
            return Err(BackendError::Driver {
                code: 401,
                name: "CUDA_ERROR_ILLEGAL_STATE (the stream is already capturing)".into(),
            });
        }
        t.next_id += 1;
        let id = t.next_id;
        t.captures.insert(
            id,
            Capture {
                device,
                origin: stream,
                mode,
                thread: std::thread::current().id(),
                invalidated: false,
                nodes: Vec::new(),
                tails: HashMap::from([(stream, Vec::new())]),
            },
        );
        t.streams.insert(stream, id);
        self.set_active(&t);
        Ok(())
    }

    /// Ends the capture begun on `stream` and returns its graph's id.
    pub(crate) fn end(&self, stream: u64) -> Result<u64> {
        let mut t = self.table();
        let id = *t
            .streams
            .get(&stream)
            .ok_or(refused(CaptureError::Unmatched))?;
        let c = t
            .captures
            .get(&id)
            .ok_or(refused(CaptureError::Unmatched))?;
        if c.origin != stream {
            return Err(refused(CaptureError::Unmatched));
        }
        if c.mode != CaptureMode::Relaxed && c.thread != std::thread::current().id() {
            return Err(refused(CaptureError::WrongThread));
        }
        let c = t.remove(id).ok_or(refused(CaptureError::Unmatched))?;
        self.set_active(&t);
        if c.invalidated {
            return Err(refused(CaptureError::Invalidated));
        }
        if !c.joined() {
            return Err(refused(CaptureError::Unjoined));
        }
        t.next_id += 1;
        let graph = t.next_id;
        let nodes = c
            .nodes
            .into_iter()
            .filter_map(|n| Some((n.run?, n.touches)))
            .collect();
        t.graphs.insert(
            graph,
            Arc::new(Graph {
                device: c.device,
                nodes,
            }),
        );
        Ok(graph)
    }

    /// The capture status of `stream`.
    pub(crate) fn status(&self, stream: u64) -> CaptureStatus {
        if self.quiet() {
            return CaptureStatus::None;
        }
        let t = self.table();
        t.streams
            .get(&stream)
            .and_then(|id| t.captures.get(id).map(|c| c.status(*id)))
            .unwrap_or_default()
    }

    /// Captures `work` if `stream` is capturing: `Ok` with the outcome when it is, `Err`
    /// giving `work` back when it is not (run it as usual).
    pub(crate) fn add_node<F>(
        &self,
        stream: u64,
        touches: &[(u64, u64)],
        work: F,
    ) -> Result<Result<()>, F>
    where
        F: FnMut() -> Result<()> + Send + 'static,
    {
        if self.quiet() {
            return Err(work);
        }
        let mut t = self.table();
        let Some(&id) = t.streams.get(&stream) else {
            return Err(work);
        };
        let Some(c) = t.captures.get_mut(&id) else {
            return Err(work);
        };
        if c.invalidated {
            return Ok(Err(refused(CaptureError::Invalidated)));
        }
        let index = c.nodes.len();
        let tail = c.tails.entry(stream).or_default();
        let deps = std::mem::replace(tail, vec![index]);
        c.nodes.push(Node {
            run: Some(Arc::new(Mutex::new(Box::new(work)))),
            deps,
            touches: touches.iter().copied().filter(|t| t.1 > 0).collect(),
        });
        Ok(Ok(()))
    }

    /// Records `event` on `stream`: `Some` when the stream is capturing (the record is a
    /// point of the graph), `None` when it is not (the record is made as usual, and the
    /// event no longer names a capture).
    pub(crate) fn record_event(&self, event: u64, stream: u64) -> Option<Result<()>> {
        if self.quiet() {
            return None;
        }
        let mut t = self.table();
        let Some(&id) = t.streams.get(&stream) else {
            t.events.remove(&event);
            return None;
        };
        let c = t.captures.get(&id)?;
        if c.invalidated {
            return Some(Err(refused(CaptureError::Invalidated)));
        }
        let tail = c.tails.get(&stream).cloned().unwrap_or_default();
        t.events.insert(event, (id, tail));
        Some(Ok(()))
    }

    /// Makes `stream` (of `device`) wait on `event`: `Some` when the capture machinery took
    /// the wait (a capturing stream's dependency, or a stream joining the event's capture),
    /// `None` when it is an ordinary wait.
    pub(crate) fn wait_event(
        &self,
        device: DeviceId,
        stream: u64,
        event: u64,
    ) -> Option<Result<()>> {
        if self.quiet() {
            return None;
        }
        let mut t = self.table();
        let recorded = t.events.get(&event).cloned();
        match (t.streams.get(&stream).copied(), recorded) {
            (None, None) => None,
            (None, Some((id, nodes))) => {
                let c = t.captures.get_mut(&id)?;
                if c.device != device {
                    return Some(Err(BackendError::invalid(
                        "a stream may join only a capture of its own device",
                    )));
                }
                if c.invalidated {
                    return Some(Err(refused(CaptureError::Invalidated)));
                }
                let join = c.nodes.len();
                c.nodes.push(Node {
                    run: None,
                    deps: nodes,
                    touches: Vec::new(),
                });
                c.tails.insert(stream, vec![join]);
                t.streams.insert(stream, id);
                Some(Ok(()))
            }
            (Some(id), recorded) => {
                let Some(c) = t.captures.get_mut(&id) else {
                    return Some(Err(refused(CaptureError::Invalidated)));
                };
                if c.invalidated {
                    return Some(Err(refused(CaptureError::Invalidated)));
                }
                let error = match recorded {
                    Some((other, nodes)) if other == id => {
                        let tail = c.tails.entry(stream).or_default();
                        for n in nodes {
                            if !tail.contains(&n) {
                                tail.push(n);
                            }
                        }
                        return Some(Ok(()));
                    }
                    Some(_) => CaptureError::Merge,
                    None => CaptureError::Isolation,
                };
                c.invalidated = true;
                Some(Err(refused(error)))
            }
        }
    }

    /// Refuses a call that synchronizes or queries `stream` (or copies on it synchronously)
    /// while it is capturing, invalidating its capture.
    pub(crate) fn check_stream_sync(&self, stream: u64) -> Result<()> {
        if self.quiet() {
            return Ok(());
        }
        let mut t = self.table();
        match t.streams.get(&stream).copied() {
            Some(id) => {
                t.invalidate(id);
                Err(refused(CaptureError::Unsupported))
            }
            None => Ok(()),
        }
    }

    /// Refuses a query or synchronization of an event last recorded in a capture.
    pub(crate) fn check_event(&self, event: u64) -> Result<()> {
        if self.quiet() || !self.table().events.contains_key(&event) {
            Ok(())
        } else {
            Err(refused(CaptureError::CapturedEvent))
        }
    }

    /// Refuses a potentially unsafe call when the calling thread's mode guards against a
    /// capture under way, invalidating those captures (see the module docs).
    pub(crate) fn check_unsafe_call(&self) -> Result<()> {
        if self.quiet() {
            return Ok(());
        }
        let mode = thread_mode();
        if mode == CaptureMode::Relaxed {
            return Ok(());
        }
        let me = std::thread::current().id();
        let mut t = self.table();
        let mut conflict = false;
        for c in t.captures.values_mut() {
            let own = c.thread == me && c.mode != CaptureMode::Relaxed;
            let others =
                mode == CaptureMode::Global && c.thread != me && c.mode == CaptureMode::Global;
            if own || others {
                c.invalidated = true;
                conflict = true;
            }
        }
        if conflict {
            Err(refused(CaptureError::Unsupported))
        } else {
            Ok(())
        }
    }

    /// A stream is being destroyed: it leaves its capture, which is invalidated (and ended,
    /// if it began there: no stream is left to end it).
    pub(crate) fn stream_destroyed(&self, stream: u64) {
        if self.quiet() {
            return;
        }
        let mut t = self.table();
        let Some(id) = t.streams.remove(&stream) else {
            return;
        };
        let origin = t.captures.get(&id).map(|c| c.origin);
        if origin == Some(stream) {
            t.remove(id);
        } else {
            t.invalidate(id);
        }
        self.set_active(&t);
    }

    /// An event is being destroyed: it no longer names a capture.
    pub(crate) fn event_destroyed(&self, event: u64) {
        if !self.quiet() {
            self.table().events.remove(&event);
        }
    }

    /// Instantiates graph `graph`; returns the instantiation's id.
    pub(crate) fn instantiate(&self, device: DeviceId, graph: u64) -> Result<u64> {
        let mut t = self.table();
        let g = of_device(&t.graphs, graph, device, "graph")?.clone();
        t.next_id += 1;
        let exec = t.next_id;
        t.execs.insert(exec, g);
        Ok(exec)
    }

    /// The graph instantiation `exec` runs.
    pub(crate) fn exec(&self, device: DeviceId, exec: u64) -> Result<Arc<Graph>> {
        of_device(&self.table().execs, exec, device, "graph instantiation").cloned()
    }

    /// Destroys graph `graph` (its instantiations keep their nodes).
    pub(crate) fn destroy_graph(&self, device: DeviceId, graph: u64) -> Result<()> {
        let mut t = self.table();
        of_device(&t.graphs, graph, device, "graph")?;
        t.graphs.remove(&graph);
        Ok(())
    }

    /// Destroys instantiation `exec` (launches already enqueued keep their nodes).
    pub(crate) fn destroy_exec(&self, device: DeviceId, exec: u64) -> Result<()> {
        let mut t = self.table();
        of_device(&t.execs, exec, device, "graph instantiation")?;
        t.execs.remove(&exec);
        Ok(())
    }

    /// Graphs and instantiations alive (for leak checks).
    pub(crate) fn live(&self) -> (usize, usize) {
        let t = self.table();
        (t.graphs.len(), t.execs.len())
    }
}
