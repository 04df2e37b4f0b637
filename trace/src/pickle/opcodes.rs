//! The pickle opcode table: byte values, names, argument layouts, and which opcodes run code.
//!
//! Shared by the reader (which executes data opcodes and refuses code-running ones), the
//! writer (which emits only the subset MemoryViz.js understands) and the opcode scanner.

#![allow(missing_docs)]

pub const MARK: u8 = b'(';
pub const STOP: u8 = b'.';
pub const POP: u8 = b'0';
pub const POP_MARK: u8 = b'1';
pub const DUP: u8 = b'2';
pub const FLOAT: u8 = b'F';
pub const INT: u8 = b'I';
pub const BININT: u8 = b'J';
pub const BININT1: u8 = b'K';
pub const LONG: u8 = b'L';
pub const BININT2: u8 = b'M';
pub const NONE: u8 = b'N';
pub const PERSID: u8 = b'P';
pub const BINPERSID: u8 = b'Q';
pub const REDUCE: u8 = b'R';
pub const STRING: u8 = b'S';
pub const BINSTRING: u8 = b'T';
pub const SHORT_BINSTRING: u8 = b'U';
pub const UNICODE: u8 = b'V';
pub const BINUNICODE: u8 = b'X';
pub const APPEND: u8 = b'a';
pub const BUILD: u8 = b'b';
pub const GLOBAL: u8 = b'c';
pub const DICT: u8 = b'd';
pub const EMPTY_DICT: u8 = b'}';
pub const APPENDS: u8 = b'e';
pub const GET: u8 = b'g';
pub const BINGET: u8 = b'h';
pub const INST: u8 = b'i';
pub const LONG_BINGET: u8 = b'j';
pub const LIST: u8 = b'l';
pub const EMPTY_LIST: u8 = b']';
pub const OBJ: u8 = b'o';
pub const PUT: u8 = b'p';
pub const BINPUT: u8 = b'q';
pub const LONG_BINPUT: u8 = b'r';
pub const SETITEM: u8 = b's';
pub const TUPLE: u8 = b't';
pub const EMPTY_TUPLE: u8 = b')';
pub const SETITEMS: u8 = b'u';
pub const BINFLOAT: u8 = b'G';
// Protocol 2.
pub const PROTO: u8 = 0x80;
pub const NEWOBJ: u8 = 0x81;
pub const EXT1: u8 = 0x82;
pub const EXT2: u8 = 0x83;
pub const EXT4: u8 = 0x84;
pub const TUPLE1: u8 = 0x85;
pub const TUPLE2: u8 = 0x86;
pub const TUPLE3: u8 = 0x87;
pub const NEWTRUE: u8 = 0x88;
pub const NEWFALSE: u8 = 0x89;
pub const LONG1: u8 = 0x8a;
pub const LONG4: u8 = 0x8b;
// Protocol 3.
pub const BINBYTES: u8 = b'B';
pub const SHORT_BINBYTES: u8 = b'C';
// Protocol 4.
pub const SHORT_BINUNICODE: u8 = 0x8c;
pub const BINUNICODE8: u8 = 0x8d;
pub const BINBYTES8: u8 = 0x8e;
pub const EMPTY_SET: u8 = 0x8f;
pub const ADDITEMS: u8 = 0x90;
pub const FROZENSET: u8 = 0x91;
pub const NEWOBJ_EX: u8 = 0x92;
pub const STACK_GLOBAL: u8 = 0x93;
pub const MEMOIZE: u8 = 0x94;
pub const FRAME: u8 = 0x95;
// Protocol 5.
pub const BYTEARRAY8: u8 = 0x96;
pub const NEXT_BUFFER: u8 = 0x97;
pub const READONLY_BUFFER: u8 = 0x98;

/// The opcodes that import or call Python code (or depend on the loader's persistent-id /
/// extension registries). A safe reader must refuse every one of them.
pub const FORBIDDEN: [u8; 13] = [
    GLOBAL,
    STACK_GLOBAL,
    REDUCE,
    BUILD,
    INST,
    OBJ,
    NEWOBJ,
    NEWOBJ_EX,
    PERSID,
    BINPERSID,
    EXT1,
    EXT2,
    EXT4,
];

/// The opcodes MemoryViz.js's own unpickler understands; our writer emits nothing else.
pub const MEMORYVIZ_WHITELIST: [u8; 32] = [
    PROTO,
    FRAME,
    MARK,
    STOP,
    EMPTY_DICT,
    EMPTY_LIST,
    EMPTY_TUPLE,
    DICT,
    LIST,
    TUPLE,
    TUPLE1,
    TUPLE2,
    TUPLE3,
    SETITEM,
    SETITEMS,
    APPEND,
    APPENDS,
    BININT,
    BININT1,
    BININT2,
    LONG1,
    BINFLOAT,
    SHORT_BINUNICODE,
    BINUNICODE,
    NONE,
    NEWTRUE,
    NEWFALSE,
    BINGET,
    LONG_BINGET,
    BINPUT,
    LONG_BINPUT,
    MEMOIZE,
];

/// Whether `op` runs code (see [`FORBIDDEN`]).
pub fn is_forbidden(op: u8) -> bool {
    FORBIDDEN.contains(&op)
}

/// How an opcode's argument is laid out after the opcode byte.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arg {
    /// No argument.
    None,
    /// A fixed number of bytes.
    Fixed(usize),
    /// A little-endian length of this many bytes (1, 4 or 8), then that many bytes.
    Counted(usize),
    /// This many newline-terminated text lines.
    Lines(usize),
}

