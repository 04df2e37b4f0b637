//! Walks a pickle's opcode stream without executing it (like `pickletools.genops`).

use std::collections::BTreeSet;

use crate::error::PickleError;
use crate::pickle::opcodes::{self as op, Arg};

/// The set of opcode bytes a pickle uses, up to and including its STOP. Does not execute
/// anything, so it also lists forbidden opcodes (that is what it is for: checking a pickle
/// against a whitelist).
pub fn opcodes_used(bytes: &[u8]) -> Result<BTreeSet<u8>, PickleError> {
    let mut used = BTreeSet::new();
    let mut pos = 0usize;
    loop {
        let offset = pos;
        let Some(&byte) = bytes.get(pos) else {
            return Err(PickleError::MissingStop { offset });
        };
        let Some((opcode, arg)) = op::info(byte) else {
            return Err(PickleError::UnknownOpcode { byte, offset });
        };
        used.insert(byte);
        pos += 1;
        if byte == op::STOP {
            return Ok(used);
        }
        let truncated = PickleError::Truncated { opcode, offset };
        let rest = bytes.get(pos..).unwrap_or(&[]);
        let skip = match arg {
            Arg::None => 0,
            Arg::Fixed(n) => n,
            Arg::Counted(width) => {
                let len_bytes = rest.get(..width).ok_or(truncated.clone())?;
                let mut buf = [0u8; 8];
                buf[..width].copy_from_slice(len_bytes);
                let len = u64::from_le_bytes(buf);
                let total = len.checked_add(width as u64);
                match total {
                    Some(t) if t <= rest.len() as u64 => t as usize,
                    _ => {
                        return Err(PickleError::TooLong {
                            opcode,
                            offset,
                            len,
                        })
                    }
                }
            }
            Arg::Lines(n) => {
                let mut at = 0;
                for _ in 0..n {
                    let nl = rest[at..]
                        .iter()
                        .position(|&b| b == b'\n')
                        .ok_or(truncated.clone())?;
                    at += nl + 1;
                }
                at
            }
        };
        if skip > rest.len() {
            return Err(truncated);
        }
        pos += skip;
    }
}
