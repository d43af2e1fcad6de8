//! `twice dlq`: look into, resubmit, purge, export and watch the dead-letter queues of `twice serve`
//! or any Service Bus namespace, through the Service Bus client (AMQP) and the administration
//! API (ATOM over HTTP) for the counts.
//!
//! Resubmitting sends a copy of each chosen dead-lettered message to the entity it came from
//! and completes the dead-lettered one only once the send is acknowledged: a failure between
//! the two leaves the message in both places (a duplicate), never in neither. A copy keeps its
//! `MessageId`, so an entity with duplicate detection would drop it as a duplicate inside its
//! window while the dead-lettered one is completed: such messages are left where they are with
//! a warning, unless `--new-id` gives the copies new ids.

pub(crate) mod admin;
mod brokers;
mod watch;

use std::collections::BTreeSet;
use std::io::{IsTerminal as _, Write as _};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context as _, anyhow, bail};
use indicatif::{ProgressBar, ProgressStyle};
use twice::export::DEAD_LETTER_PROPERTIES;
use twice::{Message, MessageId, ReceivedMessage, SequenceNumber, Timestamp, Value};
use twice_servicebus_client::{
    ConnectionString, ReceiveMode, Receiver, ReceiverOptions, ServiceBusClient,
};

use admin::{ADMIN_URL_VAR, AdminClient, AdminError, AdminUrl, Ca};

/// The variable a connection string is read from when `--connection-string` is not given.
const CONNECTION_STRING_VAR: &str = "TWICE_CONNECTION_STRING";
/// Messages asked for per peek.
const PEEK_PAGE: u32 = 100;
/// How long a receive waits for the next message before the queue counts as drained.
const DRAIN_WAIT: Duration = Duration::from_secs(3);

/// Options of `twice dlq`.
#[derive(Debug, clap::Args)]
pub(crate) struct DlqArgs {
    /// The namespace's connection string (`Endpoint=sb://…;SharedAccessKeyName=…;
    /// SharedAccessKey=…`), or a RabbitMQ (`amqp://user:pass@host:port/vhost`) or NATS
    /// (`nats://host:port`) server; default: the TWICE_CONNECTION_STRING variable. `twice
    /// serve` prints its own.
    #[arg(long, visible_alias = "connection", value_name = "STRING", global = true)]
    connection_string: Option<String>,
    /// The administration API (ATOM over HTTP), for `list`, `watch` and the
    /// duplicate-detection check of `resubmit`. Default: the TWICE_ADMIN_URL variable (`twice
    /// serve` prints it), else http://HOST:5300 (twice serve's `--http`) for an emulator
    /// connection string, https://HOST (port 443) otherwise, as Azure serves it.
    #[arg(long, env = ADMIN_URL_VAR, value_name = "URL", global = true, value_parser = AdminUrl::parse)]
    admin_url: Option<AdminUrl>,
    /// Trust only the CA certificates in this PEM file for TLS (amqps and https) instead of the
    /// public roots: for a `twice serve --tls-cert` whose certificate a private CA signed.
    #[arg(long, value_name = "FILE", global = true)]
    ca_file: Option<PathBuf>,
    #[command(subcommand)]
    command: DlqCommand,
}

