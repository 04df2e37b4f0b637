//! The sim's call counters and fault injection.
#![cfg(not(loom))] // the sim runs real threads; loom builds run only the loom models

use std::sync::Arc;

use gpualloc_runtime::{Backend, BackendError, DeviceId};
use gpualloc_sim::{Fault, Op, SimBackend, SimConfig};

const D0: DeviceId = DeviceId(0);

fn sim() -> Arc<SimBackend> {
    SimBackend::new(SimConfig::fast(1)).unwrap()
}

#[test]
fn counts_exactly_the_calls_made() {
    let sim = sim();
    let p = sim.malloc(D0, 4096).unwrap();
    let c = sim.counts();
    assert_eq!(c.get(Op::Malloc), 1);
    assert_eq!(c.get(Op::Free), 0);
    assert_eq!(c.total(), 1);
    sim.free(D0, p).unwrap();
    let s = sim.stream_create(D0).unwrap();
    let e = sim.event_create(D0).unwrap();
    sim.event_record(e, s).unwrap();
    sim.event_query(e).unwrap();
    sim.event_query(e).unwrap();
    let _ = sim.malloc(D0, 0); // failing calls count too
    let c = sim.counts();
    assert_eq!(c.get(Op::Malloc), 2);
    assert_eq!(c.get(Op::Free), 1);
    assert_eq!(c.get(Op::EventQuery), 2);
    assert_eq!(
        c.nonzero(),
        vec![
            (Op::Malloc, 2),
            (Op::Free, 1),
            (Op::StreamCreate, 1),
            (Op::EventCreate, 1),
            (Op::EventRecord, 1),
            (Op::EventQuery, 2)
        ]
    );
    sim.reset_counts();
    assert_eq!(sim.counts().total(), 0);
    sim.event_destroy(e).unwrap();
    sim.stream_destroy(s).unwrap();
    assert_eq!(sim.counts().get(Op::StreamDestroy), 1);
}

#[test]
fn oom_on_the_third_malloc() {
    let sim = sim();
    let oom = BackendError::OutOfMemory {
        requested: 0,
        what: "injected".into(),
    };
    sim.inject(
        Op::Malloc,
        Fault::FailNext {
            skip: 2,
            count: 1,
            error: oom.clone(),
        },
    );
    let a = sim.malloc(D0, 1 << 20).unwrap();
    let b = sim.malloc(D0, 1 << 20).unwrap();
    assert_eq!(sim.malloc(D0, 1 << 20), Err(oom));
    // The fault is spent: the 4th succeeds, and the failed call allocated nothing.
    let c = sim.malloc(D0, 1 << 20).unwrap();
    assert_eq!(sim.live_allocations(), 3);
    assert_eq!(sim.used_bytes(D0).unwrap(), 3 << 20);
    assert_eq!(sim.counts().get(Op::Malloc), 4);
    for p in [a, b, c] {
        sim.free(D0, p).unwrap();
    }
}

#[test]
fn fail_next_many_and_other_ops() {
    let sim = sim();
    let err = BackendError::Injected("free");
    sim.inject(
        Op::Free,
        Fault::FailNext {
            skip: 0,
            count: 2,
            error: err.clone(),
        },
    );
    let p = sim.malloc(D0, 4096).unwrap();
    assert_eq!(sim.free(D0, p), Err(err.clone()));
    assert_eq!(sim.free(D0, p), Err(err));
    assert_eq!(sim.live_allocations(), 1, "a failed free frees nothing");
    sim.free(D0, p).unwrap();
    assert_eq!(sim.live_allocations(), 0);
}

#[test]
fn random_faults_are_reproducible_and_clearable() {
    let outcomes = |seed| {
        let sim = sim();
        let err = BackendError::Injected("event_query");
        sim.inject(
            Op::EventQuery,
            Fault::Random {
                probability: 0.5,
                seed,
                error: err,
            },
        );
        let e = sim.event_create(D0).unwrap();
        let v: Vec<bool> = (0..64).map(|_| sim.event_query(e).is_ok()).collect();
        sim.clear_faults();
        assert!((0..64).all(|_| sim.event_query(e).is_ok()));
        sim.event_destroy(e).unwrap();
        v
    };
    let a = outcomes(1234);
    assert_eq!(a, outcomes(1234));
    let ok = a.iter().filter(|x| **x).count();
    assert!((16..=48).contains(&ok), "{ok} of 64 succeeded at p=0.5");
}

#[test]
fn injected_faults_hit_only_their_op() {
    let sim = sim();
    let err = BackendError::Injected("phys_create");
    sim.inject(
        Op::PhysCreate,
        Fault::FailNext {
            skip: 0,
            count: 1,
            error: err.clone(),
        },
    );
    let p = sim.malloc(D0, 4096).unwrap();
    assert_eq!(sim.phys_create(D0, 2 << 20), Err(err));
    let h = sim.phys_create(D0, 2 << 20).unwrap();
    sim.phys_release(h).unwrap();
    sim.free(D0, p).unwrap();
}
