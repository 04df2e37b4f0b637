//! The miss chain step by step, without threads: each driver call the core asks for, in
//! PyTorch's order, made (or refused) by the test (`gpualloc_devices` `miss/`).

mod common;

use std::sync::Arc;

use common::{drive, kind, oom};
use gpualloc_accounting::AccountingBackend;
use gpualloc_devices::{
    AllocError, AllocatorConfig, CachedOutcome, DeviceCore, IoDone, MemPoolId, Miss, MissIo,
    MissStep, RecordedHandles, SegmentRequest,
};
use gpualloc_runtime::{Backend, BackendError, DeviceId, StreamHandle};

const MIB: u64 = 1 << 20;
const DEV: DeviceId = DeviceId(0);

fn rig(capacity: u64, conf: &str) -> (Arc<AccountingBackend>, DeviceCore, StreamHandle) {
    let backend = Arc::new(AccountingBackend::manual_events(1, capacity));
    let dynb: Arc<dyn Backend> = backend.clone();
    let s = dynb.stream_create(DEV).unwrap();
    let core = DeviceCore::new(dynb, DEV, AllocatorConfig::parse(conf).unwrap()).unwrap();
    (backend, core, s)
}

fn miss(core: &mut DeviceCore, size: u64, stream: StreamHandle) -> SegmentRequest {
    match core.try_cached(size, stream).unwrap() {
        CachedOutcome::Miss(r) => r,
        CachedOutcome::Hit(a) => panic!("expected a miss, got {:?}", a.ptr),
    }
}

/// Runs a miss to its end in place: each segment malloc the test refuses while
/// `refuse_mallocs` lasts, every other call made. Returns the steps.
fn run(
    core: &mut DeviceCore,
    backend: &dyn Backend,
    request: SegmentRequest,
    mut refuse_mallocs: usize,
) -> (Vec<String>, MissStep) {
    drive(core, &mut Miss::new(request), None, |_, io| match io {
        MissIo::AllocSegment { .. } if refuse_mallocs > 0 => {
            refuse_mallocs -= 1;
            io.fail(oom())
        }
        io => io.perform(backend),
    })
}

/// The lookup of a request of `size` bytes on `stream` in private pool `pool`: a miss.
fn miss_in(
    core: &mut DeviceCore,
    pool: MemPoolId,
    size: u64,
    stream: StreamHandle,
) -> SegmentRequest {
    match core.try_cached_in(pool, size, stream).unwrap() {
        CachedOutcome::Miss(r) => r,
        CachedOutcome::Hit(a) => panic!("expected a miss, got {:?}", a.ptr),
    }
}

/// An off-core miss of `request` whose first step is driver call `want` (by its kind); returns
/// the miss and the call.
fn off_core_io(core: &mut DeviceCore, request: SegmentRequest, want: &str) -> (Miss, MissIo) {
    let mut m = Miss::off_core(request);
    let step = core.advance_miss(&mut m, None);
    assert_eq!(kind(&step), want);
    let MissStep::Io(io) = step else {
        unreachable!()
    };
    (m, io)
}

/// Makes driver call `io` of `m`, then every call after it, to the miss's end. Returns the
/// kinds of the steps after `io` and the last step.
fn perform_to_the_end(core: &mut DeviceCore, m: &mut Miss, io: MissIo) -> (Vec<String>, MissStep) {
    let backend = core.backend().clone();
    let done = io.perform(backend.as_ref());
    drive(core, m, Some(done), |core, io| {
        let backend = core.backend().clone();
        io.perform(backend.as_ref())
    })
}

#[test]
fn a_full_device_walks_pytorchs_release_chain_in_order() {
    // Oversize blocks from 24 MiB; a 30 MiB block cached, a 16 MiB one freed behind an event.
    let (backend, mut core, s) = rig(1 << 30, "max_split_size_mb:24");
    let other = backend.stream_create(DEV).unwrap();
    let a = core.malloc(30 * MIB, s).unwrap();
    let b = core.malloc(16 * MIB, s).unwrap();
    core.record_stream(b.ptr, other).unwrap();
    core.free(a.ptr).unwrap();
    core.free(b.ptr).unwrap();
    let request = miss(&mut core, 40 * MIB, s);
    let (steps, end) = run(&mut core, backend.as_ref(), request, 1);
    assert_eq!(
        steps,
        [
            "alloc 40 MiB",  // refused: the device is full
            "free [30] MiB", // oversize blocks, not enough for 40 MiB
            "sync 1 events", // the last release waits for the pending free
            "free [16] MiB", // and returns every cached segment
            "alloc 40 MiB",  // the retry
            "done 40 MiB",
        ]
    );
    assert!(matches!(end, MissStep::Done(_)));
    let stats = core.stats();
    assert_eq!(
        (
            stats.num_alloc_retries,
            stats.num_sync_all_streams,
            stats.num_device_free
        ),
        (1, 1, 2)
    );
    assert_eq!(backend.used(DEV), 40 * MIB);
    core.check_invariants().unwrap();
}

