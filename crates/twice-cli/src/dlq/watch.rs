//! `twice dlq watch`: reads every entity's dead-letter count (the counts `list` shows) at an
//! interval, logs a warning when one rises, and serves the counts as Prometheus text.
//!
//! The first reading is the baseline: what was dead-lettered before the watch started is not
//! news. After it, an entity whose count is higher than at the last reading gets one warning
//! with the reason of its newest dead-lettered message, peeked (nothing is locked). An entity
//! that appears later starts from zero. A reading that fails is logged and tried again at the
//! next interval; only the first must succeed, so that a wrong connection string, address or
//! key stops the watch at once.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http_body_util::Full;
use hyper::StatusCode;
use hyper::body::{Bytes, Incoming};
use hyper::header::{CONTENT_TYPE, HeaderValue};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use twice::SequenceNumber;
use twice_servicebus_client::{ReceiverOptions, ServiceBusClient};

use super::admin::EntityCounts;
use super::brokers::{self, Broker};
use super::{Ctx, PEEK_PAGE, dlq_path, parse_duration};

/// Options of `twice dlq watch`.
#[derive(Debug, clap::Args)]
pub(crate) struct WatchArgs {
    /// How often to read the counts (`500ms`, `5s`, `1m`).
    #[arg(long, value_name = "DURATION", default_value = "5s", value_parser = parse_duration)]
    interval: Duration,
    /// Serve Prometheus text at http://ADDR/metrics: `twice_dlq_messages{entity}` (a gauge),
    /// `twice_dlq_increases_total{entity}` (how often the count rose) and
    /// `twice_dlq_read_errors_total`. Port 0 picks a free port; the address is printed.
    #[arg(long, value_name = "ADDR")]
    metrics: Option<SocketAddr>,
    /// Only entities whose path contains this (case-insensitive).
    #[arg(long, value_name = "TEXT")]
    entity: Option<String>,
}

/// What the watch knows of one entity.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Watched {
    dead_lettered: u64,
    increases: u64,
    /// The newest dead-lettered message peeked so far: the next peek starts after it.
    newest: Option<i64>,
}

/// Every watched entity, and how many readings failed.
#[derive(Debug, Default)]
struct State {
    entities: BTreeMap<String, Watched>,
    read_errors: u64,
}

/// A rise of one entity's count, to be logged once its newest reason is known.
#[derive(Debug, PartialEq, Eq)]
struct Rise {
    entity: String,
    from: u64,
    to: u64,
}

impl State {
    /// Takes a reading; returns the rises since the last one (none on the first, the
    /// baseline).
    fn update(&mut self, counts: &[EntityCounts], baseline: bool) -> Vec<Rise> {
        let mut rises = Vec::new();
        let mut next = BTreeMap::new();
        for c in counts {
            let mut w = self.entities.remove(&c.path).unwrap_or_default();
            if !baseline && c.dead_letter > w.dead_lettered {
                w.increases += 1;
                rises.push(Rise {
                    entity: c.path.clone(),
                    from: w.dead_lettered,
                    to: c.dead_letter,
                });
            }
            w.dead_lettered = c.dead_letter;
            next.insert(c.path.clone(), w);
        }
        // Entities no longer listed were deleted: their series end.
        self.entities = next;
        rises
    }

    fn render(&self) -> String {
        let mut s = String::new();
        s.push_str(concat!(
            "# HELP twice_dlq_messages Dead-lettered messages of the entity at the last reading.\n",
            "# TYPE twice_dlq_messages gauge\n"
        ));
        for (entity, w) in &self.entities {
            let _ = writeln!(
                s,
                "twice_dlq_messages{{entity=\"{}\"}} {}",
                label(entity),
                w.dead_lettered
            );
        }
        s.push_str(concat!(
            "# HELP twice_dlq_increases_total Readings at which the entity's dead-letter count was higher than at the one before.\n",
            "# TYPE twice_dlq_increases_total counter\n"
        ));
        for (entity, w) in &self.entities {
            let _ = writeln!(
                s,
                "twice_dlq_increases_total{{entity=\"{}\"}} {}",
                label(entity),
                w.increases
            );
        }
        s.push_str(concat!(
            "# HELP twice_dlq_read_errors_total Readings of the counts that failed.\n",
            "# TYPE twice_dlq_read_errors_total counter\n"
        ));
        let _ = writeln!(s, "twice_dlq_read_errors_total {}", self.read_errors);
        s
    }
}

