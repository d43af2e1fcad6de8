//! The relay: sends an outbox's committed rows on a broker; see [`Relay`].

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::ops::ControlFlow;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt as _;
use tracing::Instrument as _;

use super::marks::Marks;
use super::store::{LeasedMessage, OutboxStats, OutboxStore};
use super::{BatchError, Publish, is_permanent};
use crate::clock::{SharedClock, Timestamp};
use crate::ids::MessageId;
use crate::retry::random_u64;
use crate::trace_context;
use crate::transport::TransportError;

/// Options of a [`Relay`].
#[derive(Clone, Debug)]
pub struct RelayOptions {
    batch_size: usize,
    lease_duration: Duration,
    poll_interval: Duration,
    max_concurrent_sends: usize,
    max_batch_bytes: usize,
    initial_backoff: Duration,
    max_backoff: Duration,
    stats_interval: Duration,
    mark_delay: Duration,
    owner: Option<String>,
    clock: SharedClock,
}

impl Default for RelayOptions {
    fn default() -> Self {
        Self {
            batch_size: 100,
            lease_duration: Duration::from_secs(30),
            poll_interval: Duration::from_secs(1),
            max_concurrent_sends: 16,
            max_batch_bytes: 192 * 1024,
            initial_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(60),
            stats_interval: Duration::from_secs(10),
            mark_delay: Duration::from_millis(100),
            owner: None,
            clock: SharedClock::system(),
        }
    }
}

impl RelayOptions {
    /// The defaults: batches of 100 rows, leases of 30 s, a poll every second, 16 sends at
    /// once, broker batches of at most 192 KiB of bodies, backoff from 100 ms to 60 s, stats
    /// every 10 s, sent rows deleted within 100 ms, a random owner name, the system clock.
    pub fn new() -> Self {
        Self::default()
    }

    /// How many rows one lease takes at most (at least 1).
    #[must_use]
    pub fn batch_size(mut self, n: usize) -> Self {
        self.batch_size = n.max(1);
        self
    }

    /// How many rows one lease takes at most.
    pub fn get_batch_size(&self) -> usize {
        self.batch_size
    }

    /// How long a lease holds: longer than a batch's sends take, or another relay sends the
    /// same rows again (harmless, the ids are the same, but out of order).
    #[must_use]
    pub fn lease_duration(mut self, d: Duration) -> Self {
        self.lease_duration = d.max(Duration::from_millis(100));
        self
    }

    /// How long a lease holds.
    pub fn get_lease_duration(&self) -> Duration {
        self.lease_duration
    }

    /// How often an idle relay looks for rows it was not woken for: written by other
    /// processes, or left by a relay that died.
    #[must_use]
    pub fn poll_interval(mut self, d: Duration) -> Self {
        self.poll_interval = d.max(Duration::from_millis(1));
        self
    }

    /// How often an idle relay looks for rows.
    pub fn get_poll_interval(&self) -> Duration {
        self.poll_interval
    }

    /// How many ordering keys are sent at once (at least 1).
    #[must_use]
    pub fn max_concurrent_sends(mut self, n: usize) -> Self {
        self.max_concurrent_sends = n.max(1);
        self
    }

    /// How many ordering keys are sent at once.
    pub fn get_max_concurrent_sends(&self) -> usize {
        self.max_concurrent_sends
    }

    /// How many bytes of bodies one batch to the broker ([`Publish::publish_batch`]) holds at
    /// most (a message larger than that goes alone). Keep it under the broker's largest
    /// message: Service Bus counts a batch as one message (256 KiB on the Standard tier).
    #[must_use]
    pub fn max_batch_bytes(mut self, bytes: usize) -> Self {
        self.max_batch_bytes = bytes.max(1);
        self
    }

    /// How many bytes of bodies one batch to the broker holds at most.
    pub fn get_max_batch_bytes(&self) -> usize {
        self.max_batch_bytes
    }

    /// The wait after a row's first failed send, doubling per failure up to `max`.
    #[must_use]
    pub fn backoff(mut self, initial: Duration, max: Duration) -> Self {
        self.initial_backoff = initial;
        self.max_backoff = max.max(initial);
        self
    }

    /// The backoff's first and longest wait.
    pub fn get_backoff(&self) -> (Duration, Duration) {
        (self.initial_backoff, self.max_backoff)
    }

