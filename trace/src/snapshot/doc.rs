//! Typed, path-aware access to a decoded pickle's object graph: every accessor names the
//! field it was reading (e.g. `segments[3].blocks[0].size`) in its error.

use std::collections::HashMap;
use std::sync::Arc;

use crate::error::TraceError;
use crate::event::Frame;
use crate::pickle::{Arena, Budget, Id, Node, Value};

/// Where a value sits in the document. Cheap to build; rendered only for errors.
#[derive(Clone, Copy)]
pub(crate) enum Path<'p> {
    Root,
    Key(&'p Path<'p>, &'static str),
    Index(&'p Path<'p>, usize),
}

impl<'p> Path<'p> {
    pub(crate) fn key(&'p self, key: &'static str) -> Path<'p> {
        Path::Key(self, key)
    }

    pub(crate) fn index(&'p self, i: usize) -> Path<'p> {
        Path::Index(self, i)
    }

    pub(crate) fn render(&self) -> String {
        match self {
            Path::Root => "<top level>".to_owned(),
            Path::Key(Path::Root, k) => (*k).to_owned(),
            Path::Key(parent, k) => format!("{}.{k}", parent.render()),
            Path::Index(parent, i) => format!("{}[{i}]", parent.render()),
        }
    }
}

/// A decoded pickle plus the caches and budget used while converting it.
pub(crate) struct Doc<'a> {
    pub(crate) arena: &'a Arena,
    pub(crate) budget: Budget,
    strings: HashMap<Id, Arc<str>>,
    frames: HashMap<Id, Frame>,
    /// Read `frames` lists (else every one reads as empty, unexamined).
    pub(crate) keep_frames: bool,
}

impl<'a> Doc<'a> {
    pub(crate) fn new(arena: &'a Arena, budget: Budget) -> Doc<'a> {
        Doc {
            arena,
            budget,
            strings: HashMap::new(),
            frames: HashMap::new(),
            keep_frames: true,
        }
    }

    pub(crate) fn node(&self, id: Id) -> &'a Node {
        self.arena.get(id)
    }

    pub(crate) fn wrong(&self, id: Id, path: &Path<'_>, expected: &'static str) -> TraceError {
        TraceError::WrongType {
            field: path.render(),
            expected,
            found: self.node(id).type_name(),
        }
    }

