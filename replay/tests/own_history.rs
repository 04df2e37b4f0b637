//! The allocator's own history replays to itself: a workload run through the public
//! API on the sim while recording (cross-stream frees, frees that wait, an out-of-memory
//! request, `empty_cache`), dumped with `snapshot_pickle`, read back and replayed warm with the
//! same config, puts every allocation at the address the live allocator gave it, with
//! ordinary segments and with expandable ones.

use gpualloc::{Allocator, DeviceId, HistoryOptions};
use gpualloc_replay::input::from_bytes;
use gpualloc_replay::{replay, ReplayOptions};

const MIB: u64 = 1 << 20;

async fn recorded(conf: &str) -> Vec<u8> {
    let sim = gpualloc::runtime::sim::SimBackend::new(gpualloc::runtime::sim::SimConfig {
        capacity_per_device: 1 << 30,
        ..gpualloc::runtime::sim::SimConfig::fast(1)
    })
    .unwrap();
    let alloc = Allocator::builder()
        .config_str(conf)
        .backend_instance(sim)
        // No reaper pass during the run: cross-stream frees complete when the workload's own
        // mallocs and frees process events, in its order (a pass landing while a miss maps
        // pages off the gate is the race described below).
        .reaper_interval(std::time::Duration::from_secs(3600))
        .build()
        .unwrap();
    alloc
        .record_history(HistoryOptions::default())
        .await
        .unwrap();
    let s1 = alloc.new_stream(DeviceId(0)).unwrap();
    let s2 = alloc.new_stream(DeviceId(0)).unwrap();
    let mut live = Vec::new();
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    for i in 0..400u64 {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        let size = match rng % 4 {
            0 => rng % 4096 + 1,
            1 => rng % MIB + 1,
            2 => rng % (12 * MIB) + 1,
            _ => rng % (40 * MIB) + 1,
        };
        let s = if i % 3 == 0 { &s2 } else { &s1 };
        // The streams' events complete before the malloc, so the malloc's own first step
        // records the frees they release: an event that completed while a miss maps pages off
        // the gate would be recorded before that miss's `alloc`, and a sequential replay
        // takes the freed block instead of growing (see the README).
        s1.synchronize().unwrap();
        s2.synchronize().unwrap();
        if let Ok(b) = alloc.malloc(size, s).await {
            if i % 7 == 0 {
                b.record_stream(if i % 2 == 0 { &s1 } else { &s2 }).unwrap();
            }
            live.push(b);
        }
        if live.len() > 12 || rng % 5 == 0 {
            let k = (rng as usize / 5) % live.len().max(1);
            if k < live.len() {
                live.swap_remove(k);
            }
        }
        if i == 200 {
            s1.synchronize().unwrap();
            s2.synchronize().unwrap();
            alloc.empty_cache().await.unwrap();
        }
    }
    assert!(alloc.malloc(4 << 30, &s1).await.is_err());
    let bytes = alloc.snapshot_pickle().await.unwrap();
    drop(live);
    alloc.shutdown().await.unwrap();
    bytes
}

/// A spilled block (a small request in the large pool, `gpualloc_devices::spill`) dropped on its
/// own stream parks in the thread cache, and the next request of its size revives it there:
/// the revive's `alloc`, written by the thread cache, is marked spilled too, so the replay
/// serves it from the large pool as the live allocator did (before, the replay looked in the
/// small pool, full there, and grew it).
#[test]
fn a_spilled_block_revived_by_the_thread_cache_replays_at_its_address() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let bytes = rt.block_on(async {
        let sim = gpualloc::runtime::sim::SimBackend::new(gpualloc::runtime::sim::SimConfig {
            capacity_per_device: 1 << 30,
            ..gpualloc::runtime::sim::SimConfig::fast(1)
        })
        .unwrap();
        let alloc = Allocator::builder()
            .config_str("")
            .backend_instance(sim)
            .build()
            .unwrap();
        let s = alloc.new_stream(DeviceId(0)).unwrap();
        let other = alloc.new_stream(DeviceId(0)).unwrap();
        // Frees the core sees (a buffer used on another stream is not parked): a free 12 MiB
        // block of the large pool, and 1 MiB learned short-lived.
        for size in [12 * MIB, MIB] {
            let b = alloc.malloc(size, &s).await.unwrap();
            b.record_stream(&other).unwrap();
            drop(b);
            other.synchronize().unwrap();
        }
        // The small pool's one page full: a third 1 MiB spills.
        let full = [
            alloc.malloc(MIB, &s).await.unwrap(),
            alloc.malloc(MIB, &s).await.unwrap(),
        ];
        alloc
            .record_history(HistoryOptions::default())
            .await
            .unwrap();
        let spilled = alloc.malloc(MIB, &s).await.unwrap();
        let at = spilled.ptr();
        drop(spilled);
        let revived = alloc.malloc(MIB, &s).await.unwrap();
        assert_eq!(revived.ptr(), at, "the thread cache revives it");
        let bytes = alloc.snapshot_pickle().await.unwrap();
        drop((full, revived));
        alloc.shutdown().await.unwrap();
        bytes
    });
    let trace = from_bytes("own.pickle", &bytes).unwrap().remove(0);
    let spilled: Vec<bool> = trace
        .events
        .iter()
        .filter(|e| e.action == gpualloc_trace::Action::Alloc)
        .map(|e| e.spilled)
        .collect();
    assert_eq!(spilled, [true, true], "both allocs marked");
    let options = ReplayOptions {
        warm: true,
        config: trace.recorded_config.clone().unwrap(),
        capacity: Some(1 << 30),
        ..ReplayOptions::default()
    };
    let report = replay(&trace, &options).unwrap();
    assert_eq!(report.address_match, Some((2, 2)));
}

