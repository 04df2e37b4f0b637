//! Reading snapshot pickles into [`Snapshot`].

use std::collections::BTreeMap;

use super::doc::{Doc, Path};
use super::{Block, BlockState, Segment, SegmentType, Snapshot};
use crate::error::TraceError;
use crate::event::{Action, TraceEntry};
use crate::pickle::{self, Budget, Id, Node};

impl Snapshot {
    /// Reads a snapshot pickle (as written by `torch.cuda.memory._dump_snapshot()`).
    ///
    /// The pickle is read by the safe reader: a pickle with GLOBAL, REDUCE or any other
    /// code-running opcode fails with [`TraceError::Pickle`]. A pickle whose top level is a
    /// list (the old list-of-segments format) or a dict without `device_traces` fails with
    /// [`TraceError::NoTrace`]. Wrong types, missing fields and negative sizes or addresses
    /// fail with an error naming the field.
    pub fn from_pickle(bytes: &[u8]) -> Result<Snapshot, TraceError> {
        Snapshot::read(bytes, true)
    }

    /// [`Snapshot::from_pickle`] without the call stacks: every `frames` list reads as empty,
    /// unexamined. Stacks are most of a real snapshot's size and of the time to read it, and
    /// a replay does not need them.
    pub fn from_pickle_without_frames(bytes: &[u8]) -> Result<Snapshot, TraceError> {
        Snapshot::read(bytes, false)
    }

    fn read(bytes: &[u8], keep_frames: bool) -> Result<Snapshot, TraceError> {
        let (arena, root) = pickle::parse(bytes)?;
        let mut doc = Doc::new(&arena, Budget::for_snapshot(bytes.len()));
        doc.keep_frames = keep_frames;
        read_snapshot(&mut doc, root)
    }
}

fn read_snapshot(doc: &mut Doc<'_>, root: Id) -> Result<Snapshot, TraceError> {
    let top = Path::Root;
    let items = match doc.node(root) {
        Node::Dict(items) => items,
        Node::List(_) => {
            return Err(TraceError::NoTrace {
                reason: "the top level is a list of segments (the old snapshot format, \
                         recorded without _record_memory_history)"
                    .to_owned(),
            })
        }
        _ => return Err(doc.wrong(root, &top, "dict")),
    };
    let Some(traces_id) = doc.field(items, "device_traces") else {
        return Err(TraceError::NoTrace {
            reason: "the snapshot has no `device_traces` (history recording was off)".to_owned(),
        });
    };

    let mut snapshot = Snapshot::default();

    if let Some(segs) = doc.field(items, "segments") {
        let path = top.key("segments");
        let ids = doc.seq(segs, &path)?;
        snapshot.segments.reserve(ids.len());
        for (i, &id) in ids.iter().enumerate() {
            snapshot
                .segments
                .push(read_segment(doc, id, &path.index(i))?);
        }
    }

    let path = top.key("device_traces");
    let devices = doc.seq(traces_id, &path)?;
    for (d, &dev) in devices.iter().enumerate() {
        let dpath = path.index(d);
        let events = doc.seq(dev, &dpath)?;
        let mut out = Vec::with_capacity(events.len());
        for (i, &ev) in events.iter().enumerate() {
            out.push(read_event(doc, ev, &dpath.index(i))?);
        }
        snapshot.device_traces.push(out);
    }

    if let Some(settings) = doc.field(items, "allocator_settings") {
        let path = top.key("allocator_settings");
        let mut map = BTreeMap::new();
        for (i, &(k, v)) in doc.dict(settings, &path)?.iter().enumerate() {
            let key = doc.str(k, &path.index(i))?.to_owned();
            map.insert(key, doc.value(v)?);
        }
        snapshot.allocator_settings = Some(map);
    }
    if let Some(annotations) = doc.field(items, "external_annotations") {
        snapshot.external_annotations = Some(doc.value(annotations)?);
    }
    Ok(snapshot)
}

fn opt_u64(
    doc: &Doc<'_>,
    items: &[(Id, Id)],
    path: &Path<'_>,
    key: &'static str,
    default: u64,
) -> Result<u64, TraceError> {
    match doc.field(items, key) {
        Some(id) => doc.u64(id, &path.key(key)),
        None => Ok(default),
    }
}

/// `segment_pool_id`, a pair of ints, when present.
fn pool_id(
    doc: &mut Doc<'_>,
    items: &[(Id, Id)],
    path: &Path<'_>,
) -> Result<Option<(i64, i64)>, TraceError> {
    let Some(v) = doc.field(items, "segment_pool_id") else {
        return Ok(None);
    };
    let p = path.key("segment_pool_id");
    match doc.seq(v, &p)? {
        &[a, b] => Ok(Some((doc.i64(a, &p.index(0))?, doc.i64(b, &p.index(1))?))),
        _ => Err(doc.wrong(v, &p, "a pair of ints")),
    }
}

