//! Prints the pinned-host allocator's numbers:
//! - memory held for a 1.1 GiB request with and without `pinned_max_round_threshold_mb`
//!   (on the accounting backend: addresses only, nothing is touched);
//! - the speed-up of prefaulting fresh memory on N threads over 1 (real page faults).
//!
//! `cargo run --release -p gpualloc-host --example pinned_report -- [MiB] [threads]`
//! (defaults: 1024 MiB, the available parallelism).

use std::error::Error;
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpualloc_accounting::AccountingBackend;
use gpualloc_host::mapping::PageMapping;
use gpualloc_host::{prefault, HostConfig, HostCore, ManualClock};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

fn held_for(request: u64, config: HostConfig) -> Result<u64, Box<dyn Error>> {
    let backend = Arc::new(AccountingBackend::new(1, GIB).with_host_capacity(8 * GIB));
    let mut core = HostCore::new(backend, config, Arc::new(ManualClock::default()))?;
    core.malloc(request)?;
    Ok(core.stats().reserved_bytes.current)
}

fn best_prefault(bytes: usize, threads: usize, runs: usize) -> Result<Duration, Box<dyn Error>> {
    let mut best = Duration::MAX;
    for _ in 0..runs {
        let mut m = PageMapping::new(bytes)?;
        let t0 = Instant::now();
        prefault(m.as_mut_slice(), threads);
        best = best.min(t0.elapsed());
    }
    Ok(best)
}

fn main() -> Result<(), Box<dyn Error>> {
    let mut args = std::env::args().skip(1);
    let mib: u64 = args.next().map(|a| a.parse()).transpose()?.unwrap_or(1024);
    let threads: usize = match args.next() {
        Some(a) => a.parse()?,
        None => std::thread::available_parallelism().map_or(2, |n| n.get()),
    };

    let request = GIB + GIB / 10;
    let fine = held_for(request, HostConfig::default())?;
    let pow2 = held_for(
        request,
        HostConfig {
            pinned_max_round_threshold_mb: None,
            ..HostConfig::default()
        },
    )?;
    println!("1.1 GiB request ({request} B):");
    println!(
        "  threshold 64 MiB: holds {fine} B = {:.4}x",
        fine as f64 / request as f64
    );
    println!(
        "  power of two    : holds {pow2} B = {:.4}x",
        pow2 as f64 / request as f64
    );

    let bytes = usize::try_from(mib * MIB)?;
    let one = best_prefault(bytes, 1, 3)?;
    let many = best_prefault(bytes, threads, 3)?;
    let gibps = |d: Duration| bytes as f64 / GIB as f64 / d.as_secs_f64();
    println!("prefault {mib} MiB (best of 3):");
    println!(
        "  1 thread : {:>9.1} ms  {:.2} GiB/s",
        one.as_secs_f64() * 1e3,
        gibps(one)
    );
    println!(
        "  {threads} threads: {:>9.1} ms  {:.2} GiB/s",
        many.as_secs_f64() * 1e3,
        gibps(many)
    );
    println!(
        "  speed-up : {:.2}x",
        one.as_secs_f64() / many.as_secs_f64()
    );
    Ok(())
}
