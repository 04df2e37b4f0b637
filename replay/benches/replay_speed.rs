//! Replay speed: trace events per second through the device core on the accounting backend,
//! on the real snapshots in ../shared/traces (skipped when absent) and on a synthetic trace.

// criterion's macros generate undocumented functions.
#![allow(missing_docs)]

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use gpualloc_replay::input::from_bytes;
use gpualloc_replay::{load, replay, ReplayOptions, Trace};

fn traces() -> Vec<Trace> {
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
            out.extend(load(&f).expect("trace"));
        }
    }
    let mut text = String::new();
    for i in 0..50_000u64 {
        let addr = 0x1000_0000 + (i % 64) * 0x100_0000;
        let size = 4096 + (i * 7919 % 64) * 65_536;
        text += &format!("{{\"action\":\"alloc\",\"addr\":{addr},\"size\":{size},\"stream\":1}}\n");
        text += &format!(
            "{{\"action\":\"free_requested\",\"addr\":{addr},\"size\":{size},\"stream\":1}}\n"
        );
    }
    out.extend(from_bytes("synthetic.jsonl", text.as_bytes()).expect("synthetic"));
    out
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

criterion_group!(benches, replay_speed);
criterion_main!(benches);
