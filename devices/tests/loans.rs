//! Loans (`streams/loans.rs`): under the `gpualloc` policy a request that misses its own
//! stream's free blocks takes another stream's free block, ordered after that stream's work,
//! before it gets new memory; the block goes back to its lender once the borrower's work on
//! it is done.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use gpualloc_accounting::AccountingBackend;
use gpualloc_devices::{AllocatorConfig, DeviceCore};
use gpualloc_runtime::capture::CaptureMode;
use gpualloc_runtime::{Backend, DeviceId, StreamHandle};
use gpualloc_sim::{Op, SimBackend, SimConfig};

const MIB: u64 = 1 << 20;
const D0: DeviceId = DeviceId(0);

const CONFIGS: [&str; 3] = [
    "expandable_segments:False",
    "expandable_segments:True",
    "garbage_collection_threshold:0.6,per_process_memory_fraction:0.9",
];

fn sim_rig(conf: &str) -> (Arc<SimBackend>, DeviceCore, StreamHandle, StreamHandle) {
    let sim = SimBackend::new(SimConfig::fast(1)).unwrap();
    let dynb: Arc<dyn Backend> = sim.clone();
    let s0 = dynb.stream_create(D0).unwrap();
    let s1 = dynb.stream_create(D0).unwrap();
    let core = DeviceCore::new(dynb, D0, AllocatorConfig::parse(conf).unwrap()).unwrap();
    (sim, core, s0, s1)
}

fn accounting_rig(
    conf: &str,
    manual_events: bool,
) -> (
    Arc<AccountingBackend>,
    DeviceCore,
    StreamHandle,
    StreamHandle,
) {
    let backend = Arc::new(if manual_events {
        AccountingBackend::manual_events(1, 1 << 40)
    } else {
        AccountingBackend::new(1, 1 << 40)
    });
    let dynb: Arc<dyn Backend> = backend.clone();
    let s0 = dynb.stream_create(D0).unwrap();
    let s1 = dynb.stream_create(D0).unwrap();
    let core = DeviceCore::new(dynb, D0, AllocatorConfig::parse(conf).unwrap()).unwrap();
    (backend, core, s0, s1)
}

/// The stream of the segment that holds `addr`.
fn segment_stream(core: &DeviceCore, addr: u64) -> u64 {
    let segments = core.snapshot().segments;
    let seg = segments
        .iter()
        .find(|s| (s.address..s.address + s.total_size).contains(&addr));
    seg.expect("a segment holds the block").stream
}

/// The bytes at `ptr`, read by a kernel on `stream` after its work.
fn read(sim: &SimBackend, stream: StreamHandle, ptr: gpualloc_runtime::DevicePtr) -> Vec<u8> {
    let out = Arc::new(Mutex::new(Vec::new()));
    let o = out.clone();
    sim.launch_kernel(stream, Duration::ZERO, move |m| {
        *o.lock().unwrap() = m.read(ptr, MIB)?;
        Ok(())
    })
    .unwrap();
    sim.stream_synchronize(stream).unwrap();
    let v = out.lock().unwrap().clone();
    v
}

/// The lender's kernel still runs when the block is lent: the borrower's kernel, queued
/// after the loan, runs after it (what it wrote is what stays), and nothing was allocated,
/// mapped or synchronized for the loan: one event record and one wait.
#[test]
fn the_borrowers_work_runs_after_the_lenders() {
    for conf in CONFIGS {
        let (sim, mut core, s0, s1) = sim_rig(conf);
        let a = core.malloc(4 * MIB, s0).unwrap();
        let ptr = a.ptr;
        sim.launch_kernel(s0, Duration::from_millis(100), move |m| {
            m.fill(ptr, MIB, 0x11)
        })
        .unwrap();
        core.free(a.ptr).unwrap();
        let before = sim.counts();
        let b = core.malloc(4 * MIB, s1).unwrap();
        let after = sim.counts();
        assert_eq!((b.ptr, b.stream), (a.ptr, s1), "{conf}");
        assert_eq!(core.allocation(b.ptr).unwrap().stream, s1);
        for op in [
            Op::Malloc,
            Op::Map,
            Op::StreamSynchronize,
            Op::DeviceSynchronize,
        ] {
            assert_eq!(after.get(op), before.get(op), "{conf}: {op:?}");
        }
        assert_eq!(after.get(Op::EventRecord) - before.get(Op::EventRecord), 1);
        assert_eq!(
            after.get(Op::StreamWaitEvent) - before.get(Op::StreamWaitEvent),
            1
        );
        sim.launch_kernel(s1, Duration::ZERO, move |m| m.fill(ptr, MIB, 0x22))
            .unwrap();
        sim.stream_synchronize(s0).unwrap();
        assert!(
            read(&sim, s1, ptr).iter().all(|&x| x == 0x22),
            "{conf}: the borrower ran before the lender"
        );
        core.free(b.ptr).unwrap();
        core.check_invariants().unwrap();
    }
}

