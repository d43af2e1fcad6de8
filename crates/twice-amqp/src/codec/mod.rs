//! The AMQP 1.0 type system (part 1 of the specification): values, and their encoding.
//!
//! [`Value`] holds any AMQP value, including described types, lists, maps and arrays.
//! [`decode`] is total: every byte sequence either decodes or yields a [`DecodeError`], never a
//! panic, and nesting and sizes are bounded so a hostile peer cannot exhaust the stack or the
//! heap. [`Value::encode`] writes the compact form of each value.

mod decode;
pub(crate) mod encode;

use bytes::Bytes;
use uuid::Uuid;

pub use decode::{BUDGET_BASE, BUDGET_PER_BYTE, DecodeError, Decoder, decode};

/// How deep lists, maps, arrays and described values may nest before decoding refuses.
pub const MAX_DEPTH: usize = 48;

/// An AMQP 1.0 value.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum Value {
    /// `null`.
    Null,
    /// `boolean`.
    Bool(bool),
    /// `ubyte`.
    Ubyte(u8),
    /// `ushort`.
    Ushort(u16),
    /// `uint`.
    Uint(u32),
    /// `ulong`.
    Ulong(u64),
    /// `byte`.
    Byte(i8),
    /// `short`.
    Short(i16),
    /// `int`.
    Int(i32),
    /// `long`.
    Long(i64),
    /// `float`.
    Float(f32),
    /// `double`.
    Double(f64),
    /// `decimal32`, kept as its raw bytes.
    Decimal32([u8; 4]),
    /// `decimal64`, kept as its raw bytes.
    Decimal64([u8; 8]),
    /// `decimal128`, kept as its raw bytes.
    Decimal128([u8; 16]),
    /// `char`.
    Char(char),
    /// `timestamp`: milliseconds since the Unix epoch.
    Timestamp(i64),
    /// `uuid`.
    Uuid(Uuid),
    /// `binary`.
    Binary(Bytes),
    /// `string`.
    String(String),
    /// `symbol`.
    Symbol(String),
    /// `list`.
    List(Vec<Value>),
    /// `map`, in wire order (keys may repeat on the wire; lookups take the first).
    Map(Vec<(Value, Value)>),
    /// `array`: values of one type.
    Array(Array),
    /// A described type: descriptor and value.
    Described(Box<Value>, Box<Value>),
}

/// An AMQP array: elements share one constructor.
#[derive(Clone, Debug, PartialEq)]
pub struct Array {
    /// The element constructor code, used when the array is empty (otherwise the encoder
    /// derives it from the elements).
    pub code: u8,
    /// The elements. For a described array every element is a [`Value::Described`] with the
    /// same descriptor.
    pub items: Vec<Value>,
}

impl Array {
    /// An array of these elements, all of the same variant, whose empty form uses `code`.
    pub fn new(code: u8, items: Vec<Value>) -> Self {
        Self { code, items }
    }
}

/// Element constructor codes for arrays built by twice.
pub mod code {
    /// `long` (8 bytes).
    pub const LONG: u8 = 0x81;
    /// `timestamp`.
    pub const TIMESTAMP: u8 = 0x83;
    /// `uuid`.
    pub const UUID: u8 = 0x98;
    /// `str32-utf8`.
    pub const STRING: u8 = 0xb1;
    /// `sym32`.
    pub const SYMBOL: u8 = 0xb3;
}

impl Value {
    /// How many values this one is made of (itself and everything it contains, at any depth):
    /// what decoding it costs against the budget of [`BUDGET_PER_BYTE`].
    pub fn nodes(&self) -> usize {
        match self {
            Value::Described(d, v) => 2 + d.nodes() + v.nodes(),
            Value::List(items) => 1 + items.iter().map(Value::nodes).sum::<usize>(),
            Value::Array(a) => 1 + a.items.iter().map(Value::nodes).sum::<usize>(),
            Value::Map(pairs) => {
                1 + pairs.iter().map(|(k, v)| k.nodes() + v.nodes()).sum::<usize>()
            }
            _ => 1,
        }
    }
    /// A symbol.
    pub fn symbol(s: impl Into<String>) -> Self {
        Value::Symbol(s.into())
    }

    /// A string.
    pub fn string(s: impl Into<String>) -> Self {
        Value::String(s.into())
    }

    /// A described value with a numeric descriptor.
    pub fn described(code: u64, value: Value) -> Self {
        Value::Described(Box::new(Value::Ulong(code)), Box::new(value))
    }

