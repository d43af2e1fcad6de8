//! The AMQP 1.0 performatives (transport part of the specification) and SASL frames, typed.
//!
//! Each performative is a described list; decoding checks every field's type and yields a
//! [`FrameError`] for anything else, so a malformed frame closes only its connection.

use bytes::Bytes;

use crate::codec::encode::{self, ListWriter};
use crate::codec::{Array, DecodeError, Decoder, Value, code};

/// Why a frame body is not a valid performative.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FrameError {
    /// The body is not a valid AMQP value.
    #[error("malformed frame body: {0}")]
    Decode(#[from] DecodeError),
    /// The body is not a described list.
    #[error("frame body is not a performative")]
    NotPerformative,
    /// A descriptor twice does not know.
    #[error("unknown performative 0x{0:x}")]
    Unknown(u64),
    /// A field has the wrong type or a mandatory one is missing.
    #[error("{performative}: field {field} is missing or has the wrong type")]
    Field {
        /// The performative.
        performative: &'static str,
        /// The field index.
        field: usize,
    },
}

/// Link roles.
pub const ROLE_SENDER: bool = false;
/// The receiver role.
pub const ROLE_RECEIVER: bool = true;

/// Descriptor codes.
#[allow(missing_docs)] // reason: the names are the specification's
pub mod desc {
    pub const OPEN: u64 = 0x10;
    pub const BEGIN: u64 = 0x11;
    pub const ATTACH: u64 = 0x12;
    pub const FLOW: u64 = 0x13;
    pub const TRANSFER: u64 = 0x14;
    pub const DISPOSITION: u64 = 0x15;
    pub const DETACH: u64 = 0x16;
    pub const END: u64 = 0x17;
    pub const CLOSE: u64 = 0x18;
    pub const ERROR: u64 = 0x1d;
    pub const RECEIVED: u64 = 0x23;
    pub const ACCEPTED: u64 = 0x24;
    pub const REJECTED: u64 = 0x25;
    pub const RELEASED: u64 = 0x26;
    pub const MODIFIED: u64 = 0x27;
    pub const SOURCE: u64 = 0x28;
    pub const TARGET: u64 = 0x29;
    pub const SASL_MECHANISMS: u64 = 0x40;
    pub const SASL_INIT: u64 = 0x41;
    pub const SASL_CHALLENGE: u64 = 0x42;
    pub const SASL_RESPONSE: u64 = 0x43;
    pub const SASL_OUTCOME: u64 = 0x44;
}

/// An AMQP error: condition, description, info.
#[derive(Clone, Debug, PartialEq)]
pub struct AmqpError {
    /// The condition symbol, e.g. `amqp:not-found`.
    pub condition: String,
    /// A human-readable description.
    pub description: Option<String>,
    /// Extra information (a map).
    pub info: Option<Value>,
}

impl AmqpError {
    /// An error with a condition and description.
    pub fn new(condition: impl Into<String>, description: impl Into<String>) -> Self {
        Self { condition: condition.into(), description: Some(description.into()), info: None }
    }

    /// As a described value. All three fields are written even when empty: the Python SDK
    /// indexes the info field of a rejected send without checking its length.
    pub fn to_value(&self) -> Value {
        Value::described(
            desc::ERROR,
            Value::List(vec![
                Value::symbol(self.condition.clone()),
                self.description.clone().into(),
                self.info.clone().unwrap_or(Value::Null),
            ]),
        )
    }

    /// Parses a described error.
    pub fn from_value(v: &Value) -> Result<Self, FrameError> {
        let f = Fields::of(v, desc::ERROR, "error")?;
        Ok(Self { condition: f.symbol(0)?, description: f.opt_string(1)?, info: f.opt_value(2) })
    }
}

/// A performative or SASL frame body.
#[derive(Clone, Debug, PartialEq)]
#[allow(missing_docs)] // reason: each variant is named for its performative
// Not `non_exhaustive`: AMQP 1.0 fixes the set of performatives, and the connection engines of
// the server and the client match on every one of them.
pub enum Performative {
    Open(Open),
    Begin(Begin),
    Attach(Attach),
    Flow(Flow),
    Transfer(Transfer),
    Disposition(Disposition),
    Detach(Detach),
    End(Option<AmqpError>),
    Close(Option<AmqpError>),
    SaslMechanisms(Vec<String>),
    SaslInit(SaslInit),
    SaslOutcome(u8),
}