    /// How often the relay reads the table's stats (for the gauges) and purges sent rows kept
    /// past their retention.
    #[must_use]
    pub fn stats_interval(mut self, d: Duration) -> Self {
        self.stats_interval = d.max(Duration::from_millis(10));
        self
    }

    /// How often the relay reads the table's stats.
    pub fn get_stats_interval(&self) -> Duration {
        self.stats_interval
    }

    /// How long rows the broker acknowledged may wait for their deletion (or, with a
    /// retention, their marking as sent), so that one statement covers the rows of many turns
    /// (default 100 ms). They are deleted sooner once ten batches of rows wait, when it
    /// shuts down, and, for a session's rows, before the relay reads the table (which would
    /// show them unsent, holding back the session's later rows); and never later than a
    /// quarter of the lease, so that no other relay takes them meanwhile. A relay that dies in
    /// this window leaves them to be sent again, with the same ids, once their leases end:
    /// what the broker's duplicate detection or the receiver's inbox drops. `Duration::ZERO`
    /// deletes them after every turn.
    #[must_use]
    pub fn mark_delay(mut self, d: Duration) -> Self {
        self.mark_delay = d;
        self
    }

    /// How long acknowledged rows wait for their deletion at most: the delay set, within a
    /// quarter of the lease.
    pub fn get_mark_delay(&self) -> Duration {
        self.mark_delay.min(self.lease_duration / 4)
    }

    /// The name the relay's leases carry (default: random, per relay).
    #[must_use]
    pub fn owner(mut self, owner: impl Into<String>) -> Self {
        self.owner = Some(owner.into());
        self
    }

    /// The name the relay's leases carry, if one was set.
    pub fn get_owner(&self) -> Option<&str> {
        self.owner.as_deref()
    }

    /// The clock of the lag and the waits.
    #[must_use]
    pub fn clock(mut self, clock: SharedClock) -> Self {
        self.clock = clock;
        self
    }

    /// The clock.
    pub fn get_clock(&self) -> &SharedClock {
        &self.clock
    }
}

/// A message the broker acknowledged, as the relay's `on_sent` hook sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Sent {
    /// The row's number.
    pub seq: i64,
    /// The message id it was sent with.
    pub message_id: MessageId,
    /// Where it went.
    pub destination: String,
    /// From the row's write to the broker's acknowledgement.
    pub lag: Duration,
}

/// What a relay did; read with [`RelayCounters::snapshot`].
#[derive(Debug, Default)]
pub struct RelayCounters {
    sent: AtomicU64,
    send_failures: AtomicU64,
    parked: AtomicU64,
    leases: AtomicU64,
    adopted: AtomicU64,
    store_errors: AtomicU64,
    lag_total_us: AtomicU64,
    lag_max_us: AtomicU64,
    pending: AtomicU64,
    parked_in_table: AtomicU64,
    oldest_pending_ms: AtomicU64,
}

/// A copy of a relay's counters at one moment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RelaySnapshot {
    /// Messages the broker acknowledged (a row sent again after a relay died counts again).
    pub sent: u64,
    /// Sends that failed and will be retried.
    pub send_failures: u64,
    /// Rows this relay parked.
    pub parked: u64,
    /// Leases that brought rows.
    pub leases: u64,
    /// Hand-overs of rows this process's commits wrote leased to the relay, taken over
    /// without a lease.
    pub adopted: u64,
    /// Store calls that failed.
    pub store_errors: u64,
    /// The mean lag from write to acknowledgement.
    pub mean_lag: Duration,
    /// The longest lag.
    pub max_lag: Duration,
    /// Rows not yet sent, at the last stats reading.
    pub pending: u64,
    /// Parked rows in the table, at the last stats reading.
    pub parked_in_table: u64,
    /// The age of the oldest unsent row at the last stats reading.
    pub oldest_pending_age: Duration,
}

impl RelayCounters {
    /// The counters now.
    pub fn snapshot(&self) -> RelaySnapshot {
        let sent = self.sent.load(Ordering::Relaxed);
        let total = self.lag_total_us.load(Ordering::Relaxed);
        RelaySnapshot {
            sent,
            send_failures: self.send_failures.load(Ordering::Relaxed),
            parked: self.parked.load(Ordering::Relaxed),
            leases: self.leases.load(Ordering::Relaxed),
            adopted: self.adopted.load(Ordering::Relaxed),
            store_errors: self.store_errors.load(Ordering::Relaxed),
            mean_lag: Duration::from_micros(total.checked_div(sent).unwrap_or(0)),
            max_lag: Duration::from_micros(self.lag_max_us.load(Ordering::Relaxed)),
            pending: self.pending.load(Ordering::Relaxed),
            parked_in_table: self.parked_in_table.load(Ordering::Relaxed),
            oldest_pending_age: Duration::from_millis(
                self.oldest_pending_ms.load(Ordering::Relaxed),
            ),
        }
    }

