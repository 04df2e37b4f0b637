//! [`Mailbox`]: a flat-combining cell. The guarded state has exactly one owner at a time:
//! whoever holds the [`Gate`].
//!
//! A caller first tries to take the gate and run its own request inline: no channel, no
//! wake-up, no thread switch (the cache-hit fast path). If the gate is busy it queues a
//! message and the holder runs it: a holder drains the queue before it releases the gate
//! (the gate refuses to open while messages are announced), so no message is stranded. A
//! holder that keeps finding new messages stops after a bounded number of rounds, leaves
//! the pending bit set and wakes the actor task ([`Mailbox::wake`]), which drains the rest;
//! it does so only while a drainer is attached ([`Mailbox::attach_drainer`]), and takes the
//! work back if the drainer detached meanwhile, so a queued message never waits on a task
//! that is gone.
//!
//! Messages run on whichever thread holds the gate (an async task, a blocking-pool thread,
//! a thread dropping a buffer): handlers must be quick and must never block. Slow work is
//! done by the requester outside the gate.

use crate::gate::{Acquired, Gate};
use crate::notify::Notify;
use crate::reply::{reply_slot, ReplyFuture};
use gpualloc_runtime::sync::atomic::{AtomicBool, Ordering};
use gpualloc_runtime::sync::{lock, Mutex, MutexGuard};

#[cfg(not(loom))]
use std::sync::mpsc::{channel, Receiver, Sender};

#[cfg(loom)]
use loom::sync::mpsc::{channel, Receiver, Sender};

/// A closure run on the guarded state by whoever holds the gate.
pub type Job<S> = Box<dyn FnOnce(&mut S) + Send>;

/// The state a [`Mailbox`] guards, and how it handles queued messages.
pub trait Actor: Send + 'static {
    /// A queued message.
    type Msg: Send + 'static;
    /// Handles one message. Runs under the gate: must not block.
    fn handle(&mut self, msg: Self::Msg);
    /// Wraps a closure as a message (for [`Mailbox::call`]).
    fn job(job: Job<Self>) -> Self::Msg;
    /// Runs first whenever a thread takes the gate, before queued messages and the holder's
    /// own request: the place to fold in work done beside the state without the gate (e.g.
    /// per-thread slots, [`crate::ThreadSlots`]). Must be quick and must not block.
    fn on_acquire(&mut self) {}
}

/// Holder rounds of draining before the rest is handed to the actor task.
#[cfg(not(loom))]
const MAX_DRAIN_ROUNDS: usize = 8;

/// One round under loom, so the models reach the hand-off to the drainer.
#[cfg(loom)]
const MAX_DRAIN_ROUNDS: usize = 1;

struct Inner<S: Actor> {
    state: S,
    rx: Receiver<S::Msg>,
}

/// A flat-combining cell around `S`. See the module docs.
pub struct Mailbox<S: Actor> {
    gate: Gate,
    inner: Mutex<Inner<S>>,
    pub(crate) tx: Sender<S::Msg>,
    wake: Notify,
    /// An actor task is attached and drains what holders hand to it.
    drainer: AtomicBool,
}

/// What [`Mailbox::call`] did with a request.
pub enum Call<R> {
    /// It ran inline: here is the result.
    Ready(R),
    /// The gate was busy: it was queued; the future yields the result (None if the message
    /// was dropped unhandled, which only happens when the mailbox itself is dropped).
    Queued(ReplyFuture<R>),
}

/// How [`Mailbox::await_reply`] spins on a queued request's reply before it awaits it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplySpin {
    /// Checks of the reply.
    pub rounds: u32,
    /// Pauses between checks double each round, up to 64 (else one pause each).
    pub doubling: bool,
}

/// Exclusive access to the state while holding the gate. Dropping it drains the queue and
/// releases the gate.
pub struct Held<'a, S: Actor> {
    mailbox: &'a Mailbox<S>,
    inner: Option<MutexGuard<'a, Inner<S>>>,
}

impl<S: Actor> Mailbox<S> {
    /// A mailbox owning `state`.
    pub fn new(state: S) -> Self {
        let (tx, rx) = channel();
        Mailbox {
            gate: Gate::new(),
            inner: Mutex::new(Inner { state, rx }),
            tx,
            wake: Notify::new(),
            drainer: AtomicBool::new(false),
        }
    }

