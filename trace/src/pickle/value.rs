//! The plain-data value model a pickle decodes to (no Python objects, no code).

/// A plain Python value as carried by a pickle.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// `None`.
    None,
    /// `True` / `False`.
    Bool(bool),
    /// An int that fits in 64 bits.
    Int(i64),
    /// An int that does not fit in 64 bits: little-endian two's complement bytes, as LONG1/LONG4
    /// carry them (always longer than 8 bytes, minimal).
    BigInt(Vec<u8>),
    /// A float.
    Float(f64),
    /// A `str`.
    Str(String),
    /// `bytes` or `bytearray`.
    Bytes(Vec<u8>),
    /// A `list`.
    List(Vec<Value>),
    /// A `tuple`.
    Tuple(Vec<Value>),
    /// A `dict`, in insertion order. A key set twice appears twice; [`Value::get`] returns the last.
    Dict(Vec<(Value, Value)>),
    /// A `set` or `frozenset`, in insertion order.
    Set(Vec<Value>),
}

impl Value {
    /// A short name of the value's Python type, for error messages.
    pub fn type_name(&self) -> &'static str {
        match self {
            Value::None => "None",
            Value::Bool(_) => "bool",
            Value::Int(_) | Value::BigInt(_) => "int",
            Value::Float(_) => "float",
            Value::Str(_) => "str",
            Value::Bytes(_) => "bytes",
            Value::List(_) => "list",
            Value::Tuple(_) => "tuple",
            Value::Dict(_) => "dict",
            Value::Set(_) => "set",
        }
    }

    /// For a dict, the value stored under the string key `key` (the last one if set twice).
    pub fn get(&self, key: &str) -> Option<&Value> {
        match self {
            Value::Dict(items) => items
                .iter()
                .rev()
                .find(|(k, _)| matches!(k, Value::Str(s) if s == key))
                .map(|(_, v)| v),
            _ => None,
        }
    }

    /// The string, if this is a `str`.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }

    /// The integer, if this is an int that fits in `i64` (bools count, as in Python).
    pub fn as_i64(&self) -> Option<i64> {
        match self {
            Value::Int(i) => Some(*i),
            Value::Bool(b) => Some(i64::from(*b)),
            _ => None,
        }
    }

    /// The items, if this is a list or a tuple.
    pub fn as_seq(&self) -> Option<&[Value]> {
        match self {
            Value::List(v) | Value::Tuple(v) => Some(v),
            _ => None,
        }
    }

    /// Builds a dict with string keys.
    pub fn str_dict<I, K>(items: I) -> Value
    where
        I: IntoIterator<Item = (K, Value)>,
        K: Into<String>,
    {
        Value::Dict(
            items
                .into_iter()
                .map(|(k, v)| (Value::Str(k.into()), v))
                .collect(),
        )
    }
}

impl From<&str> for Value {
    fn from(s: &str) -> Value {
        Value::Str(s.to_owned())
    }
}

impl From<String> for Value {
    fn from(s: String) -> Value {
        Value::Str(s)
    }
}

impl From<i64> for Value {
    fn from(i: i64) -> Value {
        Value::Int(i)
    }
}

impl From<bool> for Value {
    fn from(b: bool) -> Value {
        Value::Bool(b)
    }
}

impl From<f64> for Value {
    fn from(f: f64) -> Value {
        Value::Float(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn get_returns_the_last_value_of_a_repeated_key() {
        let d = Value::Dict(vec![
            (Value::from("a"), Value::Int(1)),
            (Value::Int(7), Value::Int(2)),
            (Value::from("a"), Value::Int(3)),
        ]);
        assert_eq!(d.get("a"), Some(&Value::Int(3)));
        assert_eq!(d.get("b"), None);
        assert_eq!(Value::Int(1).get("a"), None);
        assert_eq!(d.type_name(), "dict");
        assert_eq!(Value::Bool(true).as_i64(), Some(1));
    }
}
