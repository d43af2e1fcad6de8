//! The history a chaos run records, and the checker that reads it.
//!
//! The checker is a pure function of the history, so it is tested on histories written by
//! hand: a double charge, a lost order and a redelivery after a completion must each be
//! flagged.

use std::collections::{BTreeMap, HashMap};

use serde::Serialize;

/// One order the sender sent.
#[derive(Clone, Debug)]
pub(crate) struct Sent {
    /// The id the processors claim it by (the same for every attempt): its message id, or,
    /// when it was sent without one, `order-<order id>` from its body.
    pub(crate) message_id: String,
    pub(crate) order_id: u64,
    /// Sent without a message id, as a producer that is not twice sends.
    pub(crate) without_id: bool,
    /// The handler rejects it: it must end in the dead-letter queue.
    pub(crate) poison: bool,
    /// Send attempts.
    pub(crate) invoked: u32,
    /// Whether some attempt was acknowledged by the broker.
    pub(crate) acknowledged: bool,
}

/// What a processor reported, with the time it saw it (milliseconds since the epoch, from
/// the one machine clock all processes share).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Event {
    /// A delivery the transport handed to the processor, with the end of its lock.
    Delivered { message_id: String, delivery_count: u32, locked_until: u64 },
    /// The handler ran (the inbox claim succeeded).
    Handled { message_id: String },
    /// The broker acknowledged a completion.
    Completed { message_id: String },
    /// A completion the broker refused or never answered.
    CompletionFailed { message_id: String },
    /// The broker acknowledged a move to the dead-letter queue.
    DeadLettered { message_id: String },
    /// The process aborts itself right after a commit, before completing.
    AbortAfterCommit { message_id: String },
    /// The process aborts itself right after the broker acknowledged its relay's sends,
    /// before the relay deleted their rows (`message_id` is the first row's number).
    AbortAfterRelayAck { message_id: String },
}

/// An event of one processor.
#[derive(Clone, Debug)]
pub(crate) struct Observed {
    pub(crate) processor: usize,
    pub(crate) at_millis: u64,
    pub(crate) event: Event,
}

/// Everything a run recorded.
#[derive(Clone, Debug, Default)]
pub(crate) struct History {
    pub(crate) sent: Vec<Sent>,
    pub(crate) events: Vec<Observed>,
    /// Charges the payment service made, by order.
    pub(crate) charges: HashMap<u64, u32>,
    /// Emails the mail service sent, by order.
    pub(crate) emails: HashMap<u64, u32>,
    /// Shipment rows, by order.
    pub(crate) shipments: HashMap<u64, u64>,
    /// The dead-letter queue at the end: reason by message id.
    pub(crate) dead_letters: HashMap<String, String>,
    /// Messages still in the queue (active, scheduled or deferred) at the end; `None` when
    /// the count could not be read.
    pub(crate) left_in_queue: Option<u64>,
    /// Loyalty points rows, by order: one per `OrderShipped` event the downstream processor
    /// handled.
    pub(crate) points: HashMap<u64, u64>,
    /// The ids of the events the points rows were given for.
    pub(crate) event_ids: Vec<String>,
    /// The ids of the events the shipping handler's committed runs sent (derived from the
    /// incoming ids its inbox holds): any other event came from work that rolled back.
    pub(crate) committed_event_ids: std::collections::HashSet<String>,
    /// Outbox rows not sent at the end, and events left in their queue; `None` when the
    /// count could not be read.
    pub(crate) events_left: Option<EventsLeft>,
    /// Whether an acknowledged completion means the broker will not deliver the message
    /// again. Not on RabbitMQ: a `basic.ack` has no reply, and one lost with its connection
    /// comes back as a redelivery. Not on NATS killed with SIGKILL: the server answers a double
    /// ack before its consumer's state reaches its files, and a kill loses it. The inbox turns
    /// those redeliveries away.
    pub(crate) completions_confirmed: bool,
}

/// The events not yet handled downstream at the end of a run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct EventsLeft {
    /// Outbox rows not sent.
    pub(crate) unsent: u64,
    /// Events in their queue, not yet handled.
    pub(crate) queued: u64,
}