/// A lent block's free waits for an event on the borrower, then the block is the lender's
/// again: its next request of the size gets it with no new memory.
#[test]
fn a_lent_block_goes_back_to_its_lender_once_the_borrowers_work_is_done() {
    for conf in ["expandable_segments:False", "expandable_segments:True"] {
        let (backend, mut core, s0, s1) = accounting_rig(conf, true);
        let a = core.malloc(40 * MIB, s0).unwrap();
        core.free(a.ptr).unwrap();
        core.record_history(Some(100));
        let b = core.malloc(40 * MIB, s1).unwrap();
        assert_eq!(b.ptr, a.ptr, "{conf}");
        core.free(b.ptr).unwrap();
        let reserved = core.reserved_bytes();
        // The borrower's event has not completed: the lender gets new memory.
        let c = core.malloc(40 * MIB, s0).unwrap();
        assert_ne!(c.ptr, a.ptr, "{conf}");
        assert!(core.reserved_bytes() > reserved, "{conf}");
        core.free(c.ptr).unwrap();
        backend.complete_stream(s1);
        core.process_events().unwrap();
        let d = core.malloc(40 * MIB, s0).unwrap();
        assert_eq!((d.ptr, d.stream), (a.ptr, s0), "{conf}: back to its lender");
        assert_eq!(
            core.allocation(d.ptr).unwrap().stream,
            s0,
            "{conf}: loan ended"
        );
        core.free(d.ptr).unwrap();
        core.check_invariants().unwrap();
        // The history shows the loan on the borrower's stream from its alloc to its return,
        // and the block on its lender's after.
        let at_a: Vec<(String, u64)> = core
            .snapshot()
            .trace
            .iter()
            .filter(|e| e.addr == a.ptr.0)
            .map(|e| (e.action.as_str().to_string(), e.stream))
            .collect();
        let expect = [
            ("alloc", s1.raw),
            ("free_requested", s1.raw),
            ("free_completed", s1.raw),
            ("alloc", s0.raw),
            ("free_requested", s0.raw),
            ("free_completed", s0.raw),
        ];
        let expect: Vec<(String, u64)> = expect.iter().map(|(a, s)| (a.to_string(), *s)).collect();
        assert_eq!(at_a, expect, "{conf}");
    }
}

/// One step of two streams taking turns: each takes 150 and 50 MiB and frees them, and
/// `after_turn` runs after each stream's turn.
fn take_turns(
    core: &mut DeviceCore,
    streams: [StreamHandle; 2],
    after_turn: impl Fn(StreamHandle),
) {
    for s in streams {
        let x = core.malloc(150 * MIB, s).unwrap();
        let y = core.malloc(50 * MIB, s).unwrap();
        core.free(x.ptr).unwrap();
        core.free(y.ptr).unwrap();
        after_turn(s);
    }
}