/// `open`.
#[derive(Clone, Debug, PartialEq, Default)]
#[allow(missing_docs)] // reason: the field names are the specification's
pub struct Open {
    pub container_id: String,
    pub hostname: Option<String>,
    pub max_frame_size: u32,
    pub channel_max: u16,
    pub idle_time_out: Option<u32>,
    pub properties: Option<Value>,
}

/// `begin`.
#[derive(Clone, Debug, PartialEq, Default)]
#[allow(missing_docs)] // reason: the field names are the specification's
pub struct Begin {
    pub remote_channel: Option<u16>,
    pub next_outgoing_id: u32,
    pub incoming_window: u32,
    pub outgoing_window: u32,
    pub handle_max: u32,
}

/// `attach`. Source and target are kept as values so a reply can echo them verbatim.
#[derive(Clone, Debug, PartialEq, Default)]
#[allow(missing_docs)] // reason: the field names are the specification's
pub struct Attach {
    pub name: String,
    pub handle: u32,
    pub role: bool,
    pub snd_settle_mode: Option<u8>,
    pub rcv_settle_mode: Option<u8>,
    pub source: Option<Value>,
    pub target: Option<Value>,
    pub initial_delivery_count: Option<u32>,
    pub max_message_size: Option<u64>,
    pub properties: Option<Value>,
}

/// `flow`.
#[derive(Clone, Debug, PartialEq, Default)]
#[allow(missing_docs)] // reason: the field names are the specification's
pub struct Flow {
    pub next_incoming_id: Option<u32>,
    pub incoming_window: u32,
    pub next_outgoing_id: u32,
    pub outgoing_window: u32,
    pub handle: Option<u32>,
    pub delivery_count: Option<u32>,
    pub link_credit: Option<u32>,
    pub available: Option<u32>,
    pub drain: bool,
    pub echo: bool,
}

/// `transfer` (the payload travels beside it).
#[derive(Clone, Debug, PartialEq, Default)]
#[allow(missing_docs)] // reason: the field names are the specification's
pub struct Transfer {
    pub handle: u32,
    pub delivery_id: Option<u32>,
    pub delivery_tag: Option<Bytes>,
    pub message_format: Option<u32>,
    pub settled: Option<bool>,
    pub more: bool,
    pub state: Option<Value>,
    pub aborted: bool,
}

/// `disposition`.
#[derive(Clone, Debug, PartialEq, Default)]
#[allow(missing_docs)] // reason: the field names are the specification's
pub struct Disposition {
    pub role: bool,
    pub first: u32,
    pub last: Option<u32>,
    pub settled: bool,
    pub state: Option<Value>,
}

impl Disposition {
    /// A disposition in the shape clients settle messages with (numeric descriptor, two to five
    /// fields: booleans and uints in any of their encodings, an outcome without fields), read
    /// without building the list; `None` for anything else, valid or not, which
    /// [`Performative::decode_values`] then reads (and judges) as it reads every performative.
    fn decode_common(body: &[u8]) -> Option<(Self, &[u8])> {
        let rest = body.strip_prefix(&[0x00, 0x53, 0x15])?;
        let (&code, rest) = rest.split_first()?;
        let (size, count, rest) = match code {
            0xc0 => {
                let (&[size, count], rest) = rest.split_first_chunk::<2>()?;
                (usize::from(size).checked_sub(1)?, usize::from(count), rest)
            }
            0xd0 => {
                let (&[s0, s1, s2, s3, c0, c1, c2, c3], rest) = rest.split_first_chunk::<8>()?;
                let size = usize::try_from(u32::from_be_bytes([s0, s1, s2, s3])).ok()?;
                let count = usize::try_from(u32::from_be_bytes([c0, c1, c2, c3])).ok()?;
                (size.checked_sub(4)?, count, rest)
            }
            _ => return None,
        };
        if !(2..=5).contains(&count) || size > rest.len() {
            return None;
        }
        let (mut list, payload) = rest.split_at(size);
        let role = take_bool(&mut list)??;
        let first = take_uint(&mut list)??;
        let mut d = Disposition { role, first, ..Disposition::default() };
        if count > 2 {
            d.last = take_uint(&mut list)?;
        }
        if count > 3 {
            d.settled = take_bool(&mut list)?.unwrap_or(false);
        }
        if count > 4 {
            // An outcome without fields (accepted, released), or none.
            d.state = match list {
                [0x40] => None,
                [0x00, 0x53, code, 0x45] | [0x00, 0x53, code, 0xc0, 0x01, 0x00] => {
                    Some(Value::described(u64::from(*code), Value::List(Vec::new())))
                }
                _ => return None,
            };
            list = &[];
        }
        list.is_empty().then_some((d, payload))
    }
}

