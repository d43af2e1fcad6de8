//! The inbox store: where claimed message ids live, inside the handler's own transaction.
//!
//! `twice` defines the trait and depends on no database driver; `twice-sqlx` implements it for
//! SQLite, PostgreSQL and MariaDB/MySQL, with `Tx = sqlx::Transaction<'static, DB>`, so a
//! handler's queries join the claim's transaction.

use std::error::Error as StdError;
use std::fmt;
use std::future::Future;
use std::time::Duration;

use crate::clock::Timestamp;
use crate::error::ErrorClass;
use crate::ids::MessageId;
use crate::outbox::{OutgoingMessage, Staged};

/// The result of claiming a message id.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Claim {
    /// This transaction holds the claim: run the handler in it.
    Claimed,
    /// Another transaction claimed the id and committed: the work is done.
    Duplicate {
        /// When the winning copy claimed the id, if the store could read it.
        claimed_at: Option<Timestamp>,
    },
    /// Dedup-only mode ([`Inbox::record`]): another attempt recorded the id and has not
    /// finished; its work may be under way. Wait for its outcome.
    InProgress {
        /// When that attempt recorded the id, if the store could read it.
        claimed_at: Option<Timestamp>,
    },
}

/// A store of claimed message ids with transactions that a handler's work joins.
///
/// The contract every implementation keeps:
///
/// - [`Inbox::claim`] is the first statement of the transaction and is *one* operation the
///   database decides: an insert of `(consumer, message_id)` under a primary key. It never
///   raises an error that poisons the transaction on a duplicate (PostgreSQL:
///   `ON CONFLICT DO NOTHING` and a row count).
/// - While another transaction holds an uncommitted claim on the same key, `claim` waits for
///   it: if it commits, `claim` returns [`Claim::Duplicate`]; if it rolls back, `claim` returns
///   [`Claim::Claimed`].
/// - Dropping a `Tx` without committing rolls it back.
pub trait Inbox: Send + Sync + fmt::Debug + 'static {
    /// An open transaction; the handler receives `&mut Tx`.
    type Tx: Send + 'static;
    /// The store's error.
    type Error: StdError + Send + Sync + 'static;

    /// How long claimed ids are kept; `None` keeps them forever.
    fn retention(&self) -> Option<Duration>;

    /// How many connections the store can hold at once (its pool's size), if it is bounded:
    /// every message in flight holds one, so the processor refuses to start with more
    /// concurrent calls than that. The default is unbounded.
    fn max_connections(&self) -> Option<u32> {
        None
    }

    /// Begins a transaction on a connection of its own.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a transaction begun but not returned is rolled back.
    fn begin(&self) -> impl Future<Output = Result<Self::Tx, Self::Error>> + Send;

    /// Begins the transaction of a message whose lock holds for `lock_wait` more (`None`: no
    /// lock), for its claim and its handler. A store bounds the transaction's waits for other
    /// transactions' locks by `lock_wait` where the database can, so that a copy waiting on
    /// another copy's claim ends its wait, and gives its connection back, when its own lock
    /// runs out (PostgreSQL: `SET LOCAL lock_timeout`). The default calls [`Inbox::begin`].
    ///
    /// # Cancel safety
    ///
    /// As [`Inbox::begin`].
    fn begin_within(
        &self,
        lock_wait: Option<Duration>,
    ) -> impl Future<Output = Result<Self::Tx, Self::Error>> + Send {
        let _ = lock_wait;
        self.begin()
    }

    /// Claims `message_id` for `consumer` inside `tx`, recording `now` as the claim time.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe in effect: dropping the future leaves `tx` in an unknown state, and the
    /// caller then drops `tx`, which rolls the claim back.
    fn claim<'a>(
        &'a self,
        tx: &'a mut Self::Tx,
        consumer: &'a str,
        message_id: &'a MessageId,
        now: Timestamp,
    ) -> impl Future<Output = Result<Claim, Self::Error>> + Send + 'a;

    /// Checks, after the handler returned [`Outcome::Complete`](crate::Outcome::Complete) and
    /// before the commit, that the transaction can still commit the handler's work: that the
    /// database did not abort or end it while the handler carried on (PostgreSQL aborts a
    /// transaction at any failed statement and then answers its COMMIT with a silent
    /// rollback; InnoDB rolls back a deadlock victim's whole transaction). An error here is
    /// the handler's failure: the transaction is rolled back and the message is not
    /// completed. The default finds nothing wrong, for stores whose commit itself fails in
    /// that case.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe in effect, as [`Inbox::claim`].
    fn check_committable<'a>(
        &'a self,
        tx: &'a mut Self::Tx,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send + 'a {
        let _ = tx;
        async { Ok(()) }
    }

    /// Whether the store has an outbox (see [`outbox`](crate::outbox)): only then does a
    /// handler's [`Context::send`](crate::Context::send) work. The default is no.
    fn has_outbox(&self) -> bool {
        false
    }

    /// Writes `messages`, which the handler sent, as outbox rows inside `tx`, after the
    /// handler returned [`Outcome::Complete`](crate::Outcome::Complete) and before the commit,
    /// so that they commit with its work or not at all. Called only with messages, and only
    /// when [`Inbox::has_outbox`] says yes: a store that says yes must implement it (the
    /// default writes nothing). After a stage that wrote rows the processor does not call
    /// [`Inbox::check_committable`]: the stage makes the same check (with the write itself
    /// where the database refuses every statement of an aborted transaction).
    ///
    /// The processor calls [`Staged::committed`] on what it returns once `tx` has committed:
    /// that wakes the relay of this process, and hands it the rows the store wrote leased to
    /// it ([`Wake::local_relay`](crate::outbox::Wake::local_relay)).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe in effect, as [`Inbox::claim`].
    fn stage<'a>(
        &'a self,
        tx: &'a mut Self::Tx,
        messages: &'a [OutgoingMessage],
    ) -> impl Future<Output = Result<Staged, Self::Error>> + Send + 'a {
        let _ = (tx, messages);
        async { Ok(Staged::nothing()) }
    }

    /// Whether the store can process a batch of messages in one transaction
    /// ([`ProcessorOptions::batch_size`](crate::ProcessorOptions::batch_size)): claim them in
    /// one operation ([`Inbox::claim_batch`]), run each handler under a savepoint
    /// ([`Inbox::savepoint`]), roll one handler's work back alone
    /// ([`Inbox::rollback_to_savepoint`]) and take its claim back ([`Inbox::unclaim`]). The
    /// default is no; a store that says yes must implement those three.
    fn supports_batches(&self) -> bool {
        false
    }

    /// Claims each of `message_ids` (distinct) for `consumer` inside `tx`, recording `now`,
    /// and returns one [`Claim`] per id, in the same order. It waits on ids that other
    /// transactions hold, as [`Inbox::claim`] does. The default claims them one by one; a
    /// store does better with one statement.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe in effect, as [`Inbox::claim`].
    fn claim_batch<'a>(
        &'a self,
        tx: &'a mut Self::Tx,
        consumer: &'a str,
        message_ids: &'a [MessageId],
        now: Timestamp,
    ) -> impl Future<Output = Result<Vec<Claim>, Self::Error>> + Send + 'a {
        async move {
            let mut claims = Vec::with_capacity(message_ids.len());
            for id in message_ids {
                claims.push(self.claim(tx, consumer, id, now).await?);
            }
            Ok(claims)
        }
    }

    /// Sets a savepoint inside `tx`, where one handler's work in a batch begins. Called only
    /// when [`Inbox::supports_batches`] says yes.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe in effect, as [`Inbox::claim`].
    fn savepoint<'a>(
        &'a self,
        tx: &'a mut Self::Tx,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send + 'a {
        let _ = tx;
        async { Ok(()) }
    }

    /// Rolls `tx` back to the last [savepoint](Inbox::savepoint), which stays set: one
    /// handler's work is undone, the rest of the batch is kept. Called only when
    /// [`Inbox::supports_batches`] says yes. An error (the database rolled the whole
    /// transaction back, as InnoDB does to a deadlock's victim) fails the whole batch.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe in effect, as [`Inbox::claim`].
    fn rollback_to_savepoint<'a>(
        &'a self,
        tx: &'a mut Self::Tx,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send + 'a {
        let _ = tx;
        async { Ok(()) }
    }

    /// Takes back, inside `tx`, the claim of `message_id` that `tx` made: the message's work
    /// was rolled back, and a redelivery must run it again. Called only when
    /// [`Inbox::supports_batches`] says yes.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe in effect, as [`Inbox::claim`].
    fn unclaim<'a>(
        &'a self,
        tx: &'a mut Self::Tx,
        consumer: &'a str,
        message_id: &'a MessageId,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send + 'a {
        let _ = (tx, consumer, message_id);
        async { Ok(()) }
    }

    /// Commits the transaction.
    fn commit(&self, tx: Self::Tx) -> impl Future<Output = Result<(), Self::Error>> + Send;

    /// Rolls the transaction back.
    fn rollback(&self, tx: Self::Tx) -> impl Future<Output = Result<(), Self::Error>> + Send;

    /// Records `message_id` for `consumer` as claimed by `owner` (a token unique to one
    /// processing of one delivery) in a transaction of its own, and commits it at once (the
    /// dedup-only mode, [`Mode::DedupOnly`](crate::Mode::DedupOnly)).
    ///
    /// Returns [`Claim::Claimed`] when the id was not recorded, or is recorded as claimed by
    /// this same `owner` (a retry of the same processing after a commit of unknown outcome);
    /// [`Claim::Duplicate`] when it is recorded as done (by [`Inbox::finish`], or by a claim);
    /// [`Claim::InProgress`] when another owner holds it claimed.
    fn record<'a>(
        &'a self,
        consumer: &'a str,
        message_id: &'a MessageId,
        owner: &'a str,
        now: Timestamp,
    ) -> impl Future<Output = Result<Claim, Self::Error>> + Send + 'a;

    /// Marks the record `owner` made with [`Inbox::record`] as done, inside `tx`, the
    /// transaction of the handler's work, so that the mark commits with that work or not at
    /// all. Returns whether the record was there, claimed by `owner`.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe in effect, as [`Inbox::claim`].
    fn finish<'a>(
        &'a self,
        tx: &'a mut Self::Tx,
        consumer: &'a str,
        message_id: &'a MessageId,
        owner: &'a str,
    ) -> impl Future<Output = Result<bool, Self::Error>> + Send + 'a;

    /// Removes the record `owner` made with [`Inbox::record`] if it is still claimed by
    /// `owner`, so that a message whose work failed is processed again when it is redelivered.
    /// Never removes another owner's record, nor a done one. Returns whether a record was
    /// removed.
    fn forget<'a>(
        &'a self,
        consumer: &'a str,
        message_id: &'a MessageId,
        owner: &'a str,
    ) -> impl Future<Output = Result<bool, Self::Error>> + Send + 'a;

    /// Classifies an error a handler raised with `?`: the violation of a registered business
    /// key, transient, permanent or unknown. Implementations look at error codes (SQLSTATE,
    /// error numbers) and constraint names, never at message text alone.
    fn classify(&self, error: &(dyn StdError + 'static)) -> ErrorClass;
}
