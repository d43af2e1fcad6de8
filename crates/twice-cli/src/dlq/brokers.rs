//! `twice dlq` on RabbitMQ (`amqp://…`) and NATS JetStream (`nats://…`): the same commands,
//! output and safety rules as on Service Bus, through the twice transports.
//!
//! - **Entities.** On RabbitMQ an entity is a queue, its dead-letter queue
//!   `<queue>.dead-letter`; on NATS a stream, its dead-letter stream `<STREAM>_DEAD_LETTER`.
//!   Nothing is created: a missing queue or stream is an error.
//! - **Counts.** NATS lists its streams. RabbitMQ cannot list its queues over AMQP: `list` and
//!   `watch` there read the queue named with `--entity`.
//! - **Peeking.** NATS reads a stream without taking anything. RabbitMQ has no peek: `show`
//!   and `export` take the messages and put them back at once (`basic.nack` with requeue), which
//!   raises their delivery count in the dead-letter queue, where no limit applies.
//! - **Resubmit.** Each chosen message's copy is sent to the entity (or `--to`) and the
//!   dead-lettered message is removed only once the copy is confirmed (RabbitMQ) or stored
//!   (NATS): a failure between the two leaves it in both places, never in neither. On NATS a
//!   copy the target stream drops as a duplicate (its id seen inside the duplicate window)
//!   leaves the message dead-lettered, with a warning, unless `--new-id`. A message without an
//!   id stays too unless `--new-id`: its copy would be dead-lettered again. RabbitMQ gives
//!   messages no stable sequence number, so `--sequence` is NATS's only.

use std::io::{IsTerminal as _, Write as _};
use std::time::Duration;

use anyhow::{Context as _, anyhow, bail};
use twice::{Delivery as _, Message, MessageId, Receive as _, ReceivedMessage};
use twice_nats::{NatsOptions, NatsTransport, dead_letter_stream_name};
use twice_rabbitmq::{RabbitMqOptions, RabbitMqTransport, dead_letter_queue_name};

use super::admin::EntityCounts;
use super::{DlqArgs, DlqCommand, ResubmitArgs, progress, properties_json, to_json};

/// How long a receive waits for the next message before the queue counts as drained.
const DRAIN_WAIT: Duration = Duration::from_secs(1);
/// The longest the tool holds a message it took: longer than any run of it.
const HOLD: Duration = Duration::from_secs(30 * 60);

/// A broker other than Service Bus, named by `--connection-string`.
#[derive(Clone, Debug)]
pub(super) enum Broker {
    /// RabbitMQ at this `amqp://` URI.
    RabbitMq(String),
    /// NATS at this `nats://` URL.
    Nats(String),
}

impl Broker {
    /// The broker `--connection-string` (or the variable) names, when it is not Service Bus.
    pub(super) fn of(args: &DlqArgs) -> Option<Self> {
        let s = args
            .connection_string
            .clone()
            .or_else(|| std::env::var(super::CONNECTION_STRING_VAR).ok())?;
        if s.starts_with("amqp://") || s.starts_with("amqps://") {
            Some(Self::RabbitMq(s))
        } else if s.starts_with("nats://") {
            Some(Self::Nats(s))
        } else {
            None
        }
    }

    /// The entity a name means, without its dead-letter suffix.
    fn base<'a>(&self, entity: &'a str) -> &'a str {
        match self {
            Self::RabbitMq(_) => entity.strip_suffix(".dead-letter").unwrap_or(entity),
            Self::Nats(_) => entity.strip_suffix("_DEAD_LETTER").unwrap_or(entity),
        }
    }

    /// The name of the entity's dead-letter queue or stream.
    fn dead_letters(&self, entity: &str) -> String {
        match self {
            Self::RabbitMq(_) => dead_letter_queue_name(entity),
            Self::Nats(_) => dead_letter_stream_name(entity),
        }
    }
}

/// A queue or stream and its dead-letter one, opened without creating anything.
enum Opened {
    RabbitMq { main: RabbitMqTransport, dead: RabbitMqTransport },
    Nats { main: NatsTransport, dead: NatsTransport },
}

/// A transport error as one line a user can act on.
fn explain(e: twice::TransportError, broker: &Broker, entity: &str) -> anyhow::Error {
    match (e, broker) {
        (twice::TransportError::EntityNotFound(name), Broker::RabbitMq(_)) => {
            anyhow!("no queue '{name}' on the RabbitMQ server")
        }
        (twice::TransportError::EntityNotFound(name), Broker::Nats(_)) => {
            anyhow!("no stream '{name}' on the NATS server")
        }
        (e, _) => anyhow!("{entity}: {e}"),
    }
}