#[test]
fn an_oversize_block_large_enough_is_released_and_the_malloc_retried_at_once() {
    let (backend, mut core, s) = rig(1 << 30, "max_split_size_mb:24");
    let a = core.malloc(60 * MIB, s).unwrap();
    core.free(a.ptr).unwrap();
    // 30 MiB: the cached 60 MiB block is oversize and would waste 20 MiB or more.
    let request = miss(&mut core, 30 * MIB, s);
    let (steps, _) = run(&mut core, backend.as_ref(), request, 1);
    assert_eq!(
        steps,
        [
            "alloc 30 MiB",
            "free [60] MiB",
            "alloc 30 MiB",
            "done 30 MiB"
        ]
    );
    assert_eq!(core.stats().num_alloc_retries, 0, "not the last retry");
}

#[test]
fn when_nothing_helps_the_miss_fails_out_of_memory_once() {
    let (backend, mut core, s) = rig(1 << 30, "");
    let request = miss(&mut core, 40 * MIB, s);
    let (steps, end) = run(&mut core, backend.as_ref(), request, 2);
    assert_eq!(
        steps,
        ["alloc 40 MiB", "alloc 40 MiB", "failed oom"],
        "nothing cached: no release has a driver call"
    );
    let MissStep::Failed(AllocError::OutOfMemory(report)) = end else {
        panic!("expected out of memory");
    };
    assert_eq!(report.requested, 40 * MIB);
    assert_eq!(core.stats().num_ooms, 1);
    assert_eq!(core.stats().num_sync_all_streams, 1);
    assert_eq!(backend.used(DEV), 0);
}

#[test]
fn garbage_collection_frees_its_victims_before_the_segment_malloc() {
    let (backend, mut core, s) = rig(
        100 * MIB,
        "garbage_collection_threshold:0.5,per_process_memory_fraction:1.0",
    );
    let a = core.malloc(30 * MIB, s).unwrap();
    let b = core.malloc(30 * MIB, s).unwrap();
    core.free(a.ptr).unwrap();
    let request = miss(&mut core, 36 * MIB, s);
    let (steps, _) = run(&mut core, backend.as_ref(), request, 0);
    assert_eq!(steps, ["free [30] MiB", "alloc 36 MiB", "done 36 MiB"]);
    core.free(b.ptr).unwrap();
    core.check_invariants().unwrap();
}

#[test]
fn expandable_growth_maps_pages_and_a_refused_map_leaves_the_books_as_they_were() {
    let conf = "expandable_segments:True";
    let (backend, mut core, s) = rig(1 << 30, conf);
    let request = miss(&mut core, 30 * MIB, s);
    let mut m = Miss::new(request);
    let step = core.advance_miss(&mut m, None);
    assert_eq!(kind(&step), "map 30 MiB");
    let MissStep::Io(io) = step else {
        unreachable!()
    };
    // Refused: the chain goes on (nothing cached to release) and ends out of memory, with
    // the planned pages back in the unmapped set.
    let done = Some(io.fail(oom()));
    let (steps, _) = drive(&mut core, &mut m, done, |_, io| io.fail(oom()));
    assert_eq!(steps, ["map 30 MiB", "failed oom"]);
    core.check_invariants().unwrap();
    assert_eq!((core.reserved_bytes(), core.growing_bytes()), (0, 0));
    // The same request again, its map made: served from the new pages.
    let request = miss(&mut core, 30 * MIB, s);
    let (steps, _) = run(&mut core, backend.as_ref(), request, 0);
    assert_eq!(steps, ["map 30 MiB", "done 30 MiB"]);
    assert_eq!(core.reserved_bytes(), 30 * MIB);
    core.check_invariants().unwrap();
}