#[test]
fn a_recorded_history_replays_warm_at_the_same_addresses() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    // The replay places a new ordinary segment at its recorded `segment_alloc` address, and a
    // new expandable segment's reservation at its first `segment_map` (which maps from the
    // reservation's base); the device's capacity is the live one's, as an expandable
    // segment reserves 9/8 of it.
    for conf in [
        "",
        "thread_cache:False",
        "garbage_collection_threshold:0.6",
        "max_split_size_mb:40",
        "expandable_segments:True",
        "expandable_segments:True,thread_cache:False",
        "expandable_segments:True,max_split_size_mb:40",
    ] {
        let bytes = rt.block_on(recorded(conf));
        let traces = from_bytes("own.pickle", &bytes).unwrap();
        assert_eq!(traces.len(), 1);
        // The snapshot records the config the allocator ran: the replay's, under its policy.
        let config = traces[0].recorded_config.clone().unwrap();
        assert_eq!(
            config.policy,
            gpualloc_devices::Policy::Gpualloc,
            "[{conf}]"
        );
        assert_eq!(
            config,
            gpualloc::AllocatorConfig::parse(conf)
                .unwrap()
                .resolved(true),
            "[{conf}]"
        );
        let options = ReplayOptions {
            warm: true,
            config,
            capacity: Some(1 << 30),
            ..ReplayOptions::default()
        };
        let report = replay(&traces[0], &options).unwrap();
        let (matched, compared) = report.address_match.unwrap();
        println!("[{conf}] {matched} of {compared} allocations at the live allocator's address");
        assert!(compared > 300, "[{conf}] {compared}");
        assert_eq!(
            matched, compared,
            "[{conf}] first mismatch: {:?}",
            report.first_mismatch
        );
        // `gpualloc summary` replays it under the recorded config too: the same peaks.
        let (_, core) = gpualloc_replay::summary::summary_core(&traces[0]).unwrap();
        let st = core.stats();
        assert_eq!(
            (st.reserved_bytes[0].peak, st.allocated_bytes[0].peak),
            (report.peak_reserved, report.peak_allocated),
            "[{conf}] summary"
        );
    }
}

mod off_the_core {
    //! The actor's order of a miss served off the core, made step by step on a core: the
    //! request misses, a block is freed while its segment (or pages) is obtained, then the
    //! segment lands and the request takes it (ordinary segments: adopted whatever is free by
    //! then) or the best fit among the new pages and the freed block (expandable). A
    //! sequential malloc at the `alloc` would take the freed block; the replay follows the
    //! live order.

    use std::sync::Arc;

    use gpualloc::runtime::accounting::AccountingBackend;
    use gpualloc::runtime::{Backend, DeviceId, StreamHandle};
    use gpualloc::AllocatorConfig;
    use gpualloc_devices::{
        map_growth, CachedOutcome, DeviceCore, Growth, Miss, MissIo, MissStep, SegmentRequest,
    };
    use gpualloc_replay::input::{from_bytes, Trace};
    use gpualloc_replay::run::replay_core;
    use gpualloc_replay::{replay, ReplayOptions, ReplayReport};

    use super::MIB;

    const CAPACITY: u64 = 1 << 30;

    /// A core, not recording yet.
    fn rig(conf: &str) -> (Arc<AccountingBackend>, DeviceCore, StreamHandle) {
        let config = AllocatorConfig::parse(conf).unwrap();
        let backend = Arc::new(AccountingBackend::new(1, CAPACITY));
        let dynb: Arc<dyn Backend> = backend.clone();
        let s = dynb.stream_create(DeviceId(0)).unwrap();
        let core = DeviceCore::new(dynb, DeviceId(0), config.resolved(true)).unwrap();
        (backend, core, s)
    }

    /// The core's history, dumped and replayed warm: (matched, compared) addresses.
    fn replayed(core: &DeviceCore, conf: &str) -> (u64, u64) {
        let config = AllocatorConfig::parse(conf).unwrap();
        replay_warm(core, config).address_match.unwrap()
    }

    /// The core's history, dumped and replayed warm under `config`.
    fn replay_warm(core: &DeviceCore, config: AllocatorConfig) -> ReplayReport {
        let trace = dumped(core, &config);
        replay(&trace, &warm(config)).unwrap()
    }

    /// The core's snapshot under `config`, written as a pickle and read back.
    fn dumped(core: &DeviceCore, config: &AllocatorConfig) -> Trace {
        let bytes = gpualloc_replay::export::to_pickle(&[core.snapshot()], config).unwrap();
        from_bytes("own.pickle", &bytes).unwrap().remove(0)
    }

    /// A request of `size` bytes that misses the cache: the owner's part of it is to come.
    fn miss(core: &mut DeviceCore, size: u64, s: StreamHandle) -> SegmentRequest {
        let CachedOutcome::Miss(request) = core.try_cached(size, s).unwrap() else {
            panic!("expected a miss of {size} bytes");
        };
        request
    }

    /// A request of `size` bytes on `s` that misses, asks for a new ordinary segment off the
    /// core, and has `freed` freed while the segment is obtained: the new segment's block,
    /// the live request's.
    fn new_segment_while_freeing(
        backend: &AccountingBackend,
        core: &mut DeviceCore,
        size: u64,
        s: StreamHandle,
        freed: gpualloc::runtime::DevicePtr,
    ) -> gpualloc_devices::Allocation {
        let mut m = Miss::off_core(miss(core, size, s));
        let MissStep::Io(io @ MissIo::AllocSegment { .. }) = core.advance_miss(&mut m, None) else {
            panic!("expected a segment malloc");
        };
        core.free(freed).unwrap();
        let done = io.perform(backend);
        let MissStep::Done(b) = core.advance_miss(&mut m, Some(done)) else {
            panic!("expected the new segment's block");
        };
        b
    }

    /// A warm replay under `config` on a device of the rig's capacity.
    fn warm(config: AllocatorConfig) -> ReplayOptions {
        ReplayOptions {
            warm: true,
            config,
            capacity: Some(CAPACITY),
            ..ReplayOptions::default()
        }
    }

