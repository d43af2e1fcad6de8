//! Messages: what a sender sends and what a receiver gets.
//!
//! The model follows Azure Service Bus, whose property names and semantics RabbitMQ and NATS
//! JetStream transports map onto.

use std::collections::BTreeMap;
use std::time::Duration;

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::clock::Timestamp;
use crate::ids::{LockToken, MessageId, SequenceNumber, SessionId};

/// The value of an application property: the AMQP 1.0 primitive types, so that a property sent
/// over AMQP comes back with the type it was sent with.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub enum Value {
    /// No value.
    Null,
    /// A boolean.
    Bool(bool),
    /// An unsigned 8-bit integer.
    Ubyte(u8),
    /// An unsigned 16-bit integer.
    Ushort(u16),
    /// An unsigned 32-bit integer.
    Uint(u32),
    /// An unsigned 64-bit integer.
    Ulong(u64),
    /// A signed 8-bit integer.
    Byte(i8),
    /// A signed 16-bit integer.
    Short(i16),
    /// A signed 32-bit integer.
    Int(i32),
    /// A signed 64-bit integer.
    Long(i64),
    /// A 32-bit float.
    Float(f32),
    /// A 64-bit float.
    Double(f64),
    /// A Unicode scalar value.
    Char(char),
    /// A point in time.
    Timestamp(crate::clock::Timestamp),
    /// A UUID.
    Uuid(Uuid),
    /// Bytes.
    Binary(Bytes),
    /// A UTF-8 string.
    String(String),
    /// An AMQP symbol (ASCII).
    Symbol(String),
}

impl Value {
    /// The string inside a `String` or `Symbol`, if this is one.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) | Value::Symbol(s) => Some(s),
            _ => None,
        }
    }
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

impl From<i64> for Value {
    fn from(n: i64) -> Self {
        Value::Long(n)
    }
}

impl From<i32> for Value {
    fn from(n: i32) -> Self {
        Value::Int(n)
    }
}

impl From<bool> for Value {
    fn from(b: bool) -> Self {
        Value::Bool(b)
    }
}

impl From<f64> for Value {
    fn from(x: f64) -> Self {
        Value::Double(x)
    }
}

/// Application properties: user-defined headers, by name.
pub type Properties = BTreeMap<String, Value>;

/// A message to send.
///
/// Build one with [`Message::new`] and the `with_*` methods; every field is public to read and
/// change.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Message {
    /// The sender's id for the message; the broker assigns a random one when it is `None`.
    pub message_id: Option<MessageId>,
    /// The session the message belongs to (required on session-enabled entities).
    pub session_id: Option<SessionId>,
    /// Correlation id, for request/reply and filters.
    pub correlation_id: Option<String>,
    /// Subject (Service Bus `Label`).
    pub subject: Option<String>,
    /// MIME content type of the body.
    pub content_type: Option<String>,
    /// Address of the intended destination.
    pub to: Option<String>,
    /// Address to reply to.
    pub reply_to: Option<String>,
    /// Session to reply to.
    pub reply_to_session_id: Option<String>,
    /// How long the message lives after it is enqueued; capped by the entity's default.
    pub time_to_live: Option<Duration>,
    /// When the message becomes visible to receivers; `None` is at once.
    pub scheduled_enqueue_time: Option<Timestamp>,
    /// Partition key (kept and returned; twice does not partition).
    pub partition_key: Option<String>,
    /// User-defined properties.
    pub application_properties: Properties,
    /// The body bytes.
    pub body: Bytes,
}

impl Message {
    /// A message with this body and nothing else set.
    pub fn new(body: impl Into<Bytes>) -> Self {
        Self { body: body.into(), ..Self::default() }
    }

    /// Sets the message id.
    #[must_use]
    pub fn with_message_id(mut self, id: impl Into<MessageId>) -> Self {
        self.message_id = Some(id.into());
        self
    }

    /// Sets the session id.
    #[must_use]
    pub fn with_session_id(mut self, id: impl Into<SessionId>) -> Self {
        self.session_id = Some(id.into());
        self
    }

    /// Sets the correlation id.
    #[must_use]
    pub fn with_correlation_id(mut self, id: impl Into<String>) -> Self {
        self.correlation_id = Some(id.into());
        self
    }

    /// Sets the subject.
    #[must_use]
    pub fn with_subject(mut self, subject: impl Into<String>) -> Self {
        self.subject = Some(subject.into());
        self
    }

