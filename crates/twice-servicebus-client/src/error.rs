//! The client's errors, classified by the AMQP condition or management status the service
//! sends, never by its description text.

use twice::TransportError;
use twice_amqp::performative::AmqpError;

/// AMQP and Service Bus error conditions the client tells apart.
pub mod condition {
    use twice_amqp::servicebus::Condition;

    /// The message lock expired or the message was settled elsewhere.
    pub const MESSAGE_LOCK_LOST: &str = Condition::MessageLockLost.as_str();
    /// The session lock expired or was taken.
    pub const SESSION_LOCK_LOST: &str = Condition::SessionLockLost.as_str();
    /// Another receiver holds the session.
    pub const SESSION_CANNOT_BE_LOCKED: &str = Condition::SessionCannotBeLocked.as_str();
    /// An operation (for example accept-next-session) timed out on the service.
    pub const TIMEOUT: &str = Condition::Timeout.as_str();
    /// No message has the requested sequence number.
    pub const MESSAGE_NOT_FOUND: &str = Condition::MessageNotFound.as_str();
    /// The entity does not exist.
    pub const NOT_FOUND: &str = Condition::NotFound.as_str();
    /// The token is missing, expired or does not grant the entity.
    pub const UNAUTHORIZED: &str = Condition::UnauthorizedAccess.as_str();
    /// The service is busy; retry later.
    pub const SERVER_BUSY: &str = Condition::ServerBusy.as_str();
    /// The service closed the link or connection to move or rebalance it.
    pub const DETACH_FORCED: &str = Condition::DetachForced.as_str();
    /// The connection was closed by the service (for example on idle).
    pub const CONNECTION_FORCED: &str = Condition::ConnectionForced.as_str();
    /// An internal error of the service; retrying may succeed.
    pub const INTERNAL: &str = Condition::InternalError.as_str();
    /// A message or batch larger than the entity allows.
    pub const MESSAGE_SIZE: &str = Condition::MessageSizeExceeded.as_str();
    /// A quota (connections, links) is exhausted.
    pub const RESOURCE_LIMIT: &str = Condition::ResourceLimitExceeded.as_str();
}

/// An error from the Service Bus client.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The connection string is not one the SDKs accept.
    #[error("invalid connection string: {0}")]
    ConnectionString(String),
    /// The TCP connection could not be made.
    #[error("cannot connect to {addr}: {source}")]
    Connect {
        /// The host and port.
        addr: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// TLS could not be set up (bad certificate, bad configuration).
    #[error("tls: {0}")]
    Tls(String),
    /// The peer answered the TLS handshake with something other than TLS: it serves plain
    /// AMQP (the emulator, or `twice serve` without a certificate).
    #[error("{addr} does not speak TLS: it answered the TLS handshake with plain AMQP")]
    NotTls {
        /// The host and port.
        addr: String,
    },
    /// The peer did not speak AMQP 1.0 as expected during the handshake.
    #[error("amqp handshake failed: {0}")]
    Handshake(String),
    /// The connection was lost (or closed) while the operation was in flight; its outcome is
    /// unknown.
    #[error("the connection was lost")]
    ConnectionLost,
    /// The service closed the connection, a session or a link with this error.
    #[error("{condition}: {}", description.as_deref().unwrap_or(""))]
    Amqp {
        /// The AMQP condition symbol.
        condition: String,
        /// The service's description.
        description: Option<String>,
    },
    /// A `$management` or `$cbs` request failed with this status.
    #[error("{operation} failed with status {status} ({}): {description}", condition.as_deref().unwrap_or("no condition"))]
    Management {
        /// The operation, e.g. `com.microsoft:renew-lock`.
        operation: String,
        /// The status code (HTTP style).
        status: i32,
        /// The error condition, if the service sent one.
        condition: Option<String>,
        /// The service's description.
        description: String,
    },
    /// The token provider could not supply a token.
    #[error("token provider failed: {0}")]
    Token(String),
    /// The operation did not finish within its time limit.
    #[error("the operation timed out")]
    Timeout,
    /// The caller asked for something the client cannot do with this receiver or message.
    #[error("invalid request: {0}")]
    Invalid(String),
    /// The client was closed.
    #[error("the client is closed")]
    Closed,
}