/// Two streams taking turns with 200 MiB each: PyTorch's policy keeps 400 MiB (each stream's
/// own), the `gpualloc` policy 200 MiB; after the first step, neither maps, unmaps,
/// allocates nor frees device memory again (events only, for the loans).
#[test]
fn streams_taking_turns_share_their_memory_and_make_no_driver_call_after_warm_up() {
    for conf in ["expandable_segments:False", "expandable_segments:True"] {
        for (policy, reserved) in [("pytorch", 400 * MIB), ("gpualloc", 200 * MIB)] {
            let conf = format!("{conf},policy:{policy}");
            let (backend, mut core, s0, s1) = accounting_rig(&conf, false);
            let step = |core: &mut DeviceCore| take_turns(core, [s0, s1], |_| {});
            step(&mut core);
            let warm = backend.counts();
            for _ in 0..10 {
                step(&mut core);
            }
            let after = backend.counts();
            assert_eq!(core.reserved_bytes(), reserved, "{conf}");
            assert_eq!(core.stats().reserved_bytes[0].peak, reserved, "{conf}");
            assert_eq!(
                (after.mallocs, after.frees, after.maps, after.unmaps),
                (warm.mallocs, warm.frees, warm.maps, warm.unmaps),
                "{conf}"
            );
            core.check_invariants().unwrap();
        }
    }
}

/// The same turns on the sim, each stream's work done before the other's turn: after warm-up
/// a step's backend calls are the loans' events alone, two loans and two returns (a record on
/// the lender and a wait on the borrower each, a record on the borrower and a query each),
/// and no memory call, synchronization or event creation.
#[test]
fn a_repeated_step_with_loans_calls_the_backend_for_events_only() {
    for conf in ["expandable_segments:False", "expandable_segments:True"] {
        let (sim, mut core, s0, s1) = sim_rig(conf);
        let step = |core: &mut DeviceCore| {
            take_turns(core, [s0, s1], |s| sim.stream_synchronize(s).unwrap())
        };
        step(&mut core);
        step(&mut core);
        let warm = sim.counts();
        for _ in 0..10 {
            step(&mut core);
        }
        let calls: Vec<(Op, u64)> = sim
            .counts()
            .since(&warm)
            .into_iter()
            .filter(|(op, _)| *op != Op::StreamSynchronize)
            .collect();
        assert_eq!(
            calls,
            [
                (Op::StreamWaitEvent, 20),
                (Op::EventRecord, 40),
                (Op::EventQuery, 20)
            ],
            "{conf}"
        );
        assert_eq!(core.reserved_bytes(), 200 * MIB, "{conf}");
        core.check_invariants().unwrap();
    }
}

/// A stream that allocates and frees a small block again and again, while other streams hold
/// free small blocks, gets a page of its own at its first miss and then hits: no backend call
/// at all after it, in every config. (Small blocks were lent: each malloc borrowed another
/// stream's block again, an event record and a wait, and each free recorded an event: four
/// backend calls per pair, forever, to save at most one 2 MiB page. The gate's one-task
/// throughput in `bench throughput` fell from 3.7 M pairs/s to 48 k on the sim.)
#[test]
fn a_small_blocks_loop_on_a_new_stream_makes_no_backend_call_after_its_first_miss() {
    for conf in CONFIGS {
        let (sim, mut core, s0, s1) = sim_rig(conf);
        let others: Vec<StreamHandle> = (0..4).map(|_| sim.stream_create(D0).unwrap()).collect();
        for &s in others.iter().chain([&s0]) {
            let a = core.malloc(4096, s).unwrap();
            core.free(a.ptr).unwrap();
        }
        let first = core.malloc(4096, s1).unwrap();
        core.free(first.ptr).unwrap();
        sim.stream_synchronize(s1).unwrap();
        let warm = sim.counts();
        for _ in 0..100 {
            let a = core.malloc(4096, s1).unwrap();
            assert_eq!(a.stream, s1);
            core.free(a.ptr).unwrap();
        }
        assert_eq!(sim.counts().since(&warm), [], "{conf}");
        // Six streams, a small page each (small pages are not moved either).
        assert_eq!(core.reserved_bytes(), 6 * 2 * MIB, "{conf}");
        core.check_invariants().unwrap();
    }
}

