//! Snapshot import: every shape seen in the wild, and bad input as typed errors naming the
//! field.

use gpualloc_trace::pickle::{self, Value};
use gpualloc_trace::{Action, BlockState, Frame, PickleError, SegmentType, Snapshot, TraceError};

fn s(x: &str) -> Value {
    Value::Str(x.to_owned())
}

fn frame(file: &str, line: i64, name: &str) -> Value {
    Value::str_dict([
        ("filename", s(file)),
        ("line", Value::Int(line)),
        ("name", s(name)),
    ])
}

fn event(action: &str, addr: i64, size: i64) -> Value {
    Value::str_dict([
        ("action", s(action)),
        ("addr", Value::Int(addr)),
        ("size", Value::Int(size)),
        ("stream", Value::Int(0)),
        ("frames", Value::List(vec![frame("train.py", 10, "step")])),
    ])
}

/// A small modern snapshot as a Value; tests mutate it to make bad input.
fn modern() -> Value {
    let block = |addr: i64, size: i64, state: &str| {
        Value::str_dict([
            ("address", Value::Int(addr)),
            ("size", Value::Int(size)),
            ("requested_size", Value::Int(size - 16)),
            ("state", s(state)),
            ("frames", Value::List(vec![])),
        ])
    };
    let base: i64 = 0x7f00_0000_0000;
    Value::str_dict([
        (
            "segments",
            Value::List(vec![Value::str_dict([
                ("device", Value::Int(0)),
                ("address", Value::Int(base)),
                ("total_size", Value::Int(2 << 20)),
                ("allocated_size", Value::Int(1 << 20)),
                ("active_size", Value::Int(1 << 20)),
                ("requested_size", Value::Int((1 << 20) - 16)),
                ("stream", Value::Int(0)),
                ("segment_type", s("small")),
                (
                    "segment_pool_id",
                    Value::Tuple(vec![Value::Int(0), Value::Int(0)]),
                ),
                ("is_expandable", Value::Bool(false)),
                ("frames", Value::List(vec![])),
                (
                    "blocks",
                    Value::List(vec![
                        block(base, 1 << 20, "active_allocated"),
                        block(base + (1 << 20), 1 << 20, "inactive"),
                    ]),
                ),
            ])]),
        ),
        (
            "device_traces",
            Value::List(vec![Value::List(vec![
                event("segment_alloc", base, 2 << 20),
                event("alloc", base, 1 << 20),
                Value::str_dict([
                    ("action", s("oom")),
                    ("device_free", Value::Int(1234)),
                    ("size", Value::Int(1 << 40)),
                    ("stream", Value::Int(0)),
                    ("time_us", Value::Int(99)),
                    ("compile_context", s("N/A")),
                    ("frames", Value::List(vec![])),
                ]),
            ])]),
        ),
        (
            "allocator_settings",
            Value::str_dict([("expandable_segments", Value::Bool(false))]),
        ),
        ("external_annotations", Value::List(vec![])),
        ("unknown_future_key", Value::Int(1)),
    ])
}

fn load(v: &Value) -> Result<Snapshot, TraceError> {
    Snapshot::from_pickle(&pickle::write(v).unwrap())
}

/// Replaces the value at `path` (string keys and list indices) in `v`.
fn set(v: &mut Value, path: &[&str], new: Option<Value>) {
    let (first, rest) = path.split_first().unwrap();
    match v {
        Value::Dict(items) => {
            let pos = items
                .iter()
                .position(|(k, _)| k.as_str() == Some(first))
                .unwrap();
            if rest.is_empty() {
                match new {
                    Some(n) => items[pos].1 = n,
                    None => {
                        items.remove(pos);
                    }
                }
            } else {
                set(&mut items[pos].1, rest, new);
            }
        }
        Value::List(items) => {
            let i: usize = first.parse().unwrap();
            if rest.is_empty() {
                items[i] = new.unwrap();
            } else {
                set(&mut items[i], rest, new);
            }
        }
        _ => panic!("cannot descend into {v:?}"),
    }
}

