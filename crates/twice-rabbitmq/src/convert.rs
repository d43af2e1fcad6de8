//! twice's messages to AMQP 0-9-1 properties and back.
//!
//! The message id, correlation id, content type, reply-to and time to live have AMQP 0-9-1
//! properties; the other Service Bus fields travel in `twice-*` headers. Application properties
//! are the other headers; headers starting with `x-` belong to RabbitMQ and are not application
//! properties. A timestamp property keeps whole seconds only (AMQP 0-9-1 timestamps are
//! seconds); an unsigned 64-bit value above `i64::MAX` travels as a decimal string.

use lapin::BasicProperties;
use lapin::types::{AMQPValue, ByteArray, FieldTable, LongString, ShortString};
use twice::{
    Message, MessageId, ReceivedMessage, SequenceNumber, SessionId, Timestamp, TransportError,
    Value,
};

pub(crate) const SESSION_ID: &str = "twice-session-id";
pub(crate) const SUBJECT: &str = "twice-subject";
pub(crate) const TO: &str = "twice-to";
pub(crate) const REPLY_TO_SESSION_ID: &str = "twice-reply-to-session-id";
pub(crate) const PARTITION_KEY: &str = "twice-partition-key";
pub(crate) const ENQUEUED_MS: &str = "twice-enqueued-ms";
pub(crate) const DEAD_LETTER_REASON: &str = "twice-dead-letter-reason";
pub(crate) const DEAD_LETTER_DESCRIPTION: &str = "twice-dead-letter-description";
pub(crate) const DEAD_LETTER_SOURCE: &str = "twice-dead-letter-source";
pub(crate) const DELIVERY_COUNT: &str = "twice-delivery-count";
/// The deliveries of a message that ended unsettled before this copy of it was published: the
/// count the transport keeps where the broker does not (RabbitMQ 4.3 and later, classic
/// queues), carried from one copy to the next.
pub(crate) const RETURNS: &str = "twice-returns";

fn short(what: &str, s: &str) -> Result<ShortString, TransportError> {
    ShortString::try_new(s)
        .map_err(|_| TransportError::Invalid(format!("{what} {s:?} is longer than 255 bytes")))
}

fn long(s: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(s))
}

fn to_value(v: &Value) -> AMQPValue {
    match v {
        Value::Bool(b) => AMQPValue::Boolean(*b),
        Value::Ubyte(n) => AMQPValue::ShortShortUInt(*n),
        Value::Ushort(n) => AMQPValue::ShortUInt(*n),
        Value::Uint(n) => AMQPValue::LongUInt(*n),
        Value::Ulong(n) => match i64::try_from(*n) {
            Ok(n) => AMQPValue::LongLongInt(n),
            Err(_) => long(&n.to_string()),
        },
        Value::Byte(n) => AMQPValue::ShortShortInt(*n),
        Value::Short(n) => AMQPValue::ShortInt(*n),
        Value::Int(n) => AMQPValue::LongInt(*n),
        Value::Long(n) => AMQPValue::LongLongInt(*n),
        Value::Float(x) => AMQPValue::Float(*x),
        Value::Double(x) => AMQPValue::Double(*x),
        Value::Char(c) => long(&c.to_string()),
        Value::Timestamp(t) => {
            AMQPValue::Timestamp(u64::try_from(t.as_millis() / 1000).unwrap_or_default())
        }
        Value::Uuid(u) => long(&u.to_string()),
        Value::Binary(b) => AMQPValue::ByteArray(ByteArray::from(b.to_vec())),
        Value::String(s) | Value::Symbol(s) => long(s),
        // Null, and any kind added later, travels as void.
        _ => AMQPValue::Void,
    }
}