/// A `boolean` field or null (`Some(None)`) from the start of `b`; `None` for another type.
fn take_bool(b: &mut &[u8]) -> Option<Option<bool>> {
    let (v, n) = match *b {
        [0x40, ..] => (None, 1),
        [0x41, ..] => (Some(true), 1),
        [0x42, ..] => (Some(false), 1),
        [0x56, 0, ..] => (Some(false), 2),
        [0x56, 1, ..] => (Some(true), 2),
        _ => return None,
    };
    *b = &b[n..];
    Some(v)
}

/// A `uint` field or null (`Some(None)`) from the start of `b`; `None` for another type.
fn take_uint(b: &mut &[u8]) -> Option<Option<u32>> {
    let (v, n) = match *b {
        [0x40, ..] => (None, 1),
        [0x43, ..] => (Some(0), 1),
        [0x52, x, ..] => (Some(u32::from(*x)), 2),
        [0x70, a, b1, c, d, ..] => (Some(u32::from_be_bytes([*a, *b1, *c, *d])), 5),
        _ => return None,
    };
    *b = &b[n..];
    Some(v)
}

/// `detach`.
#[derive(Clone, Debug, PartialEq, Default)]
#[allow(missing_docs)] // reason: the field names are the specification's
pub struct Detach {
    pub handle: u32,
    pub closed: bool,
    pub error: Option<AmqpError>,
}

/// `sasl-init`. The initial response may hold a password: it is never logged.
#[derive(Clone, PartialEq, Default)]
#[allow(missing_docs)] // reason: the field names are the specification's
pub struct SaslInit {
    pub mechanism: String,
    pub initial_response: Option<Bytes>,
    pub hostname: Option<String>,
}

impl std::fmt::Debug for SaslInit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SaslInit")
            .field("mechanism", &self.mechanism)
            .field("initial_response", &self.initial_response.as_ref().map(|_| "<redacted>"))
            .field("hostname", &self.hostname)
            .finish()
    }
}

/// A typed view of a performative's field list.
pub(crate) struct Fields<'a> {
    name: &'static str,
    items: &'a [Value],
}

impl<'a> Fields<'a> {
    /// The fields of `v`, which must be a described list with descriptor `code`.
    pub(crate) fn of(v: &'a Value, code: u64, name: &'static str) -> Result<Self, FrameError> {
        if v.descriptor_code() != Some(code) {
            return Err(FrameError::Field { performative: name, field: 0 });
        }
        Self::list(v.undescribed(), name)
    }

    pub(crate) fn list(v: &'a Value, name: &'static str) -> Result<Self, FrameError> {
        match v {
            Value::List(items) => Ok(Self { name, items }),
            _ => Err(FrameError::NotPerformative),
        }
    }

    fn bad(&self, field: usize) -> FrameError {
        FrameError::Field { performative: self.name, field }
    }

