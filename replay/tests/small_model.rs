//! A small model's inference, generated (one under 100 MiB): a
//! MiniLM-L6-like sentence encoder in fp16 (6 layers, hidden 384, 12 heads, FFN 1536, a
//! 30,522-token embedding; 43 MiB of weights) serving 200 batches of 1–32 sequences of 16–128
//! tokens, one stream. Each layer allocates and frees what its eager forward pass would: q, k, v,
//! attention scores and probabilities, context, output projection, residual, the FFN's two
//! activations. The weights are allocated first and kept, as a server loads its model once.
//!
//! The test replays it under both policies and pins the figures BENCHMARKS.md quotes, and writes
//! the trace as JSON Lines to `<target>/tmp/minilm-inference.jsonl` for `gpualloc replay`.

use gpualloc_devices::{AllocatorConfig, Policy};
use gpualloc_replay::{replay, replay_core, ReplayOptions, Trace};
use gpualloc_trace::{Action, TraceEntry};

const HIDDEN: u64 = 384;
const FFN: u64 = 1536;
const LAYERS: usize = 6;
const VOCAB: u64 = 30_522;
const HEADS: u64 = 12;
const HALF: u64 = 2;

/// Allocation addresses and the events that use them.
struct Recorder {
    next: u64,
    events: Vec<TraceEntry>,
}

impl Recorder {
    fn alloc(&mut self, size: u64) -> (u64, u64) {
        let addr = self.next;
        self.next += size.next_multiple_of(512) + 4096;
        self.events
            .push(TraceEntry::new(Action::Alloc, addr, size, 0));
        (addr, size)
    }

    fn free(&mut self, (addr, size): (u64, u64)) {
        for action in [Action::FreeRequested, Action::FreeCompleted] {
            self.events.push(TraceEntry::new(action, addr, size, 0));
        }
    }
}

/// The generated trace (deterministic: a fixed linear congruential sequence picks the batches).
fn minilm_inference() -> Trace {
    let mut r = Recorder {
        next: 0x7f00_0000_0000,
        events: Vec::new(),
    };
    let mut weights = vec![r.alloc(VOCAB * HIDDEN * HALF), r.alloc(512 * HIDDEN * HALF)];
    for _ in 0..LAYERS {
        for _ in 0..4 {
            weights.push(r.alloc(HIDDEN * HIDDEN * HALF));
            weights.push(r.alloc(HIDDEN * HALF));
        }
        for size in [
            HIDDEN * FFN,
            FFN,
            FFN * HIDDEN,
            HIDDEN,
            2 * HIDDEN,
            2 * HIDDEN,
        ] {
            weights.push(r.alloc(size * HALF));
        }
    }
    let mut x: u64 = 7;
    let mut pick = |n: u64| {
        x = x
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (x >> 33) % n
    };
    for _ in 0..200 {
        let batch = [1, 4, 8, 16, 32][pick(5) as usize];
        let seq = [16, 32, 64, 128][pick(4) as usize];
        let tokens = batch * seq;
        let act = tokens * HIDDEN * HALF;
        let scores = batch * HEADS * seq * seq * HALF;
        let ids = r.alloc(tokens * 8);
        let mask = r.alloc(tokens * 8);
        let mut h = r.alloc(act);
        r.free(ids);
        for _ in 0..LAYERS {
            let (q, k, v) = (r.alloc(act), r.alloc(act), r.alloc(act));
            let s = r.alloc(scores);
            let p = r.alloc(scores);
            r.free(s);
            let ctx = r.alloc(act);
            for t in [p, q, k, v] {
                r.free(t);
            }
            let out = r.alloc(act);
            r.free(ctx);
            let h1 = r.alloc(act);
            r.free(out);
            r.free(h);
            let f1 = r.alloc(tokens * FFN * HALF);
            let g = r.alloc(tokens * FFN * HALF);
            r.free(f1);
            let f2 = r.alloc(act);
            r.free(g);
            h = r.alloc(act);
            r.free(f2);
            r.free(h1);
        }
        let pooled = r.alloc(batch * HIDDEN * 4);
        for t in [h, mask, pooled] {
            r.free(t);
        }
    }
    drop(weights);
    Trace {
        name: "minilm-inference (generated)".into(),
        device: 0,
        events: r.events,
        final_segments: None,
        recorded_config: None,
        pools: Vec::new(),
    }
}

