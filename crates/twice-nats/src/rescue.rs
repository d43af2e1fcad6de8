//! Moves messages that JetStream stopped delivering (`MaxDeliver` reached) to the dead-letter
//! stream, on the server's `MAX_DELIVERIES` advisory.

use async_nats::jetstream;
use futures::StreamExt as _;
use twice::TransportError;

use crate::convert;

/// The fields of the advisory this task reads.
#[derive(serde::Deserialize)]
struct DeliveryExceeded {
    stream_seq: u64,
}

/// Subscribes to the advisories of `stream`'s `consumer` and starts the task that moves their
/// messages.
pub(crate) async fn start(
    client: &async_nats::Client,
    context: jetstream::Context,
    stream: &str,
    consumer: &str,
    dead_letter_subject: &str,
) -> Result<tokio::task::AbortHandle, TransportError> {
    let subject = format!("$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{stream}.{consumer}");
    let mut advisories = client
        .subscribe(subject)
        .await
        .map_err(|e| crate::other("subscribing to advisories", e))?;
    let (stream, dead_letter_subject) = (stream.to_owned(), dead_letter_subject.to_owned());
    let task = tokio::spawn(async move {
        while let Some(advisory) = advisories.next().await {
            let Ok(a) = serde_json::from_slice::<DeliveryExceeded>(&advisory.payload) else {
                continue;
            };
            if let Err(e) = rescue(&context, &stream, &dead_letter_subject, a.stream_seq).await {
                tracing::warn!(%stream, sequence = a.stream_seq, "moving a message past MaxDeliver to the dead-letter stream failed: {e}");
            }
        }
    });
    Ok(task.abort_handle())
}

/// Copies message `sequence` of `stream` to the dead-letter stream, then deletes it.
async fn rescue(
    context: &jetstream::Context,
    stream: &str,
    dead_letter_subject: &str,
    sequence: u64,
) -> Result<(), async_nats::Error> {
    let s = context.get_stream(stream).await?;
    let Ok(raw) = s.get_raw_message(sequence).await else {
        // Gone already: acknowledged, or moved by another transport.
        return Ok(());
    };
    let mut headers = raw.headers.clone();
    let original = headers
        .get(async_nats::header::NATS_MESSAGE_ID)
        .map_or_else(|| format!("{stream}:{sequence}"), |v| v.as_str().to_owned());
    // The standard name, so that it replaces the original's header rather than adding one.
    headers.insert(async_nats::header::NATS_MESSAGE_ID, format!("{stream}:{sequence}").as_str());
    headers.insert(convert::ORIGINAL_MESSAGE_ID, original.as_str());
    headers.insert(convert::DEAD_LETTER_REASON, crate::MAX_DELIVERY_COUNT_EXCEEDED);
    headers
        .insert(convert::DEAD_LETTER_DESCRIPTION, "JetStream stopped delivering it at MaxDeliver");
    headers.insert(convert::DEAD_LETTER_SOURCE, stream);
    context
        .publish_with_headers(dead_letter_subject.to_owned(), headers, raw.payload.clone())
        .await?
        .await?;
    s.delete_message(sequence).await?;
    Ok(())
}
