//! The pickle writer, restricted to the opcodes MemoryViz.js's own unpickler understands.
//!
//! Output is protocol 4: `PROTO 4`, one `FRAME` holding the rest, the value, `STOP`. Strings
//! and flat dicts (all keys and values strings, numbers, bools or None: a snapshot's stack
//! frames) are memoized (`MEMOIZE`, then `BINGET` / `LONG_BINGET` on repeats), so the many
//! repeated keys, file names and frames of a snapshot are written once, as CPython does for
//! the shared objects PyTorch builds. (A reader therefore sees equal flat dicts as one shared
//! object.) Containers are built the way
//! CPython builds them (`EMPTY_LIST` + `APPENDS` in batches of 1000, `EMPTY_DICT` +
//! `SETITEMS`, `TUPLE1`–`TUPLE3` or `MARK` … `TUPLE`). Nothing outside
//! [`MEMORYVIZ_WHITELIST`](crate::pickle::MEMORYVIZ_WHITELIST) is emitted; values that need
//! other opcodes (bytes, sets, ints wider than 64 bits, strings over 4 GiB) are refused.

use std::collections::HashMap;

use crate::error::PickleError;
use crate::pickle::opcodes as op;
use crate::pickle::Value;

/// Deepest nesting the writer accepts.
pub const MAX_WRITE_DEPTH: usize = 256;

const BATCH: usize = 1000;

/// Writes `value` as a pickle that Python's `pickle` and MemoryViz.js both load.
pub fn write(value: &Value) -> Result<Vec<u8>, PickleError> {
    let mut w = Writer {
        out: Vec::with_capacity(1 << 16),
        memo: HashMap::new(),
        dicts: HashMap::new(),
        next_memo: 0,
    };
    w.out.extend_from_slice(&[op::PROTO, 4, op::FRAME]);
    let len_at = w.out.len();
    w.out.extend_from_slice(&[0; 8]);
    w.value(value, 0)?;
    w.out.push(op::STOP);
    let frame_len = (w.out.len() - len_at - 8) as u64;
    w.out[len_at..len_at + 8].copy_from_slice(&frame_len.to_le_bytes());
    Ok(w.out)
}

struct Writer<'v> {
    out: Vec<u8>,
    memo: HashMap<&'v str, u32>,
    dicts: HashMap<Vec<(Scalar<'v>, Scalar<'v>)>, u32>,
    next_memo: u32,
}

/// A hashable view of a scalar value, to recognise equal flat dicts.
#[derive(PartialEq, Eq, Hash)]
enum Scalar<'v> {
    None,
    Bool(bool),
    Int(i64),
    Float(u64),
    Str(&'v str),
}

fn scalar(v: &Value) -> Option<Scalar<'_>> {
    Some(match v {
        Value::None => Scalar::None,
        Value::Bool(b) => Scalar::Bool(*b),
        Value::Int(i) => Scalar::Int(*i),
        Value::Float(f) => Scalar::Float(f.to_bits()),
        Value::Str(s) => Scalar::Str(s),
        _ => return None,
    })
}

/// The memo key of a non-empty dict of scalars, `None` for any other dict.
fn flat_key(items: &[(Value, Value)]) -> Option<Vec<(Scalar<'_>, Scalar<'_>)>> {
    if items.is_empty() || items.len() > 16 {
        return None;
    }
    items
        .iter()
        .map(|(k, v)| Some((scalar(k)?, scalar(v)?)))
        .collect()
}

