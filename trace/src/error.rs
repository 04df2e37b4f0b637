//! Typed errors: [`PickleError`] for the pickle layer, [`TraceError`] for the trace formats.

use thiserror::Error;

/// Why a pickle could not be read or written. Offsets are byte offsets into the input.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum PickleError {
    /// The input ended in the middle of an opcode or its argument.
    #[error("pickle truncated: {opcode} at byte {offset} needs more bytes than the input has")]
    Truncated {
        /// The opcode being read.
        opcode: &'static str,
        /// Where that opcode starts.
        offset: usize,
    },
    /// The input ended without a STOP opcode.
    #[error("pickle ended at byte {offset} without a STOP opcode")]
    MissingStop {
        /// The input length.
        offset: usize,
    },
    /// An opcode that imports or calls Python code (GLOBAL, REDUCE, ...): refused.
    #[error("refusing pickle opcode {opcode} ({byte:#04x}) at byte {offset}: it would run code")]
    Forbidden {
        /// The opcode's name.
        opcode: &'static str,
        /// The opcode byte.
        byte: u8,
        /// Where it is.
        offset: usize,
    },
    /// A byte that is no pickle opcode.
    #[error("unknown pickle opcode {byte:#04x} at byte {offset}")]
    UnknownOpcode {
        /// The byte.
        byte: u8,
        /// Where it is.
        offset: usize,
    },
    /// A valid opcode this reader does not support (out-of-band buffers).
    #[error("unsupported pickle opcode {opcode} at byte {offset}")]
    Unsupported {
        /// The opcode's name.
        opcode: &'static str,
        /// Where it is.
        offset: usize,
    },
    /// A PROTO opcode naming a protocol above 5.
    #[error("unsupported pickle protocol {protocol} at byte {offset}")]
    UnsupportedProtocol {
        /// The protocol number.
        protocol: u8,
        /// Where it is.
        offset: usize,
    },
    /// An opcode needed more values on the stack than there were.
    #[error("pickle stack underflow: {opcode} at byte {offset}")]
    StackUnderflow {
        /// The opcode.
        opcode: &'static str,
        /// Where it is.
        offset: usize,
    },
    /// An opcode that pops to the last MARK found none.
    #[error("pickle opcode {opcode} at byte {offset} has no MARK to pop to")]
    MissingMark {
        /// The opcode.
        opcode: &'static str,
        /// Where it is.
        offset: usize,
    },
    /// A memo read of an index that was never stored.
    #[error("pickle memo index {index} read at byte {offset} was never stored")]
    BadMemo {
        /// The memo index.
        index: u64,
        /// Where it is read.
        offset: usize,
    },
    /// An opcode applied to a value of the wrong type (e.g. APPEND to a dict).
    #[error("pickle opcode {opcode} at byte {offset} expected {expected}, found {found}")]
    WrongType {
        /// The opcode.
        opcode: &'static str,
        /// Where it is.
        offset: usize,
        /// What it needed.
        expected: &'static str,
        /// What it found.
        found: &'static str,
    },
    /// A length prefix larger than the rest of the input (or than memory can address).
    #[error(
        "pickle opcode {opcode} at byte {offset} declares length {len}, past the end of the input"
    )]
    TooLong {
        /// The opcode.
        opcode: &'static str,
        /// Where it is.
        offset: usize,
        /// The declared length.
        len: u64,
    },
    /// A string that is not valid UTF-8.
    #[error("pickle string of {opcode} at byte {offset} is not valid UTF-8")]
    InvalidUtf8 {
        /// The opcode.
        opcode: &'static str,
        /// Where it is.
        offset: usize,
    },
    /// A text argument (INT, LONG, FLOAT, GET, PUT, STRING, UNICODE) that does not parse.
    #[error("pickle opcode {opcode} at byte {offset} has a malformed argument")]
    BadArgument {
        /// The opcode.
        opcode: &'static str,
        /// Where it is.
        offset: usize,
    },
    /// Nesting deeper than the reader or writer allows (also what a self-containing value hits).
    #[error("pickle value nested deeper than {limit} levels (or self-referencing)")]
    TooDeep {
        /// The depth limit.
        limit: usize,
    },
    /// Shared (memoized) values would expand past the output budget.
    #[error(
        "pickle expands past the output limit of {limit} bytes (shared values repeated too often)"
    )]
    ExpansionLimit {
        /// The limit in bytes.
        limit: u64,
    },
    /// The writer was given a value MemoryViz.js's opcodes cannot express.
    #[error("cannot write {what} with MemoryViz.js's pickle opcodes")]
    Unrepresentable {
        /// What it was.
        what: &'static str,
    },
}

/// Why a trace (snapshot, RMM CSV, JSON Lines) could not be read or written.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum TraceError {
    /// The pickle layer failed.
    #[error("invalid pickle: {0}")]
    Pickle(#[from] PickleError),
    /// A snapshot without a recorded trace (e.g. the old list-of-segments format).
    #[error("no trace in this snapshot: {reason}")]
    NoTrace {
        /// What was found instead.
        reason: String,
    },
    /// A required field is absent.
    #[error("field `{field}` is missing")]
    MissingField {
        /// Path of the field, e.g. `segments[3].blocks[0].size`.
        field: String,
    },
    /// A field holds the wrong type.
    #[error("field `{field}`: expected {expected}, found {found}")]
    WrongType {
        /// Path of the field.
        field: String,
        /// What it should hold.
        expected: &'static str,
        /// What it holds.
        found: &'static str,
    },
    /// A size, address or stream that is negative.
    #[error("field `{field}` is negative ({value})")]
    Negative {
        /// Path of the field.
        field: String,
        /// The value.
        value: i64,
    },
    /// An integer too large for its field.
    #[error("field `{field}` is out of range")]
    OutOfRange {
        /// Path of the field.
        field: String,
    },
    /// A string field with a value this crate does not know (e.g. an unknown action).
    #[error("field `{field}` has unknown value {value:?}")]
    UnknownValue {
        /// Path of the field.
        field: String,
        /// The value.
        value: String,
    },
    /// A line of a text format (RMM CSV, JSON Lines) that does not parse.
    #[error("{format} line {line}: {message}")]
    Line {
        /// `"RMM CSV"` or `"JSON Lines"`.
        format: &'static str,
        /// 1-based line number.
        line: usize,
        /// What is wrong.
        message: String,
    },
}
