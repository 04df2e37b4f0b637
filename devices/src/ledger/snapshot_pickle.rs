//! The allocator's state ([`DeviceSnapshot`]s) as a PyTorch memory snapshot (the format is
//! `gpualloc-trace`'s, a leaf crate that knows nothing of the core) that PyTorch's memory viewer (`memory_viz`, MemoryViz.js) opens: `segments`,
//! `device_traces` and `allocator_settings`, written with only the pickle opcodes
//! MemoryViz.js decodes. Shared by the allocator (`Allocator::snapshot_pickle`) and the
//! replay tool (`gpualloc replay --export`).

use std::collections::BTreeMap;

use gpualloc_trace::pickle::Value;
use gpualloc_trace::{
    Action, Block, BlockState, Frame, Segment, SegmentType, Snapshot, TraceEntry, TraceError,
};

use crate::{AllocatorConfig, BlockStateName, DeviceSnapshot, PoolInfo, PoolOptions, TraceAction};

fn action(a: TraceAction) -> Action {
    match a {
        TraceAction::Alloc => Action::Alloc,
        TraceAction::FreeRequested => Action::FreeRequested,
        TraceAction::FreeCompleted => Action::FreeCompleted,
        TraceAction::SegmentAlloc => Action::SegmentAlloc,
        TraceAction::SegmentFree => Action::SegmentFree,
        TraceAction::SegmentMap => Action::SegmentMap,
        TraceAction::SegmentUnmap => Action::SegmentUnmap,
        TraceAction::Oom => Action::Oom,
        TraceAction::Snapshot => Action::Snapshot,
    }
}

/// The allocator's frames in PyTorch's form.
fn frames(frames: Option<&[crate::Frame]>) -> Vec<Frame> {
    frames
        .unwrap_or_default()
        .iter()
        .map(|f| Frame {
            filename: f.filename.as_str().into(),
            line: i64::from(f.line),
            name: f.name.as_str().into(),
        })
        .collect()
}

/// The `allocator_settings` key naming the policy of a snapshot gpualloc wrote.
pub const POLICY_KEY: &str = "gpualloc_policy";

/// The `allocator_settings` key listing the private pools of the devices (gpualloc's own, as
/// [`POLICY_KEY`]): one dict per pool with its `device`, `id`, `name`, `named`, `quota`,
/// `use_on_oom` and `unsplit` (-1 for none), so a replay makes the pools the history's
/// `segment_pool_id`s name with the rules they had.
pub const POOLS_KEY: &str = "gpualloc_pools";

fn pools_value(devices: &[DeviceSnapshot]) -> Value {
    let int = |v: Option<u64>| Value::Int(v.and_then(|v| i64::try_from(v).ok()).unwrap_or(-1));
    let pools = devices.iter().enumerate().flat_map(|(d, snap)| {
        snap.pools.iter().map(move |p| {
            Value::str_dict([
                ("device", Value::Int(d as i64)),
                ("id", int(Some(p.id))),
                ("name", Value::Str(p.name.clone())),
                ("named", Value::Bool(p.named)),
                ("quota", int(p.options.quota)),
                ("use_on_oom", Value::Bool(p.options.use_on_oom)),
                ("unsplit", int(p.options.unsplit)),
            ])
        })
    });
    Value::List(pools.collect())
}

/// The pools [`POOLS_KEY`] lists for device `device` (none where the key is absent; an
/// entry not in the shape written is skipped).
pub fn recorded_pools(settings: &BTreeMap<String, Value>, device: i64) -> Vec<PoolInfo> {
    let Some(Value::List(pools)) = settings.get(POOLS_KEY) else {
        return Vec::new();
    };
    let bytes = |v: Option<&Value>| match v {
        Some(&Value::Int(n)) if n >= 0 => Some(Some(n as u64)),
        Some(Value::Int(-1)) => Some(None),
        _ => None,
    };
    pools
        .iter()
        .filter_map(|p| {
            let Some(&Value::Int(d)) = p.get("device") else {
                return None;
            };
            let (Some(Value::Str(name)), Some(&Value::Bool(named)), Some(&Value::Bool(use_on_oom))) =
                (p.get("name"), p.get("named"), p.get("use_on_oom"))
            else {
                return None;
            };
            let info = PoolInfo {
                id: bytes(p.get("id"))??,
                name: name.clone(),
                named,
                options: PoolOptions {
                    quota: bytes(p.get("quota"))?,
                    use_on_oom,
                    unsplit: bytes(p.get("unsplit"))?,
                },
            };
            (d == device).then_some(info)
        })
        .collect()
}