fn from_value(v: &AMQPValue) -> Option<Value> {
    Some(match v {
        AMQPValue::Boolean(b) => Value::Bool(*b),
        AMQPValue::ShortShortInt(n) => Value::Byte(*n),
        AMQPValue::ShortShortUInt(n) => Value::Ubyte(*n),
        AMQPValue::ShortInt(n) => Value::Short(*n),
        AMQPValue::ShortUInt(n) => Value::Ushort(*n),
        AMQPValue::LongInt(n) => Value::Int(*n),
        AMQPValue::LongUInt(n) => Value::Uint(*n),
        AMQPValue::LongLongInt(n) => Value::Long(*n),
        AMQPValue::Float(x) => Value::Float(*x),
        AMQPValue::Double(x) => Value::Double(*x),
        AMQPValue::ShortString(s) => Value::String(s.as_str().to_owned()),
        AMQPValue::LongString(s) => Value::String(String::from_utf8_lossy(s.as_bytes()).into()),
        AMQPValue::Timestamp(t) => Value::Timestamp(Timestamp::from_millis(
            i64::try_from(*t).unwrap_or(i64::MAX / 1000).saturating_mul(1000),
        )),
        AMQPValue::ByteArray(b) => Value::Binary(bytes::Bytes::copy_from_slice(b.as_slice())),
        AMQPValue::Void => Value::Null,
        AMQPValue::DecimalValue(_) | AMQPValue::FieldArray(_) | AMQPValue::FieldTable(_) => {
            return None;
        }
    })
}

pub(crate) fn text(v: &AMQPValue) -> Option<String> {
    match v {
        AMQPValue::ShortString(s) => Some(s.as_str().to_owned()),
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        _ => None,
    }
}

pub(crate) fn integer(v: &AMQPValue) -> Option<i64> {
    match v {
        AMQPValue::ShortShortInt(n) => Some(i64::from(*n)),
        AMQPValue::ShortShortUInt(n) => Some(i64::from(*n)),
        AMQPValue::ShortInt(n) => Some(i64::from(*n)),
        AMQPValue::ShortUInt(n) => Some(i64::from(*n)),
        AMQPValue::LongInt(n) => Some(i64::from(*n)),
        AMQPValue::LongUInt(n) => Some(i64::from(*n)),
        AMQPValue::LongLongInt(n) => Some(*n),
        _ => None,
    }
}

/// The AMQP properties of `message`, persistent, with `extra` headers added.
pub(crate) fn to_amqp(
    message: &Message,
    enqueued: Timestamp,
    extra: &[(&str, AMQPValue)],
) -> Result<BasicProperties, TransportError> {
    let mut headers = FieldTable::default();
    for (name, value) in &message.application_properties {
        headers.insert(short("property name", name)?, to_value(value));
    }
    let fields = [
        (SESSION_ID, message.session_id.as_ref().map(SessionId::as_str)),
        (SUBJECT, message.subject.as_deref()),
        (TO, message.to.as_deref()),
        (REPLY_TO_SESSION_ID, message.reply_to_session_id.as_deref()),
        (PARTITION_KEY, message.partition_key.as_deref()),
    ];
    for (name, value) in fields {
        if let Some(v) = value {
            headers.insert(name.into(), long(v));
        }
    }
    headers.insert(ENQUEUED_MS.into(), AMQPValue::LongLongInt(enqueued.as_millis()));
    for (name, value) in extra {
        headers.insert((*name).into(), value.clone());
    }
    let mut p = BasicProperties::default()
        .with_delivery_mode(2)
        .with_headers(headers)
        .with_timestamp(u64::try_from(enqueued.as_millis() / 1000).unwrap_or_default());
    if let Some(id) = &message.message_id {
        p = p.with_message_id(short("message id", id.as_str())?);
    }
    if let Some(c) = &message.correlation_id {
        p = p.with_correlation_id(short("correlation id", c)?);
    }
    if let Some(c) = &message.content_type {
        p = p.with_content_type(short("content type", c)?);
    }
    if let Some(r) = &message.reply_to {
        p = p.with_reply_to(short("reply-to", r)?);
    }
    if let Some(ttl) = message.time_to_live {
        p = p.with_expiration(ttl.as_millis().to_string().into());
    }
    Ok(p)
}