    /// A task that waits on [`Mailbox::wake`] and calls [`Mailbox::drain`] is running: holders
    /// may hand long drains to it.
    pub fn attach_drainer(&self) {
        self.drainer.store(true, Ordering::SeqCst);
    }

    /// The drainer task is leaving: holders drain everything themselves from now on. Drains
    /// once more, for work handed over just before.
    pub fn detach_drainer(&self) {
        self.drainer.store(false, Ordering::SeqCst);
        self.drain();
    }

    /// The actor task waits on this; it is notified when work was left for it.
    pub fn wake(&self) -> &Notify {
        &self.wake
    }

    /// True while someone holds the gate (a hint: spin on this, which only reads, before
    /// trying to take it, which writes and would steal the holder's cache line).
    pub fn is_busy(&self) -> bool {
        self.gate.is_locked()
    }

    /// True while messages are announced and not yet drained (a hint).
    pub fn has_pending(&self) -> bool {
        self.gate.is_pending()
    }

    pub(crate) fn gate(&self) -> &Gate {
        &self.gate
    }

    pub(crate) fn hold(&self, acquired: Acquired) -> Held<'_, S> {
        let mut held = Held {
            mailbox: self,
            inner: Some(lock(&self.inner)),
        };
        held.state().on_acquire();
        if acquired.pending && self.gate.take_pending() {
            held.drain_queue();
        }
        held
    }

    /// Takes the gate if it is free.
    pub fn try_hold(&self) -> Option<Held<'_, S>> {
        self.gate.try_acquire().map(|a| self.hold(a))
    }

    /// Runs `f` on the state if the gate is free; gives `f` back if it is busy.
    pub fn try_run<R, F: FnOnce(&mut S) -> R>(&self, f: F) -> Result<R, F> {
        match self.try_hold() {
            Some(mut held) => Ok(f(held.state())),
            None => Err(f),
        }
    }

    /// Runs `f` inline if the gate is free, else queues it for the holder.
    pub fn call<R, F>(&self, f: F) -> Call<R>
    where
        R: Send + 'static,
        F: FnOnce(&mut S) -> R + Send + 'static,
    {
        match self.try_run(f) {
            Ok(r) => Call::Ready(r),
            Err(f) => {
                let (tx, rx) = reply_slot();
                self.post(S::job(Box::new(move |s: &mut S| {
                    // A cancelled requester gives the value back; dropping it here undoes
                    // the work (RAII values return what they hold).
                    let _ = tx.send(f(s));
                })));
                Call::Queued(rx)
            }
        }
    }

    /// Awaits the reply of a request [`Mailbox::call`] queued. `None`: it was dropped
    /// unanswered (only when the mailbox itself goes). The reply always comes otherwise:
    /// holders drain before releasing the gate and hand leftovers only to a live drainer.
    ///
    /// Flat combining: the holder is usually running the queued request right now, so the
    /// caller first spins on the reply as `spin` says (and takes the gate and drains the
    /// queue itself if it frees up): this keeps the worker thread hot instead of parking it
    /// and being woken again. A separate step from [`Mailbox::call`], so the caller's
    /// inline path (`Call::Ready`) awaits nothing.
    pub async fn await_reply<R>(&self, rx: ReplyFuture<R>, spin: ReplySpin) -> Option<R> {
        for round in 0..spin.rounds {
            if rx.is_ready() {
                break;
            }
            if !self.is_busy() {
                self.drain();
            }
            // Back off: every check reads lines the holder is writing.
            let pauses = if spin.doubling {
                1u32 << round.min(6)
            } else {
                1
            };
            for _ in 0..pauses {
                std::hint::spin_loop();
            }
        }
        rx.await
    }

    /// Drains queued messages if the gate is free (the actor task's job). False if someone
    /// else holds the gate (they drain before releasing).
    pub fn drain(&self) -> bool {
        match self.try_hold() {
            Some(held) => {
                drop(held);
                true
            }
            None => false,
        }
    }

    /// Takes the gate, waiting (spinning, then yielding, then sleeping briefly) while it is
    /// busy. Only for blocking-pool threads doing rare slow work; holders never block, so
    /// the wait is short.
    pub fn hold_blocking(&self) -> Held<'_, S> {
        let mut tries = 0u32;
        loop {
            if let Some(held) = self.try_hold() {
                return held;
            }
            backoff(tries);
            tries = tries.saturating_add(1);
        }
    }
}