/// A loan the backend cannot order (its event record or wait fails) is not made: the request
/// gets new memory, as without loans, and nothing fails.
#[test]
fn a_loan_the_backend_cannot_order_falls_back_to_new_memory() {
    use gpualloc_runtime::BackendError;
    use gpualloc_sim::Fault;
    for op in [Op::EventRecord, Op::StreamWaitEvent] {
        let (sim, mut core, s0, s1) = sim_rig("expandable_segments:False");
        let a = core.malloc(4 * MIB, s0).unwrap();
        core.free(a.ptr).unwrap();
        sim.inject(
            op,
            Fault::FailNext {
                skip: 0,
                count: 1,
                error: BackendError::invalid("injected"),
            },
        );
        let mallocs = sim.counts().get(Op::Malloc);
        let b = core.malloc(4 * MIB, s1).unwrap();
        assert_ne!(b.ptr, a.ptr, "{op:?}");
        assert_eq!(sim.counts().get(Op::Malloc), mallocs + 1, "{op:?}");
        assert!(core.allocation(b.ptr).is_some_and(|x| x.stream == s1));
        sim.clear_faults();
        core.free(b.ptr).unwrap();
        core.check_invariants().unwrap();
    }
}

/// The size rules of the request's pool hold for loans: an oversize block of an ordinary
/// segment is not lent to a small request.
#[test]
fn an_oversize_block_is_not_lent_to_a_small_request() {
    let conf = "max_split_size_mb:64,expandable_segments:False";
    let (backend, mut core, s0, s1) = accounting_rig(conf, false);
    let a = core.malloc(100 * MIB, s0).unwrap();
    core.free(a.ptr).unwrap();
    let b = core.malloc(4 * MIB, s1).unwrap();
    assert_ne!(b.ptr, a.ptr);
    assert_eq!(backend.counts().mallocs, 2);
    // A request it exceeds by less than `max_non_split_rounding` (20 MiB) may have it.
    let c = core.malloc(90 * MIB, s1).unwrap();
    assert_eq!(c.ptr, a.ptr);
    core.check_invariants().unwrap();
}

/// No loan while a capture is under way: an event must not be recorded on, or waited for
/// by, a capturing stream; while the user's own capture runs on one stream, the others lend
/// and borrow as ever. Among equal fits the lowest stream lends.
#[test]
fn nothing_is_lent_during_a_capture() {
    let (sim, mut core, s0, s1) = sim_rig("expandable_segments:False");
    let (s2, s3, s4) = (
        sim.stream_create(D0).unwrap(),
        sim.stream_create(D0).unwrap(),
        sim.stream_create(D0).unwrap(),
    );
    // s2's 20 MiB segment, free.
    let a = core.malloc(4 * MIB, s2).unwrap();
    core.free(a.ptr).unwrap();
    // The user's own capture on s1, which the allocator was not told of: s1 borrows nothing.
    sim.stream_begin_capture(s1, CaptureMode::Relaxed).unwrap();
    let b = core.malloc(4 * MIB, s1).unwrap();
    assert_ne!(b.ptr, a.ptr);
    // s3 captures nothing: it is lent s2's block meanwhile.
    let mallocs = sim.counts().get(Op::Malloc);
    let c = core.malloc(4 * MIB, s3).unwrap();
    assert_eq!((c.ptr, c.stream), (a.ptr, s3));
    assert_eq!(sim.counts().get(Op::Malloc), mallocs);
    let g = sim.stream_end_capture(s1).unwrap();
    sim.graph_destroy(g).unwrap();
    // An announced capture on s0: no loan to any stream while it is under way.
    let pool = core.create_pool(false);
    sim.stream_begin_capture(s0, CaptureMode::Relaxed).unwrap();
    let id = sim.stream_capture_status(s0).unwrap().id().unwrap();
    core.begin_capture(id, pool, s0).unwrap();
    let e = core.malloc(4 * MIB, s4).unwrap();
    assert_eq!(
        sim.counts().get(Op::Malloc),
        mallocs + 1,
        "new memory for s4"
    );
    core.end_capture(id).unwrap();
    let g = sim.stream_end_capture(s0).unwrap();
    sim.graph_destroy(g).unwrap();
    // After it, s0 is lent: three 16 MiB remainders fit (s1's, s2's, s4's), the lowest
    // stream's is taken.
    let d = core.malloc(4 * MIB, s0).unwrap();
    assert_eq!((d.ptr.0, d.stream), (b.ptr.0 + 4 * MIB, s0));
    assert_eq!(sim.counts().get(Op::Malloc), mallocs + 1);
    for x in [b, c, d, e] {
        core.free(x.ptr).unwrap();
    }
    core.check_invariants().unwrap();
}

