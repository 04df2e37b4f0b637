//! Replays of the real PyTorch snapshots in ../shared/traces (skipped with a printed reason
//! where that folder is absent, as in a user's clone).
//!
//! - warm, default config: 100% of allocations land at PyTorch's address and peak reserved
//!   equals PyTorch's recorded peak exactly (the strongest check that the core follows
//!   PyTorch's rules);
//! - a deliberately broken tie-break rule drops the match well below 100%;
//! - cold, default config: peak reserved is at most PyTorch's, within one 20 MiB segment.
//!   A cold replay cannot know how the allocations alive before recording were laid out, so
//!   it packs them itself (largest first); on llama-lora-finetune that layout costs one more
//!   20 MiB segment than PyTorch's real one (6,192 MiB against 6,172 MiB, +0.32%). The warm
//!   replay, which starts from the real layout, equals PyTorch exactly (test above).

mod common;

use common::{all_traces, traces_dir};
use gpualloc_devices::{DeviceCore, RuleKnobs};
use gpualloc_replay::{replay, ReplayOptions, Trace};

#[test]
fn warm_replay_matches_pytorch_address_for_address() {
    for trace in all_traces() {
        let r = replay(
            &trace,
            &ReplayOptions {
                warm: true,
                ..ReplayOptions::default()
            },
        )
        .unwrap();
        let (matched, compared) = r.address_match.unwrap();
        eprintln!(
            "{}: {matched}/{compared} addresses, peak {} vs torch {:?}",
            trace.name, r.peak_reserved, r.torch.peak_reserved
        );
        assert!(compared > 900, "{}: compared only {compared}", trace.name);
        assert_eq!(
            matched, compared,
            "{}: first mismatch {:?}",
            trace.name, r.first_mismatch
        );
        assert!(r.first_mismatch.is_none());
        assert_eq!(
            Some(r.peak_reserved),
            r.torch.peak_reserved,
            "{}",
            trace.name
        );
        assert_eq!(
            r.device_mallocs, r.torch.segment_allocs,
            "{}: one segment per PyTorch segment_alloc",
            trace.name
        );
        assert_eq!(r.warnings, 0, "{}", trace.name);
    }
}

#[test]
fn a_broken_tie_break_is_caught() {
    fn break_ties(core: &mut DeviceCore) {
        core.set_rule_knobs(RuleKnobs {
            tie_break_high_address: true,
        });
    }
    let mut checked = 0;
    for trace in all_traces() {
        let options = ReplayOptions {
            warm: true,
            core_hook: Some(break_ties),
            ..ReplayOptions::default()
        };
        let r = replay(&trace, &options).unwrap();
        let fraction = r.address_match_fraction().unwrap();
        eprintln!(
            "{}: broken tie-break matches {:.1}%",
            trace.name,
            fraction * 100.0
        );
        assert!(fraction < 0.9, "{}: {fraction}", trace.name);
        assert!(r.first_mismatch.is_some());
        checked += 1;
    }
    if checked == 0 {
        eprintln!("skipped: no traces");
    }
}

#[test]
fn cold_replay_peak_is_at_most_pytorchs() {
    for trace in all_traces() {
        let r = replay(&trace, &ReplayOptions::default()).unwrap();
        let torch = r.torch.peak_reserved.unwrap();
        eprintln!(
            "{}: cold peak {} vs torch {torch}, fragmentation {:.2}%",
            trace.name,
            r.peak_reserved,
            r.fragmentation() * 100.0
        );
        let one_segment = 20 << 20;
        assert!(
            r.peak_reserved <= torch + one_segment,
            "{}: {} > {torch} + 20 MiB",
            trace.name,
            r.peak_reserved
        );
        assert!(r.events_per_second > 0.0);
    }
}

/// The configs the replay issue names (the gc one with a device capacity, below).
const CONFIGS: [&str; 7] = [
    "",
    "expandable_segments:False",
    "expandable_segments:True",
    "max_split_size_mb:128",
    "max_split_size_mb:128,expandable_segments:True",
    "roundup_power2_divisions:4",
    "garbage_collection_threshold:0.8,per_process_memory_fraction:0.9",
];

