//! Loom models of the actor plumbing: the flat-combining mailbox and its never-blocking
//! hand-off (a drop on any thread racing the holder's drain), the hand-off to a drainer that
//! detaches, the memory waiters' queue (wake vs cancel vs timeout), the reaper's
//! arm/disarm, and shutdown racing in-flight requests.
//!
//! Run: `RUSTFLAGS="--cfg loom" cargo test -p gpualloc-actor --release --test loom_actor`.

#![cfg(loom)]

use gpualloc_actor::mailbox::{Actor, Call, Job};
use gpualloc_actor::{Mailbox, ReaperArm, ReplySpin, Shutdown, Waiters};
use loom::sync::atomic::{AtomicBool, Ordering};
use loom::sync::Arc;
use loom::thread;

#[derive(Default)]
struct Count {
    handled: Vec<u32>,
    shut: bool,
    live: u32,
}

enum Msg {
    Push(u32),
    Return,
    Job(Job<Count>),
}

impl Actor for Count {
    type Msg = Msg;
    fn handle(&mut self, msg: Msg) {
        match msg {
            Msg::Push(v) => self.handled.push(v),
            Msg::Return => self.live -= 1,
            Msg::Job(j) => j(self),
        }
    }
    fn job(job: Job<Self>) -> Msg {
        Msg::Job(job)
    }
}

/// Posts from two threads race a third thread running its own request on the state: every
/// message is handled by somebody and nothing is left pending, with no drainer task at all.
#[test]
fn handoff_never_strands_a_message() {
    loom::model(|| {
        let mb = Arc::new(Mailbox::new(Count::default()));
        let posters: Vec<_> = (0..2)
            .map(|i| {
                let mb = mb.clone();
                thread::spawn(move || mb.post(Msg::Push(i)))
            })
            .collect();
        let _ = mb.try_run(|c| c.handled.len());
        for p in posters {
            p.join().unwrap();
        }
        assert!(!mb.has_pending(), "a message was left behind");
        let mut seen = mb.try_run(|c| c.handled.clone()).ok().unwrap();
        seen.sort();
        assert_eq!(seen, vec![0, 1]);
    });
}

/// A request queued while the gate is held gets its reply once the holder releases, and a
/// post stays ordered before a later request of the same thread.
#[test]
fn queued_call_is_answered_by_the_holder() {
    loom::model(|| {
        let mb = Arc::new(Mailbox::new(Count::default()));
        let held = mb.try_hold();
        let mb2 = mb.clone();
        let caller = thread::spawn(move || {
            mb2.post(Msg::Push(7));
            match mb2.call(|c| c.handled.clone()) {
                Call::Ready(v) => v,
                Call::Queued(f) => loom::future::block_on(f).unwrap(),
            }
        });
        drop(held);
        assert_eq!(caller.join().unwrap(), vec![7]);
    });
}

/// A call and `Mailbox::await_reply` racing a post on another thread (which holds the gate while it handles
/// messages): the spinning caller either drains the queue itself once the gate frees up or
/// gets the holder's answer; the reply always comes, and the post is handled once.
#[test]
fn a_queued_call_is_answered_while_it_spins_or_after() {
    for doubling in [false, true] {
        loom::model(move || {
            let mb = Arc::new(Mailbox::new(Count::default()));
            let mb2 = mb.clone();
            // Holds the gate while it handles its post, or queues it for the caller's run.
            let holder = thread::spawn(move || mb2.post(Msg::Push(1)));
            let spin = ReplySpin {
                rounds: 2,
                doubling,
            };
            let got = match mb.call(|c: &mut Count| c.handled.clone()) {
                Call::Ready(v) => Some(v),
                Call::Queued(rx) => loom::future::block_on(mb.await_reply(rx, spin)),
            };
            holder.join().unwrap();
            let got = got.expect("a reply");
            assert!(got.is_empty() || got == vec![1], "{got:?}");
            let last = match mb.call(|c: &mut Count| c.handled.len()) {
                Call::Ready(n) => Some(n),
                Call::Queued(rx) => loom::future::block_on(mb.await_reply(rx, spin)),
            };
            assert_eq!(last, Some(1));
        });
    }
}

/// A holder hands a long drain to the drainer task just as the task detaches: the work is
/// taken back (or drained by the task), never stranded.
#[test]
fn handoff_to_a_detaching_drainer_is_not_lost() {
    loom::model(|| {
        let mb = Arc::new(Mailbox::new(Count::default()));
        mb.attach_drainer();
        let mb1 = mb.clone();
        let poster = thread::spawn(move || mb1.post(Msg::Push(1)));
        let mb2 = mb.clone();
        let task = thread::spawn(move || mb2.detach_drainer());
        mb.post(Msg::Push(2));
        poster.join().unwrap();
        task.join().unwrap();
        assert!(!mb.has_pending(), "work handed to a departed drainer");
        assert!(!mb.is_busy(), "the gate was left locked");
        assert_eq!(mb.try_run(|c| c.handled.len()).ok(), Some(2));
    });
}

