//! The replay loop: a trace's events through a `DeviceCore` on the accounting backend.
//!
//! - `alloc` → `malloc(size, stream)` (the trace's stream ids are the stream handles, so
//!   blocks are ordered by the same stream values PyTorch saw);
//! - `free_requested` → `free`; when the trace shows the block waited for other streams
//!   (its `free_completed` comes later), the replay records a use on a private stream first
//!   and completes that stream's event at the `free_completed`;
//! - a run of `segment_free` (or, with expandable segments, `segment_unmap`) events is the
//!   program calling `empty_cache()`: the replay does too;
//! - `free_completed` of a still-live address (RMM logs have no `free_requested`) frees it.
//!
//! Cold replay starts from nothing but the allocations alive at the start, allocated first,
//! largest first (ties by address). The order they were really made in is not in the trace;
//! largest first is best fit's tightest packing of them, so the cold figures never blame the
//! config for a layout the recording does not show. (Address order, tried on the three
//! snapshots in shared/traces, gives the same peaks.) Warm replay (`ReplayOptions::warm`) rebuilds PyTorch's state when recording
//! began — its segments at their real addresses, live blocks in them, the rest free — places
//! each new segment at the address of PyTorch's pending `segment_alloc` of the same size, and
//! compares every allocation's address with PyTorch's. It also follows a history recorded by
//! gpualloc's actor, which obtains segments and pages off its lock while other requests go on
//! (`gpualloc_devices` `recorded/`): an `alloc` right after the `segment_alloc` of the segment
//! holding it is served by that new segment without a cache lookup, and a `segment_map` inside
//! a reservation maps its pages at once, so the `alloc` that follows weighs them against the
//! blocks freed meanwhile, as the live request did. The expandable segments held when
//! recording began are restored as reservations (`analysis::reservations`), their mapped runs
//! and live blocks in them, and a reservation the history starts later is made where its
//! pages lie when it maps the first (a reservation released, its last page unmapped, and
//! made again later is two, possibly at the same addresses under another stream).
//!
//! Named pools (gpualloc_devices' `pools/`): the history names the pool of each `alloc` and
//! segment event (`segment_pool_id`); the replay makes a named pool per id, restores its
//! segments in it and serves its requests from it. A pool's sleep shows as a
//! `segment_unmap` of pages live blocks are on (the replay sleeps the pool there), its wake as
//! the `segment_map`s that follow (the replay wakes it at the first).

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use gpualloc_accounting::AccountingBackend;
use gpualloc_devices::{AllocatorConfig, DeviceCore, Policy, PoolState, RecordedHandles};
use gpualloc_runtime::Backend;
use gpualloc_trace::Action;

use crate::analysis::{
    deferred_frees, event_pool, live_at_start, torch_figures, torch_reserved_after,
};
use crate::input::Trace;
use crate::replayer::{Replayer, DEVICE};
use crate::report::{ReplayReport, Sample};

/// Why a replay could not run.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    /// Reading the file failed.
    #[error("cannot read {0}: {1}")]
    Io(String, String),
    /// The file is not a trace we can read.
    #[error("{0}")]
    Format(String),
    /// The trace parser refused the file.
    #[error("{file}: {source}")]
    Parse {
        /// The file (its name).
        file: String,
        /// What the parser said.
        #[source]
        source: gpualloc_trace::TraceError,
    },
    /// The allocator failed with something other than out-of-memory.
    #[error("allocator error at event {index}: {source}")]
    Alloc {
        /// Event index.
        index: usize,
        /// The error.
        source: gpualloc_devices::AllocError,
    },
    /// Warm replay needs the snapshot's segment list.
    #[error("{0}: warm replay needs a snapshot with segments")]
    NoSegments(String),
}

