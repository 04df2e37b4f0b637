//! The safe pickle reader: a pickle machine for plain data (protocols 0–5) that refuses every
//! opcode that would import or call code, and turns malformed input into typed errors.

use std::collections::HashMap;

use crate::error::PickleError;
use crate::pickle::arena::{Arena, Budget, Id, Node};
use crate::pickle::opcodes::{self as op, Arg};
use crate::pickle::text;
use crate::pickle::Value;

/// Reads a pickle into a [`Value`].
///
/// Supports every data opcode of protocols 0–5 (including the memo, FRAME, LONG1/LONG4,
/// BINUNICODE8, BINBYTES*, sets). Refuses GLOBAL, STACK_GLOBAL, REDUCE, BUILD, INST, OBJ,
/// NEWOBJ, NEWOBJ_EX, PERSID, BINPERSID and EXT1/2/4 with [`PickleError::Forbidden`], and the
/// out-of-band buffer opcodes with [`PickleError::Unsupported`]. Output size is bounded by
/// the default budget (see [`read_with_limit`]).
pub fn read(bytes: &[u8]) -> Result<Value, PickleError> {
    read_with_limit(bytes, Budget::for_input(bytes.len()).limit())
}

/// Like [`read`], with an explicit bound in bytes on the decoded value (memo references let a
/// small pickle repeat one object many times; copies past the bound fail with
/// [`PickleError::ExpansionLimit`]). The default is 512 bytes per input byte, clamped to
/// 64 MiB ..= 1 GiB.
pub fn read_with_limit(bytes: &[u8], max_output_bytes: u64) -> Result<Value, PickleError> {
    let (arena, root) = parse(bytes)?;
    arena.to_value(root, &mut Budget::new(max_output_bytes))
}

/// Runs the pickle machine and returns the object graph and the id of the top-level object.
pub(crate) fn parse(bytes: &[u8]) -> Result<(Arena, Id), PickleError> {
    Machine {
        data: bytes,
        pos: 0,
        // About one node per 8 bytes in real snapshots (short opcodes, memoized strings).
        arena: Arena::with_capacity(bytes.len() / 8),
        stack: Vec::new(),
        marks: Vec::new(),
        memo: Memo::default(),
    }
    .run()
}

/// The pickle memo. Writers number entries 0, 1, 2, ... in order (Python's pickler uses the
/// memo's length), so those live in a vector: no hashing, and PUT and GET are most of a
/// snapshot's opcodes. Any other index (only a hand-made pickle writes one) goes to a map, so
/// a large index cannot make the vector large.
#[derive(Default)]
struct Memo {
    dense: Vec<Id>,
    sparse: HashMap<u64, Id>,
}

impl Memo {
    /// Distinct indices, as Python's `len(memo)` (MEMOIZE's index).
    fn len(&self) -> usize {
        self.dense.len() + self.sparse.len()
    }

    fn get(&self, index: u64) -> Option<Id> {
        usize::try_from(index)
            .ok()
            .and_then(|i| self.dense.get(i).copied())
            .or_else(|| self.sparse.get(&index).copied())
    }

    fn insert(&mut self, index: u64, id: Id) {
        match usize::try_from(index) {
            Ok(i) if i < self.dense.len() => self.dense[i] = id,
            Ok(i) if i == self.dense.len() && !self.sparse.contains_key(&index) => {
                self.dense.push(id)
            }
            _ => {
                self.sparse.insert(index, id);
            }
        }
    }
}

struct Machine<'a> {
    data: &'a [u8],
    pos: usize,
    arena: Arena,
    stack: Vec<Id>,
    marks: Vec<usize>,
    memo: Memo,
}

/// Where the current opcode started and what it is, for errors.
#[derive(Clone, Copy)]
struct At {
    opcode: &'static str,
    offset: usize,
}

impl At {
    fn wrong(self, expected: &'static str, found: &'static str) -> PickleError {
        PickleError::WrongType {
            opcode: self.opcode,
            offset: self.offset,
            expected,
            found,
        }
    }
    fn bad_arg(self) -> PickleError {
        PickleError::BadArgument {
            opcode: self.opcode,
            offset: self.offset,
        }
    }
}