    /// An array of longs.
    pub fn long_array(items: impl IntoIterator<Item = i64>) -> Self {
        Value::Array(Array::new(code::LONG, items.into_iter().map(Value::Long).collect()))
    }

    /// An array of timestamps (milliseconds).
    pub fn timestamp_array(items: impl IntoIterator<Item = i64>) -> Self {
        Value::Array(Array::new(code::TIMESTAMP, items.into_iter().map(Value::Timestamp).collect()))
    }

    /// An array of strings.
    pub fn string_array(items: impl IntoIterator<Item = String>) -> Self {
        Value::Array(Array::new(code::STRING, items.into_iter().map(Value::String).collect()))
    }

    /// Whether this is `null`.
    pub fn is_null(&self) -> bool {
        matches!(self, Value::Null)
    }

    /// The string inside a `string` or `symbol`.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) | Value::Symbol(s) => Some(s),
            _ => None,
        }
    }

    /// The bytes inside a `binary`.
    pub fn as_binary(&self) -> Option<&Bytes> {
        match self {
            Value::Binary(b) => Some(b),
            _ => None,
        }
    }

    /// Any integer type that fits an `i64`.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            Value::Ubyte(n) => Some(i64::from(n)),
            Value::Ushort(n) => Some(i64::from(n)),
            Value::Uint(n) => Some(i64::from(n)),
            Value::Ulong(n) => i64::try_from(n).ok(),
            Value::Byte(n) => Some(i64::from(n)),
            Value::Short(n) => Some(i64::from(n)),
            Value::Int(n) => Some(i64::from(n)),
            Value::Long(n) => Some(n),
            _ => None,
        }
    }

    /// The elements of a list or an array.
    pub fn as_seq(&self) -> Option<&[Value]> {
        match self {
            Value::List(v) => Some(v),
            Value::Array(a) => Some(&a.items),
            _ => None,
        }
    }

    /// The entries of a map.
    pub fn as_map(&self) -> Option<&[(Value, Value)]> {
        match self {
            Value::Map(m) => Some(m),
            _ => None,
        }
    }

    /// Looks up a map entry by string or symbol key.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.as_map()?.iter().find(|(k, _)| k.as_str() == Some(key)).map(|(_, v)| v)
    }

    /// The descriptor code of a described value whose descriptor is a `ulong` (or one of the
    /// symbolic descriptors twice understands, mapped to its code).
    pub fn descriptor_code(&self) -> Option<u64> {
        match self {
            Value::Described(d, _) => match d.as_ref() {
                Value::Ulong(c) => Some(*c),
                Value::Symbol(s) => symbolic_descriptor(s),
                _ => None,
            },
            _ => None,
        }
    }

    /// The value inside a described value.
    pub fn described_value(&self) -> Option<&Value> {
        match self {
            Value::Described(_, v) => Some(v),
            _ => None,
        }
    }

    /// The value without its descriptor, if it has one.
    pub fn undescribed(&self) -> &Value {
        match self {
            Value::Described(_, v) => v,
            other => other,
        }
    }

    /// The encoded form.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        self.encode(&mut out);
        out
    }
}

/// The symbolic descriptors of the specification, by their numeric code.
fn symbolic_descriptor(name: &str) -> Option<u64> {
    Some(match name {
        "amqp:open:list" => 0x10,
        "amqp:begin:list" => 0x11,
        "amqp:attach:list" => 0x12,
        "amqp:flow:list" => 0x13,
        "amqp:transfer:list" => 0x14,
        "amqp:disposition:list" => 0x15,
        "amqp:detach:list" => 0x16,
        "amqp:end:list" => 0x17,
        "amqp:close:list" => 0x18,
        "amqp:error:list" => 0x1d,
        "amqp:received:list" => 0x23,
        "amqp:accepted:list" => 0x24,
        "amqp:rejected:list" => 0x25,
        "amqp:released:list" => 0x26,
        "amqp:modified:list" => 0x27,
        "amqp:source:list" => 0x28,
        "amqp:target:list" => 0x29,
        "amqp:sasl-mechanisms:list" => 0x40,
        "amqp:sasl-init:list" => 0x41,
        "amqp:sasl-challenge:list" => 0x42,
        "amqp:sasl-response:list" => 0x43,
        "amqp:sasl-outcome:list" => 0x44,
        "amqp:header:list" => 0x70,
        "amqp:delivery-annotations:map" => 0x71,
        "amqp:message-annotations:map" => 0x72,
        "amqp:properties:list" => 0x73,
        "amqp:application-properties:map" => 0x74,
        "amqp:data:binary" => 0x75,
        "amqp:amqp-sequence:list" => 0x76,
        "amqp:amqp-value:*" => 0x77,
        "amqp:footer:map" => 0x78,
        _ => return None,
    })
}

