//! The AMQP and Service Bus error conditions, and the other `com.microsoft:` names links and
//! requests carry.

/// An error condition twice's server sends or its client tells apart.
///
/// A condition, once shipped, keeps its meaning; a new meaning is a new variant.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Condition {
    /// `amqp:decode-error`: bytes that do not decode.
    DecodeError,
    /// `amqp:connection:framing-error`: a frame beyond the announced size.
    FramingError,
    /// `amqp:connection:forced`: the peer closed the connection (shutdown, idle).
    ConnectionForced,
    /// `amqp:link:detach-forced`: the service detached the link to move or rebalance it.
    DetachForced,
    /// `amqp:not-found`: the entity does not exist.
    NotFound,
    /// `amqp:not-allowed`.
    NotAllowed,
    /// `amqp:not-implemented`.
    NotImplemented,
    /// `amqp:unauthorized-access`: the token is missing, expired or does not grant this.
    UnauthorizedAccess,
    /// `amqp:resource-limit-exceeded`: a quota is exhausted.
    ResourceLimitExceeded,
    /// `amqp:internal-error`: retrying may succeed.
    InternalError,
    /// `amqp:link:message-size-exceeded`.
    MessageSizeExceeded,
    /// `amqp:session:unattached-handle`: a frame on a handle that is not attached.
    UnattachedHandle,
    /// `amqp:link:transfer-limit-exceeded`: a transfer beyond the link credit.
    TransferLimitExceeded,
    /// `com.microsoft:message-lock-lost`: the lock expired or the message was settled.
    MessageLockLost,
    /// `com.microsoft:session-lock-lost`.
    SessionLockLost,
    /// `com.microsoft:session-cannot-be-locked`: another receiver holds the session.
    SessionCannotBeLocked,
    /// `com.microsoft:timeout`: an operation timed out on the service.
    Timeout,
    /// `com.microsoft:message-not-found`: no message has the sequence number.
    MessageNotFound,
    /// `com.microsoft:argument-error`: a bad request.
    ArgumentError,
    /// `com.microsoft:entity-already-exists`.
    EntityAlreadyExists,
    /// `com.microsoft:server-busy`: retry later.
    ServerBusy,
    /// `com.microsoft:dead-letter`: the error of a `rejected` outcome that dead-letters.
    DeadLetter,
}

impl Condition {
    /// Every condition, for tables and tests.
    pub const ALL: &'static [Condition] = &[
        Condition::DecodeError,
        Condition::FramingError,
        Condition::ConnectionForced,
        Condition::DetachForced,
        Condition::NotFound,
        Condition::NotAllowed,
        Condition::NotImplemented,
        Condition::UnauthorizedAccess,
        Condition::ResourceLimitExceeded,
        Condition::InternalError,
        Condition::MessageSizeExceeded,
        Condition::UnattachedHandle,
        Condition::TransferLimitExceeded,
        Condition::MessageLockLost,
        Condition::SessionLockLost,
        Condition::SessionCannotBeLocked,
        Condition::Timeout,
        Condition::MessageNotFound,
        Condition::ArgumentError,
        Condition::EntityAlreadyExists,
        Condition::ServerBusy,
        Condition::DeadLetter,
    ];

    /// The symbol on the wire.
    pub const fn as_str(self) -> &'static str {
        match self {
            Condition::DecodeError => "amqp:decode-error",
            Condition::FramingError => "amqp:connection:framing-error",
            Condition::ConnectionForced => "amqp:connection:forced",
            Condition::DetachForced => "amqp:link:detach-forced",
            Condition::NotFound => "amqp:not-found",
            Condition::NotAllowed => "amqp:not-allowed",
            Condition::NotImplemented => "amqp:not-implemented",
            Condition::UnauthorizedAccess => "amqp:unauthorized-access",
            Condition::ResourceLimitExceeded => "amqp:resource-limit-exceeded",
            Condition::InternalError => "amqp:internal-error",
            Condition::MessageSizeExceeded => "amqp:link:message-size-exceeded",
            Condition::UnattachedHandle => "amqp:session:unattached-handle",
            Condition::TransferLimitExceeded => "amqp:link:transfer-limit-exceeded",
            Condition::MessageLockLost => "com.microsoft:message-lock-lost",
            Condition::SessionLockLost => "com.microsoft:session-lock-lost",
            Condition::SessionCannotBeLocked => "com.microsoft:session-cannot-be-locked",
            Condition::Timeout => "com.microsoft:timeout",
            Condition::MessageNotFound => "com.microsoft:message-not-found",
            Condition::ArgumentError => "com.microsoft:argument-error",
            Condition::EntityAlreadyExists => "com.microsoft:entity-already-exists",
            Condition::ServerBusy => "com.microsoft:server-busy",
            Condition::DeadLetter => "com.microsoft:dead-letter",
        }
    }

    /// The condition a symbol names, if it is one of these.
    pub fn parse(symbol: &str) -> Option<Self> {
        Self::ALL.iter().copied().find(|c| c.as_str() == symbol)
    }
}

impl std::fmt::Display for Condition {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl From<Condition> for String {
    fn from(c: Condition) -> Self {
        c.as_str().to_owned()
    }
}

impl PartialEq<Condition> for str {
    fn eq(&self, other: &Condition) -> bool {
        self == other.as_str()
    }
}

impl PartialEq<Condition> for String {
    fn eq(&self, other: &Condition) -> bool {
        self.as_str() == other.as_str()
    }
}

/// The filter of a receiver link's source that names the session it locks.
pub const SESSION_FILTER: &str = "com.microsoft:session-filter";
/// The attach property with how long an accept-next-session may wait, in milliseconds (the
/// same name as the [`Condition::Timeout`] condition, with another meaning).
pub const TIMEOUT_PROPERTY: &str = "com.microsoft:timeout";
/// The attach property with the time a session lock ends, in .NET ticks.
pub const LOCKED_UNTIL_UTC: &str = "com.microsoft:locked-until-utc";
/// The request property with how long the client waits for a `$management` reply, in
/// milliseconds.
pub const SERVER_TIMEOUT: &str = "com.microsoft:server-timeout";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_condition_parses_back_and_no_two_share_a_symbol() {
        let mut seen = std::collections::HashSet::new();
        for c in Condition::ALL {
            assert_eq!(Condition::parse(c.as_str()), Some(*c));
            assert!(seen.insert(c.as_str()), "{c} twice");
        }
        assert_eq!(Condition::parse("amqp:no-such-thing"), None);
        assert!(*"amqp:not-found" == Condition::NotFound);
        assert_eq!(String::from(Condition::Timeout), "com.microsoft:timeout");
        let owned = String::from("com.microsoft:timeout");
        assert!(owned == Condition::Timeout);
    }
}
