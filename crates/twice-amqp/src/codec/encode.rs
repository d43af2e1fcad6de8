//! Encoding: [`Value`] to bytes, in the compact forms.

use super::Value;

impl Value {
    /// Appends the encoding of this value to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        match self {
            Value::Null => out.push(0x40),
            Value::Bool(true) => out.push(0x41),
            Value::Bool(false) => out.push(0x42),
            Value::Ubyte(n) => {
                out.push(0x50);
                out.push(*n);
            }
            Value::Ushort(n) => {
                out.push(0x60);
                out.extend_from_slice(&n.to_be_bytes());
            }
            Value::Uint(0) => out.push(0x43),
            Value::Uint(n) => match u8::try_from(*n) {
                Ok(small) => out.extend_from_slice(&[0x52, small]),
                Err(_) => {
                    out.push(0x70);
                    out.extend_from_slice(&n.to_be_bytes());
                }
            },
            Value::Ulong(0) => out.push(0x44),
            Value::Ulong(n) => match u8::try_from(*n) {
                Ok(small) => out.extend_from_slice(&[0x53, small]),
                Err(_) => {
                    out.push(0x80);
                    out.extend_from_slice(&n.to_be_bytes());
                }
            },
            Value::Byte(n) => {
                out.push(0x51);
                out.extend_from_slice(&n.to_be_bytes());
            }
            Value::Short(n) => {
                out.push(0x61);
                out.extend_from_slice(&n.to_be_bytes());
            }
            Value::Int(n) => match i8::try_from(*n) {
                Ok(small) => {
                    out.push(0x54);
                    out.extend_from_slice(&small.to_be_bytes());
                }
                Err(_) => {
                    out.push(0x71);
                    out.extend_from_slice(&n.to_be_bytes());
                }
            },
            Value::Long(n) => match i8::try_from(*n) {
                Ok(small) => {
                    out.push(0x55);
                    out.extend_from_slice(&small.to_be_bytes());
                }
                Err(_) => {
                    out.push(0x81);
                    out.extend_from_slice(&n.to_be_bytes());
                }
            },
            Value::Binary(b) => var(out, 0xa0, 0xb0, b),
            Value::String(s) => var(out, 0xa1, 0xb1, s.as_bytes()),
            Value::Symbol(s) => var(out, 0xa3, 0xb3, s.as_bytes()),
            Value::List(items) if items.is_empty() => out.push(0x45),
            Value::List(items) => {
                let start = begin_compound(out);
                for v in items {
                    v.encode(out);
                }
                end_compound(out, start, LIST, items.len());
            }
            Value::Map(pairs) => {
                let start = begin_compound(out);
                for (k, v) in pairs {
                    k.encode(out);
                    v.encode(out);
                }
                end_compound(out, start, MAP, pairs.len() * 2);
            }
            Value::Array(a) => {
                let mut body = Vec::new();
                let first = a.items.first();
                match first {
                    Some(Value::Described(d, inner)) => {
                        body.push(0x00);
                        d.encode(&mut body);
                        let code = wide_code(inner);
                        body.push(code);
                        for item in &a.items {
                            fixed_body(item.undescribed(), &mut body);
                        }
                    }
                    Some(first) => {
                        body.push(wide_code(first));
                        for item in &a.items {
                            fixed_body(item, &mut body);
                        }
                    }
                    None => body.push(a.code),
                }
                // The array's count does not include the constructor, which `body` starts with.
                compound(out, 0xe0, 0xf0, a.items.len(), &body);
            }
            Value::Described(d, v) => {
                out.push(0x00);
                d.encode(out);
                v.encode(out);
            }
            other => {
                let code = wide_code(other);
                out.push(code);
                fixed_body(other, out);
            }
        }
    }
}

fn var(out: &mut Vec<u8>, short: u8, long: u8, bytes: &[u8]) {
    match u8::try_from(bytes.len()) {
        Ok(n) => out.extend_from_slice(&[short, n]),
        Err(_) => {
            out.push(long);
            out.extend_from_slice(&len32(bytes.len()).to_be_bytes());
        }
    }
    out.extend_from_slice(bytes);
}

