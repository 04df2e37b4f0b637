//! Replay results: the figures, a side-by-side table of configs and policies, and JSON for
//! scripts (the picture is `plot.rs`).

use std::fmt::Write as _;

use gpualloc_devices::{format_size, Policy};
use serde_json::{json, Value};

use crate::analysis::TorchFigures;
use crate::input::Trace;
use crate::run::ReplayOptions;

/// Memory at one point of the replay.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sample {
    /// Event index.
    pub event: u64,
    /// The event's time stamp in the trace (µs), where it has one.
    pub time_us: Option<i64>,
    /// Reserved bytes.
    pub reserved: u64,
    /// Allocated bytes.
    pub allocated: u64,
    /// PyTorch's reserved bytes at this event, from the trace's segment events (None when the
    /// trace has no segment list).
    pub torch_reserved: Option<u64>,
}

/// The first allocation placed elsewhere than PyTorch placed it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mismatch {
    /// Event index in the trace.
    pub index: usize,
    /// Requested bytes.
    pub size: u64,
    /// Where the replay put it.
    pub ours: u64,
    /// Where PyTorch put it.
    pub torch: u64,
    /// Which rule decided it, ours against PyTorch's.
    pub rule: String,
}

/// How one side of a [`Mismatch`] served the request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Served {
    /// A segment allocated for it.
    NewSegment,
    /// A cached block of its own stream.
    Cached,
    /// Another stream's free block, lent (a history of the `gpualloc` policy marks it:
    /// `gpualloc_borrowed`).
    Loan,
}

impl Served {
    /// What the side did, in words.
    pub fn as_str(self) -> &'static str {
        match self {
            Served::NewSegment => "allocated a new segment",
            Served::Cached => "reused a cached block (best fit)",
            Served::Loan => "took another stream's free block (a loan)",
        }
    }
}

impl Mismatch {
    /// Describes a mismatch from what each side did.
    pub fn describe(
        index: usize,
        size: u64,
        ours: u64,
        torch: u64,
        our_side: Served,
        torch_side: Served,
        block: u64,
    ) -> Self {
        let rule = format!(
            "ours {} (block of {}), PyTorch {}",
            our_side.as_str(),
            format_size(block),
            torch_side.as_str()
        );
        Mismatch {
            index,
            size,
            ours,
            torch,
            rule,
        }
    }
}

/// Results of one (trace, config) replay.
#[derive(Debug, Clone)]
pub struct ReplayReport {
    /// Trace name.
    pub trace: String,
    /// Config in PyTorch's syntax ("" = default), without the policy.
    pub config: String,
    /// Whose rules answered (see `gpualloc_devices::policy`).
    pub policy: Policy,
    /// Warm replay.
    pub warm: bool,
    /// Events replayed.
    pub events: u64,
    /// Peak reserved bytes.
    pub peak_reserved: u64,
    /// Peak allocated bytes (block sizes).
    pub peak_allocated: u64,
    /// Peak requested bytes (what the program asked for, before rounding).
    pub peak_requested: u64,
    /// Device mallocs (segments allocated).
    pub device_mallocs: u64,
    /// Device frees (segments released).
    pub device_frees: u64,
    /// Map calls the driver was asked for (one per physical handle of an expandable segment:
    /// a growth is one `device_mallocs` and one or more of these); 0 without expandable
    /// segments.
    pub page_maps: u64,
    /// Unmap calls the driver was asked for (expandable segments).
    pub page_unmaps: u64,
    /// Times the replay's allocator synchronized every stream (the OOM chain's last release,
    /// `empty_cache`): a cost a policy must not add to the steady state.
    pub synchronizations: u64,
    /// Alloc retries after releasing the cache.
    pub retries: u64,
    /// Allocations that failed.
    pub ooms: u64,
    /// Events that could not be applied (free of an unknown address, ...).
    pub warnings: u64,
    /// Replay speed.
    pub events_per_second: f64,
    /// PyTorch's own figures.
    pub torch: TorchFigures,
    /// Warm replay: (allocations at PyTorch's address, allocations compared).
    pub address_match: Option<(u64, u64)>,
    /// Warm replay: the first allocation placed elsewhere.
    pub first_mismatch: Option<Mismatch>,
    /// Memory over time.
    pub samples: Vec<Sample>,
    /// Where the free memory sat at the peak (`ReplayOptions::waste_at_peak`).
    pub waste: Option<crate::waste::Waste>,
}

