//! A JSON Lines trace format: one event per line, one JSON object per event.
//!
//! ```text
//! {"action":"segment_alloc","addr":139927954128896,"size":20971520,"stream":0}
//! {"action":"alloc","addr":139927954128896,"size":1048576,"stream":0,"time_us":1772552894612373}
//! {"action":"free_requested","addr":"0x7f4300000000","size":1048576}
//! {"action":"free_completed","addr":"0x7f4300000000","size":1048576}
//! {"action":"oom","size":1073741824,"device_free":52428800}
//! ```
//!
//! Keys (unknown keys are ignored):
//!
//! | key | type | required | meaning |
//! |---|---|---|---|
//! | `action` | string | yes | a PyTorch action name: `alloc`, `free_requested`, `free_completed`, `segment_alloc`, `segment_free`, `segment_map`, `segment_unmap`, `oom`, `snapshot`; `free` is accepted as `free_completed` |
//! | `addr` | integer ≥ 0, or a hex string `"0x…"` | yes, except for `oom` and `snapshot` (default 0) | block or segment address |
//! | `size` | integer ≥ 0 | yes, except for `snapshot` (default 0) | bytes |
//! | `stream` | integer ≥ 0, or a hex string | no (default 0) | stream handle |
//! | `time_us` | integer | no | microseconds since the epoch |
//! | `device_free` | integer ≥ 0 | no | for `oom`: the device's free bytes |
//! | `frames` | list of `{"filename": str, "line": int, "name": str}` | no | call stack, innermost first |
//!
//! Blank lines and lines starting with `#` are skipped. [`write()`] produces this format
//! (addresses as integers) and [`parse`] reads it back unchanged.

use serde_json::{Map, Value as Json};

use crate::error::TraceError;
use crate::event::{Action, Frame, TraceEntry};

const FORMAT: &str = "JSON Lines";

/// Parses a JSON Lines trace (see the module documentation for the format).
pub fn parse(text: &str) -> Result<Vec<TraceEntry>, TraceError> {
    let mut out = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let line = raw.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let err = |message: String| TraceError::Line {
            format: FORMAT,
            line: i + 1,
            message,
        };
        let json: Json =
            serde_json::from_str(line).map_err(|e| err(format!("invalid JSON: {e}")))?;
        let Json::Object(obj) = json else {
            return Err(err("expected a JSON object".to_owned()));
        };
        out.push(entry(&obj).map_err(err)?);
    }
    Ok(out)
}

fn entry(obj: &Map<String, Json>) -> Result<TraceEntry, String> {
    let action = match obj.get("action") {
        None => return Err("`action` is missing".to_owned()),
        Some(Json::String(s)) if s == "free" => Action::FreeCompleted,
        Some(Json::String(s)) => {
            Action::from_name(s).ok_or_else(|| format!("`action`: unknown action {s:?}"))?
        }
        Some(_) => return Err("`action` must be a string".to_owned()),
    };
    let addr = match obj.get("addr") {
        Some(v) => unsigned(v, "addr", true)?,
        None if matches!(action, Action::Oom | Action::Snapshot) => 0,
        None => return Err("`addr` is missing".to_owned()),
    };
    let size = match obj.get("size") {
        Some(v) => unsigned(v, "size", false)?,
        None if action == Action::Snapshot => 0,
        None => return Err("`size` is missing".to_owned()),
    };
    let stream = obj
        .get("stream")
        .map(|v| unsigned(v, "stream", true))
        .transpose()?
        .unwrap_or(0);
    let time_us = match obj.get("time_us") {
        None | Some(Json::Null) => None,
        Some(v) => Some(
            v.as_i64()
                .ok_or_else(|| "`time_us` must be an integer".to_owned())?,
        ),
    };
    let device_free = match obj.get("device_free") {
        None | Some(Json::Null) => None,
        Some(v) => Some(unsigned(v, "device_free", false)?),
    };
    let frames = match obj.get("frames") {
        None | Some(Json::Null) => Vec::new(),
        Some(Json::Array(items)) => items
            .iter()
            .enumerate()
            .map(|(i, f)| frame(f).map_err(|m| format!("`frames[{i}]`: {m}")))
            .collect::<Result<_, _>>()?,
        Some(_) => return Err("`frames` must be a list".to_owned()),
    };
    Ok(TraceEntry {
        action,
        addr,
        size,
        stream,
        time_us,
        device_free,
        frames,
    })
}

fn unsigned(v: &Json, key: &str, hex_ok: bool) -> Result<u64, String> {
    match v {
        Json::Number(n) => {
            if let Some(u) = n.as_u64() {
                Ok(u)
            } else if n.as_i64().is_some_and(|i| i < 0) {
                Err(format!("`{key}` is negative ({n})"))
            } else {
                Err(format!("`{key}` must be a non-negative integer, found {n}"))
            }
        }
        Json::String(s) if hex_ok => s
            .strip_prefix("0x")
            .and_then(|h| u64::from_str_radix(h, 16).ok())
            .ok_or_else(|| format!("`{key}`: {s:?} is not a hex string like \"0x7f00\"")),
        _ => Err(format!("`{key}` must be an integer")),
    }
}