    /// A growth's physical handles as the history records them (`gpualloc_grouped_pages`,
    /// `gpualloc_single_pages`): the replay maps the same handles, so it makes the same driver
    /// maps as the live allocator. 2 MiB past 90 MiB maps 10 MiB as [1][1][1][2] pages (the
    /// request's page, two single pages, the rest of the pages ahead shared); every page a
    /// handle of its own (histories before the pages ahead shared handles) would be one more.
    #[test]
    fn a_growths_handles_replay_as_recorded() {
        let conf = "expandable_segments:True";
        let (backend, mut core, s) = rig(conf);
        core.record_history(Some(1000));
        let a = core.malloc(90 * MIB, s).unwrap();
        let b = core.malloc(2 * MIB, s).unwrap();
        assert_eq!(
            (core.reserved_bytes(), backend.counts().maps),
            (100 * MIB, 9)
        );
        let c = core.malloc(5 * MIB, s).unwrap();
        let d = core.malloc(3 * MIB / 2, s).unwrap();
        assert_eq!(d.ptr.0 - a.ptr.0, 97 * MIB);
        core.free(c.ptr).unwrap();
        core.empty_cache().unwrap();
        // The two single pages [92, 96) went back; d keeps the shared handle [96, 100).
        assert_eq!(core.reserved_bytes(), 96 * MIB);
        let e = core.malloc(2 * MIB, s).unwrap();
        let live = backend.counts();
        let report = replay_warm(&core, AllocatorConfig::parse(conf).unwrap());
        assert_eq!(report.address_match, Some((5, 5)));
        assert_eq!(
            (report.page_maps, report.page_unmaps),
            (live.maps, live.unmaps)
        );
        for p in [a.ptr, b.ptr, d.ptr, e.ptr] {
            core.free(p).unwrap();
        }
    }

    #[test]
    fn a_segment_obtained_off_the_core_serves_its_request_in_the_replay() {
        let conf = "expandable_segments:False";
        let (backend, mut core, s) = rig(conf);
        core.record_history(Some(1000));
        // An 8 MiB block and the 12 MiB left of its 20 MiB segment.
        let a = core.malloc(8 * MIB, s).unwrap();
        let rest = core.malloc(12 * MIB, s).unwrap();
        // The miss off the core: its segment malloc is asked for, then `a` is freed.
        let b = new_segment_while_freeing(&backend, &mut core, 6 * MIB, s, a.ptr);
        assert_ne!(b.ptr, a.ptr, "live, the new segment serves the request");
        assert_eq!(core.reserved_bytes(), 40 * MIB);
        let later = core.malloc(8 * MIB, s).unwrap();
        assert_eq!(later.ptr, a.ptr);
        assert_eq!(replayed(&core, conf), (4, 4));
        for p in [rest.ptr, b.ptr, later.ptr] {
            core.free(p).unwrap();
        }
    }

    #[test]
    fn pages_mapped_off_the_core_compete_with_blocks_freed_meanwhile_in_the_replay() {
        // PyTorch's 20 MiB pages: pages 0-4 taken, page 1 unmapped again (a hole).
        let conf = "expandable_segments:True,policy:pytorch";
        let (backend, mut core, s) = rig(conf);
        core.record_history(Some(1000));
        let blocks: Vec<_> = [20, 20, 20, 40]
            .iter()
            .map(|m| core.malloc(m * MIB, s).unwrap())
            .collect();
        core.free(blocks[1].ptr).unwrap();
        core.empty_cache().unwrap();
        // A 10 MiB request misses and maps the hole; the last 40 MiB (the segment's tail, which
        // best fit counts as large as it can grow) is freed meanwhile.
        let request = miss(&mut core, 10 * MIB, s);
        let Growth::Map(plan) = core.plan_growth(&request).unwrap() else {
            panic!("expected a growth");
        };
        core.free(blocks[3].ptr).unwrap();
        let mapped = map_growth(backend.as_ref(), &plan).unwrap();
        core.commit_growth(plan, mapped).map_err(|_| ()).unwrap();
        let CachedOutcome::Hit(b) = core.try_cached(10 * MIB, s).unwrap() else {
            panic!("the new page serves it");
        };
        assert_eq!(b.ptr, blocks[1].ptr, "live, the request takes the hole");
        let later = core.malloc(30 * MIB, s).unwrap();
        assert_eq!(later.ptr, blocks[3].ptr);
        assert_eq!(replayed(&core, conf), (6, 6));
        for p in [blocks[0].ptr, blocks[2].ptr, b.ptr, later.ptr] {
            core.free(p).unwrap();
        }
    }

    /// Recording begins after the allocator has been running: the expandable segments it
    /// holds then (their mapped runs and live blocks) are restored as reservations, so the
    /// pages the history maps next to them grow the same segments, as they did live.
    #[test]
    fn expandable_segments_held_when_recording_began_grow_in_the_replay() {
        // PyTorch's pages, one physical handle each; and the gpualloc policy's, one handle per
        // growth, released only whole. Where the handles of pages mapped before recording
        // began start and end is not in the snapshot: the replay restores those pages one
        // handle each, and unmaps the pages each `segment_unmap` names (before, it ran
        // `empty_cache`, which released the replay's own handles: 299 of 300 addresses).
        for conf in [
            "expandable_segments:True,policy:pytorch",
            "expandable_segments:True",
        ] {
            let (_backend, mut core, s) = rig(conf);
            let mut rng = 0x2545_f491_4f6c_dd1du64;
            let mut live = Vec::new();
            let mut step = |core: &mut DeviceCore, live: &mut Vec<_>| {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                let size = match rng % 3 {
                    0 => rng % MIB + 1,
                    1 => rng % (6 * MIB) + 1,
                    _ => rng % (24 * MIB) + 1,
                };
                live.push(core.malloc(size, s).unwrap().ptr);
                if live.len() > 10 || rng % 3 == 0 {
                    let k = (rng as usize / 3) % live.len();
                    core.free(live.swap_remove(k)).unwrap();
                }
            };
            for _ in 0..60 {
                step(&mut core, &mut live);
            }
            core.record_history(Some(10_000));
            for i in 0..300 {
                step(&mut core, &mut live);
                if i == 150 {
                    core.empty_cache().unwrap();
                }
            }
            let (matched, compared) = replayed(&core, conf);
            assert!(compared >= 300, "[{conf}] {compared}");
            assert_eq!(matched, compared, "[{conf}]");
        }
    }