#[cfg(not(loom))]
fn backoff(tries: u32) {
    if tries < 16 {
        std::hint::spin_loop();
    } else if tries < 64 {
        std::thread::yield_now();
    } else {
        std::thread::sleep(std::time::Duration::from_micros(20));
    }
}

#[cfg(loom)]
fn backoff(_tries: u32) {
    loom::thread::yield_now();
}

impl<S: Actor> Held<'_, S> {
    /// The guarded state.
    pub fn state(&mut self) -> &mut S {
        let inner = self.inner.get_or_insert_with(|| lock(&self.mailbox.inner));
        &mut inner.state
    }

    fn drain_queue(&mut self) {
        let inner = self.inner.get_or_insert_with(|| lock(&self.mailbox.inner));
        while let Ok(msg) = inner.rx.try_recv() {
            inner.state.handle(msg);
        }
    }
}

impl<S: Actor> Drop for Held<'_, S> {
    fn drop(&mut self) {
        let gate = &self.mailbox.gate;
        if std::thread::panicking() {
            // A handler panicked: open the gate so nobody hangs, and let the actor task
            // drain what is left.
            self.inner = None;
            gate.release_with_pending();
            self.mailbox.wake.notify();
            return;
        }
        let mut rounds = 0;
        loop {
            self.inner = None;
            // One compare-exchange when nothing was queued meanwhile (the common case).
            if gate.try_release() {
                return;
            }
            if gate.take_pending() {
                self.drain_queue();
            }
            rounds += 1;
            if rounds >= MAX_DRAIN_ROUNDS && self.mailbox.drainer.load(Ordering::SeqCst) {
                gate.release_with_pending();
                self.mailbox.wake.notify();
                if self.mailbox.drainer.load(Ordering::SeqCst) {
                    return;
                }
                // The drainer detached meanwhile: take the work back unless someone else
                // took the gate (they drain before releasing).
                if gate.try_acquire().is_none() {
                    return;
                }
                rounds = 0;
            }
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[derive(Default)]
    struct Counter {
        log: Vec<u32>,
    }

    enum Msg {
        Push(u32),
        Job(Job<Counter>),
    }

    impl Actor for Counter {
        type Msg = Msg;
        fn handle(&mut self, msg: Msg) {
            match msg {
                Msg::Push(v) => self.log.push(v),
                Msg::Job(j) => j(self),
            }
        }
        fn job(job: Job<Self>) -> Msg {
            Msg::Job(job)
        }
    }

    #[test]
    fn runs_inline_when_free_and_queues_when_busy() {
        let mb = Mailbox::new(Counter::default());
        assert_eq!(mb.try_run(|c| c.log.len()).ok(), Some(0));
        {
            let mut held = mb.try_hold().unwrap();
            held.state().log.push(1);
            assert!(mb.try_run(|_| ()).is_err());
            mb.post(Msg::Push(2));
            let queued = match mb.call(|c| c.log.clone()) {
                Call::Queued(f) => f,
                Call::Ready(_) => panic!("gate is held"),
            };
            drop(held);
            assert_eq!(futures::executor::block_on(queued), Some(vec![1, 2]));
        }
        assert!(!mb.has_pending());
        assert_eq!(mb.try_run(|c| c.log.clone()).ok(), Some(vec![1, 2]));
    }

    #[test]
    fn many_threads_lose_no_message() {
        let mb = std::sync::Arc::new(Mailbox::new(Counter::default()));
        let threads: Vec<_> = (0..4)
            .map(|t| {
                let mb = mb.clone();
                std::thread::spawn(move || {
                    for i in 0..2000 {
                        if i % 2 == 0 {
                            mb.post(Msg::Push(t));
                        } else if let Call::Queued(f) = mb.call(move |c| c.log.push(t)) {
                            assert_eq!(futures::executor::block_on(f), Some(()));
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        mb.drain();
        assert_eq!(mb.try_run(|c| c.log.len()).ok(), Some(8000));
    }
}
