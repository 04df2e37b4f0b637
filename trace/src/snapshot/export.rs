//! Writing [`Snapshot`] as the dict MemoryViz.js opens.

use super::{Block, Segment, Snapshot};
use crate::error::TraceError;
use crate::event::{Action, Frame, TraceEntry};
use crate::pickle::{self, Value};

impl Snapshot {
    /// The snapshot as the dict PyTorch writes: `segments`, `device_traces`, and
    /// `allocator_settings` / `external_annotations` when present. Every block and event
    /// carries `frames` (possibly empty): MemoryViz.js treats a block without `frames` as the
    /// legacy format.
    pub fn to_value(&self) -> Result<Value, TraceError> {
        let mut top = vec![
            (
                "segments",
                Value::List(
                    self.segments
                        .iter()
                        .map(segment_value)
                        .collect::<Result<_, _>>()?,
                ),
            ),
            (
                "device_traces",
                Value::List(
                    self.device_traces
                        .iter()
                        .map(|t| {
                            t.iter()
                                .map(event_value)
                                .collect::<Result<Vec<_>, _>>()
                                .map(Value::List)
                        })
                        .collect::<Result<_, _>>()?,
                ),
            ),
        ];
        if let Some(settings) = &self.allocator_settings {
            top.push((
                "allocator_settings",
                Value::str_dict(settings.iter().map(|(k, v)| (k.clone(), v.clone()))),
            ));
        }
        if let Some(annotations) = &self.external_annotations {
            top.push(("external_annotations", annotations.clone()));
        }
        Ok(Value::str_dict(top))
    }

    /// The snapshot as a pickle MemoryViz.js (and Python's `pickle`) opens; only the opcodes
    /// in [`MEMORYVIZ_WHITELIST`](crate::pickle::MEMORYVIZ_WHITELIST) are used. Fails if a
    /// number does not fit MemoryViz.js's 64-bit ints, or if `allocator_settings` /
    /// `external_annotations` hold bytes or sets.
    pub fn to_pickle(&self) -> Result<Vec<u8>, TraceError> {
        Ok(pickle::write(&self.to_value()?)?)
    }
}

fn int(field: &str, v: u64) -> Result<Value, TraceError> {
    i64::try_from(v)
        .map(Value::Int)
        .map_err(|_| TraceError::OutOfRange {
            field: field.to_owned(),
        })
}

fn frames_value(frames: &[Frame]) -> Value {
    Value::List(
        frames
            .iter()
            .map(|f| {
                Value::str_dict([
                    ("name", Value::Str(f.name.to_string())),
                    ("filename", Value::Str(f.filename.to_string())),
                    ("line", Value::Int(f.line)),
                ])
            })
            .collect(),
    )
}

fn segment_value(s: &Segment) -> Result<Value, TraceError> {
    Ok(Value::str_dict([
        ("device", Value::Int(s.device)),
        ("address", int("segments.address", s.address)?),
        ("total_size", int("segments.total_size", s.total_size)?),
        (
            "allocated_size",
            int("segments.allocated_size", s.allocated_size)?,
        ),
        ("active_size", int("segments.active_size", s.active_size)?),
        (
            "requested_size",
            int("segments.requested_size", s.requested_size)?,
        ),
        ("stream", int("segments.stream", s.stream)?),
        ("segment_type", Value::from(s.segment_type.as_str())),
        (
            "segment_pool_id",
            Value::Tuple(vec![
                Value::Int(s.segment_pool_id.0),
                Value::Int(s.segment_pool_id.1),
            ]),
        ),
        ("is_expandable", Value::Bool(s.is_expandable)),
        ("frames", frames_value(&s.frames)),
        (
            "blocks",
            Value::List(s.blocks.iter().map(block_value).collect::<Result<_, _>>()?),
        ),
    ]))
}

fn block_value(b: &Block) -> Result<Value, TraceError> {
    Ok(Value::str_dict([
        ("address", int("blocks.address", b.address)?),
        ("size", int("blocks.size", b.size)?),
        (
            "requested_size",
            int("blocks.requested_size", b.requested_size)?,
        ),
        ("state", Value::from(b.state.as_str())),
        ("frames", frames_value(&b.frames)),
    ]))
}

fn event_value(e: &TraceEntry) -> Result<Value, TraceError> {
    let mut items = vec![("action", Value::from(e.action.as_str()))];
    if e.action == Action::Oom {
        // PyTorch records the device's free bytes in place of the address.
        let free = e.device_free.unwrap_or(e.addr);
        items.push(("device_free", int("device_traces.device_free", free)?));
    } else {
        items.push(("addr", int("device_traces.addr", e.addr)?));
        if let Some(free) = e.device_free {
            items.push(("device_free", int("device_traces.device_free", free)?));
        }
    }
    items.push(("size", int("device_traces.size", e.size)?));
    items.push(("stream", int("device_traces.stream", e.stream)?));
    if let Some(t) = e.time_us {
        items.push(("time_us", Value::Int(t)));
    }
    items.push(("frames", frames_value(&e.frames)));
    if e.passed_over {
        items.push(("gpualloc_passed_over", Value::Bool(true)));
    }
    if e.borrowed {
        items.push(("gpualloc_borrowed", Value::Bool(true)));
    }
    if e.spilled {
        items.push(("gpualloc_spilled", Value::Bool(true)));
    }
    if let Some(n) = e.grouped_pages {
        items.push((
            "gpualloc_grouped_pages",
            int("device_traces.gpualloc_grouped_pages", n)?,
        ));
    }
    if let Some(n) = e.single_pages {
        items.push((
            "gpualloc_single_pages",
            int("device_traces.gpualloc_single_pages", n)?,
        ));
    }
    if let Some((a, b)) = e.pool_id {
        items.push((
            "segment_pool_id",
            Value::Tuple(vec![Value::Int(a), Value::Int(b)]),
        ));
    }
    Ok(Value::str_dict(items))
}
