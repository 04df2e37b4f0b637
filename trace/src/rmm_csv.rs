//! RMM's `logging_resource_adaptor` CSV logs.
//!
//! The adaptor writes a header `Thread,Time,Action,Pointer,Size,Stream` and one line per
//! event, e.g.
//!
//! ```text
//! Thread,Time,Action,Pointer,Size,Stream
//! 140573312345856,14:03:22.123456,allocate,0x7f8a40000000,1024,0x7f8a38001020
//! 140573312345856,14:03:22.234567,free,0x7f8a40000000,1024,0x7f8a38001020
//! 140573312345856,14:03:22.345678,allocate failure,0x0,1099511627776,0x7f8a38001020
//! ```
//!
//! - `Thread`: the logging thread's id (read and checked, not kept).
//! - `Time`: spdlog's `%H:%M:%S.%f` (time of day; fractions of any precision), or seconds
//!   since the epoch with a fraction (`1634567890.123456`). Becomes
//!   [`TraceEntry::time_us`]; a time of day that goes backwards by more than 12 hours is
//!   taken as crossing midnight.
//! - `Action`: `allocate` → [`Action::Alloc`]; `free` (or `deallocate`) →
//!   [`Action::FreeCompleted`] (RMM frees are immediate; there is no separate free request);
//!   `allocate failure` → [`Action::Oom`] with address 0.
//! - `Pointer`, `Stream`: hexadecimal, with or without `0x` (RMM writes both, depending on
//!   the version).
//! - `Size`: decimal bytes.
//!
//! The header line is optional; blank lines are skipped.

use crate::error::TraceError;
use crate::event::{Action, TraceEntry};

const FORMAT: &str = "RMM CSV";
const DAY_US: i64 = 24 * 3600 * 1_000_000;

/// Parses an RMM `logging_resource_adaptor` CSV log into trace entries, in file order.
pub fn parse(text: &str) -> Result<Vec<TraceEntry>, TraceError> {
    let mut out = Vec::new();
    let mut day_offset = 0i64;
    let mut last_time_of_day: Option<i64> = None;
    for (i, raw) in text.lines().enumerate() {
        let line_no = i + 1;
        let line = raw.trim();
        if line.is_empty() {
            continue;
        }
        let err = |message: String| TraceError::Line {
            format: FORMAT,
            line: line_no,
            message,
        };
        let fields: Vec<&str> = line.split(',').map(str::trim).collect();
        if fields.first() == Some(&"Thread") {
            continue;
        }
        let &[thread, time, action, pointer, size, stream] = fields.as_slice() else {
            return Err(err(format!(
                "expected 6 fields (Thread,Time,Action,Pointer,Size,Stream), found {}",
                fields.len()
            )));
        };
        thread
            .parse::<u64>()
            .map_err(|_| err(format!("Thread is not an integer: {thread:?}")))?;
        let (mut time_us, is_time_of_day) =
            parse_time(time).ok_or_else(|| err(format!("Time is not a time: {time:?}")))?;
        if is_time_of_day {
            if let Some(last) = last_time_of_day {
                if time_us + DAY_US / 2 < last {
                    day_offset += DAY_US;
                }
            }
            last_time_of_day = Some(time_us);
            time_us += day_offset;
        }
        let action = match action {
            "allocate" => Action::Alloc,
            "free" | "deallocate" => Action::FreeCompleted,
            "allocate failure" => Action::Oom,
            other => return Err(err(format!("unknown Action {other:?}"))),
        };
        let addr = parse_hex(pointer)
            .ok_or_else(|| err(format!("Pointer is not a hex address: {pointer:?}")))?;
        let size = parse_size(size).map_err(err)?;
        let stream = parse_hex(stream)
            .ok_or_else(|| err(format!("Stream is not a hex handle: {stream:?}")))?;
        let mut entry = TraceEntry::new(action, addr, size, stream);
        entry.time_us = Some(time_us);
        out.push(entry);
    }
    Ok(out)
}

fn parse_size(s: &str) -> Result<u64, String> {
    if s.starts_with('-') {
        return Err(format!("Size is negative ({s})"));
    }
    s.parse::<u64>()
        .map_err(|_| format!("Size is not an integer: {s:?}"))
}

/// Hexadecimal with optional `0x`; `nullptr` / `(nil)` read as 0.
fn parse_hex(s: &str) -> Option<u64> {
    if s == "nullptr" || s == "(nil)" {
        return Some(0);
    }
    let digits = s
        .strip_prefix("0x")
        .or_else(|| s.strip_prefix("0X"))
        .unwrap_or(s);
    if digits.is_empty() {
        return None;
    }
    u64::from_str_radix(digits, 16).ok()
}

