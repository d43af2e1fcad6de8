//! What a handler decides about a message.

use crate::transport::DeadLetterReason;

/// The decision a handler returns for one message.
///
/// Only [`Outcome::Complete`] commits the handler's transaction (and with it the claim on the
/// message id). Every other outcome rolls the transaction back before the message is settled,
/// so the claim is released and a later delivery of the same message (a retry after
/// [`Outcome::Abandon`], a deferred message received again, a dead-lettered message resubmitted)
/// is processed instead of being mistaken for a duplicate.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Outcome {
    /// The work is done: commit, then complete the message.
    Complete,
    /// Try again later: roll back, then abandon the message (its delivery count rises; after
    /// MaxDeliveryCount the broker dead-letters it).
    Abandon,
    /// The message can never succeed: roll back, then move it to the dead-letter queue.
    DeadLetter {
        /// A short machine-readable reason, e.g. `InvalidOrder`.
        reason: String,
        /// A human-readable description.
        description: String,
    },
    /// Set the message aside: roll back, then defer it (receivable later by sequence number).
    Defer,
}

impl Outcome {
    /// A [`Outcome::DeadLetter`] with this reason and description.
    pub fn dead_letter(reason: impl Into<String>, description: impl Into<String>) -> Self {
        Self::DeadLetter { reason: reason.into(), description: description.into() }
    }

    /// The dead-letter reason, for [`Outcome::DeadLetter`].
    pub(crate) fn dead_letter_reason(&self) -> Option<DeadLetterReason> {
        match self {
            Self::DeadLetter { reason, description } => {
                Some(DeadLetterReason::new(reason.clone(), description.clone()))
            }
            _ => None,
        }
    }
}
