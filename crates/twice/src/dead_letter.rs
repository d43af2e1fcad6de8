//! The dead-letter workflow that `twice dlq` and the web console of `twice serve` share: one
//! view of a dead-lettered message, and one meaning of *resubmit*.
//!
//! **Resubmit** sends a copy of a dead-lettered message back (to its entity, or to another
//! one) and then removes the original from the dead-letter queue, only once the copy was
//! acknowledged: a failure between the two leaves the message in both places (a duplicate,
//! which an idempotent receiver absorbs), never in neither. The copy is
//! [`resubmit_copy`]: the original message with its message id, session id, body and
//! properties, without the two properties the service added on dead-lettering and without a
//! schedule; with `new_id`, under a new random message id, the old one kept in the property
//! `OriginalMessageId` (for a target whose duplicate detection would drop a copy under the old
//! id).
//!
//! ```
//! use twice::{Message, ReceivedMessage, SequenceNumber, Timestamp};
//!
//! let mut original = Message::new("hello").with_message_id("m-1");
//! original.application_properties.insert("DeadLetterReason".into(), "Poison".into());
//! let m = ReceivedMessage::new(original, SequenceNumber::new(7), Timestamp::from_millis(0));
//!
//! let view = twice::dead_letter::view_json(&m);
//! assert_eq!(view["body_preview"], "hello");
//! assert_eq!(view["body_size"], 5);
//!
//! let copy = twice::dead_letter::resubmit_copy(&m.message, false);
//! assert_eq!(copy.message_id.as_ref().map(|id| id.as_str()), Some("m-1"));
//! assert!(copy.application_properties.get("DeadLetterReason").is_none());
//! ```

use serde_json::Value as J;

use crate::export::{DEAD_LETTER_PROPERTIES, to_json};
use crate::ids::MessageId;
use crate::message::{Message, ReceivedMessage, Value};

/// How many characters of a body [`view_json`] shows.
pub const PREVIEW_CHARS: usize = 1_000;

/// `m` as the dead-letter tools show it: [`to_json`](crate::export::to_json), the body
/// replaced by `body_preview` (its first [`PREVIEW_CHARS`] characters, `…` after a cut, or
/// `<N bytes of binary>`) and `body_size` (in bytes).
pub fn view_json(m: &ReceivedMessage) -> J {
    let mut o = to_json(m);
    if let Some(map) = o.as_object_mut() {
        map.remove("body");
        map.remove("body_encoding");
        map.insert("body_preview".into(), preview(&m.message.body).into());
        map.insert("body_size".into(), m.message.body.len().into());
    }
    o
}

/// The first [`PREVIEW_CHARS`] characters of `body`, with `…` when cut; `<N bytes of binary>`
/// when it is not UTF-8.
pub fn preview(body: &[u8]) -> String {
    match std::str::from_utf8(body) {
        Ok(text) => {
            let mut p: String = text.chars().take(PREVIEW_CHARS).collect();
            if p.len() < text.len() {
                p.push('…');
            }
            p
        }
        Err(_) => format!("<{} bytes of binary>", body.len()),
    }
}

/// The copy of a dead-lettered message that a resubmit sends; see the [module docs](self).
pub fn resubmit_copy(original: &Message, new_id: bool) -> Message {
    let mut copy = original.clone();
    for p in DEAD_LETTER_PROPERTIES {
        copy.application_properties.remove(p);
    }
    copy.scheduled_enqueue_time = None;
    if new_id {
        if let Some(old) = copy.message_id.take() {
            copy.application_properties
                .insert("OriginalMessageId".into(), Value::from(old.as_str()));
        }
        let mut bytes = [0_u8; 16];
        bytes[..8].copy_from_slice(&crate::retry::random_u64().to_le_bytes());
        bytes[8..].copy_from_slice(&crate::retry::random_u64().to_le_bytes());
        let id = uuid::Builder::from_random_bytes(bytes).into_uuid();
        copy.message_id = Some(MessageId::new(id.to_string()));
    }
    copy
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{SequenceNumber, Timestamp};

    #[test]
    fn a_new_id_is_a_random_uuid_and_keeps_the_old_one() {
        let m = Message::new("x")
            .with_message_id("m-1")
            .with_scheduled_enqueue_time(Timestamp::from_millis(5));
        let a = resubmit_copy(&m, true);
        let b = resubmit_copy(&m, true);
        assert_ne!(a.message_id, b.message_id);
        let id = a.message_id.as_ref().map(MessageId::as_str).unwrap_or_default();
        assert_eq!(uuid::Uuid::parse_str(id).map(|u| u.get_version_num()), Ok(4));
        assert_eq!(a.application_properties.get("OriginalMessageId"), Some(&Value::from("m-1")));
        assert_eq!(a.scheduled_enqueue_time, None);
    }

    #[test]
    fn a_long_body_is_cut_and_a_binary_one_named() {
        let long = "é".repeat(PREVIEW_CHARS + 1);
        let m = ReceivedMessage::new(
            Message::new(long.clone()),
            SequenceNumber::new(1),
            Timestamp::from_millis(0),
        );
        let v = view_json(&m);
        assert_eq!(v["body_size"], long.len());
        assert!(v["body_preview"].as_str().is_some_and(|p| p.ends_with('…')));
        assert!(v.get("body").is_none());
        assert_eq!(preview(&[0xff, 0xfe]), "<2 bytes of binary>");
    }
}
