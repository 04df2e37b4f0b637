//! The thread cache while history is recorded: it keeps serving round trips, and
//! records them in its slots. Through the public API: a buffer revived on one thread and
//! dropped on another keeps its order, while other requests take the gate (and so collect
//! the slots) at any moment; a block evicted from a full slot is freed once; a thread whose
//! every request is a round trip still has all of them recorded, and the ring keeps the newest.

mod common;

use std::collections::HashMap;
use std::sync::mpsc;

use common::{build, history, recording, revivals, sim, MIB};
use gpualloc::devices::{TraceAction, TraceEntry};
use gpualloc::{DeviceBuffer, DeviceId, HistoryOptions};

const D0: DeviceId = DeviceId(0);

/// Checks that every address goes alloc → free_requested → free_completed → alloc ..., and
/// returns the number of allocs per address.
fn check_well_formed(trace: &[TraceEntry]) -> HashMap<u64, usize> {
    #[derive(PartialEq, Debug)]
    enum State {
        Live,
        Freeing,
        Free,
    }
    let mut state: HashMap<u64, State> = HashMap::new();
    let mut allocs: HashMap<u64, usize> = HashMap::new();
    for (i, e) in trace.iter().enumerate() {
        let s = state.entry(e.addr).or_insert(State::Free);
        match e.action {
            TraceAction::Alloc => {
                assert_eq!(*s, State::Free, "entry {i}: {e:?} allocated while not free");
                *s = State::Live;
                *allocs.entry(e.addr).or_default() += 1;
            }
            TraceAction::FreeRequested => {
                assert_eq!(*s, State::Live, "entry {i}: {e:?} freed while not live");
                *s = State::Freeing;
            }
            TraceAction::FreeCompleted => {
                assert_eq!(*s, State::Freeing, "entry {i}: {e:?}");
                *s = State::Free;
            }
            _ => {}
        }
    }
    assert!(
        trace.windows(2).all(|w| w[0].time_us <= w[1].time_us),
        "times in order"
    );
    allocs
}

#[test]
fn a_buffer_passed_between_threads_keeps_its_order_while_others_take_the_gate() {
    const ROUNDS: usize = 2000;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let _in_runtime = rt.enter();
    let alloc = build(sim(1 << 30), "");
    let s = alloc.new_stream(D0).unwrap();
    rt.block_on(alloc.record_history(HistoryOptions::default()))
        .unwrap();
    let first = rt.block_on(alloc.malloc(MIB, &s)).unwrap();
    let ptr = first.ptr().0;
    let revived_before = revivals(&alloc);
    // Two threads pass one buffer back and forth; each drops what it receives (a park in its
    // slot) and asks again for the same size (a revive from it), then passes the buffer on.
    let (to_b, from_a) = mpsc::channel::<DeviceBuffer>();
    let (to_a, from_b) = mpsc::channel::<DeviceBuffer>();
    std::thread::scope(|scope| {
        let player = |rx: mpsc::Receiver<DeviceBuffer>, tx: mpsc::Sender<DeviceBuffer>| {
            let (alloc, s, handle) = (alloc.clone(), s.clone(), rt.handle().clone());
            move || {
                for _ in 0..ROUNDS {
                    let Ok(buf) = rx.recv() else { return };
                    drop(buf);
                    let again = handle.block_on(alloc.malloc(MIB, &s)).unwrap();
                    if tx.send(again).is_err() {
                        return;
                    }
                }
            }
        };
        let a = scope.spawn(player(from_b, to_b.clone()));
        let b = scope.spawn(player(from_a, to_a));
        // Meanwhile requests of other sizes take the gate, collecting the slots.
        let busy = scope.spawn(|| {
            for i in 0..200u64 {
                let other = rt.block_on(alloc.malloc(3 * MIB + i * 4096, &s)).unwrap();
                drop(other);
                rt.block_on(alloc.stats(D0)).unwrap();
            }
        });
        to_b.send(first).unwrap();
        busy.join().unwrap();
        a.join().unwrap();
        b.join().unwrap();
    });
    let trace = rt.block_on(history(&alloc));
    let allocs = check_well_formed(&trace);
    // The first malloc, then one per round of each thread, all at the same address: the
    // buffer only ever went back to the thread cache.
    assert_eq!(allocs[&ptr], 1 + 2 * ROUNDS);
    assert!(
        revivals(&alloc) - revived_before > ROUNDS as u64,
        "served by the cache"
    );
    rt.block_on(alloc.shutdown()).unwrap();
}

#[tokio::test(flavor = "current_thread")]
async fn a_block_evicted_from_a_full_slot_is_freed_once() {
    let (alloc, s) = recording("", HistoryOptions::default()).await;
    // More distinct sizes than a slot parks: dropping them all evicts the oldest ones,
    // which the core frees without recording their frees again.
    let mut bufs = Vec::new();
    for i in 0..12u64 {
        bufs.push(alloc.malloc(MIB + i * 512, &s).await.unwrap());
    }
    let ptrs: Vec<u64> = bufs.iter().map(|b| b.ptr().0).collect();
    drop(bufs);
    let stats = alloc.stats(D0).await.unwrap();
    assert_eq!(
        stats.allocated_bytes.all().current,
        0,
        "all back in the core"
    );
    let trace = history(&alloc).await;
    let allocs = check_well_formed(&trace);
    let frees: Vec<u64> = trace
        .iter()
        .filter(|e| e.action == TraceAction::FreeRequested)
        .map(|e| e.addr)
        .collect();
    assert_eq!(
        frees, ptrs,
        "one free per buffer, in the order they were dropped"
    );
    assert!(allocs.values().all(|&n| n == 1));
    alloc.shutdown().await.unwrap();
}

#[tokio::test(flavor = "current_thread")]
async fn a_thread_that_only_revives_has_every_round_trip_recorded() {
    const TRIPS: usize = 3000;
    let (alloc, s) = recording("", HistoryOptions::default()).await;
    let before = revivals(&alloc);
    let mut buf = alloc.malloc(MIB, &s).await.unwrap();
    for _ in 0..TRIPS {
        drop(buf);
        buf = alloc.malloc(MIB, &s).await.unwrap();
    }
    // A slot whose log grows long asks for a collection, which returns its parked block to
    // the core too: one request in about 340 then goes through the core.
    let revived = revivals(&alloc) - before;
    assert!(revived >= (TRIPS - TRIPS / 300) as u64, "{revived}");
    let trace = history(&alloc).await;
    let allocs = check_well_formed(&trace);
    assert_eq!(allocs[&buf.ptr().0], 1 + TRIPS);
    // A small ring keeps the newest: the last round trips, ending with the live buffer's
    // alloc.
    alloc
        .record_history(HistoryOptions {
            max_entries: 10,
            ..HistoryOptions::default()
        })
        .await
        .unwrap();
    for _ in 0..100 {
        drop(buf);
        buf = alloc.malloc(MIB, &s).await.unwrap();
    }
    let mut snap = alloc.snapshot().await.unwrap().remove(0).trace;
    assert_eq!(snap.len(), 10);
    assert_eq!(snap.pop().unwrap().action, TraceAction::Snapshot);
    let last = snap.pop().unwrap();
    assert_eq!((last.action, last.addr), (TraceAction::Alloc, buf.ptr().0));
    drop(buf);
    alloc.shutdown().await.unwrap();
}
