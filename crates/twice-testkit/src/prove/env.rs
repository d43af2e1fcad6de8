//! What one scenario works with: its broker, clock, queue and inbox, the history it records,
//! and the waits on conditions every step is made of.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;
use twice::{Counters, ManualClock, Message, ProcessorError};
use twice_broker::Broker;
use twice_sqlx::SqlxInbox;

use super::Store;
use super::probe::{Event, Probe};

/// How many times a wait polls (a millisecond apart) before the run gives up with an error.
pub(super) const POLLS: usize = 20_000;

/// A processor of the scenario.
pub(super) struct Running {
    pub(super) p: usize,
    pub(super) task: JoinHandle<Result<(), ProcessorError>>,
    pub(super) stop: watch::Sender<bool>,
    pub(super) counters: Arc<Counters>,
}

/// What one scenario works with.
pub(super) struct Env<DB: Store> {
    pub(super) broker: Broker,
    pub(super) clock: ManualClock,
    pub(super) path: String,
    pub(super) inbox: Arc<SqlxInbox<DB>>,
    pub(super) probe: Arc<Probe>,
    /// Whether the queue requires sessions (and its processors are session processors).
    pub(super) sessions: bool,
}

impl<DB: Store> Env<DB> {
    pub(super) fn advance(&self, by: Duration) {
        self.clock.advance(by);
        self.probe.push(Event::ClockAdvanced { by });
    }

    pub(super) async fn send(&self, m: Message) -> Result<(), String> {
        self.probe.push(Event::Sent { id: id_of(&m) });
        self.broker.send(&self.path, m).await.map_err(|e| format!("send: {e}"))?;
        Ok(())
    }

    /// Sends a copy of a message of the session again, with its id.
    pub(super) async fn send_again(&self, m: Message) -> Result<(), String> {
        self.probe.push(Event::SentAgain { id: id_of(&m) });
        self.broker.send(&self.path, m).await.map_err(|e| format!("send: {e}"))?;
        Ok(())
    }

    /// Nothing active or scheduled on the queue: every copy sent so far is settled, and every
    /// settlement is recorded.
    pub(super) async fn settled(&self) -> bool {
        match self.broker.counts(&self.path).await {
            Ok(c) => c.active == 0 && c.scheduled == 0 && self.probe.quiet(),
            Err(_) => false,
        }
    }

    /// Polls `cond` a millisecond apart, moving the clock 10 ms every 10 polls (for backoffs);
    /// an error naming `what` when it never holds.
    pub(super) async fn until<F: Future<Output = bool>>(
        &self,
        what: &str,
        mut cond: impl FnMut() -> F,
    ) -> Result<(), String> {
        for i in 0..POLLS {
            if cond().await {
                return Ok(());
            }
            if i % 10 == 9 {
                self.clock.advance(Duration::from_millis(10));
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let counts = self.broker.counts(&self.path).await.map(|c| format!("{c:?}"));
        Err(format!("gave up waiting for {what} (queue: {counts:?})"))
    }

    pub(super) async fn until_settled(&self, what: &str) -> Result<(), String> {
        self.until(what, || self.settled()).await
    }
}

/// A message's id, empty when it has none.
pub(super) fn id_of(m: &Message) -> String {
    m.message_id.as_ref().map(|i| i.as_str().to_owned()).unwrap_or_default()
}