    /// A small request spilled into the large pool's free memory (the `gpualloc` policy's
    /// spill) by what the allocator learned before recording began: its size was freed
    /// short-lived then, which the snapshot does not carry. The history marks the spill, and
    /// the warm replay spills where the mark is, into the block the history names (before,
    /// the replay saw the size as unknown and grew the small pool instead: 0 of 2 addresses).
    #[test]
    fn a_spill_decided_by_what_was_learned_before_recording_replays() {
        let conf = "";
        let (_backend, mut core, s) = rig(conf);
        // The 1 MiB size is learned short-lived, and the large pool keeps a free 12 MiB block.
        let w = core.malloc(MIB, s).unwrap();
        core.free(w.ptr).unwrap();
        let act = core.malloc(12 * MIB, s).unwrap();
        core.free(act.ptr).unwrap();
        // The small pool's one page is full: a third 1 MiB block would pass its mark.
        let small: Vec<_> = (0..2).map(|_| core.malloc(MIB, s).unwrap()).collect();
        core.record_history(Some(1000));
        let spilled = core.malloc(MIB, s).unwrap();
        assert!(!spilled.small_pool, "live, the request spills");
        assert_eq!(spilled.ptr, act.ptr, "into the large pool's free block");
        let after = core.malloc(MIB, s).unwrap();
        let (matched, compared) = replayed(&core, conf);
        assert_eq!((matched, compared), (2, 2));
        for p in [spilled.ptr, after.ptr, small[0].ptr, small[1].ptr] {
            core.free(p).unwrap();
        }
    }

    /// A 4 MiB block parked in a thread cache (`a`) while the core serves another 4 MiB
    /// request (`c`), then freed in the core; `old`: the entries as the thread cache wrote
    /// them before (the park recorded the free's request and its completion). Returns the
    /// replay's (matched, compared) addresses.
    fn parked_while_another_request_is_served(old: bool) -> (u64, u64) {
        use gpualloc_devices::{TraceAction, TraceEntry};
        use std::sync::atomic::Ordering;
        let conf = "expandable_segments:False";
        let (_backend, mut core, s) = rig(conf);
        core.record_history(Some(1000));
        let a = core.malloc(4 * MIB, s).unwrap();
        let b = core.malloc(4 * MIB, s).unwrap();
        let seq = core.trace_sequence();
        let entry = |action| {
            let e = TraceEntry {
                action,
                addr: a.ptr.0,
                size: a.size,
                stream: s.raw,
                time_us: 0,
                frames: None,
                pool: 0,
                passed_over: false,
                borrowed: false,
                spilled: false,
                grouped_pages: None,
                single_pages: None,
            };
            (seq.fetch_add(1, Ordering::Relaxed), e)
        };
        // The park, on another thread, as the gate holder serves `c`.
        let mut parked = vec![entry(TraceAction::FreeRequested)];
        if old {
            parked.push(entry(TraceAction::FreeCompleted));
        }
        let c = core.malloc(4 * MIB, s).unwrap();
        assert_eq!(
            c.ptr.0,
            b.ptr.0 + 4 * MIB,
            "live, the parked block is not free for the core"
        );
        core.record_beside(&mut parked);
        // The next gate holder collects the slot: the core frees the block for real.
        core.free_parked(a.ptr, !old).unwrap();
        let got = replayed(&core, conf);
        for p in [b.ptr, c.ptr] {
            core.free(p).unwrap();
        }
        got
    }

    /// A block is free for the core's requests only once the thread cache hands it back:
    /// its `free_completed` is recorded then, not at the park. Recorded at the park, the
    /// replay gave the parked block to the request served meanwhile (the remaining `serve`
    /// mismatches: 99.99%).
    #[test]
    fn a_block_parked_while_another_request_is_served_is_not_free_in_the_replay() {
        assert_eq!(parked_while_another_request_is_served(true), (2, 3));
        assert_eq!(parked_while_another_request_is_served(false), (3, 3));
    }

    /// The actor's release off the core: whole free segments leave the books (their
    /// `segment_free`s are recorded) and are freed with the driver after the gate is let go;
    /// a free pending on another stream's event stays pending, its segment stays, and a
    /// request served in between sees it so. The replay releases the segment the history
    /// names, and completes the pending free at its `free_completed` only: before, a
    /// `segment_free` ran `empty_cache`, which waited for the pending free and released its
    /// segment as well, and the backend's free completed every event.
    #[test]
    fn a_release_that_kept_a_segment_with_a_pending_free_replays_as_it_happened() {
        use gpualloc_devices::free_detached;
        let conf = "expandable_segments:False";
        let config = AllocatorConfig::parse(conf).unwrap();
        let backend = Arc::new(AccountingBackend::manual_events(1, CAPACITY));
        let dynb: Arc<dyn Backend> = backend.clone();
        let s = dynb.stream_create(DeviceId(0)).unwrap();
        let other = dynb.stream_create(DeviceId(0)).unwrap();
        let mut core = DeviceCore::new(dynb, DeviceId(0), config.resolved(true)).unwrap();
        core.record_history(Some(1000));
        // Three 20 MiB segments: a's whole; e's with 8 MiB used (x's 12 MiB freed below);
        // b's with 11 MiB free after b.
        let a = core.malloc(20 * MIB, s).unwrap();
        let e = core.malloc(8 * MIB, s).unwrap();
        let x = core.malloc(12 * MIB, s).unwrap();
        assert_eq!(x.ptr.0, e.ptr.0 + 8 * MIB);
        let b = core.malloc(9 * MIB, s).unwrap();
        core.free(x.ptr).unwrap();
        core.record_stream(b.ptr, other).unwrap();
        core.free(a.ptr).unwrap();
        core.free(b.ptr).unwrap(); // waits for `other`
        let detached = core.detach_free_segments().unwrap();
        assert_eq!(detached.len(), 1, "a's segment only: b's free is pending");
        // Served before the driver frees a's segment: the best fit is the 11 MiB after b (with
        // b's free completed, it would be e's 12 MiB).
        let c = core.malloc(5 * MIB, s).unwrap();
        assert_eq!(c.ptr.0, b.ptr.0 + 9 * MIB);
        free_detached(backend.as_ref(), DeviceId(0), &detached).unwrap();
        core.finish_segment_frees(&detached);
        assert_eq!(core.process_events().unwrap(), 1, "b's free completes now");
        let later = core.malloc(9 * MIB, s).unwrap();
        assert_eq!(later.ptr, b.ptr);
        let report = replay_warm(&core, config);
        assert_eq!(report.address_match, Some((6, 6)));
        assert_eq!(report.device_frees, 1, "a's segment");
        for p in [c.ptr, e.ptr, later.ptr] {
            core.free(p).unwrap();
        }
    }

