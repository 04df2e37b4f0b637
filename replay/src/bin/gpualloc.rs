//! `gpualloc`: replay recorded GPU memory traces under any allocator config, without a GPU.
//!
//! ```text
//! gpualloc replay FILE... [--config "max_split_size_mb:512"]... [--policy pytorch|gpualloc|both]
//!                 [--warm] [--json] [--timing] [--capacity 80GiB] [--plot memory.svg|.png]
//! gpualloc summary FILE
//! ```

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};
use gpualloc_devices::DeviceSnapshot;
use gpualloc_devices::{AllocatorConfig, Policy};
use gpualloc_replay::plot::{write_plot, PlotFormat};
use gpualloc_replay::report::{table, PolicyDifference};
use gpualloc_replay::{load, replay_core, ReplayOptions, Trace};
use indicatif::{ProgressBar, ProgressStyle};

#[derive(Parser)]
#[command(
    name = "gpualloc",
    about = "Replay GPU memory traces through gpualloc's caching allocator"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Replay traces (PyTorch snapshot pickles, RMM CSV logs, JSON Lines) under one or more configs.
    Replay {
        /// Trace files.
        #[arg(required = true)]
        files: Vec<PathBuf>,
        /// Allocator config in PyTorch's syntax; repeat to compare configs (default: PyTorch's
        /// defaults; `default` names them too). `recorded`: the config the snapshot was
        /// recorded with (its `allocator_settings`; PyTorch's defaults where it has none),
        /// under the recorded policy unless `--policy` says otherwise. A warm replay without
        /// `--config` and `--policy` replays the recorded config.
        #[arg(long = "config")]
        configs: Vec<String>,
        /// Whose rules answer: `pytorch` (PyTorch's, rule for rule: what your job would need
        /// under PyTorch), `gpualloc` (ours: PyTorch's except the deviations the README lists),
        /// or `both`, side by side with the difference [default: pytorch].
        #[arg(long, value_enum)]
        policy: Option<PolicyChoice>,
        /// Start from PyTorch's recorded state and compare every address with PyTorch's.
        #[arg(long)]
        warm: bool,
        /// Print one JSON object per (trace, config, policy); the README lists the fields.
        #[arg(long)]
        json: bool,
        /// Add the replay speed (events per second) to the table and the JSON; it changes from
        /// run to run, so it is left out unless asked for.
        #[arg(long)]
        timing: bool,
        /// Device capacity, e.g. 80GiB (default: unlimited).
        #[arg(long, value_parser = parse_bytes)]
        capacity: Option<u64>,
        /// Draw memory over time into FILE.svg or FILE.png: one panel per trace, reserved
        /// and allocated of each replay, PyTorch's recorded reserved memory for reference.
        #[arg(long, value_name = "FILE")]
        plot: Option<PathBuf>,
        /// Write the replay as a memory snapshot PyTorch's viewer opens (drag it into
        /// pytorch.org/memory_viz): its segments at the end and the history the replay made.
        /// Several replays are written as PATH-1.pickle, PATH-2.pickle, ...
        #[arg(long, value_name = "PATH")]
        export_viz: Option<PathBuf>,
        /// Cold replay: place new segments at the highest free address first, as CUDA's
        /// driver placed most of them in the recorded runs (the default is lowest first).
        /// Best fit breaks ties by address, so this can change which block a request takes.
        #[arg(long)]
        top_down: bool,
        /// Where the free memory sits when reserved memory first reaches its peak: in small,
        /// large or expandable segments, in holes between live blocks (the largest listed with
        /// the live blocks beside them), on how many streams; and the floor, the peak
        /// allocated rounded up to the 2 MiB page, with and without the small and large pools
        /// apart (lines under each row; `waste_at_peak` in the JSON).
        #[arg(long)]
        waste: bool,
    },
    /// Print a PyTorch-style memory summary of a snapshot's final state.
    Summary {
        /// Snapshot pickle.
        file: PathBuf,
    },
}

/// The `--policy` choice.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum PolicyChoice {
    /// PyTorch's rules.
    Pytorch,
    /// gpualloc's rules.
    Gpualloc,
    /// Both, side by side.
    Both,
}

impl PolicyChoice {
    fn policies(self) -> &'static [Policy] {
        match self {
            PolicyChoice::Pytorch => &[Policy::Pytorch],
            PolicyChoice::Gpualloc => &[Policy::Gpualloc],
            PolicyChoice::Both => &Policy::ALL,
        }
    }
}