    fn get(&self, i: usize) -> Option<&'a Value> {
        self.items.get(i).filter(|v| !v.is_null())
    }

    pub(crate) fn opt_value(&self, i: usize) -> Option<Value> {
        self.get(i).cloned()
    }

    pub(crate) fn opt_uint(&self, i: usize) -> Result<Option<u32>, FrameError> {
        match self.get(i) {
            None => Ok(None),
            Some(Value::Uint(n)) => Ok(Some(*n)),
            Some(_) => Err(self.bad(i)),
        }
    }

    pub(crate) fn uint(&self, i: usize) -> Result<u32, FrameError> {
        self.opt_uint(i)?.ok_or_else(|| self.bad(i))
    }

    pub(crate) fn opt_ushort(&self, i: usize) -> Result<Option<u16>, FrameError> {
        match self.get(i) {
            None => Ok(None),
            Some(Value::Ushort(n)) => Ok(Some(*n)),
            Some(_) => Err(self.bad(i)),
        }
    }

    pub(crate) fn opt_ubyte(&self, i: usize) -> Result<Option<u8>, FrameError> {
        match self.get(i) {
            None => Ok(None),
            Some(Value::Ubyte(n)) => Ok(Some(*n)),
            Some(_) => Err(self.bad(i)),
        }
    }

    pub(crate) fn opt_ulong(&self, i: usize) -> Result<Option<u64>, FrameError> {
        match self.get(i) {
            None => Ok(None),
            Some(Value::Ulong(n)) => Ok(Some(*n)),
            Some(_) => Err(self.bad(i)),
        }
    }

    pub(crate) fn opt_bool(&self, i: usize) -> Result<Option<bool>, FrameError> {
        match self.get(i) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(_) => Err(self.bad(i)),
        }
    }

    pub(crate) fn bool(&self, i: usize) -> Result<bool, FrameError> {
        self.opt_bool(i)?.ok_or_else(|| self.bad(i))
    }

    pub(crate) fn opt_string(&self, i: usize) -> Result<Option<String>, FrameError> {
        match self.get(i) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(_) => Err(self.bad(i)),
        }
    }

    pub(crate) fn string(&self, i: usize) -> Result<String, FrameError> {
        self.opt_string(i)?.ok_or_else(|| self.bad(i))
    }

    pub(crate) fn symbol(&self, i: usize) -> Result<String, FrameError> {
        match self.get(i) {
            Some(Value::Symbol(s)) => Ok(s.clone()),
            _ => Err(self.bad(i)),
        }
    }

    pub(crate) fn opt_binary(&self, i: usize) -> Result<Option<Bytes>, FrameError> {
        match self.get(i) {
            None => Ok(None),
            Some(Value::Binary(b)) => Ok(Some(b.clone())),
            Some(_) => Err(self.bad(i)),
        }
    }

    pub(crate) fn opt_error(&self, i: usize) -> Result<Option<AmqpError>, FrameError> {
        self.get(i).map(AmqpError::from_value).transpose()
    }
}

/// A described list with trailing nulls dropped (as the specification allows).
pub fn described_list(code: u64, mut fields: Vec<Value>) -> Value {
    while fields.last().is_some_and(Value::is_null) {
        fields.pop();
    }
    Value::described(code, Value::List(fields))
}

fn opt<T: Into<Value>>(v: Option<T>) -> Value {
    v.map_or(Value::Null, Into::into)
}

/// A `flow`'s fields in order, as its list holds them.
fn flow_fields(f: &Flow) -> [Value; 10] {
    let flag = |b: bool| if b { Value::Bool(true) } else { Value::Null };
    [
        opt(f.next_incoming_id),
        Value::Uint(f.incoming_window),
        Value::Uint(f.next_outgoing_id),
        Value::Uint(f.outgoing_window),
        opt(f.handle),
        opt(f.delivery_count),
        opt(f.link_credit),
        opt(f.available),
        flag(f.drain),
        flag(f.echo),
    ]
}

impl Performative {
    /// Decodes the performative at the start of a frame body; returns it and the payload that
    /// follows (for `transfer`).
    pub fn decode(body: &[u8]) -> Result<(Self, &[u8]), FrameError> {
        // A receiver settles message by message: its dispositions are read field by field.
        if let Some((d, rest)) = Disposition::decode_common(body) {
            return Ok((Performative::Disposition(d), rest));
        }
        Self::decode_values(body)
    }

