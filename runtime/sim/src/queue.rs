//! Streams and events of the sim: a worker thread per stream running an in-order queue.
//!
//! A stream's tasks run one after another on its thread. Progress is two counters
//! (`submitted`, `done`) under a mutex with a condvar, so `synchronize` waits for exactly
//! the work enqueued before it. A failing task leaves a sticky error that the next
//! `stream_synchronize` returns. Events keep the sequence number of their last record and
//! the set of records not yet reached; a wait captures the record current when it was made.
//!
//! For the allocator's debug check of frees that race other streams, a stream also keeps the
//! address ranges its queued tasks touch (until they run) and, per other stream, the last task
//! of that stream it has been made to wait for (through an event's record).

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, Sender};

use gpualloc_runtime::error::{BackendError, Result};
use gpualloc_runtime::types::DeviceId;

/// A unit of stream work. `Err` becomes the stream's sticky error.
pub(crate) type Task = Box<dyn FnOnce() -> Result<()> + Send + 'static>;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// An address range `[start, end)` a queued task touches; `task` is its queue number.
#[derive(Debug, Clone, Copy)]
struct Touch {
    task: u64,
    start: u64,
    end: u64,
}

#[derive(Debug, Default)]
struct Progress {
    submitted: u64,
    done: u64,
    error: Option<BackendError>,
    /// Ranges touched by tasks not yet run, in queue order.
    touches: VecDeque<Touch>,
    /// Per other stream (raw id): the last of its tasks this stream waits for.
    waits_for: HashMap<u64, u64>,
}

/// The part of a stream its worker and synchronizing callers share.
#[derive(Debug)]
pub(crate) struct StreamShared {
    pub(crate) device: DeviceId,
    /// The stream's raw handle.
    pub(crate) raw: u64,
    progress: Mutex<Progress>,
    cv: Condvar,
}

impl StreamShared {
    /// Enqueues `task` on `tx`, numbering it in queue order.
    pub(crate) fn enqueue(&self, tx: &Sender<Task>, task: Task) -> Result<()> {
        self.enqueue_touching(tx, task, &[]).map(|_| ())
    }

    /// Enqueues `task`, which touches the address ranges `(start, len)` of `touches`, and
    /// returns its queue number.
    pub(crate) fn enqueue_touching(
        &self,
        tx: &Sender<Task>,
        task: Task,
        touches: &[(u64, u64)],
    ) -> Result<u64> {
        let mut p = lock(&self.progress);
        tx.send(task)
            .map_err(|_| BackendError::InvalidHandle("stream is shutting down".into()))?;
        p.submitted += 1;
        let number = p.submitted;
        for &(start, len) in touches.iter().filter(|t| t.1 > 0) {
            p.touches.push_back(Touch {
                task: number,
                start,
                end: start.saturating_add(len),
            });
        }
        Ok(number)
    }

    /// Records that this stream's later work waits for task `task` of stream `other`.
    pub(crate) fn wait_for(&self, other: u64, task: u64) {
        let mut p = lock(&self.progress);
        let w = p.waits_for.entry(other).or_insert(0);
        *w = (*w).max(task);
    }

    /// The last task of stream `other` this stream waits for (0: none).
    pub(crate) fn waits_for(&self, other: u64) -> u64 {
        lock(&self.progress)
            .waits_for
            .get(&other)
            .copied()
            .unwrap_or(0)
    }

    /// True when a task after `after` that has not run yet touches `[start, end)`.
    pub(crate) fn touches_pending(&self, start: u64, end: u64, after: u64) -> bool {
        let p = lock(&self.progress);
        p.touches
            .iter()
            .any(|t| t.task > p.done && t.task > after && t.start < end && start < t.end)
    }