    /// A server's pools (`gpualloc_devices` `pools/`): weights in one named pool, put to sleep
    /// and woken mid-history; requests in another and in the default pools, the same sizes
    /// in each, so a request served from the wrong pool lands elsewhere. Recording begins with
    /// every pool holding pages. The history names each `alloc`'s and segment event's pool
    /// (`segment_pool_id`); the replay makes the pools, restores their segments in them,
    /// serves each request from its pool and sleeps and wakes the pool where the history
    /// does. Before, every request went to the default pools: 22 of 300 matched.
    #[test]
    fn named_pools_sleep_and_wake_replay_at_the_same_addresses() {
        use gpualloc_devices::{
            map_wake, release_slept_pages, wait_for_pool_streams, PoolOptions, SleepMode,
        };
        use gpualloc_trace::Action::{Alloc, SegmentMap, SegmentUnmap};
        use gpualloc_trace::TraceEntry;
        for conf in [
            "expandable_segments:True",
            "expandable_segments:True,policy:pytorch",
        ] {
            let (backend, mut core, s) = rig(conf);
            let weights = core.create_named_pool("weights", PoolOptions::default());
            let kv = core.create_named_pool(
                "kv_cache",
                PoolOptions {
                    quota: Some(64 * MIB),
                    ..PoolOptions::default()
                },
            );
            let held: Vec<_> = (0..4u64)
                .map(|i| core.malloc_in(weights, 6 * MIB + i * 4097, s).unwrap().ptr)
                .collect();
            let mut rng = 0x9e37_79b9_7f4a_7c15u64;
            let mut live = Vec::new();
            let mut step = |core: &mut DeviceCore, live: &mut Vec<_>| {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                let size = match rng % 3 {
                    0 => rng % MIB + 1,
                    1 => rng % (6 * MIB) + 1,
                    _ => rng % (24 * MIB) + 1,
                };
                let a = if rng % 2 == 0 {
                    core.malloc_in(kv, size, s)
                } else {
                    core.malloc(size, s)
                };
                // Past the quota: the pool's request fails.
                if let Ok(a) = a {
                    live.push(a.ptr);
                }
                if !live.is_empty() && (live.len() > 10 || rng % 3 == 0) {
                    let k = (rng as usize / 3) % live.len();
                    core.free(live.swap_remove(k)).unwrap();
                }
            };
            for _ in 0..40 {
                step(&mut core, &mut live);
            }
            core.record_history(Some(10_000));
            for i in 0..300 {
                step(&mut core, &mut live);
                if i == 100 {
                    let plan = core.begin_sleep(weights, SleepMode::Discard).unwrap();
                    wait_for_pool_streams(backend.as_ref(), &plan).unwrap();
                    release_slept_pages(backend.as_ref(), &plan);
                    assert!(core.finish_sleep(plan).is_empty());
                }
                if i == 150 {
                    core.empty_cache().unwrap();
                }
                if i == 200 {
                    let plan = core.begin_wake(weights).unwrap().unwrap();
                    let woken = map_wake(backend.as_ref(), &plan).unwrap();
                    assert!(core.finish_wake(plan, woken).is_empty());
                }
            }
            let trace = core.snapshot().trace;
            let in_pool = |pool: u64| trace.iter().filter(|e| e.pool == pool).count();
            assert!(in_pool(kv.0) > 100, "[{conf}] {}", in_pool(kv.0));
            assert!(in_pool(weights.0) >= 2, "[{conf}] its sleep and wake");
            let config = AllocatorConfig::parse(conf).unwrap();
            let trace = dumped(&core, &config);
            let options = ReplayOptions {
                sample_every: 1,
                ..warm(config)
            };
            // The pools come with their rules; the kv_cache pool reached its quota.
            let kv_quota: Vec<_> = trace.pools.iter().map(|p| p.options.quota).collect();
            assert_eq!(kv_quota, [None, Some(64 * MIB)], "[{conf}]");
            assert!(trace.count(gpualloc_trace::Action::Oom) > 0, "[{conf}]");
            let report = replay(&trace, &options).unwrap();
            let (matched, compared) = report.address_match.unwrap();
            assert!(compared >= 290, "[{conf}] {compared}");
            assert_eq!(matched, compared, "[{conf}]");
            assert_eq!(report.warnings, 0, "[{conf}]");
            // Reserved memory as it was live at every request: the sleep released the pool's
            // pages and the wake mapped them again. (The replay wakes the pool at its first
            // `segment_map`; live, the wake's maps are one event each.)
            let events = &trace.events;
            for sample in &report.samples {
                if events[sample.event as usize].action != gpualloc_trace::Action::Alloc {
                    continue;
                }
                assert_eq!(
                    Some(sample.reserved),
                    sample.torch_reserved,
                    "[{conf}] event {}",
                    sample.event
                );
            }
            // A replay with no room for the wake (an allocation that never happened live
            // fills the device just before it): the pool stays asleep with a warning, and
            // the replay goes on.
            let weights_id = Some((0, weights.0 as i64));
            let unmapped = events
                .iter()
                .position(|e| e.action == SegmentUnmap && e.pool_id == weights_id)
                .unwrap();
            let wake = unmapped
                + events[unmapped..]
                    .iter()
                    .position(|e| e.action == SegmentMap && e.pool_id == weights_id)
                    .unwrap();
            let before = report.samples[wake - 1].reserved;
            let mut crowded = trace.clone();
            let filler = TraceEntry::new(Alloc, 0x1000, CAPACITY - before - 4 * MIB, s.raw);
            crowded.events.insert(wake, filler);
            let report = replay(&crowded, &options).unwrap();
            assert!(report.warnings >= 1, "[{conf}] {}", report.warnings);
            for p in live.into_iter().chain(held) {
                core.free(p).unwrap();
            }
        }
    }

