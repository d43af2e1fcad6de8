//! An in-memory inbox that keeps the store contract (a claim waits for a concurrent
//! uncommitted claim; dropping a transaction rolls it back) and can be told to fail, and an
//! in-memory transport that records how each delivery was settled.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::Notify;
use twice::outbox::{LeasedMessage, OutboxStats, OutboxStore, Staged, Wake};
use twice::{
    Claim, DeadLetterReason, EntityInfo, ErrorClass, Inbox, Message, MessageId, OutgoingMessage,
    Properties, Receive, ReceivedMessage, SequenceNumber, Timestamp, Transport, TransportError,
};

type Key = (String, MessageId);

#[derive(Debug, Default)]
struct State {
    committed: BTreeMap<Key, Timestamp>,
    pending: BTreeSet<Key>,
    /// Dedup-only records claimed and not yet done: when, and by which owner.
    recorded: BTreeMap<Key, (Timestamp, String)>,
    /// The work of committed transactions, in commit order.
    work: Vec<String>,
}

#[derive(Debug, Default)]
struct Shared {
    state: Mutex<State>,
    /// Signalled when a pending claim ends.
    ended: Notify,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Failures the inbox can be told to produce.
#[derive(Debug, Default)]
pub struct Faults {
    /// The next this many begins fail as if no connection came in time.
    pub begin_failures: AtomicUsize,
    /// The next this many commits commit and then report a lost connection (the outcome is
    /// unknown to the caller).
    pub commits_lost_after: AtomicUsize,
    /// The next this many claims fail as a read-only database refuses a write (an error the
    /// store cannot classify).
    pub claim_failures: AtomicUsize,
}

/// The inbox's errors.
#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    /// No connection (transient).
    #[error("no connection to the store")]
    Unavailable,
    /// The transaction was aborted by the store.
    #[error("the transaction was aborted")]
    Aborted,
    /// The store refused the write, for a reason it does not classify.
    #[error("cannot execute INSERT in a read-only transaction")]
    ReadOnly,
}

#[derive(Debug, Default)]
pub struct MemoryInbox {
    shared: Arc<Shared>,
    pub faults: Faults,
    pub connections: Option<u32>,
    /// Where a handler's sends go once its transaction commits, if anywhere.
    pub outbox: Option<Arc<MemoryOutbox>>,
}

/// A transaction: its claim and its work, kept only if it commits.
#[derive(Debug)]
pub struct MemoryTx {
    shared: Arc<Shared>,
    claim: Option<Key>,
    claimed_at: Timestamp,
    /// A dedup-only record to mark done at commit, with its owner.
    finish: Option<(Key, String)>,
    pub work: Vec<String>,
    /// Set by a handler to play a statement that failed and aborted the transaction (as on
    /// PostgreSQL): the commit then keeps nothing, and says nothing.
    pub aborted: bool,
    /// Outgoing messages staged in this transaction.
    outgoing: Vec<OutgoingMessage>,
}

impl Drop for MemoryTx {
    fn drop(&mut self) {
        if let Some(key) = self.claim.take() {
            self.shared.lock().pending.remove(&key);
            self.shared.ended.notify_waiters();
        }
    }
}

fn take_one(n: &AtomicUsize) -> bool {
    n.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).is_ok()
}

impl MemoryInbox {
    /// The committed work, in order.
    pub fn work(&self) -> Vec<String> {
        self.shared.lock().work.clone()
    }

    /// How many ids are claimed and committed.
    pub fn claims(&self) -> usize {
        self.shared.lock().committed.len()
    }
}

impl Inbox for MemoryInbox {
    type Tx = MemoryTx;
    type Error = MemoryError;

    fn retention(&self) -> Option<Duration> {
        None
    }

    fn max_connections(&self) -> Option<u32> {
        self.connections
    }

    async fn begin(&self) -> Result<MemoryTx, MemoryError> {
        if take_one(&self.faults.begin_failures) {
            return Err(MemoryError::Unavailable);
        }
        Ok(MemoryTx {
            shared: self.shared.clone(),
            claim: None,
            claimed_at: Timestamp::from_millis(0),
            finish: None,
            work: Vec::new(),
            aborted: false,
            outgoing: Vec::new(),
        })
    }