    /// Blocks until everything enqueued before the call has run.
    pub(crate) fn drain(&self) {
        let mut p = lock(&self.progress);
        let target = p.submitted;
        while p.done < target {
            p = self.cv.wait(p).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// [`StreamShared::drain`], then takes the sticky error.
    pub(crate) fn synchronize(&self) -> Result<()> {
        self.drain();
        match lock(&self.progress).error.take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// True when every task queued so far has run (`cuStreamQuery`'s question, asked without
    /// queueing anything).
    pub(crate) fn idle(&self) -> bool {
        let p = lock(&self.progress);
        p.done == p.submitted
    }

    /// The sticky error, if any, without clearing it.
    pub(crate) fn peek_error(&self) -> Option<BackendError> {
        lock(&self.progress).error.clone()
    }
}

/// A live stream: shared state, the queue's sending side, and its worker thread.
#[derive(Debug)]
pub(crate) struct SimStream {
    pub(crate) shared: Arc<StreamShared>,
    pub(crate) tx: Sender<Task>,
    thread: Option<JoinHandle<()>>,
}

impl SimStream {
    /// Starts a stream on `device`; failed tasks are also counted in `failures`.
    pub(crate) fn spawn(device: DeviceId, raw: u64, failures: Arc<AtomicU64>) -> Result<Self> {
        let (tx, rx) = crossbeam_channel::unbounded::<Task>();
        let shared = Arc::new(StreamShared {
            device,
            raw,
            progress: Mutex::new(Progress::default()),
            cv: Condvar::new(),
        });
        let worker_shared = shared.clone();
        let thread = std::thread::Builder::new()
            .name(format!("sim-stream-{}-{raw}", device.0))
            .spawn(move || worker(rx, worker_shared, failures))
            .map_err(|e| BackendError::os("thread spawn", e))?;
        Ok(SimStream {
            shared,
            tx,
            thread: Some(thread),
        })
    }

    /// Closes the queue, lets it drain and joins the worker (unless called from the worker
    /// itself, e.g. a host function dropping the last handle: then it detaches).
    pub(crate) fn shutdown(self) {
        self.retire().join();
    }

    /// Closes the queue and returns at once, as `cuStreamDestroy` does: the worker runs what
    /// was queued, then ends; the returned handle joins it.
    pub(crate) fn retire(self) -> RetiredStream {
        let SimStream { shared, tx, thread } = self;
        drop(tx);
        RetiredStream { shared, thread }
    }
}

/// A destroyed stream whose queued work may still be running: device-wide synchronizations
/// (`device_synchronize`, `free`) still wait for it, as a driver's do.
#[derive(Debug)]
pub(crate) struct RetiredStream {
    pub(crate) shared: Arc<StreamShared>,
    thread: Option<JoinHandle<()>>,
}

impl RetiredStream {
    /// True once its worker ran everything queued and ended.
    pub(crate) fn finished(&self) -> bool {
        self.thread.as_ref().is_none_or(|t| t.is_finished())
    }

    /// Waits for the worker to run what was queued and end (unless called from the worker
    /// itself: then it detaches).
    pub(crate) fn join(self) {
        if let Some(t) = self.thread {
            if t.thread().id() == std::thread::current().id() {
                return;
            }
            if t.join().is_err() {
                tracing::warn!("sim stream worker panicked");
            }
        }
    }
}

fn worker(rx: Receiver<Task>, shared: Arc<StreamShared>, failures: Arc<AtomicU64>) {
    for task in rx.iter() {
        let result = catch_unwind(AssertUnwindSafe(task)).unwrap_or_else(|_| {
            Err(BackendError::Driver {
                code: 719,
                name: "CUDA_ERROR_LAUNCH_FAILED (panic)".into(),
            })
        });
        let mut p = lock(&shared.progress);
        p.done += 1;
        let done = p.done;
        while p.touches.front().is_some_and(|t| t.task <= done) {
            p.touches.pop_front();
        }
        if let Err(e) = result {
            failures.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(device = shared.device.0, error = %e, "sim stream task failed");
            if p.error.is_none() {
                p.error = Some(e);
            }
        }
        shared.cv.notify_all();
    }
}

#[derive(Debug, Default)]
struct EventState {
    last: u64,
    pending: BTreeSet<u64>,
    /// Where the last record sits: the stream (raw id) and its queue number there.
    last_at: Option<(u64, u64)>,
}

/// An event: the sequence number of its last record and the records not yet reached.
#[derive(Debug)]
pub(crate) struct SimEvent {
    pub(crate) device: DeviceId,
    state: Mutex<EventState>,
    cv: Condvar,
}

impl SimEvent {
    pub(crate) fn new(device: DeviceId) -> Self {
        SimEvent {
            device,
            state: Mutex::new(EventState::default()),
            cv: Condvar::new(),
        }
    }

    /// Starts a new record; returns its sequence number.
    pub(crate) fn begin_record(&self) -> u64 {
        let mut s = lock(&self.state);
        s.last += 1;
        let seq = s.last;
        s.pending.insert(seq);
        s.last_at = None;
        seq
    }

    /// Notes where record `seq` sits in its stream's queue (if it is still the last).
    pub(crate) fn placed(&self, seq: u64, stream: u64, task: u64) {
        let mut s = lock(&self.state);
        if s.last == seq {
            s.last_at = Some((stream, task));
        }
    }

    /// The stream and queue number of the last record, if it was placed.
    pub(crate) fn last_at(&self) -> Option<(u64, u64)> {
        lock(&self.state).last_at
    }

    /// Marks record `seq` reached.
    pub(crate) fn complete(&self, seq: u64) {
        let mut s = lock(&self.state);
        s.pending.remove(&seq);
        self.cv.notify_all();
    }

    /// The sequence number of the last record (0: never recorded).
    pub(crate) fn last(&self) -> u64 {
        lock(&self.state).last
    }

    /// True when record `seq` has been reached (record 0 always has).
    pub(crate) fn reached(&self, seq: u64) -> bool {
        !lock(&self.state).pending.contains(&seq)
    }

    /// Blocks until record `seq` has been reached.
    pub(crate) fn wait(&self, seq: u64) {
        let mut s = lock(&self.state);
        while s.pending.contains(&seq) {
            s = self.cv.wait(s).unwrap_or_else(|e| e.into_inner());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn runs_in_order_and_keeps_the_first_error_sticky() {
        let failures = Arc::new(AtomicU64::new(0));
        let s = SimStream::spawn(DeviceId(0), 1, failures.clone()).unwrap();
        let log = Arc::new(Mutex::new(Vec::new()));
        for i in 0..5u32 {
            let log = log.clone();
            s.shared
                .enqueue(
                    &s.tx,
                    Box::new(move || {
                        std::thread::sleep(Duration::from_millis(u64::from(5 - i)));
                        lock(&log).push(i);
                        if i == 2 {
                            Err(BackendError::invalid("two"))
                        } else if i == 3 {
                            Err(BackendError::invalid("three"))
                        } else {
                            Ok(())
                        }
                    }),
                )
                .unwrap();
        }
        assert_eq!(s.shared.synchronize(), Err(BackendError::invalid("two")));
        assert_eq!(*lock(&log), vec![0, 1, 2, 3, 4]);
        assert_eq!(s.shared.synchronize(), Ok(()));
        assert_eq!(failures.load(Ordering::Relaxed), 2);
        s.shutdown();
    }

    #[test]
    fn event_records_complete_independently() {
        let e = SimEvent::new(DeviceId(0));
        assert!(e.reached(e.last()));
        let a = e.begin_record();
        let b = e.begin_record();
        e.complete(b);
        assert!(e.reached(b) && !e.reached(a));
        e.complete(a);
        e.wait(a);
        assert!(e.reached(a));
    }
}