/// A `--config` value.
#[derive(Debug, Clone)]
enum ConfigChoice {
    /// This config.
    Given(Box<AllocatorConfig>),
    /// The config each snapshot recorded.
    Recorded,
}

impl ConfigChoice {
    /// The configs to replay `trace` under: one per policy of `policy` (PyTorch's when not
    /// given; for `Recorded`, the recorded one).
    fn configs(&self, trace: &Trace, policy: Option<PolicyChoice>) -> Vec<AllocatorConfig> {
        let (base, own) = match self {
            ConfigChoice::Given(c) => ((**c).clone(), Policy::Pytorch),
            ConfigChoice::Recorded => {
                let recorded = trace.config_as_recorded();
                let own = recorded.policy;
                (recorded, own)
            }
        };
        let policies: Vec<Policy> = policy.map_or(vec![own], |p| p.policies().to_vec());
        policies
            .into_iter()
            .map(|p| base.clone().with_policy(p))
            .collect()
    }
}

/// A `--config` value: PyTorch's syntax, `default` or `recorded`. The policy is `--policy`'s
/// to set.
fn parse_config(s: &str) -> Result<ConfigChoice, String> {
    if s.trim() == "recorded" {
        return Ok(ConfigChoice::Recorded);
    }
    let text = if s.trim() == "default" { "" } else { s };
    let config = AllocatorConfig::parse(text).map_err(|e| format!("--config {s:?}: {e}"))?;
    if config.policy != AllocatorConfig::default().policy || text.contains("policy:") {
        return Err(format!(
            "--config {s:?}: set the policy with --policy, not in the config"
        ));
    }
    Ok(ConfigChoice::Given(Box::new(config)))
}

fn parse_bytes(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let split = s
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: f64 = num.parse().map_err(|_| format!("not a size: {s}"))?;
    let mult = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1u64,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        other => return Err(format!("unknown unit {other:?}")),
    };
    let bytes = n * mult as f64;
    if !(bytes.is_finite() && bytes > 0.0 && bytes < u64::MAX as f64) {
        return Err(format!("size out of range: {s}"));
    }
    Ok(bytes as u64)
}

static BAR: std::sync::OnceLock<ProgressBar> = std::sync::OnceLock::new();

