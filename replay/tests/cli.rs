//! The `gpualloc` command line: replay with several configs, JSON output, the SVG plot, the
//! memory summary, and typed failures.

use std::process::Command;

fn gpualloc(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_gpualloc"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn jsonl_trace(dir: &std::path::Path) -> std::path::PathBuf {
    let mut text = String::new();
    // 40 layers of 3 MiB allocations freed in reverse, twice.
    for round in 0..2u64 {
        for i in 0..40u64 {
            let addr = 0x1000_0000 + round * 0x1_0000_0000 + i * 0x40_0000;
            text += &format!(
                "{{\"action\":\"alloc\",\"addr\":{addr},\"size\":{},\"stream\":7}}\n",
                3 << 20
            );
        }
        for i in (0..40u64).rev() {
            let addr = 0x1000_0000 + round * 0x1_0000_0000 + i * 0x40_0000;
            text += &format!(
                "{{\"action\":\"free_requested\",\"addr\":{addr},\"size\":{},\"stream\":7}}\n",
                3 << 20
            );
        }
    }
    let path = dir.join("layers.jsonl");
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn replay_compares_configs_and_writes_json_and_a_plot() {
    let dir = std::env::temp_dir().join(format!("gpualloc-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let trace = jsonl_trace(&dir);
    let plot = dir.join("mem.svg");
    let (ok, stdout, stderr) = gpualloc(&[
        "replay",
        trace.to_str().unwrap(),
        "--config",
        "",
        "--config",
        "expandable_segments:True",
        "--json",
        "--plot",
        plot.to_str().unwrap(),
    ]);
    assert!(ok, "{stderr}");
    let rows: Vec<serde_json::Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 2);
    for key in [
        "peak_reserved_bytes",
        "peak_allocated_bytes",
        "fragmentation",
        "device_mallocs",
        "torch_peak_reserved_bytes",
        "events_per_second",
    ] {
        assert!(rows[0].get(key).is_some(), "missing {key}");
    }
    assert!(
        rows[0]["torch_peak_reserved_bytes"].is_null(),
        "a JSON Lines trace does not tell"
    );
    assert_eq!(rows[0]["peak_allocated_bytes"], 120u64 << 20);
    // Default: 40 × 3 MiB in 20 MiB segments of six blocks each = 7 segments = 140 MiB.
    assert_eq!(rows[0]["peak_reserved_bytes"], 140u64 << 20);
    assert_eq!(
        rows[1]["peak_reserved_bytes"],
        120u64 << 20,
        "expandable: six 20 MiB pages"
    );
    let svg = std::fs::read_to_string(&plot).unwrap();
    assert!(svg.starts_with("<svg") && svg.matches("<polyline").count() == 4);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn bad_arguments_and_files_fail_cleanly() {
    let (ok, _, stderr) = gpualloc(&["replay", "/nonexistent/trace.pickle"]);
    assert!(!ok);
    assert!(stderr.contains("cannot read"), "{stderr}");
    let dir = std::env::temp_dir().join(format!("gpualloc-cli-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let trace = jsonl_trace(&dir);
    let (ok, _, stderr) = gpualloc(&[
        "replay",
        trace.to_str().unwrap(),
        "--config",
        "max_split_size:1",
    ]);
    assert!(!ok);
    assert!(
        stderr.contains("unknown allocator config key `max_split_size`"),
        "{stderr}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn summary_of_a_real_snapshot() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../shared/traces/transformer-lm-forward-bf16.pickle"
    );
    if !std::path::Path::new(path).exists() {
        eprintln!("skipped: {path} is absent");
        return;
    }
    let (ok, stdout, stderr) = gpualloc(&["summary", path]);
    assert!(ok, "{stderr}");
    let reserved = stdout
        .lines()
        .find(|l| l.starts_with("| GPU reserved memory"))
        .unwrap();
    assert!(reserved.contains("822 MiB"), "{reserved}");
    let segs = stdout
        .lines()
        .find(|l| l.starts_with("| GPU reserved segments"))
        .unwrap();
    assert!(segs.contains("|     43     |"), "{segs}");
}
