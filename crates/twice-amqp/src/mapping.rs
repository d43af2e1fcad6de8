//! AMQP messages to and from twice's [`Message`] and [`ReceivedMessage`].
//!
//! A message on the wire is a sequence of sections (header, annotations, properties,
//! application properties, body, footer). Senders' fields map onto [`Message`]; the broker's
//! fields come back as the annotations and header the SDKs read (research §8.2), with the exact
//! AMQP types they match on: `x-opt-sequence-number` is a `long`, the times are `timestamp`s,
//! the lock token is a `uuid` delivery annotation.

use std::time::Duration;

use bytes::Bytes;
use twice::{Message, MessageId, MessageState, Properties, ReceivedMessage, SessionId, Timestamp};

use crate::codec::encode::{self, ListWriter};
use crate::codec::{DecodeError, Decoder, Value};
use crate::performative::described_list;

/// Section descriptor codes.
mod section {
    pub(super) const HEADER: u64 = 0x70;
    pub(super) const DELIVERY_ANNOTATIONS: u64 = 0x71;
    pub(super) const MESSAGE_ANNOTATIONS: u64 = 0x72;
    pub(super) const PROPERTIES: u64 = 0x73;
    pub(super) const APPLICATION_PROPERTIES: u64 = 0x74;
    pub(super) const DATA: u64 = 0x75;
    pub(super) const AMQP_SEQUENCE: u64 = 0x76;
    pub(super) const AMQP_VALUE: u64 = 0x77;
    pub(super) const FOOTER: u64 = 0x78;
}

/// The application property that marks a body kept as raw AMQP body sections (an `amqp-value`,
/// an `amqp-sequence`, or several `data` sections), so it goes back out as it came in.
pub const RAW_BODY_PROPERTY: &str = "x-twice-amqp-body";

/// The application property that carries, as one encoded AMQP map, the fields of a message
/// that twice does not model: `user-id`, `content-encoding`, `creation-time`, the sender's own
/// message annotations, application properties of types twice has no value for (the .NET
/// SDK's `decimal`, `Uri`, `DateTimeOffset`, `TimeSpan`, which travel as described values),
/// and the footer. They go back out as they came in; clients never see the property itself.
pub const PASS_THROUGH_PROPERTY: &str = "x-twice-amqp-fields";

/// Message annotations the broker sets on what it delivers: a sender's values for them are
/// not kept.
const BROKER_ANNOTATIONS: [&str; 8] = [
    "x-opt-sequence-number",
    "x-opt-enqueued-time",
    "x-opt-locked-until",
    "x-opt-lock-token",
    "x-opt-message-state",
    "x-opt-deadletter-source",
    "x-opt-enqueue-sequence-number",
    "x-opt-scheduled-enqueue-time",
];

/// The message format of a Service Bus batch: each `data` section holds a whole message.
pub const BATCH_FORMAT: u32 = 0x8001_3700;

/// Why a payload is not a message.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum MessageError {
    /// A section is not valid AMQP.
    #[error("malformed message: {0}")]
    Decode(#[from] DecodeError),
    /// A value where a section belongs, or a section of the wrong shape.
    #[error("malformed message section")]
    BadSection,
}

/// The sections of a message, decoded.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Sections {
    /// `header` fields.
    pub header: Vec<Value>,
    /// `delivery-annotations` entries (the broker's lock token travels here).
    pub delivery_annotations: Vec<(Value, Value)>,
    /// `message-annotations` entries.
    pub message_annotations: Vec<(Value, Value)>,
    /// `properties` fields.
    pub properties: Vec<Value>,
    /// `application-properties` entries.
    pub application_properties: Vec<(Value, Value)>,
    /// The body sections, raw.
    pub body: Vec<Value>,
    /// `footer` entries.
    pub footer: Vec<(Value, Value)>,
}