/// The two policies answer alike except where a documented deviation applies: on these
/// traces, only with expandable segments (which the `gpualloc` policy runs unless the config
/// says `expandable_segments:False`; `max_split_size` there, the placement rule for dead
/// remainders, and the large pool's 2 MiB pages), and there the `gpualloc` policy never
/// reserves more at its peak. Growths are the core's `segment_map`s (for PyTorch's ordinary
/// segments, its segment mallocs); driver maps are the backend's `map` calls (one per
/// physical handle).
#[test]
fn policies_differ_only_where_a_deviation_applies() {
    use gpualloc_devices::{AllocatorConfig, Policy};
    let mut differing = Vec::new();
    for trace in all_traces() {
        for conf in CONFIGS {
            let run = |policy: Policy| {
                let options = ReplayOptions {
                    config: AllocatorConfig::parse(conf).unwrap().with_policy(policy),
                    // Room for PyTorch's recorded peak plus a fifth, so the gc threshold bites.
                    capacity: conf.contains("garbage").then(|| trace_capacity(&trace)),
                    ..ReplayOptions::default()
                };
                let r = replay(&trace, &options).unwrap();
                assert_eq!(r.policy, policy);
                assert_eq!(r.warnings, 0, "{} {conf} {policy}", trace.name);
                (r.peak_reserved, r.device_mallocs, r.ooms, r.page_maps)
            };
            let (torch, ours) = (run(Policy::Pytorch), run(Policy::Gpualloc));
            eprintln!(
                "{} [{conf}]: pytorch {torch:?}, gpualloc {ours:?}",
                trace.name
            );
            if torch != ours {
                assert!(
                    !conf.contains("expandable_segments:False"),
                    "{} [{conf}]: the policies differ where no deviation applies",
                    trace.name
                );
                assert!(torch.0 >= ours.0, "{}: {torch:?} vs {ours:?}", trace.name);
                differing.push((trace.name.clone(), conf, torch, ours));
            }
        }
    }
    if differing.is_empty() && traces_dir().is_none() {
        return;
    }
    // The figures of the deviations table (README, devices/src/config.rs).
    let mib = |b: u64| b >> 20;
    let figures: Vec<String> = differing
        .into_iter()
        .map(|(n, c, t, o)| {
            format!(
                "{n} [{c}]: {} / {} MiB, growths {} / {}, driver maps {} / {}",
                mib(t.0),
                mib(o.0),
                t.1,
                o.1,
                t.3,
                o.3
            )
        })
        .collect();
    assert_eq!(
        figures,
        [
            "llama-lora-finetune.pickle []: 6192 / 5642 MiB, growths 230 / 208, driver maps 0 / 329",
            "llama-lora-finetune.pickle [expandable_segments:True]: 5642 / 5642 MiB, growths 207 / 208, driver maps 328 / 329",
            "llama-lora-finetune.pickle [max_split_size_mb:128]: 6192 / 5642 MiB, growths 230 / 208, driver maps 0 / 329",
            "llama-lora-finetune.pickle [max_split_size_mb:128,expandable_segments:True]: 5882 / 5642 MiB, growths 209 / 208, driver maps 340 / 329",
            "llama-lora-finetune.pickle [roundup_power2_divisions:4]: 6034 / 5986 MiB, growths 213 / 207, driver maps 0 / 348",
            "llama-lora-finetune.pickle [garbage_collection_threshold:0.8,per_process_memory_fraction:0.9]: 6024 / 5642 MiB, growths 230 / 208, driver maps 0 / 329",
            "transformer-lm-forward-bf16.pickle []: 822 / 766 MiB, growths 43 / 43, driver maps 0 / 45",
            "transformer-lm-forward-bf16.pickle [expandable_segments:True]: 786 / 766 MiB, growths 41 / 43, driver maps 42 / 45",
            "transformer-lm-forward-bf16.pickle [max_split_size_mb:128]: 822 / 766 MiB, growths 43 / 43, driver maps 0 / 45",
            "transformer-lm-forward-bf16.pickle [max_split_size_mb:128,expandable_segments:True]: 786 / 766 MiB, growths 41 / 43, driver maps 42 / 45",
            "transformer-lm-forward-bf16.pickle [roundup_power2_divisions:4]: 866 / 866 MiB, growths 64 / 47, driver maps 0 / 50",
            "transformer-lm-forward-bf16.pickle [garbage_collection_threshold:0.8,per_process_memory_fraction:0.9]: 822 / 766 MiB, growths 43 / 43, driver maps 0 / 45",
            "transformer-lm-train.pickle []: 13436 / 13296 MiB, growths 240 / 248, driver maps 0 / 673",
            "transformer-lm-train.pickle [expandable_segments:True]: 13296 / 13296 MiB, growths 248 / 248, driver maps 672 / 673",
            "transformer-lm-train.pickle [max_split_size_mb:128]: 13730 / 13296 MiB, growths 245 / 248, driver maps 0 / 673",
            "transformer-lm-train.pickle [max_split_size_mb:128,expandable_segments:True]: 13576 / 13296 MiB, growths 251 / 248, driver maps 686 / 673",
            "transformer-lm-train.pickle [roundup_power2_divisions:4]: 13468 / 13436 MiB, growths 277 / 252, driver maps 0 / 679",
            "transformer-lm-train.pickle [garbage_collection_threshold:0.8,per_process_memory_fraction:0.9]: 13412 / 13296 MiB, growths 239 / 248, driver maps 0 / 673",
        ]
    );
}

