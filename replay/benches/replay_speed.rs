//! Replay speed: trace events per second through the device core on the accounting backend,
//! on the real snapshots in ../shared/traces (skipped when absent) and on a synthetic trace;
//! loading (bytes to traces) alone; and end to end (load + replay), which is what a user
//! waits for.

// criterion's macros generate undocumented functions.
#![allow(missing_docs)]

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use gpualloc_replay::input::from_bytes;
use gpualloc_replay::{replay, ReplayOptions, Trace};

/// The inputs: each real snapshot's bytes, and a synthetic JSON Lines trace.
fn inputs() -> Vec<(String, Vec<u8>)> {
    let dir = std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../../shared/traces"));
    let mut out = Vec::new();
    if let Ok(entries) = std::fs::read_dir(dir) {
        let mut files: Vec<_> = entries
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|x| x == "pickle"))
            .collect();
        files.sort();
        for f in files {
            let name = f.file_name().unwrap().to_string_lossy().into_owned();
            out.push((name, std::fs::read(&f).expect("trace")));
        }
    }
    let mut text = String::new();
    for i in 0..100_000u64 {
        let addr = 0x1000_0000 + (i % 64) * 0x100_0000;
        let size = 4096 + (i * 7919 % 64) * 65_536;
        text += &format!("{{\"action\":\"alloc\",\"addr\":{addr},\"size\":{size},\"stream\":1}}\n");
        text += &format!(
            "{{\"action\":\"free_requested\",\"addr\":{addr},\"size\":{size},\"stream\":1}}\n"
        );
    }
    out.push(("synthetic.jsonl".to_string(), text.into_bytes()));
    out
}

fn traces() -> Vec<Trace> {
    inputs()
        .iter()
        .flat_map(|(name, bytes)| from_bytes(name, bytes).expect("trace"))
        .collect()
}

fn replay_speed(c: &mut Criterion) {
    let mut group = c.benchmark_group("replay");
    for trace in traces() {
        group.throughput(Throughput::Elements(trace.events.len() as u64));
        group.bench_function(trace.name.clone(), |b| {
            b.iter(|| replay(&trace, &ReplayOptions::default()).expect("replay"))
        });
    }
    group.finish();
}

/// Loading alone, and load + replay, in events per second.
fn load_speed(c: &mut Criterion) {
    let mut load = c.benchmark_group("load");
    let inputs = inputs();
    let events = |name: &str, bytes: &[u8]| -> u64 {
        let traces = from_bytes(name, bytes).expect("trace");
        traces.iter().map(|t| t.events.len() as u64).sum()
    };
    for (name, bytes) in &inputs {
        load.throughput(Throughput::Elements(events(name, bytes)));
        load.bench_function(name.clone(), |b| {
            b.iter(|| from_bytes(name, bytes).expect("trace"))
        });
    }
    load.finish();
    let mut both = c.benchmark_group("load_and_replay");
    for (name, bytes) in &inputs {
        both.throughput(Throughput::Elements(events(name, bytes)));
        both.bench_function(name.clone(), |b| {
            b.iter(|| {
                for trace in from_bytes(name, bytes).expect("trace") {
                    replay(&trace, &ReplayOptions::default()).expect("replay");
                }
            })
        });
    }
    both.finish();
}

criterion_group!(benches, replay_speed, load_speed);
criterion_main!(benches);
