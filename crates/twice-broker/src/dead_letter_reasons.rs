//! The reasons the broker gives the messages it dead-letters itself, as the
//! `DeadLetterReason` application property carries them. The names are Service Bus's, so a
//! client written for Service Bus recognises them; once shipped, a reason never changes.
//!
//! | constant | when |
//! |---|---|
//! | [`MAX_DELIVERY_COUNT_EXCEEDED`] | the next delivery would exceed the entity's `MaxDeliveryCount` |
//! | [`TTL_EXPIRED_EXCEPTION`] | the message expired in an entity with `DeadLetteringOnMessageExpiration` |
//! | [`MAX_TRANSFER_HOP_COUNT_EXCEEDED`] | auto-forwarding would take the message over its hop limit |
//! | [`SESSION_ID_IS_NULL`] | a message without a session id reached a session-enabled subscription or forwarding target |

/// The next delivery would exceed the entity's `MaxDeliveryCount`.
pub const MAX_DELIVERY_COUNT_EXCEEDED: &str = "MaxDeliveryCountExceeded";

/// The message expired in an entity with `DeadLetteringOnMessageExpiration`.
pub const TTL_EXPIRED_EXCEPTION: &str = "TTLExpiredException";

/// Auto-forwarding would take the message over its hop limit.
pub const MAX_TRANSFER_HOP_COUNT_EXCEEDED: &str = "MaxTransferHopCountExceeded";

/// A message without a session id reached a session-enabled subscription or forwarding target.
pub const SESSION_ID_IS_NULL: &str = "Session ID is null";

/// Every reason above.
pub const ALL: [&str; 4] = [
    MAX_DELIVERY_COUNT_EXCEEDED,
    TTL_EXPIRED_EXCEPTION,
    MAX_TRANSFER_HOP_COUNT_EXCEEDED,
    SESSION_ID_IS_NULL,
];
