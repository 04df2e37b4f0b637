//! Streams that go away (`orphans.rs`): a retired stream's wholly free ordinary segments serve
//! other streams once its work is done, by PyTorch's size rules, with no synchronization; its
//! expandable segment's free pages go back to the device.

use std::sync::Arc;

use gpualloc_accounting::AccountingBackend;
use gpualloc_devices::orphans::ORPHAN_STREAM;
use gpualloc_devices::{AllocatorConfig, DeviceCore};
use gpualloc_runtime::{Backend, DeviceId, StreamHandle};
use gpualloc_sim::{Op, SimBackend, SimConfig};

mod common;
use common::hold;

const MIB: u64 = 1 << 20;

/// (segment size in MiB, raw stream), sorted.
fn segment_streams(core: &DeviceCore) -> Vec<(u64, u64)> {
    let mut v: Vec<(u64, u64)> = core
        .snapshot()
        .segments
        .iter()
        .map(|s| (s.total_size / MIB, s.stream))
        .collect();
    v.sort();
    v
}

fn sim_core(conf: &str) -> (Arc<SimBackend>, DeviceCore, StreamHandle, StreamHandle) {
    let sim = SimBackend::new(SimConfig::fast(1)).unwrap();
    let backend: Arc<dyn Backend> = sim.clone();
    let old = backend.stream_create(DeviceId(0)).unwrap();
    let new = backend.stream_create(DeviceId(0)).unwrap();
    let core =
        DeviceCore::new(backend, DeviceId(0), AllocatorConfig::parse(conf).unwrap()).unwrap();
    (sim, core, old, new)
}

#[test]
fn an_idle_retired_streams_free_segments_serve_other_streams_without_synchronizing() {
    let (sim, mut core, old, new) = sim_core("");
    let a = core.malloc(64 * MIB, old).unwrap();
    let kept = core.malloc(12 * MIB, old).unwrap();
    let mine = core.malloc(14 * MIB, new).unwrap();
    core.free(a.ptr).unwrap();
    core.free(mine.ptr).unwrap();
    core.retire_stream(old).unwrap();
    // The free 64 MiB segment is an orphan; the one with a live block is still `old`'s, and
    // the other stream's free segment stays its own.
    let expect = [(12, old.raw), (14, new.raw), (64, ORPHAN_STREAM)];
    assert_eq!(segment_streams(&core), expect);
    // Retiring the orphans' pseudo-stream does nothing.
    let orphan = StreamHandle {
        device: DeviceId(0),
        raw: ORPHAN_STREAM,
    };
    core.retire_stream(orphan).unwrap();
    assert_eq!(segment_streams(&core), expect);
    let before = sim.counts();
    let b = core.malloc(64 * MIB, new).unwrap();
    assert_eq!(b.ptr, a.ptr, "adopted by the other stream");
    assert_eq!(core.reserved_bytes(), 90 * MIB, "no new segment");
    let after = sim.counts();
    for op in [
        Op::Malloc,
        Op::Free,
        Op::DeviceSynchronize,
        Op::StreamSynchronize,
    ] {
        assert_eq!(after.get(op), before.get(op), "{op}");
    }
    let expect = [(12, old.raw), (14, new.raw), (64, new.raw)];
    assert_eq!(segment_streams(&core), expect);
    // The other segment is orphaned by a later pass, once its block is free.
    core.free(kept.ptr).unwrap();
    core.orphan_retired().unwrap();
    let expect = [(12, ORPHAN_STREAM), (14, new.raw), (64, new.raw)];
    assert_eq!(segment_streams(&core), expect);
    let c = core.malloc(12 * MIB, new).unwrap();
    assert_eq!(c.ptr, mine.ptr, "its own free segment first");
    let d = core.malloc(12 * MIB, new).unwrap();
    assert_eq!(d.ptr, kept.ptr, "then the orphan");
    assert_eq!(core.reserved_bytes(), 90 * MIB);
    for p in [b.ptr, c.ptr, d.ptr] {
        core.free(p).unwrap();
    }
    core.check_invariants().unwrap();
    core.empty_cache().unwrap();
    assert_eq!(core.reserved_bytes(), 0);
}

/// An idle stream whose only segment is in use at retirement: a later pass orphans it.
#[test]
fn a_segment_in_use_at_retirement_is_orphaned_later() {
    let (_sim, mut core, old, new) = sim_core("");
    let kept = core.malloc(12 * MIB, old).unwrap();
    core.retire_stream(old).unwrap();
    core.orphan_retired().unwrap();
    assert_eq!(segment_streams(&core), [(12, old.raw)]);
    core.free(kept.ptr).unwrap();
    core.orphan_retired().unwrap();
    assert_eq!(segment_streams(&core), [(12, ORPHAN_STREAM)]);
    let b = core.malloc(12 * MIB, new).unwrap();
    assert_eq!(b.ptr, kept.ptr);
    core.free(b.ptr).unwrap();
    // After shutdown, retiring does nothing.
    core.shutdown().unwrap();
    core.retire_stream(new).unwrap();
}

