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

/// A stored message read back: the message (its id the producer's `Nats-Msg-Id`, or for a
/// dead-lettered copy the id its original had; `None` when there is none), the dead-letter
/// fields of a copy, and the `Nats-Msg-Id` the stored message carries.
pub(crate) struct Parsed {
    pub(crate) message: Message,
    pub(crate) reason: Option<String>,
    pub(crate) description: Option<String>,
    pub(crate) source: Option<String>,
    /// The `Nats-Msg-Id` the stored message carries (for a dead-lettered copy: the id of its
    /// move).
    pub(crate) stored_id: Option<String>,
}

/// The message stored with `headers` and `payload`.
pub(crate) fn from_parts(headers: Option<&HeaderMap>, payload: bytes::Bytes) -> Parsed {
    let mut message = Message::new(payload);
    let (mut reason, mut description, mut source, mut original, mut stored_id) =
        (None, None, None, None, None);
    for (name, values) in headers.into_iter().flat_map(HeaderMap::iter) {
        let Some(value) = values.last().map(|v| v.as_str().to_owned()) else { continue };
        match name.as_ref() {
            MSG_ID => stored_id = Some(value),
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
    // A dead-lettered copy shows the id its original had; any other message the producer's.
    let id = if reason.is_some() { original } else { stored_id.clone() };
    message.message_id = id.filter(|id| !id.is_empty()).map(MessageId::new);
    Parsed { message, reason, description, source, stored_id }
}

/// A delivery read back: [`Parsed`] as a received message, `num_delivered`, and when the
/// stream stored it.
pub(crate) struct Received {
    pub(crate) message: ReceivedMessage,
    pub(crate) delivered: u32,
    pub(crate) stored_id: Option<String>,
    /// When the stream stored it, in nanoseconds since the Unix epoch.
    pub(crate) stored_at_nanos: i128,
}

/// The message of a delivery, as [`Received`] describes it.
pub(crate) fn from_jetstream(raw: &jetstream::Message) -> Result<Received, async_nats::Error> {
    let info = raw.info()?;
    let sequence = info.stream_sequence;
    let delivered = u32::try_from(info.delivered.max(1)).unwrap_or(u32::MAX);
    let stored_at_nanos = info.published.unix_timestamp_nanos();
    let published = i64::try_from(stored_at_nanos / 1_000_000).unwrap_or_default();
    let parsed = from_parts(raw.message.headers.as_ref(), raw.message.payload.clone());
    let enqueued = Timestamp::from_millis(published);
    let mut r = ReceivedMessage::new(
        parsed.message,
        SequenceNumber::new(i64::try_from(sequence).unwrap_or(i64::MAX)),
        enqueued,
    );
    r.delivery_count = delivered;
    r.expires_at = r.message.time_to_live.map(|ttl| enqueued + ttl);
    r.dead_letter_reason = parsed.reason;
    r.dead_letter_error_description = parsed.description;
    r.dead_letter_source = parsed.source;
    Ok(Received { message: r, delivered, stored_id: parsed.stored_id, stored_at_nanos })
}

/// The `Nats-Msg-Id` of the dead-letter copy of message `sequence` of `stream`, stored at
/// `stored_at_nanos`: the same for every attempt to move that message (so the dead-letter
/// stream drops a retried move), and different for any other message, also one at the same
/// sequence of a stream made again.
pub(crate) fn dead_letter_copy_id(stream: &str, sequence: u64, stored_at_nanos: i128) -> String {
    format!("{stream}:{sequence}:{stored_at_nanos}")
}
