//! Decoding of the text arguments of protocol-0 opcodes (INT, LONG, STRING, UNICODE) and of
//! little-endian two's-complement integers (LONG1 / LONG4).

use crate::pickle::arena::Node;

/// Decodes LONG1/LONG4 bytes (little-endian two's complement) into an `Int` when it fits in
/// 64 bits, else a minimal `BigInt`.
pub(crate) fn long_from_le(bytes: &[u8]) -> Node {
    if bytes.is_empty() {
        return Node::Int(0);
    }
    let negative = bytes[bytes.len() - 1] & 0x80 != 0;
    let fill = if negative { 0xff } else { 0x00 };
    // Strip redundant sign-extension bytes.
    let mut len = bytes.len();
    while len > 1 && bytes[len - 1] == fill && (bytes[len - 2] & 0x80 != 0) == negative {
        len -= 1;
    }
    if len <= 8 {
        let mut buf = [fill; 8];
        buf[..len].copy_from_slice(&bytes[..len]);
        Node::Int(i64::from_le_bytes(buf))
    } else {
        Node::BigInt(bytes[..len].to_vec())
    }
}

/// Parses a decimal integer (optional sign, optional trailing `L`) of any size.
pub(crate) fn parse_decimal(text: &str) -> Option<Node> {
    let t = text.trim();
    let t = t.strip_suffix('L').unwrap_or(t);
    if let Ok(i) = t.parse::<i64>() {
        return Some(Node::Int(i));
    }
    let (negative, digits) = match t.as_bytes().first()? {
        b'-' => (true, &t[1..]),
        b'+' => (false, &t[1..]),
        _ => (false, t),
    };
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    // Magnitude in base 2^32, little-endian limbs.
    let mut limbs: Vec<u32> = vec![0];
    for d in digits.bytes() {
        let mut carry = u64::from(d - b'0');
        for limb in limbs.iter_mut() {
            let v = u64::from(*limb) * 10 + carry;
            *limb = v as u32;
            carry = v >> 32;
        }
        if carry > 0 {
            limbs.push(carry as u32);
        }
    }
    let mut bytes: Vec<u8> = limbs.iter().flat_map(|l| l.to_le_bytes()).collect();
    bytes.push(0); // room for the sign bit
    if negative {
        // Two's complement: invert and add one.
        let mut carry = 1u16;
        for b in bytes.iter_mut() {
            let v = u16::from(!*b) + carry;
            *b = v as u8;
            carry = v >> 8;
        }
    }
    Some(long_from_le(&bytes))
}

/// Decodes a protocol-0 STRING argument: a quoted Python bytes literal with backslash escapes.
pub(crate) fn decode_string_literal(arg: &[u8]) -> Option<Vec<u8>> {
    let quote = *arg.first()?;
    if arg.len() < 2 || (quote != b'\'' && quote != b'"') || arg[arg.len() - 1] != quote {
        return None;
    }
    let body = &arg[1..arg.len() - 1];
    let mut out = Vec::with_capacity(body.len());
    let mut i = 0;
    while i < body.len() {
        let c = body[i];
        i += 1;
        if c != b'\\' {
            out.push(c);
            continue;
        }
        let e = *body.get(i)?;
        i += 1;
        match e {
            b'\\' => out.push(b'\\'),
            b'\'' => out.push(b'\''),
            b'"' => out.push(b'"'),
            b'n' => out.push(b'\n'),
            b'r' => out.push(b'\r'),
            b't' => out.push(b'\t'),
            b'a' => out.push(0x07),
            b'b' => out.push(0x08),
            b'f' => out.push(0x0c),
            b'v' => out.push(0x0b),
            b'\n' => {}
            b'x' => {
                let hex = std::str::from_utf8(body.get(i..i + 2)?).ok()?;
                out.push(u8::from_str_radix(hex, 16).ok()?);
                i += 2;
            }
            b'0'..=b'7' => {
                let mut v = u32::from(e - b'0');
                let mut n = 1;
                while n < 3 {
                    match body.get(i) {
                        Some(d @ b'0'..=b'7') => {
                            v = v * 8 + u32::from(d - b'0');
                            i += 1;
                            n += 1;
                        }
                        _ => break,
                    }
                }
                out.push(u8::try_from(v & 0xff).ok()?);
            }
            other => {
                out.push(b'\\');
                out.push(other);
            }
        }
    }
    Some(out)
}

/// Decodes a protocol-0 UNICODE argument (Python's raw-unicode-escape: Latin-1 bytes plus
/// `\uXXXX` and `\UXXXXXXXX` escapes).
pub(crate) fn decode_raw_unicode_escape(arg: &[u8]) -> Option<String> {
    let mut out = String::with_capacity(arg.len());
    let mut i = 0;
    while i < arg.len() {
        let c = arg[i];
        if c == b'\\' {
            let width = match arg.get(i + 1) {
                Some(b'u') => 4,
                Some(b'U') => 8,
                _ => 0,
            };
            if width > 0 {
                let hex = std::str::from_utf8(arg.get(i + 2..i + 2 + width)?).ok()?;
                out.push(char::from_u32(u32::from_str_radix(hex, 16).ok()?)?);
                i += 2 + width;
                continue;
            }
        }
        out.push(char::from(c));
        i += 1;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_bytes_decode_like_python() {
        assert_eq!(long_from_le(&[]), Node::Int(0));
        assert_eq!(long_from_le(&[0xff]), Node::Int(-1));
        assert_eq!(long_from_le(&[0x00, 0x80]), Node::Int(-32768));
        assert_eq!(long_from_le(&[0xff, 0x00]), Node::Int(255));
        // 2^63 needs 9 bytes.
        let two63 = [0, 0, 0, 0, 0, 0, 0, 0x80, 0];
        assert_eq!(long_from_le(&two63), Node::BigInt(two63.to_vec()));
        // Redundant sign bytes are stripped: -1 in 12 bytes is still an Int.
        assert_eq!(long_from_le(&[0xff; 12]), Node::Int(-1));
    }

    #[test]
    fn decimal_of_any_size() {
        assert_eq!(parse_decimal("42"), Some(Node::Int(42)));
        assert_eq!(parse_decimal("-7L"), Some(Node::Int(-7)));
        assert_eq!(
            parse_decimal("9223372036854775808"),
            Some(Node::BigInt(vec![0, 0, 0, 0, 0, 0, 0, 0x80, 0]))
        );
        assert_eq!(
            parse_decimal("-9223372036854775809"),
            Some(Node::BigInt(vec![
                0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f, 0xff
            ]))
        );
        assert_eq!(parse_decimal("12a"), None);
        assert_eq!(parse_decimal("-"), None);
    }

    #[test]
    fn protocol0_strings() {
        assert_eq!(
            decode_string_literal(b"'a\\'b\\x41\\101\\n'"),
            Some(b"a'bAA\n".to_vec())
        );
        assert_eq!(decode_string_literal(b"'unterminated"), None);
        assert_eq!(
            decode_raw_unicode_escape(b"caf\xe9 \\u20ac"),
            Some("caf\u{e9} \u{20ac}".to_string())
        );
    }
}