#[test]
fn the_last_release_unmaps_free_pages_of_expandable_segments() {
    // PyTorch's policy: the `gpualloc` policy would lend the other stream the cached block.
    let conf = "expandable_segments:True,policy:pytorch";
    let (backend, mut core, s) = rig(1 << 30, conf);
    let other = backend.stream_create(DEV).unwrap();
    let a = core.malloc(40 * MIB, s).unwrap();
    core.free(a.ptr).unwrap();
    // Another stream's request cannot use the 40 MiB cached for `s`: its map is refused, the
    // cache released (the 40 MiB unmapped), and the map made again.
    let request = miss(&mut core, 40 * MIB, other);
    let mut m = Miss::new(request);
    let mut refused = false;
    let (steps, _) = drive(&mut core, &mut m, None, |_, io| match io {
        MissIo::MapPages(_) if !refused => {
            assert!(!io.releases_memory());
            refused = true;
            io.fail(oom())
        }
        io => {
            let unmaps = matches!(io, MissIo::UnmapPages(_));
            assert_eq!(io.releases_memory(), unmaps, "{io:?}");
            io.perform(backend.as_ref())
        }
    });
    assert_eq!(
        steps,
        ["map 40 MiB", "unmap 40 MiB", "map 40 MiB", "done 40 MiB"]
    );
    assert_eq!(core.reserved_bytes(), 40 * MIB);
    assert_eq!(backend.used(DEV), 40 * MIB);
    core.check_invariants().unwrap();
}

#[test]
fn a_mixed_up_outcome_fails_the_miss_and_gives_its_segment_back() {
    let (backend, mut core, s) = rig(1 << 30, "");
    let first = miss(&mut core, 40 * MIB, s);
    let second = miss(&mut core, 20 * MIB, s);
    let (mut m1, mut m2) = (Miss::new(first), Miss::new(second));
    let MissStep::Io(io1) = core.advance_miss(&mut m1, None) else {
        panic!("expected a driver call")
    };
    // The first miss's segment, fed to the second, which waits for nothing.
    let segment = io1.perform(backend.as_ref());
    assert_eq!(backend.used(DEV), 40 * MIB);
    let step = core.advance_miss(&mut m2, Some(segment));
    assert_eq!(kind(&step), "free [40] MiB");
    let MissStep::Io(io) = step else {
        unreachable!()
    };
    let end = core.advance_miss(&mut m2, Some(io.perform(backend.as_ref())));
    assert!(matches!(
        end,
        MissStep::Failed(AllocError::InvalidSize { .. })
    ));
    assert_eq!(backend.used(DEV), 0, "nothing leaked");
    // The first miss, advanced without the outcome it waits for, fails too.
    let end = core.advance_miss(&mut m1, None);
    assert!(matches!(
        end,
        MissStep::Failed(AllocError::InvalidSize { .. })
    ));
    core.check_invariants().unwrap();
}

#[test]
fn a_shutdown_while_pages_are_mapped_gives_them_back() {
    let (backend, mut core, s) = rig(1 << 30, "expandable_segments:True");
    // A live block keeps the segment in the books: the miss grows it.
    let _live = core.malloc(4 * MIB, s).unwrap();
    let request = miss(&mut core, 30 * MIB, s);
    let mut m = Miss::new(request);
    let MissStep::Io(io) = core.advance_miss(&mut m, None) else {
        panic!("expected a map")
    };
    let mapped = io.perform(backend.as_ref());
    assert_eq!(backend.used(DEV), 34 * MIB);
    let base = core.snapshot().segments[0].address;
    assert_eq!(backend.reservation_holding(DEV, base), Some(base));
    core.shutdown().unwrap();
    give_back_after_shutdown(&mut core, backend.as_ref(), &mut m, mapped, "give back");
    assert_eq!(backend.used(DEV), 0);
    assert_eq!(backend.reservation_holding(DEV, base), None);
}

/// Advances `m`, whose driver call landed (`done`) after its core shut down: the step gives
/// back what it held (`expected`, a step's kind), then the miss fails with `Shutdown`.
fn give_back_after_shutdown(
    core: &mut DeviceCore,
    backend: &dyn Backend,
    m: &mut Miss,
    done: IoDone,
    expected: &str,
) {
    let step = core.advance_miss(m, Some(done));
    assert_eq!(kind(&step), expected);
    let MissStep::Io(io) = step else {
        unreachable!()
    };
    let end = core.advance_miss(m, Some(io.perform(backend)));
    assert!(matches!(end, MissStep::Failed(AllocError::Shutdown)));
}

#[test]
fn off_the_core_a_segment_in_flight_is_claimed_and_a_block_freed_meanwhile_serves_the_miss() {
    // 100 MiB allowed of 1 GiB.
    let (backend, mut core, s) = rig(1 << 30, "per_process_memory_fraction:0.09765625");
    let a = core.malloc(40 * MIB, s).unwrap();
    let request = miss(&mut core, 40 * MIB, s);
    let mut m = Miss::off_core(request);
    let MissStep::Io(io @ MissIo::AllocSegment { .. }) = core.advance_miss(&mut m, None) else {
        panic!("expected a segment malloc")
    };
    // In flight, the segment counts against the cap: a second miss of 40 MiB does not fit
    // beside it (40 + 40 + 40 > 100).
    assert_eq!(core.growing_bytes(), 40 * MIB);
    let second = miss(&mut core, 40 * MIB, s);
    let step = core.advance_miss(&mut Miss::off_core(second), None);
    assert_eq!(kind(&step), "failed oom");
    // The device refuses it; meanwhile the user frees `a`: the miss takes it.
    core.free(a.ptr).unwrap();
    let end = core.advance_miss(&mut m, Some(io.fail(oom())));
    let MissStep::Done(b) = end else {
        panic!("expected the freed block")
    };
    assert_eq!(b.ptr, a.ptr);
    assert_eq!(core.growing_bytes(), 0, "the claim ended");
    assert_eq!(backend.used(DEV), 40 * MIB);
}