/// A label value escaped as the Prometheus text format wants.
fn label(v: &str) -> String {
    v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

fn lock(state: &Mutex<State>) -> std::sync::MutexGuard<'_, State> {
    state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Runs until Ctrl-C.
pub(crate) async fn watch(ctx: &Ctx, args: &WatchArgs) -> anyhow::Result<()> {
    let admin = ctx.admin()?;
    let client = ctx.client()?;
    let filter = args.entity.as_deref().map(str::to_ascii_lowercase);
    let read = || async {
        let all = admin.list().await?;
        Ok::<_, anyhow::Error>(
            all.into_iter()
                .filter(|c| filter.as_ref().is_none_or(|f| c.path.to_ascii_lowercase().contains(f)))
                .collect::<Vec<_>>(),
        )
    };
    let newest = |entity: String, after| {
        let client = &client;
        async move { newest_reason(client, &entity, after).await }
    };
    watch_with(args, "queue(s) and subscription(s)", read, newest).await
}

/// `twice dlq watch` on RabbitMQ (the queue `--entity` names) or NATS (every stream, or those
/// whose name contains `--entity`); runs until Ctrl-C.
pub(super) async fn watch_broker(broker: &Broker, args: &WatchArgs) -> anyhow::Result<()> {
    let read = || brokers::counts(broker, args.entity.as_deref());
    let newest =
        |entity: String, after| async move { brokers::newest_reason(broker, &entity, after).await };
    let what = match broker {
        Broker::RabbitMq(_) => "queue(s)",
        Broker::Nats(_) => "stream(s)",
    };
    watch_with(args, what, read, newest).await
}

/// The watch: `read` gives the counts, `newest` the reason of an entity's newest dead-lettered
/// message after a sequence number (and that message's sequence number).
async fn watch_with<R, RF, N, NF>(
    args: &WatchArgs,
    what: &str,
    read: R,
    newest: N,
) -> anyhow::Result<()>
where
    R: Fn() -> RF,
    RF: Future<Output = anyhow::Result<Vec<EntityCounts>>>,
    N: Fn(String, Option<i64>) -> NF,
    NF: Future<Output = (String, Option<i64>)>,
{
    // A std Mutex: short sections, never held across an await.
    let state = Arc::new(Mutex::new(State::default()));
    let first = read().await?;
    lock(&state).update(&first, true);
    if let Some(addr) = args.metrics {
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|e| crate::errors::bind_error("--metrics", addr, &e))?;
        println!("metrics: http://{}/metrics", listener.local_addr()?);
        tokio::spawn(serve_metrics(listener, Arc::clone(&state)));
    }
    println!("watching {} {what} every {:?}; Ctrl-C stops", first.len(), args.interval);
    let mut ctrl_c = std::pin::pin!(tokio::signal::ctrl_c());
    loop {
        tokio::select! {
            _ = &mut ctrl_c => return Ok(()),
            () = tokio::time::sleep(args.interval) => {}
        }
        let counts = match read().await {
            Ok(counts) => counts,
            Err(e) => {
                lock(&state).read_errors += 1;
                tracing::error!(error = %crate::errors::render(&e), "reading the dead-letter counts failed; trying again");
                continue;
            }
        };
        let rises = lock(&state).update(&counts, false);
        for rise in rises {
            let after = lock(&state).entities.get(&rise.entity).and_then(|w| w.newest);
            let (reason, newest) = newest(rise.entity.clone(), after).await;
            if let Some(w) = lock(&state).entities.get_mut(&rise.entity) {
                w.newest = newest.or(w.newest);
            }
            tracing::warn!(
                entity = %rise.entity,
                from = rise.from,
                to = rise.to,
                reason = %reason,
                "dead-letter count rose"
            );
        }
    }
}