/// The message `d` carries, with the broker-set fields this transport knows. Its delivery
/// count is one more than the returns the broker counted (`x-delivery-count`) and those the
/// transport carried in [`RETURNS`].
pub(crate) fn from_amqp(d: &lapin::message::Delivery, now: Timestamp) -> ReceivedMessage {
    let p = &d.properties;
    let mut message = Message::new(d.data.clone());
    message.message_id = p.message_id().as_ref().map(|s| MessageId::new(s.as_str()));
    message.correlation_id = p.correlation_id().as_ref().map(|s| s.as_str().to_owned());
    message.content_type = p.content_type().as_ref().map(|s| s.as_str().to_owned());
    message.reply_to = p.reply_to().as_ref().map(|s| s.as_str().to_owned());
    message.time_to_live = p
        .expiration()
        .as_ref()
        .and_then(|s| s.as_str().parse().ok())
        .map(std::time::Duration::from_millis);
    let mut enqueued = p
        .timestamp()
        .and_then(|s| i64::try_from(s).ok())
        .map_or(now, |s| Timestamp::from_millis(s.saturating_mul(1000)));
    let mut returns = 0i64;
    let mut carried = 0i64;
    let mut reason = None;
    let mut description = None;
    let mut source = None;
    let mut death = None;
    if let Some(headers) = p.headers() {
        for (name, value) in headers {
            let name = name.as_str();
            match name {
                SESSION_ID => message.session_id = text(value).map(SessionId::new),
                SUBJECT => message.subject = text(value),
                TO => message.to = text(value),
                REPLY_TO_SESSION_ID => message.reply_to_session_id = text(value),
                PARTITION_KEY => message.partition_key = text(value),
                ENQUEUED_MS => {
                    if let Some(ms) = integer(value) {
                        enqueued = Timestamp::from_millis(ms);
                    }
                }
                DEAD_LETTER_REASON => reason = text(value),
                DEAD_LETTER_DESCRIPTION => description = text(value),
                DEAD_LETTER_SOURCE => source = text(value),
                // Kept for people reading the dead-letter queue with other tools.
                DELIVERY_COUNT => {}
                RETURNS => carried = integer(value).unwrap_or(0).max(0),
                "x-delivery-count" => returns = integer(value).unwrap_or(0).max(0),
                "x-death" => death = first_death(value),
                _ if name.starts_with("x-") => {}
                _ => {
                    if let Some(v) = from_value(value) {
                        message.application_properties.insert(name.to_owned(), v);
                    }
                }
            }
        }
    }
    let sequence = SequenceNumber::new(i64::try_from(d.delivery_tag).unwrap_or(i64::MAX));
    let mut r = ReceivedMessage::new(message, sequence, enqueued);
    let count = returns.saturating_add(carried).saturating_add(1);
    r.delivery_count = u32::try_from(count).unwrap_or(u32::MAX).max(1);
    if let Some(ttl) = r.message.time_to_live {
        r.expires_at = Some(enqueued + ttl);
    }
    match (reason, death) {
        (Some(reason), _) => {
            r.dead_letter_reason = Some(reason);
            r.dead_letter_error_description = description;
            r.dead_letter_source = source;
        }
        (None, Some((why, queue))) => {
            // Dead-lettered by RabbitMQ itself; its reasons in Service Bus's words.
            r.dead_letter_reason = Some(match why.as_str() {
                "delivery_limit" => crate::MAX_DELIVERY_COUNT_EXCEEDED.to_owned(),
                "expired" => twice::dead_letter_reasons::TTL_EXPIRED_EXCEPTION.to_owned(),
                _ => why.clone(),
            });
            r.dead_letter_error_description = Some(format!("RabbitMQ dead-lettered it: {why}"));
            r.dead_letter_source = queue;
        }
        (None, None) => {}
    }
    r
}

/// The reason and queue of the newest `x-death` entry.
fn first_death(v: &AMQPValue) -> Option<(String, Option<String>)> {
    let AMQPValue::FieldArray(entries) = v else { return None };
    let AMQPValue::FieldTable(entry) = entries.as_slice().first()? else { return None };
    let reason = entry.inner().get("reason").and_then(text)?;
    let queue = entry.inner().get("queue").and_then(text);
    Some((reason, queue))
}