    /// A pool's quota is part of the recording (`allocator_settings`' `gpualloc_pools`): at
    /// the quota the tail cannot grow, so the request takes the block the policy passed over
    /// (`placement.rs`); a replay without the quota grows the tail instead (the one
    /// mismatch of 30,000 in a `serve --pools` history).
    #[test]
    fn a_pools_quota_comes_with_the_history() {
        use gpualloc_devices::PoolOptions;
        let conf = "expandable_segments:True";
        let (_backend, mut core, s) = rig(conf);
        let kv = core.create_named_pool(
            "kv",
            PoolOptions {
                quota: Some(6 * MIB),
                ..PoolOptions::default()
            },
        );
        core.record_history(Some(100));
        let a = core.malloc_in(kv, 1536 << 10, s).unwrap();
        let b = core.malloc_in(kv, 1536 << 10, s).unwrap();
        let c = core.malloc_in(kv, 2560 << 10, s).unwrap();
        core.free(a.ptr).unwrap();
        let kept = core.malloc_in(kv, 1152 << 10, s).unwrap();
        assert_eq!(kept.ptr, a.ptr, "live: the passed-over block, at the quota");
        let config = AllocatorConfig::parse(conf).unwrap();
        let mut trace = dumped(&core, &config);
        let options = warm(config);
        // The entry says the block was passed over (the replay would serve it so from that
        // alone): without it, the quota decides.
        assert!(trace.events.iter().any(|e| e.passed_over));
        for e in &mut trace.events {
            e.passed_over = false;
        }
        assert_eq!(
            replay(&trace, &options).unwrap().address_match,
            Some((4, 4))
        );
        trace.pools.clear();
        assert_eq!(
            replay(&trace, &options).unwrap().address_match,
            Some((3, 4))
        );
        for p in [b.ptr, c.ptr, kept.ptr] {
            core.free(p).unwrap();
        }
    }

    /// A request that looked while another request's pages were being mapped at the tail it
    /// would grow: its segment could not grow then, and it took the block the policy had
    /// passed over (dead remainder). The history shows it after those pages landed, where a
    /// replay would grow the tail; the entry says it was served by the passed-over block
    /// (`gpualloc_passed_over`), and the replay serves it so. (The one to four allocations of
    /// 30,000 the `serve` histories with garbage collection put elsewhere.)
    #[test]
    fn a_request_that_took_a_passed_over_block_replays_the_same() {
        // A 7 MiB cap (7/1024 of the 1 GiB device): the pages in flight count against it.
        let conf = "expandable_segments:True,per_process_memory_fraction:0.0068359375";
        let (backend, mut core, s) = rig(conf);
        core.record_history(Some(100));
        // A 1.5 MiB hole at the base, 1 MiB free at the tail of the 4 MiB mapped.
        let a = core.malloc(1536 << 10, s).unwrap();
        let b = core.malloc(1536 << 10, s).unwrap();
        core.free(a.ptr).unwrap();
        // Another request's pages, in flight past the tail.
        let first = miss(&mut core, 3 * MIB, s);
        let Growth::Map(plan) = core.plan_growth(&first).unwrap() else {
            panic!("expected a growth");
        };
        // 1.125 MiB: the hole would leave 384 KiB; the tail cannot grow now (4 MiB mapped, 2
        // being mapped, 2 more would pass the cap). Once the pages land it could.
        let second = miss(&mut core, 1152 << 10, s);
        assert!(matches!(
            core.plan_growth(&second).unwrap(),
            Growth::InPlace
        ));
        let Ok(took) = core.malloc_passed_over(second) else {
            panic!("the passed-over hole serves it");
        };
        assert_eq!(took.ptr, a.ptr, "live: the passed-over hole");
        let mapped = map_growth(backend.as_ref(), &plan).unwrap();
        core.commit_growth(plan, mapped).map_err(|_| ()).unwrap();
        let CachedOutcome::Hit(c) = core.try_cached(3 * MIB, s).unwrap() else {
            panic!("the new pages serve it");
        };
        let passed: Vec<bool> = core
            .snapshot()
            .trace
            .iter()
            .filter(|e| e.action == gpualloc_devices::TraceAction::Alloc)
            .map(|e| e.passed_over)
            .collect();
        assert_eq!(passed, [false, false, true, false]);
        let config = AllocatorConfig::parse(conf).unwrap();
        let mut trace = dumped(&core, &config);
        let options = warm(config);
        assert_eq!(
            replay(&trace, &options).unwrap().address_match,
            Some((4, 4))
        );
        for e in &mut trace.events {
            e.passed_over = false;
        }
        let (matched, compared) = replay(&trace, &options).unwrap().address_match.unwrap();
        assert!(matched < compared, "{matched}/{compared}");
        for p in [b.ptr, took.ptr, c.ptr] {
            core.free(p).unwrap();
        }
    }
    /// A request whose miss ran off the core after a block of its own stream was freed: the
    /// chain starts after the lookup, so the request borrowed another stream's free block
    /// (`streams/loans.rs`) though its own block was free by then. The history shows its
    /// `alloc` after that free, where a replay's lookup would take its own block; the entry
    /// says it was a loan (`gpualloc_borrowed`), and the replay makes the same loan. (Before
    /// the mark, a `serve` history replayed at 23-99.8% of addresses per device.)
    #[test]
    fn a_request_served_by_a_loan_replays_the_same_loan() {
        let (core, mut trace, [a, b, _]) = loan_history(4 * MIB);
        let borrowed: Vec<bool> = core
            .snapshot()
            .trace
            .iter()
            .filter(|e| e.action == gpualloc_devices::TraceAction::Alloc)
            .map(|e| e.borrowed)
            .collect();
        assert_eq!(borrowed, [false, false, true]);
        assert_ne!(a, b);
        let options = warm(AllocatorConfig::default());
        assert_eq!(
            replay(&trace, &options).unwrap().address_match,
            Some((3, 3))
        );
        // Without the mark the replay's lookup takes the borrower's own block.
        for e in &mut trace.events {
            e.borrowed = false;
        }
        assert_eq!(
            replay(&trace, &options).unwrap().address_match,
            Some((2, 3))
        );
    }

