//! The safe pickle reader against CPython's own output (protocols 0–5), hand-built opcode
//! sequences, and malicious or broken input.

use gpualloc_trace::pickle::{self, opcodes as op, Value};
use gpualloc_trace::PickleError;

fn s(x: &str) -> Value {
    Value::Str(x.to_owned())
}

fn ints(v: &[i64]) -> Value {
    Value::List(v.iter().map(|&i| Value::Int(i)).collect())
}

/// What tests/data/make_fixtures.py pickles as `plain`.
fn plain() -> Value {
    let mut int_list: Vec<Value> = [
        0,
        1,
        -1,
        255,
        256,
        65535,
        65536,
        -(1 << 31),
        (1 << 31) - 1,
        1 << 31,
        (1 << 47) + 5,
        i64::MAX,
        i64::MIN,
    ]
    .iter()
    .map(|&i| Value::Int(i))
    .collect();
    int_list.push(Value::BigInt(vec![0, 0, 0, 0, 0, 0, 0, 0x80, 0])); // 2**63
    int_list.push(Value::BigInt(vec![
        0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f, 0xff,
    ])); // -2**63 - 1
    let mut two100 = vec![0u8; 12];
    two100.push(0x10);
    int_list.push(Value::BigInt(two100));
    let shared = ints(&[7, 8]);
    Value::Dict(vec![
        (s("ints"), Value::List(int_list)),
        (s("f"), Value::Float(1.5)),
        (s("neg_f"), Value::Float(-0.25)),
        (s("s"), s("h\u{e9}llo \u{20ac}")),
        (s("long_s"), Value::Str("x".repeat(300))),
        (s("t0"), Value::Tuple(vec![])),
        (s("t1"), Value::Tuple(vec![Value::Int(1)])),
        (s("t2"), Value::Tuple(vec![Value::Int(1), Value::Int(2)])),
        (
            s("t3"),
            Value::Tuple(vec![Value::Int(1), Value::Int(2), Value::Int(3)]),
        ),
        (
            s("t4"),
            Value::Tuple(vec![
                Value::Int(1),
                Value::Int(2),
                Value::Int(3),
                Value::Int(4),
            ]),
        ),
        (s("n"), Value::None),
        (s("T"), Value::Bool(true)),
        (s("F"), Value::Bool(false)),
        (s("a"), shared.clone()),
        (s("b"), shared),
        (
            s("nested"),
            Value::Dict(vec![(
                s("k"),
                Value::List(vec![
                    Value::Dict(vec![(s("x"), Value::Int(1))]),
                    Value::List(vec![Value::Int(2), ints(&[3])]),
                ]),
            )]),
        ),
        (s("many"), ints(&(0..1500).collect::<Vec<_>>())),
    ])
}

const PLAIN: [&[u8]; 6] = [
    include_bytes!("data/plain_p0.pickle"),
    include_bytes!("data/plain_p1.pickle"),
    include_bytes!("data/plain_p2.pickle"),
    include_bytes!("data/plain_p3.pickle"),
    include_bytes!("data/plain_p4.pickle"),
    include_bytes!("data/plain_p5.pickle"),
];

#[test]
fn reads_cpython_output_of_every_protocol() {
    let expected = plain();
    for (proto, bytes) in PLAIN.iter().enumerate() {
        assert_eq!(
            pickle::read(bytes).as_ref(),
            Ok(&expected),
            "protocol {proto}"
        );
    }
}

#[test]
fn reads_bytes_sets_and_bytearrays_of_protocol_5() {
    let v = pickle::read(include_bytes!("data/extended_p5.pickle")).unwrap();
    assert_eq!(v.get("bytes"), Some(&Value::Bytes(vec![0, 1, 0xff])));
    let big: Vec<u8> = (0..=255u8).chain(0..=255u8).collect();
    assert_eq!(v.get("big_bytes"), Some(&Value::Bytes(big)));
    assert_eq!(v.get("set"), Some(&Value::Set(vec![Value::Int(3)])));
    assert_eq!(v.get("fs"), Some(&Value::Set(vec![Value::Int(4)])));
    assert_eq!(v.get("ba"), Some(&Value::Bytes(b"z".to_vec())));
}

