//! Decoding: bytes to [`Value`], strictly and totally.

use bytes::Bytes;
use uuid::Uuid;

use super::{Array, MAX_DEPTH, Value};

/// How many values a decoder may build per input byte, beyond [`BUDGET_BASE`].
///
/// Zero-width array elements (`null`, `true`, `uint0`...) take no bytes, and each element of a
/// described array carries a copy of the descriptor, so without a budget a few bytes could
/// build millions of values. Four per byte covers every encoding that is not such a bomb: the
/// densest, a described array of one-byte elements, builds four values per element byte.
pub const BUDGET_PER_BYTE: usize = 4;
/// Values any decoder may build whatever its input's size.
pub const BUDGET_BASE: usize = 256;

/// Why bytes are not a valid AMQP value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// The input ended inside a value.
    #[error("input ended inside a value")]
    UnexpectedEnd,
    /// A format code that AMQP 1.0 does not define.
    #[error("unknown format code 0x{0:02x}")]
    InvalidCode(u8),
    /// A boolean byte other than 0 or 1.
    #[error("invalid boolean byte 0x{0:02x}")]
    InvalidBool(u8),
    /// A `char` that is not a Unicode scalar value.
    #[error("invalid char 0x{0:08x}")]
    InvalidChar(u32),
    /// A string that is not UTF-8, or a symbol that is not ASCII.
    #[error("invalid text encoding")]
    InvalidText,
    /// A compound's declared size disagrees with its content.
    #[error("compound size does not match its content")]
    SizeMismatch,
    /// A map with an odd number of elements.
    #[error("map with an odd element count")]
    OddMapCount,
    /// More elements than the bytes could hold.
    #[error("element count exceeds the bytes available")]
    CountTooLarge,
    /// Values nested deeper than [`MAX_DEPTH`].
    #[error("values nested too deeply")]
    TooDeep,
    /// The input describes more values than its size justifies (see [`BUDGET_PER_BYTE`]).
    #[error("the input describes more values than its size allows")]
    OverBudget,
}

/// Decodes one value from the start of `input`; returns it and the number of bytes it took.
pub fn decode(input: &[u8]) -> Result<(Value, usize), DecodeError> {
    let mut d = Decoder::new(input);
    let v = d.value()?;
    Ok((v, d.position()))
}

/// A cursor over bytes that yields values one after another.
#[derive(Debug)]
pub struct Decoder<'a> {
    input: &'a [u8],
    pos: usize,
    depth: usize,
    /// Values this decoder may still build.
    budget: usize,
}

impl<'a> Decoder<'a> {
    /// A decoder at the start of `input`.
    pub fn new(input: &'a [u8]) -> Self {
        let budget = input.len().saturating_mul(BUDGET_PER_BYTE).saturating_add(BUDGET_BASE);
        Self { input, pos: 0, depth: 0, budget }
    }

    /// How many bytes have been consumed.
    pub fn position(&self) -> usize {
        self.pos
    }

    /// Whether every byte has been consumed.
    pub fn is_empty(&self) -> bool {
        self.pos >= self.input.len()
    }