    /// [`Performative::decode`] through a [`Value`] of the whole performative.
    fn decode_values(body: &[u8]) -> Result<(Self, &[u8]), FrameError> {
        let mut d = Decoder::new(body);
        let v = d.value()?;
        let code = match v.descriptor_code() {
            Some(c) => c,
            None => return Err(FrameError::NotPerformative),
        };
        let rest = d.rest();
        let f = |name| Fields::list(v.undescribed(), name);
        let p = match code {
            desc::OPEN => {
                let f = f("open")?;
                Performative::Open(Open {
                    container_id: f.string(0)?,
                    hostname: f.opt_string(1)?,
                    max_frame_size: f.opt_uint(2)?.unwrap_or(u32::MAX),
                    channel_max: f.opt_ushort(3)?.unwrap_or(u16::MAX),
                    idle_time_out: f.opt_uint(4)?,
                    properties: f.opt_value(9),
                })
            }
            desc::BEGIN => {
                let f = f("begin")?;
                Performative::Begin(Begin {
                    remote_channel: f.opt_ushort(0)?,
                    next_outgoing_id: f.uint(1)?,
                    incoming_window: f.uint(2)?,
                    outgoing_window: f.uint(3)?,
                    handle_max: f.opt_uint(4)?.unwrap_or(u32::MAX),
                })
            }
            desc::ATTACH => {
                let f = f("attach")?;
                Performative::Attach(Attach {
                    name: f.string(0)?,
                    handle: f.uint(1)?,
                    role: f.bool(2)?,
                    snd_settle_mode: f.opt_ubyte(3)?,
                    rcv_settle_mode: f.opt_ubyte(4)?,
                    source: f.opt_value(5),
                    target: f.opt_value(6),
                    initial_delivery_count: f.opt_uint(9)?,
                    max_message_size: f.opt_ulong(10)?,
                    properties: f.opt_value(13),
                })
            }
            desc::FLOW => {
                let f = f("flow")?;
                Performative::Flow(Flow {
                    next_incoming_id: f.opt_uint(0)?,
                    incoming_window: f.uint(1)?,
                    next_outgoing_id: f.uint(2)?,
                    outgoing_window: f.uint(3)?,
                    handle: f.opt_uint(4)?,
                    delivery_count: f.opt_uint(5)?,
                    link_credit: f.opt_uint(6)?,
                    available: f.opt_uint(7)?,
                    drain: f.opt_bool(8)?.unwrap_or(false),
                    echo: f.opt_bool(9)?.unwrap_or(false),
                })
            }
            desc::TRANSFER => {
                let f = f("transfer")?;
                Performative::Transfer(Transfer {
                    handle: f.uint(0)?,
                    delivery_id: f.opt_uint(1)?,
                    delivery_tag: f.opt_binary(2)?,
                    message_format: f.opt_uint(3)?,
                    settled: f.opt_bool(4)?,
                    more: f.opt_bool(5)?.unwrap_or(false),
                    state: f.opt_value(7),
                    aborted: f.opt_bool(9)?.unwrap_or(false),
                })
            }
            desc::DISPOSITION => {
                let f = f("disposition")?;
                Performative::Disposition(Disposition {
                    role: f.bool(0)?,
                    first: f.uint(1)?,
                    last: f.opt_uint(2)?,
                    settled: f.opt_bool(3)?.unwrap_or(false),
                    state: f.opt_value(4),
                })
            }
            desc::DETACH => {
                let f = f("detach")?;
                Performative::Detach(Detach {
                    handle: f.uint(0)?,
                    closed: f.opt_bool(1)?.unwrap_or(false),
                    error: f.opt_error(2)?,
                })
            }
            desc::END => Performative::End(f("end")?.opt_error(0)?),
            desc::CLOSE => Performative::Close(f("close")?.opt_error(0)?),
            desc::SASL_MECHANISMS => {
                let f = f("sasl-mechanisms")?;
                let mechs = match f.opt_value(0) {
                    Some(Value::Symbol(s)) => vec![s],
                    Some(Value::Array(a)) => {
                        a.items.iter().filter_map(|v| v.as_str().map(str::to_owned)).collect()
                    }
                    _ => Vec::new(),
                };
                Performative::SaslMechanisms(mechs)
            }
            desc::SASL_INIT => {
                let f = f("sasl-init")?;
                Performative::SaslInit(SaslInit {
                    mechanism: f.symbol(0)?,
                    initial_response: f.opt_binary(1)?,
                    hostname: f.opt_string(2)?,
                })
            }
            desc::SASL_OUTCOME => {
                Performative::SaslOutcome(f("sasl-outcome")?.opt_ubyte(0)?.unwrap_or(0))
            }
            other => return Err(FrameError::Unknown(other)),
        };
        Ok((p, rest))
    }

    /// Appends the performative's encoding to `out`: the bytes of [`Performative::to_value`].
    /// The performatives of every message (`transfer`, `disposition`, `flow`) are written
    /// field by field, without building their values.
    pub fn encode(&self, out: &mut Vec<u8>) {
        let flag = |b: bool| if b { Value::Bool(true) } else { Value::Null };
        match self {
            Performative::Transfer(t) => {
                let mut l = ListWriter::begin(out, desc::TRANSFER);
                l.value(out, &Value::Uint(t.handle));
                l.value(out, &opt(t.delivery_id));
                match &t.delivery_tag {
                    Some(tag) => l.with(out, |out| encode::binary(out, tag)),
                    None => l.null(out),
                }
                l.value(out, &opt(t.message_format));
                l.value(out, &opt(t.settled));
                l.value(out, &flag(t.more));
                l.null(out);
                l.value(out, t.state.as_ref().unwrap_or(&Value::Null));
                l.null(out);
                l.value(out, &flag(t.aborted));
                l.end(out);
            }
            Performative::Disposition(d) => {
                let mut l = ListWriter::begin(out, desc::DISPOSITION);
                l.value(out, &Value::Bool(d.role));
                l.value(out, &Value::Uint(d.first));
                l.value(out, &opt(d.last));
                l.value(out, &Value::Bool(d.settled));
                l.value(out, d.state.as_ref().unwrap_or(&Value::Null));
                l.end(out);
            }
            Performative::Flow(f) => {
                let mut l = ListWriter::begin(out, desc::FLOW);
                for v in flow_fields(f) {
                    l.value(out, &v);
                }
                l.end(out);
            }
            other => other.to_value().encode(out),
        }
    }

