//! The AMQP and Service Bus error conditions twice sends, the other `com.microsoft:` names it
//! reads and writes on links, and the errors it builds from them.
//!
//! The names are `twice_amqp::servicebus`'s, which the client shares; this module gives the
//! server's short names for them and builds its errors. A condition, once shipped, keeps its
//! meaning.

use twice_amqp::servicebus::Condition;

use crate::backend::BackendError;
use crate::performative::AmqpError;

pub(crate) use twice_amqp::servicebus::{LOCKED_UNTIL_UTC, SESSION_FILTER, TIMEOUT_PROPERTY};

pub(crate) const DECODE_ERROR: &str = Condition::DecodeError.as_str();
pub(crate) const FRAME_TOO_LARGE: &str = Condition::FramingError.as_str();
pub(crate) const NOT_FOUND: &str = Condition::NotFound.as_str();
pub(crate) const NOT_ALLOWED: &str = Condition::NotAllowed.as_str();
pub(crate) const NOT_IMPLEMENTED: &str = Condition::NotImplemented.as_str();
pub(crate) const UNAUTHORIZED: &str = Condition::UnauthorizedAccess.as_str();
pub(crate) const RESOURCE_LIMIT: &str = Condition::ResourceLimitExceeded.as_str();
pub(crate) const MESSAGE_SIZE: &str = Condition::MessageSizeExceeded.as_str();
pub(crate) const LOCK_LOST: &str = Condition::MessageLockLost.as_str();
pub(crate) const SESSION_LOCK_LOST: &str = Condition::SessionLockLost.as_str();
pub(crate) const TIMEOUT: &str = Condition::Timeout.as_str();
pub(crate) const UNATTACHED_HANDLE: &str = Condition::UnattachedHandle.as_str();
pub(crate) const TRANSFER_LIMIT: &str = Condition::TransferLimitExceeded.as_str();
/// The server closes the connection because it is shutting down.
pub(crate) const FORCED: &str = Condition::ConnectionForced.as_str();

/// The condition of a broker refusal.
pub(crate) fn of_backend(e: &BackendError) -> Condition {
    match e {
        BackendError::LockLost => Condition::MessageLockLost,
        BackendError::SessionLockLost => Condition::SessionLockLost,
        BackendError::SessionCannotBeLocked(_) => Condition::SessionCannotBeLocked,
        BackendError::EntityNotFound(_) => Condition::NotFound,
        BackendError::MessageNotFound(_) => Condition::MessageNotFound,
        BackendError::Invalid(_) => Condition::ArgumentError,
        BackendError::AlreadyExists(_) => Condition::EntityAlreadyExists,
        // The condition the SDKs turn into their quota-exceeded error.
        BackendError::QuotaExceeded(_) => Condition::ResourceLimitExceeded,
        BackendError::MessageSizeExceeded(_) => Condition::MessageSizeExceeded,
        BackendError::Unsupported(_) => Condition::NotImplemented,
        BackendError::Unavailable(_) => Condition::InternalError,
        // A full disk is a quota of the namespace: the SDKs raise their quota-exceeded error,
        // with the reason in the description.
        BackendError::StorageFailed(_) => Condition::ResourceLimitExceeded,
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
