//! The allocator's state ([`DeviceSnapshot`]s of `gpualloc-devices`) as a PyTorch memory
//! snapshot that PyTorch's memory viewer (`memory_viz`, MemoryViz.js) opens: `segments`,
//! `device_traces` and `allocator_settings`, written with only the pickle opcodes
//! MemoryViz.js decodes. Shared by the allocator (`Allocator::snapshot_pickle`) and the
//! replay tool (`gpualloc replay --export`).

use std::collections::BTreeMap;

use crate::pickle::Value;
use crate::{
    Action, Block, BlockState, Frame, Segment, SegmentType, Snapshot, TraceEntry, TraceError,
};
use gpualloc_devices::{AllocatorConfig, BlockStateName, DeviceSnapshot, TraceAction};

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
fn frames(frames: Option<&[gpualloc_devices::Frame]>) -> Vec<Frame> {
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
                    if e.action == TraceAction::Oom {
                        t.device_free = Some(e.addr);
                    }
                    t
                })
                .collect(),
        );
    }
    Snapshot {
        segments,
        device_traces,
        allocator_settings: Some(settings(config)),
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