#[test]
fn off_the_core_a_growth_whose_neighbour_was_taken_grows_again() {
    let (backend, mut core, s) = rig(1 << 30, "expandable_segments:True");
    let _b = core.malloc(4 * MIB, s).unwrap();
    let a = core.malloc(20 * MIB, s).unwrap();
    core.free(a.ptr).unwrap();
    let request = miss(&mut core, 30 * MIB, s);
    let mut m = Miss::off_core(request);
    let step = core.advance_miss(&mut m, None);
    let first = kind(&step);
    let MissStep::Io(io) = step else {
        panic!("expected a map")
    };
    let mapped = io.perform(backend.as_ref());
    // Another request takes the free 20 MiB the growth meant to extend.
    let taken = core.malloc(20 * MIB, s).unwrap();
    assert_eq!(taken.ptr, a.ptr);
    let step = core.advance_miss(&mut m, Some(mapped));
    assert_eq!(
        (first.as_str(), kind(&step).as_str()),
        ("map 10 MiB", "map 20 MiB"),
        "the second growth maps what the request still lacks"
    );
    let MissStep::Io(io) = step else {
        unreachable!()
    };
    let end = core.advance_miss(&mut m, Some(io.perform(backend.as_ref())));
    assert!(matches!(end, MissStep::Done(ref c) if c.size == 30 * MIB));
    core.check_invariants().unwrap();
}

#[test]
fn off_the_core_the_last_release_completes_only_the_frees_whose_events_are_done() {
    let (backend, mut core, s) = rig(1 << 30, "expandable_segments:False");
    let other = backend.stream_create(DEV).unwrap();
    let a = core.malloc(16 * MIB, s).unwrap();
    core.record_stream(a.ptr, other).unwrap();
    core.free(a.ptr).unwrap();
    let request = miss(&mut core, 40 * MIB, s);
    let mut m = Miss::off_core(request);
    let mut refused = false;
    let (_, end) = drive(&mut core, &mut m, None, |core, io| match io {
        MissIo::AllocSegment { .. } if !refused => {
            refused = true;
            io.fail(oom())
        }
        MissIo::SynchronizeEvents(_) => {
            let synced = io.perform(backend.as_ref());
            // Meanwhile another request's lookup completes that free, takes the block and
            // frees it again behind a new event (the recycled one), which has not completed.
            core.process_events().unwrap();
            let b = core.malloc(16 * MIB, s).unwrap();
            assert_eq!(b.ptr, a.ptr);
            core.record_stream(b.ptr, other).unwrap();
            core.free(b.ptr).unwrap();
            assert_eq!(core.pending_frees(), 1);
            synced
        }
        io => io.perform(backend.as_ref()),
    });
    assert!(matches!(end, MissStep::Done(_)));
    assert_eq!(
        core.pending_frees(),
        1,
        "the new free still waits for its event"
    );
    assert_eq!(core.reserved_bytes(), 56 * MIB, "its segment stays");
    core.check_invariants().unwrap();
}

#[test]
fn pages_are_unmapped_after_their_segment_stream_finished_its_work() {
    use gpualloc_sim::{Op, SimBackend, SimConfig};
    let sim = SimBackend::new(SimConfig::fast(1)).unwrap();
    let dynb: Arc<dyn Backend> = sim.clone();
    let s = dynb.stream_create(DEV).unwrap();
    let other = dynb.stream_create(DEV).unwrap();
    let conf = AllocatorConfig::parse("expandable_segments:True").unwrap();
    let mut core = DeviceCore::new(dynb.clone(), DEV, conf).unwrap();
    let a = core.malloc(40 * MIB, s).unwrap();
    core.free(a.ptr).unwrap();
    let request = miss(&mut core, 40 * MIB, other);
    let mut m = Miss::new(request);
    let mut refused = false;
    let (_, end) = drive(&mut core, &mut m, None, |_, io| match io {
        MissIo::MapPages(_) if !refused => {
            refused = true;
            io.fail(oom())
        }
        MissIo::UnmapPages(_) => {
            sim.reset_counts();
            let done = io.perform(dynb.as_ref());
            let counts = sim.counts();
            assert_eq!(
                (counts.get(Op::StreamSynchronize), counts.get(Op::Unmap)),
                (1, 2),
                "one wait for the segment's stream, then its two 20 MiB handles unmapped"
            );
            done
        }
        io => io.perform(dynb.as_ref()),
    });
    assert!(matches!(end, MissStep::Done(_)), "{}", kind(&end));
    core.check_invariants().unwrap();
}