fn read_segment(doc: &mut Doc<'_>, id: Id, path: &Path<'_>) -> Result<Segment, TraceError> {
    let items = doc.dict(id, path)?;
    let address = doc.u64(doc.required(items, path, "address")?, &path.key("address"))?;
    let total_size = doc.u64(
        doc.required(items, path, "total_size")?,
        &path.key("total_size"),
    )?;
    let device = match doc.field(items, "device") {
        Some(v) => doc.i64(v, &path.key("device"))?,
        None => 0,
    };
    let segment_type = match doc.field(items, "segment_type") {
        None => SegmentType::Large,
        Some(v) => {
            let p = path.key("segment_type");
            match doc.str(v, &p)? {
                "small" => SegmentType::Small,
                "large" => SegmentType::Large,
                other => {
                    return Err(TraceError::UnknownValue {
                        field: p.render(),
                        value: other.to_owned(),
                    })
                }
            }
        }
    };
    let segment_pool_id = pool_id(doc, items, path)?.unwrap_or((0, 0));
    let is_expandable = match doc.field(items, "is_expandable") {
        Some(v) => doc.bool(v, &path.key("is_expandable"))?,
        None => false,
    };
    let frames = doc.frames(items, path)?;

    let bpath = path.key("blocks");
    let block_ids = match doc.field(items, "blocks") {
        Some(v) => doc.seq(v, &bpath)?,
        None => &[],
    };
    let mut blocks = Vec::with_capacity(block_ids.len());
    let mut next = address;
    for (i, &b) in block_ids.iter().enumerate() {
        let block = read_block(doc, b, &bpath.index(i), next)?;
        next = block.address.saturating_add(block.size);
        blocks.push(block);
    }

    Ok(Segment {
        device,
        address,
        total_size,
        allocated_size: opt_u64(doc, items, path, "allocated_size", 0)?,
        active_size: opt_u64(doc, items, path, "active_size", 0)?,
        requested_size: opt_u64(doc, items, path, "requested_size", 0)?,
        stream: opt_u64(doc, items, path, "stream", 0)?,
        segment_type,
        segment_pool_id,
        is_expandable,
        frames,
        blocks,
    })
}

/// `next` is where the block starts if it has no `address` (old snapshots: blocks tile the
/// segment in order).
fn read_block(doc: &mut Doc<'_>, id: Id, path: &Path<'_>, next: u64) -> Result<Block, TraceError> {
    let items = doc.dict(id, path)?;
    let size = doc.u64(doc.required(items, path, "size")?, &path.key("size"))?;
    let address = opt_u64(doc, items, path, "address", next)?;
    let requested_size = opt_u64(doc, items, path, "requested_size", size)?;
    let spath = path.key("state");
    let state_name = doc.str(doc.required(items, path, "state")?, &spath)?;
    let state = BlockState::from_name(state_name).ok_or_else(|| TraceError::UnknownValue {
        field: spath.render(),
        value: state_name.to_owned(),
    })?;
    let frames = if doc.field(items, "frames").is_some() {
        doc.frames(items, path)?
    } else {
        // Old format: the stack lives in history[0].frames.
        match doc.field(items, "history") {
            Some(h) => {
                let hpath = path.key("history");
                match doc.seq(h, &hpath)?.first() {
                    Some(&first) => {
                        let fpath = hpath.index(0);
                        let first_items = doc.dict(first, &fpath)?;
                        doc.frames(first_items, &fpath)?
                    }
                    None => Vec::new(),
                }
            }
            None => Vec::new(),
        }
    };
    Ok(Block {
        address,
        size,
        requested_size,
        state,
        frames,
    })
}

fn read_event(doc: &mut Doc<'_>, id: Id, path: &Path<'_>) -> Result<TraceEntry, TraceError> {
    let items = doc.dict(id, path)?;
    let apath = path.key("action");
    let name = doc.str(doc.required(items, path, "action")?, &apath)?;
    let action = Action::from_name(name).ok_or_else(|| TraceError::UnknownValue {
        field: apath.render(),
        value: name.to_owned(),
    })?;
    // PyTorch writes `device_free` instead of `addr` for OOM events.
    let optional_addr = matches!(action, Action::Oom | Action::Snapshot);
    let addr = match doc.field(items, "addr") {
        Some(v) => doc.u64(v, &path.key("addr"))?,
        None if optional_addr => 0,
        None => return Err(doc_missing(path, "addr")),
    };
    let size = match doc.field(items, "size") {
        Some(v) => doc.u64(v, &path.key("size"))?,
        None if action == Action::Snapshot => 0,
        None => return Err(doc_missing(path, "size")),
    };
    let stream = opt_u64(doc, items, path, "stream", 0)?;
    let time_us = match doc.field(items, "time_us") {
        Some(v) => Some(doc.i64(v, &path.key("time_us"))?),
        None => None,
    };
    let device_free = match doc.field(items, "device_free") {
        Some(v) => Some(doc.u64(v, &path.key("device_free"))?),
        None => None,
    };
    let frames = doc.frames(items, path)?;
    let pool_id = pool_id(doc, items, path)?;
    let passed_over = match doc.field(items, "gpualloc_passed_over") {
        Some(v) => doc.bool(v, &path.key("gpualloc_passed_over"))?,
        None => false,
    };
    let borrowed = match doc.field(items, "gpualloc_borrowed") {
        Some(v) => doc.bool(v, &path.key("gpualloc_borrowed"))?,
        None => false,
    };
    let spilled = match doc.field(items, "gpualloc_spilled") {
        Some(v) => doc.bool(v, &path.key("gpualloc_spilled"))?,
        None => false,
    };
    let grouped_pages = match doc.field(items, "gpualloc_grouped_pages") {
        Some(v) => Some(doc.u64(v, &path.key("gpualloc_grouped_pages"))?),
        None => None,
    };
    let single_pages = match doc.field(items, "gpualloc_single_pages") {
        Some(v) => Some(doc.u64(v, &path.key("gpualloc_single_pages"))?),
        None => None,
    };
    Ok(TraceEntry {
        action,
        addr,
        size,
        stream,
        time_us,
        device_free,
        frames,
        pool_id,
        passed_over,
        borrowed,
        spilled,
        grouped_pages,
        single_pages,
    })
}

fn doc_missing(path: &Path<'_>, key: &'static str) -> TraceError {
    TraceError::MissingField {
        field: path.key(key).render(),
    }
}
