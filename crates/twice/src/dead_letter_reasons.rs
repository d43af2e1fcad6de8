//! Every dead-letter reason twice gives, in one table, as the `DeadLetterReason` application
//! property carries it. Where Service Bus has the case, the name is Service Bus's, so a client
//! or a dashboard written for Service Bus recognises it; once shipped, a reason never changes.
//!
//! Given by a broker (the embedded broker, and the RabbitMQ and NATS transports in Service
//! Bus's words for what their servers do):
//!
//! | constant | when |
//! |---|---|
//! | [`MAX_DELIVERY_COUNT_EXCEEDED`] | the next delivery would exceed the entity's `MaxDeliveryCount` |
//! | [`TTL_EXPIRED_EXCEPTION`] | the message expired in an entity with `DeadLetteringOnMessageExpiration` |
//! | [`MAX_TRANSFER_HOP_COUNT_EXCEEDED`] | auto-forwarding would take the message over its hop limit |
//! | [`SESSION_ID_IS_NULL`] | a message without a session id reached a session-enabled subscription or forwarding target |
//!
//! Given by the processor:
//!
//! | constant | when |
//! |---|---|
//! | [`HANDLER_FAILED`] | a permanent handler error that names no reason of its own |
//! | [`MISSING_MESSAGE_ID`] | the message has no message id (or an empty one) |
//! | [`DESERIALIZATION_FAILED`] | a JSON handler's body does not parse |
//! | [`OUTBOX_NOT_CONFIGURED`] | the handler sent through `ctx.send`, and the inbox store has no outbox |
//! | [`INVALID_OUTGOING_MESSAGE`] | the handler sent a message with a destination or field out of range |

/// The next delivery would exceed the entity's `MaxDeliveryCount`.
pub const MAX_DELIVERY_COUNT_EXCEEDED: &str = "MaxDeliveryCountExceeded";

/// The message expired in an entity with `DeadLetteringOnMessageExpiration`.
pub const TTL_EXPIRED_EXCEPTION: &str = "TTLExpiredException";

/// Auto-forwarding would take the message over its hop limit.
pub const MAX_TRANSFER_HOP_COUNT_EXCEEDED: &str = "MaxTransferHopCountExceeded";

/// A message without a session id reached a session-enabled subscription or forwarding target.
pub const SESSION_ID_IS_NULL: &str = "Session ID is null";

/// A permanent error that names no reason of its own.
pub const HANDLER_FAILED: &str = "HandlerFailed";

/// A message that arrived without a message id (or with an empty one): it is never processed,
/// because it cannot be told apart from other id-less messages.
pub const MISSING_MESSAGE_ID: &str = "MissingMessageId";

/// A message whose body does not deserialize.
pub const DESERIALIZATION_FAILED: &str = "DeserializationFailed";

/// The handler sent a message through its context's outbox, and the inbox store has none: no
/// retry can help until the store is given one.
pub const OUTBOX_NOT_CONFIGURED: &str = "OutboxNotConfigured";

/// The handler sent a message whose destination, id or session id is out of range.
pub const INVALID_OUTGOING_MESSAGE: &str = "InvalidOutgoingMessage";

/// The reasons a broker gives.
pub const BROKER: [&str; 4] = [
    MAX_DELIVERY_COUNT_EXCEEDED,
    TTL_EXPIRED_EXCEPTION,
    MAX_TRANSFER_HOP_COUNT_EXCEEDED,
    SESSION_ID_IS_NULL,
];

/// The reasons the processor gives.
pub const PROCESSOR: [&str; 5] = [
    HANDLER_FAILED,
    MISSING_MESSAGE_ID,
    DESERIALIZATION_FAILED,
    OUTBOX_NOT_CONFIGURED,
    INVALID_OUTGOING_MESSAGE,
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_two_reasons_are_the_same() {
        let mut all: Vec<&str> = BROKER.iter().chain(&PROCESSOR).copied().collect();
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), BROKER.len() + PROCESSOR.len());
    }
}