/// PyTorch's size rules hold for orphans as for any cached block: under
/// `max_split_size_mb:64` a 12 MiB request does not take (nor adopt) a free 80 MiB segment.
#[test]
fn orphans_follow_the_size_rules() {
    let (_sim, mut core, old, new) = sim_core("max_split_size_mb:64");
    let a = core.malloc(80 * MIB, old).unwrap();
    core.free(a.ptr).unwrap();
    core.retire_stream(old).unwrap();
    let small = core.malloc(12 * MIB, new).unwrap();
    assert_ne!(small.ptr, a.ptr);
    assert_eq!(core.reserved_bytes(), 80 * MIB + 12 * MIB);
    assert_eq!(
        segment_streams(&core),
        [(12, new.raw), (80, ORPHAN_STREAM)],
        "the oversize orphan was not adopted"
    );
    let big = core.malloc(80 * MIB, new).unwrap();
    assert_eq!(big.ptr, a.ptr);
    core.free(small.ptr).unwrap();
    core.free(big.ptr).unwrap();
    core.check_invariants().unwrap();
}

/// A stream with work queued when it is retired: its segments wait for an event; one still
/// in use when the event completes waits for a later pass.
#[test]
fn a_busy_stream_is_orphaned_once_its_event_completes() {
    let backend = Arc::new(AccountingBackend::manual_events(1, 1 << 30));
    let dynb: Arc<dyn Backend> = backend.clone();
    let old = dynb.stream_create(DeviceId(0)).unwrap();
    let new = dynb.stream_create(DeviceId(0)).unwrap();
    // PyTorch's policy: the `gpualloc` policy would lend `new` the free 64 MiB at once.
    let config = AllocatorConfig::parse("policy:pytorch").unwrap();
    let mut core = DeviceCore::new(dynb, DeviceId(0), config).unwrap();
    let a = core.malloc(64 * MIB, old).unwrap();
    let kept = core.malloc(12 * MIB, old).unwrap();
    core.free(a.ptr).unwrap();
    core.retire_stream(old).unwrap();
    core.retire_stream(old).unwrap(); // twice: one entry
    let expect = [(12, old.raw), (64, old.raw)];
    assert_eq!(segment_streams(&core), expect, "its work is not done");
    let b = core.malloc(64 * MIB, new).unwrap();
    assert_ne!(b.ptr, a.ptr);
    backend.complete_stream(old);
    core.orphan_retired().unwrap();
    let expect = [(12, old.raw), (64, new.raw), (64, ORPHAN_STREAM)];
    assert_eq!(segment_streams(&core), expect);
    core.free(kept.ptr).unwrap();
    core.orphan_retired().unwrap();
    let expect = [(12, ORPHAN_STREAM), (64, new.raw), (64, ORPHAN_STREAM)];
    assert_eq!(segment_streams(&core), expect);
    core.free(b.ptr).unwrap();
    let c = core.malloc(64 * MIB, new).unwrap();
    assert_eq!(c.ptr, b.ptr, "its own block first");
    let d = core.malloc(64 * MIB, new).unwrap();
    assert_eq!(d.ptr, a.ptr, "then the orphan");
    assert_eq!(core.reserved_bytes(), 140 * MIB);
    core.free(c.ptr).unwrap();
    core.free(d.ptr).unwrap();
    core.check_invariants().unwrap();
}

/// Expandable segments: the retired stream's free pages are unmapped (a synchronize of that
/// stream only) and its reservation freed.
#[test]
fn a_retired_streams_expandable_pages_go_back_to_the_device() {
    let (sim, mut core, old, new) = sim_core("expandable_segments:True");
    let a = core.malloc(64 * MIB, old).unwrap();
    core.free(a.ptr).unwrap();
    // 2 MiB pages, at most 20 MiB to a physical handle: handles of 20, 20, 20 and 4 MiB.
    assert_eq!(core.reserved_bytes(), 64 * MIB);
    let before = sim.counts();
    core.retire_stream(old).unwrap();
    assert_eq!(core.reserved_bytes(), 0);
    assert!(core.snapshot().segments.is_empty());
    let after = sim.counts();
    assert_eq!(
        after.get(Op::DeviceSynchronize),
        before.get(Op::DeviceSynchronize)
    );
    assert_eq!(after.get(Op::Unmap) - before.get(Op::Unmap), 4);
    let b = core.malloc(64 * MIB, new).unwrap();
    assert_eq!(core.reserved_bytes(), 64 * MIB);
    core.free(b.ptr).unwrap();
    core.check_invariants().unwrap();
}