/// PyTorch's `allocator_settings` dict for `config`, and [`POLICY_KEY`].
fn settings(config: &AllocatorConfig) -> BTreeMap<String, Value> {
    let mut m = BTreeMap::new();
    let int = |v: u64| Value::Int(i64::try_from(v).unwrap_or(-1));
    m.insert(
        "PYTORCH_CUDA_ALLOC_CONF".to_string(),
        Value::Str(config.to_string()),
    );
    // Not one of PyTorch's keys (its viewer shows the dict as it is): says gpualloc wrote the
    // file, and whose rules ran, for a replay under the recorded config.
    m.insert(
        POLICY_KEY.to_string(),
        Value::Str(config.policy.name().to_string()),
    );
    m.insert(
        "max_split_size".to_string(),
        if config.max_split_size == u64::MAX {
            Value::Int(-1)
        } else {
            int(config.max_split_size)
        },
    );
    m.insert(
        "garbage_collection_threshold".to_string(),
        Value::Float(config.garbage_collection_threshold),
    );
    m.insert(
        "expandable_segments".to_string(),
        Value::Bool(config.expandable_segments),
    );
    m.insert(
        "release_lock_on_cudamalloc".to_string(),
        Value::Bool(config.release_lock_on_device_malloc),
    );
    let bands = config
        .roundup_power2_divisions
        .iter()
        .enumerate()
        .map(|(i, n)| (Value::Str((1u64 << i).to_string()), int(*n)))
        .collect();
    m.insert("roundup_power2_divisions".to_string(), Value::Dict(bands));
    m
}

/// The snapshot of `devices` (index = device ordinal) in PyTorch's typed form.
pub fn to_snapshot(devices: &[DeviceSnapshot], config: &AllocatorConfig) -> Snapshot {
    let mut segments = Vec::new();
    let mut device_traces = Vec::with_capacity(devices.len());
    for snap in devices {
        for s in &snap.segments {
            segments.push(Segment {
                device: i64::from(s.device),
                address: s.address,
                total_size: s.total_size,
                allocated_size: s.allocated_size,
                active_size: s.active_size,
                requested_size: s.requested_size,
                stream: s.stream,
                segment_type: if s.is_small {
                    SegmentType::Small
                } else {
                    SegmentType::Large
                },
                segment_pool_id: (s.pool_id.0 as i64, s.pool_id.1 as i64),
                is_expandable: s.is_expandable,
                frames: Vec::new(),
                blocks: s
                    .blocks
                    .iter()
                    .map(|b| Block {
                        address: b.address,
                        size: b.size,
                        requested_size: b.requested_size,
                        state: match b.state {
                            BlockStateName::ActiveAllocated => BlockState::ActiveAllocated,
                            BlockStateName::ActivePendingFree => BlockState::ActivePendingFree,
                            BlockStateName::Inactive => BlockState::Inactive,
                        },
                        frames: frames(b.frames.as_deref()),
                    })
                    .collect(),
            });
        }
        device_traces.push(
            snap.trace
                .iter()
                .map(|e| {
                    let mut t = TraceEntry::new(action(e.action), e.addr, e.size, e.stream);
                    t.time_us = i64::try_from(e.time_us).ok();
                    t.frames = frames(e.frames.as_deref());
                    if e.pool != 0 {
                        t.pool_id = Some((0, e.pool as i64));
                    }
                    t.passed_over = e.passed_over;
                    t.borrowed = e.borrowed;
                    t.spilled = e.spilled;
                    t.grouped_pages = e.grouped_pages;
                    t.single_pages = e.single_pages;
                    if e.action == TraceAction::Oom {
                        t.device_free = Some(e.addr);
                    }
                    t
                })
                .collect(),
        );
    }
    let mut settings = settings(config);
    if devices.iter().any(|d| !d.pools.is_empty()) {
        settings.insert(POOLS_KEY.to_string(), pools_value(devices));
    }
    Snapshot {
        segments,
        device_traces,
        allocator_settings: Some(settings),
        external_annotations: None,
    }
}

/// The snapshot as pickle bytes MemoryViz.js opens.
pub fn to_pickle(
    devices: &[DeviceSnapshot],
    config: &AllocatorConfig,
) -> Result<Vec<u8>, TraceError> {
    to_snapshot(devices, config).to_pickle()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(id: u64, quota: Option<u64>, named: bool) -> PoolInfo {
        PoolInfo {
            id,
            name: format!("p{id}"),
            named,
            options: PoolOptions {
                quota,
                use_on_oom: !named,
                unsplit: quota.map(|_| 2 << 20),
            },
        }
    }

    /// The pools of each device are written into `allocator_settings` and read back per
    /// device through a pickle; a snapshot without pools has no such key; an entry of
    /// another shape is skipped.
    #[test]
    fn pools_are_recorded_per_device_and_read_back() {
        let config = AllocatorConfig::default();
        let devices = [
            DeviceSnapshot {
                pools: vec![pool(1, None, true), pool(2, Some(64 << 20), true)],
                ..DeviceSnapshot::default()
            },
            DeviceSnapshot {
                pools: vec![pool(1, Some(1 << 30), false)],
                ..DeviceSnapshot::default()
            },
        ];
        let bytes = to_pickle(&devices, &config).unwrap();
        let mut settings = Snapshot::from_pickle(&bytes)
            .unwrap()
            .allocator_settings
            .unwrap();
        assert_eq!(recorded_pools(&settings, 0), devices[0].pools);
        assert_eq!(recorded_pools(&settings, 1), devices[1].pools);
        assert_eq!(recorded_pools(&settings, 2), []);
        if let Some(Value::List(list)) = settings.get_mut(POOLS_KEY) {
            list.push(Value::Int(3));
            if let Value::Dict(items) = &mut list[0] {
                items.retain(|(k, _)| k.as_str() != Some("named"));
            }
        }
        assert_eq!(recorded_pools(&settings, 0), devices[0].pools[1..]);
        let none = to_snapshot(&[DeviceSnapshot::default()], &config);
        assert!(!none.allocator_settings.unwrap().contains_key(POOLS_KEY));
    }
}
