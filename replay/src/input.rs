//! Loading traces: PyTorch snapshot pickles (any protocol), RMM `logging_resource_adaptor` CSV,
//! and the JSON Lines format of `gpualloc_trace::jsonl`, chosen by content (see `detect`).

use std::collections::BTreeMap;
use std::path::Path;

use gpualloc_devices::snapshot_pickle::{recorded_pools, POLICY_KEY};
use gpualloc_devices::PoolInfo;
use gpualloc_devices::{AllocatorConfig, Policy};
use gpualloc_trace::pickle::Value;
use gpualloc_trace::{Action, BlockState, SegmentType, Snapshot, TraceEntry};

use crate::run::ReplayError;

/// A live block of a recorded final segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FinalBlock {
    /// Address.
    pub addr: u64,
    /// Block size.
    pub size: u64,
    /// Requested bytes.
    pub requested: u64,
    /// Allocated (or pending free) rather than cached.
    pub active: bool,
}

/// A segment of the snapshot's final state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FinalSegment {
    /// Base address.
    pub addr: u64,
    /// Bytes.
    pub size: u64,
    /// Stream id.
    pub stream: u64,
    /// Small pool.
    pub small: bool,
    /// Expandable segment.
    pub expandable: bool,
    /// Its memory pool (`segment_pool_id`; `(0, 0)`: the default pools).
    pub pool: (i64, i64),
    /// Blocks in address order.
    pub blocks: Vec<FinalBlock>,
}

/// One device's history, normalized.
#[derive(Debug, Clone)]
pub struct Trace {
    /// A name for reports (file name, plus the device when several have events).
    pub name: String,
    /// Device ordinal in the recording.
    pub device: i64,
    /// The events in order.
    pub events: Vec<TraceEntry>,
    /// The final segments, when the source has them (snapshots only).
    pub final_segments: Option<Vec<FinalSegment>>,
    /// The config the recording ran under, when the snapshot's `allocator_settings` say:
    /// their `PYTORCH_CUDA_ALLOC_CONF`, under PyTorch's policy, or under the policy gpualloc
    /// wrote beside it (`gpualloc_devices::snapshot_pickle::POLICY_KEY`). None when absent or
    /// not in a syntax the replay knows.
    pub recorded_config: Option<AllocatorConfig>,
    /// The device's private pools as gpualloc recorded them (`allocator_settings`'
    /// `gpualloc_pools`): a replay makes each with its rules (quota, `use_on_oom`, unsplit
    /// blocks). Empty for other recordings.
    pub pools: Vec<PoolInfo>,
}

/// The config a snapshot's `allocator_settings` record (see [`Trace::recorded_config`]).
pub fn recorded_config(settings: &BTreeMap<String, Value>) -> Option<AllocatorConfig> {
    let Some(Value::Str(conf)) = settings.get("PYTORCH_CUDA_ALLOC_CONF") else {
        return None;
    };
    let config = AllocatorConfig::parse(conf).ok()?;
    let policy = match settings.get(POLICY_KEY) {
        Some(Value::Str(name)) => Policy::from_name(name)?,
        Some(_) => return None,
        None => Policy::Pytorch,
    };
    Some(config.with_policy(policy))
}

/// Loads every device's trace from `path`.
pub fn load(path: &Path) -> Result<Vec<Trace>, ReplayError> {
    let bytes = std::fs::read(path)
        .map_err(|e| ReplayError::Io(path.display().to_string(), e.to_string()))?;
    let name = path.file_name().map_or_else(
        || path.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    );
    from_bytes(&name, &bytes)
}

/// The formats a trace file can be in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Format {
    Pickle,
    RmmCsv,
    JsonLines,
}

/// Which format `bytes` are in, by content: a pickle of protocol 2 or later starts with the
/// PROTO opcode; one of protocol 0 or 1 (text-like) starts with the opcode that makes its top
/// value (`(` MARK, `}` or `d` a dict, `]` or `l` a list) and ends with STOP (`.`); an RMM log
/// starts with its CSV header; JSON Lines starts with `{` or a `#` comment. Anything else is
/// read as JSON Lines, whose parser says which line is wrong.
fn detect(bytes: &[u8]) -> Format {
    if bytes.first() == Some(&0x80) {
        return Format::Pickle;
    }
    let start = bytes.iter().position(|b| !b.is_ascii_whitespace());
    let end = bytes.iter().rposition(|b| !b.is_ascii_whitespace());
    let (Some(start), Some(end)) = (start, end) else {
        return Format::JsonLines;
    };
    let (first, last) = (bytes[start], bytes[end]);
    if start == 0 && matches!(first, b'(' | b'}' | b'd' | b']' | b'l') && last == b'.' {
        Format::Pickle
    } else if bytes[start..].starts_with(b"Thread,") {
        Format::RmmCsv
    } else {
        Format::JsonLines
    }
}