impl Sections {
    /// Splits a payload into its sections.
    pub fn parse(payload: &[u8]) -> Result<Self, MessageError> {
        let mut s = Sections::default();
        let mut d = Decoder::new(payload);
        while !d.is_empty() {
            let v = d.value()?;
            let code = v.descriptor_code().ok_or(MessageError::BadSection)?;
            let inner = v.undescribed();
            match code {
                section::HEADER => {
                    s.header = inner.as_seq().ok_or(MessageError::BadSection)?.to_vec()
                }
                section::DELIVERY_ANNOTATIONS => {
                    s.delivery_annotations = map_entries(inner)?;
                }
                section::FOOTER => s.footer = map_entries(inner)?,
                section::MESSAGE_ANNOTATIONS => {
                    s.message_annotations = map_entries(inner)?;
                }
                section::PROPERTIES => {
                    s.properties = inner.as_seq().ok_or(MessageError::BadSection)?.to_vec();
                }
                section::APPLICATION_PROPERTIES => {
                    s.application_properties = map_entries(inner)?;
                }
                section::DATA | section::AMQP_SEQUENCE | section::AMQP_VALUE => s.body.push(v),
                _ => return Err(MessageError::BadSection),
            }
        }
        Ok(s)
    }

    fn prop(&self, i: usize) -> Option<&Value> {
        self.properties.get(i).filter(|v| !v.is_null())
    }

    fn annotation(&self, key: &str) -> Option<&Value> {
        self.message_annotations.iter().find(|(k, _)| k.as_str() == Some(key)).map(|(_, v)| v)
    }

    /// The message these sections carry, in twice's terms.
    pub fn to_message(&self) -> Message {
        let mut m = Message::default();
        m.message_id = self.prop(0).and_then(id_string).map(MessageId::new);
        m.to = self.prop(2).and_then(text);
        m.subject = self.prop(3).and_then(text);
        m.reply_to = self.prop(4).and_then(text);
        m.correlation_id = self.prop(5).and_then(id_string);
        m.content_type = self.prop(6).and_then(text);
        m.session_id = self.prop(10).and_then(text).map(SessionId::new);
        m.reply_to_session_id = self.prop(12).and_then(text);
        if let Some(Value::Uint(ttl)) = self.header.get(2) {
            m.time_to_live = Some(Duration::from_millis(u64::from(*ttl)));
        }
        if let Some(Value::Timestamp(t)) = self.annotation("x-opt-scheduled-enqueue-time") {
            m.scheduled_enqueue_time = Some(Timestamp::from_millis(*t));
        }
        m.partition_key = self.annotation("x-opt-partition-key").and_then(text);
        let mut pass = PassThrough {
            user_id: self.prop(1).cloned(),
            content_encoding: self.prop(7).cloned(),
            creation_time: self.prop(9).cloned(),
            annotations: self
                .message_annotations
                .iter()
                .filter(|(k, _)| {
                    k.as_str().is_none_or(|k| {
                        k != "x-opt-partition-key" && !BROKER_ANNOTATIONS.contains(&k)
                    })
                })
                .cloned()
                .collect(),
            application_properties: Vec::new(),
            footer: self.footer.clone(),
        };
        for (k, v) in &self.application_properties {
            let Some(key) = k.as_str() else { continue };
            if key == PASS_THROUGH_PROPERTY || key == RAW_BODY_PROPERTY {
                // Reserved: a sender cannot forge what the broker keeps for itself.
                continue;
            }
            match to_twice_value(v) {
                Some(v) => {
                    m.application_properties.insert(key.to_owned(), v);
                }
                None => pass.application_properties.push((k.clone(), v.clone())),
            }
        }
        if let Some(encoded) = pass.encode() {
            m.application_properties
                .insert(PASS_THROUGH_PROPERTY.to_owned(), twice::Value::Binary(encoded));
        }
        match self.body.as_slice() {
            [] => {}
            [single] if single.descriptor_code() == Some(section::DATA) => {
                if let Some(b) = single.undescribed().as_binary() {
                    m.body = b.clone();
                }
            }
            sections => {
                let mut raw = Vec::new();
                for s in sections {
                    s.encode(&mut raw);
                }
                m.body = Bytes::from(raw);
                m.application_properties
                    .insert(RAW_BODY_PROPERTY.to_owned(), twice::Value::Bool(true));
            }
        }
        m
    }
}

