//! Prints what a PyTorch memory snapshot holds, and optionally re-exports it.
//!
//! `cargo run --release -p gpualloc-trace --example snapshot_info -- FILE [--export OUT]`

use std::process::ExitCode;
use std::time::Instant;

use gpualloc_trace::{Action, Snapshot};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(path) = args.first() else {
        eprintln!("usage: snapshot_info FILE [--export OUT]");
        return ExitCode::FAILURE;
    };
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) => {
            eprintln!("{path}: {e}");
            return ExitCode::FAILURE;
        }
    };
    let start = Instant::now();
    let snap = match Snapshot::from_pickle(&bytes) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("{path}: {e}");
            return ExitCode::FAILURE;
        }
    };
    let elapsed = start.elapsed();
    println!("{path}: {} bytes parsed in {elapsed:?}", bytes.len());
    println!(
        "  {} segments, {} blocks, {} devices, {} events",
        snap.segments.len(),
        snap.segments.iter().map(|s| s.blocks.len()).sum::<usize>(),
        snap.device_traces.len(),
        snap.event_count()
    );
    for action in Action::ALL {
        let n = snap.count(action);
        if n > 0 {
            println!("  {action:>15}: {n}");
        }
    }
    println!(
        "  allocator_settings: {}",
        if snap.allocator_settings.is_some() {
            "yes"
        } else {
            "no"
        }
    );
    if let (Some(flag), Some(out)) = (args.get(1), args.get(2)) {
        if flag == "--export" {
            let bytes = match snap.to_pickle() {
                Ok(b) => b,
                Err(e) => {
                    eprintln!("export failed: {e}");
                    return ExitCode::FAILURE;
                }
            };
            let written = std::fs::write(out, &bytes).map(|()| bytes.len());
            match written {
                Ok(n) => println!("  exported {n} bytes to {out}"),
                Err(e) => {
                    eprintln!("export failed: {e}");
                    return ExitCode::FAILURE;
                }
            }
        }
    }
    ExitCode::SUCCESS
}
