//! A message as one JSON object: the line `twice data export` and `twice dlq export` write,
//! one shape for both (documented in `docs/export.md`).
//!
//! ```
//! use twice::{Message, ReceivedMessage, SequenceNumber, Timestamp};
//!
//! let m = ReceivedMessage::new(
//!     Message::new("hello").with_message_id("m-1"),
//!     SequenceNumber::new(7),
//!     Timestamp::from_millis(0),
//! );
//! let line = twice::export::to_json(&m);
//! assert_eq!(line["sequence_number"], 7);
//! assert_eq!(line["body"], "hello");
//! assert_eq!(line["body_encoding"], "utf8");
//! ```

use serde_json::{Map, Value as J};

use crate::message::{MessageState, ReceivedMessage, Value};

/// The two application properties the service adds on dead-lettering: exported as
/// `dead_letter_reason` and `dead_letter_description`, not among `properties`.
pub const DEAD_LETTER_PROPERTIES: [&str; 2] = ["DeadLetterReason", "DeadLetterErrorDescription"];

/// `m` as one JSON object. Always present: `sequence_number`, `message_id`, `enqueued_time`,
/// `delivery_count`, `state`, `properties`, `body` and `body_encoding` (`utf8`: the body is
/// the text itself; `base64`: it is not UTF-8). The other fields are there only when the
/// message has them. Times are RFC 3339 in UTC; `time_to_live_ms` is in milliseconds;
/// property values are plain JSON (binary ones in base64).
pub fn to_json(m: &ReceivedMessage) -> J {
    let msg = &m.message;
    let mut o = Map::new();
    o.insert("sequence_number".into(), m.sequence_number.get().into());
    o.insert("message_id".into(), msg.message_id.as_ref().map(|id| id.as_str().to_owned()).into());
    o.insert("enqueued_time".into(), m.enqueued_time.to_string().into());
    o.insert("delivery_count".into(), m.delivery_count.into());
    let state = match m.state {
        MessageState::Active => "active",
        MessageState::Deferred => "deferred",
        MessageState::Scheduled => "scheduled",
    };
    o.insert("state".into(), state.into());
    let mut optional = |key: &str, value: Option<J>| {
        if let Some(v) = value {
            o.insert(key.to_owned(), v);
        }
    };
    optional("expires_at", m.expires_at.map(|t| t.to_string().into()));
    optional("dead_letter_reason", m.dead_letter_reason.clone().map(J::from));
    optional("dead_letter_description", m.dead_letter_error_description.clone().map(J::from));
    optional("dead_letter_source", m.dead_letter_source.clone().map(J::from));
    optional("session_id", msg.session_id.as_ref().map(|s| s.as_str().into()));
    optional("correlation_id", msg.correlation_id.clone().map(J::from));
    optional("subject", msg.subject.clone().map(J::from));
    optional("content_type", msg.content_type.clone().map(J::from));
    optional("to", msg.to.clone().map(J::from));
    optional("reply_to", msg.reply_to.clone().map(J::from));
    optional("reply_to_session_id", msg.reply_to_session_id.clone().map(J::from));
    optional(
        "time_to_live_ms",
        msg.time_to_live.map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX).into()),
    );
    optional("scheduled_enqueue_time", msg.scheduled_enqueue_time.map(|t| t.to_string().into()));
    optional("partition_key", msg.partition_key.clone().map(J::from));
    let properties: Map<String, J> = msg
        .application_properties
        .iter()
        .filter(|(k, _)| !DEAD_LETTER_PROPERTIES.contains(&k.as_str()))
        .map(|(k, v)| (k.clone(), value_json(v)))
        .collect();
    o.insert("properties".into(), J::Object(properties));
    let (body, encoding) = match std::str::from_utf8(&msg.body) {
        Ok(text) => (text.to_owned(), "utf8"),
        Err(_) => (base64(&msg.body), "base64"),
    };
    o.insert("body".into(), body.into());
    o.insert("body_encoding".into(), encoding.into());
    J::Object(o)
}

/// A property value as plain JSON: numbers as numbers, times and UUIDs as text, binary in
/// base64.
pub fn value_json(v: &Value) -> J {
    match v {
        Value::Null => J::Null,
        Value::Bool(b) => J::Bool(*b),
        Value::Ubyte(n) => J::from(*n),
        Value::Ushort(n) => J::from(*n),
        Value::Uint(n) => J::from(*n),
        Value::Ulong(n) => J::from(*n),
        Value::Byte(n) => J::from(*n),
        Value::Short(n) => J::from(*n),
        Value::Int(n) => J::from(*n),
        Value::Long(n) => J::from(*n),
        Value::Float(f) => J::from(f64::from(*f)),
        Value::Double(f) => J::from(*f),
        Value::Char(c) => J::String(c.to_string()),
        Value::Timestamp(t) => J::String(t.to_string()),
        Value::Uuid(u) => J::String(u.to_string()),
        Value::Binary(b) => J::String(base64(b)),
        Value::String(s) | Value::Symbol(s) => J::String(s.clone()),
    }
}

/// Standard base64 with padding.
pub fn base64(data: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(data.len().div_ceil(3) * 4);
    for chunk in data.chunks(3) {
        let b = [chunk[0], chunk.get(1).copied().unwrap_or(0), chunk.get(2).copied().unwrap_or(0)];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(char::from(ALPHABET[((n >> (18 - 6 * i)) & 63) as usize]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Message, SequenceNumber, Timestamp};

    #[test]
    fn a_binary_body_is_base64_and_optional_fields_appear_only_when_set() {
        let mut msg = Message::new(vec![0xff_u8, 0x00, 0x01]).with_subject("s");
        msg.application_properties.insert("DeadLetterReason".into(), Value::from("Poison"));
        msg.application_properties.insert("n".into(), Value::Int(3));
        let mut m = ReceivedMessage::new(msg, SequenceNumber::new(1), Timestamp::from_millis(0));
        m.dead_letter_reason = Some("Poison".into());
        let o = to_json(&m);
        assert_eq!(o["body"], "/wAB");
        assert_eq!(o["body_encoding"], "base64");
        assert_eq!(o["subject"], "s");
        assert_eq!(o["dead_letter_reason"], "Poison");
        assert_eq!(o["properties"], serde_json::json!({ "n": 3 }));
        assert!(o.get("correlation_id").is_none() && o.get("expires_at").is_none());
    }

    #[test]
    fn base64_matches_the_standard() {
        assert_eq!(base64(b""), "");
        assert_eq!(base64(b"f"), "Zg==");
        assert_eq!(base64(b"fo"), "Zm8=");
        assert_eq!(base64(b"foo"), "Zm9v");
        assert_eq!(base64(b"foobar"), "Zm9vYmFy");
        assert_eq!(base64(&[0xff, 0x00, 0x80]), "/wCA");
    }
}