/// What the checker found.
#[derive(Clone, Debug, Default, Serialize)]
pub(crate) struct Verdict {
    pub(crate) sends_invoked: u64,
    pub(crate) sends_acknowledged: u64,
    pub(crate) deliveries: u64,
    pub(crate) handler_runs: u64,
    pub(crate) completions_acknowledged: u64,
    pub(crate) completions_failed: u64,
    pub(crate) aborts_after_commit: u64,
    pub(crate) shipments: u64,
    pub(crate) charges: u64,
    pub(crate) emails: u64,
    pub(crate) dead_lettered: u64,
    /// Acknowledged orders the handler rejects.
    pub(crate) poison_orders: u64,
    /// Repeated calls to the payment and mail services answered from their idempotency-key
    /// record (filled in by the controller, which runs the services).
    pub(crate) idempotency_key_replays: u64,
    /// Deliveries the inbox turned away (a copy of a message already handled or in hand).
    pub(crate) duplicates_prevented: u64,
    /// Deliveries, with a live lock, of a message whose completion the broker had
    /// acknowledged: a violation where the broker's acknowledgement promises it is gone, and
    /// otherwise (RabbitMQ; NATS restarted with SIGKILL) a duplicate for the inbox to turn
    /// away.
    pub(crate) redelivered_after_completion: u64,
    /// Aborts right after the broker acknowledged a relay's sends, before the rows' deletion.
    pub(crate) relay_aborts_after_ack: u64,
    /// Loyalty points rows: `OrderShipped` events handled downstream.
    pub(crate) points: u64,
    /// Violations by kind.
    pub(crate) violations: BTreeMap<String, u64>,
    /// The first few violations, spelled out.
    pub(crate) examples: Vec<String>,
}

impl Verdict {
    /// All violations.
    pub(crate) fn violation_count(&self) -> u64 {
        self.violations.values().sum()
    }

    fn violate(&mut self, kind: &str, detail: String) {
        *self.violations.entry(kind.to_owned()).or_default() += 1;
        if self.examples.len() < 20 {
            self.examples.push(format!("{kind}: {detail}"));
        }
    }
}

