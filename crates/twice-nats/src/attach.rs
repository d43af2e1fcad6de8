//! Connecting: the stream, its dead-letter stream and the durable consumer, made where they are
//! missing and used as they are where they exist, with a note for what is missing.

use std::time::Duration;

use async_nats::jetstream::{self, consumer::pull, stream};
use twice::{EntityInfo, TransportError};

use crate::NatsOptions;
use crate::dead_letter_stream_name;

/// What connecting found.
pub(crate) struct Attached {
    pub(crate) client: async_nats::Client,
    pub(crate) context: jetstream::Context,
    pub(crate) consumer: jetstream::consumer::PullConsumer,
    pub(crate) info: EntityInfo,
    /// The consumer's `AckWait`: the lock.
    pub(crate) ack_wait: Duration,
    /// The consumer's `MaxDeliver` (`None`: unlimited).
    pub(crate) max_deliver: Option<u32>,
    /// The stream's duplicate window.
    pub(crate) duplicate_window: Duration,
    /// The subject sends go to: the options', else the existing stream's one subject.
    pub(crate) subject: String,
    /// The dead-letter stream's subject (the main stream's transport only).
    pub(crate) dead_letter_subject: String,
    pub(crate) notes: Vec<String>,
}

/// The consumer a transport creates: explicit acks, the lock duration as `AckWait`, and no
/// `MaxDeliver` (the transport dead-letters past MaxDeliveryCount itself, so the server never
/// gives up on a message whose move failed).
pub(crate) fn consumer_config(options: &NatsOptions) -> pull::Config {
    pull::Config {
        durable_name: Some(options.consumer.clone()),
        ack_policy: jetstream::consumer::AckPolicy::Explicit,
        ack_wait: options.lock_duration,
        max_deliver: -1,
        max_ack_pending: 10_000,
        ..pull::Config::default()
    }
}