/// A length as the wire's `u32`; twice never builds values near 4 GiB (frames are far
/// smaller), so saturating is only a guard.
fn len32(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// The short and long constructors of a list.
pub(crate) const LIST: (u8, u8) = (0xc0, 0xd0);
/// The short and long constructors of a map.
pub(crate) const MAP: (u8, u8) = (0xc1, 0xd1);

/// Starts a list or map whose items are then encoded straight into `out`: reserves the short
/// header and returns where it starts, for [`end_compound`].
pub(crate) fn begin_compound(out: &mut Vec<u8>) -> usize {
    let start = out.len();
    out.extend_from_slice(&[0, 0, 0]);
    start
}

/// Writes the header of the compound begun at `start` now that its `count` items follow it:
/// the short form when it fits, else the long one (the items move up by the difference, which
/// only compounds of more than 254 bytes pay). The bytes are those of [`compound`].
pub(crate) fn end_compound(out: &mut Vec<u8>, start: usize, (short, long): (u8, u8), count: usize) {
    let body = out.len() - start - 3;
    if let (Ok(size), Ok(count)) = (u8::try_from(body + 1), u8::try_from(count)) {
        out[start..start + 3].copy_from_slice(&[short, size, count]);
        return;
    }
    out.extend_from_slice(&[0; 6]);
    out.copy_within(start + 3..start + 3 + body, start + 9);
    out[start] = long;
    out[start + 1..start + 5].copy_from_slice(&len32(body + 4).to_be_bytes());
    out[start + 5..start + 9].copy_from_slice(&len32(count).to_be_bytes());
}

/// Writes the descriptor of a described value: `0x00` and the numeric code.
pub(crate) fn descriptor(out: &mut Vec<u8>, code: u64) {
    out.push(0x00);
    Value::Ulong(code).encode(out);
}

/// Writes a `string`.
pub(crate) fn string(out: &mut Vec<u8>, s: &str) {
    var(out, 0xa1, 0xb1, s.as_bytes());
}

/// Writes a `symbol`.
pub(crate) fn symbol(out: &mut Vec<u8>, s: &str) {
    var(out, 0xa3, 0xb3, s.as_bytes());
}

/// Writes a `binary`.
pub(crate) fn binary(out: &mut Vec<u8>, b: &[u8]) {
    var(out, 0xa0, 0xb0, b);
}

/// A described list written straight into a buffer, field by field, trailing nulls dropped:
/// the bytes of [`crate::performative::described_list`] without building its values.
#[derive(Debug)]
pub(crate) struct ListWriter {
    start: usize,
    count: usize,
    /// The length of the buffer after the last field that is not null, and its count.
    kept: (usize, usize),
}

impl ListWriter {
    /// Writes the descriptor and starts the list.
    pub(crate) fn begin(out: &mut Vec<u8>, code: u64) -> Self {
        descriptor(out, code);
        let start = begin_compound(out);
        Self { start, count: 0, kept: (out.len(), 0) }
    }

    /// A null field.
    pub(crate) fn null(&mut self, out: &mut Vec<u8>) {
        out.push(0x40);
        self.count += 1;
    }

    /// A field (null or not).
    pub(crate) fn value(&mut self, out: &mut Vec<u8>, v: &Value) {
        if v.is_null() {
            self.null(out);
        } else {
            v.encode(out);
            self.kept(out);
        }
    }

    /// A field that is not null, written by `write`.
    pub(crate) fn with(&mut self, out: &mut Vec<u8>, write: impl FnOnce(&mut Vec<u8>)) {
        write(out);
        self.kept(out);
    }

    /// A field that is a `string`, or null.
    pub(crate) fn opt_string(&mut self, out: &mut Vec<u8>, s: Option<&str>) {
        match s {
            Some(s) => {
                string(out, s);
                self.kept(out);
            }
            None => self.null(out),
        }
    }

    /// A field that is a `symbol`, or null.
    pub(crate) fn opt_symbol(&mut self, out: &mut Vec<u8>, s: Option<&str>) {
        match s {
            Some(s) => {
                symbol(out, s);
                self.kept(out);
            }
            None => self.null(out),
        }
    }

    fn kept(&mut self, out: &[u8]) {
        self.count += 1;
        self.kept = (out.len(), self.count);
    }

    /// Ends the list: drops the trailing nulls and writes its header.
    pub(crate) fn end(self, out: &mut Vec<u8>) {
        let (len, count) = self.kept;
        out.truncate(len);
        if count == 0 {
            out.truncate(self.start);
            out.push(0x45);
        } else {
            end_compound(out, self.start, LIST, count);
        }
    }
}

/// Writes a list/map/array header and body; `size` counts the count field.
fn compound(out: &mut Vec<u8>, short: u8, long: u8, count: usize, body: &[u8]) {
    match (u8::try_from(body.len() + 1), u8::try_from(count)) {
        (Ok(size), Ok(count)) => out.extend_from_slice(&[short, size, count]),
        _ => {
            out.push(long);
            out.extend_from_slice(&len32(body.len() + 4).to_be_bytes());
            out.extend_from_slice(&len32(count).to_be_bytes());
        }
    }
    out.extend_from_slice(body);
}

/// The fixed-width or widest constructor of a value, as used for array elements.
fn wide_code(v: &Value) -> u8 {
    match v {
        Value::Null => 0x40,
        Value::Bool(_) => 0x56,
        Value::Ubyte(_) => 0x50,
        Value::Ushort(_) => 0x60,
        Value::Uint(_) => 0x70,
        Value::Ulong(_) => 0x80,
        Value::Byte(_) => 0x51,
        Value::Short(_) => 0x61,
        Value::Int(_) => 0x71,
        Value::Long(_) => 0x81,
        Value::Float(_) => 0x72,
        Value::Double(_) => 0x82,
        Value::Decimal32(_) => 0x74,
        Value::Decimal64(_) => 0x84,
        Value::Decimal128(_) => 0x94,
        Value::Char(_) => 0x73,
        Value::Timestamp(_) => 0x83,
        Value::Uuid(_) => 0x98,
        Value::Binary(_) => 0xb0,
        Value::String(_) => 0xb1,
        Value::Symbol(_) => 0xb3,
        Value::List(_) => 0xd0,
        Value::Map(_) => 0xd1,
        Value::Array(_) => 0xf0,
        // A described value inside an undescribed array cannot occur in arrays twice builds
        // or decodes; fall back to its inner value's code.
        Value::Described(_, inner) => wide_code(inner),
    }
}

/// Writes the body of `v` for its [`wide_code`] constructor.
fn fixed_body(v: &Value, out: &mut Vec<u8>) {
    match v {
        Value::Null => {}
        Value::Bool(b) => out.push(u8::from(*b)),
        Value::Ubyte(n) => out.push(*n),
        Value::Ushort(n) => out.extend_from_slice(&n.to_be_bytes()),
        Value::Uint(n) => out.extend_from_slice(&n.to_be_bytes()),
        Value::Ulong(n) => out.extend_from_slice(&n.to_be_bytes()),
        Value::Byte(n) => out.extend_from_slice(&n.to_be_bytes()),
        Value::Short(n) => out.extend_from_slice(&n.to_be_bytes()),
        Value::Int(n) => out.extend_from_slice(&n.to_be_bytes()),
        Value::Long(n) | Value::Timestamp(n) => out.extend_from_slice(&n.to_be_bytes()),
        Value::Float(x) => out.extend_from_slice(&x.to_be_bytes()),
        Value::Double(x) => out.extend_from_slice(&x.to_be_bytes()),
        Value::Decimal32(b) => out.extend_from_slice(b),
        Value::Decimal64(b) => out.extend_from_slice(b),
        Value::Decimal128(b) => out.extend_from_slice(b),
        Value::Char(c) => out.extend_from_slice(&u32::from(*c).to_be_bytes()),
        Value::Uuid(u) => out.extend_from_slice(u.as_bytes()),
        Value::Binary(b) => {
            out.extend_from_slice(&len32(b.len()).to_be_bytes());
            out.extend_from_slice(b);
        }
        Value::String(s) | Value::Symbol(s) => {
            out.extend_from_slice(&len32(s.len()).to_be_bytes());
            out.extend_from_slice(s.as_bytes());
        }
        Value::List(_) | Value::Map(_) | Value::Array(_) => {
            // Encode the compound in its wide form, then drop the constructor byte.
            let mut tmp = Vec::new();
            match v {
                Value::List(items) => {
                    let mut body = Vec::new();
                    for i in items {
                        i.encode(&mut body);
                    }
                    wide_compound(&mut tmp, items.len(), &body);
                }
                Value::Map(pairs) => {
                    let mut body = Vec::new();
                    for (k, x) in pairs {
                        k.encode(&mut body);
                        x.encode(&mut body);
                    }
                    wide_compound(&mut tmp, pairs.len() * 2, &body);
                }
                _ => {
                    let mut enc = Vec::new();
                    v.encode(&mut enc);
                    // Re-encode in the 32-bit form regardless of the short form chosen above.
                    if let Some((&0xe0, rest)) = enc.split_first() {
                        let body = rest.get(2..).unwrap_or(&[]);
                        let count = rest.get(1).copied().unwrap_or(0);
                        wide_compound(&mut tmp, usize::from(count), body);
                    } else if let Some((_, rest)) = enc.split_first() {
                        tmp.extend_from_slice(rest);
                    }
                }
            }
            out.extend_from_slice(&tmp);
        }
        Value::Described(_, inner) => fixed_body(inner, out),
    }
}

fn wide_compound(out: &mut Vec<u8>, count: usize, body: &[u8]) {
    out.extend_from_slice(&len32(body.len() + 4).to_be_bytes());
    out.extend_from_slice(&len32(count).to_be_bytes());
    out.extend_from_slice(body);
}
