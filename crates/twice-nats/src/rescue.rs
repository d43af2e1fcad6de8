//! Moves messages that JetStream stopped delivering to the dead-letter stream.
//!
//! A consumer this transport creates has no `MaxDeliver`: JetStream never gives up on a
//! message, and the transport moves it when its delivery count passes MaxDeliveryCount. A
//! consumer that exists with a `MaxDeliver` (made by hand, or by an earlier version of this
//! transport) stops delivering a message at that count and leaves it in the stream, where no
//! consumer will ever see it again. Two things find such a message:
//!
//! - the server's `MAX_DELIVERIES` advisory, which arrives only while a transport is connected
//!   (advisories are core NATS messages: one sent while nobody listens is gone);
//! - a sweep, on connect and then every lock duration: in a work-queue stream an acknowledged
//!   message is deleted, so with one consumer a message still stored is one it gave up on when
//!   it is at or below the consumer's acknowledgement floor, or when it was delivered and no
//!   delivery waits for an acknowledgement (one sent back with `-NAK` waits until it is
//!   delivered again). The sweep takes the stream's first message while that holds, and moves
//!   it after seeing it so twice (an acknowledged message may be read in the instant between
//!   the floor moving and its delete). A stream with more than one consumer is not swept:
//!   whose message it is cannot be told.

use std::time::Duration;

use futures::StreamExt as _;
use twice::{DeadLetterReason, MessageIdentity, TransportError};

use crate::convert;
use crate::dead_letter::{DeadLetters, Original};

/// The fields of the advisory this task reads.
#[derive(serde::Deserialize)]
struct DeliveryExceeded {
    stream_seq: u64,
}

/// What the task needs to find and move messages.
pub(crate) struct Rescue {
    pub(crate) dead_letters: DeadLetters,
    pub(crate) consumer: String,
    pub(crate) identity: MessageIdentity,
    /// How often the stream is swept.
    pub(crate) every: Duration,
    pub(crate) clock: twice::SharedClock,
}

/// Subscribes to the advisories of the stream's consumer and starts the task that moves their
/// messages and sweeps the stream.
pub(crate) async fn start(
    client: &async_nats::Client,
    rescue: Rescue,
) -> Result<tokio::task::AbortHandle, TransportError> {
    let subject = format!(
        "$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{}.{}",
        rescue.dead_letters.source, rescue.consumer
    );
    let mut advisories = client
        .subscribe(subject)
        .await
        .map_err(|e| crate::other("subscribing to advisories", e))?;
    let task = tokio::spawn(async move {
        let stream = &rescue.dead_letters.source;
        loop {
            if let Err(e) = rescue.sweep().await {
                tracing::warn!(%stream, "sweeping for messages JetStream stopped delivering failed: {e}");
            }
            let next = rescue.clock.sleep(rescue.every);
            tokio::pin!(next);
            loop {
                tokio::select! {
                    () = &mut next => break,
                    advisory = advisories.next() => {
                        let Some(advisory) = advisory else { return };
                        let Ok(a) = serde_json::from_slice::<DeliveryExceeded>(&advisory.payload)
                        else {
                            continue;
                        };
                        if let Err(e) = rescue.rescue(a.stream_seq).await {
                            tracing::warn!(%stream, sequence = a.stream_seq, "moving a message past MaxDeliver to the dead-letter stream failed (the next sweep tries again): {e}");
                        }
                    }
                }
            }
        }
    });
    Ok(task.abort_handle())
}

impl Rescue {
    /// Moves every message the consumer has given up on, oldest first.
    async fn sweep(&self) -> Result<(), async_nats::Error> {
        let context = &self.dead_letters.context;
        let mut stream = context.get_stream(&self.dead_letters.source).await?;
        // Bounded, so one sweep cannot run forever on a stream that keeps failing.
        for _ in 0..10_000 {
            let state = stream.info().await?.state.clone();
            if state.consumer_count != 1 || state.messages == 0 {
                return Ok(());
            }
            let first = state.first_sequence;
            if !self.given_up(&stream, first).await? {
                return Ok(());
            }
            // Still there, and still given up on, after another round trip: stranded.
            if stream.get_raw_message(first).await.is_err()
                || !self.given_up(&stream, first).await?
            {
                continue;
            }
            self.rescue(first).await?;
        }
        Ok(())
    }

    /// Whether the consumer is done with message `sequence` while the stream still holds it:
    /// it is at or below the acknowledgement floor, or it was delivered and nothing is waiting
    /// for an acknowledgement (a message sent back with `-NAK` waits for one until it is
    /// delivered again).
    async fn given_up(
        &self,
        stream: &async_nats::jetstream::stream::Stream,
        sequence: u64,
    ) -> Result<bool, async_nats::Error> {
        let c = stream.consumer_info(&self.consumer).await?;
        Ok(sequence <= c.ack_floor.stream_sequence
            || (c.num_ack_pending == 0 && sequence <= c.delivered.stream_sequence))
    }

    /// Copies message `sequence` to the dead-letter stream, then deletes it.
    async fn rescue(&self, sequence: u64) -> Result<(), async_nats::Error> {
        let s = self.dead_letters.context.get_stream(&self.dead_letters.source).await?;
        let Ok(raw) = s.get_raw_message(sequence).await else {
            // Gone already: acknowledged, or moved by another transport.
            return Ok(());
        };
        let mut parsed = convert::from_parts(Some(&raw.headers), raw.payload.clone());
        parsed.message.message_id = self.identity.identify(&parsed.message);
        let original = Original {
            message: &parsed.message,
            sequence,
            stored_at_nanos: raw.time.unix_timestamp_nanos(),
            delivery_count: None,
        };
        let reason = DeadLetterReason::new(
            crate::MAX_DELIVERY_COUNT_EXCEEDED,
            "JetStream stopped delivering it at the consumer's MaxDeliver",
        );
        self.dead_letters.store_copy(&original, &reason).await?;
        s.delete_message(sequence).await?;
        Ok(())
    }
}
