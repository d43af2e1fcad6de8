//! twice's messages to NATS headers and back.

use async_nats::HeaderMap;
use async_nats::jetstream;
use twice::{Message, MessageId, ReceivedMessage, SequenceNumber, SessionId, Timestamp, Value};

const MSG_ID: &str = "Nats-Msg-Id";
const SESSION_ID: &str = "Twice-Session-Id";
const CORRELATION_ID: &str = "Twice-Correlation-Id";
const SUBJECT: &str = "Twice-Subject";
const CONTENT_TYPE: &str = "Twice-Content-Type";
const TO: &str = "Twice-To";
const REPLY_TO: &str = "Twice-Reply-To";
const REPLY_TO_SESSION_ID: &str = "Twice-Reply-To-Session-Id";
const PARTITION_KEY: &str = "Twice-Partition-Key";
const TIME_TO_LIVE_MS: &str = "Twice-Time-To-Live-Ms";
pub(crate) const DEAD_LETTER_REASON: &str = "Twice-Dead-Letter-Reason";
pub(crate) const DEAD_LETTER_DESCRIPTION: &str = "Twice-Dead-Letter-Description";
pub(crate) const DEAD_LETTER_SOURCE: &str = "Twice-Dead-Letter-Source";
pub(crate) const ORIGINAL_MESSAGE_ID: &str = "Twice-Original-Message-Id";
pub(crate) const DELIVERY_COUNT: &str = "Twice-Delivery-Count";

/// The text a property travels as.
fn text(v: &Value) -> String {
    match v {
        Value::Null => String::new(),
        Value::Bool(b) => b.to_string(),
        Value::Ubyte(n) => n.to_string(),
        Value::Ushort(n) => n.to_string(),
        Value::Uint(n) => n.to_string(),
        Value::Ulong(n) => n.to_string(),
        Value::Byte(n) => n.to_string(),
        Value::Short(n) => n.to_string(),
        Value::Int(n) => n.to_string(),
        Value::Long(n) => n.to_string(),
        Value::Float(x) => x.to_string(),
        Value::Double(x) => x.to_string(),
        Value::Char(c) => c.to_string(),
        Value::Timestamp(t) => t.as_millis().to_string(),
        Value::Uuid(u) => u.to_string(),
        Value::Binary(b) => b.iter().map(|x| format!("{x:02x}")).collect(),
        Value::String(s) | Value::Symbol(s) => s.clone(),
        // A kind added later travels as its debug form rather than not at all.
        other => format!("{other:?}"),
    }
}

/// The headers of `message`, with `extra` added.
pub(crate) fn to_headers(message: &Message, extra: &[(&str, String)]) -> HeaderMap {
    let mut h = HeaderMap::new();
    if let Some(id) = &message.message_id {
        h.insert(async_nats::header::NATS_MESSAGE_ID, id.as_str());
    }
    for (name, value) in &message.application_properties {
        h.insert(name.as_str(), text(value).as_str());
    }
    let ttl = message.time_to_live.map(|d| d.as_millis().to_string());
    let fields = [
        (SESSION_ID, message.session_id.as_ref().map(SessionId::as_str)),
        (CORRELATION_ID, message.correlation_id.as_deref()),
        (SUBJECT, message.subject.as_deref()),
        (CONTENT_TYPE, message.content_type.as_deref()),
        (TO, message.to.as_deref()),
        (REPLY_TO, message.reply_to.as_deref()),
        (REPLY_TO_SESSION_ID, message.reply_to_session_id.as_deref()),
        (PARTITION_KEY, message.partition_key.as_deref()),
        (TIME_TO_LIVE_MS, ttl.as_deref()),
    ];
    for (name, value) in fields {
        if let Some(v) = value {
            h.insert(name, v);
        }
    }
    for (name, value) in extra {
        h.insert(*name, value.as_str());
    }
    h
}

/// The message of a delivery and its `num_delivered`.
pub(crate) fn from_jetstream(
    raw: &jetstream::Message,
    stream: &str,
) -> Result<(ReceivedMessage, u32), async_nats::Error> {
    let info = raw.info()?;
    let sequence = info.stream_sequence;
    let delivered = u32::try_from(info.delivered.max(1)).unwrap_or(u32::MAX);
    let published =
        i64::try_from(info.published.unix_timestamp_nanos() / 1_000_000).unwrap_or_default();
    let mut message = Message::new(raw.message.payload.clone());
    let mut reason = None;
    let mut description = None;
    let mut source = None;
    let mut original = None;
    if let Some(headers) = &raw.message.headers {
        for (name, values) in headers.iter() {
            let Some(value) = values.last().map(|v| v.as_str().to_owned()) else { continue };
            match name.as_ref() {
                MSG_ID => message.message_id = Some(MessageId::new(value)),
                SESSION_ID => message.session_id = Some(SessionId::new(value)),
                CORRELATION_ID => message.correlation_id = Some(value),
                SUBJECT => message.subject = Some(value),
                CONTENT_TYPE => message.content_type = Some(value),
                TO => message.to = Some(value),
                REPLY_TO => message.reply_to = Some(value),
                REPLY_TO_SESSION_ID => message.reply_to_session_id = Some(value),
                PARTITION_KEY => message.partition_key = Some(value),
                TIME_TO_LIVE_MS => {
                    message.time_to_live = value.parse().ok().map(std::time::Duration::from_millis);
                }
                DEAD_LETTER_REASON => reason = Some(value),
                DEAD_LETTER_DESCRIPTION => description = Some(value),
                DEAD_LETTER_SOURCE => source = Some(value),
                ORIGINAL_MESSAGE_ID => original = Some(value),
                DELIVERY_COUNT => {}
                name if name.starts_with("Nats-") => {}
                name => {
                    message.application_properties.insert(name.to_owned(), Value::String(value));
                }
            }
        }
    }
    if let Some(id) = original {
        // A dead-lettered copy shows the id its original had.
        message.message_id = Some(MessageId::new(id));
    }
    if message.message_id.as_ref().is_none_or(|id| id.as_str().is_empty()) {
        message.message_id = Some(MessageId::new(format!("{stream}:{sequence}")));
    }
    let enqueued = Timestamp::from_millis(published);
    let mut r = ReceivedMessage::new(
        message,
        SequenceNumber::new(i64::try_from(sequence).unwrap_or(i64::MAX)),
        enqueued,
    );
    r.delivery_count = delivered;
    r.expires_at = r.message.time_to_live.map(|ttl| enqueued + ttl);
    r.dead_letter_reason = reason;
    r.dead_letter_error_description = description;
    r.dead_letter_source = source;
    Ok((r, delivered))
}
