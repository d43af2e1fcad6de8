//! Connections that have not proved themselves yet (an AMQP handshake, an HTTP request's head
//! and body): at most a fixed number at once, and when that many wait, a new one evicts the
//! oldest. Idle or slow sockets, however many, then cannot lock out a real client, which
//! finishes its handshake in milliseconds while a flood keeps evicting itself.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use tokio::sync::oneshot;

/// The waiting connections, oldest first.
#[derive(Debug)]
pub(crate) struct Pending {
    capacity: usize,
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    next: u64,
    /// By admission order: dropping a sender evicts its connection.
    waiting: BTreeMap<u64, oneshot::Sender<()>>,
}

/// A waiting connection's place: it leaves the set when dropped.
#[derive(Debug)]
pub(crate) struct Ticket {
    id: u64,
    pending: Arc<Pending>,
    evicted: oneshot::Receiver<()>,
}

impl Pending {
    pub(crate) fn new(capacity: usize) -> Arc<Self> {
        Arc::new(Self { capacity: capacity.max(1), inner: Mutex::new(Inner::default()) })
    }

    /// Lets a connection wait, evicting the oldest waiting one when the set is full; returns
    /// its ticket and whether it evicted one.
    pub(crate) fn admit(self: &Arc<Self>) -> (Ticket, bool) {
        let (tx, rx) = oneshot::channel();
        let mut inner = self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let evicted = inner.waiting.len() >= self.capacity && inner.waiting.pop_first().is_some();
        let id = inner.next;
        inner.next += 1;
        inner.waiting.insert(id, tx);
        (Ticket { id, pending: self.clone(), evicted: rx }, evicted)
    }

    /// How many connections wait.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner).waiting.len()
    }
}

impl Ticket {
    /// Resolves once a newer connection has evicted this one.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe.
    pub(crate) async fn evicted(&mut self) {
        let _ = (&mut self.evicted).await;
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut inner =
            self.pending.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        inner.waiting.remove(&self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_new_connection_evicts_the_oldest_when_full() {
        let pending = Pending::new(2);
        let (mut first, evicted) = pending.admit();
        assert!(!evicted);
        let (mut second, _) = pending.admit();
        let (mut third, evicted) = pending.admit();
        assert!(evicted);
        assert_eq!(pending.len(), 2);
        first.evicted().await;
        let not_yet = tokio::time::timeout(std::time::Duration::ZERO, second.evicted()).await;
        assert!(not_yet.is_err(), "the second is still waiting");
        drop(second);
        assert_eq!(pending.len(), 1);
        let (_, evicted) = pending.admit();
        assert!(!evicted, "a place was free");
        let not_yet = tokio::time::timeout(std::time::Duration::ZERO, third.evicted()).await;
        assert!(not_yet.is_err());
    }
}