impl Opened {
    /// Opens `entity`, taking up to `take` messages at once from its dead-letter queue.
    async fn open(broker: &Broker, entity: &str, take: usize) -> anyhow::Result<Self> {
        Ok(match broker {
            Broker::RabbitMq(uri) => {
                let options = RabbitMqOptions::new(uri.as_str(), entity)
                    .declare(false)
                    .lock_duration(HOLD)
                    .prefetch(u16::try_from(take.max(1)).unwrap_or(u16::MAX));
                let main = RabbitMqTransport::connect(options)
                    .await
                    .map_err(|e| explain(e, broker, entity))?;
                let dead =
                    main.dead_letter_receiver().await.map_err(|e| explain(e, broker, entity))?;
                Self::RabbitMq { main, dead }
            }
            Broker::Nats(url) => {
                let options =
                    NatsOptions::new(url.as_str(), entity).create(false).lock_duration(HOLD);
                let main = NatsTransport::connect(options)
                    .await
                    .map_err(|e| explain(e, broker, entity))?;
                let dead =
                    main.dead_letter_receiver().await.map_err(|e| explain(e, broker, entity))?;
                Self::Nats { main, dead }
            }
        })
    }

    /// How many messages wait in the dead-letter queue.
    async fn dead_count(&self) -> anyhow::Result<u64> {
        Ok(match self {
            Self::RabbitMq { dead, .. } => dead.ready_count().await?,
            Self::Nats { dead, .. } => dead.message_count().await?,
        })
    }

    /// Up to `max` dead-lettered messages, oldest first, nothing taken for good: NATS reads
    /// the stream; RabbitMQ takes them and puts them back.
    async fn peek(&self, max: usize) -> anyhow::Result<Vec<ReceivedMessage>> {
        match self {
            Self::Nats { dead, .. } => Ok(dead.peek(None, max).await?),
            Self::RabbitMq { dead, .. } => {
                let taken = take_rabbit(dead, max).await?;
                let shown =
                    taken.iter().map(|d| with_original_id(d.message(), d.original_message_id()));
                let shown: Vec<_> = shown.collect();
                for d in &taken {
                    let _ = twice::Transport::release(dead, d).await;
                }
                Ok(shown)
            }
        }
    }
}

/// The message as it came, under the id it came with (RabbitMQ shows a message without one
/// under a random id).
fn with_original_id(m: &ReceivedMessage, original: Option<&MessageId>) -> ReceivedMessage {
    let mut m = m.clone();
    m.message.message_id = original.cloned();
    m
}

/// Takes up to `max` deliveries of a RabbitMQ queue, waiting [`DRAIN_WAIT`] for more.
async fn take_rabbit(
    t: &RabbitMqTransport,
    max: usize,
) -> anyhow::Result<Vec<twice_rabbitmq::RabbitMqDelivery>> {
    let mut out = Vec::new();
    while out.len() < max {
        let got = t.receive(max - out.len(), DRAIN_WAIT).await?;
        if got.is_empty() {
            break;
        }
        out.extend(got);
    }
    Ok(out)
}

/// Runs a `twice dlq` command other than `watch` on `broker`.
pub(super) async fn run(broker: &Broker, command: &DlqCommand) -> anyhow::Result<()> {
    match command {
        DlqCommand::List { entity, json } => list(broker, entity.as_deref(), *json).await,
        DlqCommand::Show { entity, max, json } => {
            show(broker, broker.base(entity), *max, *json).await
        }
        DlqCommand::Export { entity, output } => {
            export(broker, broker.base(entity), output.as_deref()).await
        }
        DlqCommand::Resubmit(r) => resubmit(broker, r).await,
        DlqCommand::Purge { entity, yes } => purge(broker, broker.base(entity), *yes).await,
        DlqCommand::Watch(_) => bail!("twice dlq watch on a broker is watch::watch_broker"),
    }
}