#[derive(Debug, clap::Subcommand)]
enum DlqCommand {
    /// Every queue and subscription with its active, dead-lettered, scheduled and deferred
    /// counts (needs the Manage claim).
    List {
        /// Only entities whose path contains this (case-insensitive).
        #[arg(long, value_name = "TEXT")]
        entity: Option<String>,
        /// One JSON object per entity (`entity`, `active`, `dead_lettered`, `scheduled`,
        /// `deferred`), for scripts.
        #[arg(long)]
        json: bool,
    },
    /// Peek at the dead-letter queue of ENTITY without locking anything.
    Show {
        /// A queue or `TOPIC/Subscriptions/NAME`.
        entity: String,
        /// The most messages shown.
        #[arg(long, value_name = "N", default_value_t = 20)]
        max: usize,
        /// One JSON object per message, for scripts.
        #[arg(long)]
        json: bool,
    },
    /// Send copies of dead-lettered messages back, and remove each from the dead-letter queue
    /// once its copy is acknowledged.
    ///
    /// A crash between the send and the removal leaves the message in both places (a
    /// duplicate, which an idempotent receiver absorbs), never in neither. A copy keeps its
    /// MessageId (and SessionId): a target with duplicate detection would drop a copy whose
    /// original was enqueued inside its window, so such messages stay dead-lettered with a
    /// warning; --new-id sends them with new ids instead.
    Resubmit(ResubmitArgs),
    /// Delete every message of the dead-letter queue of ENTITY (asks first).
    Purge {
        /// A queue or `TOPIC/Subscriptions/NAME`.
        entity: String,
        /// Do not ask.
        #[arg(long)]
        yes: bool,
    },
    /// Write the dead-letter queue of ENTITY as JSON lines, removing nothing.
    Export {
        /// A queue or `TOPIC/Subscriptions/NAME`.
        entity: String,
        /// Write here instead of stdout.
        #[arg(long, value_name = "FILE")]
        output: Option<PathBuf>,
    },
    /// Read every entity's dead-letter count at an interval, log a warning ("dead-letter count
    /// rose", with the entity, the counts before and after and the newest message's reason)
    /// when one rises, and optionally serve the counts as Prometheus metrics for alerts
    /// (needs the Manage claim, as `list`).
    ///
    /// The first reading is the baseline. An alert on the metrics:
    /// `increase(twice_dlq_increases_total[10m]) > 0`. Only the first reading must succeed; a
    /// later failure is logged, counted in `twice_dlq_read_errors_total`, and retried at the
    /// next interval. Ctrl-C stops it.
    Watch(watch::WatchArgs),
}

/// Options of `twice dlq resubmit`: `--all`, or filters that a message must all match.
#[derive(Debug, clap::Args)]
#[command(group(clap::ArgGroup::new("select").required(true).multiple(true)
    .args(["sequence", "reason", "older_than", "property", "all"])))]
struct ResubmitArgs {
    /// A queue or `TOPIC/Subscriptions/NAME`.
    entity: String,
    /// The message with this sequence number (repeatable).
    #[arg(long, value_name = "N")]
    sequence: Vec<i64>,
    /// The messages dead-lettered with this reason.
    #[arg(long, value_name = "REASON")]
    reason: Option<String>,
    /// The messages enqueued longer ago than this (`90s`, `30m`, `12h`, `7d`).
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    older_than: Option<Duration>,
    /// The messages with this application property (`KEY=VALUE`, the value compared as
    /// text; repeatable: every one must match).
    #[arg(long, value_name = "KEY=VALUE", value_parser = parse_property)]
    property: Vec<(String, String)>,
    /// Every message.
    #[arg(long, conflicts_with_all = ["sequence", "reason", "older_than", "property"])]
    all: bool,
    /// Where the copies go. Default: the queue itself. A subscription cannot be sent to: give
    /// its topic (every subscription of the topic whose rules match then gets a copy) or
    /// another queue.
    #[arg(long, value_name = "ENTITY")]
    to: Option<String>,
    /// Give each copy a new message id (the old one goes into the `OriginalMessageId`
    /// property), so duplicate detection does not drop it.
    #[arg(long)]
    new_id: bool,
}

fn parse_property(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_owned(), v.to_owned())),
        _ => Err(format!("expected KEY=VALUE, got {s:?}")),
    }
}

impl ResubmitArgs {
    /// Whether `m` is chosen: `--all`, or every filter given matches.
    fn chooses(&self, m: &ReceivedMessage, now: Timestamp) -> bool {
        self.all
            || ((self.sequence.is_empty() || self.sequence.contains(&m.sequence_number.get()))
                && self.reason.as_ref().is_none_or(|r| m.dead_letter_reason.as_deref() == Some(r))
                && self.older_than.is_none_or(|age| m.enqueued_time.saturating_add(age) < now)
                && self.property.iter().all(|(k, v)| {
                    m.message.application_properties.get(k).is_some_and(|p| value_text(p) == *v)
                }))
    }
}

