//! The demo's results: the side-by-side table, the verdict, and the JSON object.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::Serialize;

/// What one column (naive or twice) ended with.
#[derive(Clone, Debug, Default, Serialize)]
pub(crate) struct Column {
    /// Handler invocations, duplicates included.
    pub(crate) deliveries: u64,
    /// Shipment rows.
    pub(crate) shipments: u64,
    /// Charges the payment service really made.
    pub(crate) charges: u64,
    /// Emails the mail service really sent.
    pub(crate) emails: u64,
    /// Messages abandoned for a retry.
    pub(crate) abandoned: u64,
    /// Messages in the dead-letter queue at the end.
    pub(crate) dead_lettered: u64,
    /// Valid orders missing a shipment, a charge or an email.
    pub(crate) lost: u64,
    /// Valid orders with more than one shipment, charge or email.
    pub(crate) repeated: u64,
    /// Orders charged more than once.
    pub(crate) orders_charged_twice: u64,
    /// Poison messages (bad JSON, rejected orders) that are not in the dead-letter queue with
    /// a reason.
    pub(crate) poison_missing_from_dlq: u64,
    /// Duplicates suppressed, by layer.
    pub(crate) duplicates: Duplicates,
    /// The `OrderShipped` events and what the loyalty service made of them.
    pub(crate) events: Events,
    /// Errors the processor met and handled, by where they happened (twice column only).
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub(crate) errors: BTreeMap<String, u64>,
}

/// Duplicates suppressed, by the layer that caught them.
#[derive(Clone, Debug, Default, Serialize)]
pub(crate) struct Duplicates {
    /// Re-sent message ids dropped by the broker's duplicate detection.
    pub(crate) broker: u64,
    /// Copies that met the inbox claim (already processed, or a concurrent copy).
    pub(crate) inbox: u64,
    /// Orders published again under another message id, caught by the unique business key.
    pub(crate) business_key: u64,
    /// Repeated calls to the payment and mail services answered from their idempotency-key
    /// record instead of charging or mailing again.
    pub(crate) idempotency_key: u64,
}

/// The `OrderShipped` events of a column, and the loyalty points they gave.
#[derive(Clone, Debug, Default, Serialize)]
pub(crate) struct Events {
    /// Events sent to the broker (by the naive handler; by the twice column's relay, re-sends
    /// after a relay's restart included).
    pub(crate) published: u64,
    /// Events sent for work that then rolled back: counted by the naive handler itself; for
    /// twice, events whose id no committed handler run derived.
    pub(crate) for_rolled_back_work: u64,
    /// Points rows the loyalty service wrote (one per event it handled).
    pub(crate) points: u64,
    /// Valid orders that got no points: a lost event.
    pub(crate) lost: u64,
    /// Valid orders that got points more than once.
    pub(crate) repeated: u64,
    /// Points given for orders that were never shipped (poison orders).
    pub(crate) for_unshipped_orders: u64,
    /// Copies of an event dropped: by the broker's duplicate detection (where it says so)
    /// and by the loyalty service's inbox.
    pub(crate) duplicates_downstream: u64,
}

/// Counts of the injected faults.
#[derive(Clone, Debug, Default, Serialize)]
pub(crate) struct Injected {
    pub(crate) sender_retries: u64,
    pub(crate) republished: u64,
    pub(crate) crashes_after_commit: u64,
    pub(crate) slow_handlers: u64,
    pub(crate) transient_errors: u64,
    pub(crate) bad_json: u64,
    pub(crate) rejected_orders: u64,
    pub(crate) restart_after_deliveries: u64,
    /// Completions the twice column lost to a crash after commit (first deliveries only).
    pub(crate) completions_lost: u64,
    /// Times the twice column's relay stopped after the broker acknowledged its sends and
    /// before it deleted their rows.
    pub(crate) relay_stopped_after_ack: u64,
}

/// The whole report.
#[derive(Clone, Debug, Serialize)]
pub(crate) struct Report {
    pub(crate) orders: u64,
    pub(crate) valid_orders: u64,
    pub(crate) poison: u64,
    pub(crate) seed: u64,
    pub(crate) store: String,
    /// The broker: `embedded`, `rabbitmq`, `nats`, `serve` or `servicebus`.
    pub(crate) broker: String,
    /// Whether the broker says when it drops a re-sent message id. Service Bus drops them
    /// silently, RabbitMQ has no duplicate detection: `duplicates.broker` is then 0.
    pub(crate) broker_reports_duplicates: bool,
    pub(crate) elapsed_seconds: f64,
    pub(crate) faults: Injected,
    pub(crate) naive: Column,
    pub(crate) twice: Column,
    pub(crate) invariants_hold: bool,
}

impl Report {
    /// Whether twice got every effect exactly once and every poison message into the DLQ.
    pub(crate) fn twice_holds(twice: &Column, valid_orders: u64, poison: u64) -> bool {
        twice.shipments == valid_orders
            && twice.charges == valid_orders
            && twice.emails == valid_orders
            && twice.lost == 0
            && twice.repeated == 0
            && twice.poison_missing_from_dlq == 0
            && twice.dead_lettered == poison
            && twice.events.points == valid_orders
            && twice.events.lost == 0
            && twice.events.repeated == 0
            && twice.events.for_unshipped_orders == 0
            && twice.events.for_rolled_back_work == 0
    }

    /// A count of duplicates the broker dropped, or why there is none.
    fn broker_count(&self, n: u64) -> String {
        if self.broker_reports_duplicates {
            n.to_string()
        } else if self.broker == "rabbitmq" {
            "none".into()
        } else {
            "silent".into()
        }
    }