/// How to replay.
#[derive(Debug, Clone)]
pub struct ReplayOptions {
    /// The allocator config under test; its `policy` says whose rules answer.
    /// [`ReplayOptions::default`] sets PyTorch's (the question the tool answers is "what would
    /// PyTorch do?"), while `AllocatorConfig::default()` alone is gpualloc's.
    pub config: AllocatorConfig,
    /// Start from PyTorch's recorded state and compare addresses.
    pub warm: bool,
    /// Device capacity in bytes (None: effectively unlimited, 1 TiB).
    pub capacity: Option<u64>,
    /// Keep a memory-over-time sample every this many events (0: none).
    pub sample_every: usize,
    /// Called with (events done, total) every 4096 events.
    pub progress: Option<fn(u64, u64)>,
    /// Called on the core before the replay starts (tests use it to break a rule on purpose).
    pub core_hook: Option<fn(&mut DeviceCore)>,
    /// Record the replay's own history in the core (from the first event on, stamped with
    /// the trace's `time_us`, or the event index where it has none), for an export that
    /// PyTorch's memory viewer opens (`replay --export-viz`).
    pub record_history: bool,
    /// Cold replay: new segments at the highest free address first, as CUDA's driver handed
    /// out most of them in the shared traces, instead of the lowest first (the default).
    /// Best fit breaks ties between equal free blocks by address, so the order can decide
    /// which block a request takes: cold qwen2-7b-layerwise-calib peaks at PyTorch's recorded
    /// 5.40 GiB top-down and at 5.79 GiB bottom-up. A warm replay places every segment
    /// at PyTorch's address and is not affected.
    pub top_down: bool,
    /// Where the free memory sits when reserved memory first reaches its peak
    /// ([`crate::waste::Waste`], `replay --waste`): a snapshot at every new peak, so off by
    /// default.
    pub waste_at_peak: bool,
}

impl Default for ReplayOptions {
    fn default() -> Self {
        ReplayOptions {
            config: AllocatorConfig::default().with_policy(Policy::Pytorch),
            warm: false,
            capacity: None,
            sample_every: 0,
            progress: None,
            core_hook: None,
            record_history: false,
            top_down: false,
            waste_at_peak: false,
        }
    }
}

/// Replays `trace` under `options`.
pub fn replay(trace: &Trace, options: &ReplayOptions) -> Result<ReplayReport, ReplayError> {
    replay_core(trace, options).map(|(report, _)| report)
}