impl<'a> Machine<'a> {
    fn run(mut self) -> Result<(Arena, Id), PickleError> {
        loop {
            let offset = self.pos;
            let Some(&byte) = self.data.get(offset) else {
                return Err(PickleError::MissingStop { offset });
            };
            self.pos += 1;
            let Some((opcode, _)) = op::info(byte) else {
                return Err(PickleError::UnknownOpcode { byte, offset });
            };
            if op::is_forbidden(byte) {
                return Err(PickleError::Forbidden {
                    opcode,
                    byte,
                    offset,
                });
            }
            let at = At { opcode, offset };
            if byte == op::STOP {
                let root = self.pop(at)?;
                return Ok((self.arena, root));
            }
            self.step(byte, at)?;
        }
    }

    fn step(&mut self, byte: u8, at: At) -> Result<(), PickleError> {
        match byte {
            op::PROTO => {
                let protocol = self.take(1, at)?[0];
                if protocol > 5 {
                    return Err(PickleError::UnsupportedProtocol {
                        protocol,
                        offset: at.offset,
                    });
                }
            }
            op::FRAME => {
                let len = self.u64(at)?;
                if len > self.remaining() as u64 {
                    return Err(PickleError::TooLong {
                        opcode: at.opcode,
                        offset: at.offset,
                        len,
                    });
                }
            }
            op::MARK => self.marks.push(self.stack.len()),
            op::POP => {
                if self.stack.len() > self.base() {
                    self.stack.pop();
                } else if self.marks.pop().is_none() {
                    return Err(self.underflow(at));
                }
            }
            op::POP_MARK => {
                self.pop_mark(at)?;
            }
            op::DUP => {
                let top = self.top(at)?;
                self.stack.push(top);
            }
            op::NONE => self.push(Node::None),
            op::NEWTRUE => self.push(Node::Bool(true)),
            op::NEWFALSE => self.push(Node::Bool(false)),
            op::BININT => {
                let b = self.take(4, at)?;
                self.push(Node::Int(i64::from(i32::from_le_bytes([
                    b[0], b[1], b[2], b[3],
                ]))));
            }
            op::BININT1 => {
                let b = self.take(1, at)?[0];
                self.push(Node::Int(i64::from(b)));
            }
            op::BININT2 => {
                let b = self.take(2, at)?;
                self.push(Node::Int(i64::from(u16::from_le_bytes([b[0], b[1]]))));
            }
            op::LONG1 | op::LONG4 => {
                let bytes = self.counted(byte, at)?;
                let node = text::long_from_le(bytes);
                self.push(node);
            }
            op::INT => {
                let line = self.line_str(at)?;
                let node = match line {
                    "00" => Node::Bool(false),
                    "01" => Node::Bool(true),
                    _ => text::parse_decimal(line).ok_or(at.bad_arg())?,
                };
                self.push(node);
            }
            op::LONG => {
                let line = self.line_str(at)?;
                let node = text::parse_decimal(line).ok_or(at.bad_arg())?;
                self.push(node);
            }
            op::FLOAT => {
                let f = self.line_str(at)?.trim().parse::<f64>();
                self.push(Node::Float(f.map_err(|_| at.bad_arg())?));
            }
            op::BINFLOAT => {
                let b = self.take(8, at)?;
                let mut buf = [0u8; 8];
                buf.copy_from_slice(b);
                self.push(Node::Float(f64::from_be_bytes(buf)));
            }
            op::BINUNICODE | op::SHORT_BINUNICODE | op::BINUNICODE8 => {
                let bytes = self.counted(byte, at)?;
                let s = std::str::from_utf8(bytes).map_err(|_| PickleError::InvalidUtf8 {
                    opcode: at.opcode,
                    offset: at.offset,
                })?;
                let node = Node::Str(s.to_owned());
                self.push(node);
            }
            op::UNICODE => {
                let line = self.line(at)?;
                let s = text::decode_raw_unicode_escape(line).ok_or(at.bad_arg())?;
                self.push(Node::Str(s));
            }
            op::BINSTRING | op::SHORT_BINSTRING => {
                let bytes = self.counted(byte, at)?;
                let node = bytes_or_str(bytes.to_vec());
                self.push(node);
            }
            op::STRING => {
                let line = self.line(at)?;
                let bytes = text::decode_string_literal(line).ok_or(at.bad_arg())?;
                self.push(bytes_or_str(bytes));
            }
            op::BINBYTES | op::SHORT_BINBYTES | op::BINBYTES8 | op::BYTEARRAY8 => {
                let bytes = self.counted(byte, at)?.to_vec();
                self.push(Node::Bytes(bytes));
            }
            op::EMPTY_LIST => self.push(Node::List(Vec::new())),
            op::EMPTY_TUPLE => self.push(Node::Tuple(Vec::new())),
            op::EMPTY_DICT => self.push(Node::Dict(Vec::new())),
            op::EMPTY_SET => self.push(Node::Set(Vec::new())),
            op::LIST => {
                let items = self.pop_mark(at)?;
                self.push(Node::List(items));
            }
            op::TUPLE => {
                let items = self.pop_mark(at)?;
                self.push(Node::Tuple(items));
            }
            op::FROZENSET => {
                let items = self.pop_mark(at)?;
                self.push(Node::Set(items));
            }
            op::DICT => {
                let items = self.pop_mark(at)?;
                let pairs = pairs(&items, at)?;
                self.push(Node::Dict(pairs));
            }
            op::TUPLE1 | op::TUPLE2 | op::TUPLE3 => {
                let n = usize::from(byte - op::TUPLE1) + 1;
                if self.stack.len() < self.base() + n {
                    return Err(self.underflow(at));
                }
                let items = self.stack.split_off(self.stack.len() - n);
                self.push(Node::Tuple(items));
            }
            op::APPEND => {
                let v = self.pop(at)?;
                let target = self.top(at)?;
                match self.arena.get_mut(target) {
                    Some(Node::List(items)) => items.push(v),
                    other => return Err(at.wrong("list", found(other))),
                }
            }
            op::APPENDS => {
                let items = self.pop_mark(at)?;
                let target = self.top(at)?;
                match self.arena.get_mut(target) {
                    Some(Node::List(list)) => list.extend(items),
                    other => return Err(at.wrong("list", found(other))),
                }
            }
            op::ADDITEMS => {
                let items = self.pop_mark(at)?;
                let target = self.top(at)?;
                match self.arena.get_mut(target) {
                    Some(Node::Set(set)) => set.extend(items),
                    other => return Err(at.wrong("set", found(other))),
                }
            }
            op::SETITEM => {
                let v = self.pop(at)?;
                let k = self.pop(at)?;
                let target = self.top(at)?;
                match self.arena.get_mut(target) {
                    Some(Node::Dict(d)) => d.push((k, v)),
                    other => return Err(at.wrong("dict", found(other))),
                }
            }
            op::SETITEMS => {
                let items = self.pop_mark(at)?;
                let new = pairs(&items, at)?;
                let target = self.top(at)?;
                match self.arena.get_mut(target) {
                    Some(Node::Dict(d)) => d.extend(new),
                    other => return Err(at.wrong("dict", found(other))),
                }
            }
            op::GET => {
                let index = self.line_index(at)?;
                self.get(index, at)?;
            }
            op::BINGET => {
                let index = u64::from(self.take(1, at)?[0]);
                self.get(index, at)?;
            }
            op::LONG_BINGET => {
                let index = u64::from(self.u32(at)?);
                self.get(index, at)?;
            }
            op::PUT => {
                let index = self.line_index(at)?;
                self.put(index, at)?;
            }
            op::BINPUT => {
                let index = u64::from(self.take(1, at)?[0]);
                self.put(index, at)?;
            }
            op::LONG_BINPUT => {
                let index = u64::from(self.u32(at)?);
                self.put(index, at)?;
            }
            op::MEMOIZE => {
                let index = self.memo.len() as u64;
                self.put(index, at)?;
            }
            _ => {
                return Err(PickleError::Unsupported {
                    opcode: at.opcode,
                    offset: at.offset,
                })
            }
        }
        Ok(())
    }