fn map_entries(v: &Value) -> Result<Vec<(Value, Value)>, MessageError> {
    match v {
        Value::Map(m) => Ok(m.clone()),
        Value::Null => Ok(Vec::new()),
        _ => Err(MessageError::BadSection),
    }
}

/// The AMQP fields twice keeps without modelling them (see [`PASS_THROUGH_PROPERTY`]).
#[derive(Debug, Default, PartialEq)]
struct PassThrough {
    user_id: Option<Value>,
    content_encoding: Option<Value>,
    creation_time: Option<Value>,
    annotations: Vec<(Value, Value)>,
    application_properties: Vec<(Value, Value)>,
    footer: Vec<(Value, Value)>,
}

impl PassThrough {
    const KEYS: [&'static str; 6] = [
        "user-id",
        "content-encoding",
        "creation-time",
        "annotations",
        "application-properties",
        "footer",
    ];

    /// The fields a message carries in [`PASS_THROUGH_PROPERTY`], if any.
    fn of(m: &Message) -> PassThrough {
        let Some(twice::Value::Binary(b)) = m.application_properties.get(PASS_THROUGH_PROPERTY)
        else {
            return PassThrough::default();
        };
        let Ok(Value::Map(entries)) = Decoder::new(b).value() else {
            return PassThrough::default();
        };
        let mut p = PassThrough::default();
        for (k, v) in entries {
            match (k.as_str(), v) {
                (Some("user-id"), v) => p.user_id = Some(v),
                (Some("content-encoding"), v) => p.content_encoding = Some(v),
                (Some("creation-time"), v) => p.creation_time = Some(v),
                (Some("annotations"), Value::Map(m)) => p.annotations = m,
                (Some("application-properties"), Value::Map(m)) => p.application_properties = m,
                (Some("footer"), Value::Map(m)) => p.footer = m,
                _ => {}
            }
        }
        p
    }

    /// The fields as one encoded map, or `None` when there are none.
    fn encode(self) -> Option<Bytes> {
        let values = [
            self.user_id,
            self.content_encoding,
            self.creation_time,
            (!self.annotations.is_empty()).then_some(Value::Map(self.annotations)),
            (!self.application_properties.is_empty())
                .then_some(Value::Map(self.application_properties)),
            (!self.footer.is_empty()).then_some(Value::Map(self.footer)),
        ];
        let entries: Vec<(Value, Value)> = Self::KEYS
            .iter()
            .zip(values)
            .filter_map(|(&k, v)| Some((Value::symbol(k), v?)))
            .collect();
        if entries.is_empty() {
            return None;
        }
        let mut out = Vec::new();
        Value::Map(entries).encode(&mut out);
        Some(Bytes::from(out))
    }
}

fn text(v: &Value) -> Option<String> {
    v.as_str().map(str::to_owned)
}

/// A message or correlation id as a string: Service Bus ids are strings, and the other AMQP id
/// types (uuid, ulong, binary) are shown the way .NET shows them.
fn id_string(v: &Value) -> Option<String> {
    match v {
        Value::String(s) | Value::Symbol(s) => Some(s.clone()),
        Value::Uuid(u) => Some(u.to_string()),
        Value::Ulong(n) => Some(n.to_string()),
        Value::Binary(b) => Some(b.iter().map(|x| format!("{x:02x}")).collect()),
        _ => None,
    }
}