#[test]
fn modern_snapshot_loads_every_field() {
    let snap = load(&modern()).unwrap();
    assert_eq!(snap.segments.len(), 1);
    let seg = &snap.segments[0];
    assert_eq!(seg.address, 0x7f00_0000_0000);
    assert_eq!(seg.total_size, 2 << 20);
    assert_eq!(seg.segment_type, SegmentType::Small);
    assert_eq!(seg.blocks[1].state, BlockState::Inactive);
    assert_eq!(seg.blocks[1].address, 0x7f00_0010_0000);
    assert_eq!(seg.blocks[1].requested_size, (1 << 20) - 16);
    let trace = &snap.device_traces[0];
    assert_eq!(trace.len(), 3);
    assert_eq!(trace[1].action, Action::Alloc);
    assert_eq!(trace[1].frames, vec![Frame::new("train.py", 10, "step")]);
    assert_eq!(trace[2].action, Action::Oom);
    assert_eq!(trace[2].addr, 0);
    assert_eq!(trace[2].device_free, Some(1234));
    assert_eq!(trace[2].time_us, Some(99));
    assert_eq!(
        snap.allocator_settings
            .as_ref()
            .unwrap()
            .get("expandable_segments"),
        Some(&Value::Bool(false))
    );
    // Export and re-import is lossless for everything the model keeps.
    let again = Snapshot::from_pickle(&snap.to_pickle().unwrap()).unwrap();
    assert_eq!(again, snap);
}

#[test]
fn legacy_blocks_without_address_or_requested_size() {
    // Old snapshots: blocks tile the segment, stacks in history[0].frames.
    let mut v = modern();
    let legacy_block = |size: i64, with_history: bool| {
        let mut items = vec![("size", Value::Int(size)), ("state", s("active_allocated"))];
        if with_history {
            items.push((
                "history",
                Value::List(vec![Value::str_dict([
                    ("addr", Value::Int(0)),
                    ("real_size", Value::Int(size)),
                    ("frames", Value::List(vec![frame("old.py", 1, "f")])),
                ])]),
            ));
        }
        Value::str_dict(items)
    };
    set(
        &mut v,
        &["segments", "0", "blocks"],
        Some(Value::List(vec![
            legacy_block(512, true),
            legacy_block(1536, false),
        ])),
    );
    set(&mut v, &["segments", "0", "segment_type"], None);
    set(&mut v, &["segments", "0", "segment_pool_id"], None);
    set(&mut v, &["segments", "0", "is_expandable"], None);
    set(&mut v, &["allocator_settings"], None);
    set(&mut v, &["external_annotations"], None);
    let snap = load(&v).unwrap();
    let seg = &snap.segments[0];
    assert_eq!(seg.segment_type, SegmentType::Large);
    assert_eq!(seg.segment_pool_id, (0, 0));
    assert_eq!(seg.blocks[0].address, 0x7f00_0000_0000);
    assert_eq!(seg.blocks[1].address, 0x7f00_0000_0200);
    assert_eq!(seg.blocks[1].requested_size, 1536);
    assert_eq!(seg.blocks[0].frames, vec![Frame::new("old.py", 1, "f")]);
    assert!(snap.allocator_settings.is_none());
}

#[test]
fn old_list_of_segments_has_no_trace() {
    let err =
        Snapshot::from_pickle(include_bytes!("data/old_list_of_segments.pickle")).unwrap_err();
    assert!(matches!(err, TraceError::NoTrace { .. }));
    assert!(
        err.to_string().starts_with("no trace in this snapshot"),
        "{err}"
    );
    let mut v = modern();
    set(&mut v, &["device_traces"], None);
    assert!(matches!(load(&v), Err(TraceError::NoTrace { .. })));
    assert!(matches!(
        load(&Value::Int(3)),
        Err(TraceError::WrongType {
            expected: "dict",
            found: "int",
            ..
        })
    ));
}