    async fn claim<'a>(
        &'a self,
        tx: &'a mut MemoryTx,
        consumer: &'a str,
        id: &'a MessageId,
        now: Timestamp,
    ) -> Result<Claim, MemoryError> {
        if take_one(&self.faults.claim_failures) {
            return Err(MemoryError::ReadOnly);
        }
        let key = (consumer.to_owned(), id.clone());
        loop {
            let ended = self.shared.ended.notified();
            let mut ended = std::pin::pin!(ended);
            ended.as_mut().enable();
            {
                let mut state = self.shared.lock();
                if let Some(at) = state.committed.get(&key) {
                    return Ok(Claim::Duplicate { claimed_at: Some(*at) });
                }
                if state.pending.insert(key.clone()) {
                    tx.claim = Some(key);
                    tx.claimed_at = now;
                    return Ok(Claim::Claimed);
                }
            }
            // Another transaction holds the key: wait for it to end, as a database does.
            ended.await;
        }
    }

    fn has_outbox(&self) -> bool {
        self.outbox.is_some()
    }

    async fn stage<'a>(
        &'a self,
        tx: &'a mut MemoryTx,
        messages: &'a [OutgoingMessage],
    ) -> Result<Staged, MemoryError> {
        tx.outgoing.extend_from_slice(messages);
        Ok(self.outbox.as_ref().map_or_else(Staged::nothing, |o| Staged::wake(o.wake.clone())))
    }

    async fn check_committable<'a>(&'a self, tx: &'a mut MemoryTx) -> Result<(), MemoryError> {
        if tx.aborted { Err(MemoryError::Aborted) } else { Ok(()) }
    }

    async fn commit(&self, mut tx: MemoryTx) -> Result<(), MemoryError> {
        if tx.aborted {
            // PostgreSQL's answer to COMMIT of an aborted transaction: a rollback, no error.
            return Ok(());
        }
        {
            let mut state = self.shared.lock();
            if let Some(key) = tx.claim.take() {
                state.pending.remove(&key);
                state.committed.insert(key, tx.claimed_at);
            }
            state.work.append(&mut tx.work);
            if let Some(outbox) = &self.outbox {
                outbox.rows.lock().expect("rows").append(&mut tx.outgoing);
            }
            if let Some((key, owner)) = tx.finish.take()
                && state.recorded.get(&key).is_some_and(|(_, o)| *o == owner)
                && let Some((at, _)) = state.recorded.remove(&key)
            {
                state.committed.insert(key, at);
            }
        }
        self.shared.ended.notify_waiters();
        if take_one(&self.faults.commits_lost_after) {
            return Err(MemoryError::Unavailable);
        }
        Ok(())
    }

    async fn rollback(&self, tx: MemoryTx) -> Result<(), MemoryError> {
        drop(tx);
        Ok(())
    }

    async fn record<'a>(
        &'a self,
        consumer: &'a str,
        id: &'a MessageId,
        owner: &'a str,
        now: Timestamp,
    ) -> Result<Claim, MemoryError> {
        let mut state = self.shared.lock();
        let key = (consumer.to_owned(), id.clone());
        if let Some(at) = state.committed.get(&key) {
            return Ok(Claim::Duplicate { claimed_at: Some(*at) });
        }
        match state.recorded.get(&key) {
            Some((_, o)) if o == owner => Ok(Claim::Claimed),
            Some((at, _)) => Ok(Claim::InProgress { claimed_at: Some(*at) }),
            None => {
                state.recorded.insert(key, (now, owner.to_owned()));
                Ok(Claim::Claimed)
            }
        }
    }

    async fn finish<'a>(
        &'a self,
        tx: &'a mut MemoryTx,
        consumer: &'a str,
        id: &'a MessageId,
        owner: &'a str,
    ) -> Result<bool, MemoryError> {
        let key = (consumer.to_owned(), id.clone());
        let held = self.shared.lock().recorded.get(&key).is_some_and(|(_, o)| o == owner);
        tx.finish = Some((key, owner.to_owned()));
        Ok(held)
    }

    async fn forget<'a>(
        &'a self,
        consumer: &'a str,
        id: &'a MessageId,
        owner: &'a str,
    ) -> Result<bool, MemoryError> {
        let mut state = self.shared.lock();
        let key = (consumer.to_owned(), id.clone());
        if state.recorded.get(&key).is_some_and(|(_, o)| o == owner) {
            state.recorded.remove(&key);
            return Ok(true);
        }
        Ok(false)
    }

    fn classify(&self, error: &(dyn std::error::Error + 'static)) -> ErrorClass {
        match error.downcast_ref::<MemoryError>() {
            Some(MemoryError::Unavailable) => ErrorClass::Transient,
            _ => ErrorClass::Unknown,
        }
    }
}