/// Decodes a message as a broker delivers it (on a receiver link, or inside a `$management`
/// reply): the sent message plus the broker's header and annotations (research §8.2). The
/// lock token is taken from the `x-opt-lock-token` delivery annotation; a receiver that has
/// the delivery tag should prefer [`lock_token_of_tag`].
pub fn decode_received(payload: &[u8]) -> Result<ReceivedMessage, MessageError> {
    let s = Sections::parse(payload)?;
    let annotation = |key: &str| s.annotation(key);
    let seq = annotation("x-opt-sequence-number").and_then(Value::as_i64).unwrap_or(0);
    let enqueued = match annotation("x-opt-enqueued-time") {
        Some(Value::Timestamp(t)) => *t,
        _ => 0,
    };
    let mut message = s.to_message();
    // The creation time the broker fills in (the enqueued time) is no field of the sender's:
    // it is not kept, so that a message nobody gave extra fields carries no extra property.
    let mut pass = PassThrough::of(&message);
    if pass.creation_time == Some(Value::Timestamp(enqueued)) {
        pass.creation_time = None;
        match pass.encode() {
            Some(b) => {
                message
                    .application_properties
                    .insert(PASS_THROUGH_PROPERTY.to_owned(), twice::Value::Binary(b));
            }
            None => {
                message.application_properties.remove(PASS_THROUGH_PROPERTY);
            }
        }
    }
    let mut r = ReceivedMessage::new(
        message,
        twice::SequenceNumber::new(seq),
        Timestamp::from_millis(enqueued),
    );
    if let Some(Value::Timestamp(t)) = annotation("x-opt-locked-until") {
        r.locked_until = Some(Timestamp::from_millis(*t));
    }
    if let Some(Value::Timestamp(t)) = s.prop(8) {
        r.expires_at = Some(Timestamp::from_millis(*t));
    }
    // The wire counts earlier deliveries; twice counts this one too.
    let wire_count = s.header.get(4).and_then(Value::as_i64).unwrap_or(0);
    r.delivery_count = u32::try_from(wire_count).unwrap_or(0).saturating_add(1);
    r.state = match annotation("x-opt-message-state").and_then(Value::as_i64) {
        Some(1) => MessageState::Deferred,
        Some(2) => MessageState::Scheduled,
        _ => MessageState::Active,
    };
    r.dead_letter_source = annotation("x-opt-deadletter-source").and_then(text);
    let app = |key: &str| {
        s.application_properties
            .iter()
            .find(|(k, _)| k.as_str() == Some(key))
            .and_then(|(_, v)| text(v))
    };
    r.dead_letter_reason = app("DeadLetterReason");
    r.dead_letter_error_description = app("DeadLetterErrorDescription");
    r.lock_token = s
        .delivery_annotations
        .iter()
        .find(|(k, _)| k.as_str() == Some("x-opt-lock-token"))
        .and_then(|(_, v)| match v {
            Value::Uuid(u) => Some(twice::LockToken::from_uuid(*u)),
            _ => None,
        });
    Ok(r)
}

/// The lock token a delivery tag carries: Service Bus tags a locked delivery with the 16
/// bytes of its lock token in .NET's GUID byte order.
pub fn lock_token_of_tag(tag: &[u8]) -> Option<twice::LockToken> {
    let bytes: [u8; 16] = tag.try_into().ok()?;
    Some(twice::LockToken::from_uuid(uuid::Uuid::from_bytes_le(bytes)))
}

/// Splits a payload into messages: one, or for the batch format each `data` section's message.
pub fn messages_of(payload: &[u8], format: u32) -> Result<Vec<Message>, MessageError> {
    let sections = Sections::parse(payload)?;
    if format != BATCH_FORMAT {
        return Ok(vec![sections.to_message()]);
    }
    let mut out = Vec::new();
    for body in &sections.body {
        if body.descriptor_code() != Some(section::DATA) {
            return Err(MessageError::BadSection);
        }
        let bytes = body.undescribed().as_binary().ok_or(MessageError::BadSection)?;
        out.push(Sections::parse(bytes)?.to_message());
    }
    Ok(out)
}

