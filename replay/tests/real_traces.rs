//! Replays of the real PyTorch snapshots in ../shared/traces (skipped with a printed reason
//! where that folder is absent, as in a user's clone), every device trace of each, under the
//! config each recorded (qwen3's run: `expandable_segments:True`; PyTorch's defaults for the
//! others):
//!
//! - warm: 100% of allocations land at PyTorch's address and peak reserved equals PyTorch's
//!   recorded peak exactly (the strongest check that the core follows PyTorch's rules);
//! - a deliberately broken tie-break rule drops the match well below 100%;
//! - cold: peak reserved is at most PyTorch's, within one 20 MiB segment, with segments
//!   placed bottom-up and top-down; one stated exception (qwen2 bottom-up, see the test).
//!   A cold replay cannot know how the allocations alive before recording were laid out, so
//!   it packs them itself (largest first); on llama-lora-finetune that layout costs one more
//!   20 MiB segment than PyTorch's real one (6,192 MiB against 6,172 MiB, +0.32%). The warm
//!   replay, which starts from the real layout, equals PyTorch exactly (test above);
//! - the two policies under seven configs: where they differ (`gpualloc` never reserves
//!   more).

mod common;

use common::{all_traces, traces_dir};
use gpualloc_devices::{DeviceCore, RuleKnobs};
use gpualloc_replay::{replay, ReplayOptions, Trace};
use gpualloc_trace::Action;

/// A warm replay under the config the snapshot recorded (its `allocator_settings`; PyTorch's
/// defaults where it records none), as `gpualloc replay --warm` does: a run recorded with
/// `expandable_segments:True` placed its blocks by that config's rules, and only those rules
/// can put them at the same addresses.
fn warm_as_recorded(trace: &Trace) -> ReplayOptions {
    ReplayOptions {
        warm: true,
        config: trace.config_as_recorded(),
        ..ReplayOptions::default()
    }
}

/// Every device trace of every snapshot (`all_traces` yields one `Trace` per device), each
/// under the config it recorded.
#[test]
fn warm_replay_matches_pytorch_address_for_address() {
    for trace in all_traces() {
        let r = replay(&trace, &warm_as_recorded(&trace)).unwrap();
        let (matched, compared) = r.address_match.unwrap();
        eprintln!(
            "{}: {matched}/{compared} addresses, peak {} vs torch {:?}",
            trace.name, r.peak_reserved, r.torch.peak_reserved
        );
        // Every allocation of the trace is compared (a device of a multi-GPU run may have
        // few: qwen3's device 1 has 199).
        let allocs = trace
            .events
            .iter()
            .filter(|e| e.action == Action::Alloc && e.size > 0);
        assert_eq!(compared, allocs.count() as u64, "{}", trace.name);
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
        // A growth of an expandable segment is a `segment_map` in PyTorch's history, and one
        // device malloc (one core growth) in ours.
        let torch_growths = r.torch.segment_allocs + trace.count(Action::SegmentMap) as u64;
        assert_eq!(
            r.device_mallocs, torch_growths,
            "{}: one growth per PyTorch segment_alloc or segment_map",
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
            core_hook: Some(break_ties),
            ..warm_as_recorded(&trace)
        };
        let r = replay(&trace, &options).unwrap();
        let fraction = r.address_match_fraction().unwrap();
        eprintln!(
            "{}: broken tie-break matches {:.1}%",
            trace.name,
            fraction * 100.0
        );
        // With expandable segments (qwen3's run) a stream's blocks share one segment, so far
        // fewer requests meet a tie between equal blocks: the broken rule still misplaces
        // 6-27% of them there (device 2: 94.1% matched), against 57-73% elsewhere.
        let bound = if options.config.expandable_segments {
            0.95
        } else {
            0.9
        };
        assert!(fraction < bound, "{}: {fraction}", trace.name);
        assert!(r.first_mismatch.is_some());
        checked += 1;
    }
    if checked == 0 {
        eprintln!("skipped: no traces");
    }
}