#[test]
fn off_the_core_blocks_freed_by_the_last_release_serve_the_miss_before_a_new_segment() {
    // 8 MiB blocks split from one 20 MiB segment; `a` freed behind an event, `b` live.
    for off_core in [true, false] {
        let (backend, mut core, s) = rig(1 << 30, "expandable_segments:False");
        let other = backend.stream_create(DEV).unwrap();
        let a = core.malloc(8 * MIB, s).unwrap();
        let _b = core.malloc(8 * MIB, s).unwrap();
        core.record_stream(a.ptr, other).unwrap();
        core.free(a.ptr).unwrap();
        let request = miss(&mut core, 8 * MIB, s);
        let mut m = if off_core {
            Miss::off_core(request)
        } else {
            Miss::new(request)
        };
        let mut first = true;
        let (steps, end) = drive(&mut core, &mut m, None, |_, io| {
            let refuse = std::mem::take(&mut first);
            match io {
                MissIo::AllocSegment { .. } if refuse => io.fail(oom()),
                io => io.perform(backend.as_ref()),
            }
        });
        if off_core {
            // The synchronized free gave `a` back: it serves the request.
            assert_eq!(steps, ["alloc 20 MiB", "sync 1 events", "done 8 MiB"]);
            assert!(matches!(end, MissStep::Done(ref c) if c.ptr == a.ptr));
        } else {
            // PyTorch's order: the malloc is retried after the release.
            assert_eq!(
                steps,
                [
                    "alloc 20 MiB",
                    "sync 1 events",
                    "alloc 20 MiB",
                    "done 8 MiB"
                ]
            );
        }
        core.check_invariants().unwrap();
    }
}

/// A segment the chain took out of the books is the device's until its free returns: off the
/// core, a request made meanwhile must not get memory the cap only has once it is back
/// (PyTorch lowers `total_allocated_memory` after `cudaFree`, under the lock the request
/// waits for).
#[test]
fn off_the_core_a_segment_being_freed_counts_against_the_cap_until_its_free_returns() {
    // 100 MiB allowed of 1 GiB; blocks from 24 MiB are oversize.
    let (backend, mut core, s) = rig(
        1 << 30,
        "max_split_size_mb:24,per_process_memory_fraction:0.09765625",
    );
    let cached = core.malloc(60 * MIB, s).unwrap();
    core.free(cached.ptr).unwrap();
    // 60 + 70 > 100: the miss releases the cached oversize segment first.
    let request = miss(&mut core, 70 * MIB, s);
    let (mut first, free) = off_core_io(&mut core, request, "free [60] MiB");
    assert_eq!(core.reserved_bytes(), 0, "out of the books");
    assert_eq!(core.releasing_bytes(), 60 * MIB);
    // Meanwhile another request of 50 MiB: the device still holds the 60 MiB (60 + 50 > 100),
    // so the chain has no room for its segment and it runs out of memory, saying why.
    let second = miss(&mut core, 50 * MIB, s);
    let step = core.advance_miss(&mut Miss::off_core(second), None);
    assert_eq!(kind(&step), "failed oom");
    let MissStep::Failed(AllocError::OutOfMemory(report)) = step else {
        unreachable!()
    };
    assert_eq!(report.releasing, 60 * MIB);
    assert!(
        report
            .to_string()
            .contains("60.00 MiB is being returned to the device"),
        "{report}"
    );
    // The free returns: the first request gets its segment, and the device never held more
    // than the cap.
    let (steps, end) = perform_to_the_end(&mut core, &mut first, free);
    assert_eq!(steps, ["alloc 70 MiB", "done 70 MiB"]);
    assert!(matches!(end, MissStep::Done(_)));
    assert_eq!((core.releasing_bytes(), backend.used(DEV)), (0, 70 * MIB));
    core.check_invariants().unwrap();
}