    fn remaining(&self) -> usize {
        self.data.len() - self.pos
    }

    fn take(&mut self, n: usize, at: At) -> Result<&'a [u8], PickleError> {
        if self.remaining() < n {
            return Err(PickleError::Truncated {
                opcode: at.opcode,
                offset: at.offset,
            });
        }
        let data: &'a [u8] = self.data;
        let out = &data[self.pos..self.pos + n];
        self.pos += n;
        Ok(out)
    }

    fn u32(&mut self, at: At) -> Result<u32, PickleError> {
        let b = self.take(4, at)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self, at: At) -> Result<u64, PickleError> {
        let b = self.take(8, at)?;
        let mut buf = [0u8; 8];
        buf.copy_from_slice(b);
        Ok(u64::from_le_bytes(buf))
    }

    /// The length-prefixed argument of opcode `byte`; the length is checked against the
    /// input before anything is copied.
    fn counted(&mut self, byte: u8, at: At) -> Result<&'a [u8], PickleError> {
        let width = match op::info(byte) {
            Some((_, Arg::Counted(w))) => w,
            _ => return Err(at.bad_arg()),
        };
        let len: u64 = match width {
            1 => u64::from(self.take(1, at)?[0]),
            4 => {
                let raw = self.u32(at)?;
                // LONG4 and BINSTRING lengths are signed.
                let signed = matches!(byte, op::LONG4 | op::BINSTRING);
                if signed && raw > i32::MAX as u32 {
                    return Err(at.bad_arg());
                }
                u64::from(raw)
            }
            _ => self.u64(at)?,
        };
        if len > self.remaining() as u64 {
            return Err(PickleError::TooLong {
                opcode: at.opcode,
                offset: at.offset,
                len,
            });
        }
        // Fits: len <= remaining, which is a usize.
        self.take(len as usize, at)
    }

    fn line(&mut self, at: At) -> Result<&'a [u8], PickleError> {
        let data: &'a [u8] = self.data;
        let rest = &data[self.pos..];
        let Some(nl) = rest.iter().position(|&b| b == b'\n') else {
            return Err(PickleError::Truncated {
                opcode: at.opcode,
                offset: at.offset,
            });
        };
        self.pos += nl + 1;
        Ok(&rest[..nl])
    }

    fn line_str(&mut self, at: At) -> Result<&'a str, PickleError> {
        let line = self.line(at)?;
        std::str::from_utf8(line).map_err(|_| at.bad_arg())
    }

    fn line_index(&mut self, at: At) -> Result<u64, PickleError> {
        self.line_str(at)?
            .trim()
            .parse::<u64>()
            .map_err(|_| at.bad_arg())
    }

    fn push(&mut self, node: Node) {
        let id = self.arena.push(node);
        self.stack.push(id);
    }

    /// Stack index where the current MARK frame begins.
    fn base(&self) -> usize {
        self.marks.last().copied().unwrap_or(0)
    }

    fn underflow(&self, at: At) -> PickleError {
        PickleError::StackUnderflow {
            opcode: at.opcode,
            offset: at.offset,
        }
    }

    fn pop(&mut self, at: At) -> Result<Id, PickleError> {
        if self.stack.len() <= self.base() {
            return Err(self.underflow(at));
        }
        self.stack.pop().ok_or(self.underflow(at))
    }

    fn top(&self, at: At) -> Result<Id, PickleError> {
        if self.stack.len() <= self.base() {
            return Err(self.underflow(at));
        }
        self.stack.last().copied().ok_or(self.underflow(at))
    }

    fn pop_mark(&mut self, at: At) -> Result<Vec<Id>, PickleError> {
        let mark = self.marks.pop().ok_or(PickleError::MissingMark {
            opcode: at.opcode,
            offset: at.offset,
        })?;
        Ok(self.stack.split_off(mark.min(self.stack.len())))
    }

    fn get(&mut self, index: u64, at: At) -> Result<(), PickleError> {
        let id = self.memo.get(index).ok_or(PickleError::BadMemo {
            index,
            offset: at.offset,
        })?;
        self.stack.push(id);
        Ok(())
    }

    fn put(&mut self, index: u64, at: At) -> Result<(), PickleError> {
        let top = self.top(at)?;
        self.memo.insert(index, top);
        Ok(())
    }
}

fn found(node: Option<&mut Node>) -> &'static str {
    node.map_or("nothing", |n| n.type_name())
}

fn pairs(items: &[Id], at: At) -> Result<Vec<(Id, Id)>, PickleError> {
    if items.len() % 2 != 0 {
        return Err(at.wrong("key/value pairs", "an odd number of items"));
    }
    Ok(items.chunks_exact(2).map(|kv| (kv[0], kv[1])).collect())
}

/// Python 3 decodes protocol-0/1 byte strings as text; keep them as `str` when they are
/// UTF-8 and as bytes otherwise.
fn bytes_or_str(bytes: Vec<u8>) -> Node {
    match String::from_utf8(bytes) {
        Ok(s) => Node::Str(s),
        Err(e) => Node::Bytes(e.into_bytes()),
    }
}
