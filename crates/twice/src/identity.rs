//! Which id the inbox claims for a message a transport received: its identity policy.
//!
//! The claim is only as good as the id: two copies of one message must carry the same id, and
//! two different messages must never share one. Brokers that give a message no identity of
//! their own (RabbitMQ, NATS JetStream) leave it to the producer, and a producer that is not
//! twice may set none. A [`MessageIdentity`] says, per receiver, where the id comes from:
//!
//! - [`MessageIdentity::message_id`] (the default): the message id the producer set
//!   (`message-id` on RabbitMQ, `Nats-Msg-Id` on NATS);
//! - [`MessageIdentity::property`]: an application property (a header) the producer sets;
//! - [`MessageIdentity::function`]: a function of the message, such as a business key read
//!   from the body.
//!
//! A message for which the source gives no id (or an empty one) gets the policy's answer,
//! [`WhenMissing`]: dead-lettered with [`MISSING_MESSAGE_ID`](crate::dead_letter_reasons::MISSING_MESSAGE_ID)
//! and never handed to a handler (the default), or, where the user opts in with
//! [`MessageIdentity::or_content_hash`], the SHA-256 of its body, so that two publications of
//! the same body are one message. Nothing here ever derives an id from where the broker stored
//! the message: a position (a stream sequence, a delivery tag) is reused once the stream or
//! queue is made again, and a reused id completes a new message without running its handler.
//!
//! ```
//! use twice::{Message, MessageIdentity};
//!
//! // The order id in the body is the message's identity.
//! let identity = MessageIdentity::function(|m: &Message| {
//!     let order: serde_json::Value = serde_json::from_slice(&m.body).ok()?;
//!     Some(order.get("order_id")?.to_string())
//! });
//! let m = Message::new(r#"{"order_id": 42}"#);
//! assert_eq!(identity.identify(&m).unwrap().as_str(), "42");
//!
//! // No id at all: dead-lettered by default, or named by its content where the user opts in.
//! let plain = Message::new("hello");
//! assert!(MessageIdentity::message_id().identify(&plain).is_none());
//! let hashed = MessageIdentity::message_id().or_content_hash().identify(&plain).unwrap();
//! assert!(hashed.as_str().starts_with("sha256:"));
//! ```

use std::fmt;
use std::sync::Arc;

use sha2::{Digest as _, Sha256};

use crate::ids::MessageId;
use crate::message::{Message, Value};

/// A function that names a message: `None` when the message carries no usable id.
type IdFn = Arc<dyn Fn(&Message) -> Option<String> + Send + Sync>;

/// Where the id the inbox claims comes from.
#[derive(Clone)]
enum Source {
    MessageId,
    Property(String),
    Function(IdFn),
}

/// What becomes of a message whose source gives no id.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum WhenMissing {
    /// Dead-lettered with the reason `MissingMessageId`, never handed to a handler (the
    /// default): two such messages cannot be told apart.
    DeadLetter,
    /// Named `sha256:<hex of the SHA-256 of the body>`: a producer's retry of the same body is
    /// one message, and so are two different publications of the same body.
    ContentHash,
}

/// The identity policy of a receiver: where the id the inbox claims comes from, and what
/// happens to a message without one. See the [module docs](self).
#[derive(Clone)]
pub struct MessageIdentity {
    source: Source,
    missing: WhenMissing,
}

impl Default for MessageIdentity {
    fn default() -> Self {
        Self::message_id()
    }
}

impl fmt::Debug for MessageIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let source = match &self.source {
            Source::MessageId => "the message id".to_owned(),
            Source::Property(name) => format!("the property {name:?}"),
            Source::Function(_) => "a function of the message".to_owned(),
        };
        f.debug_struct("MessageIdentity")
            .field("source", &source)
            .field("missing", &self.missing)
            .finish()
    }
}

impl MessageIdentity {
    /// The message id the producer set (the default).
    pub fn message_id() -> Self {
        Self { source: Source::MessageId, missing: WhenMissing::DeadLetter }
    }

    /// The application property (header) `name`: its text, or the decimal form of an integer
    /// or the text of a UUID.
    pub fn property(name: impl Into<String>) -> Self {
        Self { source: Source::Property(name.into()), missing: WhenMissing::DeadLetter }
    }