    fn record_sent(&self, sent: &Sent) {
        self.sent.fetch_add(1, Ordering::Relaxed);
        let us = u64::try_from(sent.lag.as_micros()).unwrap_or(u64::MAX);
        self.lag_total_us.fetch_add(us, Ordering::Relaxed);
        self.lag_max_us.fetch_max(us, Ordering::Relaxed);
        #[cfg(feature = "metrics")]
        {
            metrics::counter!("twice_outbox_sent_total", "destination" => sent.destination.clone())
                .increment(1);
            metrics::histogram!("twice_outbox_relay_lag_seconds").record(sent.lag.as_secs_f64());
        }
    }

    fn record_failure(&self) {
        self.send_failures.fetch_add(1, Ordering::Relaxed);
        #[cfg(feature = "metrics")]
        metrics::counter!("twice_outbox_send_failures_total").increment(1);
    }

    fn record_parked(&self) {
        self.parked.fetch_add(1, Ordering::Relaxed);
        #[cfg(feature = "metrics")]
        metrics::counter!("twice_outbox_parked_total").increment(1);
    }

    fn record_stats(&self, stats: &OutboxStats, now: Timestamp) {
        let age = stats.oldest_pending.map_or(Duration::ZERO, |t| now.duration_since(t));
        self.pending.store(stats.pending, Ordering::Relaxed);
        self.parked_in_table.store(stats.parked, Ordering::Relaxed);
        self.oldest_pending_ms
            .store(u64::try_from(age.as_millis()).unwrap_or(u64::MAX), Ordering::Relaxed);
        #[cfg(feature = "metrics")]
        {
            #[allow(clippy::cast_precision_loss)] // reason: a gauge; counts far below 2^53
            let (pending, parked) = (stats.pending as f64, stats.parked as f64);
            metrics::gauge!("twice_outbox_pending").set(pending);
            metrics::gauge!("twice_outbox_parked").set(parked);
            metrics::gauge!("twice_outbox_oldest_pending_seconds").set(age.as_secs_f64());
        }
    }
}

/// How long a relay that shuts down waits for the deletion of the rows it sent.
const FINAL_MARK_WAIT: Duration = Duration::from_secs(5);

type SentHook = Arc<dyn Fn(&Sent) + Send + Sync>;
type AckHook = Arc<dyn Fn(&[i64]) -> ControlFlow<()> + Send + Sync>;

/// What one concurrent send of a turn does: a destination's rows in batches, or one key's rows
/// one by one.
enum Work {
    Destination(String, Vec<LeasedMessage>),
    Key(Vec<LeasedMessage>),
}

/// The relay: sends an outbox's committed rows on a broker, in order per ordering key.
///
/// One turn: take the rows this process's commits handed over (written already leased to this
/// relay, see [`Wake`](super::Wake)), or else lease a batch of due rows from the table; send
/// each ordering key's rows in order (different keys concurrently). The rows the broker
/// acknowledged are deleted in one statement for many turns, within
/// [`RelayOptions::mark_delay`] (100 ms by default). A transient failure holds the rest of its
/// key back and retries the row after a backoff; a permanent one parks the row. Between turns
/// the relay sleeps until a local commit wakes it ([`Wake`](super::Wake)) or the poll interval
/// passes, which finds rows left by other processes and by relays that died.
///
/// With the `metrics` cargo feature the relay records, labelled by `destination` where it says
/// so:
///
/// | metric | kind | what |
/// |---|---|---|
/// | `twice_outbox_sent_total` | counter | messages the broker acknowledged, label `destination` |
/// | `twice_outbox_send_failures_total` | counter | sends that failed and will be retried |
/// | `twice_outbox_parked_total` | counter | rows parked by this relay |
/// | `twice_outbox_relay_lag_seconds` | histogram | from the row's write to the broker's acknowledgement |
/// | `twice_outbox_pending` | gauge | rows not yet sent (from the store, every stats interval) |
/// | `twice_outbox_oldest_pending_seconds` | gauge | age of the oldest of them |
/// | `twice_outbox_parked` | gauge | rows parked in the table |
///
/// See also the [outbox docs](crate::outbox).
pub struct Relay<S, P> {
    store: Arc<S>,
    publisher: Arc<P>,
    options: RelayOptions,
    owner: String,
    counters: Arc<RelayCounters>,
    on_sent: Option<SentHook>,
    on_acknowledged: Option<AckHook>,
}