/// A named pool's quota counts its segments being freed off the core the same way.
#[test]
fn off_the_core_a_pools_segment_being_freed_counts_against_its_quota_until_its_free_returns() {
    use gpualloc_devices::PoolOptions;
    let (backend, mut core, s) = rig(1 << 30, "expandable_segments:False");
    let kv = core.create_named_pool(
        "kv",
        PoolOptions {
            quota: Some(100 * MIB),
            ..PoolOptions::default()
        },
    );
    let cached = core.malloc_in(kv, 60 * MIB, s).unwrap();
    core.free(cached.ptr).unwrap();
    // 60 + 70 > 100: at its quota, the pool releases its own cached segment first.
    let request = miss_in(&mut core, kv, 70 * MIB, s);
    let (mut first, free) = off_core_io(&mut core, request, "free [60] MiB");
    // Meanwhile 50 MiB more in the pool: the device still holds its 60 MiB.
    let second = miss_in(&mut core, kv, 50 * MIB, s);
    let step = core.advance_miss(&mut Miss::off_core(second), None);
    let MissStep::Failed(quota @ AllocError::PoolQuota { in_flight, .. }) = step else {
        panic!("expected the quota error, got {}", kind(&step))
    };
    assert_eq!(in_flight, 60 * MIB);
    assert_eq!(
        quota.to_string(),
        "memory pool \"kv\" is at its quota: tried to allocate 50.00 MiB with 0 bytes of \
         100.00 MiB reserved and 60.00 MiB on its way to or from the device"
    );
    let (steps, end) = perform_to_the_end(&mut core, &mut first, free);
    assert_eq!(steps, ["alloc 70 MiB", "done 70 MiB"]);
    assert!(matches!(end, MissStep::Done(_)));
    assert_eq!(backend.used(DEV), 70 * MIB);
    // Nothing in flight is left counted: 30 MiB more fit the quota.
    let third = miss_in(&mut core, kv, 30 * MIB, s);
    let (_, io) = off_core_io(&mut core, third, "alloc 30 MiB");
    // And with the 30 MiB in flight, the pool is full.
    let fourth = miss_in(&mut core, kv, 1, s);
    let end = core.advance_miss(&mut Miss::off_core(fourth), None);
    assert!(
        matches!(end, MissStep::Failed(AllocError::PoolQuota { .. })),
        "{}",
        kind(&end)
    );
    drop(io.fail(oom()));
    core.check_invariants().unwrap();
}

/// The same for pages of an expandable segment: being unmapped off the core, they are the
/// device's until the unmap returns.
#[test]
fn off_the_core_pages_being_unmapped_count_against_the_cap_until_the_unmap_returns() {
    // 100 MiB allowed of 1 GiB.
    let (backend, mut core, s) = rig(
        1 << 30,
        "policy:pytorch,expandable_segments:True,per_process_memory_fraction:0.09765625",
    );
    let t = backend.stream_create(DEV).unwrap();
    let u = backend.stream_create(DEV).unwrap();
    let cached = core.malloc(60 * MIB, s).unwrap();
    core.free(cached.ptr).unwrap();
    assert_eq!(core.reserved_bytes(), 60 * MIB);
    // A request of another stream: its own segment has no room beside the 60 MiB mapped, so
    // the last release unmaps them.
    let request = miss(&mut core, 70 * MIB, t);
    let (mut first, unmap) = off_core_io(&mut core, request, "unmap 60 MiB");
    assert_eq!(
        (core.reserved_bytes(), core.releasing_bytes()),
        (0, 60 * MIB)
    );
    // Meanwhile a third stream's 50 MiB: no room while the pages are the device's.
    let second = miss(&mut core, 50 * MIB, u);
    let step = core.advance_miss(&mut Miss::off_core(second), None);
    assert_eq!(kind(&step), "failed oom");
    // The unmap returns: the first request maps its pages.
    let (steps, end) = perform_to_the_end(&mut core, &mut first, unmap);
    // (Pages of 20 MiB in the large pool, as PyTorch's.)
    assert_eq!(steps, ["map 80 MiB", "done 70 MiB"]);
    assert!(matches!(end, MissStep::Done(_)));
    assert_eq!(core.releasing_bytes(), 0);
    assert_eq!(
        (core.reserved_bytes(), backend.used(DEV)),
        (80 * MIB, 80 * MIB)
    );
    core.check_invariants().unwrap();
}

#[test]
fn a_segment_that_reaches_the_memory_fraction_exactly_fits() {
    // 64 MiB allowed of 1 GiB: one 64 MiB segment is all of it.
    let (backend, mut core, s) = rig(1 << 30, "per_process_memory_fraction:0.0625");
    let request = miss(&mut core, 64 * MIB, s);
    let (steps, _) = run(&mut core, backend.as_ref(), request, 0);
    assert_eq!(steps, ["alloc 64 MiB", "done 64 MiB"]);
    let request = miss(&mut core, 2 * MIB, s);
    let (steps, end) = run(&mut core, backend.as_ref(), request, 0);
    assert!(
        matches!(end, MissStep::Failed(ref e) if e.is_oom()),
        "{steps:?}"
    );
}