/// A stream whose capture the owner prepared (`DeviceCore::prepare_capture`, before the
/// backend's begin) neither lends nor borrows: its status still reads "not capturing", but
/// its begin may run on the user's thread between the core's check and the loan's event
/// record, and then the record is a node of the capture and the borrower's wait joins the
/// borrower into it (the capture's end fails: a stream was not joined back). Found by the
/// stress test on the emulated driver.
#[test]
fn a_stream_about_to_capture_neither_lends_nor_borrows() {
    for conf in CONFIGS {
        let (sim, mut core, s0, s1) = sim_rig(conf);
        let (s2, s3) = (
            sim.stream_create(D0).unwrap(),
            sim.stream_create(D0).unwrap(),
        );
        // s0 has a small free block, s1 a 40 MiB one.
        let a = core.malloc(4 * MIB, s0).unwrap();
        let b = core.malloc(40 * MIB, s1).unwrap();
        core.free(a.ptr).unwrap();
        core.free(b.ptr).unwrap();
        assert!(core.prepare_capture(s0));
        sim.reset_counts();
        // s0 would borrow s1's block (its own is too small): it gets new memory.
        let e = core.malloc(30 * MIB, s0).unwrap();
        assert_ne!(e.ptr.0, b.ptr.0, "{conf}: s0 borrowed while it prepares");
        assert_eq!(sim.counts().get(Op::EventRecord), 0, "{conf}");
        // s2 would be lent s0's block (the smallest that fits): it gets other memory.
        let f = core.malloc(4 * MIB, s2).unwrap();
        assert_ne!(f.ptr.0, a.ptr.0, "{conf}: s0 lent while it prepares");
        // Given up: s0 lends again (its free block is the smallest that fits).
        core.unprepare_capture(s0);
        core.free(e.ptr).unwrap();
        let g = core.malloc(4 * MIB, s3).unwrap();
        assert_eq!(g.stream, s3);
        assert_eq!(
            segment_stream(&core, g.ptr.0),
            s0.raw,
            "{conf}: not lent s0's block"
        );
        for x in [f, g] {
            core.free(x.ptr).unwrap();
        }
        core.check_invariants().unwrap();
    }
}

/// The best fit among the other streams' free blocks, under the size rules of the request's
/// pool: the smallest that fits; an oversize block of an ordinary segment only for a large
/// request it exceeds by less than `max_non_split_rounding` (20 MiB); an expandable block
/// whatever its size (the `gpualloc` policy does not limit them by `max_split_size`).
#[test]
fn the_smallest_fitting_block_is_lent_under_the_pools_size_rules() {
    // Smallest: s1 has 40 MiB free, s2 20 MiB; s0 asks 10.
    let (backend, mut core, s0, s1) = accounting_rig("expandable_segments:False", false);
    let s2 = backend.stream_create(D0).unwrap();
    let big = core.malloc(40 * MIB, s1).unwrap();
    let small = core.malloc(20 * MIB, s2).unwrap();
    core.free(big.ptr).unwrap();
    core.free(small.ptr).unwrap();
    assert_eq!(core.malloc(10 * MIB, s0).unwrap().ptr, small.ptr);

    // Ordinary segments with `max_split_size_mb:64`: 80 MiB free serves 64 MiB (not small,
    // exceeded by 16 MiB); 100 MiB free does not serve 70 MiB (exceeded by 30 MiB).
    let ordinary = "expandable_segments:False,max_split_size_mb:64";
    assert!(lent(ordinary, 80 * MIB, 64 * MIB));
    assert!(!lent(ordinary, 100 * MIB, 70 * MIB));
    // Expandable: the 100 MiB block serves a 4 MiB request.
    assert!(lent(
        "expandable_segments:True,max_split_size_mb:64",
        100 * MIB,
        4 * MIB
    ));
}

