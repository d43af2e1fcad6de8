//! Counters for `/metrics`: what the front end did, by entity.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

/// Operation counts of one entity.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct EntityCounters {
    /// Messages sent to the entity.
    pub sends: u64,
    /// Messages handed to receivers.
    pub receives: u64,
    /// Messages completed.
    pub completes: u64,
    /// Messages abandoned.
    pub abandons: u64,
    /// Messages dead-lettered by a receiver.
    pub dead_letters: u64,
    /// Settlements refused because the lock was lost (not those refused for another reason,
    /// such as the entity having been deleted).
    pub lock_losses: u64,
}

/// The server's counters, shared by every connection.
#[derive(Debug, Default)]
pub struct Metrics {
    connections: AtomicU64,
    connections_total: AtomicU64,
    // A plain mutex: each update is a map lookup and an add, with no await inside.
    entities: Mutex<BTreeMap<String, EntityCounters>>,
}

/// Which counter to bump.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[allow(missing_docs)] // reason: one variant per field of `EntityCounters`
pub enum Counter {
    Send,
    Receive,
    Complete,
    Abandon,
    DeadLetter,
    LockLost,
}

impl Metrics {
    /// Counts `n` operations on an entity.
    pub fn add(&self, entity: &str, counter: Counter, n: u64) {
        let mut map = self.entities.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let c = map.entry(entity.to_owned()).or_default();
        let slot = match counter {
            Counter::Send => &mut c.sends,
            Counter::Receive => &mut c.receives,
            Counter::Complete => &mut c.completes,
            Counter::Abandon => &mut c.abandons,
            Counter::DeadLetter => &mut c.dead_letters,
            Counter::LockLost => &mut c.lock_losses,
        };
        *slot += n;
    }

    /// Drops the counters of a deleted entity and of what is under it (a topic's
    /// subscriptions), so that `/metrics` lists only entities that exist. Operations on it
    /// that finish afterwards fail, and a failure counts nothing (a refused settlement counts
    /// only when its lock was lost), so the series does not come back unless an entity of the
    /// same name is created and used.
    pub fn forget(&self, entity: &str) {
        let mut map = self.entities.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let under = |k: &str| {
            k.get(..entity.len()).is_some_and(|head| head.eq_ignore_ascii_case(entity))
                && matches!(k.as_bytes().get(entity.len()), None | Some(b'/'))
        };
        map.retain(|k, _| !under(k));
    }

    /// A connection opened.
    pub fn connection_opened(&self) {
        self.connections.fetch_add(1, Ordering::Relaxed);
        self.connections_total.fetch_add(1, Ordering::Relaxed);
    }

    /// A connection closed.
    pub fn connection_closed(&self) {
        self.connections.fetch_sub(1, Ordering::Relaxed);
    }

    /// Open connections.
    pub fn connections(&self) -> u64 {
        self.connections.load(Ordering::Relaxed)
    }

    /// Connections accepted since start.
    pub fn connections_total(&self) -> u64 {
        self.connections_total.load(Ordering::Relaxed)
    }

    /// A copy of the per-entity counters.
    pub fn entities(&self) -> BTreeMap<String, EntityCounters> {
        self.entities.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }
}