/// Cold, under the config each snapshot recorded (qwen3's run had expandable segments; a
/// default-config replay of it answers another question): peak reserved at most PyTorch's,
/// within one 20 MiB segment, with new segments placed at the lowest free address (the
/// default) and at the highest (`top_down`, as CUDA's driver placed most of them).
///
/// One stated exception: qwen2-7b-layerwise-calib-fp16 bottom-up peaks at 5.79 GiB against
/// PyTorch's 5.40 GiB. Not for memory cached before recording began (its start holds four
/// segments and one live 196 MiB block, which the cold start has too), but for the order of
/// segment addresses: the layer's 196 MiB blocks tie in best fit, and the tie goes to the
/// lowest address; the driver gave the run its segments mostly downwards (270 of 419 steps),
/// so PyTorch reused a whole 196 MiB segment where the bottom-up replay took the half of a
/// 392 MiB one, which then could not serve the next 392 MiB request. Top-down, the cold
/// replay peaks at PyTorch's 5.40 GiB exactly.
/// A warm replay under a config with expandable segments runs to its end on every trace and
/// under both policies: each stream's two pools reserve 9/8 of the replay's 1 TiB device
/// each, as PyTorch's do, and llama7b-offload's ten streams under PyTorch's policy ran the
/// accounting backend's address window out (`address space exhausted` at event 1689 with a
/// 16 TiB window; it holds 56 such reservations now).
#[test]
fn warm_replays_with_expandable_segments_run_to_the_end() {
    use gpualloc_devices::{AllocatorConfig, Policy};
    for trace in all_traces() {
        for conf in [
            "expandable_segments:True",
            "max_split_size_mb:128,expandable_segments:True",
        ] {
            for policy in Policy::ALL {
                let options = ReplayOptions {
                    warm: true,
                    config: AllocatorConfig::parse(conf).unwrap().with_policy(policy),
                    ..ReplayOptions::default()
                };
                let r = replay(&trace, &options)
                    .unwrap_or_else(|e| panic!("{} [{conf}] {policy}: {e}", trace.name));
                assert!(r.address_match.is_some(), "{} [{conf}]", trace.name);
                assert!(
                    r.peak_reserved >= r.peak_allocated,
                    "{} [{conf}]",
                    trace.name
                );
            }
        }
    }
}

/// The floor the `gpualloc` policy reaches online: with the default config, fragmentation at
/// the peak (1 - peak allocated / peak reserved) is at most 2% on every shared trace and every
/// device of it; transformer-lm-forward-bf16 is the highest at 1.89%, one 2 MiB page (0.26%)
/// from the bound. PyTorch's default leaves 1.15% to 29.95% on the same traces.
#[test]
fn fragmentation_at_the_peak_is_at_most_two_percent_on_every_trace() {
    use gpualloc_devices::{AllocatorConfig, Policy};
    let mut checked = 0;
    for trace in all_traces() {
        let options = ReplayOptions {
            config: AllocatorConfig::default().with_policy(Policy::Gpualloc),
            ..ReplayOptions::default()
        };
        let r = replay(&trace, &options).unwrap();
        eprintln!(
            "{}: {} of {} MiB, {:.2}%",
            trace.name,
            r.peak_allocated >> 20,
            r.peak_reserved >> 20,
            r.fragmentation() * 100.0
        );
        assert!(
            r.fragmentation() <= 0.02,
            "{}: {:.2}%",
            trace.name,
            r.fragmentation() * 100.0
        );
        checked += 1;
    }
    if traces_dir().is_some() {
        assert!(
            checked >= 9,
            "seven traces, one of them on three devices: {checked}"
        );
    }
}

