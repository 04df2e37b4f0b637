//! A memory summary in the layout of PyTorch's `torch.cuda.memory_summary()`.

use std::fmt::Write as _;

use crate::stats::{DeviceStats, Stat, StatArray};

fn fmt_size(v: u64) -> String {
    const PREFIXES: [&str; 6] = ["B  ", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let (mut v, mut i) = (v, 0);
    while i + 1 < PREFIXES.len() && v >= 768 * 1024 {
        v /= 1024;
        i += 1;
    }
    // One more step when the value is still large (PyTorch keeps at most 6 digits).
    if v >= 1024 * 10 && i + 1 < PREFIXES.len() {
        v /= 1024;
        i += 1;
    }
    format!("{v:>6} {}", PREFIXES[i])
}

fn fmt_count(v: u64) -> String {
    const PREFIXES: [&str; 3] = [" ", "K", "M"];
    let (mut v, mut i) = (v, 0);
    while i + 1 < PREFIXES.len() && v >= 750 * 1000 {
        v /= 1000;
        i += 1;
    }
    format!("{v:>8} {}", PREFIXES[i])
}

/// The summary table of `stats` for `device`.
pub fn memory_summary(stats: &DeviceStats, device: u32) -> String {
    let rule = format!("|{}|", "=".repeat(75));
    let thin = format!("|{}|", "-".repeat(75));
    let mut out = String::new();
    let _ = writeln!(out, "{rule}");
    let _ = writeln!(
        out,
        "|{:^75}|",
        format!("gpualloc memory summary, device ID {device}")
    );
    let _ = writeln!(out, "{thin}");
    let _ = writeln!(
        out,
        "|{:^37}|{:^37}|",
        format!("OOMs: {}", stats.num_ooms),
        format!("device malloc retries: {}", stats.num_alloc_retries)
    );
    let _ = writeln!(out, "{rule}");
    let _ = writeln!(
        out,
        "|{:^23}|{:^12}|{:^12}|{:^12}|{:^12}|",
        "Metric", "Cur Usage", "Peak Usage", "Tot Alloc", "Tot Freed"
    );
    let bytes: [(&str, &StatArray); 5] = [
        ("Allocated memory", &stats.allocated_bytes),
        ("Active memory", &stats.active_bytes),
        ("Requested memory", &stats.requested_bytes),
        ("GPU reserved memory", &stats.reserved_bytes),
        ("Non-releasable memory", &stats.inactive_split_bytes),
    ];
    let counts: [(&str, &StatArray); 4] = [
        ("Allocations", &stats.allocation),
        ("Active allocs", &stats.active),
        ("GPU reserved segments", &stats.segment),
        ("Non-releasable allocs", &stats.inactive_split),
    ];
    let row = |out: &mut String, name: &str, s: &Stat, f: fn(u64) -> String| {
        let _ = writeln!(
            out,
            "| {name:<22}| {} | {} | {} | {} |",
            f(s.current),
            f(s.peak),
            f(s.allocated),
            f(s.freed)
        );
    };
    for (name, arr) in bytes {
        let _ = writeln!(out, "{thin}");
        row(&mut out, name, &arr[0], fmt_size);
        row(&mut out, "      from large pool", &arr[2], fmt_size);
        row(&mut out, "      from small pool", &arr[1], fmt_size);
    }
    for (name, arr) in counts {
        let _ = writeln!(out, "{thin}");
        row(&mut out, name, &arr[0], fmt_count);
        row(&mut out, "      from large pool", &arr[2], fmt_count);
        row(&mut out, "      from small pool", &arr[1], fmt_count);
    }
    let _ = writeln!(out, "{thin}");
    row(
        &mut out,
        "Oversize allocations",
        &stats.oversize_allocations,
        fmt_count,
    );
    row(
        &mut out,
        "Oversize GPU segments",
        &stats.oversize_segments,
        fmt_count,
    );
    let _ = writeln!(out, "{rule}");
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stats::for_pool;

    #[test]
    fn table_shows_current_and_peak_per_pool() {
        let mut s = DeviceStats::default();
        for_pool(&mut s.allocated_bytes, false, |x| x.increase(3 << 30));
        for_pool(&mut s.allocated_bytes, true, |x| x.increase(512 << 10));
        for_pool(&mut s.allocation, false, |x| x.increase(2));
        let text = memory_summary(&s, 0);
        assert!(text.contains("device ID 0"));
        let alloc_line = text
            .lines()
            .find(|l| l.starts_with("| Allocated memory"))
            .unwrap();
        assert!(alloc_line.contains("3072 MiB"), "{alloc_line}");
        let small = text
            .lines()
            .find(|l| l.contains("from small pool"))
            .unwrap();
        assert!(small.contains("512 KiB"), "{small}");
        let allocs = text
            .lines()
            .find(|l| l.starts_with("| Allocations"))
            .unwrap();
        assert!(allocs.contains("       2   |"), "{allocs}");
        assert!(
            text.lines().all(|l| l.chars().count() == 77),
            "every line is 77 wide"
        );
    }
}