    /// A request whose miss got a segment off the core while another stream's block was
    /// freed: live, its chain had found no loan, so it took the new segment. The replay's
    /// chain runs at the history's `alloc`, where that block is free: it lends only where the
    /// history shows a loan, so the new segment serves the request there too.
    #[test]
    fn a_request_served_by_a_new_segment_is_not_lent_in_the_replay() {
        let conf = "expandable_segments:False";
        let (backend, mut core, s) = rig(conf);
        let lender = backend
            .stream_create(gpualloc::runtime::DeviceId(0))
            .unwrap();
        core.record_history(Some(100));
        // The borrower's 20 MiB segment, full; the lender's, full.
        let a = core.malloc(8 * MIB, s).unwrap();
        let rest = core.malloc(12 * MIB, s).unwrap();
        let b = core.malloc(20 * MIB, lender).unwrap();
        // The miss asks for a segment; the lender's block is freed meanwhile.
        let y = new_segment_while_freeing(&backend, &mut core, 6 * MIB, s, b.ptr);
        assert_ne!(y.ptr, b.ptr, "live: the new segment");
        assert_eq!(core.reserved_bytes(), 60 * MIB);
        assert_eq!(replayed(&core, conf), (4, 4));
        for p in [a.ptr, rest.ptr, y.ptr] {
            core.free(p).unwrap();
        }
    }

    /// A free recorded while a request's segment was obtained off the core lands between the
    /// `segment_alloc` and the request's `alloc` (another task's free, beside the core): the
    /// request still adopted its new segment, and the replay serves it so.
    #[test]
    fn a_free_between_a_new_segment_and_its_alloc_does_not_hide_it() {
        use gpualloc_trace::Action;
        let conf = "expandable_segments:False";
        let (backend, mut core, s) = rig(conf);
        core.record_history(Some(1000));
        let a = core.malloc(8 * MIB, s).unwrap();
        let rest = core.malloc(12 * MIB, s).unwrap();
        let z = core.malloc(4096, s).unwrap();
        let b = new_segment_while_freeing(&backend, &mut core, 6 * MIB, s, a.ptr);
        assert_ne!(b.ptr, a.ptr, "live, the new segment serves the request");
        core.free(z.ptr).unwrap();
        let config = AllocatorConfig::parse(conf).unwrap();
        let mut trace = dumped(&core, &config);
        // z's free, moved to between the segment_alloc and b's alloc.
        let at = |t: &Trace, action: Action, addr: u64| {
            t.events
                .iter()
                .position(|e| e.action == action && e.addr == addr)
                .unwrap()
        };
        let requested = trace
            .events
            .remove(at(&trace, Action::FreeRequested, z.ptr.0));
        let completed = trace
            .events
            .remove(at(&trace, Action::FreeCompleted, z.ptr.0));
        let alloc_b = at(&trace, Action::Alloc, b.ptr.0);
        assert_eq!(trace.events[alloc_b - 1].action, Action::SegmentAlloc);
        trace.events.insert(alloc_b, completed);
        trace.events.insert(alloc_b, requested);
        assert_eq!(
            replay(&trace, &warm(config)).unwrap().address_match,
            Some((4, 4))
        );
        for p in [rest.ptr, b.ptr] {
            core.free(p).unwrap();
        }
    }

    /// A history of a loan: the borrower's live 4 MiB block `a`, the lender's free 8 MiB
    /// block `b`, and `y` (`y_size` bytes) on the borrower's stream, lent `b` by a miss that
    /// ran after `a` was freed. The core, its history's trace, and `a`, `b`, `y`.
    fn loan_history(y_size: u64) -> (DeviceCore, Trace, [u64; 3]) {
        let (backend, mut core, s) = rig("");
        let lender = backend
            .stream_create(gpualloc::runtime::DeviceId(0))
            .unwrap();
        core.record_history(Some(100));
        let a = core.malloc(4 * MIB, s).unwrap();
        let b = core.malloc(8 * MIB, lender).unwrap();
        core.free(b.ptr).unwrap();
        let request = miss(&mut core, y_size, s);
        core.free(a.ptr).unwrap();
        let mut m = Miss::off_core(request);
        let MissStep::Done(y) = core.advance_miss(&mut m, None) else {
            panic!("expected a loan");
        };
        assert_eq!(
            (y.ptr, y.stream),
            (b.ptr, s),
            "live: the lender's block, lent"
        );
        let trace = dumped(&core, &AllocatorConfig::default());
        (core, trace, [a.ptr.0, b.ptr.0, y.ptr.0])
    }

    /// A loan of a block of exactly the request's size replays as the same loan.
    #[test]
    fn a_loan_of_a_block_of_the_requests_size_replays_the_same() {
        let (_core, trace, _) = loan_history(8 * MIB);
        let report = replay(&trace, &warm(AllocatorConfig::default())).unwrap();
        assert_eq!(report.address_match, Some((3, 3)));
        assert_eq!(report.peak_reserved, 12 * MIB);
    }

