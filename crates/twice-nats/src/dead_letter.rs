//! Copies of messages on their way to the dead-letter stream.
//!
//! A move is two steps: store a copy in the dead-letter stream, then end the original (`+TERM`
//! for a delivery, a delete for a message JetStream stopped delivering). The copy's
//! `Nats-Msg-Id` names the original's place in its stream *and the moment it was stored there*
//! ([`convert::dead_letter_copy_id`]): a move tried again is dropped by the dead-letter stream's
//! duplicate window (so a message moved twice is stored once), while a different message, also
//! one at the same sequence of a stream made again, can never be taken for it.

use async_nats::jetstream;
use twice::{DeadLetterReason, Message, MessageId, TransportError};

use crate::convert;

/// Where copies go, and the stream they come from.
#[derive(Clone, Debug)]
pub(crate) struct DeadLetters {
    pub(crate) context: jetstream::Context,
    /// The subject of the dead-letter stream.
    pub(crate) subject: String,
    /// The stream the originals are in.
    pub(crate) source: String,
}

/// The original a copy is made of.
pub(crate) struct Original<'a> {
    /// The message, its id the one the inbox would claim (`None` when it has none).
    pub(crate) message: &'a Message,
    pub(crate) sequence: u64,
    pub(crate) stored_at_nanos: i128,
    pub(crate) delivery_count: Option<u32>,
}

impl DeadLetters {
    /// Stores a copy of `original` in the dead-letter stream, with `reason`; `Ok` once the
    /// stream has it (or had it: a move tried again).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe in effect: a copy stored by a call that was dropped is dropped as a
    /// duplicate when the move is tried again.
    pub(crate) async fn store_copy(
        &self,
        original: &Original<'_>,
        reason: &DeadLetterReason,
    ) -> Result<(), TransportError> {
        let mut copy = original.message.clone();
        let copy_id =
            convert::dead_letter_copy_id(&self.source, original.sequence, original.stored_at_nanos);
        copy.message_id = Some(MessageId::new(copy_id));
        let mut extra = vec![
            (convert::DEAD_LETTER_REASON, reason.reason.clone()),
            (convert::DEAD_LETTER_DESCRIPTION, reason.description.clone()),
            (convert::DEAD_LETTER_SOURCE, self.source.clone()),
        ];
        if let Some(id) = &original.message.message_id {
            extra.push((convert::ORIGINAL_MESSAGE_ID, id.as_str().to_owned()));
        }
        if let Some(n) = original.delivery_count {
            extra.push((convert::DELIVERY_COUNT, n.to_string()));
        }
        let headers = convert::to_headers(&copy, &extra);
        let ack = self
            .context
            .publish_with_headers(self.subject.clone(), headers, copy.body.clone())
            .await
            .map_err(|e| crate::other("publishing to the dead-letter stream", e))?
            .await
            .map_err(|e| crate::other("waiting for the dead-letter stream's acknowledgement", e))?;
        if ack.duplicate {
            tracing::debug!(stream = %self.source, sequence = original.sequence, "the dead-letter stream already had this copy: a move tried again");
        }
        Ok(())
    }
}