/// The reason of the newest message of the entity's dead-letter queue after sequence number
/// `after`, peeked page by page, and that message's sequence number. `-` when none could be
/// peeked (taken already, or the peek failed: the rise is logged all the same).
async fn newest_reason(
    client: &ServiceBusClient,
    entity: &str,
    after: Option<i64>,
) -> (String, Option<i64>) {
    let receiver = client.receiver(&dlq_path(entity), ReceiverOptions::new());
    let mut from = after.map(|s| SequenceNumber::new(s.saturating_add(1)));
    let mut newest = None;
    loop {
        match receiver.peek_messages(from, PEEK_PAGE).await {
            Ok(page) => {
                let Some(last) = page.last() else { break };
                from = Some(SequenceNumber::new(last.sequence_number.get().saturating_add(1)));
                newest = Some(last.clone());
            }
            Err(e) => {
                tracing::debug!(entity, error = %e, "peeking the newest dead-lettered message");
                break;
            }
        }
    }
    receiver.close().await;
    match newest {
        Some(m) => {
            (m.dead_letter_reason.unwrap_or_else(|| "-".to_owned()), Some(m.sequence_number.get()))
        }
        None => ("-".to_owned(), None),
    }
}

/// Answers every request on `/metrics` with the counts; anything else with 404. One request per
/// connection; a client that has not sent its request's head within 10 s is cut off.
async fn serve_metrics(listener: TcpListener, state: Arc<Mutex<State>>) {
    loop {
        let Ok((stream, _)) = listener.accept().await else { continue };
        let state = Arc::clone(&state);
        tokio::spawn(async move {
            let service = service_fn(|request: hyper::Request<Incoming>| {
                std::future::ready(Ok::<_, Infallible>(answer(request.uri(), &state)))
            });
            let served = http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(Duration::from_secs(10))
                .keep_alive(false)
                .serve_connection(TokioIo::new(stream), service)
                .await;
            if let Err(e) = served {
                tracing::debug!(error = %e, "a metrics request failed");
            }
        });
    }
}

/// The answer to a request for `uri`: the counts on `/metrics`, 404 elsewhere.
fn answer(uri: &hyper::Uri, state: &Mutex<State>) -> hyper::Response<Full<Bytes>> {
    let (status, body) = if uri.path() == "/metrics" {
        (StatusCode::OK, lock(state).render())
    } else {
        (StatusCode::NOT_FOUND, "not found: the metrics are at /metrics\n".to_owned())
    };
    let mut response = hyper::Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"));
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counts(entries: &[(&str, u64)]) -> Vec<EntityCounts> {
        entries
            .iter()
            .map(|(p, n)| EntityCounts {
                path: (*p).to_owned(),
                dead_letter: *n,
                ..Default::default()
            })
            .collect()
    }

    #[test]
    fn the_first_reading_is_the_baseline_and_later_rises_are_reported() {
        let mut s = State::default();
        assert!(s.update(&counts(&[("a", 3), ("b", 0)]), true).is_empty(), "the baseline");
        assert!(s.update(&counts(&[("a", 3), ("b", 0)]), false).is_empty());
        let rises = s.update(&counts(&[("a", 2), ("b", 4), ("c", 1)]), false);
        assert_eq!(
            rises,
            [
                Rise { entity: "b".into(), from: 0, to: 4 },
                Rise { entity: "c".into(), from: 0, to: 1 }
            ],
            "a fall is no rise; a new entity starts from zero"
        );
        s.update(&counts(&[("b", 4)]), false);
        let text = s.render();
        assert!(text.contains("twice_dlq_messages{entity=\"b\"} 4\n"), "{text}");
        assert!(text.contains("twice_dlq_increases_total{entity=\"b\"} 1\n"), "{text}");
        assert!(!text.contains("entity=\"a\""), "a deleted entity's series end: {text}");
    }

    #[test]
    fn label_values_are_escaped() {
        assert_eq!(label(r#"a"b\c"#), r#"a\"b\\c"#);
    }
}
