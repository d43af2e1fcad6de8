//! The AMQP and Service Bus error conditions twice sends, the other `com.microsoft:` names it
//! reads and writes on links, and the errors it builds from them.
//!
//! Every condition string of the crate is written here once. A condition, once shipped, keeps
//! its meaning.

use crate::backend::BackendError;
use crate::performative::AmqpError;

pub(crate) const DECODE_ERROR: &str = "amqp:decode-error";
pub(crate) const FRAME_TOO_LARGE: &str = "amqp:connection:framing-error";
pub(crate) const NOT_FOUND: &str = "amqp:not-found";
pub(crate) const NOT_ALLOWED: &str = "amqp:not-allowed";
pub(crate) const NOT_IMPLEMENTED: &str = "amqp:not-implemented";
pub(crate) const UNAUTHORIZED: &str = "amqp:unauthorized-access";
pub(crate) const RESOURCE_LIMIT: &str = "amqp:resource-limit-exceeded";
pub(crate) const INTERNAL: &str = "amqp:internal-error";
pub(crate) const MESSAGE_SIZE: &str = "amqp:link:message-size-exceeded";
pub(crate) const LOCK_LOST: &str = "com.microsoft:message-lock-lost";
pub(crate) const SESSION_LOCK_LOST: &str = "com.microsoft:session-lock-lost";
pub(crate) const SESSION_CANNOT_BE_LOCKED: &str = "com.microsoft:session-cannot-be-locked";
pub(crate) const TIMEOUT: &str = "com.microsoft:timeout";
pub(crate) const MESSAGE_NOT_FOUND: &str = "com.microsoft:message-not-found";
pub(crate) const ARGUMENT: &str = "com.microsoft:argument-error";
pub(crate) const ALREADY_EXISTS: &str = "com.microsoft:entity-already-exists";
pub(crate) const UNATTACHED_HANDLE: &str = "amqp:session:unattached-handle";
pub(crate) const TRANSFER_LIMIT: &str = "amqp:link:transfer-limit-exceeded";
/// The server closes the connection because it is shutting down.
pub(crate) const FORCED: &str = "amqp:connection:forced";

/// The filter of a receiver link's source that names the session it locks.
pub(crate) const SESSION_FILTER: &str = "com.microsoft:session-filter";
/// The attach property with how long an accept-next-session may wait, in milliseconds (the
/// same name as the [`TIMEOUT`] condition, with another meaning).
pub(crate) const TIMEOUT_PROPERTY: &str = "com.microsoft:timeout";
/// The attach property with the time a session lock ends, in .NET ticks.
pub(crate) const LOCKED_UNTIL_UTC: &str = "com.microsoft:locked-until-utc";

/// The condition of a broker refusal.
pub(crate) fn of_backend(e: &BackendError) -> &'static str {
    match e {
        BackendError::LockLost => LOCK_LOST,
        BackendError::SessionLockLost => SESSION_LOCK_LOST,
        BackendError::SessionCannotBeLocked(_) => SESSION_CANNOT_BE_LOCKED,
        BackendError::EntityNotFound(_) => NOT_FOUND,
        BackendError::MessageNotFound(_) => MESSAGE_NOT_FOUND,
        BackendError::Invalid(_) => ARGUMENT,
        BackendError::AlreadyExists(_) => ALREADY_EXISTS,
        // The condition the SDKs turn into their quota-exceeded error.
        BackendError::QuotaExceeded(_) => RESOURCE_LIMIT,
        BackendError::MessageSizeExceeded(_) => MESSAGE_SIZE,
        BackendError::Unsupported(_) => NOT_IMPLEMENTED,
        BackendError::Unavailable(_) => INTERNAL,
        // A full disk is a quota of the namespace: the SDKs raise their quota-exceeded error,
        // with the reason in the description.
        BackendError::StorageFailed(_) => RESOURCE_LIMIT,
    }
}

/// The AMQP error for a broker refusal.
pub(crate) fn backend_error(e: &BackendError) -> AmqpError {
    AmqpError::new(of_backend(e), e.to_string())
}

/// The error for an attach the broker cannot answer because it cannot serve (its storage
/// failed): `reason` is the one `/health` gives.
pub(crate) fn unavailable(reason: &str) -> AmqpError {
    AmqpError::new(RESOURCE_LIMIT, format!("the broker cannot serve until restarted: {reason}"))
}

/// The canonical not-found error (JS matches the description's wording).
pub(crate) fn not_found(path: &str) -> AmqpError {
    AmqpError::new(
        NOT_FOUND,
        format!(
            "The messaging entity '{path}' could not be found. To know more visit https://aka.ms/sbResourceMgrExceptions."
        ),
    )
}

/// The error a lost session lock detaches its link with.
pub(crate) fn session_lock_lost() -> AmqpError {
    AmqpError::new(
        SESSION_LOCK_LOST,
        "The session lock has expired on the MessageSession. Accept a new MessageSession.",
    )
}

/// The error a link is detached with when its token expired and was not renewed.
pub(crate) fn token_expired(path: &str) -> AmqpError {
    AmqpError::new(
        UNAUTHORIZED,
        format!("the token for '{path}' has expired: put a new token to $cbs"),
    )
}
