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

use std::borrow::Cow;
use std::fmt;

use serde::de::{Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use serde_json::{Map, Value as Json};

use crate::error::TraceError;
use crate::event::{Action, Frame, TraceEntry};

const FORMAT: &str = "JSON Lines";

/// Parses a JSON Lines trace (see the module documentation for the format).
///
/// Each line is read straight into its fields (strings borrowed from the text, unknown keys
/// skipped without building them), not into a generic JSON value first: loading is most of
/// the time a replay takes.
pub fn parse(text: &str) -> Result<Vec<TraceEntry>, TraceError> {
    let mut out = Vec::with_capacity(text.len() / 64);
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
        let fields: Fields<'_> = serde_json::from_str(line).map_err(|e| {
            err(if e.is_data() {
                e.to_string()
            } else {
                format!("invalid JSON: {e}")
            })
        })?;
        out.push(entry(fields).map_err(err)?);
    }
    Ok(out)
}

/// A JSON value where the format expects a scalar; anything else is `Other`.
#[derive(Debug)]
enum Scalar<'a> {
    Unsigned(u64),
    Signed(i64),
    Float(f64),
    Str(Cow<'a, str>),
    Null,
    Other,
}

impl<'de> Deserialize<'de> for Scalar<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Scalar<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON value")
            }
            fn visit_u64<E>(self, v: u64) -> Result<Self::Value, E> {
                Ok(Scalar::Unsigned(v))
            }
            fn visit_i64<E>(self, v: i64) -> Result<Self::Value, E> {
                Ok(Scalar::Signed(v))
            }
            fn visit_f64<E>(self, v: f64) -> Result<Self::Value, E> {
                Ok(Scalar::Float(v))
            }
            fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
                Ok(Scalar::Other)
            }
            fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(Scalar::Str(Cow::Borrowed(v)))
            }
            fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
                Ok(Scalar::Str(Cow::Owned(v.to_owned())))
            }
            fn visit_unit<E>(self) -> Result<Self::Value, E> {
                Ok(Scalar::Null)
            }
            fn visit_none<E>(self) -> Result<Self::Value, E> {
                Ok(Scalar::Null)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(Scalar::Other)
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok(Scalar::Other)
            }
        }
        d.deserialize_any(V)
    }
}

/// The keys the format knows.
enum Key {
    Action,
    Addr,
    Size,
    Stream,
    TimeUs,
    DeviceFree,
    Frames,
    Unknown,
}

impl<'de> Deserialize<'de> for Key {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Key;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a key")
            }
            fn visit_str<E>(self, v: &str) -> Result<Key, E> {
                Ok(match v {
                    "action" => Key::Action,
                    "addr" => Key::Addr,
                    "size" => Key::Size,
                    "stream" => Key::Stream,
                    "time_us" => Key::TimeUs,
                    "device_free" => Key::DeviceFree,
                    "frames" => Key::Frames,
                    _ => Key::Unknown,
                })
            }
        }
        d.deserialize_str(V)
    }
}

/// One line's fields, as given (a later duplicate key wins, as in a JSON object).
#[derive(Default)]
struct Fields<'a> {
    action: Option<Scalar<'a>>,
    addr: Option<Scalar<'a>>,
    size: Option<Scalar<'a>>,
    stream: Option<Scalar<'a>>,
    time_us: Option<Scalar<'a>>,
    device_free: Option<Scalar<'a>>,
    /// Rare and nested: kept as a generic value, checked by [`frame`].
    frames: Option<Json>,
}

impl<'de> Deserialize<'de> for Fields<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Fields<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut f = Fields::default();
                while let Some(key) = map.next_key::<Key>()? {
                    let slot = match key {
                        Key::Action => &mut f.action,
                        Key::Addr => &mut f.addr,
                        Key::Size => &mut f.size,
                        Key::Stream => &mut f.stream,
                        Key::TimeUs => &mut f.time_us,
                        Key::DeviceFree => &mut f.device_free,
                        Key::Frames => {
                            f.frames = Some(map.next_value()?);
                            continue;
                        }
                        Key::Unknown => {
                            map.next_value::<IgnoredAny>()?;
                            continue;
                        }
                    };
                    *slot = Some(map.next_value()?);
                }
                Ok(f)
            }
        }
        d.deserialize_map(V)
    }
}

fn entry(f: Fields<'_>) -> Result<TraceEntry, String> {
    let action = match &f.action {
        None => return Err("`action` is missing".to_owned()),
        Some(Scalar::Str(s)) if s == "free" => Action::FreeCompleted,
        Some(Scalar::Str(s)) => {
            Action::from_name(s).ok_or_else(|| format!("`action`: unknown action {s:?}"))?
        }
        Some(_) => return Err("`action` must be a string".to_owned()),
    };
    let addr = match &f.addr {
        Some(v) => unsigned(v, "addr", true)?,
        None if matches!(action, Action::Oom | Action::Snapshot) => 0,
        None => return Err("`addr` is missing".to_owned()),
    };
    let size = match &f.size {
        Some(v) => unsigned(v, "size", false)?,
        None if action == Action::Snapshot => 0,
        None => return Err("`size` is missing".to_owned()),
    };
    let stream = f
        .stream
        .as_ref()
        .map(|v| unsigned(v, "stream", true))
        .transpose()?
        .unwrap_or(0);
    let time_us = match &f.time_us {
        None | Some(Scalar::Null) => None,
        Some(Scalar::Signed(t)) => Some(*t),
        Some(Scalar::Unsigned(t)) => {
            Some(i64::try_from(*t).map_err(|_| "`time_us` must be an integer".to_owned())?)
        }
        Some(_) => return Err("`time_us` must be an integer".to_owned()),
    };
    let device_free = match &f.device_free {
        None | Some(Scalar::Null) => None,
        Some(v) => Some(unsigned(v, "device_free", false)?),
    };
    let frames = match f.frames {
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
        pool_id: None,
        passed_over: false,
        borrowed: false,
        spilled: false,
        grouped_pages: None,
        single_pages: None,
    })
}

fn unsigned(v: &Scalar<'_>, key: &str, hex_ok: bool) -> Result<u64, String> {
    match v {
        Scalar::Unsigned(u) => Ok(*u),
        Scalar::Signed(i) if *i < 0 => Err(format!("`{key}` is negative ({i})")),
        Scalar::Signed(i) => Ok(*i as u64),
        Scalar::Float(x) => Err(format!("`{key}` must be a non-negative integer, found {x}")),
        Scalar::Str(s) if hex_ok => s
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
