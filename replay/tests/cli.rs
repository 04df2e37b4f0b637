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
        "peak_requested_bytes",
        "fragmentation",
        "device_mallocs",
        "torch_peak_reserved_bytes",
        "policy",
    ] {
        assert!(rows[0].get(key).is_some(), "missing {key}");
    }
    assert_eq!(rows[0]["peak_requested_bytes"], 120u64 << 20);
    // Run-to-run noise only when asked for: two runs print the same bytes.
    assert!(rows[0].get("events_per_second").is_none());
    let again = gpualloc(&["replay", trace.to_str().unwrap(), "--json"]);
    let once = gpualloc(&["replay", trace.to_str().unwrap(), "--json"]);
    assert_eq!(again.1, once.1);
    let timed = gpualloc(&["replay", trace.to_str().unwrap(), "--json", "--timing"]);
    let timed: serde_json::Value = serde_json::from_str(timed.1.trim()).unwrap();
    assert!(timed["events_per_second"].as_f64().unwrap() > 0.0);
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
    // The picture: one panel with labelled axes, a legend naming each replay and its peak.
    let svg = std::fs::read_to_string(&plot).unwrap();
    assert!(svg.starts_with("<svg"), "{}", &svg[..100]);
    for text in [
        "layers.jsonl",
        "memory (MiB)",
        "event",
        "default · pytorch: reserved (peak 1: 140.00 MiB)",
        "expandable_segments:True · pytorch: reserved (peak 2: 120.00 MiB)",
        "default · pytorch: allocated",
    ] {
        assert!(svg.contains(text), "the plot lacks {text:?}");
    }
    assert!(
        !svg.contains("PyTorch reserved"),
        "a JSON Lines trace has no recorded reserved memory to show"
    );
    // PNG too; any other extension is refused before the replay runs.
    let png = dir.join("mem.png");
    let (ok, _, stderr) = gpualloc(&[
        "replay",
        trace.to_str().unwrap(),
        "--plot",
        png.to_str().unwrap(),
    ]);
    assert!(ok, "{stderr}");
    let bytes = std::fs::read(&png).unwrap();
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
    assert_eq!(
        u32::from_be_bytes(bytes[16..20].try_into().unwrap()),
        1280,
        "width"
    );
    let (ok, stdout, stderr) = gpualloc(&["replay", trace.to_str().unwrap(), "--plot", "mem.jpg"]);
    assert!(!ok);
    assert!(stdout.is_empty(), "refused before replaying");
    assert!(
        stderr.contains("a plot is written as .svg or .png"),
        "{stderr}"
    );
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
    // Warm JSON carries the counts behind the fraction.
    let (ok, stdout, stderr) = gpualloc(&["replay", path, "--warm", "--json"]);
    assert!(ok, "{stderr}");
    let row: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(row["addresses_matched"], 937);
    assert_eq!(row["addresses_compared"], 937);
    assert_eq!(row["address_match_fraction"], 1.0);
    assert_eq!(
        row["peak_requested_bytes"],
        row["torch_peak_requested_bytes"]
    );
}