    /// A mark the replay cannot follow (a hand-edited history: the block it names is the
    /// request's own stream's, or too small) is not a loan there: the request is served as an
    /// ordinary one, and nothing is lent to the stream that owns the block.
    #[test]
    fn a_loan_mark_that_names_no_other_streams_free_block_serves_an_ordinary_request() {
        use gpualloc_trace::Action;
        let (_core, trace, [a, _, y]) = loan_history(4 * MIB);
        // The mark moved to `a`'s alloc, whose block at its address is its own stream's.
        let mut own = trace.clone();
        for e in &mut own.events {
            e.borrowed = e.action == Action::Alloc && e.addr == a;
        }
        let report = replay(&own, &warm(AllocatorConfig::default())).unwrap();
        // `a` at its address (its own new memory), `y` not lent: `a`'s block, freed by then.
        assert_eq!(report.address_match, Some((2, 3)));
        // `y` grown to 10 MiB: the 8 MiB block it names is too small for it.
        let mut bigger = trace.clone();
        let y_alloc = bigger
            .events
            .iter()
            .rposition(|e| e.action == Action::Alloc && e.addr == y)
            .unwrap();
        bigger.events[y_alloc].size = 10 * MIB;
        let report = replay(&bigger, &warm(AllocatorConfig::default())).unwrap();
        assert_eq!(report.address_match, Some((2, 3)));
        let mismatch = report.first_mismatch.unwrap();
        assert_eq!(mismatch.index, y_alloc);
        assert!(
            mismatch
                .rule
                .ends_with("PyTorch took another stream's free block (a loan)"),
            "{}",
            mismatch.rule
        );
    }

    /// A cold replay of a history recorded under a policy that lends answers what the policy
    /// would do: it lends where its own chain finds a loan (only a warm replay follows the
    /// history's marks alone).
    #[test]
    fn a_cold_replay_of_a_lending_history_lends_by_its_own_rules() {
        let (_core, trace, [a, _, _]) = loan_history(4 * MIB);
        let cold = ReplayOptions {
            warm: false,
            ..warm(AllocatorConfig::default())
        };
        // Strip the mark: a cold replay ignores it, and a loan it makes is its own.
        let mut unmarked = trace.clone();
        for e in &mut unmarked.events {
            e.borrowed = false;
        }
        // Sequentially `a`'s block is free at `y`: no loan is needed, 12 MiB.
        assert_eq!(replay(&unmarked, &cold).unwrap().peak_reserved, 12 * MIB);
        // With `a` still live at `y` (its free moved to the end), `y` borrows `b`'s block.
        let is_a_free = |e: &gpualloc_trace::TraceEntry| {
            e.addr == a
                && matches!(
                    e.action,
                    gpualloc_trace::Action::FreeRequested | gpualloc_trace::Action::FreeCompleted
                )
        };
        let mut live_a = unmarked.clone();
        let a_free: Vec<_> = live_a
            .events
            .iter()
            .filter(|e| is_a_free(e))
            .cloned()
            .collect();
        assert_eq!(a_free.len(), 2);
        live_a.events.retain(|e| !is_a_free(e));
        live_a.events.extend(a_free);
        assert_eq!(replay(&live_a, &cold).unwrap().peak_reserved, 12 * MIB);
    }
    /// A core over an accounting backend whose events complete only when told, recording its
    /// history: the lender's 8 MiB block is freed and lent to `s`, whose free of it waits for
    /// `s`'s work. Returns the block's address too.
    fn manual_loan() -> (
        Arc<AccountingBackend>,
        DeviceCore,
        StreamHandle,
        StreamHandle,
        u64,
    ) {
        let backend = Arc::new(AccountingBackend::manual_events(1, CAPACITY));
        let dynb: Arc<dyn Backend> = backend.clone();
        let s = dynb.stream_create(DeviceId(0)).unwrap();
        let lender = dynb.stream_create(DeviceId(0)).unwrap();
        let mut core =
            DeviceCore::new(dynb, DeviceId(0), AllocatorConfig::default().resolved(true)).unwrap();
        core.record_history(Some(100));
        let a = core.malloc(8 * MIB, lender).unwrap();
        core.free(a.ptr).unwrap();
        let y = core.malloc(8 * MIB, s).unwrap();
        assert_eq!((y.ptr, y.stream), (a.ptr, s), "live: a loan");
        core.free(y.ptr).unwrap();
        (backend, core, s, lender, a.ptr.0)
    }

    /// A lent block whose borrower's work is not done when the history ends: its free never
    /// completes, and the lender's next request gets new memory. The replay keeps it pending
    /// too (a free with no `free_completed` in a history that records them).
    #[test]
    fn a_lent_block_whose_free_never_completed_stays_pending_in_the_replay() {
        let (backend, mut core, s, lender, a) = manual_loan();
        // The lender's request while the borrower's work is not done: new memory.
        let b = core.malloc(8 * MIB, lender).unwrap();
        assert_ne!(b.ptr.0, a);
        assert_eq!(core.reserved_bytes(), 16 * MIB);
        let report = replay_warm(&core, AllocatorConfig::default());
        assert_eq!(report.address_match, Some((3, 3)));
        assert_eq!(report.peak_reserved, 16 * MIB);
        backend.complete_stream(s);
        core.free(b.ptr).unwrap();
    }

    /// A lent block given back at once (its `free_completed` right after its free), then its
    /// pages unmapped by `empty_cache`: the replay has it back at its `free_completed`, so
    /// the `segment_unmap` finds its pages free and unmaps them as the live allocator did.
    #[test]
    fn a_lent_blocks_return_lands_before_the_unmap_that_follows_it() {
        let (backend, mut core, s, _lender, _) = manual_loan();
        backend.complete_stream(s);
        core.empty_cache().unwrap();
        assert_eq!(core.reserved_bytes(), 0);
        let trace = dumped(&core, &AllocatorConfig::default());
        let actions: Vec<&str> = trace.events.iter().map(|e| e.action.as_str()).collect();
        assert_eq!(
            actions,
            [
                "segment_map",
                "alloc",
                "free_requested",
                "free_completed",
                "alloc",
                "free_requested",
                "free_completed",
                "segment_unmap"
            ]
        );
        let (_, replayed) = replay_core(&trace, &warm(AllocatorConfig::default())).unwrap();
        assert_eq!(replayed.reserved_bytes(), 0);
    }
}