#[test]
fn reads_multi_frame_protocol_4() {
    let bytes = include_bytes!("data/framed_p4.pickle");
    let used = pickle::opcodes_used(bytes).unwrap();
    assert!(used.contains(&op::FRAME));
    let v = pickle::read(bytes).unwrap();
    let items = v.as_seq().unwrap();
    assert_eq!(items.len(), 100);
    assert_eq!(items[99], Value::Str(format!("{}99", "y".repeat(1000))));
}

/// Protocol 2 header + body + STOP.
fn p2(body: &[u8]) -> Vec<u8> {
    let mut v = vec![op::PROTO, 2];
    v.extend_from_slice(body);
    v.push(op::STOP);
    v
}

#[test]
fn reads_opcodes_cpython_rarely_writes() {
    // BINUNICODE8, BINBYTES8, SHORT_BINBYTES, LONG4, SHORT_BINSTRING, BINSTRING, DUP, POP,
    // POP_MARK, PUT/GET and LONG_BINPUT/LONG_BINGET.
    let mut body = vec![op::MARK];
    body.push(op::BINUNICODE8);
    body.extend_from_slice(&2u64.to_le_bytes());
    body.extend_from_slice(b"ok");
    body.push(op::BINBYTES8);
    body.extend_from_slice(&1u64.to_le_bytes());
    body.push(9);
    body.extend_from_slice(&[op::SHORT_BINBYTES, 2, 1, 2]);
    body.push(op::LONG4);
    body.extend_from_slice(&2u32.to_le_bytes());
    body.extend_from_slice(&[0x00, 0x80]); // -32768
    body.extend_from_slice(&[op::SHORT_BINSTRING, 3]);
    body.extend_from_slice(b"abc");
    body.push(op::BINSTRING);
    body.extend_from_slice(&2u32.to_le_bytes());
    body.extend_from_slice(&[0xff, 0xfe]); // not UTF-8: stays bytes
    body.extend_from_slice(&[op::BININT1, 5, op::DUP, op::POP]);
    body.extend_from_slice(&[op::MARK, op::BININT1, 6, op::POP_MARK]);
    body.extend_from_slice(b"p7\ng7\n");
    body.push(op::LONG_BINPUT);
    body.extend_from_slice(&70_000u32.to_le_bytes());
    body.push(op::LONG_BINGET);
    body.extend_from_slice(&70_000u32.to_le_bytes());
    body.extend_from_slice(&[op::EMPTY_SET, op::MARK, op::NONE, op::ADDITEMS]);
    body.push(op::LIST);
    let v = pickle::read(&p2(&body)).unwrap();
    assert_eq!(
        v,
        Value::List(vec![
            s("ok"),
            Value::Bytes(vec![9]),
            Value::Bytes(vec![1, 2]),
            Value::Int(-32768),
            s("abc"),
            Value::Bytes(vec![0xff, 0xfe]),
            Value::Int(5),
            Value::Int(5),
            Value::Int(5),
            Value::Set(vec![Value::None]),
        ])
    );
}

