//! The fault schedule: every order, how it is sent, and what goes wrong with it, all drawn from
//! one seed so that the naive and the idempotent runs meet exactly the same faults.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// How often each fault happens, as a probability per order.
#[derive(Clone, Debug)]
pub(crate) struct FaultRates {
    /// The sender retries a send with the same MessageId (broker duplicate detection drops it).
    pub(crate) sender_retry: f64,
    /// The same order is published again with a different MessageId (the business key catches it).
    pub(crate) republish: f64,
    /// The handler's process dies after the commit and before the completion.
    pub(crate) crash_after_commit: f64,
    /// How many handlers are slower than their lock and cannot renew it (a pause), so that a
    /// second copy runs. A count, not a rate: on SQLite a stalled transaction holds the only
    /// write lock until its message lock expires, so each one stalls every writer.
    pub(crate) slow: u64,
    /// The handler fails with a transient error on its first deliveries.
    pub(crate) transient: f64,
    /// The body is not JSON.
    pub(crate) poison_json: f64,
    /// The order is one the handler always rejects.
    pub(crate) poison_rejected: f64,
}

impl Default for FaultRates {
    fn default() -> Self {
        Self {
            sender_retry: 0.05,
            republish: 0.03,
            crash_after_commit: 0.03,
            slow: 3,
            transient: 0.05,
            poison_json: 0.005,
            poison_rejected: 0.005,
        }
    }
}

/// What an order is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum OrderKind {
    /// A good order: exactly one shipment, one charge and one email must come of it.
    Valid,
    /// A body that is not JSON: must end in the dead-letter queue (`DeserializationFailed`).
    BadJson,
    /// An order the handler always rejects: must end in the dead-letter queue (`OrderRejected`).
    Rejected,
}

/// One order of the run.
#[derive(Clone, Debug)]
pub(crate) struct PlannedOrder {
    pub(crate) order_id: u64,
    pub(crate) amount_cents: u64,
    pub(crate) kind: OrderKind,
    /// Extra sends with the same MessageId.
    pub(crate) retries: u32,
    /// Whether the order is also published with a second MessageId.
    pub(crate) republished: bool,
    /// The first delivery crashes after commit, before complete.
    pub(crate) crash_after_commit: bool,
    /// The first delivery is slower than its lock.
    pub(crate) slow: bool,
    /// Deliveries that fail with a transient error before one succeeds.
    pub(crate) transient_failures: u32,
}

impl PlannedOrder {
    /// The MessageId of the order's first publication.
    pub(crate) fn message_id(&self) -> String {
        format!("order-{}", self.order_id)
    }

    /// The MessageId of the second publication, when republished.
    pub(crate) fn republished_message_id(&self) -> String {
        format!("order-{}-again", self.order_id)
    }

    /// The message body.
    pub(crate) fn body(&self) -> Vec<u8> {
        match self.kind {
            OrderKind::BadJson => format!("order {} <not json>", self.order_id).into_bytes(),
            OrderKind::Valid | OrderKind::Rejected => {
                // A rejected order has a negative amount: the handler refuses it every time.
                let amount = if self.kind == OrderKind::Rejected {
                    -i128::from(self.amount_cents)
                } else {
                    i128::from(self.amount_cents)
                };
                format!(
                    r#"{{"order_id":{},"amount_cents":{amount},"email":"customer{}@example.com"}}"#,
                    self.order_id, self.order_id
                )
                .into_bytes()
            }
        }
    }
}

/// The whole schedule.
#[derive(Clone, Debug)]
pub(crate) struct Plan {
    pub(crate) orders: Vec<PlannedOrder>,
    /// After how many handled deliveries the processor is restarted.
    pub(crate) restart_after: u64,
}

impl Plan {
    /// Draws the schedule for `count` orders from `seed`.
    pub(crate) fn new(count: u64, seed: u64, rates: &FaultRates) -> Self {
        let mut rng = StdRng::seed_from_u64(seed);
        let orders = (1..=count)
            .map(|order_id| {
                let kind = if rng.random_bool(rates.poison_json) {
                    OrderKind::BadJson
                } else if rng.random_bool(rates.poison_rejected) {
                    OrderKind::Rejected
                } else {
                    OrderKind::Valid
                };
                let valid = kind == OrderKind::Valid;
                PlannedOrder {
                    order_id,
                    amount_cents: rng.random_range(100..100_000),
                    kind,
                    retries: u32::from(rng.random_bool(rates.sender_retry)),
                    republished: valid && rng.random_bool(rates.republish),
                    crash_after_commit: valid && rng.random_bool(rates.crash_after_commit),
                    slow: false,
                    transient_failures: if valid && rng.random_bool(rates.transient) {
                        rng.random_range(1..=3)
                    } else {
                        0
                    },
                }
            })
            .collect::<Vec<PlannedOrder>>();
        let mut orders = orders;
        let valid: Vec<usize> =
            (0..orders.len()).filter(|&i| orders[i].kind == OrderKind::Valid).collect();
        for _ in 0..rates.slow.min(valid.len() as u64) {
            // Distinct picks: retry on a repeat (the count is tiny next to the orders).
            loop {
                let i = valid[rng.random_range(0..valid.len())];
                if !orders[i].slow {
                    orders[i].slow = true;
                    break;
                }
            }
        }
        Self { orders, restart_after: count / 2 }
    }

    /// Orders that must have effects.
    pub(crate) fn valid_orders(&self) -> u64 {
        self.orders.iter().filter(|o| o.kind == OrderKind::Valid).count() as u64
    }

    /// Orders that must end in the dead-letter queue.
    pub(crate) fn poison(&self) -> u64 {
        self.orders.iter().filter(|o| o.kind != OrderKind::Valid).count() as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_plan_and_every_fault_occurs() {
        let rates = FaultRates::default();
        let a = Plan::new(1000, 7, &rates);
        let b = Plan::new(1000, 7, &rates);
        assert_eq!(format!("{:?}", a.orders), format!("{:?}", b.orders));
        let o = &a.orders;
        assert!(o.iter().any(|o| o.retries > 0));
        assert!(o.iter().any(|o| o.republished));
        assert!(o.iter().any(|o| o.crash_after_commit));
        assert!(o.iter().any(|o| o.slow));
        assert!(o.iter().any(|o| o.transient_failures > 0));
        assert!(o.iter().any(|o| o.kind == OrderKind::BadJson));
        assert!(o.iter().any(|o| o.kind == OrderKind::Rejected));
        assert_eq!(a.valid_orders() + a.poison(), 1000);
    }
}