/// An application property value, if twice can hold it.
pub fn to_twice_value(v: &Value) -> Option<twice::Value> {
    Some(match v {
        Value::Null => twice::Value::Null,
        Value::Bool(b) => twice::Value::Bool(*b),
        Value::Ubyte(n) => twice::Value::Ubyte(*n),
        Value::Ushort(n) => twice::Value::Ushort(*n),
        Value::Uint(n) => twice::Value::Uint(*n),
        Value::Ulong(n) => twice::Value::Ulong(*n),
        Value::Byte(n) => twice::Value::Byte(*n),
        Value::Short(n) => twice::Value::Short(*n),
        Value::Int(n) => twice::Value::Int(*n),
        Value::Long(n) => twice::Value::Long(*n),
        Value::Float(x) => twice::Value::Float(*x),
        Value::Double(x) => twice::Value::Double(*x),
        Value::Char(c) => twice::Value::Char(*c),
        Value::Timestamp(t) => twice::Value::Timestamp(Timestamp::from_millis(*t)),
        Value::Uuid(u) => twice::Value::Uuid(*u),
        Value::Binary(b) => twice::Value::Binary(b.clone()),
        Value::String(s) => twice::Value::String(s.clone()),
        Value::Symbol(s) => twice::Value::Symbol(s.clone()),
        _ => return None,
    })
}

/// A twice property value on the wire.
pub fn from_twice_value(v: &twice::Value) -> Value {
    match v {
        twice::Value::Bool(b) => Value::Bool(*b),
        twice::Value::Ubyte(n) => Value::Ubyte(*n),
        twice::Value::Ushort(n) => Value::Ushort(*n),
        twice::Value::Uint(n) => Value::Uint(*n),
        twice::Value::Ulong(n) => Value::Ulong(*n),
        twice::Value::Byte(n) => Value::Byte(*n),
        twice::Value::Short(n) => Value::Short(*n),
        twice::Value::Int(n) => Value::Int(*n),
        twice::Value::Long(n) => Value::Long(*n),
        twice::Value::Float(x) => Value::Float(*x),
        twice::Value::Double(x) => Value::Double(*x),
        twice::Value::Char(c) => Value::Char(*c),
        twice::Value::Timestamp(t) => Value::Timestamp(t.as_millis()),
        twice::Value::Uuid(u) => Value::Uuid(*u),
        twice::Value::Binary(b) => Value::Binary(b.clone()),
        twice::Value::String(s) => Value::String(s.clone()),
        twice::Value::Symbol(s) => Value::Symbol(s.clone()),
        _ => Value::Null,
    }
}

/// Properties from a map (string or symbol keys), e.g. `propertiesToModify` or the info of a
/// dead-letter error, leaving out the given keys.
pub fn properties_of(map: Option<&Value>, except: &[&str]) -> Properties {
    let mut out = Properties::new();
    for (k, v) in map.and_then(Value::as_map).unwrap_or(&[]) {
        if let (Some(k), Some(v)) = (k.as_str(), to_twice_value(v))
            && !except.contains(&k)
        {
            out.insert(k.to_owned(), v);
        }
    }
    out
}

/// How a received message is shown to a client.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Presentation {
    /// Delivered on a link, locked: lock token annotation and locked-until included.
    Locked,
    /// Delivered without a lock (receive-and-delete) or peeked.
    Unlocked,
}

/// Encodes a received message as the SDKs expect it.
pub fn encode_received(r: &ReceivedMessage, how: Presentation) -> Vec<u8> {
    let mut out = Vec::with_capacity(r.message.body.len() + 256);
    encode_received_into(&mut out, r, how);
    out
}