/// The memo as Python's: overwrites win, MEMOIZE takes the count of distinct indices, and a
/// huge or out-of-order index works (and costs one entry, not a table up to it).
#[test]
fn memo_indices_in_and_out_of_order() {
    let mut body = vec![op::MARK];
    // 0 and 1 in order, then 0 overwritten.
    body.extend_from_slice(&[op::BININT1, 1, op::BINPUT, 0, op::POP]);
    body.extend_from_slice(&[op::BININT1, 2, op::BINPUT, 1, op::POP]);
    body.extend_from_slice(&[op::BININT1, 3, op::BINPUT, 0, op::POP]);
    // A far index (the third distinct one), then MEMOIZE, which takes len(memo) = 3.
    body.extend_from_slice(&[op::BININT1, 4, op::LONG_BINPUT]);
    body.extend_from_slice(&4_000_000_000u32.to_le_bytes());
    body.extend_from_slice(&[op::POP, op::BININT1, 5, op::MEMOIZE, op::POP]);
    body.extend_from_slice(&[op::BINGET, 0, op::BINGET, 1, op::BINGET, 3]);
    body.push(op::LONG_BINGET);
    body.extend_from_slice(&4_000_000_000u32.to_le_bytes());
    body.push(op::LIST);
    let v = pickle::read(&p2(&body)).unwrap();
    assert_eq!(v, ints(&[3, 2, 5, 4]));
    let missing = p2(&[op::BININT1, 1, op::BINPUT, 0, op::BINGET, 2]);
    assert!(matches!(
        pickle::read(&missing),
        Err(PickleError::BadMemo { index: 2, .. })
    ));
}

#[test]
fn memo_keeps_identity_so_later_appends_are_seen() {
    // l = []; memo it; d = {"x": l}; then append 1 to l via the memo: d["x"] == [1].
    let mut body = vec![op::EMPTY_LIST, op::MEMOIZE, op::POP, op::EMPTY_DICT];
    body.extend_from_slice(&[op::SHORT_BINUNICODE, 1, b'x', op::BINGET, 0, op::SETITEM]);
    body.extend_from_slice(&[op::BINGET, 0, op::BININT1, 1, op::APPEND, op::POP]);
    let v = pickle::read(&p2(&body)).unwrap();
    assert_eq!(v, Value::Dict(vec![(s("x"), ints(&[1]))]));
}

#[test]
fn every_forbidden_opcode_is_refused_with_its_name_and_offset() {
    for &byte in &pickle::FORBIDDEN {
        let bytes = p2(&[byte, 0, 0, 0, 0, b'\n', b'\n']);
        match pickle::read(&bytes) {
            Err(PickleError::Forbidden {
                opcode,
                byte: b,
                offset,
            }) => {
                assert_eq!(b, byte);
                assert_eq!(offset, 2);
                assert_eq!(opcode, op::info(byte).unwrap().0);
            }
            other => panic!("{byte:#04x}: {other:?}"),
        }
    }
}

#[test]
fn refuses_real_code_running_pickles() {
    // pickle.dumps(os.system) with a call, protocol 0: GLOBAL first.
    let global = b"cposix\nsystem\n(S'echo pwned'\ntR.";
    let err = pickle::read(global).unwrap_err();
    assert_eq!(
        err,
        PickleError::Forbidden {
            opcode: "GLOBAL",
            byte: b'c',
            offset: 0
        }
    );
    assert!(err.to_string().contains("GLOBAL"));
    // Protocol 4: STACK_GLOBAL after two strings.
    let mut stack_global = vec![op::PROTO, 4, op::SHORT_BINUNICODE, 5];
    stack_global.extend_from_slice(b"posix");
    stack_global.extend_from_slice(&[op::SHORT_BINUNICODE, 6]);
    stack_global.extend_from_slice(b"system");
    stack_global.extend_from_slice(&[op::STACK_GLOBAL, op::STOP]);
    assert!(matches!(
        pickle::read(&stack_global),
        Err(PickleError::Forbidden {
            opcode: "STACK_GLOBAL",
            offset: 17,
            ..
        })
    ));
    // REDUCE on plain data (would call the first item).
    assert_eq!(
        pickle::read(&p2(&[op::NONE, op::EMPTY_TUPLE, op::REDUCE])),
        Err(PickleError::Forbidden {
            opcode: "REDUCE",
            byte: op::REDUCE,
            offset: 4
        })
    );
}