#[test]
fn a_small_models_inference_under_both_policies() {
    let trace = minilm_inference();
    let path = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("minilm-inference.jsonl");
    std::fs::write(&path, gpualloc_trace::jsonl::write(&trace.events)).unwrap();
    println!("wrote {}", path.display());

    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    let mut figures = Vec::new();
    for conf in ["", "expandable_segments:True"] {
        for policy in Policy::ALL {
            let options = ReplayOptions {
                config: AllocatorConfig::parse(conf).unwrap().with_policy(policy),
                ..ReplayOptions::default()
            };
            let r = replay(&trace, &options).unwrap();
            assert_eq!(r.warnings, 0);
            assert!(r.peak_allocated < 100 << 20, "a workload under 100 MiB");
            println!(
                "[{conf}] {policy}: peak reserved {:.1} MiB, allocated {:.1} MiB, fragmentation {:.2}%, maps {}",
                mib(r.peak_reserved),
                mib(r.peak_allocated),
                r.fragmentation() * 100.0,
                r.device_mallocs
            );
            figures.push((
                conf,
                policy,
                r.peak_reserved >> 20,
                (r.fragmentation() * 10_000.0).round() as u64,
            ));
        }
    }
    // (config, policy, peak reserved MiB, fragmentation in hundredths of a percent). With
    // expandable segments the gpualloc policy's 2 MiB large-pool pages (`map_ahead.rs`) leave
    // at most half of PyTorch's fragmentation (20 MiB pages), the point of the small pages; with the
    // default config the gpualloc policy runs expandable segments (the accounting backend has
    // virtual memory): at most half of PyTorch's ordinary segments' too.
    assert_eq!(
        figures,
        [
            ("", Policy::Pytorch, 102, 2196),
            ("", Policy::Gpualloc, 80, 116),
            ("expandable_segments:True", Policy::Pytorch, 92, 1405),
            ("expandable_segments:True", Policy::Gpualloc, 80, 116),
        ]
    );
    assert!(
        2 * figures[3].3 <= figures[2].3 && 2 * figures[1].3 <= figures[0].3,
        "at most half: {figures:?}"
    );
}

#[test]
fn the_waste_at_the_peak_accounts_for_every_reserved_byte() {
    let trace = minilm_inference();
    for config in [
        AllocatorConfig::default(),
        AllocatorConfig::parse("expandable_segments:False").unwrap(),
    ] {
        let options = ReplayOptions {
            config: config.clone(),
            waste_at_peak: true,
            ..ReplayOptions::default()
        };
        let (report, _) = replay_core(&trace, &options).unwrap();
        let w = report.waste.clone().expect("measured");
        assert_eq!(w.reserved, report.peak_reserved, "{config}");
        assert_eq!(w.free(), w.reserved - w.active, "{config}");
        assert!(
            w.free_holes <= w.free() && w.requested <= w.active,
            "{config}"
        );
        assert!(w.event < trace.events.len() as u64);
        let json = report.to_json(false);
        assert_eq!(json["waste_at_peak"]["reserved_bytes"], w.reserved);
        // Off by default: the JSON stays as it was.
        let (plain, _) = replay_core(
            &trace,
            &ReplayOptions {
                config,
                ..ReplayOptions::default()
            },
        )
        .unwrap();
        assert!(plain.waste.is_none() && plain.to_json(false).get("waste_at_peak").is_none());
    }
}
