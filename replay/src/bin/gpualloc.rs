//! `gpualloc`: replay recorded GPU memory traces under any allocator config, without a GPU.
//!
//! ```text
//! gpualloc replay FILE... [--config "max_split_size_mb:512"]... [--warm] [--json]
//!                 [--capacity 80GiB] [--plot memory.svg]
//! gpualloc summary FILE
//! ```

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use gpualloc_devices::AllocatorConfig;
use gpualloc_replay::report::{svg_plot, table};
use gpualloc_replay::{load, replay, ReplayOptions};
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
        /// Allocator config in PyTorch's syntax; repeat to compare configs (default: PyTorch's defaults).
        #[arg(long = "config")]
        configs: Vec<String>,
        /// Start from PyTorch's recorded state and compare every address with PyTorch's.
        #[arg(long)]
        warm: bool,
        /// Print one JSON object per (trace, config).
        #[arg(long)]
        json: bool,
        /// Device capacity, e.g. 80GiB (default: unlimited).
        #[arg(long, value_parser = parse_bytes)]
        capacity: Option<u64>,
        /// Write an SVG plot of reserved and allocated memory over time.
        #[arg(long)]
        plot: Option<PathBuf>,
    },
    /// Print a PyTorch-style memory summary of a snapshot's final state.
    Summary {
        /// Snapshot pickle.
        file: PathBuf,
    },
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

fn run(cli: Cli) -> Result<(), Box<dyn std::error::Error>> {
    match cli.command {
        Command::Summary { file } => {
            for trace in load(&file)? {
                println!("{}", gpualloc_replay::summary::summarize(&trace)?);
            }
            Ok(())
        }
        Command::Replay {
            files,
            configs,
            warm,
            json,
            capacity,
            plot,
        } => {
            let configs = if configs.is_empty() {
                vec![String::new()]
            } else {
                configs
            };
            let parsed: Vec<AllocatorConfig> = configs
                .iter()
                .map(|c| AllocatorConfig::parse(c))
                .collect::<Result<_, _>>()?;
            let bar = ProgressBar::new(0);
            bar.set_style(
                ProgressStyle::with_template("{msg} [{bar:40}] {pos}/{len} events")
                    .unwrap_or_else(|_| ProgressStyle::default_bar()),
            );
            let _ = BAR.set(bar.clone());
            let mut reports = Vec::new();
            for file in &files {
                for trace in load(file)? {
                    for config in &parsed {
                        bar.set_message(trace.name.clone());
                        let options = ReplayOptions {
                            config: config.clone(),
                            warm,
                            capacity,
                            sample_every: if plot.is_some() {
                                (trace.events.len() / 2000).max(1)
                            } else {
                                0
                            },
                            progress: if trace.events.len() > 100_000 {
                                Some(progress)
                            } else {
                                None
                            },
                            core_hook: None,
                        };
                        reports.push(replay(&trace, &options)?);
                    }
                }
            }
            bar.finish_and_clear();
            if json {
                for r in &reports {
                    println!("{}", r.to_json());
                }
            } else {
                print!("{}", table(&reports));
            }
            if let Some(path) = plot {
                std::fs::write(&path, svg_plot(&reports))?;
                eprintln!("plot written to {}", path.display());
            }
            Ok(())
        }
    }
}