/// The head waiter is cancelled while memory comes back: the next waiter is woken either
/// way (a lost wake-up would leave `block_on` waiting forever, which loom reports).
#[test]
fn waiters_wake_vs_cancel() {
    loom::model(|| {
        // Turns borrow the queue; leak one small queue per run so threads can share it.
        let w: &'static Waiters = Box::leak(Box::new(Waiters::new()));
        let a = w.join();
        let b = w.join();
        // `a` joined an empty queue, `b` may overtake it: their first waits return at once.
        loom::future::block_on(a.wait());
        loom::future::block_on(b.wait());
        let second = thread::spawn(move || {
            loom::future::block_on(b.wait());
            b.finish();
        });
        let waker = thread::spawn(move || w.wake_head());
        let canceller = thread::spawn(move || drop(a));
        waker.join().unwrap();
        canceller.join().unwrap();
        second.join().unwrap();
        assert!(w.is_empty());
    });
}

/// The head passes memory it cannot use on while the waiter behind it is cancelled: the
/// wake-up reaches the third waiter either way (a lost one would leave `block_on` waiting
/// forever, which loom reports).
#[test]
fn waiters_pass_vs_cancel() {
    loom::model(|| {
        let w: &'static Waiters = Box::leak(Box::new(Waiters::new()));
        let (a, b, c) = (w.join(), w.join(), w.join());
        for t in [&a, &b, &c] {
            loom::future::block_on(t.wait());
        }
        let passer = thread::spawn(move || {
            a.pass();
            a
        });
        let canceller = thread::spawn(move || drop(b));
        loom::future::block_on(c.wait());
        let a = passer.join().unwrap();
        canceller.join().unwrap();
        drop((a, c));
        assert!(w.is_empty());
    });
}

/// A waiter times out (is dropped unwoken) behind a head that is served: the two leave in
/// either order and the queue ends empty.
#[test]
fn waiters_timeout_vs_finish() {
    loom::model(|| {
        let w: &'static Waiters = Box::leak(Box::new(Waiters::new()));
        let head = w.join();
        let t = thread::spawn(move || {
            let late = w.join();
            drop(late); // timed out
        });
        loom::future::block_on(head.wait());
        head.finish();
        t.join().unwrap();
        assert!(w.is_empty());
    });
}

/// Work becomes pending (and arms the reaper) while the reaper decides whether to sleep:
/// the reaper never sleeps through pending work.
#[test]
fn reaper_never_sleeps_through_pending_work() {
    loom::model(|| {
        let arm = Arc::new(ReaperArm::new());
        let pending = Arc::new(AtomicBool::new(false));
        let (a, p) = (arm.clone(), pending.clone());
        let free = thread::spawn(move || {
            p.store(true, Ordering::SeqCst);
            a.arm();
        });
        loop {
            arm.disarm();
            if pending.load(Ordering::SeqCst) {
                break;
            }
            loom::future::block_on(arm.armed());
        }
        free.join().unwrap();
    });
}

/// Shutdown races an in-flight request: the request either completes before the shutdown
/// (and its drop returns the block) or sees the shutdown and allocates nothing. Nothing is
/// live at the end, and a waiter on the shutdown signal is released.
#[test]
fn shutdown_races_in_flight_requests() {
    loom::model(|| {
        let mb = Arc::new(Mailbox::new(Count::default()));
        let signal = Arc::new(Shutdown::new());
        let mb1 = mb.clone();
        let request = thread::spawn(move || {
            let got = match mb1.call(|c| {
                if c.shut {
                    false
                } else {
                    c.live += 1;
                    true
                }
            }) {
                Call::Ready(v) => v,
                Call::Queued(f) => loom::future::block_on(f).unwrap(),
            };
            if got {
                // The buffer is dropped: its free is posted, never blocking.
                mb1.post(Msg::Return);
            }
        });
        let s2 = signal.clone();
        let watcher = thread::spawn(move || loom::future::block_on(s2.wait()));
        {
            let mut held = mb.hold_blocking();
            held.state().shut = true;
        }
        signal.trigger();
        request.join().unwrap();
        watcher.join().unwrap();
        assert!(!mb.has_pending());
        assert_eq!(mb.try_run(|c| c.live).ok(), Some(0));
    });
}