/// The name and argument layout of a known opcode, `None` for a byte that is no opcode.
/// (A table lookup: the reader asks once per opcode.)
pub fn info(op: u8) -> Option<(&'static str, Arg)> {
    INFO[usize::from(op)]
}

/// [`info`] of every byte, computed at compile time.
static INFO: [Option<(&str, Arg)>; 256] = {
    let mut table = [Option::None; 256];
    let mut i = 0;
    while i < 256 {
        table[i] = describe(i as u8);
        i += 1;
    }
    table
};

const fn describe(op: u8) -> Option<(&'static str, Arg)> {
    use Arg::*;
    Some(match op {
        MARK => ("MARK", None),
        STOP => ("STOP", None),
        POP => ("POP", None),
        POP_MARK => ("POP_MARK", None),
        DUP => ("DUP", None),
        FLOAT => ("FLOAT", Lines(1)),
        INT => ("INT", Lines(1)),
        BININT => ("BININT", Fixed(4)),
        BININT1 => ("BININT1", Fixed(1)),
        LONG => ("LONG", Lines(1)),
        BININT2 => ("BININT2", Fixed(2)),
        NONE => ("NONE", None),
        PERSID => ("PERSID", Lines(1)),
        BINPERSID => ("BINPERSID", None),
        REDUCE => ("REDUCE", None),
        STRING => ("STRING", Lines(1)),
        BINSTRING => ("BINSTRING", Counted(4)),
        SHORT_BINSTRING => ("SHORT_BINSTRING", Counted(1)),
        UNICODE => ("UNICODE", Lines(1)),
        BINUNICODE => ("BINUNICODE", Counted(4)),
        APPEND => ("APPEND", None),
        BUILD => ("BUILD", None),
        GLOBAL => ("GLOBAL", Lines(2)),
        DICT => ("DICT", None),
        EMPTY_DICT => ("EMPTY_DICT", None),
        APPENDS => ("APPENDS", None),
        GET => ("GET", Lines(1)),
        BINGET => ("BINGET", Fixed(1)),
        INST => ("INST", Lines(2)),
        LONG_BINGET => ("LONG_BINGET", Fixed(4)),
        LIST => ("LIST", None),
        EMPTY_LIST => ("EMPTY_LIST", None),
        OBJ => ("OBJ", None),
        PUT => ("PUT", Lines(1)),
        BINPUT => ("BINPUT", Fixed(1)),
        LONG_BINPUT => ("LONG_BINPUT", Fixed(4)),
        SETITEM => ("SETITEM", None),
        TUPLE => ("TUPLE", None),
        EMPTY_TUPLE => ("EMPTY_TUPLE", None),
        SETITEMS => ("SETITEMS", None),
        BINFLOAT => ("BINFLOAT", Fixed(8)),
        PROTO => ("PROTO", Fixed(1)),
        NEWOBJ => ("NEWOBJ", None),
        EXT1 => ("EXT1", Fixed(1)),
        EXT2 => ("EXT2", Fixed(2)),
        EXT4 => ("EXT4", Fixed(4)),
        TUPLE1 => ("TUPLE1", None),
        TUPLE2 => ("TUPLE2", None),
        TUPLE3 => ("TUPLE3", None),
        NEWTRUE => ("NEWTRUE", None),
        NEWFALSE => ("NEWFALSE", None),
        LONG1 => ("LONG1", Counted(1)),
        LONG4 => ("LONG4", Counted(4)),
        BINBYTES => ("BINBYTES", Counted(4)),
        SHORT_BINBYTES => ("SHORT_BINBYTES", Counted(1)),
        SHORT_BINUNICODE => ("SHORT_BINUNICODE", Counted(1)),
        BINUNICODE8 => ("BINUNICODE8", Counted(8)),
        BINBYTES8 => ("BINBYTES8", Counted(8)),
        EMPTY_SET => ("EMPTY_SET", None),
        ADDITEMS => ("ADDITEMS", None),
        FROZENSET => ("FROZENSET", None),
        NEWOBJ_EX => ("NEWOBJ_EX", None),
        STACK_GLOBAL => ("STACK_GLOBAL", None),
        MEMOIZE => ("MEMOIZE", None),
        FRAME => ("FRAME", Fixed(8)),
        BYTEARRAY8 => ("BYTEARRAY8", Counted(8)),
        NEXT_BUFFER => ("NEXT_BUFFER", None),
        READONLY_BUFFER => ("READONLY_BUFFER", None),
        _ => return Option::None,
    })
}

/// The name of `op`, or `"<unknown>"`.
pub fn name(op: u8) -> &'static str {
    info(op).map_or("<unknown>", |(n, _)| n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_listed_opcode_has_a_name() {
        for op in FORBIDDEN.iter().chain(MEMORYVIZ_WHITELIST.iter()) {
            assert_ne!(name(*op), "<unknown>", "opcode {op:#04x}");
        }
        assert_eq!(name(GLOBAL), "GLOBAL");
        assert_eq!(name(0xff), "<unknown>");
        assert!(is_forbidden(REDUCE));
        assert!(!is_forbidden(SETITEMS));
    }

    #[test]
    fn whitelist_and_forbidden_are_disjoint() {
        for op in MEMORYVIZ_WHITELIST {
            assert!(!is_forbidden(op), "{}", name(op));
        }
    }
}