/// Whether, under `conf`, a block of `held` bytes one stream freed is lent to another stream's
/// request of `asked` bytes.
fn lent(conf: &str, held: u64, asked: u64) -> bool {
    let (_, mut core, s0, s1) = accounting_rig(conf, false);
    let a = core.malloc(held, s0).unwrap();
    core.free(a.ptr).unwrap();
    core.malloc(asked, s1).unwrap().ptr == a.ptr
}

/// Private pools keep PyTorch's rule: a named pool's free block serves only its stream.
#[test]
fn a_private_pools_blocks_are_not_lent() {
    let (_, mut core, s0, s1) = accounting_rig("expandable_segments:False", false);
    let pool = core.create_named_pool("kv", Default::default());
    let a = core.malloc_in(pool, 4 * MIB, s0).unwrap();
    core.free(a.ptr).unwrap();
    assert_ne!(core.malloc_in(pool, 4 * MIB, s1).unwrap().ptr, a.ptr);
}

/// The replay's loan (`DeviceCore::malloc_borrowed`): the block the history names, lent
/// and ordered as the chain lends (an event recorded on the lender, waited for by the
/// borrower); refused, giving the request back, where that block is the request's own
/// stream's, not free, oversize for it, or its lender captures. With
/// `lend_as_recorded` the chain lends nothing, and only this loan is made.
#[test]
fn the_replays_loan_is_of_the_named_block_and_refused_where_the_chain_would_not_lend() {
    let (sim, mut core, s0, s1) = sim_rig("expandable_segments:False");
    core.lend_as_recorded(true);
    let (s2, s3) = (
        sim.stream_create(D0).unwrap(),
        sim.stream_create(D0).unwrap(),
    );
    // s0's 20 MiB segment, free.
    let a = core.malloc(4 * MIB, s0).unwrap();
    core.free(a.ptr).unwrap();
    // The chain lends nothing now: s1's request gets new memory.
    let mallocs = sim.counts().get(Op::Malloc);
    let n = core.malloc(4 * MIB, s1).unwrap();
    assert_ne!(n.ptr, a.ptr);
    assert_eq!(sim.counts().get(Op::Malloc), mallocs + 1);
    // Refused: its own stream's block, an address no free block starts at.
    let own = core.segment_request_in(None, 4 * MIB, s0).unwrap();
    let given_back = core.malloc_borrowed(own, a.ptr.0).unwrap_err();
    assert!(core.malloc_borrowed(given_back, a.ptr.0 + 512).is_err());
    // The named block, lent to s2 and ordered after s0's work.
    let before = sim.counts();
    let request = core.segment_request_in(None, 4 * MIB, s2).unwrap();
    let Ok(y) = core.malloc_borrowed(request, a.ptr.0) else {
        panic!("the named block is lent");
    };
    assert_eq!((y.ptr, y.stream), (a.ptr, s2));
    let after = sim.counts();
    assert_eq!(after.get(Op::EventRecord) - before.get(Op::EventRecord), 1);
    assert_eq!(
        after.get(Op::StreamWaitEvent) - before.get(Op::StreamWaitEvent),
        1
    );
    assert_eq!(after.get(Op::Malloc), before.get(Op::Malloc));
    // A lender that captures (the user's own capture) lends nothing.
    let b = core.malloc(4 * MIB, s3).unwrap();
    core.free(b.ptr).unwrap();
    sim.stream_begin_capture(s3, CaptureMode::Relaxed).unwrap();
    let request = core.segment_request_in(None, 4 * MIB, s1).unwrap();
    assert!(core.malloc_borrowed(request, b.ptr.0).is_err());
    let g = sim.stream_end_capture(s3).unwrap();
    sim.graph_destroy(g).unwrap();
    for x in [n, y] {
        core.free(x.ptr).unwrap();
    }
    core.check_invariants().unwrap();

    // The size rules: an oversize block of an ordinary segment is not lent to a small request.
    let conf = "max_split_size_mb:64,expandable_segments:False";
    let (_backend, mut core, s0, s1) = accounting_rig(conf, false);
    let big = core.malloc(100 * MIB, s0).unwrap();
    core.free(big.ptr).unwrap();
    let request = core.segment_request_in(None, 4 * MIB, s1).unwrap();
    assert!(core.malloc_borrowed(request, big.ptr.0).is_err());
    core.check_invariants().unwrap();
}
