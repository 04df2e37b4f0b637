//! The reader's object graph: nodes with identity (so memo references and in-place APPEND /
//! SETITEMS behave as in Python), and its bounded conversion into [`Value`] trees.

use crate::error::PickleError;
use crate::pickle::Value;

/// Index of a node in an [`Arena`].
pub(crate) type Id = usize;

/// One Python object built by the pickle machine. Containers refer to other nodes by id.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Node {
    None,
    Bool(bool),
    Int(i64),
    BigInt(Vec<u8>),
    Float(f64),
    Str(String),
    Bytes(Vec<u8>),
    List(Vec<Id>),
    Tuple(Vec<Id>),
    Dict(Vec<(Id, Id)>),
    Set(Vec<Id>),
}

impl Node {
    /// A short name of the node's Python type, for error messages.
    pub(crate) fn type_name(&self) -> &'static str {
        match self {
            Node::None => "None",
            Node::Bool(_) => "bool",
            Node::Int(_) | Node::BigInt(_) => "int",
            Node::Float(_) => "float",
            Node::Str(_) => "str",
            Node::Bytes(_) => "bytes",
            Node::List(_) => "list",
            Node::Tuple(_) => "tuple",
            Node::Dict(_) => "dict",
            Node::Set(_) => "set",
        }
    }
}

/// Deepest nesting the conversion to [`Value`] accepts; also what stops cyclic values.
pub const MAX_DEPTH: usize = 256;

static NONE_NODE: Node = Node::None;

/// All nodes a pickle built. Every opcode adds at most one node and consumes at least one
/// input byte, so an arena is never larger than a small multiple of its input.
#[derive(Debug, Default)]
pub(crate) struct Arena {
    nodes: Vec<Node>,
}

impl Arena {
    /// An arena with room for `n` nodes.
    pub(crate) fn with_capacity(n: usize) -> Arena {
        Arena {
            nodes: Vec::with_capacity(n),
        }
    }

    /// Adds a node and returns its id.
    pub(crate) fn push(&mut self, node: Node) -> Id {
        self.nodes.push(node);
        self.nodes.len() - 1
    }

    /// The node `id` (ids come from [`Arena::push`]; an unknown id reads as `None`).
    pub(crate) fn get(&self, id: Id) -> &Node {
        self.nodes.get(id).unwrap_or(&NONE_NODE)
    }

    /// Mutable access to node `id`.
    pub(crate) fn get_mut(&mut self, id: Id) -> Option<&mut Node> {
        self.nodes.get_mut(id)
    }

    /// Converts node `id` into an owned [`Value`] tree, charging `budget` for every byte the
    /// tree takes (shared nodes are copied each time they are referenced).
    pub(crate) fn to_value(&self, id: Id, budget: &mut Budget) -> Result<Value, PickleError> {
        self.convert(id, 0, budget)
    }

    fn convert(&self, id: Id, depth: usize, budget: &mut Budget) -> Result<Value, PickleError> {
        if depth > MAX_DEPTH {
            return Err(PickleError::TooDeep { limit: MAX_DEPTH });
        }
        let node = self.get(id);
        let value_size = std::mem::size_of::<Value>() as u64;
        budget.charge(value_size)?;
        Ok(match node {
            Node::None => Value::None,
            Node::Bool(b) => Value::Bool(*b),
            Node::Int(i) => Value::Int(*i),
            Node::Float(f) => Value::Float(*f),
            Node::BigInt(b) => {
                budget.charge(b.len() as u64)?;
                Value::BigInt(b.clone())
            }
            Node::Str(s) => {
                budget.charge(s.len() as u64)?;
                Value::Str(s.clone())
            }
            Node::Bytes(b) => {
                budget.charge(b.len() as u64)?;
                Value::Bytes(b.clone())
            }
            Node::List(items) => Value::List(self.convert_all(items, depth, budget)?),
            Node::Tuple(items) => Value::Tuple(self.convert_all(items, depth, budget)?),
            Node::Set(items) => Value::Set(self.convert_all(items, depth, budget)?),
            Node::Dict(items) => {
                let mut out = Vec::with_capacity(items.len());
                for &(k, v) in items {
                    out.push((
                        self.convert(k, depth + 1, budget)?,
                        self.convert(v, depth + 1, budget)?,
                    ));
                }
                Value::Dict(out)
            }
        })
    }

