//! The commit-unknown scenario: the connection is cut during a message's COMMIT, so the
//! processor does not know whether its work committed.
//!
//! The processors of this scenario use a pool of the kit's: the user's pool options and
//! connect options, with the host and port of a [`Proxy`] in front of the user's server (and
//! no TLS, so the proxy can see the COMMIT). Armed for one COMMIT, the proxy either forwards it
//! and closes both sides before the server's answer comes back (the server commits, the client
//! hears nothing), or drops it and closes both sides (the server sees the connection go and
//! rolls back). SQLite has no connection to cut: there the scenario is not applicable.

use std::sync::Arc;

use sqlx::{Pool, Transaction};
use twice::{Handler, Inbox, Message, Mode};
use twice_sqlx::{SqlxInbox, StoreError};

use super::cut::CommitCut;
use super::env::{Env, Running};
use super::probe::{Event, Probe};
use super::{Prove, Store};
use crate::proxy::Proxy;

/// The inbox of the commit-unknown scenario, on a pool through a proxy that cuts COMMITs.
pub(super) struct CutInbox<DB: Store> {
    pub(super) inbox: Arc<SqlxInbox<DB>>,
    pub(super) pool: Pool<DB>,
    pub(super) proxy: Proxy,
}

impl<DB, H> Prove<DB, H>
where
    DB: Store,
    H: Handler<Transaction<'static, DB>>,
    SqlxInbox<DB>: Inbox<Tx = Transaction<'static, DB>, Error = StoreError>,
{
    /// The inbox of the commit-unknown scenario: `Ok(Err(why))` when the scenario does not
    /// apply to this store (SQLite, a pool on a Unix socket), `Err` when it applies and the
    /// proxy or the inbox could not be made.
    pub(super) async fn cut_inbox(
        &self,
        probe: &Probe,
    ) -> Result<Result<CutInbox<DB>, String>, String> {
        let server = match DB::server(&self.pool) {
            Ok(server) => server,
            Err(why) => return Ok(Err(why)),
        };
        let cut = CommitCut::new(DB::COMMIT);
        let rewrite = cut.clone();
        let proxy = Proxy::start_with(&server, move || Box::new(rewrite.clone()))
            .await
            .map_err(|e| format!("the proxy to {server} did not start: {e}"))?;
        let pool = DB::via(&self.pool, proxy.addr());
        let inbox = SqlxInbox::new(pool.clone(), self.inbox.clone())
            .await
            .map_err(|e| format!("the inbox through the proxy to {server} failed: {e}"))?;
        let inbox = match &self.outbox {
            Some(outbox) => inbox.with_outbox(outbox.clone()),
            None => inbox,
        };
        probe.set_cut(cut);
        Ok(Ok(CutInbox { inbox: Arc::new(inbox), pool, proxy }))
    }

    /// One message of the commit-unknown scenario: its COMMIT meets a cut connection (after
    /// the server got it for the `target`, before for the others). Returns whether the cut
    /// happened and the processor went on as the server's outcome asks: a later claim found
    /// the committed claim, or claimed again and committed; `None` for a message that never
    /// reached a commit to cut (poison, say).
    pub(super) async fn commit_unknown(
        &self,
        env: &Env<DB>,
        running: &Running,
        m: &Message,
        target: bool,
    ) -> Result<Option<bool>, String> {
        let id = m.message_id.as_ref().map(|i| i.as_str().to_owned()).unwrap_or_default();
        let p = running.p;
        if !self.is_poison(m) {
            env.probe.arm_commit_cut(&id, !target);
        }
        env.send(m.clone()).await?;
        env.until_settled("the message whose COMMIT was cut to settle").await?;
        let events = env.probe.events();
        let Some(at) = events.iter().position(
            |e| matches!(e, Event::CommitUnknown { p: q, id: c, .. } if *q == p && *c == id),
        ) else {
            // Not armed, or the handler never returned Complete: nothing was cut.
            return Ok((!self.is_poison(m)).then_some(false));
        };
        let later = &events[at..];
        let claim_after = |outcome: &str| {
            later.iter().any(|e| matches!(e, Event::Claim { id: c, outcome: o, .. } if *c == id && *o == outcome))
        };
        let completed =
            later.iter().any(|e| matches!(e, Event::Completed { id: c, .. } if *c == id));
        let committed_again =
            later.iter().any(|e| matches!(e, Event::Committed { id: c, .. } if *c == id));
        // Without a claim (or a record) the retry runs the handler again, whatever the server
        // did: there is no outcome to see but the completion.
        let claims = matches!(self.mode, Mode::Claim | Mode::DedupOnly);
        let followed = match (claims, target) {
            (true, true) => claim_after("a duplicate"),
            (true, false) => claim_after("claimed") && committed_again,
            (false, _) => true,
        };
        Ok(Some(completed && followed))
    }
}
