//! The words the engine and the public API share: how a receive takes messages, what a send
//! did, and how a locked message is settled. One definition each, so that the engine, the
//! [`Broker`](crate::Broker) handle and the Service Bus front end above it speak alike.

use twice::{DeadLetterReason, Properties, SequenceNumber};

/// How a receive takes messages.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum ReceiveMode {
    /// Lock each message for the receiver until it is settled or the lock expires (at least
    /// once).
    #[default]
    PeekLock,
    /// Remove each message as it is delivered (at most once).
    ReceiveAndDelete,
}

/// What happened to one sent message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum SendOutcome {
    /// Enqueued with this sequence number (of the queue or topic it was sent to).
    Enqueued(SequenceNumber),
    /// Its message id was accepted within the duplicate-detection window: acknowledged as a
    /// success and dropped.
    Duplicate,
}

impl SendOutcome {
    /// The sequence number, unless the message was a duplicate.
    pub fn sequence_number(&self) -> Option<SequenceNumber> {
        match self {
            SendOutcome::Enqueued(s) => Some(*s),
            SendOutcome::Duplicate => None,
        }
    }
}

/// How a locked message is settled ([`Broker::settle_in`](crate::Broker::settle_in)).
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum Settlement {
    /// Done: remove it.
    Complete,
    /// Unlock it for redelivery, counting a delivery, after merging these properties into its
    /// application properties.
    Abandon(Properties),
    /// Set it aside, receivable only by sequence number, after merging these properties.
    Defer(Properties),
    /// Move it to the dead-letter queue with a reason and a description (empty strings are
    /// left unset), after merging these properties.
    DeadLetter(DeadLetterReason, Properties),
    /// Unlock it without counting a delivery (it never reached a handler).
    Release,
}