/// How the transport was asked to settle a delivery.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Settled {
    Complete,
    Abandon,
    /// Unlocked without counting a delivery.
    Release,
    DeadLetter(DeadLetterReason),
    Defer,
    RedeliverLater(Duration),
}

/// A queue in memory without locks (nothing expires), MaxDeliveryCount 10, that can redeliver
/// later (at once, recording the delay).
#[derive(Debug)]
pub struct MemoryTransport {
    entity: EntityInfo,
    queue: Mutex<VecDeque<ReceivedMessage>>,
    arrived: Notify,
    sequence: AtomicI64,
    settled: Mutex<Vec<(Option<MessageId>, u32, Settled)>>,
    pub redeliver_later_supported: AtomicBool,
    /// While true, a completion waits (unrecorded) until it is set to false.
    hold_completions: tokio::sync::watch::Sender<bool>,
    /// Completions that have started, held or not.
    completions_started: AtomicUsize,
    /// The next this many completions fail because the lock was lost (after the hold).
    pub completions_lock_lost: AtomicUsize,
    /// When set, a renewal returns this locked-until (a lock the broker will not extend past
    /// it) instead of extending the lock without end.
    pub renew_cap: Mutex<Option<Timestamp>>,
    /// Renewals asked for. Past 10,000 a renewal fails with lock-lost, so that a keeper that
    /// renews in a loop ends.
    pub renew_calls: AtomicUsize,
}

impl MemoryTransport {
    pub fn new() -> Self {
        Self {
            entity: EntityInfo::new("orders"),
            queue: Mutex::default(),
            arrived: Notify::new(),
            sequence: AtomicI64::new(0),
            settled: Mutex::default(),
            redeliver_later_supported: AtomicBool::new(true),
            hold_completions: tokio::sync::watch::Sender::new(false),
            completions_started: AtomicUsize::new(0),
            completions_lock_lost: AtomicUsize::new(0),
            renew_cap: Mutex::new(None),
            renew_calls: AtomicUsize::new(0),
        }
    }

    /// Holds every completion from now on (`true`) until released (`false`).
    pub fn hold_completions(&self, hold: bool) {
        self.hold_completions.send_replace(hold);
    }

    /// How many completions have started (the held ones included).
    pub fn completions_started(&self) -> usize {
        self.completions_started.load(Ordering::SeqCst)
    }

    pub fn send(&self, message: Message) {
        let n = self.sequence.fetch_add(1, Ordering::SeqCst);
        let received =
            ReceivedMessage::new(message, SequenceNumber::new(n), Timestamp::from_millis(0));
        self.push(received);
    }

    pub fn push(&self, message: ReceivedMessage) {
        self.queue.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push_back(message);
        self.arrived.notify_one();
    }

    /// Every settlement so far: (message id, delivery count, how).
    pub fn settled(&self) -> Vec<(Option<MessageId>, u32, Settled)> {
        self.settled.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }

    fn record(&self, d: &ReceivedMessage, how: Settled) {
        let entry = (d.message.message_id.clone(), d.delivery_count, how);
        self.settled.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(entry);
    }
}

impl Receive for MemoryTransport {
    type Delivery = ReceivedMessage;

    async fn receive(
        &self,
        max_messages: usize,
        max_wait: Duration,
    ) -> Result<Vec<ReceivedMessage>, TransportError> {
        let wait = async {
            loop {
                let arrived = self.arrived.notified();
                {
                    let mut queue =
                        self.queue.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                    if !queue.is_empty() {
                        let n = max_messages.min(queue.len());
                        return queue.drain(..n).collect();
                    }
                }
                arrived.await;
            }
        };
        Ok(tokio::time::timeout(max_wait, wait).await.unwrap_or_default())
    }

