//! A one-shot completion cell and the future that waits on it.
//!
//! The GPU side (a backend host callback, run on a backend thread when a stream reaches it)
//! calls [`CompletionCell::complete`]; the async side polls [`Completion`]. The cell is the
//! only shared state between them: the waker registration may race with completion, and
//! either side may be dropped first. `tests/loom_completion.rs` model-checks exactly that.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use crate::error::BackendError;
use crate::sync::{lock, Arc, Mutex};

enum State {
    Pending(Option<Waker>),
    Done(Result<(), BackendError>),
}

/// Shared cell written once by the completing side.
pub struct CompletionCell {
    state: Mutex<State>,
}

impl CompletionCell {
    /// A new, pending cell.
    pub fn new() -> Arc<Self> {
        Arc::new(CompletionCell {
            state: Mutex::new(State::Pending(None)),
        })
    }

    /// Marks the cell done with `result` and wakes the waiter, if any. Later calls are ignored
    /// (the first result wins).
    pub fn complete(&self, result: Result<(), BackendError>) {
        let waker = {
            let mut state = lock(&self.state);
            match &mut *state {
                State::Done(_) => return,
                State::Pending(waker) => {
                    let waker = waker.take();
                    *state = State::Done(result);
                    waker
                }
            }
        };
        // Wake outside the lock: the woken task may poll at once on another thread.
        if let Some(waker) = waker {
            waker.wake();
        }
    }

    /// True once [`CompletionCell::complete`] has run.
    pub fn is_done(&self) -> bool {
        matches!(&*lock(&self.state), State::Done(_))
    }

    fn poll_result(&self, cx: &mut Context<'_>) -> Poll<Result<(), BackendError>> {
        let mut state = lock(&self.state);
        match &mut *state {
            State::Done(result) => Poll::Ready(result.clone()),
            State::Pending(slot) => {
                match slot {
                    Some(w) if w.will_wake(cx.waker()) => {}
                    _ => *slot = Some(cx.waker().clone()),
                }
                Poll::Pending
            }
        }
    }
}

/// Future that resolves when its [`CompletionCell`] is completed. Dropping it before
/// completion is fine: the completing side still holds the cell and simply finds no waker.
pub struct Completion {
    cell: Arc<CompletionCell>,
}

impl Completion {
    /// A future over `cell`.
    pub fn new(cell: Arc<CompletionCell>) -> Self {
        Completion { cell }
    }

    /// A future that is already complete with `result`.
    pub fn ready(result: Result<(), BackendError>) -> Self {
        let cell = CompletionCell::new();
        cell.complete(result);
        Completion { cell }
    }

    /// True once complete, without registering a waker.
    pub fn is_done(&self) -> bool {
        self.cell.is_done()
    }
}

impl Future for Completion {
    type Output = Result<(), BackendError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.cell.poll_result(cx)
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn completes_once_first_result_wins() {
        let cell = CompletionCell::new();
        let fut = Completion::new(cell.clone());
        assert!(!fut.is_done());
        cell.complete(Ok(()));
        cell.complete(Err(BackendError::invalid("late")));
        assert_eq!(futures::executor::block_on(fut), Ok(()));
    }

    #[test]
    fn wakes_a_waiting_task_from_another_thread() {
        let cell = CompletionCell::new();
        let fut = Completion::new(cell.clone());
        let t = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(20));
            cell.complete(Err(BackendError::invalid("boom")));
        });
        assert_eq!(
            futures::executor::block_on(fut),
            Err(BackendError::invalid("boom"))
        );
        t.join().unwrap();
    }
}