/// Appends a received message, encoded as [`encode_received`] encodes it, to `out` (a frame
/// being written, say).
///
/// Every message a receiver gets goes through here, so the sections are written straight into
/// the buffer rather than built as [`Value`]s first; the bytes are the same.
pub fn encode_received_into(out: &mut Vec<u8>, r: &ReceivedMessage, how: Presentation) {
    let m = &r.message;
    let pass = PassThrough::of(m);
    // The effective time to live, as Service Bus sends it: the message's own, else what its
    // entity's default made of it (when it fits the header's milliseconds).
    let effective = m.time_to_live.or_else(|| {
        let ms = r.expires_at?.as_millis().checked_sub(r.enqueued_time.as_millis())?;
        Some(Duration::from_millis(u64::try_from(ms).ok().filter(|&ms| ms > 0)?))
    });
    let ttl = effective
        .map_or(Value::Null, |d| Value::Uint(u32::try_from(d.as_millis()).unwrap_or(u32::MAX)));
    let wire_count = r.delivery_count.saturating_sub(1);
    let mut header = ListWriter::begin(out, section::HEADER);
    header.null(out);
    header.null(out);
    header.value(out, &ttl);
    header.null(out);
    header.value(out, &Value::Uint(wire_count));
    header.end(out);
    let lock = match how {
        Presentation::Locked => r.lock_token,
        Presentation::Unlocked => None,
    };
    if let Some(lock) = lock {
        encode::descriptor(out, section::DELIVERY_ANNOTATIONS);
        let map = encode::begin_compound(out);
        encode::symbol(out, "x-opt-lock-token");
        Value::Uuid(*lock.as_uuid()).encode(out);
        encode::end_compound(out, map, encode::MAP, 2);
    }
    encode::descriptor(out, section::MESSAGE_ANNOTATIONS);
    let map = encode::begin_compound(out);
    let annotation = |out: &mut Vec<u8>, key: &str, v: &Value| {
        encode::symbol(out, key);
        v.encode(out);
    };
    annotation(out, "x-opt-sequence-number", &Value::Long(r.sequence_number.get()));
    annotation(out, "x-opt-enqueued-time", &Value::Timestamp(r.enqueued_time.as_millis()));
    let mut entries = 2;
    if lock.is_some()
        && let Some(until) = r.locked_until
    {
        annotation(out, "x-opt-locked-until", &Value::Timestamp(until.as_millis()));
        entries += 1;
    }
    if let Some(at) = m.scheduled_enqueue_time {
        annotation(out, "x-opt-scheduled-enqueue-time", &Value::Timestamp(at.as_millis()));
        entries += 1;
    }
    if let Some(pk) = &m.partition_key {
        encode::symbol(out, "x-opt-partition-key");
        encode::string(out, pk);
        entries += 1;
    }
    if let Some(src) = &r.dead_letter_source {
        encode::symbol(out, "x-opt-deadletter-source");
        encode::string(out, src);
        entries += 1;
    }
    let state = match r.state {
        MessageState::Active => None,
        MessageState::Deferred => Some(1),
        MessageState::Scheduled => Some(2),
    };
    if let Some(state) = state {
        annotation(out, "x-opt-message-state", &Value::Int(state));
        entries += 1;
    }
    for (k, v) in &pass.annotations {
        k.encode(out);
        v.encode(out);
        entries += 1;
    }
    encode::end_compound(out, map, encode::MAP, entries * 2);
    // The creation time is the sender's, else (as Service Bus sets it) the enqueued time.
    let created = pass.creation_time.unwrap_or(Value::Timestamp(r.enqueued_time.as_millis()));
    let mut p = ListWriter::begin(out, section::PROPERTIES);
    p.opt_string(out, m.message_id.as_ref().map(MessageId::as_str));
    p.value(out, pass.user_id.as_ref().unwrap_or(&Value::Null));
    p.opt_string(out, m.to.as_deref());
    p.opt_string(out, m.subject.as_deref());
    p.opt_string(out, m.reply_to.as_deref());
    p.opt_string(out, m.correlation_id.as_deref());
    p.opt_symbol(out, m.content_type.as_deref());
    p.value(out, pass.content_encoding.as_ref().unwrap_or(&Value::Null));
    p.value(out, &r.expires_at.map_or(Value::Null, |t| Value::Timestamp(t.as_millis())));
    p.value(out, &created);
    p.opt_string(out, m.session_id.as_ref().map(SessionId::as_str));
    p.null(out);
    p.opt_string(out, m.reply_to_session_id.as_deref());
    p.end(out);
    let raw_body =
        matches!(m.application_properties.get(RAW_BODY_PROPERTY), Some(twice::Value::Bool(true)));
    let before = out.len();
    encode::descriptor(out, section::APPLICATION_PROPERTIES);
    let map = encode::begin_compound(out);
    let mut entries = 0;
    for (k, v) in &m.application_properties {
        if k.as_str() == RAW_BODY_PROPERTY || k.as_str() == PASS_THROUGH_PROPERTY {
            continue;
        }
        encode::string(out, k);
        encode_twice_value(out, v);
        entries += 1;
    }
    for (k, v) in &pass.application_properties {
        k.encode(out);
        v.encode(out);
        entries += 1;
    }
    for (key, v) in [
        ("DeadLetterReason", &r.dead_letter_reason),
        ("DeadLetterErrorDescription", &r.dead_letter_error_description),
    ] {
        if let Some(v) = v
            && !m.application_properties.contains_key(key)
        {
            encode::string(out, key);
            encode::string(out, v);
            entries += 1;
        }
    }
    if entries == 0 {
        out.truncate(before);
    } else {
        encode::end_compound(out, map, encode::MAP, entries * 2);
    }
    if raw_body {
        out.extend_from_slice(&m.body);
    } else {
        encode::descriptor(out, section::DATA);
        encode::binary(out, &m.body);
    }
    if !pass.footer.is_empty() {
        Value::described(section::FOOTER, Value::Map(pass.footer)).encode(out);
    }
}