impl<S, P> std::fmt::Debug for Relay<S, P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Relay")
            .field("owner", &self.owner)
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

impl<S: OutboxStore, P: Publish> Relay<S, P> {
    /// A relay of `store`'s rows to `publisher`.
    pub fn new(store: S, publisher: P, options: RelayOptions) -> Self {
        Self::from_arcs(Arc::new(store), Arc::new(publisher), options)
    }

    /// As [`Relay::new`], sharing the store and the publisher.
    pub fn from_arcs(store: Arc<S>, publisher: Arc<P>, options: RelayOptions) -> Self {
        let owner = options.owner.clone().unwrap_or_else(|| format!("relay-{:016x}", random_u64()));
        Self {
            store,
            publisher,
            options,
            owner,
            counters: Arc::default(),
            on_sent: None,
            on_acknowledged: None,
        }
    }

    /// The relay's counters, live.
    pub fn counters(&self) -> Arc<RelayCounters> {
        self.counters.clone()
    }

    /// The name its leases carry.
    pub fn owner(&self) -> &str {
        &self.owner
    }

    /// Calls `f` for every message the broker acknowledged, after its row was deleted (or
    /// when deleting it failed, since the broker has it either way).
    #[must_use]
    pub fn on_sent(mut self, f: impl Fn(&Sent) + Send + Sync + 'static) -> Self {
        self.on_sent = Some(Arc::new(f));
        self
    }

    /// Calls `f` with a turn's acknowledged rows between the broker's acknowledgement and
    /// their deletion: the window in which a relay that dies sends them again. When `f`
    /// returns [`ControlFlow::Break`] the relay stops there, its rows not deleted, as a crash
    /// would leave them (they go out again, with the same ids, once their leases end). For
    /// fault injection (`twice demo`, `twice chaos`).
    #[must_use]
    pub fn on_acknowledged(
        mut self,
        f: impl Fn(&[i64]) -> ControlFlow<()> + Send + Sync + 'static,
    ) -> Self {
        self.on_acknowledged = Some(Arc::new(f));
        self
    }