/// The counts of the entities `filter` chooses: on NATS every stream whose name contains it,
/// on RabbitMQ the one queue it names.
pub(super) async fn counts(
    broker: &Broker,
    filter: Option<&str>,
) -> anyhow::Result<Vec<EntityCounts>> {
    match broker {
        Broker::Nats(url) => {
            let all = twice_nats::stream_counts(url).await?;
            let filter = filter.map(str::to_ascii_lowercase);
            let dead: std::collections::BTreeMap<&str, u64> =
                all.iter().map(|(n, c)| (n.as_str(), *c)).collect();
            Ok(all
                .iter()
                .filter(|(name, _)| !name.ends_with("_DEAD_LETTER"))
                .filter(|(name, _)| {
                    filter.as_ref().is_none_or(|f| name.to_ascii_lowercase().contains(f))
                })
                .map(|(name, active)| EntityCounts {
                    path: name.clone(),
                    active: *active,
                    dead_letter: dead
                        .get(dead_letter_stream_name(name).as_str())
                        .copied()
                        .unwrap_or(0),
                    ..EntityCounts::default()
                })
                .collect())
        }
        Broker::RabbitMq(_) => {
            let Some(queue) = filter else {
                bail!(
                    "RabbitMQ cannot list its queues over AMQP: name the queue with --entity QUEUE"
                );
            };
            let queue = broker.base(queue);
            let opened = Opened::open(broker, queue, 1).await?;
            let Opened::RabbitMq { main, dead } = &opened else {
                bail!("'{queue}' is not a RabbitMQ queue");
            };
            Ok(vec![EntityCounts {
                path: queue.to_owned(),
                active: main.ready_count().await?,
                dead_letter: dead.ready_count().await?,
                ..EntityCounts::default()
            }])
        }
    }
}

async fn list(broker: &Broker, filter: Option<&str>, json: bool) -> anyhow::Result<()> {
    let shown = counts(broker, filter).await?;
    let mut out = std::io::stdout().lock();
    if json {
        for c in &shown {
            let line = serde_json::json!({
                "entity": c.path,
                "active": c.active,
                "dead_lettered": c.dead_letter,
                "scheduled": c.scheduled,
                "deferred": c.deferred,
            });
            writeln!(out, "{line}")?;
        }
        return Ok(());
    }
    let width = shown.iter().map(|c| c.path.len()).max().unwrap_or(0).max("ENTITY".len());
    writeln!(
        out,
        "{:width$}  {:>8}  {:>13}  {:>9}  {:>8}",
        "ENTITY", "ACTIVE", "DEAD-LETTERED", "SCHEDULED", "DEFERRED"
    )?;
    for c in &shown {
        writeln!(
            out,
            "{:width$}  {:>8}  {:>13}  {:>9}  {:>8}",
            c.path, c.active, c.dead_letter, c.scheduled, c.deferred
        )?;
    }
    if shown.is_empty() {
        let what = match broker {
            Broker::Nats(_) => "stream",
            Broker::RabbitMq(_) => "queue",
        };
        writeln!(out, "(no {what}{})", if filter.is_some() { " matches" } else { "" })?;
    }
    Ok(())
}

async fn show(broker: &Broker, entity: &str, max: usize, json: bool) -> anyhow::Result<()> {
    let opened = Opened::open(broker, entity, max).await?;
    let path = broker.dead_letters(entity);
    let bar = progress(None, "peeking");
    let messages = opened.peek(max).await?;
    bar.finish_and_clear();
    let mut out = std::io::stdout().lock();
    if json {
        for m in &messages {
            writeln!(out, "{}", to_json(m, false))?;
        }
        return Ok(());
    }
    if messages.is_empty() {
        writeln!(out, "{path}: empty")?;
        return Ok(());
    }
    writeln!(out, "{path}: {} message(s) shown (at most {max})", messages.len())?;
    for m in &messages {
        writeln!(
            out,
            "#{}  id={}  reason={}  deliveries={}  enqueued={}",
            m.sequence_number,
            m.message.message_id.as_ref().map_or("-", MessageId::as_str),
            m.dead_letter_reason.as_deref().unwrap_or("-"),
            m.delivery_count,
            m.enqueued_time
        )?;
        if let Some(d) = m.dead_letter_error_description.as_deref() {
            writeln!(out, "    description: {d}")?;
        }
        let props = properties_json(m, true);
        if props.as_object().is_some_and(|p| !p.is_empty()) {
            writeln!(out, "    properties: {props}")?;
        }
        writeln!(out, "    body: {}", twice::dead_letter::preview(&m.message.body))?;
    }
    Ok(())
}