    /// The performative as a described list.
    pub fn to_value(&self) -> Value {
        match self {
            Performative::Open(o) => described_list(
                desc::OPEN,
                vec![
                    o.container_id.clone().into(),
                    opt(o.hostname.clone()),
                    Value::Uint(o.max_frame_size),
                    Value::Ushort(o.channel_max),
                    opt(o.idle_time_out),
                    Value::Null,
                    Value::Null,
                    Value::Null,
                    Value::Null,
                    o.properties.clone().unwrap_or(Value::Null),
                ],
            ),
            Performative::Begin(b) => described_list(
                desc::BEGIN,
                vec![
                    b.remote_channel.map_or(Value::Null, Value::Ushort),
                    Value::Uint(b.next_outgoing_id),
                    Value::Uint(b.incoming_window),
                    Value::Uint(b.outgoing_window),
                    Value::Uint(b.handle_max),
                ],
            ),
            Performative::Attach(a) => described_list(
                desc::ATTACH,
                vec![
                    a.name.clone().into(),
                    Value::Uint(a.handle),
                    Value::Bool(a.role),
                    a.snd_settle_mode.map_or(Value::Null, Value::Ubyte),
                    a.rcv_settle_mode.map_or(Value::Null, Value::Ubyte),
                    a.source.clone().unwrap_or(Value::Null),
                    a.target.clone().unwrap_or(Value::Null),
                    Value::Null,
                    Value::Null,
                    opt(a.initial_delivery_count),
                    a.max_message_size.map_or(Value::Null, Value::Ulong),
                    Value::Null,
                    Value::Null,
                    a.properties.clone().unwrap_or(Value::Null),
                ],
            ),
            Performative::Flow(f) => described_list(desc::FLOW, flow_fields(f).into()),
            Performative::Transfer(t) => described_list(
                desc::TRANSFER,
                vec![
                    Value::Uint(t.handle),
                    opt(t.delivery_id),
                    t.delivery_tag.clone().map_or(Value::Null, Value::Binary),
                    opt(t.message_format),
                    opt(t.settled),
                    if t.more { Value::Bool(true) } else { Value::Null },
                    Value::Null,
                    t.state.clone().unwrap_or(Value::Null),
                    Value::Null,
                    if t.aborted { Value::Bool(true) } else { Value::Null },
                ],
            ),
            Performative::Disposition(d) => described_list(
                desc::DISPOSITION,
                vec![
                    Value::Bool(d.role),
                    Value::Uint(d.first),
                    opt(d.last),
                    Value::Bool(d.settled),
                    d.state.clone().unwrap_or(Value::Null),
                ],
            ),
            Performative::Detach(d) => described_list(
                desc::DETACH,
                vec![
                    Value::Uint(d.handle),
                    Value::Bool(d.closed),
                    d.error.as_ref().map_or(Value::Null, AmqpError::to_value),
                ],
            ),
            Performative::End(e) => {
                described_list(desc::END, vec![e.as_ref().map_or(Value::Null, AmqpError::to_value)])
            }
            Performative::Close(e) => described_list(
                desc::CLOSE,
                vec![e.as_ref().map_or(Value::Null, AmqpError::to_value)],
            ),
            Performative::SaslMechanisms(m) => described_list(
                desc::SASL_MECHANISMS,
                vec![Value::Array(Array::new(
                    code::SYMBOL,
                    m.iter().cloned().map(Value::Symbol).collect(),
                ))],
            ),
            Performative::SaslInit(i) => described_list(
                desc::SASL_INIT,
                vec![
                    Value::Symbol(i.mechanism.clone()),
                    i.initial_response.clone().map_or(Value::Null, Value::Binary),
                    opt(i.hostname.clone()),
                ],
            ),
            Performative::SaslOutcome(code) => {
                described_list(desc::SASL_OUTCOME, vec![Value::Ubyte(*code)])
            }
        }
    }

