//! Loom model of the completion cell (`src/completion.rs`): completion racing with waker
//! registration, the future dropped before completion, and a double complete.
//!
//! Run: `RUSTFLAGS="--cfg loom" cargo test -p gpualloc-runtime --test loom_completion --release`
#![cfg(loom)]

use std::future::Future;
use std::pin::pin;
use std::task::{Context, Poll};

use futures::task::noop_waker;
use gpualloc_runtime::{BackendError, Completion, CompletionCell};
use loom::thread;

/// Polls `fut` once with a no-op waker, then drops it.
fn poll_once(fut: Completion) -> Poll<Result<(), BackendError>> {
    let mut fut = pin!(fut);
    let waker = noop_waker();
    fut.as_mut().poll(&mut Context::from_waker(&waker))
}

/// Poll from one thread, complete from another: the waiter must be woken (loom reports a
/// deadlock if the wake-up is lost).
#[test]
fn completion_races_waker_registration() {
    loom::model(|| {
        let cell = CompletionCell::new();
        let fut = Completion::new(cell.clone());
        let t = thread::spawn(move || cell.complete(Ok(())));
        assert_eq!(loom::future::block_on(fut), Ok(()));
        t.join().unwrap();
    });
}

/// The waiter polls, gets woken, and polls again (re-registering) while the completer runs.
#[test]
fn completion_with_an_error_reaches_the_waiter() {
    loom::model(|| {
        let cell = CompletionCell::new();
        let waiter = {
            let cell = cell.clone();
            thread::spawn(move || loom::future::block_on(Completion::new(cell)))
        };
        cell.complete(Err(BackendError::invalid("boom")));
        assert_eq!(waiter.join().unwrap(), Err(BackendError::invalid("boom")));
        assert!(cell.is_done());
    });
}

/// The future is polled once and dropped while the completing side runs: no panic, no
/// lost state, and the cell still ends up done.
#[test]
fn future_dropped_before_completion() {
    loom::model(|| {
        let cell = CompletionCell::new();
        let completer = {
            let cell = cell.clone();
            thread::spawn(move || cell.complete(Ok(())))
        };
        {
            let fut = Completion::new(cell.clone());
            if let Poll::Ready(r) = poll_once(fut) {
                assert_eq!(r, Ok(()));
            }
        } // dropped (inside poll_once), possibly before completion
        completer.join().unwrap();
        assert!(cell.is_done());
        assert!(Completion::new(cell).is_done());
    });
}

/// Two completers race: the first result wins, the waiter sees exactly that one, and later
/// completions change nothing.
#[test]
fn double_complete_first_wins() {
    loom::model(|| {
        let cell = CompletionCell::new();
        let a = {
            let cell = cell.clone();
            thread::spawn(move || cell.complete(Ok(())))
        };
        let b = {
            let cell = cell.clone();
            thread::spawn(move || cell.complete(Err(BackendError::invalid("second"))))
        };
        let got = loom::future::block_on(Completion::new(cell.clone()));
        a.join().unwrap();
        b.join().unwrap();
        assert!(
            got == Ok(()) || got == Err(BackendError::invalid("second")),
            "{got:?}"
        );
        // Once both ran, every observer sees the same winner, even after a third complete.
        cell.complete(Err(BackendError::invalid("third")));
        assert_eq!(poll_once(Completion::new(cell)), Poll::Ready(got));
    });
}