async fn export(
    broker: &Broker,
    entity: &str,
    output: Option<&std::path::Path>,
) -> anyhow::Result<()> {
    let count = Opened::open(broker, entity, 1).await?.dead_count().await?;
    let take = usize::try_from(count).unwrap_or(usize::MAX);
    let opened = Opened::open(broker, entity, take).await?;
    let path = broker.dead_letters(entity);
    let mut out: Box<dyn std::io::Write> = match output {
        Some(p) => Box::new(std::io::BufWriter::new(
            std::fs::File::create(p).with_context(|| format!("creating {}", p.display()))?,
        )),
        None => Box::new(std::io::stdout().lock()),
    };
    let bar = progress(None, "exporting");
    let messages = opened.peek(take).await?;
    for m in &messages {
        writeln!(out, "{}", to_json(m, true))?;
    }
    out.flush()?;
    bar.finish_and_clear();
    if let Some(p) = output {
        println!("exported {} message(s) of {path} to {}", messages.len(), p.display());
    }
    Ok(())
}

/// What happened to one chosen message.
enum Outcome {
    /// Its copy is stored and it was removed.
    Moved,
    /// It stays dead-lettered, with the warning given.
    Kept,
    /// Its copy is stored but it could not be removed: it is in both places.
    Both,
}

async fn resubmit(broker: &Broker, args: &ResubmitArgs) -> anyhow::Result<()> {
    let entity = broker.base(&args.entity);
    if matches!(broker, Broker::RabbitMq(_)) && !args.sequence.is_empty() {
        bail!(
            "RabbitMQ gives messages no stable sequence number: choose with --reason, --property, --older-than or --all"
        );
    }
    let target = args.to.clone().unwrap_or_else(|| entity.to_owned());
    let count = Opened::open(broker, entity, 1).await?.dead_count().await?;
    let path = broker.dead_letters(entity);
    if count == 0 {
        println!("nothing in {path} matches; nothing sent");
        return Ok(());
    }
    let take = usize::try_from(count).unwrap_or(usize::MAX);
    let opened = Opened::open(broker, entity, take).await?;
    let target_opened =
        if target == entity { None } else { Some(Opened::open(broker, &target, 1).await?) };
    let sender = target_opened.as_ref().unwrap_or(&opened);
    let now = super::now();
    let (mut chosen, mut moved, mut kept, mut both) = (0usize, 0usize, 0usize, 0usize);
    let bar = progress(Some(count), "resubmitting");
    let mut tally = |outcome: Outcome| match outcome {
        Outcome::Moved => moved += 1,
        Outcome::Kept => kept += 1,
        Outcome::Both => both += 1,
    };
    match (&opened, sender) {
        (Opened::RabbitMq { dead, .. }, Opened::RabbitMq { main: to, .. }) => {
            // Everything is taken and held (no sequence number tells them apart), the chosen
            // ones moved, the others put back at the end.
            let taken = take_rabbit(dead, take).await?;
            let mut held = Vec::new();
            for d in &taken {
                let m = with_original_id(d.message(), d.original_message_id());
                if !args.chooses(&m, now) {
                    held.push(d);
                    continue;
                }
                chosen += 1;
                let Some(copy) = copy_or_keep(&m, args.new_id, &path) else {
                    tally(Outcome::Kept);
                    held.push(d);
                    continue;
                };
                to.send(copy).await.map_err(|e| explain(e, broker, &target)).with_context(
                    || format!("sending the copy of {}; it stays dead-lettered", describe(&m)),
                )?;
                tally(match dead.complete(d).await {
                    Ok(()) => Outcome::Moved,
                    Err(e) => {
                        eprintln!(
                            "warning: {} was sent to {target} but could not be removed from {path} ({e}): it is in both now",
                            describe(&m)
                        );
                        Outcome::Both
                    }
                });
                bar.inc(1);
            }
            for d in held {
                let _ = twice::Transport::release(dead, d).await;
            }
        }
        (Opened::Nats { dead, .. }, Opened::Nats { main: to, .. }) => {
            let mut held = Vec::new();
            let mut seen = 0usize;
            while seen < take {
                let batch = dead.receive(take - seen, DRAIN_WAIT).await?;
                if batch.is_empty() {
                    break;
                }
                seen += batch.len();
                for d in batch {
                    let m = d.message().clone();
                    if !args.chooses(&m, now) {
                        held.push(d);
                        continue;
                    }
                    chosen += 1;
                    let Some(copy) = copy_or_keep(&m, args.new_id, &path) else {
                        tally(Outcome::Kept);
                        held.push(d);
                        continue;
                    };
                    let dropped = to
                        .send_reporting_duplicate(copy)
                        .await
                        .map_err(|e| explain(e, broker, &target))
                        .with_context(|| {
                            format!("sending the copy of {}; it stays dead-lettered", describe(&m))
                        })?;
                    if dropped {
                        eprintln!(
                            "warning: {} has an id '{target}' saw inside its duplicate window: the stream dropped its copy, so it stays dead-lettered (resubmit with --new-id, or after the window)",
                            describe(&m)
                        );
                        tally(Outcome::Kept);
                        held.push(d);
                        continue;
                    }
                    tally(match dead.complete(&d).await {
                        Ok(()) => Outcome::Moved,
                        Err(e) => {
                            eprintln!(
                                "warning: {} was sent to {target} but could not be removed from {path} ({e}): it is in both now",
                                describe(&m)
                            );
                            Outcome::Both
                        }
                    });
                    bar.inc(1);
                }
            }
            for d in &held {
                let _ = twice::Transport::release(dead, d).await;
            }
        }
        _ => bail!("'{target}' is on another broker"),
    }
    bar.finish_and_clear();
    if chosen == 0 {
        println!("nothing in {path} matches; nothing sent");
        return Ok(());
    }
    println!(
        "resubmitted {moved} of {chosen} matching message(s) from {path} to {target}{}{}",
        if kept > 0 { format!("; {kept} kept") } else { String::new() },
        if both > 0 { format!("; {both} in both places") } else { String::new() },
    );
    Ok(())
}