    /// The name, for logs.
    pub fn name(&self) -> &'static str {
        match self {
            Performative::Open(_) => "open",
            Performative::Begin(_) => "begin",
            Performative::Attach(_) => "attach",
            Performative::Flow(_) => "flow",
            Performative::Transfer(_) => "transfer",
            Performative::Disposition(_) => "disposition",
            Performative::Detach(_) => "detach",
            Performative::End(_) => "end",
            Performative::Close(_) => "close",
            Performative::SaslMechanisms(_) => "sasl-mechanisms",
            Performative::SaslInit(_) => "sasl-init",
            Performative::SaslOutcome(_) => "sasl-outcome",
        }
    }
}

/// A delivery outcome (or state) as a client or twice sends it in a disposition.
#[derive(Clone, Debug, PartialEq)]
pub enum Outcome {
    /// `accepted`: complete.
    Accepted,
    /// `rejected`, with its error (dead-letter carries `com.microsoft:dead-letter`).
    Rejected(Option<AmqpError>),
    /// `released`: unlock without counting a delivery.
    Released,
    /// `modified`: abandon or (with `undeliverable_here`) defer.
    Modified {
        /// `delivery-failed`.
        delivery_failed: bool,
        /// `undeliverable-here`.
        undeliverable_here: bool,
        /// Annotations to merge into the message.
        message_annotations: Option<Value>,
    },
    /// `received` or anything else: not a terminal outcome.
    Other,
}

impl Outcome {
    /// Parses a delivery state value.
    pub fn from_value(v: &Value) -> Result<Self, FrameError> {
        let name = "outcome";
        Ok(match v.descriptor_code() {
            Some(desc::ACCEPTED) => Outcome::Accepted,
            Some(desc::RELEASED) => Outcome::Released,
            Some(desc::REJECTED) => {
                let f = Fields::list(v.undescribed(), name)?;
                Outcome::Rejected(f.opt_error(0)?)
            }
            Some(desc::MODIFIED) => {
                let f = Fields::list(v.undescribed(), name)?;
                Outcome::Modified {
                    delivery_failed: f.opt_bool(0)?.unwrap_or(false),
                    undeliverable_here: f.opt_bool(1)?.unwrap_or(false),
                    message_annotations: f.opt_value(2),
                }
            }
            _ => Outcome::Other,
        })
    }

    /// As a described value.
    pub fn to_value(&self) -> Value {
        match self {
            Outcome::Accepted | Outcome::Other => described_list(desc::ACCEPTED, vec![]),
            Outcome::Released => described_list(desc::RELEASED, vec![]),
            Outcome::Rejected(e) => described_list(
                desc::REJECTED,
                vec![e.as_ref().map_or(Value::Null, AmqpError::to_value)],
            ),
            Outcome::Modified { delivery_failed, undeliverable_here, message_annotations } => {
                described_list(
                    desc::MODIFIED,
                    vec![
                        Value::Bool(*delivery_failed),
                        Value::Bool(*undeliverable_here),
                        message_annotations.clone().unwrap_or(Value::Null),
                    ],
                )
            }
        }
    }
}

/// The fields of a `source` or `target` twice reads.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Terminus {
    /// The address.
    pub address: Option<String>,
    /// The filter map (sources only).
    pub filter: Option<Value>,
}