#[test]
fn cold_replay_peak_is_at_most_pytorchs() {
    let one_segment = 20 << 20;
    for trace in all_traces() {
        let cold = |top_down: bool| {
            let options = ReplayOptions {
                config: trace.config_as_recorded(),
                top_down,
                ..ReplayOptions::default()
            };
            replay(&trace, &options).unwrap()
        };
        let (up, down) = (cold(false), cold(true));
        let torch = up.torch.peak_reserved.unwrap();
        eprintln!(
            "{}: cold peak {} (top-down {}) vs torch {torch}, fragmentation {:.2}%",
            trace.name,
            up.peak_reserved,
            down.peak_reserved,
            up.fragmentation() * 100.0
        );
        assert!(up.events_per_second > 0.0);
        assert!(
            down.peak_reserved <= torch + one_segment,
            "{}: top-down {} > {torch} + 20 MiB",
            trace.name,
            down.peak_reserved
        );
        if trace.name.starts_with("qwen2-7b-layerwise-calib") {
            assert_eq!(down.peak_reserved, torch, "{}", trace.name);
            assert_eq!(up.peak_reserved - torch, QWEN2_BOTTOM_UP_EXCESS);
            continue;
        }
        assert!(
            up.peak_reserved <= torch + one_segment,
            "{}: {} > {torch} + 20 MiB",
            trace.name,
            up.peak_reserved
        );
    }
}

/// What bottom-up placement costs the cold replay of qwen2-7b-layerwise-calib-fp16 at its
/// peak (see `cold_replay_peak_is_at_most_pytorchs`): the one 392 MiB segment more.
const QWEN2_BOTTOM_UP_EXCESS: u64 = 392 << 20;