/// `#sequence (id …)` of a message, for warnings.
fn describe(m: &ReceivedMessage) -> String {
    format!(
        "#{} (id {})",
        m.sequence_number,
        m.message.message_id.as_ref().map_or("-", MessageId::as_str)
    )
}

/// The copy to send, or `None` (with a warning) for a message without an id and no
/// `--new-id`: its copy would be dead-lettered again as `MissingMessageId`.
fn copy_or_keep(m: &ReceivedMessage, new_id: bool, path: &str) -> Option<Message> {
    if m.message.message_id.is_none() && !new_id {
        eprintln!(
            "warning: {} in {path} has no message id: its copy would be dead-lettered again, so it stays (resubmit with --new-id to give it one)",
            describe(m)
        );
        return None;
    }
    Some(twice::dead_letter::resubmit_copy(&m.message, new_id))
}

async fn purge(broker: &Broker, entity: &str, yes: bool) -> anyhow::Result<()> {
    let opened = Opened::open(broker, entity, 1).await?;
    let path = broker.dead_letters(entity);
    let count = opened.dead_count().await?;
    if count == 0 {
        println!("{path} is empty; nothing deleted");
        return Ok(());
    }
    if !yes {
        if !std::io::stdin().is_terminal() {
            bail!(
                "purge deletes {count} message(s) from {path}: confirm with --yes when not on a terminal"
            );
        }
        eprint!(
            "delete the {count} message(s) of {path} (and any dead-lettered while it runs)? [y/N] "
        );
        std::io::stderr().flush()?;
        let mut answer = String::new();
        std::io::stdin().read_line(&mut answer)?;
        if !matches!(answer.trim(), "y" | "Y" | "yes" | "YES" | "Yes") {
            println!("nothing deleted");
            return Ok(());
        }
    }
    let deleted = match &opened {
        Opened::RabbitMq { dead, .. } => dead.purge().await?,
        Opened::Nats { dead, .. } => dead.purge().await?,
    };
    println!("deleted {deleted} message(s) from {path}");
    Ok(())
}

/// The reason of the newest message of `entity`'s dead-letter queue: NATS reads it; RabbitMQ
/// cannot tell which is newest without taking them all, and says `-`.
pub(super) async fn newest_reason(
    broker: &Broker,
    entity: &str,
    after: Option<i64>,
) -> (String, Option<i64>) {
    let Broker::Nats(_) = broker else { return ("-".to_owned(), None) };
    let Ok(Opened::Nats { dead, .. }) = Opened::open(broker, entity, 1).await else {
        return ("-".to_owned(), None);
    };
    let from = after.and_then(|s| u64::try_from(s.saturating_add(1)).ok());
    match dead.peek(from, usize::MAX).await {
        Ok(page) => match page.last() {
            Some(m) => (
                m.dead_letter_reason.clone().unwrap_or_else(|| "-".to_owned()),
                Some(m.sequence_number.get()),
            ),
            None => ("-".to_owned(), None),
        },
        Err(_) => ("-".to_owned(), None),
    }
}