/// A property value as text: a string as it is, anything else as JSON.
fn value_text(v: &Value) -> String {
    match v {
        Value::String(s) | Value::Symbol(s) => s.clone(),
        other => value_json(other).to_string(),
    }
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (n, unit) = s.split_at(split);
    let n: u64 = n.parse().map_err(|_| format!("expected a number and a unit, got {s:?}"))?;
    let secs = match unit {
        "ms" => return Ok(Duration::from_millis(n)),
        "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86_400,
        _ => return Err(format!("unknown unit in {s:?}: expected ms, s, m, h or d")),
    };
    Ok(Duration::from_secs(n.saturating_mul(secs)))
}

/// What every subcommand works with.
struct Ctx {
    connection_string: String,
    parsed: ConnectionString,
    admin_url: Option<AdminUrl>,
    /// The CA certificates of `--ca-file`: for the AMQP client and for the administration API.
    ca: Option<Ca>,
}

impl Ctx {
    fn new(args: &DlqArgs) -> anyhow::Result<Self> {
        let connection_string = match &args.connection_string {
            Some(s) => s.clone(),
            None => std::env::var(CONNECTION_STRING_VAR).map_err(|_| {
                anyhow!(
                    "no connection string: give --connection-string or set {CONNECTION_STRING_VAR}"
                )
            })?,
        };
        let parsed: ConnectionString = connection_string.parse().map_err(|e| anyhow!("{e}"))?;
        let ca = args.ca_file.as_deref().map(Ca::load).transpose().map_err(|e| anyhow!(e))?;
        Ok(Self { connection_string, parsed, admin_url: args.admin_url.clone(), ca })
    }

    fn client(&self) -> anyhow::Result<ServiceBusClient> {
        let options = Ca::client_options(self.ca.as_ref(), &self.connection_string)
            .map_err(|e| anyhow!("{e}"))?;
        Ok(ServiceBusClient::new(options))
    }

    fn admin(&self) -> anyhow::Result<AdminClient> {
        let admin = AdminClient::for_connection_string(&self.parsed, self.admin_url.clone())
            .map_err(|e| anyhow!(e))?;
        Ok(Ca::admin(self.ca.as_ref(), admin))
    }
}

/// A client error as one line a user can act on.
fn explain(e: twice_servicebus_client::Error, entity: &str, ctx: &Ctx) -> anyhow::Error {
    if e.is_not_found() {
        anyhow!("no entity '{}' in the namespace {}", base_entity(entity), ctx.parsed.host())
    } else if e.is_unauthorized() {
        let key = ctx.parsed.key_name().unwrap_or("the signature");
        anyhow!(
            "unauthorized: {} refused {key} for '{entity}' (a wrong key, or a key without the Listen/Send claim it needs)",
            ctx.parsed.host()
        )
    } else {
        anyhow!("{entity}: {e}{}", Ca::hint(ctx.ca.as_ref(), &e))
    }
}

/// The queue or subscription a path names, without a trailing `/$DeadLetterQueue`.
fn base_entity(entity: &str) -> &str {
    let trimmed = entity.trim_end_matches('/');
    match trimmed.rsplit_once('/') {
        Some((base, last)) if last.eq_ignore_ascii_case("$DeadLetterQueue") => base,
        _ => trimmed,
    }
}

fn is_subscription(entity: &str) -> bool {
    entity.split('/').any(|s| s.eq_ignore_ascii_case("subscriptions"))
}