/// Takes every free mapped block of `stream` in the cache (as other requests would).
fn steal_free_blocks(core: &mut DeviceCore, stream: StreamHandle) -> Vec<u64> {
    let free: Vec<u64> = core
        .snapshot()
        .segments
        .iter()
        .flat_map(|s| s.blocks.iter())
        .filter(|b| b.mapped && b.state == gpualloc_devices::BlockStateName::Inactive)
        .map(|b| b.size)
        .collect();
    free.into_iter()
        .map(|size| core.malloc(size, stream).unwrap().ptr.0)
        .collect()
}

#[test]
fn off_the_core_a_miss_grows_again_three_times_then_goes_on_down_the_chain() {
    let (backend, mut core, s) = rig(1 << 30, "expandable_segments:True");
    let _b = core.malloc(4 * MIB, s).unwrap();
    let a = core.malloc(20 * MIB, s).unwrap();
    core.free(a.ptr).unwrap();
    let request = miss(&mut core, 30 * MIB, s);
    let mut m = Miss::off_core(request);
    // Before each map lands, other requests take the free block it was to extend.
    let mut maps = Vec::new();
    let (_, end) = drive(&mut core, &mut m, None, |core, io| match io {
        MissIo::MapPages(_) => {
            maps.push(core.stats().num_alloc_retries);
            let mapped = io.perform(backend.as_ref());
            if maps.len() <= 4 {
                steal_free_blocks(core, s);
            }
            mapped
        }
        io => io.perform(backend.as_ref()),
    });
    assert!(matches!(end, MissStep::Done(_)), "{}", kind(&end));
    assert_eq!(
        maps,
        [0, 0, 0, 0, 1],
        "a growth and three more, then the chain's retry (which is left alone)"
    );
    core.check_invariants().unwrap();
}

#[test]
fn off_the_core_new_pages_compete_with_blocks_freed_meanwhile() {
    for off_core in [true, false] {
        let (backend, mut core, s) = rig(1 << 30, "expandable_segments:True");
        let c = core.malloc(30 * MIB, s).unwrap();
        let _d = core.malloc(4 * MIB, s).unwrap();
        let request = miss(&mut core, 30 * MIB, s);
        let mut m = if off_core {
            Miss::off_core(request)
        } else {
            Miss::new(request)
        };
        let MissStep::Io(io) = core.advance_miss(&mut m, None) else {
            panic!("expected a map")
        };
        let mapped = io.perform(backend.as_ref());
        core.free(c.ptr).unwrap();
        let MissStep::Done(got) = core.advance_miss(&mut m, Some(mapped)) else {
            panic!("expected the request served")
        };
        // Off the core the request looks in the cache again: `c`, freed meanwhile, is the
        // best fit (the new pages can still grow). In place it takes the pages it grew.
        assert_eq!(got.ptr == c.ptr, off_core);
        core.check_invariants().unwrap();
    }
}

#[test]
fn off_the_core_a_segment_that_lands_after_a_shutdown_goes_back() {
    let (backend, mut core, s) = rig(1 << 30, "expandable_segments:False");
    let request = miss(&mut core, 40 * MIB, s);
    let mut m = Miss::off_core(request);
    let MissStep::Io(io) = core.advance_miss(&mut m, None) else {
        panic!("expected a segment malloc")
    };
    let segment = io.perform(backend.as_ref());
    assert_eq!(backend.used(DEV), 40 * MIB);
    core.shutdown().unwrap();
    give_back_after_shutdown(
        &mut core,
        backend.as_ref(),
        &mut m,
        segment,
        "free [40] MiB",
    );
    assert_eq!(backend.used(DEV), 0);
}

#[test]
fn a_driver_error_other_than_out_of_memory_fails_the_miss_with_it() {
    let (backend, mut core, s) = rig(1 << 30, "expandable_segments:False");
    let request = miss(&mut core, 40 * MIB, s);
    let failure = BackendError::Unavailable("the driver went away".into());
    let (steps, end) = drive(&mut core, &mut Miss::new(request), None, |_, io| {
        io.fail(failure.clone())
    });
    assert_eq!(steps, ["alloc 40 MiB", "failed other"]);
    assert!(matches!(end, MissStep::Failed(AllocError::Backend(ref e)) if *e == failure));
    assert_eq!((core.growing_bytes(), backend.used(DEV)), (0, 0));
}

