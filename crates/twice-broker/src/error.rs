//! The broker's error type.

use std::path::PathBuf;

use twice::TransportError;

/// An error from the broker.
///
/// A call that fails with an error changed nothing, except where a variant says otherwise.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// No entity has this path.
    #[error("messaging entity {0:?} not found")]
    EntityNotFound(String),
    /// An entity with this path exists already.
    #[error("messaging entity {0:?} already exists")]
    EntityAlreadyExists(String),
    /// The path is not a valid entity name.
    #[error("invalid entity name {name:?}: {reason}")]
    InvalidEntityName {
        /// The rejected name.
        name: String,
        /// Which rule it breaks.
        reason: &'static str,
    },
    /// An entity property is out of its range or otherwise invalid.
    #[error("invalid property {property}: {reason}")]
    InvalidProperty {
        /// The Service Bus name of the property, e.g. `LockDuration`.
        property: &'static str,
        /// Why it is rejected.
        reason: String,
    },
    /// The property can only be chosen when the entity is created.
    #[error("{property} of {entity:?} cannot be changed after the entity is created")]
    ImmutableProperty {
        /// The entity path.
        entity: String,
        /// The Service Bus name of the property.
        property: &'static str,
    },
    /// The feature exists in Service Bus but not (yet) in this broker.
    #[error("{0} are not supported yet")]
    NotSupported(&'static str),
    /// The lock token is unknown or its lock expired: the message may be with another receiver.
    #[error("the lock on the message was lost (it expired, or the message was settled already)")]
    MessageLockLost,
    /// The session lock is unknown or expired.
    #[error("the session lock was lost")]
    SessionLockLost,
    /// Another receiver holds the session.
    #[error("session {0:?} is locked by another receiver")]
    SessionCannotBeLocked(String),
    /// A message sent to a session-enabled entity has no session id.
    #[error("entity {0:?} requires sessions: the message must have a session id")]
    SessionIdRequired(String),
    /// A receive without a session on a session-enabled entity.
    #[error("entity {0:?} requires sessions: accept a session to receive")]
    SessionRequired(String),
    /// A session operation on an entity without sessions.
    #[error("entity {0:?} does not use sessions")]
    SessionsNotEnabled(String),
    /// No message with this sequence number is in the state the call needs.
    #[error("message with sequence number {0} not found")]
    MessageNotFound(i64),
    /// The message (or a batch) is larger than the broker accepts.
    #[error("message size of {size} bytes exceeds the limit of {limit} bytes")]
    MessageSizeExceeded {
        /// The size of the rejected message or batch.
        size: usize,
        /// The limit.
        limit: usize,
    },
    /// The entity holds its `MaxSizeInMegabytes`: the send would take it past that, so
    /// nothing of it was accepted. It is accepted again once receivers take messages out. The
    /// AMQP front end answers it with `com.microsoft:quota-exceeded`.
    #[error(
        "messaging entity {entity:?} is full: {size} bytes held and {adding} more sent, \
         past its MaxSizeInMegabytes of {max_size_in_megabytes}"
    )]
    QuotaExceeded {
        /// The queue or topic.
        entity: String,
        /// The bytes it holds (each message counted with its headers; a topic counts every
        /// subscription's copies, and dead-letter queues count for their entity).
        size: u64,
        /// The bytes of the rejected send.
        adding: u64,
        /// Its `MaxSizeInMegabytes`.
        max_size_in_megabytes: u64,
    },
    /// The namespace, topic or subscription holds as many queues and topics, subscriptions
    /// or rules as it may: the entity or rule was not created. The front end answers it as
    /// Service Bus answers a quota exceeded (`amqp:resource-limit-exceeded`, HTTP 403).
    #[error(
        "cannot create {path:?}: {holder} holds {held} {what}, its limit of {limit} (raise it \
         with BrokerOptions::{option}, or twice serve --{flag})",
        flag = .option.replace('_', "-")
    )]
    LimitExceeded {
        /// The entity or rule that was refused.
        path: String,
        /// What is full: `the namespace`, `topic "t"`, `subscription "t/Subscriptions/s"`.
        holder: String,
        /// How many it holds.
        held: usize,
        /// What it holds: `queues and topics`, `subscriptions`, `rules`.
        what: &'static str,
        /// The cap.
        limit: usize,
        /// The [`crate::BrokerOptions`] setting of the cap.
        option: &'static str,
    },
    /// An argument is out of range (a count of zero, a batch with too many messages...).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The operation does not apply to this entity or message (sending to a subscription,
    /// dead-lettering a dead-lettered message...).
    #[error("invalid operation: {0}")]
    InvalidOperation(String),
    /// A configuration file is invalid; `path` says where (e.g.
    /// `UserConfig.Namespaces[0].Queues[2].Properties.LockDuration`).
    #[error("{path}: {message}")]
    Config {
        /// The JSON path of the offending value.
        path: String,
        /// What is wrong with it.
        message: String,
    },
    /// A configuration file could not be read.
    #[error("cannot read {path}: {source}")]
    ConfigIo {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The stored state is inconsistent (a record that does not fit what came before it).
    #[error("corrupt broker state: {0}")]
    Corrupt(String),
    /// Reading or writing the broker's data failed.
    #[error("broker storage error: {0}")]
    Io(#[from] std::io::Error),
    /// The broker is shut down.
    #[error("the broker is closed")]
    Closed,
    /// A log record is damaged where a crash cannot have torn it (in a closed segment, or in a
    /// commit of the newest one that a later commit shows was durable): acknowledged data is
    /// damaged, so the broker refuses to open rather than skip it. `twice data check` shows the
    /// damage; `twice data repair --truncate-at SEGMENT:OFFSET` cuts the log there.
    #[error("corrupt log record in segment {segment} at byte offset {offset}")]
    CorruptLog {
        /// The segment id (the number in the segment's file name).
        segment: u64,
        /// The byte offset of the damaged record in the segment file.
        offset: u64,
    },
    /// A log segment between the oldest and the newest is missing from the data directory:
    /// the records it held are gone, so the broker refuses to open rather than skip them.
    #[error("log segment {segment} is missing from the data directory")]
    MissingSegment {
        /// The id of the missing segment (the number its file name would carry).
        segment: u64,
    },
    /// Another broker (in this or another process) has the data directory open.
    #[error("the data directory {0} is already in use by another broker")]
    DirectoryInUse(PathBuf),
}

impl Error {
    /// Whether the error means the message lock or session lock is gone.
    pub fn is_lock_lost(&self) -> bool {
        matches!(self, Self::MessageLockLost | Self::SessionLockLost)
    }

    /// Whether the error means the entity is full (see [`Error::QuotaExceeded`]): the same
    /// send may succeed later, once receivers have taken messages out.
    pub fn is_quota_exceeded(&self) -> bool {
        matches!(self, Self::QuotaExceeded { .. })
    }

    /// Whether the error means a cap on entities, subscriptions or rules was reached (see
    /// [`Error::LimitExceeded`]).
    pub fn is_limit_exceeded(&self) -> bool {
        matches!(self, Self::LimitExceeded { .. })
    }

    /// Whether the error means an entity or message does not exist.
    pub fn is_not_found(&self) -> bool {
        matches!(self, Self::EntityNotFound(_) | Self::MessageNotFound(_))
    }
}

impl From<Error> for TransportError {
    fn from(e: Error) -> Self {
        match e {
            Error::MessageLockLost => TransportError::LockLost,
            Error::SessionLockLost => TransportError::SessionLockLost,
            Error::EntityNotFound(path) => TransportError::EntityNotFound(path),
            Error::NotSupported(what) => TransportError::Unsupported(what),
            Error::Closed => TransportError::Closed,
            Error::Io(source) => TransportError::Other {
                message: "broker storage error".to_owned(),
                transient: false,
                source: Some(Box::new(source)),
            },
            e @ Error::QuotaExceeded { .. } => TransportError::Other {
                message: e.to_string(),
                transient: true,
                source: Some(Box::new(e)),
            },
            other => TransportError::Invalid(other.to_string()),
        }
    }
}