    async fn complete(&self, d: &ReceivedMessage) -> Result<(), TransportError> {
        self.completions_started.fetch_add(1, Ordering::SeqCst);
        let mut hold = self.hold_completions.subscribe();
        // The sender lives as long as the transport, so waiting cannot fail.
        let _ = hold.wait_for(|held| !*held).await;
        if take_one(&self.completions_lock_lost) {
            return Err(TransportError::LockLost);
        }
        self.record(d, Settled::Complete);
        Ok(())
    }

    async fn abandon(&self, d: &ReceivedMessage, props: Properties) -> Result<(), TransportError> {
        self.record(d, Settled::Abandon);
        let mut again = d.clone();
        again.delivery_count += 1;
        again.message.application_properties.extend(props);
        if again.delivery_count <= 10 {
            self.push(again);
        }
        Ok(())
    }

    async fn dead_letter(
        &self,
        d: &ReceivedMessage,
        reason: DeadLetterReason,
    ) -> Result<(), TransportError> {
        self.record(d, Settled::DeadLetter(reason));
        Ok(())
    }

    async fn defer(&self, d: &ReceivedMessage) -> Result<(), TransportError> {
        self.record(d, Settled::Defer);
        Ok(())
    }
}

impl Transport for MemoryTransport {
    fn entity(&self) -> &EntityInfo {
        &self.entity
    }

    fn system(&self) -> &'static str {
        "memory"
    }

    async fn release(&self, d: &ReceivedMessage) -> Result<(), TransportError> {
        self.record(d, Settled::Release);
        self.push(d.clone());
        Ok(())
    }

    async fn renew_lock(&self, _: &ReceivedMessage) -> Result<Timestamp, TransportError> {
        if self.renew_calls.fetch_add(1, Ordering::SeqCst) >= 10_000 {
            return Err(TransportError::LockLost);
        }
        let cap = *self.renew_cap.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        Ok(cap.unwrap_or(Timestamp::MAX))
    }

    async fn redeliver_later(
        &self,
        d: &ReceivedMessage,
        delay: Duration,
        props: Properties,
    ) -> Result<(), TransportError> {
        if !self.redeliver_later_supported.load(Ordering::SeqCst) {
            return Err(TransportError::Unsupported("delayed redelivery"));
        }
        self.record(d, Settled::RedeliverLater(delay));
        let mut again = d.clone();
        again.message.application_properties.extend(props);
        self.push(again);
        Ok(())
    }
}

/// An outbox in memory: committed rows, leased whole by one relay, deleted when sent.
#[derive(Debug, Default)]
pub struct MemoryOutbox {
    pub rows: Mutex<Vec<OutgoingMessage>>,
    wake: Wake,
}

impl OutboxStore for MemoryOutbox {
    type Error = MemoryError;

    fn waker(&self) -> &Wake {
        &self.wake
    }

    async fn lease<'a>(
        &'a self,
        _owner: &'a str,
        max: usize,
        _lease: Duration,
    ) -> Result<Vec<LeasedMessage>, MemoryError> {
        let mut rows = self.rows.lock().expect("rows");
        let n = max.min(rows.len());
        Ok(rows
            .drain(..n)
            .zip(1..)
            .map(|(r, seq)| {
                LeasedMessage::new(seq, r.destination, r.message, r.ordering_key, r.created_at, 0)
            })
            .collect())
    }

    async fn sent<'a>(&'a self, _owner: &'a str, seqs: &'a [i64]) -> Result<u64, MemoryError> {
        Ok(seqs.len() as u64)
    }

    async fn retry_later<'a>(
        &'a self,
        _: &'a str,
        _: i64,
        _: Duration,
        _: &'a str,
        _: bool,
    ) -> Result<(), MemoryError> {
        Ok(())
    }

    async fn release<'a>(&'a self, _: &'a str, _: &'a [i64]) -> Result<(), MemoryError> {
        Ok(())
    }

    async fn park<'a>(&'a self, _: &'a str, _: i64, _: &'a str) -> Result<(), MemoryError> {
        Ok(())
    }

    async fn stats(&self) -> Result<OutboxStats, MemoryError> {
        let pending = self.rows.lock().expect("rows").len() as u64;
        Ok(OutboxStats::new(pending, None, 0, 0))
    }

    async fn purge_sent(&self) -> Result<u64, MemoryError> {
        Ok(0)
    }
}