/// The configs every trace is replayed under: PyTorch's defaults, expandable segments off and
/// on, the oversize rule alone and with them, power-of-two rounding, and garbage collection
/// under a fraction cap (that one with a device capacity, below).
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
/// remainders, and the large pool's 2 MiB pages), and there the `gpualloc` policy reserves at
/// most PyTorch's at its peak, on every trace and config. Growths are the core's
/// `segment_map`s (for PyTorch's ordinary segments, its segment mallocs); driver maps are the
/// backend's `map` calls (one per physical handle). Where the `gpualloc` policy maps pages,
/// its driver calls stay within what its first pass may spend for the memory it saves: at
/// most 4x the maps PyTorch makes with `expandable_segments:True` (and the rest of the config
/// as it is), and at most 4x PyTorch's growths under the same config
/// (transformer-lm-forward-bf16: 141 maps against 42, 3.4x; 324 before the pages ahead shared
/// handles).
///
/// Two exceptions were listed here before and are gone: llama7b-offload-10streams with
/// garbage collection and a fraction cap (garbage collection, PyTorch's rule, reclaims nothing
/// from expandable segments: +1.16 GB before loans, +0.87 GB after; the release before a
/// growth after the job's own `empty_cache` took it under PyTorch's, 19,950 against 20,018
/// MiB), and qwen3-gcn-3gpu device 2 with `max_split_size_mb:128` (the default expandable
/// segments against PyTorch's ordinary ones under the oversize rule: +190 MiB before the page
/// move before a growth, +30 MiB after it; under it, 20,618 against 20,680 MiB, since a
/// growth's handles end where its request ends and the move can unmap the free pages that
/// shared a handle with live blocks).
#[test]
fn policies_differ_only_where_a_deviation_applies() {
    use gpualloc_devices::{AllocatorConfig, Policy};
    let mut differing = Vec::new();
    for trace in all_traces() {
        for conf in CONFIGS {
            let run_under = |conf: &str, policy: Policy| {
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
            let run = |policy: Policy| run_under(conf, policy);
            let (torch, ours) = (run(Policy::Pytorch), run(Policy::Gpualloc));
            if ours.3 > 0 {
                // The driver-call allowance: at most 4x PyTorch's maps with expandable
                // segments (the rest of the config as it is), and 4x its growths.
                let twin = match conf {
                    c if c.contains("expandable_segments:True") => c.to_string(),
                    "" => "expandable_segments:True".to_string(),
                    c => format!("{c},expandable_segments:True"),
                };
                let torch_maps = if twin == conf {
                    torch.3
                } else {
                    run_under(&twin, Policy::Pytorch).3
                };
                assert!(
                    ours.3 <= 4 * torch_maps && ours.1 <= 4 * torch.1,
                    "{} [{conf}]: driver maps {} against PyTorch's {torch_maps} [{twin}], growths {} against {}",
                    trace.name,
                    ours.3,
                    ours.1,
                    torch.1
                );
            }
            eprintln!(
                "{} [{conf}]: pytorch {torch:?}, gpualloc {ours:?}",
                trace.name
            );
            if torch != ours {
                // With ordinary segments only loans apply, on traces of several streams.
                assert!(
                    !conf.contains("expandable_segments:False") || streams_of(&trace) > 1,
                    "{} [{conf}]: the policies differ where no deviation applies",
                    trace.name
                );
                assert!(
                    ours.0 <= torch.0,
                    "{} [{conf}]: {torch:?} vs {ours:?}",
                    trace.name
                );
                differing.push((trace.name.clone(), conf, torch, ours));
            }
        }
    }
    if differing.is_empty() && traces_dir().is_none() {
        return;
    }
    // The figures of the deviations table (README, devices/src/config/policy.rs).
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
            "cnn-counterfactual-small.pickle []: 128 / 104 MiB, growths 10 / 16, driver maps 0 / 35",
            "cnn-counterfactual-small.pickle [expandable_segments:True]: 108 / 104 MiB, growths 9 / 16, driver maps 9 / 35",
            "cnn-counterfactual-small.pickle [max_split_size_mb:128]: 128 / 104 MiB, growths 10 / 16, driver maps 0 / 35",
            "cnn-counterfactual-small.pickle [max_split_size_mb:128,expandable_segments:True]: 108 / 104 MiB, growths 9 / 16, driver maps 9 / 35",
            "cnn-counterfactual-small.pickle [roundup_power2_divisions:4]: 138 / 122 MiB, growths 11 / 18, driver maps 0 / 27",
            "cnn-counterfactual-small.pickle [garbage_collection_threshold:0.8,per_process_memory_fraction:0.9]: 128 / 104 MiB, growths 10 / 16, driver maps 0 / 35",
            "llama-lora-finetune.pickle []: 6192 / 5630 MiB, growths 230 / 251, driver maps 0 / 644",
            "llama-lora-finetune.pickle [expandable_segments:True]: 5642 / 5630 MiB, growths 207 / 251, driver maps 328 / 644",
            "llama-lora-finetune.pickle [max_split_size_mb:128]: 6192 / 5630 MiB, growths 230 / 251, driver maps 0 / 644",
            "llama-lora-finetune.pickle [max_split_size_mb:128,expandable_segments:True]: 5882 / 5630 MiB, growths 209 / 251, driver maps 340 / 644",
            "llama-lora-finetune.pickle [roundup_power2_divisions:4]: 6034 / 5982 MiB, growths 213 / 321, driver maps 0 / 676",
            "llama-lora-finetune.pickle [garbage_collection_threshold:0.8,per_process_memory_fraction:0.9]: 6024 / 5630 MiB, growths 230 / 251, driver maps 0 / 644",
            "llama7b-offload-10streams.pickle []: 21476 / 19878 MiB, growths 728 / 750, driver maps 0 / 10581",
            "llama7b-offload-10streams.pickle [expandable_segments:False]: 21476 / 21220 MiB, growths 728 / 564, driver maps 0 / 0",
            "llama7b-offload-10streams.pickle [expandable_segments:True]: 21124 / 19878 MiB, growths 752 / 750, driver maps 8042 / 10581",
            "llama7b-offload-10streams.pickle [max_split_size_mb:128]: 23492 / 19878 MiB, growths 913 / 750, driver maps 0 / 10581",
            "llama7b-offload-10streams.pickle [max_split_size_mb:128,expandable_segments:True]: 35272 / 19878 MiB, growths 902 / 750, driver maps 11828 / 10581",
            "llama7b-offload-10streams.pickle [roundup_power2_divisions:4]: 22728 / 20978 MiB, growths 729 / 708, driver maps 0 / 9482",
            "llama7b-offload-10streams.pickle [garbage_collection_threshold:0.8,per_process_memory_fraction:0.9]: 20018 / 19878 MiB, growths 806 / 750, driver maps 0 / 10581",
            "qwen2-7b-layerwise-calib-fp16.pickle []: 5926 / 4182 MiB, growths 479 / 647, driver maps 0 / 9809",
            "qwen2-7b-layerwise-calib-fp16.pickle [expandable_segments:True]: 4404 / 4182 MiB, growths 449 / 647, driver maps 5811 / 9809",
            "qwen2-7b-layerwise-calib-fp16.pickle [max_split_size_mb:128]: 6080 / 4182 MiB, growths 591 / 647, driver maps 0 / 9809",
            "qwen2-7b-layerwise-calib-fp16.pickle [max_split_size_mb:128,expandable_segments:True]: 17304 / 4182 MiB, growths 1456 / 647, driver maps 17760 / 9809",
            "qwen2-7b-layerwise-calib-fp16.pickle [roundup_power2_divisions:4]: 7098 / 5088 MiB, growths 507 / 672, driver maps 0 / 11775",
            "qwen2-7b-layerwise-calib-fp16.pickle [garbage_collection_threshold:0.8,per_process_memory_fraction:0.9]: 5142 / 4182 MiB, growths 479 / 647, driver maps 0 / 9809",
            "qwen3-gcn-3gpu-expandable-oom.pickle[device 0] []: 8824 / 8114 MiB, growths 204 / 303, driver maps 0 / 890",
            "qwen3-gcn-3gpu-expandable-oom.pickle[device 0] [expandable_segments:True]: 8146 / 8114 MiB, growths 175 / 303, driver maps 410 / 890",
            "qwen3-gcn-3gpu-expandable-oom.pickle[device 0] [max_split_size_mb:128]: 9412 / 8114 MiB, growths 231 / 303, driver maps 0 / 890",
            "qwen3-gcn-3gpu-expandable-oom.pickle[device 0] [max_split_size_mb:128,expandable_segments:True]: 10726 / 8114 MiB, growths 225 / 303, driver maps 539 / 890",
            "qwen3-gcn-3gpu-expandable-oom.pickle[device 0] [roundup_power2_divisions:4]: 9016 / 8366 MiB, growths 205 / 223, driver maps 0 / 916",
            "qwen3-gcn-3gpu-expandable-oom.pickle[device 0] [garbage_collection_threshold:0.8,per_process_memory_fraction:0.9]: 8212 / 8114 MiB, growths 204 / 303, driver maps 0 / 890",
            "qwen3-gcn-3gpu-expandable-oom.pickle[device 1] []: 85370 / 80228 MiB, growths 40 / 53, driver maps 0 / 4729",
            "qwen3-gcn-3gpu-expandable-oom.pickle[device 1] [expandable_segments:True]: 80302 / 80228 MiB, growths 40 / 53, driver maps 4205 / 4729",
            "qwen3-gcn-3gpu-expandable-oom.pickle[device 1] [max_split_size_mb:128]: 81364 / 80228 MiB, growths 59 / 53, driver maps 0 / 4729",
            "qwen3-gcn-3gpu-expandable-oom.pickle[device 1] [max_split_size_mb:128,expandable_segments:True]: 103202 / 80228 MiB, growths 61 / 53, driver maps 5414 / 4729",
            "qwen3-gcn-3gpu-expandable-oom.pickle[device 1] [roundup_power2_divisions:4]: 86306 / 81140 MiB, growths 39 / 54, driver maps 0 / 4778",
            "qwen3-gcn-3gpu-expandable-oom.pickle[device 1] [garbage_collection_threshold:0.8,per_process_memory_fraction:0.9]: 85370 / 80228 MiB, growths 40 / 53, driver maps 0 / 4729",
            "qwen3-gcn-3gpu-expandable-oom.pickle[device 2] []: 21406 / 20622 MiB, growths 78 / 110, driver maps 0 / 1433",
            "qwen3-gcn-3gpu-expandable-oom.pickle[device 2] [expandable_segments:True]: 20870 / 20622 MiB, growths 78 / 110, driver maps 1048 / 1433",
            "qwen3-gcn-3gpu-expandable-oom.pickle[device 2] [max_split_size_mb:128]: 20680 / 20622 MiB, growths 100 / 110, driver maps 0 / 1433",
            "qwen3-gcn-3gpu-expandable-oom.pickle[device 2] [max_split_size_mb:128,expandable_segments:True]: 28250 / 20622 MiB, growths 118 / 110, driver maps 1417 / 1433",
            "qwen3-gcn-3gpu-expandable-oom.pickle[device 2] [roundup_power2_divisions:4]: 24920 / 24354 MiB, growths 68 / 110, driver maps 0 / 1610",
            "qwen3-gcn-3gpu-expandable-oom.pickle[device 2] [garbage_collection_threshold:0.8,per_process_memory_fraction:0.9]: 21386 / 20622 MiB, growths 80 / 110, driver maps 0 / 1433",
            "transformer-lm-forward-bf16.pickle []: 822 / 758 MiB, growths 43 / 43, driver maps 0 / 141",
            "transformer-lm-forward-bf16.pickle [expandable_segments:True]: 786 / 758 MiB, growths 41 / 43, driver maps 42 / 141",
            "transformer-lm-forward-bf16.pickle [max_split_size_mb:128]: 822 / 758 MiB, growths 43 / 43, driver maps 0 / 141",
            "transformer-lm-forward-bf16.pickle [max_split_size_mb:128,expandable_segments:True]: 786 / 758 MiB, growths 41 / 43, driver maps 42 / 141",
            "transformer-lm-forward-bf16.pickle [roundup_power2_divisions:4]: 866 / 852 MiB, growths 64 / 46, driver maps 0 / 146",
            "transformer-lm-forward-bf16.pickle [garbage_collection_threshold:0.8,per_process_memory_fraction:0.9]: 822 / 758 MiB, growths 43 / 43, driver maps 0 / 141",
            "transformer-lm-train.pickle []: 13436 / 13280 MiB, growths 240 / 267, driver maps 0 / 1103",
            "transformer-lm-train.pickle [expandable_segments:True]: 13296 / 13280 MiB, growths 248 / 267, driver maps 672 / 1103",
            "transformer-lm-train.pickle [max_split_size_mb:128]: 13730 / 13280 MiB, growths 245 / 267, driver maps 0 / 1103",
            "transformer-lm-train.pickle [max_split_size_mb:128,expandable_segments:True]: 13576 / 13280 MiB, growths 251 / 267, driver maps 686 / 1103",
            "transformer-lm-train.pickle [roundup_power2_divisions:4]: 13468 / 13436 MiB, growths 277 / 252, driver maps 0 / 1268",
            "transformer-lm-train.pickle [garbage_collection_threshold:0.8,per_process_memory_fraction:0.9]: 13412 / 13280 MiB, growths 239 / 267, driver maps 0 / 1103",
        ]
    );
}

/// How many streams the trace allocates on.
fn streams_of(trace: &Trace) -> usize {
    let streams: std::collections::BTreeSet<u64> = trace
        .events
        .iter()
        .filter(|e| e.action == Action::Alloc)
        .map(|e| e.stream)
        .collect();
    streams.len()
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
        let warm = replay(&trace, &warm_as_recorded(&trace)).unwrap();
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
