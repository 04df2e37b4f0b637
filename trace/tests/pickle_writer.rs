//! The writer emits only MemoryViz.js's opcodes and reads back to the same value.

use gpualloc_trace::pickle::{self, opcodes as op, Value};
use gpualloc_trace::PickleError;

fn s(x: &str) -> Value {
    Value::Str(x.to_owned())
}

/// A value exercising every branch of the writer.
fn rich() -> Value {
    let ints = [
        0,
        1,
        255,
        256,
        65_535,
        65_536,
        -1,
        -256,
        i64::from(i32::MIN),
        i64::from(i32::MAX),
        1 << 31,
        -(1 << 31) - 1,
        (1 << 47) + 12_345,
        i64::MAX,
        i64::MIN,
    ];
    Value::Dict(vec![
        (
            s("ints"),
            Value::List(ints.iter().map(|&i| Value::Int(i)).collect()),
        ),
        (
            s("floats"),
            Value::List(vec![
                Value::Float(1.5),
                Value::Float(-0.0),
                Value::Float(1e300),
            ]),
        ),
        (s("none"), Value::None),
        (
            s("bools"),
            Value::List(vec![Value::Bool(true), Value::Bool(false)]),
        ),
        (s("short"), s("h\u{e9}llo")),
        (s("long"), Value::Str("z".repeat(70_000))),
        // 400 distinct strings then repeats: memo indices above 255 need LONG_BINGET.
        (
            s("strings"),
            Value::List(
                (0..800)
                    .map(|i| Value::Str(format!("name{}", i % 400)))
                    .collect(),
            ),
        ),
        (s("one"), Value::List(vec![Value::Int(1)])),
        (s("empty"), Value::List(vec![])),
        (s("big"), Value::List((0..2_501).map(Value::Int).collect())),
        (
            s("tuples"),
            Value::List(vec![
                Value::Tuple(vec![]),
                Value::Tuple(vec![Value::Int(1)]),
                Value::Tuple(vec![Value::Int(1), Value::Int(2)]),
                Value::Tuple(vec![Value::Int(1), Value::Int(2), Value::Int(3)]),
                Value::Tuple(vec![
                    Value::Int(1),
                    Value::Int(2),
                    Value::Int(3),
                    Value::Int(4),
                ]),
            ]),
        ),
        (s("single"), Value::Dict(vec![(s("k"), Value::Int(1))])),
        (s("int_key"), Value::Dict(vec![(Value::Int(3), s("three"))])),
        (s("empty_dict"), Value::Dict(vec![])),
        (
            s("wide"),
            Value::Dict(
                (0..1_200)
                    .map(|i| (Value::Int(i), Value::Int(-i)))
                    .collect(),
            ),
        ),
    ])
}

#[test]
fn writer_stays_inside_the_memoryviz_whitelist() {
    let bytes = pickle::write(&rich()).unwrap();
    let used = pickle::opcodes_used(&bytes).unwrap();
    for opcode in &used {
        assert!(
            pickle::MEMORYVIZ_WHITELIST.contains(opcode),
            "opcode {} ({opcode:#04x}) is outside MemoryViz.js's set",
            op::info(*opcode).map_or("?", |i| i.0)
        );
    }
    // The rich value really exercises the interesting opcodes.
    for expected in [
        op::PROTO,
        op::FRAME,
        op::LONG1,
        op::BININT,
        op::BININT1,
        op::BININT2,
        op::BINFLOAT,
        op::SHORT_BINUNICODE,
        op::BINUNICODE,
        op::MEMOIZE,
        op::BINGET,
        op::LONG_BINGET,
        op::APPEND,
        op::APPENDS,
        op::SETITEM,
        op::SETITEMS,
        op::EMPTY_TUPLE,
        op::TUPLE1,
        op::TUPLE2,
        op::TUPLE3,
        op::TUPLE,
        op::NEWTRUE,
        op::NEWFALSE,
        op::NONE,
    ] {
        assert!(
            used.contains(&expected),
            "{} not used",
            op::info(expected).map_or("?", |i| i.0)
        );
    }
}

#[test]
fn written_pickles_read_back_identically() {
    let v = rich();
    let bytes = pickle::write(&v).unwrap();
    assert_eq!(pickle::read(&bytes), Ok(v));
    // The single frame covers everything after its header.
    let frame_len = u64::from_le_bytes(bytes[3..11].try_into().unwrap());
    assert_eq!(frame_len as usize, bytes.len() - 11);
}

#[test]
fn ints_use_the_smallest_encoding_memoryviz_decodes_correctly() {
    // MemoryViz.js reads BININT1/BININT2 as unsigned and LONG1 up to 8 bytes.
    let cases: [(i64, &[u8]); 6] = [
        (7, &[op::BININT1, 7]),
        (300, &[op::BININT2, 0x2c, 0x01]),
        (-1, &[op::BININT, 0xff, 0xff, 0xff, 0xff]),
        (1 << 31, &[op::LONG1, 5, 0, 0, 0, 0x80, 0]),
        (
            -(1 << 31) - 1,
            &[op::LONG1, 5, 0xff, 0xff, 0xff, 0x7f, 0xff],
        ),
        (i64::MIN, &[op::LONG1, 8, 0, 0, 0, 0, 0, 0, 0, 0x80]),
    ];
    for (i, encoding) in cases {
        let bytes = pickle::write(&Value::Int(i)).unwrap();
        assert_eq!(&bytes[11..bytes.len() - 1], encoding, "{i}");
        assert_eq!(pickle::read(&bytes), Ok(Value::Int(i)));
    }
}

#[test]
fn values_outside_memoryviz_are_refused() {
    for (v, what) in [
        (Value::Bytes(vec![1]), "bytes"),
        (Value::Set(vec![]), "a set"),
        (
            Value::BigInt(vec![0, 0, 0, 0, 0, 0, 0, 0x80, 0]),
            "an int wider than 64 bits",
        ),
    ] {
        assert_eq!(
            pickle::write(&Value::List(vec![v])),
            Err(PickleError::Unrepresentable { what })
        );
    }
    let mut deep = Value::None;
    for _ in 0..1_000 {
        deep = Value::List(vec![deep]);
    }
    assert_eq!(
        pickle::write(&deep),
        Err(PickleError::TooDeep {
            limit: pickle::MAX_WRITE_DEPTH
        })
    );
}

#[test]
fn equal_flat_dicts_are_written_once() {
    let frame = |line: i64| {
        Value::str_dict([
            ("filename", Value::from("model.py")),
            ("line", Value::Int(line)),
            ("name", Value::from("forward")),
        ])
    };
    let repeated = Value::List((0..10_000).map(|i| frame(i % 3)).collect());
    let bytes = pickle::write(&repeated).unwrap();
    // 3 distinct dicts written out, 9,997 two-byte references.
    assert!(bytes.len() < 25_000, "{} bytes", bytes.len());
    assert_eq!(pickle::read(&bytes), Ok(repeated));
    // Dicts holding containers are not shared.
    let nested = Value::List(vec![
        Value::str_dict([("k", Value::List(vec![]))]),
        Value::str_dict([("k", Value::List(vec![]))]),
    ]);
    let bytes = pickle::write(&nested).unwrap();
    assert_eq!(bytes.iter().filter(|&&b| b == op::EMPTY_DICT).count(), 2);
}