/// In a named pool a retired stream's free segment becomes an orphan of that pool: adopted by
/// the pool's next request on another stream, never by the default pools'. PyTorch's unnamed
/// private pools keep theirs.
#[test]
fn named_pools_orphan_a_retired_streams_segments_within_the_pool() {
    use gpualloc_devices::PoolOptions;
    let (_, mut core, old, new) = sim_core("");
    let named = core.create_named_pool("kv_cache", PoolOptions::default());
    let plain = core.create_pool(false);
    let a = core.malloc_in(named, 64 * MIB, old).unwrap();
    let b = core.malloc_in(plain, 30 * MIB, old).unwrap();
    core.free(a.ptr).unwrap();
    core.free(b.ptr).unwrap();
    core.retire_stream(old).unwrap();
    let expect = [(30, old.raw), (64, ORPHAN_STREAM)];
    assert_eq!(segment_streams(&core), expect);
    // The default pools do not get it; the pool's request on another stream does.
    let d = core.malloc(64 * MIB, new).unwrap();
    assert_ne!(d.ptr, a.ptr);
    let c = core.malloc_in(named, 64 * MIB, new).unwrap();
    assert_eq!(c.ptr, a.ptr);
    for p in [c.ptr, d.ptr] {
        core.free(p).unwrap();
    }
    core.check_invariants().unwrap();
}

/// Retiring records one event per busy stream however often it is asked, none for a stream
/// that names no segment; the event goes back to the core's spare events once the stream's
/// work is done, and a shutdown destroys the events of streams still retiring.
#[test]
fn a_retiring_stream_holds_one_event_and_gives_it_back() {
    let (sim, mut core, old, new) = sim_core("expandable_segments:False");
    let records = |sim: &SimBackend| sim.counts().get(Op::EventRecord);
    let creates = |sim: &SimBackend| sim.counts().get(Op::EventCreate);
    let before = records(&sim);
    core.retire_stream(new).unwrap();
    assert_eq!(records(&sim), before, "a stream with no segment");
    let a = core.malloc(4 * MIB, old).unwrap();
    core.free(a.ptr).unwrap();
    let busy = hold(&sim, old);
    core.retire_stream(old).unwrap();
    core.retire_stream(old).unwrap();
    assert_eq!(records(&sim), before + 1, "one entry, one event");
    drop(busy);
    sim.stream_synchronize(old).unwrap();
    core.orphan_retired().unwrap();
    assert_eq!(segment_streams(&core), [(20, ORPHAN_STREAM)]);
    // `new` adopts the orphan, then retires busy: the spare event is recorded again.
    let b = core.malloc(4 * MIB, new).unwrap();
    core.free(b.ptr).unwrap();
    let made = creates(&sim);
    let busy = hold(&sim, new);
    core.retire_stream(new).unwrap();
    assert_eq!((creates(&sim), records(&sim)), (made, before + 2));
    // Its work done but not yet seen: the shutdown finds it still retiring.
    drop(busy);
    sim.stream_synchronize(new).unwrap();
    core.shutdown().unwrap();
    let counts = sim.counts();
    assert_eq!(
        counts.get(Op::EventDestroy),
        counts.get(Op::EventCreate),
        "every event destroyed at shutdown"
    );
}

/// The core queries a retiring stream until its work is done (`orphan_retired`), so it names
/// the stream (`streams_in_use`) until then, even once the stream has no segment left. Its
/// pages can go in between: an owner that releases them off the core synchronizes the stream
/// first, and the stream may retire after that synchronize, before the release finishes. An
/// owner that let go of the stream there (the device actor did) destroyed a stream the next
/// pass then queried.
#[test]
fn a_retiring_stream_is_named_until_its_work_is_done_even_without_segments() {
    let backend = Arc::new(AccountingBackend::manual_events(1, 1 << 30));
    let dynb: Arc<dyn Backend> = backend.clone();
    let old = dynb.stream_create(DeviceId(0)).unwrap();
    let config = AllocatorConfig::parse("expandable_segments:True").unwrap();
    let mut core = DeviceCore::new(dynb.clone(), DeviceId(0), config).unwrap();
    let a = core.malloc(64 * MIB, old).unwrap();
    core.free(a.ptr).unwrap();
    // The owner's release: pages out of the books, the stream synchronized off the core.
    let releases = core.detach_free_pages().unwrap();
    assert!(!releases.is_empty());
    gpualloc_devices::release_pages(dynb.as_ref(), &releases).unwrap();
    // Meanwhile its users drop the stream, whose work (this backend: never idle until
    // completed) is not done: it retires with an event.
    core.retire_stream(old).unwrap();
    for r in releases {
        assert_eq!(core.finish_page_release(r).unwrap(), None);
    }
    assert!(core.snapshot().segments.is_empty(), "its segment is gone");
    assert!(
        core.streams_in_use().contains(&old),
        "still retiring: the next pass queries it"
    );
    core.orphan_retired().unwrap();
    assert!(core.streams_in_use().contains(&old), "its work is not done");
    backend.complete_stream(old);
    core.orphan_retired().unwrap();
    assert!(
        !core.streams_in_use().contains(&old),
        "retired: nothing names it any more"
    );
    core.check_invariants().unwrap();
}