    /// The bytes not yet consumed.
    pub fn rest(&self) -> &'a [u8] {
        self.input.get(self.pos..).unwrap_or(&[])
    }

    /// Decodes the next value.
    pub fn value(&mut self) -> Result<Value, DecodeError> {
        self.charge(1)?;
        let code = self.u8()?;
        if code == 0x00 {
            return self.described();
        }
        self.body(code)
    }

    fn described(&mut self) -> Result<Value, DecodeError> {
        // The two boxes.
        self.charge(1)?;
        self.enter()?;
        let descriptor = self.value()?;
        let value = self.value()?;
        self.depth -= 1;
        Ok(Value::Described(Box::new(descriptor), Box::new(value)))
    }

    /// Spends `n` values of the budget, before they are built.
    fn charge(&mut self, n: usize) -> Result<(), DecodeError> {
        self.budget = self.budget.checked_sub(n).ok_or(DecodeError::OverBudget)?;
        Ok(())
    }

    fn enter(&mut self) -> Result<(), DecodeError> {
        self.depth += 1;
        if self.depth > MAX_DEPTH { Err(DecodeError::TooDeep) } else { Ok(()) }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        let end = self.pos.checked_add(n).ok_or(DecodeError::UnexpectedEnd)?;
        let s = self.input.get(self.pos..end).ok_or(DecodeError::UnexpectedEnd)?;
        self.pos = end;
        Ok(s)
    }

    fn array_n<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        let s = self.take(N)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.array_n::<1>()?[0])
    }

    fn u32(&mut self) -> Result<u32, DecodeError> {
        Ok(u32::from_be_bytes(self.array_n()?))
    }

    fn len32(&mut self) -> Result<usize, DecodeError> {
        usize::try_from(self.u32()?).map_err(|_| DecodeError::CountTooLarge)
    }

    fn text(&mut self, n: usize, symbol: bool) -> Result<String, DecodeError> {
        let raw = self.take(n)?;
        let s = std::str::from_utf8(raw).map_err(|_| DecodeError::InvalidText)?;
        if symbol && !s.is_ascii() {
            return Err(DecodeError::InvalidText);
        }
        Ok(s.to_owned())
    }

    /// Decodes the body of a value whose constructor is `code`.
    fn body(&mut self, code: u8) -> Result<Value, DecodeError> {
        Ok(match code {
            0x40 => Value::Null,
            0x41 => Value::Bool(true),
            0x42 => Value::Bool(false),
            0x56 => match self.u8()? {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => return Err(DecodeError::InvalidBool(b)),
            },
            0x43 => Value::Uint(0),
            0x44 => Value::Ulong(0),
            0x45 => Value::List(Vec::new()),
            0x50 => Value::Ubyte(self.u8()?),
            0x51 => Value::Byte(i8::from_be_bytes(self.array_n()?)),
            0x52 => Value::Uint(u32::from(self.u8()?)),
            0x53 => Value::Ulong(u64::from(self.u8()?)),
            0x54 => Value::Int(i32::from(i8::from_be_bytes(self.array_n()?))),
            0x55 => Value::Long(i64::from(i8::from_be_bytes(self.array_n()?))),
            0x60 => Value::Ushort(u16::from_be_bytes(self.array_n()?)),
            0x61 => Value::Short(i16::from_be_bytes(self.array_n()?)),
            0x70 => Value::Uint(self.u32()?),
            0x71 => Value::Int(i32::from_be_bytes(self.array_n()?)),
            0x72 => Value::Float(f32::from_be_bytes(self.array_n()?)),
            0x73 => {
                let n = self.u32()?;
                Value::Char(char::from_u32(n).ok_or(DecodeError::InvalidChar(n))?)
            }
            0x74 => Value::Decimal32(self.array_n()?),
            0x80 => Value::Ulong(u64::from_be_bytes(self.array_n()?)),
            0x81 => Value::Long(i64::from_be_bytes(self.array_n()?)),
            0x82 => Value::Double(f64::from_be_bytes(self.array_n()?)),
            0x83 => Value::Timestamp(i64::from_be_bytes(self.array_n()?)),
            0x84 => Value::Decimal64(self.array_n()?),
            0x94 => Value::Decimal128(self.array_n()?),
            0x98 => Value::Uuid(Uuid::from_bytes(self.array_n()?)),
            0xa0 => {
                let n = usize::from(self.u8()?);
                Value::Binary(Bytes::copy_from_slice(self.take(n)?))
            }
            0xb0 => {
                let n = self.len32()?;
                Value::Binary(Bytes::copy_from_slice(self.take(n)?))
            }
            0xa1 => {
                let n = usize::from(self.u8()?);
                Value::String(self.text(n, false)?)
            }
            0xb1 => {
                let n = self.len32()?;
                Value::String(self.text(n, false)?)
            }
            0xa3 => {
                let n = usize::from(self.u8()?);
                Value::Symbol(self.text(n, true)?)
            }
            0xb3 => {
                let n = self.len32()?;
                Value::Symbol(self.text(n, true)?)
            }
            0xc0 | 0xc1 => {
                let size = usize::from(self.u8()?);
                self.compound(code == 0xc1, size, 1)?
            }
            0xd0 | 0xd1 => {
                let size = self.len32()?;
                self.compound(code == 0xd1, size, 4)?
            }
            0xe0 => {
                let size = usize::from(self.u8()?);
                self.array(size, 1)?
            }
            0xf0 => {
                let size = self.len32()?;
                self.array(size, 4)?
            }
            other => return Err(DecodeError::InvalidCode(other)),
        })
    }

    /// A list or map of `size` bytes (which include the count field of `width` bytes).
    fn compound(&mut self, is_map: bool, size: usize, width: usize) -> Result<Value, DecodeError> {
        if size < width {
            return Err(DecodeError::SizeMismatch);
        }
        let start = self.pos;
        let end = start.checked_add(size).ok_or(DecodeError::UnexpectedEnd)?;
        if end > self.input.len() {
            return Err(DecodeError::UnexpectedEnd);
        }
        let count = if width == 1 { usize::from(self.u8()?) } else { self.len32()? };
        // Every element takes at least one byte.
        if count > end - self.pos {
            return Err(DecodeError::CountTooLarge);
        }
        self.enter()?;
        let mut items = Vec::with_capacity(count);
        for _ in 0..count {
            items.push(self.value()?);
            if self.pos > end {
                return Err(DecodeError::SizeMismatch);
            }
        }
        self.depth -= 1;
        if self.pos != end {
            return Err(DecodeError::SizeMismatch);
        }
        if !is_map {
            return Ok(Value::List(items));
        }
        if count % 2 != 0 {
            return Err(DecodeError::OddMapCount);
        }
        let mut pairs = Vec::with_capacity(count / 2);
        let mut it = items.into_iter();
        while let (Some(k), Some(v)) = (it.next(), it.next()) {
            pairs.push((k, v));
        }
        Ok(Value::Map(pairs))
    }

    fn array(&mut self, size: usize, width: usize) -> Result<Value, DecodeError> {
        if size < width + 1 {
            return Err(DecodeError::SizeMismatch);
        }
        let start = self.pos;
        let end = start.checked_add(size).ok_or(DecodeError::UnexpectedEnd)?;
        if end > self.input.len() {
            return Err(DecodeError::UnexpectedEnd);
        }
        let count = if width == 1 { usize::from(self.u8()?) } else { self.len32()? };
        self.enter()?;
        let mut code = self.u8()?;
        let mut descriptor = None;
        if code == 0x00 {
            descriptor = Some(self.value()?);
            code = self.u8()?;
        }
        // Fixed zero-width elements (null, true, uint0, ...) take no bytes; bound them apart.
        let zero_width = matches!(code, 0x40..=0x45);
        let room = end.saturating_sub(self.pos);
        if (zero_width && count > 4096) || (!zero_width && count > room) {
            return Err(DecodeError::CountTooLarge);
        }
        // Every element is a value, and in a described array also a copy of the descriptor
        // and the two boxes that hold them: all paid for before anything is built.
        let per_element = match &descriptor {
            Some(d) => 2 + d.nodes(),
            None => 1,
        };
        self.charge(count.saturating_mul(per_element))?;
        let mut items = Vec::with_capacity(count);
        for _ in 0..count {
            let v = self.body(code)?;
            if self.pos > end {
                return Err(DecodeError::SizeMismatch);
            }
            items.push(match &descriptor {
                Some(d) => Value::Described(Box::new(d.clone()), Box::new(v)),
                None => v,
            });
        }
        self.depth -= 1;
        if self.pos != end {
            return Err(DecodeError::SizeMismatch);
        }
        Ok(Value::Array(Array { code, items }))
    }
}
