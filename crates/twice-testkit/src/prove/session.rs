//! The session-order scenario: the messages of one session, sent in an order the seed shuffles
//! (a later one first), handled by a session processor; then one of them sent again with its
//! id after a later one was handled, as a publisher's retry delivers it.

use sqlx::Transaction;
use twice::{Handler, Inbox, Message};
use twice_sqlx::{SqlxInbox, StoreError};

use super::env::{Env, id_of};
use super::probe::Event;
use super::{Prove, Seeded, Store};

/// The session the scenario's messages are sent in.
pub(super) const SESSION: &str = "prove-session";

/// `messages` in a send order the seed picks, never their own: a later message goes first.
pub(super) fn out_of_order(rng: &mut Seeded, messages: Vec<Message>) -> Vec<Message> {
    let mut order: Vec<usize> = (0..messages.len()).collect();
    for i in (1..order.len()).rev() {
        let j = usize::try_from(rng.between(0, i as u64)).unwrap_or(0);
        order.swap(i, j);
    }
    if order.windows(2).all(|w| w[0] < w[1]) {
        order.rotate_left(1);
    }
    let mut slots: Vec<Option<Message>> = messages.into_iter().map(Some).collect();
    order
        .into_iter()
        .filter_map(|i| slots.get_mut(i).and_then(Option::take))
        .map(|m| m.with_session_id(SESSION))
        .collect()
}

impl<DB, H> Prove<DB, H>
where
    DB: Store,
    H: Handler<Transaction<'static, DB>>,
    SqlxInbox<DB>: Inbox<Tx = Transaction<'static, DB>, Error = StoreError>,
{
    /// Sends `messages` (already in their shuffled order) to the session, waits until they are
    /// settled, then sends `messages[target]` again. Returns whether the fault was exercised:
    /// the session's messages were handled in the order they were sent, and the copy was
    /// delivered after a message sent after it had been handled.
    pub(super) async fn session_order(
        &self,
        env: &Env<DB>,
        messages: &[Message],
        target: usize,
        sent: &mut Vec<Message>,
    ) -> Result<bool, String> {
        for m in messages {
            sent.push(m.clone());
            env.send(m.clone()).await?;
        }
        env.until_settled("the session's messages to settle").await?;
        let Some(again) = messages.get(target) else { return Ok(false) };
        let id = id_of(again);
        env.send_again(again.clone()).await?;
        let copy = |e: &Event| matches!(e, Event::Delivered { id: d, .. } if *d == id);
        env.until("the copy to be delivered", || async { env.probe.count(copy) >= 2 }).await?;
        env.until_settled("the copy to settle").await?;

        let events = env.probe.events();
        let mut started: Vec<&str> = Vec::new();
        for e in &events {
            if let Event::HandlerStarted { id, .. } = e
                && !started.contains(&id.as_str())
            {
                started.push(id);
            }
        }
        let ids: Vec<String> = messages.iter().map(id_of).collect();
        let handled: Vec<&str> =
            ids.iter().map(String::as_str).filter(|i| started.contains(i)).collect();
        let in_order = started.iter().copied().eq(handled.iter().copied());
        let Some(copy_at) =
            events.iter().enumerate().filter(|(_, e)| copy(e)).nth(1).map(|(at, _)| at)
        else {
            return Ok(false);
        };
        let later = &ids[target + 1..];
        let later_handled = events[..copy_at]
            .iter()
            .any(|e| matches!(e, Event::HandlerReturned { id: d, .. } if later.contains(d)));
        Ok(in_order && later_handled)
    }
}