    /// A function of the message, e.g. a business key read from the body; `None` (or an empty
    /// string) when the message has none.
    pub fn function(f: impl Fn(&Message) -> Option<String> + Send + Sync + 'static) -> Self {
        Self { source: Source::Function(Arc::new(f)), missing: WhenMissing::DeadLetter }
    }

    /// Names a message without an id by the SHA-256 of its body instead of dead-lettering it.
    #[must_use]
    pub fn or_content_hash(mut self) -> Self {
        self.missing = WhenMissing::ContentHash;
        self
    }

    /// What becomes of a message whose source gives no id.
    pub fn get_when_missing(&self) -> WhenMissing {
        self.missing
    }

    /// The id the inbox claims for `message`; `None` when it has none and the policy
    /// dead-letters it.
    pub fn identify(&self, message: &Message) -> Option<MessageId> {
        let found = match &self.source {
            Source::MessageId => message.message_id.as_ref().map(|id| id.as_str().to_owned()),
            Source::Property(name) => message.application_properties.get(name).and_then(text),
            Source::Function(f) => f(message),
        };
        match found.filter(|id| !id.is_empty()) {
            Some(id) => Some(MessageId::new(id)),
            None => match self.missing {
                WhenMissing::DeadLetter => None,
                WhenMissing::ContentHash => Some(content_hash(&message.body)),
            },
        }
    }
}

/// The id a body names itself by: `sha256:` and 64 lowercase hex digits.
pub fn content_hash(body: &[u8]) -> MessageId {
    let digest = Sha256::digest(body);
    let mut id = String::with_capacity(7 + 64);
    id.push_str("sha256:");
    for b in digest {
        id.push_str(&format!("{b:02x}"));
    }
    MessageId::new(id)
}

/// The text of a property that can name a message.
fn text(v: &Value) -> Option<String> {
    Some(match v {
        Value::String(s) | Value::Symbol(s) => s.clone(),
        Value::Ubyte(n) => n.to_string(),
        Value::Ushort(n) => n.to_string(),
        Value::Uint(n) => n.to_string(),
        Value::Ulong(n) => n.to_string(),
        Value::Byte(n) => n.to_string(),
        Value::Short(n) => n.to_string(),
        Value::Int(n) => n.to_string(),
        Value::Long(n) => n.to_string(),
        Value::Uuid(u) => u.to_string(),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_takes_the_message_id_and_dead_letters_without_one() {
        let p = MessageIdentity::default();
        assert_eq!(p.identify(&Message::new("x").with_message_id("m")), Some(MessageId::new("m")));
        assert_eq!(p.identify(&Message::new("x")), None);
        assert_eq!(p.identify(&Message::new("x").with_message_id("")), None, "empty is none");
        assert_eq!(p.get_when_missing(), WhenMissing::DeadLetter);
    }

    #[test]
    fn a_property_names_the_message_whatever_its_message_id() {
        let p = MessageIdentity::property("event-id");
        let m = Message::new("x").with_message_id("broker").with_property("event-id", "e-1");
        assert_eq!(p.identify(&m), Some(MessageId::new("e-1")));
        assert_eq!(
            p.identify(&Message::new("x").with_property("event-id", 7i64)),
            Some(MessageId::new("7"))
        );
        assert_eq!(p.identify(&Message::new("x").with_message_id("broker")), None);
    }

    #[test]
    fn the_content_hash_is_the_same_for_the_same_body_only() {
        let p = MessageIdentity::message_id().or_content_hash();
        let a = p.identify(&Message::new("same")).unwrap();
        assert_eq!(a, p.identify(&Message::new("same")).unwrap());
        assert_ne!(a, p.identify(&Message::new("other")).unwrap());
        assert_eq!(
            a.as_str(),
            "sha256:0967115f2813a3541eaef77de9d9d5773f1c0c04314b0bbfe4ff3b3b1c55b5d5"
        );
        // A message with an id keeps it.
        assert_eq!(
            p.identify(&Message::new("same").with_message_id("m")),
            Some(MessageId::new("m"))
        );
    }
}