impl From<&str> for Value {
    fn from(s: &str) -> Self {
        Value::String(s.to_owned())
    }
}

impl From<String> for Value {
    fn from(s: String) -> Self {
        Value::String(s)
    }
}

impl From<bool> for Value {
    fn from(b: bool) -> Self {
        Value::Bool(b)
    }
}

impl From<u32> for Value {
    fn from(n: u32) -> Self {
        Value::Uint(n)
    }
}

impl From<i32> for Value {
    fn from(n: i32) -> Self {
        Value::Int(n)
    }
}

impl From<i64> for Value {
    fn from(n: i64) -> Self {
        Value::Long(n)
    }
}

impl From<Uuid> for Value {
    fn from(u: Uuid) -> Self {
        Value::Uuid(u)
    }
}

impl From<Bytes> for Value {
    fn from(b: Bytes) -> Self {
        Value::Binary(b)
    }
}

impl<T: Into<Value>> From<Option<T>> for Value {
    fn from(v: Option<T>) -> Self {
        v.map_or(Value::Null, Into::into)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip(v: &Value) {
        let bytes = v.to_bytes();
        let (back, used) = decode(&bytes).unwrap();
        assert_eq!(&back, v, "{bytes:02x?}");
        assert_eq!(used, bytes.len());
    }

    #[test]
    fn primitives_round_trip() {
        for v in [
            Value::Null,
            Value::Bool(true),
            Value::Bool(false),
            Value::Ubyte(7),
            Value::Ushort(65535),
            Value::Uint(0),
            Value::Uint(255),
            Value::Uint(70000),
            Value::Ulong(0),
            Value::Ulong(3),
            Value::Ulong(u64::MAX),
            Value::Byte(-3),
            Value::Short(-300),
            Value::Int(-5),
            Value::Int(i32::MIN),
            Value::Long(-1),
            Value::Long(i64::MAX),
            Value::Float(1.5),
            Value::Double(-2.25),
            Value::Char('é'),
            Value::Timestamp(1_796_028_803_256),
            Value::Uuid(Uuid::from_u128(0x0102_0304_0506_0708_090a_0b0c_0d0e_0f10)),
            Value::Binary(Bytes::from_static(b"abc")),
            Value::Binary(Bytes::from(vec![7u8; 300])),
            Value::string("hello"),
            Value::String("x".repeat(300)),
            Value::symbol("amqp:not-found"),
            Value::Decimal32([1, 2, 3, 4]),
        ] {
            round_trip(&v);
        }
    }

    #[test]
    fn compounds_round_trip() {
        round_trip(&Value::List(vec![]));
        round_trip(&Value::List(vec![Value::Null, Value::string("a"), Value::Uint(1)]));
        round_trip(&Value::List(vec![Value::Binary(Bytes::from(vec![0u8; 400]))]));
        round_trip(&Value::Map(vec![(Value::symbol("k"), Value::Long(5))]));
        round_trip(&Value::long_array([1, 2, 300]));
        round_trip(&Value::timestamp_array([1_796_028_818_269]));
        round_trip(&Value::string_array(["s1".to_owned(), "s2".to_owned()]));
        round_trip(&Value::Array(Array::new(code::UUID, vec![])));
        round_trip(&Value::described(0x24, Value::List(vec![])));
        round_trip(&Value::Array(Array::new(
            0xd0,
            vec![Value::List(vec![Value::Uint(1)]), Value::List(vec![])],
        )));
    }

    /// Lists and maps take the short form while their body and count fit a byte, the long form
    /// past that, at every depth.
    #[test]
    fn compounds_take_the_short_form_while_it_fits() {
        // A body of 254 bytes (the size byte counts the count byte too): short.
        let fits = Value::List(vec![Value::Binary(Bytes::from(vec![1u8; 252]))]);
        let bytes = fits.to_bytes();
        assert_eq!(bytes[..5], [0xc0, 0xff, 0x01, 0xa0, 0xfc]);
        assert_eq!(bytes.len(), 3 + 254);
        // One byte more: long, with 4-byte size and count.
        let over = Value::List(vec![Value::Binary(Bytes::from(vec![1u8; 253]))]);
        let bytes = over.to_bytes();
        assert_eq!(bytes[..11], [0xd0, 0, 0, 1, 3, 0, 0, 0, 1, 0xa0, 0xfd]);
        assert_eq!(bytes.len(), 9 + 255);
        // More than 255 items: long, whatever the size.
        let many = Value::List(vec![Value::Null; 256]);
        assert_eq!(many.to_bytes()[..9], [0xd0, 0, 0, 1, 4, 0, 0, 1, 0]);
        // A long map inside a short list inside a long list.
        let inner = Value::Map(vec![(Value::symbol("k"), Value::String("v".repeat(300)))]);
        let nested = Value::List(vec![
            Value::List(vec![Value::Uint(1)]),
            inner.clone(),
            Value::Binary(Bytes::from(vec![2u8; 10])),
        ]);
        let bytes = nested.to_bytes();
        assert_eq!(bytes[0], 0xd0);
        assert_eq!(bytes[9..13], [0xc0, 0x03, 0x01, 0x52]);
        assert_eq!(bytes[14], 0xd1);
        round_trip(&nested);
        round_trip(&inner);
    }

    /// Values exactly as the SDKs put them on the wire (from the frame logs).
    #[test]
    fn decodes_wire_samples() {
        // Python's `sequence-numbers` in receive-by-sequence-number: array<0x81>[long(3)].
        let (v, _) = decode(b"\xe0\x0a\x01\x81\x00\x00\x00\x00\x00\x00\x00\x03").unwrap();
        assert_eq!(v, Value::long_array([3]));
        // JS batch entry's empty message-annotations as a map32.
        let (v, _) = decode(b"\xd1\x00\x00\x00\x04\x00\x00\x00\x00").unwrap();
        assert_eq!(v, Value::Map(vec![]));
        // A described accepted outcome: 0x00 0x53 0x24 0x45.
        let (v, _) = decode(b"\x00\x53\x24\x45").unwrap();
        assert_eq!(v.descriptor_code(), Some(0x24));
        // A symbolic descriptor is understood like the numeric one.
        let sym = Value::Described(
            Box::new(Value::symbol("amqp:accepted:list")),
            Box::new(Value::List(vec![])),
        );
        assert_eq!(decode(&sym.to_bytes()).unwrap().0.descriptor_code(), Some(0x24));
    }

    #[test]
    fn malformed_input_is_a_typed_error() {
        assert_eq!(decode(b""), Err(DecodeError::UnexpectedEnd));
        assert_eq!(decode(b"\xff"), Err(DecodeError::InvalidCode(0xff)));
        assert_eq!(decode(b"\x56\x02"), Err(DecodeError::InvalidBool(2)));
        assert_eq!(decode(b"\xa1\x05ab"), Err(DecodeError::UnexpectedEnd));
        assert_eq!(decode(b"\xa1\x02\xff\xfe"), Err(DecodeError::InvalidText));
        assert_eq!(decode(b"\xa3\x02\xc3\xa9"), Err(DecodeError::InvalidText));
        assert_eq!(decode(b"\x73\x00\x11\x00\x00"), Err(DecodeError::InvalidChar(0x0011_0000)));
        // A list whose size says 3 bytes but whose one element needs 2.
        assert_eq!(decode(b"\xc0\x02\x01\xa1\x05"), Err(DecodeError::UnexpectedEnd));
        assert_eq!(decode(b"\xc0\x03\x01\x40\x40"), Err(DecodeError::SizeMismatch));
        assert_eq!(decode(b"\xc1\x02\x01\x40"), Err(DecodeError::OddMapCount));
        // A list claiming four billion elements in a few bytes.
        assert_eq!(
            decode(b"\xd0\x00\x00\x00\x05\xff\xff\xff\xff\x40"),
            Err(DecodeError::CountTooLarge)
        );
        // An array of four billion nulls.
        assert_eq!(
            decode(b"\xf0\x00\x00\x00\x05\xff\xff\xff\xff\x40"),
            Err(DecodeError::CountTooLarge)
        );
        // Deep nesting.
        let mut deep = Vec::new();
        for _ in 0..100 {
            deep.extend_from_slice(b"\x00\x53\x01");
        }
        deep.push(0x40);
        assert_eq!(decode(&deep), Err(DecodeError::TooDeep));
    }
}