#[test]
fn bad_fields_are_named() {
    let field = |e: TraceError| match e {
        TraceError::Negative { field, .. }
        | TraceError::WrongType { field, .. }
        | TraceError::MissingField { field }
        | TraceError::UnknownValue { field, .. }
        | TraceError::OutOfRange { field } => field,
        other => panic!("unexpected {other:?}"),
    };
    let cases: Vec<(Vec<&str>, Option<Value>, &str)> = vec![
        (
            vec!["segments", "0", "blocks", "1", "size"],
            Some(Value::Int(-4096)),
            "segments[0].blocks[1].size",
        ),
        (
            vec!["segments", "0", "address"],
            Some(Value::Int(-1)),
            "segments[0].address",
        ),
        (
            vec!["device_traces", "0", "1", "addr"],
            Some(s("0x10")),
            "device_traces[0][1].addr",
        ),
        (
            vec!["device_traces", "0", "1", "size"],
            Some(Value::Int(-8)),
            "device_traces[0][1].size",
        ),
        (
            vec!["device_traces", "0", "0", "action"],
            Some(s("malloc")),
            "device_traces[0][0].action",
        ),
        (
            vec!["device_traces", "0", "1", "addr"],
            None,
            "device_traces[0][1].addr",
        ),
        (
            vec!["segments", "0", "total_size"],
            None,
            "segments[0].total_size",
        ),
        (
            vec!["segments", "0", "blocks", "0", "state"],
            Some(s("weird")),
            "segments[0].blocks[0].state",
        ),
        (
            vec!["segments", "0", "segment_type"],
            Some(Value::Int(1)),
            "segments[0].segment_type",
        ),
        (
            vec!["segments", "0", "blocks"],
            Some(Value::Int(1)),
            "segments[0].blocks",
        ),
        (
            vec!["device_traces", "0"],
            Some(Value::None),
            "device_traces[0]",
        ),
        (
            vec!["device_traces", "0", "1", "frames"],
            Some(Value::List(vec![Value::Int(1)])),
            "device_traces[0][1].frames[0]",
        ),
        (
            vec!["device_traces", "0", "1", "frames"],
            Some(Value::List(vec![Value::str_dict([("line", s("x"))])])),
            "device_traces[0][1].frames[0].line",
        ),
        (
            vec!["allocator_settings"],
            Some(Value::List(vec![])),
            "allocator_settings",
        ),
    ];
    for (path, new, expected) in cases {
        let mut v = modern();
        set(&mut v, &path, new);
        let err = load(&v).unwrap_err();
        let msg = err.to_string();
        assert_eq!(field(err), expected);
        assert!(msg.contains(expected), "{msg}");
    }
    // An address of 2^63 and more does not fit an i64 but is a valid u64; 2^64 is too big.
    let big = Snapshot::from_pickle(include_bytes!("data/addr_2_63.pickle")).unwrap();
    assert_eq!(big.device_traces[0][0].addr, (1 << 63) + 5);
    assert_eq!(
        Snapshot::from_pickle(include_bytes!("data/size_2_64.pickle")),
        Err(TraceError::OutOfRange {
            field: "device_traces[0][0].size".into()
        })
    );
    // ... and cannot be exported to MemoryViz.js's 64-bit signed ints.
    assert_eq!(
        big.to_pickle(),
        Err(TraceError::OutOfRange {
            field: "device_traces.addr".into()
        })
    );
}

