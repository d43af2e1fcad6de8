//! The outbox store: where outgoing messages wait, as rows, until a relay has sent them.

use std::error::Error as StdError;
use std::fmt;
use std::future::Future;
use std::time::Duration;

use super::Wake;
use crate::clock::Timestamp;
use crate::message::Message;

/// A row a relay has leased: it alone sends it until the lease ends.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct LeasedMessage {
    /// The row's number: rows of one ordering key are sent in this order.
    pub seq: i64,
    /// Where it goes.
    pub destination: String,
    /// The message, its id set.
    pub message: Message,
    /// Rows of one key are sent in order.
    pub ordering_key: String,
    /// When it was written (the writer's clock).
    pub created_at: Timestamp,
    /// How many sends of it failed so far.
    pub attempts: u32,
}

impl LeasedMessage {
    /// A leased row; stores build these.
    pub fn new(
        seq: i64,
        destination: String,
        message: Message,
        ordering_key: String,
        created_at: Timestamp,
        attempts: u32,
    ) -> Self {
        Self { seq, destination, message, ordering_key, created_at, attempts }
    }
}

/// What an outbox holds, for gauges and tooling.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct OutboxStats {
    /// Rows not yet sent (parked ones excluded).
    pub pending: u64,
    /// When the oldest of them was written.
    pub oldest_pending: Option<Timestamp>,
    /// Rows parked: refused by the broker for good, kept with their reason.
    pub parked: u64,
    /// Rows sent and kept for the retention.
    pub sent: u64,
}

impl OutboxStats {
    /// Stats; stores build these.
    pub fn new(pending: u64, oldest_pending: Option<Timestamp>, parked: u64, sent: u64) -> Self {
        Self { pending, oldest_pending, parked, sent }
    }
}

/// A table of outgoing messages that relays lease, send and then delete.
///
/// The contract every implementation keeps:
///
/// - [`OutboxStore::lease`] hands out only committed, unsent, unparked rows that are due and
///   that no live lease holds, and never a row while an earlier unsent, unparked row of its
///   ordering key is not handed out with it: rows of one key go out in order whichever relay
///   sends them.
/// - Two relays leasing at once never both get a row (in the normal case; a lease that
///   expires hands its rows on).
/// - [`OutboxStore::sent`], [`OutboxStore::retry_later`], [`OutboxStore::park`] and
///   [`OutboxStore::release`] act only on rows `owner` still leases.
pub trait OutboxStore: Send + Sync + fmt::Debug + 'static {
    /// The store's error.
    type Error: StdError + Send + Sync + 'static;

    /// The waker of a relay serving this store in this process: rung when a transaction that
    /// wrote rows has committed.
    fn waker(&self) -> &Wake;

    /// Leases up to `max` rows for `lease` as `owner`, in order of `seq`.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a lease cut off is either not taken or taken and left to expire.
    fn lease<'a>(
        &'a self,
        owner: &'a str,
        max: usize,
        lease: Duration,
    ) -> impl Future<Output = Result<Vec<LeasedMessage>, Self::Error>> + Send + 'a;

    /// Takes over `rows`, which this process wrote already leased to `owner` and handed over
    /// after their commit ([`Wake`]): returns those that may be sent now, in order of `seq`.
    /// A row not handed out is one whose ordering key has an earlier unsent row that is not
    /// among `rows` (written by another process, or waiting out a backoff), or one no longer
    /// leased to `owner` (its lease ended, or it is gone); rows held back by order are
    /// released, for [`OutboxStore::lease`] to hand out in order.
    ///
    /// The default releases them all: a store that never writes rows leased has nothing to
    /// take over.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: cut off, the rows stay leased until their leases end.
    fn adopt<'a>(
        &'a self,
        owner: &'a str,
        rows: Vec<LeasedMessage>,
    ) -> impl Future<Output = Result<Vec<LeasedMessage>, Self::Error>> + Send + 'a {
        async move {
            let seqs: Vec<i64> = rows.iter().map(|r| r.seq).collect();
            self.release(owner, &seqs).await?;
            Ok(Vec::new())
        }
    }

    /// The broker has stored these rows: they are deleted (or marked sent and kept for the
    /// retention). Returns how many `owner` still leased.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe in effect: rows not marked are sent again, with the same ids.
    fn sent<'a>(
        &'a self,
        owner: &'a str,
        seqs: &'a [i64],
    ) -> impl Future<Output = Result<u64, Self::Error>> + Send + 'a;

    /// The send of row `seq` failed for now: its lease ends, it is not due again before
    /// `delay`, and the failure is counted with `error` unless `counted` is false (a row held
    /// for its scheduled time).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: cut off, the lease expires instead.
    fn retry_later<'a>(
        &'a self,
        owner: &'a str,
        seq: i64,
        delay: Duration,
        error: &'a str,
        counted: bool,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send + 'a;

    /// Ends `owner`'s leases on rows it did not try.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: cut off, the leases expire instead.
    fn release<'a>(
        &'a self,
        owner: &'a str,
        seqs: &'a [i64],
    ) -> impl Future<Output = Result<(), Self::Error>> + Send + 'a;

    /// The broker refused row `seq` for good: it is parked with `reason` and never sent
    /// again unless an operator retries it.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: cut off, the lease expires and the row is tried again.
    fn park<'a>(
        &'a self,
        owner: &'a str,
        seq: i64,
        reason: &'a str,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send + 'a;

    /// What the table holds.
    fn stats(&self) -> impl Future<Output = Result<OutboxStats, Self::Error>> + Send;

    /// Deletes, in bounded batches, the sent rows kept past their retention; returns how many.
    fn purge_sent(&self) -> impl Future<Output = Result<u64, Self::Error>> + Send;
}