    pub(crate) fn dict(&self, id: Id, path: &Path<'_>) -> Result<&'a [(Id, Id)], TraceError> {
        match self.node(id) {
            Node::Dict(items) => Ok(items),
            _ => Err(self.wrong(id, path, "dict")),
        }
    }

    pub(crate) fn seq(&self, id: Id, path: &Path<'_>) -> Result<&'a [Id], TraceError> {
        match self.node(id) {
            Node::List(items) | Node::Tuple(items) => Ok(items),
            _ => Err(self.wrong(id, path, "list")),
        }
    }

    /// The value of string key `key` in `items` (the last one if set twice).
    pub(crate) fn field(&self, items: &[(Id, Id)], key: &str) -> Option<Id> {
        items
            .iter()
            .rev()
            .find(|(k, _)| matches!(self.node(*k), Node::Str(s) if s == key))
            .map(|(_, v)| *v)
    }

    pub(crate) fn required(
        &self,
        items: &[(Id, Id)],
        path: &Path<'_>,
        key: &'static str,
    ) -> Result<Id, TraceError> {
        self.field(items, key)
            .ok_or_else(|| TraceError::MissingField {
                field: path.key(key).render(),
            })
    }

    pub(crate) fn u64(&self, id: Id, path: &Path<'_>) -> Result<u64, TraceError> {
        match self.node(id) {
            Node::Int(i) => u64::try_from(*i).map_err(|_| TraceError::Negative {
                field: path.render(),
                value: *i,
            }),
            // 2^63 ..= 2^64-1 needs nine bytes, the last one zero.
            Node::BigInt(b) if b.len() == 9 && b[8] == 0 => {
                let mut buf = [0u8; 8];
                buf.copy_from_slice(&b[..8]);
                Ok(u64::from_le_bytes(buf))
            }
            Node::BigInt(b) if b.last().is_some_and(|x| x & 0x80 != 0) => {
                Err(TraceError::Negative {
                    field: path.render(),
                    value: i64::MIN,
                })
            }
            Node::BigInt(_) => Err(TraceError::OutOfRange {
                field: path.render(),
            }),
            _ => Err(self.wrong(id, path, "int")),
        }
    }

    pub(crate) fn i64(&self, id: Id, path: &Path<'_>) -> Result<i64, TraceError> {
        match self.node(id) {
            Node::Int(i) => Ok(*i),
            Node::BigInt(_) => Err(TraceError::OutOfRange {
                field: path.render(),
            }),
            _ => Err(self.wrong(id, path, "int")),
        }
    }

    pub(crate) fn bool(&self, id: Id, path: &Path<'_>) -> Result<bool, TraceError> {
        match self.node(id) {
            Node::Bool(b) => Ok(*b),
            Node::Int(i) => Ok(*i != 0),
            _ => Err(self.wrong(id, path, "bool")),
        }
    }

    pub(crate) fn str(&self, id: Id, path: &Path<'_>) -> Result<&'a str, TraceError> {
        match self.node(id) {
            Node::Str(s) => Ok(s),
            _ => Err(self.wrong(id, path, "str")),
        }
    }

    /// A shared copy of a string node (one allocation per distinct node).
    pub(crate) fn arc_str(&mut self, id: Id, path: &Path<'_>) -> Result<Arc<str>, TraceError> {
        if let Some(s) = self.strings.get(&id) {
            return Ok(Arc::clone(s));
        }
        let s: Arc<str> = Arc::from(self.str(id, path)?);
        self.strings.insert(id, Arc::clone(&s));
        Ok(s)
    }

    /// An owned [`Value`] copy of a node, charged to the budget.
    pub(crate) fn value(&mut self, id: Id) -> Result<Value, TraceError> {
        Ok(self.arena.to_value(id, &mut self.budget)?)
    }

    /// A frame list (`[{"filename", "line", "name"}, ...]`); a missing list is empty.
    pub(crate) fn frames(
        &mut self,
        items: &[(Id, Id)],
        path: &Path<'_>,
    ) -> Result<Vec<Frame>, TraceError> {
        if !self.keep_frames {
            return Ok(Vec::new());
        }
        let Some(list) = self.field(items, "frames") else {
            return Ok(Vec::new());
        };
        let path = path.key("frames");
        let ids = self.seq(list, &path)?;
        self.budget
            .charge((ids.len() * std::mem::size_of::<Frame>()) as u64)?;
        let mut out = Vec::with_capacity(ids.len());
        for (i, &id) in ids.iter().enumerate() {
            out.push(self.frame(id, &path.index(i))?);
        }
        Ok(out)
    }

    fn frame(&mut self, id: Id, path: &Path<'_>) -> Result<Frame, TraceError> {
        if let Some(f) = self.frames.get(&id) {
            return Ok(f.clone());
        }
        let items = self.dict(id, path)?;
        let filename = match self.field(items, "filename") {
            Some(v) => self.arc_str(v, &path.key("filename"))?,
            None => Arc::from("??"),
        };
        let name = match self.field(items, "name") {
            Some(v) => self.arc_str(v, &path.key("name"))?,
            None => Arc::from("??"),
        };
        let line = match self.field(items, "line") {
            Some(v) => self.i64(v, &path.key("line"))?,
            None => 0,
        };
        let frame = Frame {
            filename,
            line,
            name,
        };
        self.frames.insert(id, frame.clone());
        Ok(frame)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_render_like_python_accessors() {
        let root = Path::Root;
        let segs = root.key("segments");
        let s3 = segs.index(3);
        let blocks = s3.key("blocks");
        let b0 = blocks.index(0);
        assert_eq!(b0.key("size").render(), "segments[3].blocks[0].size");
        assert_eq!(root.render(), "<top level>");
    }
}