fn frame(v: &Json) -> Result<Frame, String> {
    let Json::Object(o) = v else {
        return Err("expected an object".to_owned());
    };
    let text = |key: &str| match o.get(key) {
        None => Ok("??"),
        Some(Json::String(s)) => Ok(s.as_str()),
        Some(_) => Err(format!("`{key}` must be a string")),
    };
    let line = match o.get("line") {
        None => 0,
        Some(v) => v
            .as_i64()
            .ok_or_else(|| "`line` must be an integer".to_owned())?,
    };
    Ok(Frame::new(text("filename")?, line, text("name")?))
}

/// Writes trace entries in this format, one line each (every line ends with `\n`).
pub fn write(entries: &[TraceEntry]) -> String {
    let mut out = String::new();
    for e in entries {
        let mut obj = Map::new();
        obj.insert("action".into(), Json::from(e.action.as_str()));
        obj.insert("addr".into(), Json::from(e.addr));
        obj.insert("size".into(), Json::from(e.size));
        obj.insert("stream".into(), Json::from(e.stream));
        if let Some(t) = e.time_us {
            obj.insert("time_us".into(), Json::from(t));
        }
        if let Some(f) = e.device_free {
            obj.insert("device_free".into(), Json::from(f));
        }
        if !e.frames.is_empty() {
            let frames = e
                .frames
                .iter()
                .map(|f| {
                    let mut m = Map::new();
                    m.insert("filename".into(), Json::from(&*f.filename));
                    m.insert("line".into(), Json::from(f.line));
                    m.insert("name".into(), Json::from(&*f.name));
                    Json::Object(m)
                })
                .collect();
            obj.insert("frames".into(), Json::Array(frames));
        }
        out.push_str(&Json::Object(obj).to_string());
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const TRACE: &str = r#"# a comment
{"action":"segment_alloc","addr":139927954128896,"size":20971520,"stream":0}
{"action":"alloc","addr":139927954128896,"size":1048576,"stream":0,"time_us":1772552894612373,"extra":1}

{"action":"free_requested","addr":"0x7f4300000000","size":1048576}
{"action":"free","addr":"0x7f4300000000","size":1048576,"frames":[{"filename":"a.py","line":3,"name":"f"}]}
{"action":"oom","size":1073741824,"device_free":52428800}
"#;

    #[test]
    fn parses_the_documented_example() {
        let t = parse(TRACE).unwrap();
        assert_eq!(t.len(), 5);
        assert_eq!(t[0].action, Action::SegmentAlloc);
        assert_eq!(t[0].size, 20_971_520);
        assert_eq!(t[1].time_us, Some(1_772_552_894_612_373));
        assert_eq!(t[2].addr, 0x7f43_0000_0000);
        assert_eq!(t[3].action, Action::FreeCompleted);
        assert_eq!(t[3].frames, vec![Frame::new("a.py", 3, "f")]);
        assert_eq!(t[4].action, Action::Oom);
        assert_eq!(t[4].addr, 0);
        assert_eq!(t[4].device_free, Some(52_428_800));
    }

    #[test]
    fn write_then_parse_is_identity() {
        let t = parse(TRACE).unwrap();
        let text = write(&t);
        assert_eq!(text.lines().count(), 5);
        assert_eq!(parse(&text).unwrap(), t);
    }

    #[test]
    fn bad_lines_name_the_line_and_field() {
        let cases = [
            (
                r#"{"action":"alloc","addr":16,"size":-8}"#,
                "`size` is negative",
            ),
            (r#"{"action":"alloc","size":8}"#, "`addr` is missing"),
            (r#"{"action":"malloc","addr":1,"size":8}"#, "unknown action"),
            (
                r#"{"action":"alloc","addr":"16","size":8}"#,
                "not a hex string",
            ),
            (
                r#"{"action":"alloc","addr":1.5,"size":8}"#,
                "non-negative integer",
            ),
            (
                r#"{"action":"alloc","addr":1,"size":8,"frames":[{"line":"x"}]}"#,
                "frames[0]",
            ),
            (r#"[1,2]"#, "expected a JSON object"),
            (r#"{"action":"alloc""#, "invalid JSON"),
        ];
        for (line, what) in cases {
            let text = format!("{{\"action\":\"snapshot\"}}\n{line}\n");
            match parse(&text) {
                Err(TraceError::Line {
                    format,
                    line: 2,
                    message,
                }) => {
                    assert_eq!(format, "JSON Lines");
                    assert!(
                        message.contains(what),
                        "{message:?} should contain {what:?}"
                    );
                }
                other => panic!("{line}: expected a line-2 error, got {other:?}"),
            }
        }
    }
}