#[test]
fn every_truncation_of_real_pickles_is_an_error_not_a_panic() {
    let files: [&[u8]; 4] = [
        include_bytes!("data/small_p0.pickle"),
        include_bytes!("data/small_p2.pickle"),
        include_bytes!("data/small_p4.pickle"),
        include_bytes!("data/extended_p5.pickle"),
    ];
    for bytes in files {
        assert!(pickle::read(bytes).is_ok());
        for len in 0..bytes.len() {
            match pickle::read(&bytes[..len]) {
                Err(
                    PickleError::Truncated { .. }
                    | PickleError::MissingStop { .. }
                    | PickleError::TooLong { .. },
                ) => {}
                other => panic!("prefix of {len} bytes: {other:?}"),
            }
            assert!(
                pickle::opcodes_used(&bytes[..len]).is_err(),
                "scan of {len}"
            );
        }
    }
}

#[test]
fn malformed_streams_get_typed_errors() {
    let cases: Vec<(Vec<u8>, PickleError)> = vec![
        (
            vec![op::STOP],
            PickleError::StackUnderflow {
                opcode: "STOP",
                offset: 0,
            },
        ),
        (
            p2(&[op::APPEND]),
            PickleError::StackUnderflow {
                opcode: "APPEND",
                offset: 2,
            },
        ),
        (
            p2(&[op::BINGET, 5]),
            PickleError::BadMemo {
                index: 5,
                offset: 2,
            },
        ),
        (
            p2(&[op::LIST]),
            PickleError::MissingMark {
                opcode: "LIST",
                offset: 2,
            },
        ),
        (
            p2(&[op::BININT1, 1, op::BININT1, 2, op::APPEND]),
            PickleError::WrongType {
                opcode: "APPEND",
                offset: 6,
                expected: "list",
                found: "int",
            },
        ),
        (
            p2(&[op::EMPTY_LIST, op::MARK, op::NONE, op::NONE, op::SETITEMS]),
            PickleError::WrongType {
                opcode: "SETITEMS",
                offset: 6,
                expected: "dict",
                found: "list",
            },
        ),
        (
            p2(&[op::MARK, op::NONE, op::DICT]),
            PickleError::WrongType {
                opcode: "DICT",
                offset: 4,
                expected: "key/value pairs",
                found: "an odd number of items",
            },
        ),
        (
            // A MARK hides what is below it: TUPLE2 cannot reach across it.
            p2(&[op::NONE, op::MARK, op::NONE, op::TUPLE2]),
            PickleError::StackUnderflow {
                opcode: "TUPLE2",
                offset: 5,
            },
        ),
        (
            vec![op::PROTO, 6, op::NONE, op::STOP],
            PickleError::UnsupportedProtocol {
                protocol: 6,
                offset: 0,
            },
        ),
        (
            p2(&[0xff]),
            PickleError::UnknownOpcode {
                byte: 0xff,
                offset: 2,
            },
        ),
        (
            p2(&[op::NEXT_BUFFER]),
            PickleError::Unsupported {
                opcode: "NEXT_BUFFER",
                offset: 2,
            },
        ),
        (
            vec![op::PROTO, 2, op::NONE],
            PickleError::MissingStop { offset: 3 },
        ),
        (
            b"Iabc\n.".to_vec(),
            PickleError::BadArgument {
                opcode: "INT",
                offset: 0,
            },
        ),
        (
            b"F1.5x\n.".to_vec(),
            PickleError::BadArgument {
                opcode: "FLOAT",
                offset: 0,
            },
        ),
        (
            p2(&[op::SHORT_BINUNICODE, 2, 0xc3, 0x28]),
            PickleError::InvalidUtf8 {
                opcode: "SHORT_BINUNICODE",
                offset: 2,
            },
        ),
    ];
    for (bytes, expected) in cases {
        assert_eq!(pickle::read(&bytes), Err(expected), "{bytes:02x?}");
    }
}