    fn convert_all(
        &self,
        items: &[Id],
        depth: usize,
        budget: &mut Budget,
    ) -> Result<Vec<Value>, PickleError> {
        let mut out = Vec::with_capacity(items.len());
        for &item in items {
            out.push(self.convert(item, depth + 1, budget)?);
        }
        Ok(out)
    }
}

/// A byte budget for everything built from a pickle beyond its arena: memo references
/// can repeat one object many times (a "billion laughs" pickle), so copies are counted.
#[derive(Debug, Clone)]
pub struct Budget {
    left: u64,
    limit: u64,
}

impl Budget {
    /// A budget of `limit` bytes.
    pub fn new(limit: u64) -> Budget {
        Budget { left: limit, limit }
    }

    /// The default budget for an input of `input_len` bytes: 512 bytes of output per input
    /// byte, at least 64 MiB and at most 1 GiB.
    pub fn for_input(input_len: usize) -> Budget {
        const MIB: u64 = 1 << 20;
        let scaled = (input_len as u64).saturating_mul(512);
        Budget::new(scaled.clamp(64 * MIB, 1024 * MIB))
    }

    /// The budget for typed snapshot import of an input of `input_len` bytes: 128 bytes per
    /// input byte, at least 64 MiB and at most 1 GiB (the real snapshots need about 16).
    pub fn for_snapshot(input_len: usize) -> Budget {
        const MIB: u64 = 1 << 20;
        let scaled = (input_len as u64).saturating_mul(128);
        Budget::new(scaled.clamp(64 * MIB, 1024 * MIB))
    }

    /// The limit this budget started with.
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// Takes `bytes` from the budget, or fails with [`PickleError::ExpansionLimit`].
    pub fn charge(&mut self, bytes: u64) -> Result<(), PickleError> {
        match self.left.checked_sub(bytes) {
            Some(left) => {
                self.left = left;
                Ok(())
            }
            None => Err(PickleError::ExpansionLimit { limit: self.limit }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_nodes_are_copied_and_charged() {
        let mut a = Arena::default();
        let s = a.push(Node::Str("abcdef".into()));
        let l = a.push(Node::List(vec![s, s, s]));
        let mut budget = Budget::new(10_000);
        let v = a.to_value(l, &mut budget).unwrap();
        assert_eq!(v, Value::List(vec![Value::Str("abcdef".into()); 3]));
        let per_value = std::mem::size_of::<Value>() as u64;
        assert_eq!(10_000 - budget.left, 4 * per_value + 3 * 6);

        let mut tiny = Budget::new(2 * per_value);
        assert_eq!(
            a.to_value(l, &mut tiny),
            Err(PickleError::ExpansionLimit {
                limit: 2 * per_value
            })
        );
    }

    #[test]
    fn a_cycle_is_too_deep_not_a_stack_overflow() {
        let mut a = Arena::default();
        let l = a.push(Node::List(vec![]));
        if let Some(Node::List(items)) = a.get_mut(l) {
            items.push(l);
        }
        let mut budget = Budget::new(u64::MAX);
        assert_eq!(
            a.to_value(l, &mut budget),
            Err(PickleError::TooDeep { limit: MAX_DEPTH })
        );
    }

    #[test]
    fn default_budget_is_clamped() {
        assert_eq!(Budget::for_input(10).limit(), 64 << 20);
        assert_eq!(Budget::for_input(1 << 20).limit(), 512 << 20);
        assert_eq!(Budget::for_input(1 << 30).limit(), 1 << 30);
    }
}