    /// Sets the content type.
    #[must_use]
    pub fn with_content_type(mut self, content_type: impl Into<String>) -> Self {
        self.content_type = Some(content_type.into());
        self
    }

    /// Sets the `To` address.
    #[must_use]
    pub fn with_to(mut self, to: impl Into<String>) -> Self {
        self.to = Some(to.into());
        self
    }

    /// Sets the reply-to address.
    #[must_use]
    pub fn with_reply_to(mut self, reply_to: impl Into<String>) -> Self {
        self.reply_to = Some(reply_to.into());
        self
    }

    /// Sets the reply-to session id.
    #[must_use]
    pub fn with_reply_to_session_id(mut self, id: impl Into<String>) -> Self {
        self.reply_to_session_id = Some(id.into());
        self
    }

    /// Sets the time to live.
    #[must_use]
    pub fn with_time_to_live(mut self, ttl: Duration) -> Self {
        self.time_to_live = Some(ttl);
        self
    }

    /// Sets the scheduled enqueue time.
    #[must_use]
    pub fn with_scheduled_enqueue_time(mut self, at: Timestamp) -> Self {
        self.scheduled_enqueue_time = Some(at);
        self
    }

    /// Sets the partition key.
    #[must_use]
    pub fn with_partition_key(mut self, key: impl Into<String>) -> Self {
        self.partition_key = Some(key.into());
        self
    }

    /// Adds an application property.
    #[must_use]
    pub fn with_property(mut self, name: impl Into<String>, value: impl Into<Value>) -> Self {
        self.application_properties.insert(name.into(), value.into());
        self
    }
}

/// Where a message stands in its entity.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
pub enum MessageState {
    /// Available to receivers (or locked by one).
    #[default]
    Active,
    /// Set aside by its receiver; receivable only by sequence number.
    Deferred,
    /// Waiting for its scheduled enqueue time.
    Scheduled,
}

/// A message as a receiver gets it: the sent message plus what the broker recorded.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct ReceivedMessage {
    /// The message as sent (its `message_id` is always set: the broker assigns one).
    pub message: Message,
    /// The number the entity gave this message; unique and increasing within the entity.
    pub sequence_number: SequenceNumber,
    /// When the message entered the entity.
    pub enqueued_time: Timestamp,
    /// When the message expires (enqueued time + time to live), if it does.
    pub expires_at: Option<Timestamp>,
    /// The lock of this delivery; `None` when received without a lock (receive-and-delete,
    /// peek).
    pub lock_token: Option<LockToken>,
    /// Until when the lock holds, if there is one.
    pub locked_until: Option<Timestamp>,
    /// Which delivery this is: 1 on the first delivery, raised by every abandon and every lock
    /// that expired. (The Service Bus AMQP header carries this minus one.)
    pub delivery_count: u32,
    /// Active, deferred or scheduled.
    pub state: MessageState,
    /// For a dead-lettered message, the entity it was dead-lettered from, when forwarded.
    pub dead_letter_source: Option<String>,
    /// For a dead-lettered message, why.
    pub dead_letter_reason: Option<String>,
    /// For a dead-lettered message, the details.
    pub dead_letter_error_description: Option<String>,
}

impl ReceivedMessage {
    /// A received message with these broker-set fields; the rest start empty (no lock, first
    /// delivery, active).
    pub fn new(
        message: Message,
        sequence_number: SequenceNumber,
        enqueued_time: Timestamp,
    ) -> Self {
        Self {
            message,
            sequence_number,
            enqueued_time,
            expires_at: None,
            lock_token: None,
            locked_until: None,
            delivery_count: 1,
            state: MessageState::Active,
            dead_letter_source: None,
            dead_letter_reason: None,
            dead_letter_error_description: None,
        }
    }

    /// The message id (always present on a received message).
    pub fn message_id(&self) -> &MessageId {
        static EMPTY: std::sync::OnceLock<MessageId> = std::sync::OnceLock::new();
        self.message.message_id.as_ref().unwrap_or_else(|| EMPTY.get_or_init(|| MessageId::new("")))
    }

    /// The body bytes.
    pub fn body(&self) -> &Bytes {
        &self.message.body
    }
}

impl AsRef<ReceivedMessage> for ReceivedMessage {
    fn as_ref(&self) -> &ReceivedMessage {
        self
    }
}