fn progress(len: Option<u64>, what: &str) -> ProgressBar {
    if !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = match len {
        Some(n) => ProgressBar::new(n).with_style(
            ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len} ({per_sec}, {eta} left)")
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> "),
        ),
        None => ProgressBar::new_spinner().with_style(
            ProgressStyle::with_template("{spinner} {msg} {pos}")
                .unwrap_or_else(|_| ProgressStyle::default_spinner()),
        ),
    };
    bar.set_message(what.to_owned());
    bar
}

impl DlqArgs {
    /// Whether this is `twice dlq watch`, whose warnings are its output.
    pub(crate) fn is_watch(&self) -> bool {
        matches!(self.command, DlqCommand::Watch(_))
    }
}

pub(crate) async fn run(args: DlqArgs) -> anyhow::Result<ExitCode> {
    if let Some(broker) = brokers::Broker::of(&args) {
        let done = match &args.command {
            DlqCommand::Watch(w) => watch::watch_broker(&broker, w).await,
            command => brokers::run(&broker, command).await,
        };
        return done.map(|()| ExitCode::SUCCESS);
    }
    let ctx = Ctx::new(&args)?;
    let result = match args.command {
        DlqCommand::List { entity, json } => list(&ctx, entity.as_deref(), json).await,
        DlqCommand::Show { entity, max, json } => show(&ctx, base_entity(&entity), max, json).await,
        DlqCommand::Resubmit(r) => resubmit(&ctx, &r).await,
        DlqCommand::Purge { entity, yes } => purge(&ctx, base_entity(&entity), yes).await,
        DlqCommand::Export { entity, output } => {
            export(&ctx, base_entity(&entity), output.as_deref()).await
        }
        DlqCommand::Watch(w) => watch::watch(&ctx, &w).await,
    };
    result.map(|()| ExitCode::SUCCESS)
}

async fn list(ctx: &Ctx, filter: Option<&str>, json: bool) -> anyhow::Result<()> {
    let admin = ctx.admin()?;
    let all = admin.list().await?;
    let filter = filter.map(str::to_ascii_lowercase);
    let shown: Vec<_> = all
        .into_iter()
        .filter(|c| filter.as_ref().is_none_or(|f| c.path.to_ascii_lowercase().contains(f)))
        .collect();
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
        writeln!(
            out,
            "(no queue or subscription{})",
            if filter.is_some() { " matches" } else { "" }
        )?;
    }
    Ok(())
}

/// Peeks at up to `max` messages of a dead-letter queue, page by page.
async fn peek_all(
    ctx: &Ctx,
    receiver: &Receiver,
    entity: &str,
    max: usize,
    bar: &ProgressBar,
) -> anyhow::Result<Vec<ReceivedMessage>> {
    let mut out: Vec<ReceivedMessage> = Vec::new();
    let mut from = None;
    while out.len() < max {
        let want = u32::try_from(max - out.len()).unwrap_or(u32::MAX).min(PEEK_PAGE);
        let page = receiver.peek_messages(from, want).await.map_err(|e| explain(e, entity, ctx))?;
        let Some(last) = page.last() else { break };
        from = Some(SequenceNumber::new(last.sequence_number.get().saturating_add(1)));
        bar.inc(u64::try_from(page.len()).unwrap_or(0));
        out.extend(page);
    }
    Ok(out)
}

fn dlq_path(entity: &str) -> String {
    format!("{entity}/$DeadLetterQueue")
}

