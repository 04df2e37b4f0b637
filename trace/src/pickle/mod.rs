//! Pickle: a plain-data value model, a safe reader (refuses code-running opcodes), a writer
//! restricted to the opcodes PyTorch's MemoryViz.js decodes, and an opcode scanner.

mod arena;
pub mod opcodes;
mod read;
mod scan;
mod text;
mod value;
mod write;

pub use arena::MAX_DEPTH;
pub(crate) use arena::{Arena, Budget, Id, Node};
pub use opcodes::{FORBIDDEN, MEMORYVIZ_WHITELIST};
pub(crate) use read::parse;
pub use read::{read, read_with_limit};
pub use scan::opcodes_used;
pub use value::Value;
pub use write::{write, MAX_WRITE_DEPTH};