impl Error {
    pub(crate) fn from_amqp(e: &AmqpError) -> Self {
        Error::Amqp { condition: e.condition.clone(), description: e.description.clone() }
    }

    /// The AMQP condition, if the service named one.
    pub fn condition(&self) -> Option<&str> {
        match self {
            Error::Amqp { condition, .. } => Some(condition),
            Error::Management { condition, .. } => condition.as_deref(),
            _ => None,
        }
    }

    /// Whether the message lock is lost (expired, settled elsewhere, or its link died).
    pub fn is_lock_lost(&self) -> bool {
        self.condition() == Some(condition::MESSAGE_LOCK_LOST)
            || matches!(self, Error::Management { status: 410, condition: None, .. })
    }

    /// Whether the session lock is lost.
    pub fn is_session_lock_lost(&self) -> bool {
        self.condition() == Some(condition::SESSION_LOCK_LOST)
    }

    /// Whether the entity does not exist.
    pub fn is_not_found(&self) -> bool {
        self.condition() == Some(condition::NOT_FOUND)
            || matches!(self, Error::Management { status: 404, condition: None, .. })
    }

    /// Whether no message has the requested sequence number.
    pub fn is_message_not_found(&self) -> bool {
        self.condition() == Some(condition::MESSAGE_NOT_FOUND)
    }

    /// Whether the credentials were refused.
    pub fn is_unauthorized(&self) -> bool {
        self.condition() == Some(condition::UNAUTHORIZED)
            || matches!(self, Error::Management { status: 401, .. })
    }

    /// Whether the service timed out the operation.
    pub fn is_timeout(&self) -> bool {
        matches!(self, Error::Timeout) || self.condition() == Some(condition::TIMEOUT)
    }

    /// Whether retrying the same call (after a reconnect) may succeed.
    pub fn is_transient(&self) -> bool {
        match self {
            Error::Connect { .. } | Error::ConnectionLost | Error::Timeout => true,
            Error::Amqp { condition: c, .. } | Error::Management { condition: Some(c), .. } => {
                matches!(
                    c.as_str(),
                    condition::SERVER_BUSY
                        | condition::DETACH_FORCED
                        | condition::CONNECTION_FORCED
                        | condition::INTERNAL
                        | condition::TIMEOUT
                )
            }
            Error::Management { status, .. } => *status >= 500,
            _ => false,
        }
    }
}

impl From<Error> for TransportError {
    fn from(e: Error) -> Self {
        if e.is_lock_lost() {
            return TransportError::LockLost;
        }
        if e.is_session_lock_lost() {
            return TransportError::SessionLockLost;
        }
        match e {
            Error::Closed => TransportError::Closed,
            Error::Invalid(m) => TransportError::Invalid(m),
            e if e.is_not_found() => TransportError::EntityNotFound(e.to_string()),
            e => TransportError::Other {
                message: e.to_string(),
                transient: e.is_transient(),
                source: Some(Box::new(e)),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conditions_map_to_transport_errors() {
        let lost =
            Error::Amqp { condition: condition::MESSAGE_LOCK_LOST.into(), description: None };
        assert!(matches!(TransportError::from(lost), TransportError::LockLost));
        let session = Error::Management {
            operation: "com.microsoft:renew-session-lock".into(),
            status: 410,
            condition: Some(condition::SESSION_LOCK_LOST.into()),
            description: String::new(),
        };
        assert!(matches!(TransportError::from(session), TransportError::SessionLockLost));
        let missing = Error::Amqp { condition: condition::NOT_FOUND.into(), description: None };
        assert!(matches!(TransportError::from(missing), TransportError::EntityNotFound(_)));
        assert!(TransportError::from(Error::ConnectionLost).is_transient());
        let busy = Error::Amqp { condition: condition::SERVER_BUSY.into(), description: None };
        assert!(TransportError::from(busy).is_transient());
        let denied = Error::Amqp { condition: condition::UNAUTHORIZED.into(), description: None };
        assert!(!TransportError::from(denied).is_transient());
    }
}