/// A named pool's miss off the core waits for the last release's events; meanwhile its pool
/// is released (a cancelled request: its user dropped the pool) and forgotten by a release
/// (no segment left in it). The miss must not bring a segment into a pool no release looks
/// at again: it fails as a request of an unknown pool. Before the check, it allocated 12 MiB
/// there, which stayed reserved until shutdown.
#[test]
fn off_the_core_a_miss_of_a_pool_forgotten_meanwhile_brings_no_memory_into_it() {
    let (backend, mut core, s) = rig(1 << 30, "expandable_segments:False");
    let other = backend.stream_create(DEV).unwrap();
    let a = core.malloc(16 * MIB, s).unwrap();
    core.record_stream(a.ptr, other).unwrap();
    core.free(a.ptr).unwrap();
    let pool = core.create_named_pool("p", Default::default());
    let request = match core.try_cached_in(pool, 12 * MIB, s).unwrap() {
        CachedOutcome::Miss(r) => r,
        CachedOutcome::Hit(_) => panic!("expected a miss"),
    };
    let mut m = Miss::off_core(request);
    let mut refused = false;
    let (steps, end) = drive(&mut core, &mut m, None, |core, io| match io {
        MissIo::AllocSegment { .. } if !refused => {
            refused = true;
            io.fail(oom())
        }
        MissIo::SynchronizeEvents(_) => {
            let synced = io.perform(backend.as_ref());
            core.release_pool(pool).unwrap();
            core.empty_cache().unwrap();
            assert!(core.pool_usage(pool).is_none(), "the pool is forgotten");
            synced
        }
        io => io.perform(backend.as_ref()),
    });
    assert_eq!(steps, ["alloc 12 MiB", "sync 1 events", "failed other"]);
    assert!(
        matches!(end, MissStep::Failed(AllocError::UnknownPool(id)) if id == pool.0),
        "{:?}",
        kind(&end)
    );
    assert_eq!(core.reserved_bytes(), 0);
    assert_eq!(backend.used(DEV), 0);
    core.check_invariants().unwrap();
}

/// The replay's third driver answers a growth with the pages the history shows mapped, which
/// may not be the ones the replay's chain planned ("these pages, not the planned ones"): with
/// the core's public steps alone, the driver aborts the chain's plan, plans the recorded range
/// (`plan_recorded_growth`), makes that map and advances the miss with it; the miss commits
/// the recorded pages and serves the request from them, the books as if the chain had planned
/// them.
#[test]
fn off_the_core_a_map_answered_with_other_pages_serves_the_request_from_them() {
    let (backend, mut core, s) = rig(1 << 30, "expandable_segments:True");
    let _a = core.malloc(4 * MIB, s).unwrap();
    let before = core.reserved_bytes();
    let [first] = core.segment_ranges()[..] else {
        panic!("one mapped stretch")
    };
    assert_eq!(first.size, before, "everything reserved is that stretch");
    let request = miss(&mut core, 10 * MIB, s);
    let mut m = Miss::off_core(request);
    let MissStep::Io(MissIo::MapPages(plan)) = core.advance_miss(&mut m, None) else {
        panic!("expected a map")
    };
    // The first growth mapped the 4 MiB request's two 2 MiB pages; the chain plans the
    // 10 MiB the miss needs after them.
    let planned = plan.bytes();
    assert_eq!((before, planned), (4 * MIB, 10 * MIB));
    // The history shows two pages more mapped, from where the plan starts (the mapped end).
    assert_eq!(
        core.abort_growth(plan),
        None,
        "the reservation stays: pages are mapped"
    );
    assert_eq!(core.reserved_bytes(), before, "the plan left no trace");
    core.check_invariants().unwrap();
    let (addr, len) = (first.addr + first.size, planned + 4 * MIB);
    let recorded = core
        .plan_recorded_growth(addr, len, RecordedHandles::default())
        .unwrap()
        .expect("the recorded range is unmapped and fits");
    assert_eq!(recorded.bytes(), 14 * MIB);
    let maps = backend.counts().maps;
    let done = MissIo::MapPages(recorded).perform(backend.as_ref());
    let MissStep::Done(got) = core.advance_miss(&mut m, Some(done)) else {
        panic!("expected the request served from the recorded pages")
    };
    assert!(
        backend.counts().maps > maps,
        "the recorded range was mapped"
    );
    assert!(got.ptr.0 >= first.addr && got.ptr.0 + got.block_size <= addr + len);
    assert_eq!(core.reserved_bytes(), 18 * MIB);
    let [stretch] = core.segment_ranges()[..] else {
        panic!("the new pages joined the mapped stretch")
    };
    assert_eq!((stretch.addr, stretch.size), (first.addr, 18 * MIB));
    core.check_invariants().unwrap();
}
