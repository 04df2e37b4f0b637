//! A memory summary in the layout of PyTorch's `torch.cuda.memory_summary()`, shared by the
//! facade (`Allocator::memory_summary`) and `gpualloc summary`.

use std::fmt::Write;

use crate::ledger::stats::{DeviceStats, Stat, StatType};
use gpualloc_runtime::DeviceId;

const RULE: &str =
    "|===========================================================================|\n";
const THIN: &str =
    "|---------------------------------------------------------------------------|\n";

/// Formats bytes as PyTorch's summary does: the unit is chosen from `pref` (the peak).
fn format_bytes(value: u64, pref: u64) -> String {
    const UNITS: [&str; 6] = ["B  ", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let (mut v, mut p, mut i) = (value, pref, 0);
    while p >= 768 * 1024 && i + 1 < UNITS.len() {
        p /= 1024;
        v /= 1024;
        i += 1;
    }
    format!("{v:6} {}", UNITS[i])
}

/// Formats a count as PyTorch's summary does (K, M above 750 thousand of the peak).
fn format_count(value: u64, pref: u64) -> String {
    const UNITS: [&str; 3] = ["   ", "K  ", "M  "];
    let (mut v, mut p, mut i) = (value, pref, 0);
    while p >= 750 * 1000 && i + 1 < UNITS.len() {
        p /= 1000;
        v /= 1000;
        i += 1;
    }
    format!("{v:6} {}", UNITS[i])
}

/// One row; each column's unit follows that column's value in `pref` (the metric's
/// all-pools row), as PyTorch does.
fn row(out: &mut String, name: &str, s: &Stat, pref: &Stat, bytes: bool) {
    let f = |v: u64, p: u64| {
        if bytes {
            format_bytes(v, p)
        } else {
            format_count(v, p)
        }
    };
    let _ = writeln!(
        out,
        "| {name:<21} | {} | {} | {} | {} |",
        f(s.current, pref.current),
        f(s.peak, pref.peak),
        f(s.allocated, pref.allocated),
        f(s.freed, pref.freed)
    );
}

fn section(out: &mut String, name: &str, arr: &[Stat; 3], bytes: bool) {
    let all = &arr[StatType::All as usize];
    row(out, name, all, all, bytes);
    row(
        out,
        "      from large pool",
        &arr[StatType::Large as usize],
        all,
        bytes,
    );
    row(
        out,
        "      from small pool",
        &arr[StatType::Small as usize],
        all,
        bytes,
    );
    out.push_str(THIN);
}

/// The summary table of one device (PyTorch's `torch.cuda.memory_summary` layout).
pub fn memory_summary(device: DeviceId, s: &DeviceStats) -> String {
    let mut out = String::new();
    out.push_str(RULE);
    let _ = writeln!(
        out,
        "|{:^75}|",
        format!("gpualloc memory summary, device ID {}", device.0)
    );
    out.push_str(THIN);
    let left = format!("OOMs: {}", s.num_ooms);
    let right = format!("device malloc retries: {}", s.num_alloc_retries);
    let _ = writeln!(out, "|{left:^37}|{right:^37}|");
    out.push_str(RULE);
    let _ = writeln!(
        out,
        "|        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  |"
    );
    out.push_str(THIN);
    section(&mut out, "Allocated memory", &s.allocated_bytes, true);
    section(&mut out, "Active memory", &s.active_bytes, true);
    section(&mut out, "Requested memory", &s.requested_bytes, true);
    section(&mut out, "GPU reserved memory", &s.reserved_bytes, true);
    section(
        &mut out,
        "Non-releasable memory",
        &s.inactive_split_bytes,
        true,
    );
    section(&mut out, "Allocations", &s.allocation, false);
    section(&mut out, "Active allocs", &s.active, false);
    section(&mut out, "GPU reserved segments", &s.segment, false);
    section(&mut out, "Non-releasable allocs", &s.inactive_split, false);
    let (oa, os) = (&s.oversize_allocations, &s.oversize_segments);
    row(&mut out, "Oversize allocations", oa, oa, false);
    row(&mut out, "Oversize GPU segments", os, os, false);
    out.push_str(RULE);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_like_pytorch() {
        assert_eq!(format_bytes(512, 512), "   512 B  ");
        assert_eq!(format_bytes(3 << 20, 3 << 20), "  3072 KiB");
        assert_eq!(format_bytes(20 << 20, 20 << 20), " 20480 KiB");
        assert_eq!(format_bytes(2 << 30, 2 << 30), "  2048 MiB");
        assert_eq!(format_count(12, 12), "    12    ");
        let mut s = DeviceStats::default();
        s.allocated_bytes[0] = Stat {
            current: 2 << 20,
            peak: 4 << 20,
            allocated: 6 << 20,
            freed: 4 << 20,
        };
        s.num_ooms = 2;
        let text = memory_summary(DeviceId(1), &s);
        assert!(text.contains("device ID 1"), "{text}");
        assert!(text.contains("OOMs: 2"), "{text}");
        assert!(
            text.contains(
                "| Allocated memory      |   2048 KiB |   4096 KiB |   6144 KiB |   4096 KiB |"
            ),
            "{text}"
        );
        assert!(text.lines().all(|l| l.chars().count() == 77), "{text}");
        // Each column picks its own unit: 21 GiB in total does not widen the table.
        s.allocated_bytes[0].allocated = 21 << 30;
        let text = memory_summary(DeviceId(0), &s);
        assert!(text.contains("|  21504 MiB |"), "{text}");
        assert!(text.lines().all(|l| l.chars().count() == 77), "{text}");
    }
}