impl ReplayReport {
    /// An empty report for `trace` under `options`.
    pub fn new(trace: &Trace, options: &ReplayOptions, torch: TorchFigures) -> Self {
        ReplayReport {
            trace: trace.name.clone(),
            config: options
                .config
                .clone()
                .with_policy(Policy::default())
                .to_string(),
            policy: options.config.policy,
            warm: options.warm,
            events: trace.events.len() as u64,
            peak_reserved: 0,
            peak_allocated: 0,
            peak_requested: 0,
            device_mallocs: 0,
            page_maps: 0,
            page_unmaps: 0,
            device_frees: 0,
            synchronizations: 0,
            retries: 0,
            ooms: 0,
            warnings: 0,
            events_per_second: 0.0,
            torch,
            address_match: None,
            first_mismatch: None,
            samples: Vec::new(),
            waste: None,
        }
    }

    /// 1 − peak allocated / peak reserved.
    pub fn fragmentation(&self) -> f64 {
        if self.peak_reserved == 0 {
            0.0
        } else {
            1.0 - self.peak_allocated as f64 / self.peak_reserved as f64
        }
    }

    /// Fraction of allocations placed at PyTorch's address (warm replay).
    pub fn address_match_fraction(&self) -> Option<f64> {
        self.address_match
            .map(|(m, n)| if n == 0 { 1.0 } else { m as f64 / n as f64 })
    }

    /// The report as one JSON object (the fields are listed in the README's replay section).
    /// `timing` adds `events_per_second`, which changes from run to run; without it two runs
    /// of the same replay print the same bytes.
    pub fn to_json(&self, timing: bool) -> Value {
        let mut v = json!({
            "trace": self.trace,
            "config": self.config,
            "policy": self.policy.name(),
            "warm": self.warm,
            "events": self.events,
            "peak_reserved_bytes": self.peak_reserved,
            "peak_allocated_bytes": self.peak_allocated,
            "peak_requested_bytes": self.peak_requested,
            "fragmentation": self.fragmentation(),
            "device_mallocs": self.device_mallocs,
            "device_frees": self.device_frees,
            "page_maps": self.page_maps,
            "page_unmaps": self.page_unmaps,
            "synchronizations": self.synchronizations,
            "retries": self.retries,
            "ooms": self.ooms,
            "warnings": self.warnings,
            "torch_peak_reserved_bytes": self.torch.peak_reserved,
            "torch_peak_requested_bytes": self.torch.peak_requested,
            "torch_segment_allocs": self.torch.segment_allocs,
            "torch_segment_frees": self.torch.segment_frees,
        });
        if timing {
            v["events_per_second"] = json!(self.events_per_second);
        }
        if let Some(w) = &self.waste {
            v["waste_at_peak"] = w.to_json();
        }
        if self.warm {
            let (matched, compared) = self.address_match.unwrap_or((0, 0));
            v["addresses_matched"] = json!(matched);
            v["addresses_compared"] = json!(compared);
            v["address_match_fraction"] = json!(self.address_match_fraction());
            v["first_mismatch"] = match &self.first_mismatch {
                None => Value::Null,
                Some(m) => {
                    json!({"index": m.index, "size": m.size, "ours": m.ours, "torch": m.torch, "rule": m.rule})
                }
            };
        }
        v
    }
}