    /// Relays until `shutdown` resolves (or an [`on_acknowledged`](Relay::on_acknowledged)
    /// hook stops it). A turn under way when it does is cut off: its sends may have reached
    /// the broker, and its rows, still leased, are sent again (with the same ids) once their
    /// leases end. Rows acknowledged before are deleted first (waiting up to 5 s for the
    /// store); a hook that stops the relay leaves them, as a crash would.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe in the same sense: dropped, it leaves leases to expire, those of rows
    /// already sent and not yet deleted ([`RelayOptions::mark_delay`]) included.
    pub async fn run(self, shutdown: impl Future<Output = ()>) {
        let mut shutdown = std::pin::pin!(shutdown);
        let clock = self.options.clock.clone();
        let mut store_failures: u32 = 0;
        let mut next_stats = clock.now();
        let waker = self.store.waker().clone();
        let attached = waker.attach(&self.owner, self.options.lease_duration);
        // Rows this process's commits hand over are sent without a lease; the table itself is
        // read when a commit of rows written unleased wakes the relay, after a lease that
        // brought rows, and at least once per poll interval (rows of other processes, of
        // relays that died, held back by order).
        let mut next_lease = clock.now();
        let mut leased_last = false;
        // Acknowledged rows wait here for their deletion, which one statement does for many
        // turns' rows.
        let mut marks = Marks::<Sent>::default();
        let mark_delay = self.options.get_mark_delay();
        let mark_max = self.options.batch_size.saturating_mul(10);
        loop {
            if clock.now() >= next_stats {
                tokio::select! {
                    biased;
                    () = &mut shutdown => break,
                    () = self.housekeeping() => {}
                }
                next_stats = clock.now().saturating_add(self.options.stats_interval);
            }
            if marks.due(clock.now(), mark_delay, mark_max) {
                tokio::select! {
                    biased;
                    () = &mut shutdown => break,
                    () = self.mark(&mut marks) => {}
                }
            }
            // After a lease, what was handed over meanwhile goes first: a lease never returns
            // those rows (they are leased to this relay), and turns longer than the poll
            // interval must not starve them.
            let handed = if leased_last || clock.now() < next_lease {
                attached.take_handed()
            } else {
                Vec::new()
            };
            let adopting = !handed.is_empty();
            if !adopting && !leased_last && clock.now() < next_lease && !waker.take_lease_wanted() {
                // Only hand-overs woke the relay since it last read the table, and none waits:
                // the table is read when a commit of rows written unleased asks for it, or at
                // the poll.
                let wait = self.wait(next_lease, next_stats, marks.deadline(mark_delay));
                tokio::select! {
                    biased;
                    () = &mut shutdown => break,
                    () = waker.woken() => {}
                    () = clock.sleep(wait) => {}
                }
                continue;
            }
            leased_last = !adopting;
            // Rows handed over of a key only their own transaction writes go out as they are;
            // a session's rows, and rows whose lease may be near its end, are checked against
            // the table first.
            let now = clock.now();
            let fresh = self.options.lease_duration / 2;
            let (mut ready, check): (Vec<LeasedMessage>, Vec<LeasedMessage>) =
                handed.into_iter().partition(|r| {
                    !super::key_spans_transactions(&r.ordering_key)
                        && now.duration_since(r.created_at) < fresh
                });
            // A lease and a check read the table, where a session's rows sent and not yet
            // deleted would hold back the session's later rows.
            if (!adopting || !check.is_empty()) && marks.holds_order() {
                tokio::select! {
                    biased;
                    () = &mut shutdown => break,
                    () = self.mark(&mut marks) => {}
                }
            }
            let got = if adopting {
                let offered = check.len();
                let adopted = if check.is_empty() {
                    Ok(Vec::new())
                } else {
                    tokio::select! {
                        biased;
                        () = &mut shutdown => break,
                        r = self.store.adopt(&self.owner, check) => r,
                    }
                };
                if adopted.as_ref().map_or(true, |rows| rows.len() < offered) {
                    // Some are held back by order (or the store failed): read the table next.
                    next_lease = clock.now();
                }
                match adopted {
                    Ok(rows) => {
                        ready.extend(rows);
                        ready.sort_unstable_by_key(|r| r.seq);
                        Ok(ready)
                    }
                    // The checked rows stay leased until their leases end; the rest go.
                    Err(e) if !ready.is_empty() => {
                        self.counters.store_errors.fetch_add(1, Ordering::Relaxed);
                        tracing::warn!(owner = %self.owner, "checking handed rows failed: {e}");
                        Ok(ready)
                    }
                    Err(e) => Err(e),
                }
            } else {
                next_lease = clock.now().saturating_add(self.options.poll_interval);
                tokio::select! {
                    biased;
                    () = &mut shutdown => break,
                    r = self.store.lease(&self.owner, self.options.batch_size, self.options.lease_duration) => r,
                }
            };
            match got {
                Err(e) => {
                    store_failures = store_failures.saturating_add(1);
                    self.counters.store_errors.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(owner = %self.owner, "leasing outbox rows failed: {e}");
                    let wait = self.backoff(store_failures);
                    tokio::select! {
                        biased;
                        () = &mut shutdown => break,
                        () = clock.sleep(wait) => {}
                    }
                }
                Ok(batch) if batch.is_empty() => {
                    store_failures = 0;
                    if adopting {
                        continue;
                    }
                    let poll = clock.now().saturating_add(self.options.poll_interval);
                    let wait = self.wait(poll, next_stats, marks.deadline(mark_delay));
                    tokio::select! {
                        biased;
                        () = &mut shutdown => break,
                        () = waker.woken() => {}
                        () = clock.sleep(wait) => {}
                    }
                }
                Ok(batch) => {
                    store_failures = 0;
                    let counter =
                        if adopting { &self.counters.adopted } else { &self.counters.leases };
                    counter.fetch_add(1, Ordering::Relaxed);
                    let turned = tokio::select! {
                        biased;
                        () = &mut shutdown => break,
                        turned = self.turn(batch) => turned,
                    };
                    match turned {
                        ControlFlow::Continue((sent, holds_order)) => {
                            marks.add(sent, holds_order, clock.now());
                        }
                        ControlFlow::Break(()) => return,
                    }
                }
            }
        }
        if !marks.is_empty() {
            // What the broker acknowledged before the shutdown is deleted now, if the store
            // answers in time; otherwise it goes out again once its leases end.
            tokio::select! {
                biased;
                () = self.mark(&mut marks) => {}
                () = clock.sleep(FINAL_MARK_WAIT) => tracing::warn!(
                    owner = %self.owner,
                    "the outbox store did not answer within {FINAL_MARK_WAIT:?} at shutdown; \
                     rows already sent will be sent again with the same ids"
                ),
            }
        }
    }