#[test]
fn code_running_snapshots_are_refused() {
    // A snapshot-looking pickle whose `segments` is built by calling os.system.
    let evil = b"\x80\x02}q\x00(X\x08\x00\x00\x00segmentsq\x01cposix\nsystem\nq\x02X\x02\x00\x00\x00idq\x03\x85q\x04Rq\x05u.";
    match Snapshot::from_pickle(evil) {
        Err(TraceError::Pickle(PickleError::Forbidden {
            opcode: "GLOBAL",
            offset,
            ..
        })) => {
            assert_eq!(offset, 21)
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn shared_frame_lists_cannot_blow_up_memory() {
    // One list of 10,000 frames shared by 1,000 events: 10 million frames (400 MB) if
    // copied naively, from a 60 KB pickle.
    use gpualloc_trace::pickle::opcodes as op;
    let key = |out: &mut Vec<u8>, k: &str| {
        out.extend_from_slice(&[op::SHORT_BINUNICODE, k.len() as u8]);
        out.extend_from_slice(k.as_bytes());
    };
    let mut body = vec![op::PROTO, 4, op::EMPTY_DICT, op::MARK];
    key(&mut body, "device_traces");
    body.extend_from_slice(&[op::EMPTY_LIST, op::EMPTY_LIST, op::MARK]);
    // The first event defines the shared frames list (memo 0), the rest refer to it.
    for i in 0..1_000u32 {
        body.extend_from_slice(&[op::EMPTY_DICT, op::MARK]);
        key(&mut body, "action");
        key(&mut body, "alloc");
        key(&mut body, "addr");
        body.extend_from_slice(&[op::BININT1, 1]);
        key(&mut body, "size");
        body.extend_from_slice(&[op::BININT1, 1]);
        key(&mut body, "frames");
        if i == 0 {
            body.extend_from_slice(&[op::EMPTY_LIST, op::MEMOIZE, op::MARK]);
            body.extend(std::iter::repeat_n(op::EMPTY_DICT, 10_000));
            body.push(op::APPENDS);
        } else {
            body.extend_from_slice(&[op::BINGET, 0]);
        }
        body.push(op::SETITEMS);
    }
    body.extend_from_slice(&[op::APPENDS, op::APPEND, op::SETITEMS, op::STOP]);
    assert!(body.len() < 70_000, "{}", body.len());
    match Snapshot::from_pickle(&body) {
        Err(TraceError::Pickle(PickleError::ExpansionLimit { limit })) => {
            assert_eq!(limit, 64 << 20)
        }
        other => panic!("{:?}", other.map(|s| s.event_count())),
    }
}

/// gpualloc's `segment_map` whose handles end where its request ended carries
/// `gpualloc_grouped_pages` and `gpualloc_single_pages`: read, written back, absent where the
/// event has none, and a value that is not a count is named.
#[test]
fn a_maps_grouped_pages_read_and_write_back() {
    let mut v = modern();
    let mut map = event("segment_map", 0x7f00_0000_0000, 10 << 20);
    if let Value::Dict(items) = &mut map {
        items.push((s("gpualloc_grouped_pages"), Value::Int(3)));
        items.push((s("gpualloc_single_pages"), Value::Int(2)));
    }
    set(&mut v, &["device_traces", "0", "1"], Some(map));
    let snap = load(&v).unwrap();
    let trace = &snap.device_traces[0];
    assert_eq!(
        (trace[1].grouped_pages, trace[1].single_pages),
        (Some(3), Some(2))
    );
    assert_eq!(
        (trace[0].grouped_pages, trace[0].single_pages),
        (None, None)
    );
    let again = Snapshot::from_pickle(&snap.to_pickle().unwrap()).unwrap();
    assert_eq!(again, snap);
    for key in ["gpualloc_grouped_pages", "gpualloc_single_pages"] {
        let mut bad = v.clone();
        set(
            &mut bad,
            &["device_traces", "0", "1", key],
            Some(Value::Int(-1)),
        );
        let err = load(&bad).unwrap_err().to_string();
        assert!(err.contains(&format!("device_traces[0][1].{key}")), "{err}");
    }
}

/// gpualloc's events in a private pool carry its `segment_pool_id`, and an `alloc` served by
/// a passed-over block `gpualloc_passed_over`, one served by a loan `gpualloc_borrowed`, a
/// small request served by the large pool `gpualloc_spilled` (keys of its own, which PyTorch's readers ignore): read, written back, and absent where
/// the event has none.
#[test]
fn an_events_pool_id_reads_and_writes_back() {
    let mut v = modern();
    let mut alloc = event("alloc", 0x7f00_0000_0000, 1 << 20);
    if let Value::Dict(items) = &mut alloc {
        items.push((
            s("segment_pool_id"),
            Value::Tuple(vec![Value::Int(0), Value::Int(3)]),
        ));
        items.push((s("gpualloc_passed_over"), Value::Bool(true)));
        items.push((s("gpualloc_borrowed"), Value::Bool(true)));
        items.push((s("gpualloc_spilled"), Value::Bool(true)));
    }
    set(&mut v, &["device_traces", "0", "1"], Some(alloc));
    let snap = load(&v).unwrap();
    let trace = &snap.device_traces[0];
    assert_eq!(trace[1].pool_id, Some((0, 3)));
    assert_eq!(trace[0].pool_id, None);
    assert!(trace[1].passed_over);
    assert!(!trace[0].passed_over);
    assert!(trace[1].borrowed);
    assert!(!trace[0].borrowed);
    assert!(trace[1].spilled);
    assert!(!trace[0].spilled);
    let again = Snapshot::from_pickle(&snap.to_pickle().unwrap()).unwrap();
    assert_eq!(again, snap);
    // A pool id that is not a pair is named.
    set(
        &mut v,
        &["device_traces", "0", "1", "segment_pool_id"],
        Some(Value::Int(3)),
    );
    let err = load(&v).unwrap_err().to_string();
    assert!(err.contains("device_traces[0][1].segment_pool_id"), "{err}");
}
