//! The rows a relay sent and has not yet deleted (or marked sent): their deletion waits a
//! little, so that one statement covers the rows of many turns.

use std::time::Duration;

use crate::clock::Timestamp;

/// Acknowledged rows (`T`: what the relay keeps of one) waiting for their mark, oldest first.
#[derive(Debug)]
pub(crate) struct Marks<T> {
    sent: Vec<T>,
    /// When the oldest of them was acknowledged.
    since: Option<Timestamp>,
    /// Whether some are of an ordering key that other transactions write too (a session's):
    /// until they are deleted, the table shows them as unsent rows before those of the key
    /// written since, which a lease then holds back.
    holds_order: bool,
}

impl<T> Default for Marks<T> {
    fn default() -> Self {
        Self { sent: Vec::new(), since: None, holds_order: false }
    }
}

impl<T> Marks<T> {
    /// Adds a turn's acknowledged rows, acknowledged at `now`; `holds_order` when some are
    /// of a key other transactions write too.
    pub(crate) fn add(&mut self, sent: Vec<T>, holds_order: bool, now: Timestamp) {
        if sent.is_empty() {
            return;
        }
        self.since.get_or_insert(now);
        self.holds_order |= holds_order;
        self.sent.extend(sent);
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.sent.is_empty()
    }

    /// Whether some rows are of a key other transactions write too: they must be deleted
    /// before the relay reads the table's order.
    pub(crate) fn holds_order(&self) -> bool {
        self.holds_order
    }

    /// When the rows must be marked at the latest: `delay` after the oldest's
    /// acknowledgement; `None` when none waits.
    pub(crate) fn deadline(&self, delay: Duration) -> Option<Timestamp> {
        self.since.map(|t| t.saturating_add(delay))
    }

    /// Whether the rows are due at `now`: the oldest has waited `delay`, or `max` rows wait.
    pub(crate) fn due(&self, now: Timestamp, delay: Duration, max: usize) -> bool {
        self.sent.len() >= max || self.deadline(delay).is_some_and(|d| now >= d)
    }

    /// Takes the rows, leaving none.
    pub(crate) fn take(&mut self) -> Vec<T> {
        self.since = None;
        self.holds_order = false;
        std::mem::take(&mut self.sent)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_are_due_after_the_delay_since_the_oldest_or_once_enough_wait() {
        let delay = Duration::from_millis(100);
        let t0 = Timestamp::from_millis(1_000);
        let mut marks = Marks::<i64>::default();
        assert!(!marks.due(t0, delay, 3), "nothing waits");
        assert_eq!(marks.deadline(delay), None);
        marks.add(vec![], true, t0);
        assert!(marks.is_empty());
        assert!(!marks.holds_order());
        assert_eq!(marks.deadline(delay), None, "an empty turn starts no clock");
        marks.add(vec![1], false, t0);
        assert!(!marks.holds_order());
        marks.add(vec![2], true, Timestamp::from_millis(1_050));
        assert!(marks.holds_order());
        assert_eq!(marks.deadline(delay), Some(Timestamp::from_millis(1_100)), "the oldest's");
        assert!(!marks.due(Timestamp::from_millis(1_099), delay, 3));
        assert!(marks.due(Timestamp::from_millis(1_100), delay, 3));
        marks.add(vec![3], false, Timestamp::from_millis(1_060));
        assert!(marks.holds_order(), "until they are taken");
        assert!(marks.due(Timestamp::from_millis(1_060), delay, 3), "three wait");
        assert_eq!(marks.take(), [1, 2, 3]);
        assert!(marks.is_empty());
        assert!(!marks.holds_order());
        assert_eq!(marks.deadline(delay), None);
        assert!(!marks.due(t0, Duration::ZERO, 3), "none waits, whatever the delay");
    }
}