/// Microseconds, and whether the value was a time of day (`HH:MM:SS.fff`) rather than
/// seconds since the epoch.
fn parse_time(s: &str) -> Option<(i64, bool)> {
    let (whole, frac) = match s.split_once('.') {
        Some((w, f)) => (w, f),
        None => (s, ""),
    };
    if !frac.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    // Fraction to microseconds, whatever its precision.
    let mut frac_us = 0i64;
    for (i, b) in frac.bytes().take(6).enumerate() {
        frac_us += i64::from(b - b'0') * 10i64.pow(5 - i as u32);
    }
    let parts: Vec<&str> = whole.split(':').collect();
    match parts.as_slice() {
        [secs] => {
            let secs: i64 = secs.parse().ok().filter(|v| *v >= 0)?;
            Some((secs.checked_mul(1_000_000)?.checked_add(frac_us)?, false))
        }
        [h, m, sec] => {
            let h: i64 = h.parse().ok().filter(|v| (0..24).contains(v))?;
            let m: i64 = m.parse().ok().filter(|v| (0..60).contains(v))?;
            let sec: i64 = sec.parse().ok().filter(|v| (0..61).contains(v))?;
            Some((((h * 60 + m) * 60 + sec) * 1_000_000 + frac_us, true))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LOG: &str = "Thread,Time,Action,Pointer,Size,Stream
140573312345856,23:59:59.999999,allocate,0x7f8a40000000,1024,0x7f8a38001020
140573312345856,23:59:59.9999995,allocate,7f8a40000400,2048,7f8a38001020

140573312345856,00:00:00.000001,free,0x7f8a40000000,1024,0x7f8a38001020
140573312345856,00:00:00.5,allocate failure,0x0,1099511627776,0x0
";

    #[test]
    fn parses_both_pointer_styles_and_crosses_midnight() {
        let t = parse(LOG).unwrap();
        assert_eq!(t.len(), 4);
        assert_eq!(t[0].action, Action::Alloc);
        assert_eq!(t[0].addr, 0x7f8a_4000_0000);
        assert_eq!(t[0].size, 1024);
        assert_eq!(t[0].stream, 0x7f8a_3800_1020);
        assert_eq!(t[0].time_us, Some(86_399_999_999));
        assert_eq!(t[1].addr, 0x7f8a_4000_0400);
        assert_eq!(t[1].stream, 0x7f8a_3800_1020);
        assert_eq!(t[2].action, Action::FreeCompleted);
        assert_eq!(t[2].time_us, Some(86_400_000_001));
        assert_eq!(t[3].action, Action::Oom);
        assert_eq!(t[3].addr, 0);
        assert_eq!(t[3].size, 1 << 40);
        assert_eq!(t[3].time_us, Some(86_400_500_000));
    }

    #[test]
    fn epoch_seconds_and_deallocate() {
        let t = parse("1,1634567890.123456,deallocate,0x10,8,0x0\n").unwrap();
        assert_eq!(t[0].time_us, Some(1_634_567_890_123_456));
        assert_eq!(t[0].action, Action::FreeCompleted);
    }

    #[test]
    fn bad_lines_are_typed_errors_with_line_numbers() {
        let bad = [
            ("1,00:00:01.0,allocate,0x10,-8,0x0", "negative"),
            ("1,00:00:01.0,allocate,0x10,8", "expected 6 fields"),
            ("1,00:00:01.0,reallocate,0x10,8,0x0", "unknown Action"),
            ("1,00:00:01.0,allocate,0xzz,8,0x0", "Pointer"),
            ("1,25:00:01.0,allocate,0x10,8,0x0", "Time"),
            ("x,00:00:01.0,allocate,0x10,8,0x0", "Thread"),
            ("1,00:00:01.0,allocate,0x10,8,0x10000000000000000", "Stream"),
        ];
        for (line, what) in bad {
            let text = format!("Thread,Time,Action,Pointer,Size,Stream\n{line}\n");
            match parse(&text) {
                Err(TraceError::Line {
                    format,
                    line,
                    message,
                }) => {
                    assert_eq!(format, "RMM CSV");
                    assert_eq!(line, 2);
                    assert!(message.contains(what), "{message} should mention {what}");
                }
                other => panic!("{line:?}: expected a line error, got {other:?}"),
            }
        }
    }
}
