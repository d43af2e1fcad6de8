//! Newtypes for the identifiers a broker hands out or a sender chooses.

use std::fmt;

use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// The id a sender gives a message; the key of duplicate detection and of the inbox claim.
///
/// Senders should choose it from the business identity of the message (say, the order id plus
/// the event type), so that a retried send carries the same id.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct MessageId(String);

impl MessageId {
    /// Wraps a string as a message id.
    pub fn new(id: impl Into<String>) -> Self {
        Self(id.into())
    }

    /// A new random id (32 lowercase hex digits, as Service Bus assigns them).
    pub fn random() -> Self {
        Self(Uuid::new_v4().simple().to_string())
    }

    /// A new time-ordered id (a version 7 UUID, 32 lowercase hex digits): ids made later sort
    /// later, so an inbox keyed on them inserts at the end of its index instead of at random
    /// places (on a large PostgreSQL table random keys write several times the WAL).
    pub fn time_ordered() -> Self {
        Self(Uuid::now_v7().simple().to_string())
    }

    /// The id as a string slice.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Consumes the id, returning its string.
    pub fn into_string(self) -> String {
        self.0
    }
}

impl fmt::Debug for MessageId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.0, f)
    }
}

impl fmt::Display for MessageId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<&str> for MessageId {
    fn from(s: &str) -> Self {
        Self(s.to_owned())
    }
}

impl From<String> for MessageId {
    fn from(s: String) -> Self {
        Self(s)
    }
}

/// The id of a session: messages with the same session id are delivered in order, to one
/// receiver at a time.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct SessionId(String);

impl SessionId {
    /// Wraps a string as a session id.
    pub fn new(id: impl Into<String>) -> Self {
        Self(id.into())
    }

    /// The id as a string slice.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for SessionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.0, f)
    }
}

impl fmt::Display for SessionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<&str> for SessionId {
    fn from(s: &str) -> Self {
        Self(s.to_owned())
    }
}

impl From<String> for SessionId {
    fn from(s: String) -> Self {
        Self(s)
    }
}

/// The number a broker gives a message when it enters an entity: unique and increasing within
/// that entity, never reused.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, Default,
)]
#[serde(transparent)]
pub struct SequenceNumber(i64);

impl SequenceNumber {
    /// Wraps a raw sequence number.
    pub const fn new(n: i64) -> Self {
        Self(n)
    }

    /// The raw number.
    pub const fn get(self) -> i64 {
        self.0
    }

    /// The next number.
    #[must_use]
    pub const fn next(self) -> Self {
        Self(self.0 + 1)
    }
}

impl fmt::Display for SequenceNumber {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

/// The token of one peek-lock delivery: settling a message names it by this token.
///
/// A new token is issued for every delivery, so a receiver whose lock expired cannot settle the
/// copy another receiver now holds.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct LockToken(Uuid);

impl LockToken {
    /// Wraps a UUID as a lock token.
    pub const fn from_uuid(uuid: Uuid) -> Self {
        Self(uuid)
    }

    /// A new random token.
    pub fn random() -> Self {
        Self(Uuid::new_v4())
    }

    /// The token as a UUID.
    pub const fn as_uuid(&self) -> &Uuid {
        &self.0
    }
}

impl fmt::Debug for LockToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

impl fmt::Display for LockToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}