/// Checks a history against the invariants: every acknowledged order shipped, charged and
/// emailed exactly once; no message delivered again after its completion was acknowledged;
/// every poison message in the dead-letter queue and nothing else there; the queue empty.
pub(crate) fn check(h: &History) -> Verdict {
    let mut v = Verdict {
        sends_invoked: h.sent.iter().map(|s| u64::from(s.invoked)).sum(),
        sends_acknowledged: h.sent.iter().filter(|s| s.acknowledged).count() as u64,
        shipments: h.shipments.values().sum(),
        charges: h.charges.values().map(|&n| u64::from(n)).sum(),
        emails: h.emails.values().map(|&n| u64::from(n)).sum(),
        dead_lettered: h.dead_letters.len() as u64,
        points: h.points.values().sum(),
        poison_orders: h.sent.iter().filter(|s| s.acknowledged && s.poison).count() as u64,
        ..Verdict::default()
    };
    // The earliest acknowledged completion of each message.
    let mut completed_at: HashMap<&str, u64> = HashMap::new();
    for o in &h.events {
        match &o.event {
            Event::Delivered { .. } => v.deliveries += 1,
            Event::Handled { .. } => v.handler_runs += 1,
            Event::Completed { message_id } => {
                v.completions_acknowledged += 1;
                let t = completed_at.entry(message_id).or_insert(o.at_millis);
                *t = (*t).min(o.at_millis);
            }
            Event::CompletionFailed { .. } => v.completions_failed += 1,
            Event::DeadLettered { .. } => {}
            Event::AbortAfterCommit { .. } => v.aborts_after_commit += 1,
            Event::AbortAfterRelayAck { .. } => v.relay_aborts_after_ack += 1,
        }
    }
    v.duplicates_prevented = v.deliveries.saturating_sub(v.handler_runs);
    // Failed completions by processor and message: a delivery seen after another processor
    // completed the message is a stale one (handed out before, held by a processor that was
    // stopped) when its lock had run out when it was seen, or its own completion then fails.
    // A real delivery after the completion has a live lock and completes.
    let mut failed: HashMap<(usize, &str), Vec<u64>> = HashMap::new();
    for o in &h.events {
        if let Event::CompletionFailed { message_id } = &o.event {
            failed.entry((o.processor, message_id)).or_default().push(o.at_millis);
        }
    }
    for o in &h.events {
        let Event::Delivered { message_id, delivery_count, locked_until } = &o.event else {
            continue;
        };
        let Some(&done) = completed_at.get(message_id.as_str()) else { continue };
        if o.at_millis <= done {
            continue;
        }
        // Its lock had run out before the processor saw it (the processor drops it), or its
        // completion failed.
        let stale = *locked_until <= o.at_millis
            || failed
                .get(&(o.processor, message_id.as_str()))
                .is_some_and(|ts| ts.iter().any(|&t| t >= o.at_millis));
        if stale {
            continue;
        }
        v.redelivered_after_completion += 1;
        if h.completions_confirmed {
            v.violate(
                "delivered after its completion was acknowledged",
                format!(
                    "{message_id} (delivery {delivery_count}) to processor {} {} ms after the completion, with a live lock",
                    o.processor,
                    o.at_millis - done
                ),
            );
        }
    }
    for id in &h.event_ids {
        if !h.committed_event_ids.contains(id) {
            v.violate("event of work that rolled back", format!("event {id}"));
        }
    }
    for s in h.sent.iter().filter(|s| s.acknowledged) {
        let o = s.order_id;
        let points = h.points.get(&o).copied().unwrap_or(0);
        if s.poison && points > 0 {
            v.violate("event of a rejected order", format!("order {o}: {points} points rows"));
        } else if !s.poison && points == 0 {
            v.violate("OrderShipped never handled downstream", format!("order {o}"));
        } else if points > 1 {
            v.violate(
                "OrderShipped handled more than once downstream",
                format!("order {o}: {points} times"),
            );
        }
    }
    for s in h.sent.iter().filter(|s| s.acknowledged) {
        let o = s.order_id;
        let shipped = h.shipments.get(&o).copied().unwrap_or(0);
        let charged = u64::from(h.charges.get(&o).copied().unwrap_or(0));
        let emailed = u64::from(h.emails.get(&o).copied().unwrap_or(0));
        let in_dlq = h.dead_letters.contains_key(&s.message_id);
        if s.poison {
            if !in_dlq {
                v.violate("poison message not in the dead-letter queue", s.message_id.clone());
            }
            if shipped + charged + emailed > 0 {
                v.violate(
                    "effect of a rejected order",
                    format!("order {o}: {shipped} shipped, {charged} charged, {emailed} emailed"),
                );
            }
            continue;
        }
        if in_dlq {
            v.violate(
                "valid order dead-lettered",
                format!("{} ({})", s.message_id, h.dead_letters[&s.message_id]),
            );
        }
        for (what, n) in [("shipped", shipped), ("charged", charged), ("emailed", emailed)] {
            if n == 0 {
                v.violate(&format!("acknowledged order never {what}"), format!("order {o}"));
            } else if n > 1 {
                v.violate(&format!("order {what} more than once"), format!("order {o}: {n} times"));
            }
        }
    }
    match h.left_in_queue {
        Some(0) => {}
        Some(n) => v.violate("messages left in the queue", format!("{n} not settled at the end")),
        None => v.violate("messages left in the queue", "the count could not be read".into()),
    }
    match h.events_left {
        Some(EventsLeft { unsent: 0, queued: 0 }) => {}
        Some(EventsLeft { unsent, queued }) => v.violate(
            "events left unsent or unhandled",
            format!("{unsent} outbox rows not sent and {queued} events in their queue at the end"),
        ),
        None => v.violate("events left unsent or unhandled", "the count could not be read".into()),
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two valid orders and one poison message, all handled once: a clean history.
    fn clean() -> History {
        let sent = |n: u64, poison: bool| Sent {
            message_id: format!("order-{n}"),
            order_id: n,
            poison,
            without_id: false,
            invoked: 1,
            acknowledged: true,
        };
        let mut h = History {
            sent: vec![sent(1, false), sent(2, false), sent(3, true)],
            left_in_queue: Some(0),
            events_left: Some(EventsLeft::default()),
            completions_confirmed: true,
            ..History::default()
        };
        for n in [1, 2] {
            h.charges.insert(n, 1);
            h.emails.insert(n, 1);
            h.shipments.insert(n, 1);
            h.points.insert(n, 1);
            h.event_ids.push(format!("event-{n}"));
            h.committed_event_ids.insert(format!("event-{n}"));
        }
        h.dead_letters.insert("order-3".into(), "OrderRejected".into());
        let mut t = 0;
        for n in [1, 2] {
            let id = format!("order-{n}");
            for event in [
                Event::Delivered {
                    message_id: id.clone(),
                    delivery_count: 1,
                    locked_until: t + 5_000,
                },
                Event::Handled { message_id: id.clone() },
                Event::Completed { message_id: id.clone() },
            ] {
                t += 10;
                h.events.push(Observed { processor: 0, at_millis: t, event });
            }
        }
        h
    }

    #[test]
    fn a_clean_history_has_no_violation() {
        let v = check(&clean());
        assert_eq!(v.violation_count(), 0, "{:?}", v.examples);
        assert_eq!((v.sends_acknowledged, v.deliveries, v.completions_acknowledged), (3, 2, 2));
    }

    #[test]
    fn a_double_charge_is_flagged() {
        let mut h = clean();
        h.charges.insert(2, 2);
        let v = check(&h);
        assert_eq!(v.violations.get("order charged more than once"), Some(&1), "{v:?}");
        assert_eq!(v.violation_count(), 1);
    }

    #[test]
    fn a_lost_order_is_flagged() {
        let mut h = clean();
        for effects in [&mut h.charges, &mut h.emails] {
            effects.remove(&1);
        }
        h.shipments.remove(&1);
        let v = check(&h);
        assert_eq!(v.violations.get("acknowledged order never shipped"), Some(&1), "{v:?}");
        assert_eq!(v.violations.get("acknowledged order never charged"), Some(&1));
        assert_eq!(v.violation_count(), 3);
    }

    /// A second delivery of order 1, with a live lock, after its completion.
    fn redelivery_after_completion() -> Observed {
        Observed {
            processor: 2,
            at_millis: 1_000,
            event: Event::Delivered {
                message_id: "order-1".into(),
                delivery_count: 2,
                locked_until: 6_000,
            },
        }
    }

    #[test]
    fn a_redelivery_after_an_acknowledged_completion_is_flagged() {
        let mut h = clean();
        h.events.push(redelivery_after_completion());
        let v = check(&h);
        assert_eq!(
            v.violations.get("delivered after its completion was acknowledged"),
            Some(&1),
            "{v:?}"
        );
        // The duplicate the inbox turned away is counted, not mistaken for a second effect.
        assert_eq!(v.duplicates_prevented, 1);
    }

    #[test]
    fn a_redelivery_after_an_unconfirmed_completion_is_no_violation() {
        // RabbitMQ: the ack has no reply; one lost with its connection comes back, and the
        // inbox turns the copy away.
        let mut h = clean();
        h.completions_confirmed = false;
        h.events.push(redelivery_after_completion());
        let v = check(&h);
        assert_eq!(v.violation_count(), 0, "{v:?}");
        assert_eq!((v.duplicates_prevented, v.redelivered_after_completion), (1, 1));
        // Its effects are still checked: a second charge is a violation whatever the broker.
        h.charges.insert(1, 2);
        assert_eq!(check(&h).violations.get("order charged more than once"), Some(&1));
    }

    #[test]
    fn a_stale_delivery_whose_completion_fails_is_no_violation() {
        // A processor stopped past its lock sees, once it goes on, a message another one has
        // completed meanwhile; its completion fails, as it must.
        let mut h = clean();
        for (t, event) in [
            (
                1_000,
                Event::Delivered {
                    message_id: "order-1".into(),
                    delivery_count: 1,
                    locked_until: 6_000,
                },
            ),
            (1_001, Event::CompletionFailed { message_id: "order-1".into() }),
        ] {
            h.events.push(Observed { processor: 1, at_millis: t, event });
        }
        assert_eq!(check(&h).violation_count(), 0);
        // The same failure on another processor excuses nothing.
        h.events.last_mut().unwrap().processor = 2;
        assert_eq!(check(&h).violation_count(), 1);
    }

    #[test]
    fn a_stale_delivery_whose_lock_ran_out_before_it_was_seen_is_no_violation() {
        let mut h = clean();
        h.events.push(Observed {
            processor: 1,
            at_millis: 9_000,
            event: Event::Delivered {
                message_id: "order-1".into(),
                delivery_count: 1,
                locked_until: 8_000,
            },
        });
        assert_eq!(check(&h).violation_count(), 0);
    }

    #[test]
    fn events_lost_repeated_ghostly_or_left_behind_are_flagged() {
        let mut h = clean();
        h.points.remove(&1);
        h.points.insert(2, 2);
        h.points.insert(3, 1);
        h.event_ids.push("event-of-a-rollback".into());
        h.events_left = Some(EventsLeft { unsent: 2, queued: 1 });
        let v = check(&h);
        for kind in [
            "OrderShipped never handled downstream",
            "OrderShipped handled more than once downstream",
            "event of a rejected order",
            "event of work that rolled back",
            "events left unsent or unhandled",
        ] {
            assert_eq!(v.violations.get(kind), Some(&1), "{kind}: {v:?}");
        }
        assert_eq!(v.violation_count(), 5);
    }

    #[test]
    fn poison_outside_the_dead_letter_queue_and_a_queue_not_drained_are_flagged() {
        let mut h = clean();
        h.dead_letters.clear();
        h.left_in_queue = Some(4);
        let v = check(&h);
        assert_eq!(v.violations.get("poison message not in the dead-letter queue"), Some(&1));
        assert_eq!(v.violations.get("messages left in the queue"), Some(&1));
    }
}