    /// Deletes (or, with a retention, marks sent) the acknowledged rows waiting in `marks`,
    /// then calls the `on_sent` hook for each.
    async fn mark(&self, marks: &mut Marks<Sent>) {
        let sent = marks.take();
        if sent.is_empty() {
            return;
        }
        let seqs: Vec<i64> = sent.iter().map(|s: &Sent| s.seq).collect();
        match self.store.sent(&self.owner, &seqs).await {
            Ok(n) if n < seqs.len() as u64 => tracing::debug!(
                owner = %self.owner,
                acknowledged = seqs.len(),
                deleted = n,
                "some acknowledged rows were no longer leased by this relay (their lease ended)"
            ),
            Ok(_) => {}
            Err(e) => {
                self.counters.store_errors.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    owner = %self.owner,
                    "deleting {} sent outbox rows failed; they will be sent again with the same ids: {e}",
                    seqs.len()
                );
            }
        }
        if let Some(hook) = &self.on_sent {
            sent.iter().for_each(|s| hook(s));
        }
    }

    /// Sends the rows of one lease; returns the acknowledged ones and whether some rows were
    /// of a key other transactions write too, or breaks when the acknowledgement hook stops
    /// the relay.
    async fn turn(&self, batch: Vec<LeasedMessage>) -> ControlFlow<(), (Vec<Sent>, bool)> {
        let holds_order = batch.iter().any(|r| super::key_spans_transactions(&r.ordering_key));
        // Ordering keys in the order of their first row; each key's rows in `seq` order.
        let mut groups: Vec<Vec<LeasedMessage>> = Vec::new();
        let mut index: HashMap<String, usize> = HashMap::new();
        for row in batch {
            let i = *index.entry(row.ordering_key.clone()).or_insert_with(|| {
                groups.push(Vec::new());
                groups.len() - 1
            });
            groups[i].push(row);
        }
        // The keys whose rows all go to one destination, none held here for a schedule, are
        // sent in batches per destination (a batch keeps each key's rows in order); a key that
        // spans destinations is sent row by row, in order.
        let mut by_destination: Vec<(String, Vec<LeasedMessage>)> = Vec::new();
        let mut row_by_row: Vec<Vec<LeasedMessage>> = Vec::new();
        for group in groups {
            let destination = group[0].destination.clone();
            let batchable = group.iter().all(|r| {
                r.destination == destination
                    && (r.message.scheduled_enqueue_time.is_none() || self.publisher.schedules())
            });
            if !batchable {
                row_by_row.push(group);
            } else if let Some((_, rows)) =
                by_destination.iter_mut().find(|(d, _)| *d == destination)
            {
                rows.extend(group);
            } else {
                by_destination.push((destination, group));
            }
        }
        let sent = Mutex::new(Vec::new());
        let work = by_destination
            .into_iter()
            .map(|(destination, rows)| Work::Destination(destination, rows))
            .chain(row_by_row.into_iter().map(Work::Key));
        futures::stream::iter(work)
            .for_each_concurrent(self.options.max_concurrent_sends, |work| async {
                match work {
                    Work::Destination(destination, rows) => {
                        self.send_destination(&destination, rows, &sent).await;
                    }
                    Work::Key(group) => self.send_group(group, &sent).await,
                }
            })
            .await;
        let sent = sent.into_inner().unwrap_or_else(std::sync::PoisonError::into_inner);
        if !sent.is_empty()
            && let Some(hook) = &self.on_acknowledged
        {
            let seqs: Vec<i64> = sent.iter().map(|s: &Sent| s.seq).collect();
            hook(&seqs)?;
        }
        ControlFlow::Continue((sent, holds_order))
    }

    /// Sends the rows for one destination in batches, in order; a key whose batch failed for
    /// now waits (its first row behind a backoff, the rest released), and a batch refused for
    /// good is sent again row by row to find the message at fault.
    async fn send_destination(
        &self,
        destination: &str,
        rows: Vec<LeasedMessage>,
        sent: &Mutex<Vec<Sent>>,
    ) {
        let mut failed: HashSet<String> = HashSet::new();
        let mut rest = rows.into_iter().peekable();
        while rest.peek().is_some() {
            let mut chunk = Vec::new();
            let mut bytes = 0;
            while let Some(row) = rest.next_if(|r| {
                chunk.is_empty() || bytes + r.message.body.len() <= self.options.max_batch_bytes
            }) {
                bytes += row.message.body.len();
                chunk.push(row);
            }
            let (waiting, chunk): (Vec<_>, Vec<_>) =
                chunk.into_iter().partition(|r| failed.contains(&r.ordering_key));
            if !waiting.is_empty() {
                let seqs: Vec<i64> = waiting.iter().map(|r| r.seq).collect();
                self.store_call(self.store.release(&self.owner, &seqs)).await;
            }
            if chunk.is_empty() {
                continue;
            }
            let spans: Vec<tracing::Span> = chunk
                .iter()
                .map(|r| {
                    let id = r.message.message_id.clone().unwrap_or_else(|| MessageId::new(""));
                    self.span(destination, &id, &r.message)
                })
                .collect();
            let messages: Vec<crate::Message> = chunk.iter().map(|r| r.message.clone()).collect();
            let published = self.publisher.publish_batch(destination, messages).await;
            drop(spans);
            let BatchError { stored, error: e } = match published {
                Ok(()) => {
                    for row in chunk {
                        self.record(row, sent);
                    }
                    continue;
                }
                Err(e) => e,
            };
            let mut chunk = chunk.into_iter();
            for row in chunk.by_ref().take(stored) {
                self.record(row, sent);
            }
            let unsure: Vec<LeasedMessage> = chunk.collect();
            if unsure.is_empty() {
                continue;
            }
            if is_permanent(&e) && unsure.len() > 1 {
                // One of them is at fault: each on its own, in order.
                for row in unsure {
                    if failed.contains(&row.ordering_key) {
                        self.store_call(self.store.release(&self.owner, &[row.seq])).await;
                    } else if !self.send_one(row.clone(), sent).await {
                        failed.insert(row.ordering_key);
                    }
                }
            } else if is_permanent(&e) {
                let row = unsure.into_iter().next().unwrap_or_else(|| unreachable!());
                self.park(row, &e).await;
            } else {
                self.counters.record_failure();
                let error = e.to_string();
                tracing::info!(
                    destination = %destination,
                    rows = unsure.len(),
                    "sending a batch of outbox messages failed; their ordering keys wait: {e}"
                );
                for row in unsure {
                    if failed.insert(row.ordering_key.clone()) {
                        let delay = self.backoff(row.attempts.saturating_add(1));
                        let later =
                            self.store.retry_later(&self.owner, row.seq, delay, &error, true);
                        self.store_call(later).await;
                    } else {
                        self.store_call(self.store.release(&self.owner, &[row.seq])).await;
                    }
                }
            }
        }
    }

    /// Counts a row the broker acknowledged and keeps it for the deletion.
    fn record(&self, row: LeasedMessage, sent: &Mutex<Vec<Sent>>) {
        let lag = self.options.clock.now().duration_since(row.created_at);
        let id = row.message.message_id.unwrap_or_else(|| MessageId::new(""));
        let s = Sent { seq: row.seq, message_id: id, destination: row.destination, lag };
        self.counters.record_sent(&s);
        sent.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(s);
    }

    /// Parks a row the broker refused for good.
    async fn park(&self, row: LeasedMessage, e: &TransportError) {
        tracing::warn!(
            seq = row.seq,
            message_id = %row.message.message_id.as_ref().map_or("", |id| id.as_str()),
            destination = %row.destination,
            "the broker refused an outbox message for good; it is parked: {e}"
        );
        self.store_call(self.store.park(&self.owner, row.seq, &e.to_string())).await;
        self.counters.record_parked();
    }

    /// Sends one row; returns false when it failed for now (it then waits behind a backoff).
    async fn send_one(&self, row: LeasedMessage, sent: &Mutex<Vec<Sent>>) -> bool {
        let id = row.message.message_id.clone().unwrap_or_else(|| MessageId::new(""));
        let span = self.span(&row.destination, &id, &row.message);
        let published =
            self.publisher.publish(&row.destination, row.message.clone()).instrument(span).await;
        match published {
            Ok(()) => {
                self.record(row, sent);
                true
            }
            Err(e) if is_permanent(&e) => {
                self.park(row, &e).await;
                true
            }
            Err(e) => {
                self.counters.record_failure();
                let delay = self.backoff(row.attempts.saturating_add(1));
                let error = e.to_string();
                self.store_call(self.store.retry_later(&self.owner, row.seq, delay, &error, true))
                    .await;
                false
            }
        }
    }

    /// Sends one ordering key's rows in order, one by one; stops at the first transient
    /// failure (the rest of the key waits for it).
    async fn send_group(&self, group: Vec<LeasedMessage>, sent: &Mutex<Vec<Sent>>) {
        let mut rows = group.into_iter();
        while let Some(mut row) = rows.next() {
            let now = self.options.clock.now();
            if let Some(at) = row.message.scheduled_enqueue_time
                && !self.publisher.schedules()
            {
                if at > now {
                    // Held here until due, since this broker cannot hold it.
                    let delay = at.duration_since(now);
                    let held =
                        self.store.retry_later(&self.owner, row.seq, delay, "scheduled", false);
                    self.store_call(held).await;
                    continue;
                }
                row.message.scheduled_enqueue_time = None;
            }
            if !self.send_one(row, sent).await {
                let rest: Vec<i64> = rows.map(|r| r.seq).collect();
                if !rest.is_empty() {
                    self.store_call(self.store.release(&self.owner, &rest)).await;
                }
                return;
            }
        }
    }

    /// A store call whose failure only delays its rows (their leases expire instead).
    async fn store_call<T>(&self, call: impl Future<Output = Result<T, S::Error>>) {
        if let Err(e) = call.await {
            self.counters.store_errors.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(owner = %self.owner, "an outbox store call failed; the rows' leases will expire instead: {e}");
        }
    }

    /// Reads the stats for the gauges and purges sent rows past their retention.
    async fn housekeeping(&self) {
        match self.store.stats().await {
            Ok(stats) => self.counters.record_stats(&stats, self.options.clock.now()),
            Err(e) => {
                self.counters.store_errors.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(owner = %self.owner, "reading the outbox's stats failed: {e}");
            }
        }
        match self.store.purge_sent().await {
            Ok(0) => {}
            Ok(n) => tracing::debug!(rows = n, "purged sent outbox rows past their retention"),
            Err(e) => tracing::warn!(owner = %self.owner, "purging sent outbox rows failed: {e}"),
        }
    }

    /// The wait before retry number `n` (from 1), with jitter in its upper half.
    fn backoff(&self, n: u32) -> Duration {
        let doublings = n.saturating_sub(1).min(30);
        let full = self
            .options
            .initial_backoff
            .saturating_mul(1 << doublings)
            .min(self.options.max_backoff);
        #[allow(clippy::cast_precision_loss)] // reason: 53-bit value, exact in an f64
        let fraction = (random_u64() >> 11) as f64 / (1_u64 << 53) as f64;
        full / 2 + full.mul_f64(fraction / 2.0)
    }

    /// How long to wait for a wake: until `at`, the next stats reading or the deadline of the
    /// rows waiting for their deletion, whichever comes first.
    fn wait(&self, at: Timestamp, next_stats: Timestamp, marks: Option<Timestamp>) -> Duration {
        let wait = self.until(at).min(self.until(next_stats));
        marks.map_or(wait, |m| wait.min(self.until(m)))
    }

    fn until(&self, at: Timestamp) -> Duration {
        let now = self.options.clock.now();
        if at > now { at.duration_since(now) } else { Duration::ZERO }
    }

    /// The span of one send, linked to the trace the message carries (the incoming
    /// message's, for a handler's send).
    fn span(&self, destination: &str, id: &MessageId, message: &crate::Message) -> tracing::Span {
        let span = tracing::info_span!(
            "twice.publish",
            "otel.name" = %format_args!("send {destination}"),
            "otel.kind" = "producer",
            "messaging.system" = self.publisher.system(),
            "messaging.operation.type" = "send",
            "messaging.operation.name" = "send",
            "messaging.destination.name" = %destination,
            "messaging.message.id" = %id,
            "trace_parent" = tracing::field::Empty,
        );
        if let Some(parent) = trace_context::extract(message) {
            span.record("trace_parent", tracing::field::display(parent));
            #[cfg(feature = "opentelemetry")]
            trace_context::set_otel_parent(&span, &parent);
        }
        span
    }
}