async fn show(ctx: &Ctx, entity: &str, max: usize, json: bool) -> anyhow::Result<()> {
    let client = ctx.client()?;
    let path = dlq_path(entity);
    let receiver = client.receiver(&path, ReceiverOptions::new());
    let bar = progress(None, "peeking");
    let messages = peek_all(ctx, &receiver, &path, max, &bar).await?;
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

fn value_json(v: &Value) -> serde_json::Value {
    twice::export::value_json(v)
}

/// The application properties, without the two the service adds on dead-lettering when
/// `without_reason` (they are shown as the reason and description).
fn properties_json(m: &ReceivedMessage, without_reason: bool) -> serde_json::Value {
    let map = m
        .message
        .application_properties
        .iter()
        .filter(|(k, _)| !(without_reason && DEAD_LETTER_PROPERTIES.contains(&k.as_str())))
        .map(|(k, v)| (k.clone(), value_json(v)))
        .collect();
    serde_json::Value::Object(map)
}

/// A message as one JSON object: for an export, as `twice data export` writes it
/// ([`twice::export::to_json`]); otherwise as the console shows it, with a preview of its body
/// ([`twice::dead_letter::view_json`]).
fn to_json(m: &ReceivedMessage, whole_body: bool) -> serde_json::Value {
    if whole_body { twice::export::to_json(m) } else { twice::dead_letter::view_json(m) }
}

/// The copy a resubmit sends ([`twice::dead_letter::resubmit_copy`]).
fn copy_of(m: &ReceivedMessage, new_id: bool) -> Message {
    twice::dead_letter::resubmit_copy(&m.message, new_id)
}

fn now() -> Timestamp {
    twice::SharedClock::system().now()
}

async fn resubmit(ctx: &Ctx, args: &ResubmitArgs) -> anyhow::Result<()> {
    let entity = base_entity(&args.entity);
    let target = match &args.to {
        Some(t) => t.clone(),
        None if is_subscription(entity) => bail!(
            "'{entity}' is a subscription, which cannot be sent to: give --to TOPIC (every subscription of the topic whose rules match gets a copy) or --to QUEUE"
        ),
        None => entity.to_owned(),
    };
    if is_subscription(&target) {
        bail!("'{target}' is a subscription, which cannot be sent to: give its topic or a queue");
    }
    let client = ctx.client()?;
    let path = dlq_path(entity);
    let peeker = client.receiver(&path, ReceiverOptions::new());
    let bar = progress(None, "peeking");
    let all = peek_all(ctx, &peeker, &path, usize::MAX, &bar).await?;
    bar.finish_and_clear();
    let now = now();
    let chosen: Vec<&ReceivedMessage> = all.iter().filter(|m| args.chooses(m, now)).collect();
    if chosen.is_empty() {
        println!("nothing in {path} matches; nothing sent");
        return Ok(());
    }
    // A copy with the same id inside the target's duplicate-detection window would be dropped
    // by the service while the dead-lettered message is completed: lost. Such messages stay.
    let window = if args.new_id {
        None
    } else {
        let admin = ctx.admin()?;
        match admin.dedup(&target).await {
            Ok(d) => d.window,
            Err(AdminError::NotFound(_)) => {
                bail!("no entity '{target}' in the namespace {}", ctx.parsed.host())
            }
            Err(e) => bail!(
                "cannot tell whether '{target}' detects duplicates ({e}); give --admin-url, or --new-id to send the copies with new ids"
            ),
        }
    };
    let mut wanted = BTreeSet::new();
    let mut kept = 0usize;
    for m in &chosen {
        let inside = window.is_some_and(|w| m.enqueued_time.saturating_add(w) > now);
        if inside {
            kept += 1;
            eprintln!(
                "warning: #{} (id {}) was enqueued at {}, inside the duplicate-detection window of '{target}': the service would drop its copy, so it stays dead-lettered (resubmit with --new-id, or after the window)",
                m.sequence_number,
                m.message.message_id.as_ref().map_or("-", MessageId::as_str),
                m.enqueued_time
            );
        } else {
            wanted.insert(m.sequence_number.get());
        }
    }
    let to_move = wanted.len();
    let moved = if wanted.is_empty() {
        0
    } else {
        move_back(ctx, &client, &path, &target, &mut wanted, args.new_id).await?
    };
    println!(
        "resubmitted {moved} of {} matching message(s) from {path} to {target}{}{}",
        chosen.len(),
        if kept > 0 {
            format!("; {kept} kept (duplicate-detection window)")
        } else {
            String::new()
        },
        if moved < to_move {
            format!("; {} no longer there (taken or removed by another receiver)", to_move - moved)
        } else {
            String::new()
        },
    );
    Ok(())
}

/// Receives the dead-lettered messages whose sequence numbers are in `wanted`, sends a copy
/// of each to `target` and completes it once the send is acknowledged. Messages not wanted are
/// held locked until the end and then released, so the receive sees each message once.
async fn move_back(
    ctx: &Ctx,
    client: &ServiceBusClient,
    path: &str,
    target: &str,
    wanted: &mut BTreeSet<i64>,
    new_id: bool,
) -> anyhow::Result<usize> {
    let credit = u32::try_from(wanted.len()).unwrap_or(u32::MAX).min(PEEK_PAGE);
    let receiver = client.receiver(path, ReceiverOptions::new().prefetch(credit));
    let sender = client.sender(target);
    let bar = progress(Some(u64::try_from(wanted.len()).unwrap_or(0)), "resubmitting");
    let mut held = Vec::new();
    let mut moved = 0usize;
    let result: anyhow::Result<()> = async {
        while !wanted.is_empty() {
            let batch = receiver
                .receive_messages(usize::try_from(PEEK_PAGE).unwrap_or(100), DRAIN_WAIT)
                .await
                .map_err(|e| explain(e, path, ctx))?;
            if batch.is_empty() {
                break;
            }
            for d in batch {
                let seq = d.message().sequence_number.get();
                if !wanted.remove(&seq) {
                    held.push(d);
                    continue;
                }
                sender
                    .send_message(copy_of(d.message(), new_id))
                    .await
                    .map_err(|e| explain(e, target, ctx))
                    .with_context(|| format!("sending the copy of #{seq}; it stays dead-lettered"))?;
                if let Err(e) = receiver.complete_message(&d).await {
                    eprintln!(
                        "warning: #{seq} was sent to {target} but could not be removed from {path} ({e}): it is in both now"
                    );
                } else {
                    moved += 1;
                }
                bar.inc(1);
            }
        }
        Ok(())
    }
    .await;
    bar.finish_and_clear();
    // The messages not asked for go back at once, not when their locks expire.
    receiver.release_and_close(held).await;
    result.map(|()| moved)
}

async fn purge(ctx: &Ctx, entity: &str, yes: bool) -> anyhow::Result<()> {
    let client = ctx.client()?;
    let path = dlq_path(entity);
    let peeker = client.receiver(&path, ReceiverOptions::new());
    let bar = progress(None, "counting");
    let count = peek_all(ctx, &peeker, &path, usize::MAX, &bar).await?.len();
    bar.finish_and_clear();
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
    // Credit only while a receive waits: a message that arrives after the last one is not
    // deleted unseen and uncounted.
    let receiver =
        client.receiver(&path, ReceiverOptions::new().mode(ReceiveMode::ReceiveAndDelete));
    let bar = progress(Some(u64::try_from(count).unwrap_or(0)), "deleting");
    let drained = drain(ctx, &receiver, &peeker, &path, count, &bar).await;
    bar.finish_and_clear();
    receiver.close().await;
    let (deleted, left) = drained?;
    println!("deleted {deleted} message(s) from {path}");
    if left {
        eprintln!(
            "warning: {path} still holds messages that could not be received (another receiver \
             holds them locked?): purge again once their locks have run out"
        );
    }
    Ok(())
}

/// How many receives in a row may come back empty while a peek still shows messages, before
/// a purge gives up on them.
const PURGE_PATIENCE: u32 = 10;

/// Deletes (receive-and-delete) until the `peeked` messages are gone and a receive on the
/// attached link finds nothing more, or a peek finds the queue empty. An empty receive alone
/// proves nothing: its wait may have gone on connecting and attaching the link (seconds on a
/// loaded machine), or another receiver may hold the messages locked. Returns how many were
/// deleted, and whether messages were left that could not be received.
async fn drain(
    ctx: &Ctx,
    receiver: &Receiver,
    peeker: &Receiver,
    path: &str,
    peeked: usize,
    bar: &ProgressBar,
) -> anyhow::Result<(usize, bool)> {
    let mut deleted = 0usize;
    let mut empty = 0u32;
    loop {
        let batch = receiver
            .receive_messages(usize::try_from(PEEK_PAGE).unwrap_or(100), DRAIN_WAIT)
            .await
            .map_err(|e| explain(e, path, ctx))?;
        if !batch.is_empty() {
            deleted += batch.len();
            empty = 0;
            bar.inc(u64::try_from(batch.len()).unwrap_or(0));
            continue;
        }
        if deleted >= peeked {
            // What was counted is gone, and the link, attached since it delivered, stayed
            // empty for a whole wait.
            return Ok((deleted, false));
        }
        let left = peeker.peek_messages(None, 1).await.map_err(|e| explain(e, path, ctx))?;
        if left.is_empty() {
            return Ok((deleted, false));
        }
        empty += 1;
        if empty >= PURGE_PATIENCE {
            return Ok((deleted, true));
        }
    }
}

async fn export(ctx: &Ctx, entity: &str, output: Option<&std::path::Path>) -> anyhow::Result<()> {
    let client = ctx.client()?;
    let path = dlq_path(entity);
    let receiver = client.receiver(&path, ReceiverOptions::new());
    let mut out: Box<dyn std::io::Write> = match output {
        Some(p) => Box::new(std::io::BufWriter::new(
            std::fs::File::create(p).with_context(|| format!("creating {}", p.display()))?,
        )),
        None => Box::new(std::io::stdout().lock()),
    };
    let bar = progress(None, "exporting");
    let mut from = None;
    let mut written = 0usize;
    loop {
        let page =
            receiver.peek_messages(from, PEEK_PAGE).await.map_err(|e| explain(e, &path, ctx))?;
        let Some(last) = page.last() else { break };
        from = Some(SequenceNumber::new(last.sequence_number.get().saturating_add(1)));
        for m in &page {
            writeln!(out, "{}", to_json(m, true))?;
        }
        written += page.len();
        bar.inc(u64::try_from(page.len()).unwrap_or(0));
    }
    out.flush()?;
    bar.finish_and_clear();
    if let Some(p) = output {
        println!("exported {written} message(s) of {path} to {}", p.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse_with_a_unit() {
        assert_eq!(parse_duration("90s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("2h"), Ok(Duration::from_secs(7200)));
        assert_eq!(parse_duration("7d"), Ok(Duration::from_secs(604_800)));
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert!(parse_duration("5").is_err());
        assert!(parse_duration("5y").is_err());
        assert!(parse_duration("m").is_err());
    }

    #[test]
    fn entities_are_named_without_their_dead_letter_queue() {
        assert_eq!(base_entity("q/$DeadLetterQueue"), "q");
        assert_eq!(base_entity("t/Subscriptions/s/$deadletterqueue"), "t/Subscriptions/s");
        assert_eq!(base_entity("q"), "q");
        assert!(is_subscription("t/Subscriptions/s") && !is_subscription("q"));
    }

    #[test]
    fn a_copy_drops_the_dead_letter_properties_and_keeps_or_replaces_its_id() {
        let mut msg = Message::new("x").with_message_id("m1");
        msg.application_properties.insert("DeadLetterReason".into(), Value::from("Poison"));
        msg.application_properties.insert("k".into(), Value::from("v"));
        let m = ReceivedMessage::new(msg, SequenceNumber::new(3), Timestamp::from_millis(0));
        let same = copy_of(&m, false);
        assert_eq!(same.message_id.as_ref().map(MessageId::as_str), Some("m1"));
        assert!(!same.application_properties.contains_key("DeadLetterReason"));
        assert_eq!(same.application_properties.get("k"), Some(&Value::from("v")));
        let fresh = copy_of(&m, true);
        assert_ne!(fresh.message_id.as_ref().map(MessageId::as_str), Some("m1"));
        assert_eq!(fresh.application_properties.get("OriginalMessageId"), Some(&Value::from("m1")));
    }
}