/// Connects and attaches to the stream and consumer of `options` (the dead-letter stream's own
/// when `is_dead_letter`).
pub(crate) async fn attach(
    options: &NatsOptions,
    is_dead_letter: bool,
) -> Result<Attached, TransportError> {
    let client = async_nats::ConnectOptions::new()
        .retry_on_initial_connect()
        .max_reconnects(None)
        .connection_timeout(Duration::from_secs(5))
        .connect(options.url.as_str())
        .await
        .map_err(|e| crate::other("connecting to NATS", e))?;
    let context = jetstream::new(client.clone());
    let mut notes = Vec::new();
    // JetStream refuses a duplicate window longer than the stream's `max_age`.
    let create = |name: String, subject: String, max_age: Duration| stream::Config {
        name,
        subjects: vec![subject],
        retention: stream::RetentionPolicy::WorkQueue,
        storage: stream::StorageType::File,
        duplicate_window: if max_age.is_zero() {
            options.duplicate_window
        } else {
            options.duplicate_window.min(max_age)
        },
        max_age,
        ..stream::Config::default()
    };
    let stream = if options.create {
        context
            .get_or_create_stream(create(
                options.stream.clone(),
                options.get_subject(),
                options.max_age,
            ))
            .await
            .map_err(|e| crate::other("creating the stream", e))?
    } else {
        context
            .get_stream(&options.stream)
            .await
            .map_err(|_| TransportError::EntityNotFound(options.stream.clone()))?
    };
    // A stream that exists on one subject is published to on that subject.
    let subject = options.subject.clone().unwrap_or_else(|| {
        literal_subject(&stream.cached_info().config.subjects)
            .unwrap_or_else(|| options.get_subject())
    });
    let mut dead_letter_subject =
        options.dead_letter_subject.clone().unwrap_or_else(|| format!("{subject}.dead-letter"));
    if !is_dead_letter {
        let name = dead_letter_stream_name(&options.stream);
        let made = if options.create {
            context
                .get_or_create_stream(create(
                    name.clone(),
                    dead_letter_subject.clone(),
                    Duration::ZERO,
                ))
                .await
                .map_err(|e| e.to_string())
        } else {
            context.get_stream(&name).await.map_err(|e| e.to_string())
        };
        match made {
            Ok(dl) => {
                if let Some(s) = literal_subject(&dl.cached_info().config.subjects) {
                    dead_letter_subject = s;
                }
            }
            Err(e) => {
                return Err(TransportError::Invalid(format!(
                    "the dead-letter stream {name} on subject {dead_letter_subject:?} cannot be \
                     had ({e}); if another stream takes that subject, set \
                     NatsOptions::dead_letter_subject"
                )));
            }
        }
    }
    let config = stream.cached_info().config.clone();
    if config.retention != stream::RetentionPolicy::WorkQueue {
        notes.push(format!(
            "stream {}: retention is {:?}, not WorkQueue: an acknowledged message stays in the \
             stream, and no sweep finds messages JetStream stopped delivering",
            options.stream, config.retention
        ));
    }
    let consumer: jetstream::consumer::PullConsumer = stream
        .get_or_create_consumer(&options.consumer, consumer_config(options))
        .await
        .map_err(|e| crate::other("creating the consumer", e))?;
    let consumer_config = &consumer.cached_info().config;
    if consumer_config.ack_policy != jetstream::consumer::AckPolicy::Explicit {
        return Err(TransportError::Invalid(format!(
            "consumer {} of stream {} acknowledges {:?}, not Explicit: a processor settles each \
             message itself; create a consumer with ack_policy explicit and name it with \
             NatsOptions::consumer",
            options.consumer, options.stream, consumer_config.ack_policy
        )));
    }
    let ack_wait = consumer_config.ack_wait;
    if ack_wait != options.lock_duration {
        notes.push(format!(
            "consumer {}: its AckWait is {ack_wait:?}, and that is the lock duration (the options \
             say {:?}); to change it, update the consumer's ack_wait",
            options.consumer, options.lock_duration
        ));
    }
    let max_deliver = u32::try_from(consumer_config.max_deliver).ok().filter(|n| *n > 0);
    let wanted = options.max_delivery_count;
    if let Some(n) = max_deliver
        && !is_dead_letter
        && wanted.is_none_or(|max| n <= max)
    {
        notes.push(format!(
            "consumer {}: MaxDeliver {n} stops deliveries before MaxDeliveryCount is passed; \
             such messages are moved to the dead-letter stream by the advisory listener and the \
             sweep. To leave it to the transport, update the consumer's max_deliver to -1",
            options.consumer
        ));
    }
    let mut info = EntityInfo::new(options.stream.clone());
    info.lock_duration = ack_wait;
    info.max_delivery_count = if is_dead_letter {
        None
    } else {
        match (wanted, max_deliver) {
            (Some(w), Some(n)) => Some(w.min(n)),
            (w, n) => w.or(n),
        }
    };
    // What the server has, which for a stream that existed may differ from the options.
    info.duplicate_detection_window = Some(config.duplicate_window);
    info.requires_session = false;
    // `max_age` removes a message however often it was delivered; zero keeps it forever.
    info.message_time_to_live = (!config.max_age.is_zero()).then_some(config.max_age);
    for note in &notes {
        tracing::warn!(stream = %options.stream, "{note}");
    }
    Ok(Attached {
        client,
        context,
        consumer,
        info,
        ack_wait,
        max_deliver,
        duplicate_window: config.duplicate_window,
        subject,
        dead_letter_subject,
        notes,
    })
}

/// The one subject of a stream, when it has exactly one and it has no wildcard.
fn literal_subject(subjects: &[String]) -> Option<String> {
    match subjects {
        [one] if !one.contains(['*', '>']) => Some(one.clone()),
        _ => None,
    }
}

/// The consumer again, made again if it is gone (its stream was deleted and made again);
/// `None` while the stream does not exist.
pub(crate) async fn reattach(
    context: &jetstream::Context,
    options: &NatsOptions,
) -> Result<Option<jetstream::consumer::PullConsumer>, async_nats::Error> {
    let Ok(stream) = context.get_stream(&options.stream).await else { return Ok(None) };
    Ok(Some(stream.get_or_create_consumer(&options.consumer, consumer_config(options)).await?))
}