#[test]
fn absurd_lengths_are_refused_before_allocating() {
    let mut huge_str = vec![op::PROTO, 4, op::BINUNICODE8];
    huge_str.extend_from_slice(&u64::MAX.to_le_bytes());
    assert_eq!(
        pickle::read(&huge_str),
        Err(PickleError::TooLong {
            opcode: "BINUNICODE8",
            offset: 2,
            len: u64::MAX
        })
    );
    let mut huge_bytes = vec![op::PROTO, 3, op::BINBYTES];
    huge_bytes.extend_from_slice(&u32::MAX.to_le_bytes());
    assert!(matches!(
        pickle::read(&huge_bytes),
        Err(PickleError::TooLong { .. })
    ));
    let mut huge_frame = vec![op::PROTO, 4, op::FRAME];
    huge_frame.extend_from_slice(&(1u64 << 40).to_le_bytes());
    huge_frame.extend_from_slice(&[op::NONE, op::STOP]);
    assert!(matches!(
        pickle::read(&huge_frame),
        Err(PickleError::TooLong {
            opcode: "FRAME",
            ..
        })
    ));
    let mut negative_long4 = vec![op::PROTO, 2, op::LONG4];
    negative_long4.extend_from_slice(&(-1i32).to_le_bytes());
    assert_eq!(
        pickle::read(&negative_long4),
        Err(PickleError::BadArgument {
            opcode: "LONG4",
            offset: 2
        })
    );
    // A memo index of 4 billion is just a map key, not a 4-billion-entry table.
    let mut far_put = vec![op::PROTO, 2, op::NONE, op::LONG_BINPUT];
    far_put.extend_from_slice(&u32::MAX.to_le_bytes());
    far_put.push(op::STOP);
    assert_eq!(pickle::read(&far_put), Ok(Value::None));
}

#[test]
fn billion_laughs_hits_the_expansion_limit() {
    // l0 = []; l(i+1) = [l(i), l(i)]: 2^40 leaves from ~600 bytes.
    let mut body = vec![op::EMPTY_LIST, op::MEMOIZE];
    for i in 0u32..40 {
        body.push(op::MARK);
        for _ in 0..2 {
            body.push(op::LONG_BINGET);
            body.extend_from_slice(&i.to_le_bytes());
        }
        body.extend_from_slice(&[op::LIST, op::MEMOIZE]);
    }
    let bytes = p2(&body);
    assert!(bytes.len() < 1000);
    assert_eq!(
        pickle::read(&bytes),
        Err(PickleError::ExpansionLimit { limit: 64 << 20 })
    );
    assert_eq!(
        pickle::read_with_limit(&bytes, 1000),
        Err(PickleError::ExpansionLimit { limit: 1000 })
    );
}

#[test]
fn deep_nesting_and_cycles_are_errors_not_stack_overflows() {
    let depth = 100_000;
    let mut body = vec![op::EMPTY_LIST; depth];
    body.extend(std::iter::repeat_n(op::APPEND, depth - 1));
    assert_eq!(
        pickle::read(&p2(&body)),
        Err(PickleError::TooDeep {
            limit: pickle::MAX_DEPTH
        })
    );
    let cycle = p2(&[op::EMPTY_LIST, op::MEMOIZE, op::BINGET, 0, op::APPEND]);
    assert_eq!(
        pickle::read(&cycle),
        Err(PickleError::TooDeep {
            limit: pickle::MAX_DEPTH
        })
    );
}

#[test]
fn opcode_scan_lists_forbidden_opcodes_without_running_them() {
    let used = pickle::opcodes_used(b"cposix\nsystem\n(S'echo pwned'\ntR.").unwrap();
    let expected: Vec<u8> = vec![b'(', b'.', b'R', b'S', b'c', b't'];
    assert_eq!(used.into_iter().collect::<Vec<_>>(), expected);
}