impl Terminus {
    /// Reads a source (`is_source`) or target value; anything unreadable is an empty terminus.
    pub fn parse(v: Option<&Value>, is_source: bool) -> Self {
        let Some(v) = v else { return Self::default() };
        let items = v.undescribed().as_seq().unwrap_or(&[]);
        let address = items.first().and_then(|a| a.as_str().map(str::to_owned));
        let filter = if is_source { items.get(7).filter(|f| !f.is_null()).cloned() } else { None };
        Self { address, filter }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `encode` writes the bytes of `to_value`, for the performatives it writes field by field
    /// (with and without their optional fields, and a tag long enough for the long forms) and
    /// for those it builds as values.
    #[test]
    fn encode_writes_the_bytes_of_to_value() {
        let accepted = Some(Outcome::Accepted.to_value());
        let performatives = [
            Performative::Transfer(Transfer::default()),
            Performative::Transfer(Transfer {
                handle: 3,
                delivery_id: Some(70_000),
                delivery_tag: Some(Bytes::from_static(&[7; 16])),
                message_format: Some(0),
                settled: Some(false),
                more: true,
                state: accepted.clone(),
                aborted: true,
            }),
            Performative::Transfer(Transfer {
                handle: 1,
                delivery_tag: Some(Bytes::from(vec![1u8; 300])),
                settled: Some(true),
                ..Transfer::default()
            }),
            Performative::Disposition(Disposition::default()),
            Performative::Disposition(Disposition {
                role: true,
                first: 5,
                last: Some(9),
                settled: true,
                state: Some(Outcome::Rejected(Some(AmqpError::new("c", "d"))).to_value()),
            }),
            Performative::Flow(Flow::default()),
            Performative::Flow(Flow {
                next_incoming_id: Some(1),
                incoming_window: 5000,
                next_outgoing_id: 2,
                outgoing_window: u32::MAX,
                handle: Some(0),
                delivery_count: Some(10),
                link_credit: Some(256),
                available: Some(0),
                drain: true,
                echo: true,
            }),
            Performative::Flow(Flow { handle: Some(1), echo: true, ..Flow::default() }),
            Performative::Close(None),
            Performative::Detach(Detach { handle: 2, closed: true, error: None }),
        ];
        for p in performatives {
            let mut direct = Vec::new();
            p.encode(&mut direct);
            assert_eq!(direct, p.to_value().to_bytes(), "{p:?}");
            assert_eq!(Performative::decode(&direct).unwrap().0, p);
        }
    }

    /// The dispositions read field by field decode as every performative does, whatever the
    /// bytes: the common shapes, other valid encodings, every prefix and every one-byte change
    /// of them, with a payload behind.
    #[test]
    fn dispositions_decode_as_their_values_do() {
        let mut samples: Vec<Vec<u8>> = Vec::new();
        for d in [
            Disposition { role: true, first: 7, settled: true, ..Disposition::default() },
            Disposition {
                role: true,
                first: 300,
                last: Some(70_000),
                settled: false,
                state: Some(Outcome::Accepted.to_value()),
            },
            Disposition {
                role: false,
                first: 0,
                last: None,
                settled: true,
                state: Some(Outcome::Released.to_value()),
            },
            Disposition {
                role: true,
                first: 1,
                last: Some(1),
                settled: true,
                state: Some(Outcome::Rejected(Some(AmqpError::new("c", "d"))).to_value()),
            },
            Disposition {
                role: true,
                first: 2,
                state: Some(
                    Outcome::Modified {
                        delivery_failed: true,
                        undeliverable_here: false,
                        message_annotations: None,
                    }
                    .to_value(),
                ),
                ..Disposition::default()
            },
        ] {
            samples.push(Performative::Disposition(d).to_value().to_bytes());
        }
        // Other encodings of the same fields: 0x56 booleans, a 4-byte uint, a 32-bit list, an
        // empty list in its short form, a sixth field, a symbolic descriptor.
        samples.push(
            b"\x00\x53\x15\xc0\x0f\x05\x56\x01\x70\x00\x00\x00\x09\x40\x56\x00\x00\x53\x24\x45"
                .to_vec(),
        );
        samples.push(b"\x00\x53\x15\xd0\x00\x00\x00\x0e\x00\x00\x00\x05\x41\x43\x40\x41\x00\x53\x26\xc0\x01\x00".to_vec());
        samples.push(b"\x00\x53\x15\xc0\x08\x06\x41\x52\x03\x40\x41\x40\x41".to_vec());
        let mut symbolic = b"\x00\xa3\x15amqp:disposition:list".to_vec();
        symbolic.extend_from_slice(b"\xc0\x04\x02\x41\x52\x05");
        samples.push(symbolic);
        for sample in &samples {
            assert!(Performative::decode_values(sample).is_ok(), "{sample:02x?}");
        }
        // What the shortcut reads: the common shapes, in any encoding of their fields.
        for i in [0, 1, 2, 5, 6] {
            assert!(Disposition::decode_common(&samples[i]).is_some(), "{:02x?}", samples[i]);
        }
        let mut inputs = Vec::new();
        for sample in &samples {
            for end in 0..=sample.len() {
                inputs.push(sample[..end].to_vec());
            }
            for i in 0..sample.len() {
                for byte in [0x00, 0x01, 0x02, 0x05, 0x40, 0x41, 0x43, 0x45, 0x52, 0x56, 0x70, 0xff]
                {
                    let mut changed = sample.clone();
                    changed[i] = byte;
                    inputs.push(changed);
                }
            }
            let mut with_payload = sample.clone();
            with_payload.extend_from_slice(b"payload");
            inputs.push(with_payload);
        }
        for input in inputs {
            assert_eq!(
                Performative::decode(&input),
                Performative::decode_values(&input),
                "{input:02x?}"
            );
        }
    }
}