/// 1.2 × PyTorch's recorded peak reserved (or 1 TiB when the trace does not tell).
fn trace_capacity(trace: &Trace) -> u64 {
    let r = replay(trace, &ReplayOptions::default()).unwrap();
    r.torch.peak_reserved.map_or(1 << 40, |p| p + p / 5)
}

/// `summary` covers the whole recording: totals count every allocation of the trace (and
/// those alive when it began), the peak is the replay's, the current state is the snapshot's.
#[test]
fn summary_totals_cover_the_whole_trace() {
    use gpualloc_devices::StatType;
    use gpualloc_replay::analysis::live_at_start;
    use gpualloc_replay::summary::summary_core;
    use gpualloc_trace::Action;
    const ALL: usize = StatType::All as usize;
    for trace in all_traces() {
        let (what, core) = summary_core(&trace).unwrap();
        assert!(what.contains("recorded history"), "{what}");
        let st = core.stats();
        let (initial, _) = live_at_start(&trace);
        let allocs = trace.count(Action::Alloc) as u64 + initial.len() as u64;
        assert_eq!(st.allocation[ALL].allocated, allocs, "{}", trace.name);
        assert!(st.allocation[ALL].freed > 0, "{}", trace.name);
        let final_live: u64 = trace
            .final_segments
            .as_ref()
            .unwrap()
            .iter()
            .flat_map(|s| s.blocks.iter())
            .filter(|b| b.active)
            .map(|b| b.size)
            .sum();
        assert_eq!(
            st.allocated_bytes[ALL].current, final_live,
            "{}",
            trace.name
        );
        let warm = replay(
            &trace,
            &ReplayOptions {
                warm: true,
                ..ReplayOptions::default()
            },
        )
        .unwrap();
        assert_eq!(st.allocated_bytes[ALL].peak, warm.peak_allocated);
        assert!(warm.peak_allocated > final_live, "{}", trace.name);
    }
}

/// The plot's reference line: PyTorch's reserved memory, sampled along the replay, peaks at
/// PyTorch's recorded peak; its time axis is the trace's own where it has time stamps.
#[test]
fn samples_carry_pytorchs_reserved_curve_and_time() {
    for trace in all_traces() {
        let options = ReplayOptions {
            sample_every: 1,
            ..ReplayOptions::default()
        };
        let r = replay(&trace, &options).unwrap();
        assert_eq!(r.samples.len(), trace.events.len());
        let torch_peak = r.samples.iter().filter_map(|s| s.torch_reserved).max();
        assert_eq!(torch_peak, r.torch.peak_reserved, "{}", trace.name);
        let stamped = r.samples.iter().all(|s| s.time_us.is_some());
        let trace_stamped = trace.events.iter().all(|e| e.time_us.is_some());
        assert_eq!(stamped, trace_stamped, "{}", trace.name);
        let svg = std::env::temp_dir().join(format!("gpualloc-plot-{}.svg", std::process::id()));
        gpualloc_replay::plot::write_plot(&svg, &[r]).unwrap();
        let text = std::fs::read_to_string(&svg).unwrap();
        assert!(
            text.contains("PyTorch reserved (recorded)"),
            "{}",
            trace.name
        );
        let axis = if trace_stamped {
            "time since the first event (s)"
        } else {
            ">event<"
        };
        assert!(
            text.contains(axis) || text.contains(&axis.replace(['<', '>'], "\n")),
            "{}: {axis}",
            trace.name
        );
        std::fs::remove_file(&svg).ok();
    }
}
