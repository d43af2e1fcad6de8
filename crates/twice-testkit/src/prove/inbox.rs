//! The inbox as one simulated processor sees it: the user's store, with every claim's outcome
//! recorded, a crash before a message's claim, and a cut connection during its COMMIT.

use std::error::Error as StdError;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use twice::{Claim, ErrorClass, Inbox, MessageId, OutgoingMessage, Timestamp};

use super::probe::{Event, Probe};

/// The store of processor `p`: every call goes to `inner`.
pub(super) struct Faulted<I> {
    pub(super) inner: Arc<I>,
    pub(super) probe: Arc<Probe>,
    pub(super) p: usize,
    /// Shared with the processor's transport: once set, nothing reaches the broker.
    pub(super) crashed: Arc<AtomicBool>,
}

impl<I: fmt::Debug> fmt::Debug for Faulted<I> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Faulted").field("inner", &self.inner).field("p", &self.p).finish()
    }
}

impl<I> Faulted<I> {
    /// Where a processor armed to die before its claim dies: at the first step of the
    /// message's transaction (its `BEGIN`, or the record of dedup-only mode), before anything
    /// of the message reaches the store. The process is gone: this never returns, and the
    /// scenario kills the processor's task.
    async fn maybe_die(&self) {
        let Some(id) = self.probe.take_crash_before_claim(self.p) else { return };
        self.crashed.store(true, Ordering::SeqCst);
        self.probe.push(Event::Fault { p: self.p, id, what: "died before its claim" });
        std::future::pending::<()>().await;
    }

    fn claimed(&self, id: &MessageId, claim: &Claim) {
        let outcome = match claim {
            Claim::Claimed => "claimed",
            Claim::Duplicate { .. } => "a duplicate",
            Claim::InProgress { .. } => "in progress elsewhere",
            _ => "another outcome",
        };
        self.probe.push(Event::Claim { p: self.p, id: id.as_str().to_owned(), outcome });
    }
}

impl<I: Inbox> Inbox for Faulted<I> {
    type Tx = I::Tx;
    type Error = I::Error;

    fn retention(&self) -> Option<Duration> {
        self.inner.retention()
    }

    fn max_connections(&self) -> Option<u32> {
        self.inner.max_connections()
    }

    async fn begin(&self) -> Result<I::Tx, I::Error> {
        self.maybe_die().await;
        self.inner.begin().await
    }

    async fn begin_within(&self, lock_wait: Option<Duration>) -> Result<I::Tx, I::Error> {
        self.maybe_die().await;
        self.inner.begin_within(lock_wait).await
    }

    async fn claim<'a>(
        &'a self,
        tx: &'a mut I::Tx,
        consumer: &'a str,
        message_id: &'a MessageId,
        now: Timestamp,
    ) -> Result<Claim, I::Error> {
        let claim = self.inner.claim(tx, consumer, message_id, now).await;
        if let Ok(c) = &claim {
            self.claimed(message_id, c);
        }
        claim
    }

    async fn check_committable<'a>(&'a self, tx: &'a mut I::Tx) -> Result<(), I::Error> {
        self.inner.check_committable(tx).await
    }

    fn has_outbox(&self) -> bool {
        self.inner.has_outbox()
    }

    async fn stage<'a>(
        &'a self,
        tx: &'a mut I::Tx,
        messages: &'a [OutgoingMessage],
    ) -> Result<twice::outbox::Staged, I::Error> {
        self.inner.stage(tx, messages).await
    }

    fn supports_batches(&self) -> bool {
        self.inner.supports_batches()
    }

    async fn claim_batch<'a>(
        &'a self,
        tx: &'a mut I::Tx,
        consumer: &'a str,
        message_ids: &'a [MessageId],
        now: Timestamp,
    ) -> Result<Vec<Claim>, I::Error> {
        let claims = self.inner.claim_batch(tx, consumer, message_ids, now).await;
        if let Ok(cs) = &claims {
            for (id, c) in message_ids.iter().zip(cs) {
                self.claimed(id, c);
            }
        }
        claims
    }

    async fn savepoint<'a>(&'a self, tx: &'a mut I::Tx) -> Result<(), I::Error> {
        self.inner.savepoint(tx).await
    }

    async fn rollback_to_savepoint<'a>(&'a self, tx: &'a mut I::Tx) -> Result<(), I::Error> {
        self.inner.rollback_to_savepoint(tx).await
    }

    async fn unclaim<'a>(
        &'a self,
        tx: &'a mut I::Tx,
        consumer: &'a str,
        message_id: &'a MessageId,
    ) -> Result<(), I::Error> {
        self.inner.unclaim(tx, consumer, message_id).await
    }

    /// Commits; when the message in flight is armed for a cut connection, arms the proxy's cut
    /// first, so that the COMMIT is the statement it cuts, and records what the cut left.
    async fn commit(&self, tx: I::Tx) -> Result<(), I::Error> {
        let armed = self.probe.take_commit_cut(self.p);
        if let Some((id, before)) = &armed {
            self.probe.push(Event::Fault {
                p: self.p,
                id: id.clone(),
                what: if *before {
                    "connection cut as it sends the COMMIT, before the server gets it"
                } else {
                    "connection cut after the server got the COMMIT, before its answer"
                },
            });
        }
        let done = self.inner.commit(tx).await;
        if let Some((id, before)) = armed {
            let fired = self.probe.commit_cut_fired();
            match &done {
                Err(e) if fired => self.probe.push(Event::CommitUnknown {
                    p: self.p,
                    id,
                    reached_server: !before,
                    error: e.to_string(),
                }),
                _ => self.probe.push(Event::Error {
                    p: self.p,
                    text: format!("the cut of the COMMIT of {id} did not happen"),
                }),
            }
        }
        done
    }

    async fn rollback(&self, tx: I::Tx) -> Result<(), I::Error> {
        self.inner.rollback(tx).await
    }

    async fn record<'a>(
        &'a self,
        consumer: &'a str,
        message_id: &'a MessageId,
        owner: &'a str,
        now: Timestamp,
    ) -> Result<Claim, I::Error> {
        self.maybe_die().await;
        let claim = self.inner.record(consumer, message_id, owner, now).await;
        if let Ok(c) = &claim {
            self.claimed(message_id, c);
        }
        claim
    }

    async fn finish<'a>(
        &'a self,
        tx: &'a mut I::Tx,
        consumer: &'a str,
        message_id: &'a MessageId,
        owner: &'a str,
    ) -> Result<bool, I::Error> {
        self.inner.finish(tx, consumer, message_id, owner).await
    }

    async fn forget<'a>(
        &'a self,
        consumer: &'a str,
        message_id: &'a MessageId,
        owner: &'a str,
    ) -> Result<bool, I::Error> {
        self.inner.forget(consumer, message_id, owner).await
    }

    fn classify(&self, error: &(dyn StdError + 'static)) -> ErrorClass {
        self.inner.classify(error)
    }
}