/// Loads traces from bytes (the format is chosen by content: see `detect`). Errors name `name`.
pub fn from_bytes(name: &str, bytes: &[u8]) -> Result<Vec<Trace>, ReplayError> {
    let parse = |source| ReplayError::Parse {
        file: name.to_string(),
        source,
    };
    let format = detect(bytes);
    if format == Format::Pickle {
        // The replay never looks at call stacks: not reading them halves the load time.
        let snapshot = Snapshot::from_pickle_without_frames(bytes).map_err(parse)?;
        return Ok(from_snapshot(name, snapshot));
    }
    let text = std::str::from_utf8(bytes).map_err(|_| {
        ReplayError::Format(format!(
            "{name}: not a PyTorch snapshot pickle, and not text (an RMM CSV log or JSON Lines)"
        ))
    })?;
    if text.trim().is_empty() {
        return Err(ReplayError::Format(format!("{name}: empty file")));
    }
    let events = match format {
        Format::RmmCsv => gpualloc_trace::rmm_csv::parse(text),
        _ => gpualloc_trace::jsonl::parse(text),
    }
    .map_err(parse)?;
    Ok(vec![Trace {
        name: name.to_string(),
        device: 0,
        events,
        final_segments: None,
        recorded_config: None,
        pools: Vec::new(),
    }])
}

/// One trace per device that has events or segments (a device with segments but no events
/// has a final state to summarize, and nothing to replay).
pub fn from_snapshot(name: &str, mut snap: Snapshot) -> Vec<Trace> {
    let recorded = snap.allocator_settings.as_ref().and_then(recorded_config);
    let with_events: Vec<usize> = (0..snap.device_traces.len())
        .filter(|&d| !snap.device_traces[d].is_empty())
        .chain(
            snap.segments
                .iter()
                .filter_map(|s| usize::try_from(s.device).ok()),
        )
        .collect::<std::collections::BTreeSet<usize>>()
        .into_iter()
        .collect();
    with_events
        .iter()
        .map(|&d| {
            let segments = snap
                .segments
                .iter()
                .filter(|s| s.device == d as i64)
                .map(|s| FinalSegment {
                    addr: s.address,
                    size: s.total_size,
                    stream: s.stream,
                    small: s.segment_type == SegmentType::Small,
                    expandable: s.is_expandable,
                    pool: s.segment_pool_id,
                    blocks: s
                        .blocks
                        .iter()
                        .map(|b| FinalBlock {
                            addr: b.address,
                            size: b.size,
                            requested: b.requested_size,
                            active: b.state != BlockState::Inactive,
                        })
                        .collect(),
                })
                .collect();
            Trace {
                name: if with_events.len() > 1 {
                    format!("{name}[device {d}]")
                } else {
                    name.to_string()
                },
                device: d as i64,
                events: snap
                    .device_traces
                    .get_mut(d)
                    .map(std::mem::take)
                    .unwrap_or_default(),
                final_segments: Some(segments),
                recorded_config: recorded.clone(),
                pools: snap
                    .allocator_settings
                    .as_ref()
                    .map(|s| recorded_pools(s, d as i64))
                    .unwrap_or_default(),
            }
        })
        .collect()
}

impl Trace {
    /// Number of events of `action`.
    pub fn count(&self, action: Action) -> usize {
        self.events.iter().filter(|e| e.action == action).count()
    }

    /// The config to replay the recording as it ran: [`Trace::recorded_config`], else
    /// PyTorch's defaults under PyTorch's policy (a snapshot that records no settings, or a
    /// log: PyTorch's own).
    pub fn config_as_recorded(&self) -> AllocatorConfig {
        self.recorded_config
            .clone()
            .unwrap_or_else(|| AllocatorConfig::default().with_policy(Policy::Pytorch))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(pairs: &[(&str, &str)]) -> BTreeMap<String, Value> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), Value::Str(v.to_string())))
            .collect()
    }

    #[test]
    fn the_recorded_config_and_whose_policy_ran() {
        let torch = AllocatorConfig::default().with_policy(Policy::Pytorch);
        // PyTorch's own snapshot: its config under its rules.
        let s = settings(&[("PYTORCH_CUDA_ALLOC_CONF", "")]);
        assert_eq!(recorded_config(&s), Some(torch.clone()));
        let s = settings(&[("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")]);
        let c = recorded_config(&s).unwrap();
        assert_eq!((c.max_split_size, c.policy), (128 << 20, Policy::Pytorch));
        // gpualloc's: the policy it names.
        let s = settings(&[
            ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"),
            (POLICY_KEY, "gpualloc"),
        ]);
        let c = recorded_config(&s).unwrap();
        assert!(c.expandable_segments);
        assert_eq!(c.policy, Policy::Gpualloc);
        // Nothing the replay can trust: none.
        assert_eq!(recorded_config(&BTreeMap::new()), None);
        let s = settings(&[("PYTORCH_CUDA_ALLOC_CONF", "no_such_key:1")]);
        assert_eq!(recorded_config(&s), None);
        let s = settings(&[("PYTORCH_CUDA_ALLOC_CONF", ""), (POLICY_KEY, "other")]);
        assert_eq!(recorded_config(&s), None);
        let mut s = settings(&[("PYTORCH_CUDA_ALLOC_CONF", "")]);
        s.insert(POLICY_KEY.to_string(), Value::Int(1));
        assert_eq!(recorded_config(&s), None);
    }
}