    /// The human-readable table and verdict.
    pub(crate) fn render(&self) -> String {
        let mut out = String::new();
        let f = &self.faults;
        let _ = writeln!(
            out,
            "twice demo: {} orders ({} valid, {} poison), seed {}, store {}, broker {}, {:.1} s",
            self.orders,
            self.valid_orders,
            self.poison,
            self.seed,
            self.store,
            self.broker,
            self.elapsed_seconds
        );
        let _ = writeln!(
            out,
            "faults: {} sender retries, {} orders published twice, {} crashes after commit, {} handlers slower than their lock,\n        {} transient errors, {} bodies not JSON, {} rejected orders, a processor restart after {} deliveries,\n        {} outbox relay stopped between the broker's acknowledgement and the deletion of its rows\n",
            f.sender_retries,
            f.republished,
            f.crashes_after_commit,
            f.slow_handlers,
            f.transient_errors,
            f.bad_json,
            f.rejected_orders,
            f.restart_after_deliveries,
            f.relay_stopped_after_ack
        );
        let (n, t) = (&self.naive, &self.twice);
        let (ne, te) = (&n.events, &t.events);
        let rows: [(&str, String, String); 21] = [
            ("deliveries", n.deliveries.to_string(), t.deliveries.to_string()),
            ("shipments", n.shipments.to_string(), t.shipments.to_string()),
            ("charges", n.charges.to_string(), t.charges.to_string()),
            ("emails", n.emails.to_string(), t.emails.to_string()),
            (
                "orders charged twice",
                n.orders_charged_twice.to_string(),
                t.orders_charged_twice.to_string(),
            ),
            (
                "duplicates: broker",
                self.broker_count(n.duplicates.broker),
                self.broker_count(t.duplicates.broker),
            ),
            ("duplicates: inbox claim", "-".into(), t.duplicates.inbox.to_string()),
            ("duplicates: business key", "-".into(), t.duplicates.business_key.to_string()),
            ("repeats stopped by keys", "-".into(), t.duplicates.idempotency_key.to_string()),
            ("abandoned", n.abandoned.to_string(), t.abandoned.to_string()),
            ("dead-lettered", n.dead_lettered.to_string(), t.dead_lettered.to_string()),
            ("lost", n.lost.to_string(), t.lost.to_string()),
            ("valid orders with repeats", n.repeated.to_string(), t.repeated.to_string()),
            (
                "poison not in DLQ",
                n.poison_missing_from_dlq.to_string(),
                t.poison_missing_from_dlq.to_string(),
            ),
            ("OrderShipped sent", ne.published.to_string(), te.published.to_string()),
            (
                "  for rolled-back work",
                ne.for_rolled_back_work.to_string(),
                te.for_rolled_back_work.to_string(),
            ),
            ("loyalty points given", ne.points.to_string(), te.points.to_string()),
            (
                "  re-sent copies dropped",
                ne.duplicates_downstream.to_string(),
                te.duplicates_downstream.to_string(),
            ),
            ("  valid orders lost", ne.lost.to_string(), te.lost.to_string()),
            ("  valid orders repeated", ne.repeated.to_string(), te.repeated.to_string()),
            (
                "  unshipped orders",
                ne.for_unshipped_orders.to_string(),
                te.for_unshipped_orders.to_string(),
            ),
        ];
        let _ = writeln!(out, "{:<28}{:>10}{:>10}", "", "naive", "twice");
        let _ = writeln!(
            out,
            "{:<28}{:>10}{:>10}",
            "valid orders", self.valid_orders, self.valid_orders
        );
        for (name, a, b) in rows {
            let _ = writeln!(out, "{name:<28}{a:>10}{b:>10}");
        }
        let _ = writeln!(out);
        if self.broker == "serve" || self.broker == "servicebus" {
            let _ = writeln!(
                out,
                "Service Bus drops a re-sent message id within its duplicate window without telling the sender: \
                 \"silent\" above, the drops are not counted.\n"
            );
        }
        if self.invariants_hold {
            let _ = writeln!(
                out,
                "twice: PASS  exactly one shipment, one charge, one email and one OrderShipped for each of the {} valid orders;\n             no event for rolled-back work; all {} poison messages in the dead-letter queue with a reason; nothing lost.",
                self.valid_orders, self.poison
            );
        } else {
            let _ = writeln!(
                out,
                "twice: FAIL  shipments {}, charges {}, emails {}, points {} for {} valid orders; lost {}; repeats {}; poison not in DLQ {};\n             events lost {}, repeated {}, for unshipped orders {}, for rolled-back work {}.",
                t.shipments,
                t.charges,
                t.emails,
                te.points,
                self.valid_orders,
                t.lost,
                t.repeated,
                t.poison_missing_from_dlq,
                te.lost,
                te.repeated,
                te.for_unshipped_orders,
                te.for_rolled_back_work
            );
        }
        let _ = writeln!(
            out,
            "naive: {} orders charged more than once, {} extra charges, {} extra emails, {} extra shipments;\n       {} OrderShipped events for rolled-back work, {} orders given points more than once.",
            n.orders_charged_twice,
            n.charges.saturating_sub(self.valid_orders),
            n.emails.saturating_sub(self.valid_orders),
            n.shipments.saturating_sub(self.valid_orders),
            ne.for_rolled_back_work,
            ne.repeated
        );
        out
    }
}