/// An 80 MiB buffer freed with a 2 MiB one live after it, then a 40 MiB request: the rule
/// where the two policies differ under `max_split_size_mb:64,expandable_segments:True`.
fn max_split_trace(dir: &std::path::Path) -> std::path::PathBuf {
    let event = |action: &str, addr: u64, mib: u64| {
        format!(
            "{{\"action\":\"{action}\",\"addr\":{addr},\"size\":{},\"stream\":0}}\n",
            mib << 20
        )
    };
    let text = [
        event("alloc", 0x1000_0000, 80),
        event("alloc", 0x2000_0000, 2),
        event("free_requested", 0x1000_0000, 80),
        event("alloc", 0x3000_0000, 40),
    ]
    .concat();
    let path = dir.join("max_split.jsonl");
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn the_policy_is_pytorch_unless_asked_and_both_shows_the_difference() {
    let dir = std::env::temp_dir().join(format!("gpualloc-cli-policy-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let trace = max_split_trace(&dir);
    let trace = trace.to_str().unwrap();
    let config = "max_split_size_mb:64,expandable_segments:True";
    let rows = |args: &[&str]| -> Vec<serde_json::Value> {
        let (ok, stdout, stderr) = gpualloc(args);
        assert!(ok, "{stderr}");
        stdout
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    };
    // Default: PyTorch's rules, which refuse the oversize expandable block (80 + 20 + 40 MiB).
    let torch = rows(&["replay", trace, "--config", config, "--json"]);
    assert_eq!(torch.len(), 1);
    assert_eq!(torch[0]["policy"], "pytorch");
    assert_eq!(torch[0]["config"], config);
    assert_eq!(torch[0]["peak_reserved_bytes"], 140u64 << 20);
    let ours = rows(&[
        "replay", trace, "--config", config, "--policy", "gpualloc", "--json",
    ]);
    assert_eq!(ours[0]["policy"], "gpualloc");
    // Its own rule splits the block; its 2 MiB pages map 10 MiB for the kept 2 MiB (80 + 10).
    assert_eq!(ours[0]["peak_reserved_bytes"], 90u64 << 20);
    assert!(
        ours[0].get("vs_pytorch").is_none(),
        "no pytorch row to compare with"
    );
    let both = rows(&[
        "replay", trace, "--config", config, "--policy", "both", "--json",
    ]);
    assert_eq!(both.len(), 2);
    assert_eq!(
        (&both[0]["policy"], &both[1]["policy"]),
        (&"pytorch".into(), &"gpualloc".into())
    );
    assert_eq!(both[1]["vs_pytorch"]["peak_reserved_bytes"], -(50i64 << 20));
    assert_eq!(
        both[1]["vs_pytorch"]["device_mallocs"],
        both[1]["device_mallocs"].as_i64().unwrap() - both[0]["device_mallocs"].as_i64().unwrap()
    );
    // The table says it too, in a row of its own under the pair.
    let (ok, table, stderr) = gpualloc(&["replay", trace, "--config", config, "--policy", "both"]);
    assert!(ok, "{stderr}");
    let lines: Vec<&str> = table.lines().collect();
    assert!(lines[0].contains("policy"), "{table}");
    assert!(
        lines[1].contains(" pytorch ") && lines[2].contains(" gpualloc "),
        "{table}"
    );
    assert!(
        lines[3].contains("gpualloc - pytorch: peak resv -50.00 MiB (-35.7%)"),
        "{table}"
    );
    // `default` names the default config, as the table labels it.
    let default = rows(&["replay", trace, "--config", "default", "--json"]);
    assert_eq!(default[0]["config"], "");
    // The policy is --policy's to set, never a --config key.
    let (ok, _, stderr) = gpualloc(&["replay", trace, "--config", "policy:gpualloc"]);
    assert!(!ok);
    assert!(stderr.contains("set the policy with --policy"), "{stderr}");
    std::fs::remove_dir_all(&dir).ok();
}

/// `pickle.dumps({'segments': [], 'device_traces': [[]]}, protocol=0)`: nothing recorded.
const NO_EVENTS: &str = "(dp0\nVsegments\np1\n(lp2\nsVdevice_traces\np3\n(lp4\n(lp5\nas.";
/// The same with two allocs at one address and one free, and no segments anywhere (what a
/// CPU profiler's recording looks like).
const NO_SEGMENTS: &str = "(dp0\nVsegments\np1\n(lp2\nsVdevice_traces\np3\n(lp4\n(lp5\n(dp6\nVaction\np7\nValloc\np8\nsVaddr\np9\nI4096\nsVsize\np10\nI512\nsVstream\np11\nI0\nsa(dp12\ng7\ng8\nsg9\nI4096\nsg10\nI512\nsg11\nI0\nsa(dp13\ng7\nVfree_requested\np14\nsg9\nI4096\nsg10\nI512\nsg11\nI0\nsaas.";

#[test]
fn each_file_is_reported_on_its_own_and_failures_say_why() {
    let dir = std::env::temp_dir().join(format!("gpualloc-cli-files-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let good = jsonl_trace(&dir);
    let bad = dir.join("bad.jsonl");
    std::fs::write(&bad, "{\"action\":\"alloc\"\n").unwrap();
    let empty = dir.join("empty.pickle");
    std::fs::write(&empty, NO_EVENTS).unwrap();
    let cpu = dir.join("cpu.pickle");
    std::fs::write(&cpu, NO_SEGMENTS).unwrap();
    let path = |p: &std::path::Path| p.to_str().unwrap().to_string();

    // A bad file and an empty one among good ones: the good ones are reported, each failure
    // is named, and the exit status says something failed.
    let (ok, stdout, stderr) =
        gpualloc(&["replay", &path(&bad), &path(&good), &path(&empty), "--json"]);
    assert!(!ok, "a failed file fails the run");
    assert_eq!(
        stdout.lines().count(),
        1,
        "the good file is reported: {stdout}"
    );
    assert!(stderr.contains("bad.jsonl: JSON Lines line 1"), "{stderr}");
    assert!(
        stderr.contains("empty.pickle: no events on any device"),
        "{stderr}"
    );
    assert!(stderr.contains("2 files or replays failed"), "{stderr}");

    // Warm replay of a snapshot that records no segments: the same refusal as for a log.
    for file in [&cpu, &good] {
        let (ok, _, stderr) = gpualloc(&["replay", &path(file), "--warm"]);
        assert!(!ok);
        assert!(
            stderr.contains("warm replay needs a snapshot with segments"),
            "{stderr}"
        );
    }
    // Cold, the same snapshot replays; its second alloc at a live address is a warning.
    let (ok, stdout, stderr) = gpualloc(&["replay", &path(&cpu), "--json"]);
    assert!(ok, "{stderr}");
    let row: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(row["warnings"], 1);
    assert_eq!(row["peak_allocated_bytes"], 512);

    // A summary needs a snapshot; of a log it says so (not "warm replay needs ...").
    let (ok, _, stderr) = gpualloc(&["summary", &path(&good)]);
    assert!(!ok);
    assert!(
        stderr.contains("a summary needs a PyTorch snapshot"),
        "{stderr}"
    );
    let (ok, _, stderr) = gpualloc(&["summary", &path(&empty)]);
    assert!(!ok);
    assert!(stderr.contains("no events on any device"), "{stderr}");
    std::fs::remove_dir_all(&dir).ok();
}

/// `--export-viz` writes the replay as a snapshot: read back and replayed warm, it matches the
/// replay address for address, with the same peaks.
#[test]
fn export_viz_writes_the_replay_as_a_snapshot_that_replays_exactly() {
    let dir = std::env::temp_dir().join(format!("gpualloc-cli-viz-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let trace = jsonl_trace(&dir);
    let viz = dir.join("replay.pickle");
    let (ok, stdout, stderr) = gpualloc(&[
        "replay",
        trace.to_str().unwrap(),
        "--config",
        "expandable_segments:True",
        "--json",
        "--export-viz",
        viz.to_str().unwrap(),
    ]);
    assert!(ok, "{stderr}");
    assert!(stderr.contains("memory viewer"), "{stderr}");
    let first: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    // A warm replay without --config runs the config and policy the snapshot recorded.
    let (ok, stdout, stderr) = gpualloc(&["replay", viz.to_str().unwrap(), "--warm", "--json"]);
    assert!(ok, "{stderr}");
    let again: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(again["config"], "expandable_segments:True", "{again}");
    assert_eq!(again["policy"], "pytorch");
    // `--config recorded` under another policy; a log that records no config: PyTorch's.
    let (ok, stdout, stderr) = gpualloc(&[
        "replay",
        viz.to_str().unwrap(),
        "--config",
        "recorded",
        "--policy",
        "gpualloc",
        "--json",
    ]);
    assert!(ok, "{stderr}");
    let other: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(other["config"], "expandable_segments:True");
    assert_eq!(other["policy"], "gpualloc");
    let (ok, stdout, stderr) = gpualloc(&[
        "replay",
        trace.to_str().unwrap(),
        "--config",
        "recorded",
        "--json",
    ]);
    assert!(ok, "{stderr}");
    let log: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(
        (&log["config"], &log["policy"]),
        (&"".into(), &"pytorch".into()),
        "{log}"
    );
    assert_eq!(again["addresses_compared"], 80);
    assert_eq!(again["address_match_fraction"], 1.0);
    for key in [
        "peak_reserved_bytes",
        "peak_allocated_bytes",
        "peak_requested_bytes",
    ] {
        assert_eq!(again[key], first[key], "{key}");
    }
    // Several replays: one file each, numbered.
    let (ok, _, stderr) = gpualloc(&[
        "replay",
        trace.to_str().unwrap(),
        "--policy",
        "both",
        "--export-viz",
        viz.to_str().unwrap(),
    ]);
    assert!(ok, "{stderr}");
    assert!(dir.join("replay-1.pickle").exists() && dir.join("replay-2.pickle").exists());
    std::fs::remove_dir_all(&dir).ok();
}

/// The costs columns: a trace that calls `empty_cache()` (a run of `segment_free`) costs one
/// synchronization of every stream, and one segment freed; with expandable segments the pages
/// mapped and unmapped are counted too.
#[test]
fn json_counts_synchronizations_and_device_frees() {
    let dir = std::env::temp_dir().join(format!("gpualloc-cli-sync-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("empty_cache.jsonl");
    std::fs::write(
        &path,
        "{\"action\":\"alloc\",\"addr\":4096,\"size\":4096,\"stream\":0}\n\
         {\"action\":\"free_requested\",\"addr\":4096,\"size\":4096,\"stream\":0}\n\
         {\"action\":\"segment_free\",\"addr\":4096,\"size\":2097152,\"stream\":0}\n",
    )
    .unwrap();
    let (ok, stdout, stderr) = gpualloc(&["replay", path.to_str().unwrap(), "--json"]);
    assert!(ok, "{stderr}");
    let row: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(row["synchronizations"], 1);
    assert_eq!(row["device_frees"], 1);
    assert_eq!(row["device_mallocs"], 1);
    assert_eq!(
        (row["page_maps"].as_u64(), row["page_unmaps"].as_u64()),
        (Some(0), Some(0))
    );
    // With expandable segments: a 30 MiB block maps two 20 MiB pages in one growth; the
    // empty_cache unmaps both.
    let big = dir.join("expandable.jsonl");
    std::fs::write(
        &big,
        "{\"action\":\"alloc\",\"addr\":4096,\"size\":31457280,\"stream\":0}\n\
         {\"action\":\"free_requested\",\"addr\":4096,\"size\":31457280,\"stream\":0}\n\
         {\"action\":\"segment_free\",\"addr\":4096,\"size\":41943040,\"stream\":0}\n",
    )
    .unwrap();
    let (ok, stdout, stderr) = gpualloc(&[
        "replay",
        big.to_str().unwrap(),
        "--json",
        "--config",
        "expandable_segments:True",
    ]);
    assert!(ok, "{stderr}");
    let row: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(row["device_mallocs"], 1);
    assert_eq!(row["page_maps"], 2);
    assert_eq!(row["page_unmaps"], 2);
    std::fs::remove_dir_all(&dir).ok();
}

/// `--top-down` places a cold replay's new segments from the highest address down. Best fit
/// breaks ties by address, so the order decides which of two equal free blocks a request
/// takes: a 40 MiB segment split in two 20 MiB blocks and a 20 MiB segment, one block of each
/// free; bottom-up the next 20 MiB request takes the half in the 40 MiB segment (the lower
/// address) and a later 40 MiB request needs a third segment (100 MiB reserved); top-down it
/// takes the 20 MiB segment, and the 40 MiB one is whole again when needed (60 MiB).
#[test]
fn top_down_placement_changes_which_equal_block_a_request_takes() {
    let dir = std::env::temp_dir().join(format!("gpualloc-cli-topdown-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mib = 1u64 << 20;
    let events = [
        ("alloc", 1, 40),
        ("free_requested", 1, 40),
        ("alloc", 2, 20), // B: the 40 MiB segment's first half
        ("alloc", 3, 20), // C: its second half
        ("alloc", 4, 20), // D: a new 20 MiB segment
        ("free_requested", 2, 20),
        ("free_requested", 4, 20),
        ("alloc", 5, 20), // E: B's place or D's, by address
        ("free_requested", 3, 20),
        ("alloc", 6, 40), // F: the whole 40 MiB segment if E is not in it
    ];
    let text: String = events
        .iter()
        .map(|(action, id, size)| {
            format!(
                "{{\"action\":\"{action}\",\"addr\":{},\"size\":{},\"stream\":0}}\n",
                0x7f00_0000_0000u64 + id * 0x1000_0000,
                size * mib
            )
        })
        .collect();
    let trace = dir.join("tie.jsonl");
    std::fs::write(&trace, text).unwrap();
    let peak = |extra: &[&str]| {
        let mut args = vec!["replay", trace.to_str().unwrap(), "--json"];
        args.extend_from_slice(extra);
        let (ok, stdout, stderr) = gpualloc(&args);
        assert!(ok, "{stderr}");
        let row: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
        row["peak_reserved_bytes"].as_u64().unwrap() / mib
    };
    assert_eq!(peak(&[]), 100);
    assert_eq!(peak(&["--top-down"]), 60);
    std::fs::remove_dir_all(&dir).ok();
}