/// Writes an application property's value as [`from_twice_value`] makes it, without the copy.
fn encode_twice_value(out: &mut Vec<u8>, v: &twice::Value) {
    match v {
        twice::Value::Binary(b) => encode::binary(out, b),
        twice::Value::String(s) => encode::string(out, s),
        twice::Value::Symbol(s) => encode::symbol(out, s),
        other => from_twice_value(other).encode(out),
    }
}

/// Encodes a message to send (used by tests and by the management reply for scheduled
/// messages): properties, application properties, annotations, body.
pub fn encode_message(m: &Message) -> Vec<u8> {
    let pass = PassThrough::of(m);
    let mut out = Vec::new();
    if let Some(ttl) = m.time_to_live {
        let ttl = Value::Uint(u32::try_from(ttl.as_millis()).unwrap_or(u32::MAX));
        described_list(section::HEADER, vec![Value::Null, Value::Null, ttl]).encode(&mut out);
    }
    let mut ma = Vec::new();
    if let Some(at) = m.scheduled_enqueue_time {
        ma.push((Value::symbol("x-opt-scheduled-enqueue-time"), Value::Timestamp(at.as_millis())));
    }
    if let Some(pk) = &m.partition_key {
        ma.push((Value::symbol("x-opt-partition-key"), Value::String(pk.clone())));
    }
    ma.extend(pass.annotations);
    if !ma.is_empty() {
        Value::described(section::MESSAGE_ANNOTATIONS, Value::Map(ma)).encode(&mut out);
    }
    let s = |o: &Option<String>| o.clone().map_or(Value::Null, Value::String);
    described_list(
        section::PROPERTIES,
        vec![
            m.message_id.as_ref().map_or(Value::Null, |id| Value::String(id.as_str().to_owned())),
            pass.user_id.unwrap_or(Value::Null),
            s(&m.to),
            s(&m.subject),
            s(&m.reply_to),
            s(&m.correlation_id),
            m.content_type.clone().map_or(Value::Null, Value::Symbol),
            pass.content_encoding.unwrap_or(Value::Null),
            Value::Null,
            pass.creation_time.unwrap_or(Value::Null),
            m.session_id.as_ref().map_or(Value::Null, |id| Value::String(id.as_str().to_owned())),
            Value::Null,
            s(&m.reply_to_session_id),
        ],
    )
    .encode(&mut out);
    let mut ap: Vec<(Value, Value)> = m
        .application_properties
        .iter()
        .filter(|(k, _)| k.as_str() != PASS_THROUGH_PROPERTY)
        .map(|(k, v)| (Value::String(k.clone()), from_twice_value(v)))
        .collect();
    ap.extend(pass.application_properties);
    if !ap.is_empty() {
        Value::described(section::APPLICATION_PROPERTIES, Value::Map(ap)).encode(&mut out);
    }
    Value::described(section::DATA, Value::Binary(m.body.clone())).encode(&mut out);
    if !pass.footer.is_empty() {
        Value::described(section::FOOTER, Value::Map(pass.footer)).encode(&mut out);
    }
    out
}

#[cfg(test)]
mod tests;