fn progress(done: u64, total: u64) {
    if let Some(bar) = BAR.get() {
        bar.set_length(total);
        bar.set_position(done);
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gpualloc: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Writes each replay's snapshot for PyTorch's memory viewer: to `path` when there is one,
/// else to `path` with `-1`, `-2`, ... before its extension.
fn write_exports(
    path: &std::path::Path,
    exports: &[(DeviceSnapshot, AllocatorConfig)],
) -> Result<(), Box<dyn std::error::Error>> {
    for (i, (snapshot, config)) in exports.iter().enumerate() {
        let target = if exports.len() == 1 {
            path.to_path_buf()
        } else {
            let stem = path.file_stem().unwrap_or_default().to_string_lossy();
            let ext = path
                .extension()
                .map_or_else(String::new, |e| format!(".{}", e.to_string_lossy()));
            path.with_file_name(format!("{stem}-{}{ext}", i + 1))
        };
        let bytes = gpualloc_replay::export::to_pickle(std::slice::from_ref(snapshot), config)?;
        std::fs::write(&target, bytes)
            .map_err(|e| format!("cannot write {}: {e}", target.display()))?;
        eprintln!(
            "replay written for PyTorch's memory viewer to {}",
            target.display()
        );
    }
    Ok(())
}

/// An error message that names `name` once.
fn named(name: &str, e: &dyn std::fmt::Display) -> String {
    let text = e.to_string();
    if text.starts_with(name) {
        text
    } else {
        format!("{name}: {text}")
    }
}

/// What to say of a file whose devices recorded no events.
fn no_events(file: &std::path::Path) -> String {
    format!(
        "{}: no events on any device: nothing was recorded (call \
         torch.cuda.memory._record_memory_history() before dumping the snapshot)",
        file.display()
    )
}

fn run(cli: Cli) -> Result<(), Box<dyn std::error::Error>> {
    match cli.command {
        Command::Summary { file } => {
            let traces = load(&file)?;
            if traces.is_empty() {
                return Err(no_events(&file).into());
            }
            for trace in traces {
                println!("{}", gpualloc_replay::summary::summarize(&trace)?);
            }
            Ok(())
        }
        Command::Replay {
            files,
            configs,
            policy,
            warm,
            json,
            timing,
            capacity,
            plot,
            export_viz,
            top_down,
            waste,
        } => {
            if let Some(path) = &plot {
                PlotFormat::of(path)?;
            }
            let configs = if !configs.is_empty() {
                configs
            } else if warm && policy.is_none() {
                vec!["recorded".to_string()]
            } else {
                vec![String::new()]
            };
            let choices: Vec<ConfigChoice> = configs
                .iter()
                .map(|c| parse_config(c))
                .collect::<Result<Vec<_>, _>>()?;
            // Drawn on a terminal only (indicatif hides it when stderr is not one): a spinner
            // while a file loads, then a bar per replay, labelled with what runs.
            let bar = ProgressBar::new(0);
            let _ = BAR.set(bar.clone());
            let loading = ProgressStyle::with_template("{spinner} {msg}")
                .unwrap_or_else(|_| ProgressStyle::default_spinner());
            let replaying = ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len} events")
                .unwrap_or_else(|_| ProgressStyle::default_bar());
            let mut reports = Vec::new();
            let mut exports = Vec::new();
            // Each file on its own: one that fails is reported and the rest still run.
            let mut failures = Vec::new();
            for file in &files {
                bar.set_style(loading.clone());
                bar.set_message(format!("loading {}", file.display()));
                bar.enable_steady_tick(std::time::Duration::from_millis(100));
                let loaded = load(file);
                bar.disable_steady_tick();
                bar.set_style(replaying.clone());
                let traces = match loaded {
                    Ok(t) => t,
                    Err(e) => {
                        // Load errors name the file already.
                        failures.push(e.to_string());
                        continue;
                    }
                };
                if traces.iter().all(|t| t.events.is_empty()) {
                    failures.push(no_events(file));
                    continue;
                }
                for trace in traces.iter().filter(|t| !t.events.is_empty()) {
                    let parsed: Vec<AllocatorConfig> = choices
                        .iter()
                        .flat_map(|c| c.configs(trace, policy))
                        .collect();
                    for config in &parsed {
                        let shown = config.clone().with_policy(Policy::default()).to_string();
                        let label = if shown.is_empty() { "default" } else { &shown };
                        bar.set_message(format!("{} [{label}; {}]", trace.name, config.policy));
                        bar.set_length(trace.events.len() as u64);
                        bar.set_position(0);
                        let options = ReplayOptions {
                            config: config.clone(),
                            warm,
                            capacity,
                            sample_every: if plot.is_some() {
                                (trace.events.len() / 2000).max(1)
                            } else {
                                0
                            },
                            progress: Some(progress),
                            core_hook: None,
                            record_history: export_viz.is_some(),
                            top_down,
                            waste_at_peak: waste,
                        };
                        match replay_core(trace, &options) {
                            Ok((r, core)) => {
                                if export_viz.is_some() {
                                    exports.push((core.snapshot(), config.clone()));
                                }
                                reports.push(r);
                            }
                            Err(e) => failures.push(named(&trace.name, &e)),
                        }
                    }
                }
            }
            bar.finish_and_clear();
            if json {
                for (i, r) in reports.iter().enumerate() {
                    let mut v = r.to_json(timing);
                    if let Some(d) = i
                        .checked_sub(1)
                        .and_then(|j| PolicyDifference::between(&reports[j], r))
                    {
                        v["vs_pytorch"] = d.to_json();
                    }
                    println!("{v}");
                }
            } else if !reports.is_empty() {
                print!("{}", table(&reports, timing));
            }
            if let Some(path) = plot {
                write_plot(&path, &reports)?;
                eprintln!("plot written to {}", path.display());
            }
            if let Some(path) = export_viz {
                write_exports(&path, &exports)?;
            }
            for f in &failures {
                eprintln!("gpualloc: {f}");
            }
            if failures.is_empty() {
                Ok(())
            } else {
                Err(format!(
                    "{} failed (above); {} results reported",
                    if failures.len() == 1 {
                        "1 file or replay".to_string()
                    } else {
                        format!("{} files or replays", failures.len())
                    },
                    reports.len()
                )
                .into())
            }
        }
    }
}