/// A text table comparing reports (one row per trace, config and policy). A `gpualloc` row
/// right after the `pytorch` row of the same trace and config (`--policy both`) is followed
/// by the difference, gpualloc - pytorch.
/// `timing` adds the events/s column (it changes from run to run).
pub fn table(reports: &[ReplayReport], timing: bool) -> String {
    let mut out = String::new();
    let _ = write!(
        out,
        "{:<34} {:<36} {:<8} {:>12} {:>12} {:>7} {:>8} {:>6} {:>12} {:>9}",
        "trace",
        "config",
        "policy",
        "peak resv",
        "peak alloc",
        "frag",
        "mallocs",
        "ooms",
        "torch resv",
        "addr ok",
    );
    if timing {
        let _ = write!(out, " {:>10}", "events/s");
    }
    out.push('\n');
    for (i, r) in reports.iter().enumerate() {
        let config = if r.config.is_empty() {
            "(default)".to_string()
        } else {
            r.config.clone()
        };
        let torch = r
            .torch
            .peak_reserved
            .map_or_else(|| "-".to_string(), format_size);
        let matched = r
            .address_match_fraction()
            .map_or_else(|| "-".to_string(), |f| format!("{:.2}%", f * 100.0));
        let _ = write!(
            out,
            "{:<34} {:<36} {:<8} {:>12} {:>12} {:>6.2}% {:>8} {:>6} {:>12} {:>9}",
            truncate(&r.trace, 34),
            truncate(&config, 36),
            r.policy.name(),
            format_size(r.peak_reserved),
            format_size(r.peak_allocated),
            r.fragmentation() * 100.0,
            r.device_mallocs,
            r.ooms,
            torch,
            matched,
        );
        if timing {
            let _ = write!(out, " {:>10.2e}", r.events_per_second);
        }
        out.push('\n');
        if let Some(m) = &r.first_mismatch {
            let _ = writeln!(
                out,
                "    first mismatch at event {}: {} bytes at {:#x}, PyTorch {:#x}: {}",
                m.index, m.size, m.ours, m.torch, m.rule
            );
        }
        if r.warnings > 0 {
            let _ = writeln!(
                out,
                "    {} events could not be applied (unknown addresses)",
                r.warnings
            );
        }
        if let Some(w) = &r.waste {
            let _ = writeln!(
                out,
                "    at the peak (event {}): {} free of {} reserved: small pool {}, large {}, \
                 expandable {}; in holes between live blocks {}; on {} stream(s), at most {} on \
                 one; rounding {}. Floor {} (the peak allocated to the 2 MiB page: {:.2}%), {} \
                 with the small and large pools apart ({:.2}%)",
                w.event,
                format_size(w.free()),
                format_size(w.reserved),
                format_size(w.free_small),
                format_size(w.free_large),
                format_size(w.free_expandable),
                format_size(w.free_holes),
                w.streams_with_free,
                format_size(w.most_free_on_a_stream),
                format_size(w.active - w.requested.min(w.active)),
                format_size(w.floor),
                floor_fragmentation(r.peak_allocated, w.floor),
                format_size(w.floor_pools_apart),
                floor_fragmentation(r.peak_allocated, w.floor_pools_apart),
            );
            if !w.largest_holes.is_empty() {
                let holes: Vec<String> = w
                    .largest_holes
                    .iter()
                    .map(|h| {
                        format!(
                            "{} (between {} and {})",
                            format_size(h.bytes),
                            format_size(h.before),
                            format_size(h.after)
                        )
                    })
                    .collect();
                let _ = writeln!(out, "    largest holes: {}", holes.join(", "));
            }
        }
        if let Some(torch_row) = i.checked_sub(1).map(|j| &reports[j]) {
            if let Some(d) = PolicyDifference::between(torch_row, r) {
                let _ = writeln!(out, "{:<71} {}", "", d.describe());
            }
        }
    }
    out
}

/// How the `gpualloc` policy's replay of a trace and config differs from the `pytorch` one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PolicyDifference {
    /// Peak reserved bytes, gpualloc - pytorch.
    pub peak_reserved: i64,
    /// Device mallocs, gpualloc - pytorch.
    pub device_mallocs: i64,
    /// Failed allocations, gpualloc - pytorch.
    pub ooms: i64,
    /// PyTorch's policy's peak reserved, for the relative figure.
    pub pytorch_peak_reserved: u64,
}