/// Replays `trace` under `options` and hands back the core in its final state too (its
/// statistics cover the whole replay: `summary` prints them).
pub fn replay_core(
    trace: &Trace,
    options: &ReplayOptions,
) -> Result<(ReplayReport, DeviceCore), ReplayError> {
    let capacity = options.capacity.unwrap_or(1 << 40);
    // Events complete where the history says (`free_completed`), not at a segment's free.
    let mut backend = AccountingBackend::manual_events(1, capacity).free_does_not_synchronize();
    if options.top_down {
        backend = backend.highest_address_first();
    }
    let backend = Arc::new(backend);
    let dynb: Arc<dyn Backend> = backend.clone();
    // As the allocator runs it: the accounting backend has virtual memory.
    let mut core = DeviceCore::new(dynb, DEVICE, options.config.resolved(true))
        .map_err(|source| ReplayError::Alloc { index: 0, source })?;
    if let Some(hook) = options.core_hook {
        hook(&mut core);
    }
    // A history recorded under a policy that lends marks its loans (`gpualloc_borrowed`), and
    // one under a policy that spills small requests into the large pool its spills
    // (`gpualloc_spilled`): a warm replay lends and spills there and nowhere else (what
    // decided them live is not in the history).
    if let Some(recorded) = trace.recorded_config.as_ref().filter(|_| options.warm) {
        core.lend_as_recorded(recorded.policy.lends_across_streams());
        core.spill_as_recorded(recorded.policy.spills_small_requests());
    }
    let mut r = Replayer::new(backend, core, trace.pools.clone());
    let (initial, unexplained) = live_at_start(trace);
    r.warnings += unexplained;
    let torch = torch_figures(trace, &initial);
    // Warm, expandable history: the reservations to make (see `analysis::reservations`).
    let reservations_plan = if options.warm {
        r.start_warm(trace, &initial, capacity)?
    } else {
        r.start_cold(&initial)?;
        Vec::new()
    };

    // A warm replay's start state is the recording's, not the replay's: its pages are not
    // counted. (A cold replay counts what it allocated for the allocations alive at the
    // start: its own layout of them.)
    let baseline = if options.warm {
        (r.backend.counts().maps, r.core.stats().num_device_alloc)
    } else {
        (0, 0)
    };
    let deferred = deferred_frees(trace);
    // Warm: PyTorch's segment_alloc addresses not yet used, per size.
    let mut pending_segments: HashMap<u64, VecDeque<u64>> = HashMap::new();
    let mut report = ReplayReport::new(trace, options, torch);
    if options.record_history {
        // Every event the replay makes: at most one per trace event, plus the segment
        // events of a release.
        r.core.record_history(Some(2 * trace.events.len() + 1024));
    }
    // Warm: addresses that matched PyTorch's, and addresses compared.
    let mut compared = (0u64, 0u64);
    // PyTorch's own reserved bytes as the trace goes, for the plot's reference line.
    let mut torch_reserved = report.torch.start_reserved;
    let started = Instant::now();
    let total = trace.events.len() as u64;
    // The highest reserved memory so far (`waste_at_peak`).
    let mut peak_seen = 0u64;
    for (i, e) in trace.events.iter().enumerate() {
        if options.record_history {
            let at = e.time_us.and_then(|t| u64::try_from(t).ok());
            r.core.set_time_us(at.unwrap_or(i as u64));
        }
        match e.action {
            Action::SegmentMap if options.warm => {
                // A sleeping pool's first page back is its wake (which maps every page it
                // had: the `segment_map`s after it, and this one's own map below, find their
                // pages mapped and change nothing). A replay holding more memory than the
                // recording did may not have room: the pool stays asleep (a warning), and its
                // next page tries again.
                if let Some(pool) = r.pool(event_pool(e)) {
                    if r.core.pool_state(pool) == Some(PoolState::Asleep) {
                        let woken = r
                            .wake(pool)
                            .map_err(|source| ReplayError::Alloc { index: i, source })?;
                        if !woken {
                            r.warnings += 1;
                        }
                    }
                }
                // The first page of a reservation the history starts: the reservation first.
                if r.backend.reservation_holding(DEVICE, e.addr).is_none() {
                    let planned = reservations_plan.iter().find(|p| p.first_map == Some(i));
                    if let Some(res) = planned {
                        r.restore_reservation(res, &[], &[], i)?;
                    }
                }
                // Pages mapped for a request before it looked in the cache again: the blocks
                // freed meanwhile compete with them, as they did live. (Without expandable
                // segments in the config nothing is mapped.)
                r.core
                    .map_recorded_growth(
                        e.addr,
                        e.size,
                        RecordedHandles {
                            grouped_pages: e.grouped_pages,
                            single_pages: e.single_pages,
                        },
                    )
                    .map_err(|source| ReplayError::Alloc { index: i, source })?;
            }
            Action::SegmentMap => {}
            Action::SegmentAlloc => {
                if options.warm {
                    pending_segments
                        .entry(e.size)
                        .or_default()
                        .push_back(e.addr);
                }
            }
            Action::Alloc => r.alloc(
                trace,
                i,
                options,
                &mut pending_segments,
                &mut report,
                &mut compared,
            )?,
            Action::FreeRequested => r.free(e.addr, deferred.contains(&i)),
            Action::FreeCompleted => {
                if let Some(s) = r.deferred.remove(&e.addr) {
                    r.backend.complete_stream(s);
                    r.core
                        .process_events()
                        .map_err(|source| ReplayError::Alloc { index: i, source })?;
                } else if r.addrs.contains_key(&e.addr) {
                    // A log without free_requested (RMM): the free happens here.
                    r.free(e.addr, false);
                } else {
                    // A free whose events the replay completed at its `free_requested` (a lent
                    // block's return: its borrower's work is done there) lands here, where the
                    // history shows it back, before a `segment_unmap` or a loan that follows
                    // needs it free. Nothing pending: one test.
                    r.core
                        .process_events()
                        .map_err(|source| ReplayError::Alloc { index: i, source })?;
                }
            }
            Action::SegmentFree if options.warm => {
                // The segment the history released, not others: the release may have kept
                // segments with frees pending on stream events (`gpualloc_devices` `recorded/`). A segment
                // the replay does not have free there stays.
                r.core
                    .release_recorded_segment(e.addr)
                    .map_err(|source| ReplayError::Alloc { index: i, source })?;
            }
            Action::SegmentUnmap if options.warm && r.core.config().expandable_segments => {
                // Likewise the pages the history unmapped.
                let unmapped = r
                    .core
                    .unmap_recorded_pages(e.addr, e.size)
                    .map_err(|source| ReplayError::Alloc { index: i, source })?;
                // Pages under live blocks of a named pool that is awake: its sleep.
                if let Some(pool) = r.pool(event_pool(e)) {
                    let awake = r.core.pool_state(pool) == Some(PoolState::Awake);
                    if !unmapped && awake && r.live_in(e.addr, e.size) {
                        r.sleep(pool)
                            .map_err(|source| ReplayError::Alloc { index: i, source })?;
                    }
                }
            }
            Action::SegmentFree | Action::SegmentUnmap => {
                // Expandable segments' pages go back as `segment_unmap` runs.
                let run_start = i == 0 || !trace.events[i - 1].action.releases_memory();
                if run_start {
                    r.core
                        .empty_cache()
                        .map_err(|source| ReplayError::Alloc { index: i, source })?;
                }
            }
            Action::Oom | Action::Snapshot => {}
        }
        torch_reserved = torch_reserved.map(|t| torch_reserved_after(t, e));
        if options.waste_at_peak {
            let reserved = r.core.stats().reserved_bytes[0].current;
            if reserved > peak_seen {
                peak_seen = reserved;
                report.waste = Some(crate::waste::Waste::of(&r.core.snapshot(), i as u64));
            }
        }
        if options.sample_every > 0
            && (i % options.sample_every == 0 || i + 1 == trace.events.len())
        {
            let st = r.core.stats();
            report.samples.push(Sample {
                event: i as u64,
                time_us: e.time_us,
                reserved: st.reserved_bytes[0].current,
                allocated: st.allocated_bytes[0].current,
                torch_reserved,
            });
        }
        if let Some(progress) = options.progress {
            if i % 4096 == 0 {
                progress(i as u64, total);
            }
        }
    }
    let elapsed = started.elapsed().as_secs_f64();
    let st = r.core.stats();
    report.peak_reserved = st.reserved_bytes[0].peak;
    report.peak_allocated = st.allocated_bytes[0].peak;
    report.peak_requested = st.requested_bytes[0].peak;
    if let Some(w) = &mut report.waste {
        w.set_floors(
            st.allocated_bytes.all().peak,
            st.allocated_bytes.small().peak,
            st.allocated_bytes.large().peak,
        );
    }
    report.device_mallocs = st.num_device_alloc.saturating_sub(baseline.1);
    report.device_frees = st.num_device_free;
    let calls = r.backend.counts();
    report.page_maps = calls.maps.saturating_sub(baseline.0);
    report.page_unmaps = calls.unmaps;
    report.synchronizations = st.num_sync_all_streams;
    report.retries = st.num_alloc_retries;
    report.ooms = st.num_ooms;
    report.warnings = r.warnings;
    report.events_per_second = if elapsed > 0.0 {
        total as f64 / elapsed
    } else {
        f64::INFINITY
    };
    if options.warm {
        report.address_match = Some(compared);
    }
    Ok((report, r.core))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::replayer::served_by_new_segment;
    use gpualloc_trace::TraceEntry;

    /// An `alloc` is served by the ordinary segment allocated before it (frees between aside)
    /// only where it lies inside that segment.
    #[test]
    fn an_alloc_is_served_by_the_new_segment_only_inside_it() {
        const MIB: u64 = 1 << 20;
        let base = 0x7000_0000_0000;
        let trace_with = |alloc_at: u64| Trace {
            name: "t".into(),
            device: 0,
            events: vec![
                TraceEntry::new(Action::SegmentAlloc, base, 20 * MIB, 7),
                TraceEntry::new(Action::FreeRequested, base - 4 * MIB, MIB, 7),
                TraceEntry::new(Action::FreeCompleted, base - 4 * MIB, MIB, 7),
                TraceEntry::new(Action::Alloc, alloc_at, MIB, 7),
            ],
            final_segments: None,
            recorded_config: None,
            pools: Vec::new(),
        };
        let served = |at: u64| served_by_new_segment(&trace_with(at), 3);
        assert!(served(base));
        assert!(served(base + 19 * MIB));
        assert!(!served(base + 20 * MIB), "the segment's end is outside it");
        assert!(!served(base + 21 * MIB));
        assert!(!served(base - 2 * MIB));
        // Another alloc between: not the new segment's request.
        let mut t = trace_with(base);
        t.events
            .insert(3, TraceEntry::new(Action::Alloc, base - 4 * MIB, MIB, 7));
        assert!(!served_by_new_segment(&t, 4));
    }
}