impl<'v> Writer<'v> {
    fn value(&mut self, value: &'v Value, depth: usize) -> Result<(), PickleError> {
        if depth > MAX_WRITE_DEPTH {
            return Err(PickleError::TooDeep {
                limit: MAX_WRITE_DEPTH,
            });
        }
        match value {
            Value::None => self.out.push(op::NONE),
            Value::Bool(true) => self.out.push(op::NEWTRUE),
            Value::Bool(false) => self.out.push(op::NEWFALSE),
            Value::Int(i) => self.int(*i),
            Value::Float(f) => {
                self.out.push(op::BINFLOAT);
                self.out.extend_from_slice(&f.to_be_bytes());
            }
            Value::Str(s) => self.str(s)?,
            Value::BigInt(_) => {
                return Err(PickleError::Unrepresentable {
                    what: "an int wider than 64 bits",
                })
            }
            Value::Bytes(_) => return Err(PickleError::Unrepresentable { what: "bytes" }),
            Value::Set(_) => return Err(PickleError::Unrepresentable { what: "a set" }),
            Value::List(items) => {
                self.out.push(op::EMPTY_LIST);
                self.batched(items, depth)?;
            }
            Value::Tuple(items) => match items.len() {
                0 => self.out.push(op::EMPTY_TUPLE),
                1..=3 => {
                    for item in items {
                        self.value(item, depth + 1)?;
                    }
                    self.out.push(op::TUPLE1 + (items.len() as u8 - 1));
                }
                _ => {
                    self.out.push(op::MARK);
                    for item in items {
                        self.value(item, depth + 1)?;
                    }
                    self.out.push(op::TUPLE);
                }
            },
            Value::Dict(items) => {
                let key = flat_key(items);
                if let Some(k) = &key {
                    if let Some(&index) = self.dicts.get(k) {
                        self.get(index);
                        return Ok(());
                    }
                }
                self.out.push(op::EMPTY_DICT);
                if let Some(k) = key {
                    if let Some(index) = self.memoize() {
                        self.dicts.insert(k, index);
                    }
                }
                for chunk in items.chunks(BATCH) {
                    if let [(k, v)] = chunk {
                        self.value(k, depth + 1)?;
                        self.value(v, depth + 1)?;
                        self.out.push(op::SETITEM);
                        continue;
                    }
                    self.out.push(op::MARK);
                    for (k, v) in chunk {
                        self.value(k, depth + 1)?;
                        self.value(v, depth + 1)?;
                    }
                    self.out.push(op::SETITEMS);
                }
            }
        }
        Ok(())
    }

    fn batched(&mut self, items: &'v [Value], depth: usize) -> Result<(), PickleError> {
        for chunk in items.chunks(BATCH) {
            if let [item] = chunk {
                self.value(item, depth + 1)?;
                self.out.push(op::APPEND);
                continue;
            }
            self.out.push(op::MARK);
            for item in chunk {
                self.value(item, depth + 1)?;
            }
            self.out.push(op::APPENDS);
        }
        Ok(())
    }

    fn int(&mut self, i: i64) {
        if (0..=0xff).contains(&i) {
            self.out.extend_from_slice(&[op::BININT1, i as u8]);
        } else if (0..=0xffff).contains(&i) {
            self.out.push(op::BININT2);
            self.out.extend_from_slice(&(i as u16).to_le_bytes());
        } else if let Ok(small) = i32::try_from(i) {
            self.out.push(op::BININT);
            self.out.extend_from_slice(&small.to_le_bytes());
        } else {
            // Minimal two's complement, as CPython's LONG1 (at most 8 bytes for an i64).
            let bytes = i.to_le_bytes();
            let fill = if i < 0 { 0xff } else { 0x00 };
            let mut len = 8;
            while len > 1 && bytes[len - 1] == fill && (bytes[len - 2] & 0x80 != 0) == (i < 0) {
                len -= 1;
            }
            self.out.extend_from_slice(&[op::LONG1, len as u8]);
            self.out.extend_from_slice(&bytes[..len]);
        }
    }

    fn str(&mut self, s: &'v str) -> Result<(), PickleError> {
        if let Some(&index) = self.memo.get(s) {
            self.get(index);
            return Ok(());
        }
        if let Ok(len) = u8::try_from(s.len()) {
            self.out.extend_from_slice(&[op::SHORT_BINUNICODE, len]);
        } else {
            let len = u32::try_from(s.len()).map_err(|_| PickleError::Unrepresentable {
                what: "a string over 4 GiB",
            })?;
            self.out.push(op::BINUNICODE);
            self.out.extend_from_slice(&len.to_le_bytes());
        }
        self.out.extend_from_slice(s.as_bytes());
        if let Some(index) = self.memoize() {
            self.memo.insert(s, index);
        }
        Ok(())
    }

    /// Stores the value just written in the memo; `None` once 2^32 entries are used.
    fn memoize(&mut self) -> Option<u32> {
        let index = self.next_memo;
        self.next_memo = self.next_memo.checked_add(1)?;
        self.out.push(op::MEMOIZE);
        Some(index)
    }

    fn get(&mut self, index: u32) {
        match u8::try_from(index) {
            Ok(small) => self.out.extend_from_slice(&[op::BINGET, small]),
            Err(_) => {
                self.out.push(op::LONG_BINGET);
                self.out.extend_from_slice(&index.to_le_bytes());
            }
        }
    }
}