impl PolicyDifference {
    /// The difference when `torch` and `ours` are the two policies' replays of the same
    /// trace, config and mode; `None` otherwise.
    pub fn between(torch: &ReplayReport, ours: &ReplayReport) -> Option<Self> {
        let same_run = torch.trace == ours.trace && torch.config == ours.config;
        let pair = torch.policy == Policy::Pytorch && ours.policy == Policy::Gpualloc;
        (same_run && pair && torch.warm == ours.warm).then(|| PolicyDifference {
            peak_reserved: ours.peak_reserved as i64 - torch.peak_reserved as i64,
            device_mallocs: ours.device_mallocs as i64 - torch.device_mallocs as i64,
            ooms: ours.ooms as i64 - torch.ooms as i64,
            pytorch_peak_reserved: torch.peak_reserved,
        })
    }

    /// One line: "gpualloc - pytorch: peak resv -27.50 GiB (-34.6%), mallocs -120, ooms +0".
    pub fn describe(&self) -> String {
        let signed = |v: i64| {
            if v < 0 {
                format!("-{}", format_size(v.unsigned_abs()))
            } else {
                format!("+{}", format_size(v as u64))
            }
        };
        let percent = if self.pytorch_peak_reserved == 0 {
            0.0
        } else {
            self.peak_reserved as f64 / self.pytorch_peak_reserved as f64 * 100.0
        };
        format!(
            "gpualloc - pytorch: peak resv {} ({percent:+.1}%), mallocs {:+}, ooms {:+}",
            signed(self.peak_reserved),
            self.device_mallocs,
            self.ooms
        )
    }

    /// The difference as JSON (the `vs_pytorch` object of a gpualloc row).
    pub fn to_json(&self) -> Value {
        json!({
            "peak_reserved_bytes": self.peak_reserved,
            "device_mallocs": self.device_mallocs,
            "ooms": self.ooms,
        })
    }
}

/// `s`, cut to `n` characters with an ellipsis (for table cells and legend labels).
pub(crate) fn truncate(s: &str, n: usize) -> String {
    if s.chars().count() <= n {
        s.to_string()
    } else {
        let cut: String = s.chars().take(n.saturating_sub(1)).collect();
        format!("{cut}…")
    }
}

/// The fragmentation a replay would show reserving `floor` at its peak, in percent.
fn floor_fragmentation(peak_allocated: u64, floor: u64) -> f64 {
    if floor == 0 {
        0.0
    } else {
        (1.0 - peak_allocated as f64 / floor as f64) * 100.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::waste::Waste;

    #[test]
    fn a_floor_s_fragmentation_is_the_share_no_block_uses() {
        assert_eq!(floor_fragmentation(0, 0), 0.0);
        assert_eq!(floor_fragmentation(3 << 20, 4 << 20), 25.0);
        // cnn-counterfactual-small: 103.26 MiB at the peak, floors 104 and 106 MiB.
        let at = |floor_mib: u64| floor_fragmentation(108_275_712, floor_mib << 20);
        assert_eq!(format!("{:.2} / {:.2}", at(104), at(106)), "0.71 / 2.59");
    }

    #[test]
    fn the_waste_line_shows_both_floors() {
        let trace = Trace {
            name: "t.pickle".into(),
            device: 0,
            events: Vec::new(),
            final_segments: None,
            recorded_config: None,
            pools: Vec::new(),
        };
        let mut r = ReplayReport::new(&trace, &ReplayOptions::default(), TorchFigures::default());
        r.peak_allocated = 3 << 20;
        r.peak_reserved = 4 << 20;
        let mut w = Waste::default();
        w.set_floors(3 << 20, 1 << 20, 2 << 20);
        r.waste = Some(w);
        let text = table(&[r], false);
        assert!(text.contains("t.pickle"), "{text}");
        assert!(
            text.contains("Floor 4.00 MiB (the peak allocated to the 2 MiB page: 25.00%), 4.00 MiB with the small and large pools apart (25.00%)"),
            "{text}"
        );
    }
}
