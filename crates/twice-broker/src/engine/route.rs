//! Where a message lands: a queue, a topic's matching subscriptions, a forwarding target, or a
//! dead-letter queue. Routing only reads the state and produces [`Placement`]s; applying the
//! record that carries them changes the state.

use std::sync::Arc;
use std::time::Duration;

use twice::{Message, Timestamp, Value};

use super::record::{Extra, PlacedState, Placement};
use super::state::{Entity, Kind};
use super::{Engine, MAX_TRANSFER_HOPS};
use crate::config::Filter;
use crate::dead_letter_reasons;
use crate::error::Error;

/// The application property that names the rule whose action made a subscription's copy.
pub(crate) const RULE_NAME_PROPERTY: &str = "RuleName";

/// A message being routed, with what the broker knows about it.
#[derive(Clone, Debug)]
pub(super) struct Item {
    /// The message, when in memory (needed to evaluate a topic's filters).
    pub(super) message: Option<Arc<Message>>,
    pub(super) has_session: bool,
    /// The smallest time to live so far (the message's, then each entity's on the way).
    pub(super) ttl: Option<Duration>,
    pub(super) delivery_count: u32,
    pub(super) extra: Option<Extra>,
    /// The enqueued time to keep in a dead-letter queue (the original one).
    pub(super) enqueued: Option<Timestamp>,
}

/// Sequence numbers handed out while routing, before the records that use them are applied.
#[derive(Debug)]
pub(super) struct Router {
    now: Timestamp,
    next: Vec<(u32, i64)>,
}

impl Router {
    pub(super) fn new(now: Timestamp) -> Self {
        Self { now, next: Vec::new() }
    }

    /// The next sequence number of the queue or topic in `owner`.
    pub(super) fn alloc(&mut self, engine: &Engine, owner: u32) -> i64 {
        if let Some((_, n)) = self.next.iter_mut().find(|(s, _)| *s == owner) {
            let seq = *n;
            *n += 1;
            return seq;
        }
        let seq = engine.ent(owner).map_or(1, |e| e.next_seq);
        self.next.push((owner, seq + 1));
        seq
    }
}

/// `enqueued + min(ttls)`, or `None` when nothing limits the message's life.
fn expiry(enqueued: Timestamp, a: Option<Duration>, b: Option<Duration>) -> Option<Timestamp> {
    let ttl = match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    };
    ttl.map(|d| enqueued + d)
}

fn min_ttl(a: Option<Duration>, b: Option<Duration>) -> Option<Duration> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

fn with_reason(item: &Item, reason: &str, description: String) -> Item {
    let mut item = item.clone();
    let extra = item.extra.get_or_insert_with(Extra::default);
    extra.dead_letter_reason = Some(reason.to_owned());
    extra.dead_letter_description = Some(description);
    item
}

impl Engine {
    /// The slot whose sequence numbers an entity uses (a subscription uses its topic's).
    fn owner(&self, slot: u32) -> u32 {
        match self.ent(slot).map(|e| &e.kind) {
            Some(Kind::Subscription { topic, .. }) => *topic,
            _ => slot,
        }
    }

    /// The queue or topic a `ForwardTo`-style name designates, if it exists.
    pub(super) fn forward_target(&self, name: Option<&str>) -> Option<u32> {
        let slot = *self.by_path.get(&name?.to_ascii_lowercase())?;
        let e = self.ent(slot)?;
        (!matches!(e.kind, Kind::Subscription { .. })).then_some(slot)
    }

    /// Routes a message sent to the queue or topic in `slot`; returns its sequence number
    /// there. A scheduled message stays in the entity until its time, whatever the entity
    /// does with messages then.
    pub(super) fn route_send(
        &self,
        r: &mut Router,
        slot: u32,
        message: &Arc<Message>,
        out: &mut Vec<Placement>,
    ) -> Result<i64, Error> {
        let e =
            self.ent(slot).ok_or_else(|| Error::EntityNotFound("(deleted entity)".to_owned()))?;
        let item = Item {
            message: Some(Arc::clone(message)),
            has_session: message.session_id.is_some(),
            ttl: message.time_to_live,
            delivery_count: 1,
            extra: None,
            enqueued: None,
        };
        let seq = r.alloc(self, slot);
        match message.scheduled_enqueue_time.filter(|&at| at > r.now) {
            Some(at) => out.push(Placement {
                store: e.key(false),
                sequence: seq,
                enqueued: at,
                expires: expiry(at, item.ttl, e.default_ttl()),
                delivery_count: 1,
                state: PlacedState::Scheduled,
                extra: None,
            }),
            None => self.land(r, slot, seq, 0, &item, out),
        }
        Ok(seq)
    }

    /// Routes a message resubmitted from the dead-letter queue of `slot` back to it; returns
    /// its new sequence number.
    pub(super) fn route_resubmit(
        &self,
        r: &mut Router,
        slot: u32,
        item: &Item,
        out: &mut Vec<Placement>,
    ) -> Result<i64, Error> {
        let seq = r.alloc(self, self.owner(slot));
        self.land(r, slot, seq, 0, item, out);
        Ok(seq)
    }

    /// A message arrives at an entity with sequence number `seq` there, after `hops`
    /// auto-forwards (also how a scheduled message of a topic or forwarding queue is routed
    /// when its time comes).
    pub(super) fn land(
        &self,
        r: &mut Router,
        slot: u32,
        seq: i64,
        hops: u32,
        item: &Item,
        out: &mut Vec<Placement>,
    ) {
        let Some(e) = self.ent(slot) else { return };
        if let Kind::Topic { subs, .. } = &e.kind {
            let item = Item { ttl: min_ttl(item.ttl, e.default_ttl()), ..item.clone() };
            for &sub in subs {
                self.land_in_subscription(r, sub, seq, hops, &item, out);
            }
            return;
        }
        if let Some(target) = self.forward_target(e.forward_to()) {
            if hops >= MAX_TRANSFER_HOPS {
                let item = with_reason(
                    item,
                    dead_letter_reasons::MAX_TRANSFER_HOP_COUNT_EXCEEDED,
                    format!("The message was auto-forwarded more than {MAX_TRANSFER_HOPS} times."),
                );
                self.place_dead_letter(r, e, seq, &item, out);
                return;
            }
            let tseq = r.alloc(self, self.owner(target));
            let item =
                Item { ttl: min_ttl(item.ttl, e.default_ttl()), delivery_count: 1, ..item.clone() };
            self.land(r, target, tseq, hops + 1, &item, out);
            return;
        }
        if e.requires_session() && !item.has_session {
            let item = with_reason(
                item,
                dead_letter_reasons::SESSION_ID_IS_NULL,
                "A session-enabled entity does not accept a message without a session id."
                    .to_owned(),
            );
            self.route_dead_letter(r, slot, seq, hops, &item, out);
            return;
        }
        out.push(Placement {
            store: e.key(false),
            sequence: seq,
            enqueued: r.now,
            expires: expiry(r.now, item.ttl, e.default_ttl()),
            delivery_count: item.delivery_count,
            state: PlacedState::Active,
            extra: item.extra.clone().map(Box::new),
        });
    }

    /// A topic's message arrives at one of its subscriptions. The rules without an action
    /// give it one copy between them, with the topic's sequence number `seq`; each rule with an
    /// action that selects it gives a copy of its own, with a new sequence number, changed by
    /// the action and carrying the application property `RuleName`. A subscription without
    /// rules gets nothing. Without the message in memory only rules that need nothing of it
    /// (the true filter, without an action) can match; the engine keeps the message in memory
    /// wherever it may have to be routed later, so that does not happen.
    fn land_in_subscription(
        &self,
        r: &mut Router,
        sub: u32,
        seq: i64,
        hops: u32,
        item: &Item,
        out: &mut Vec<Placement>,
    ) {
        let Some(Kind::Subscription { rules, .. }) = self.ent(sub).map(|e| &e.kind) else {
            return;
        };
        let message = item.message.as_deref();
        let mut plain = false;
        for rule in rules {
            let selected = match (&rule.filter, message) {
                (Filter::True, _) => true,
                (f, Some(m)) => f.matches(m),
                (_, None) => false,
            };
            match (&rule.action, message) {
                (_, _) if !selected => {}
                (None, _) => plain = true,
                (Some(action), Some(m)) => {
                    let mut copy = m.clone();
                    action.apply(&mut copy);
                    copy.application_properties
                        .insert(RULE_NAME_PROPERTY.to_owned(), Value::String(rule.name.clone()));
                    let (set, changes) = crate::sql::Changes::between(m, &copy);
                    let mut extra = item.extra.clone().unwrap_or_default();
                    extra.properties.extend(set);
                    extra.action = (!changes.is_empty()).then(|| Box::new(changes));
                    let copy_item = Item {
                        has_session: copy.session_id.is_some(),
                        message: Some(Arc::new(copy)),
                        extra: Some(extra),
                        ..item.clone()
                    };
                    let copy_seq = r.alloc(self, self.owner(sub));
                    self.land(r, sub, copy_seq, hops, &copy_item, out);
                }
                (Some(_), None) => {}
            }
        }
        if plain {
            self.land(r, sub, seq, hops, item, out);
        }
    }

    /// Dead-letters a message of entity `slot`: to its `ForwardDeadLetteredMessagesTo`
    /// entity when it has one (as an ordinary message there, with the dead-letter fields and
    /// source), else to its own dead-letter queue with the same sequence number.
    pub(super) fn route_dead_letter(
        &self,
        r: &mut Router,
        slot: u32,
        seq: i64,
        hops: u32,
        item: &Item,
        out: &mut Vec<Placement>,
    ) {
        let Some(e) = self.ent(slot) else { return };
        if let Some(target) = self.forward_target(e.forward_dead_lettered_to())
            && hops < MAX_TRANSFER_HOPS
        {
            let mut item = item.clone();
            item.extra.get_or_insert_with(Extra::default).dead_letter_source = Some(e.path.clone());
            item.delivery_count = 1;
            item.enqueued = None;
            let tseq = r.alloc(self, self.owner(target));
            self.land(r, target, tseq, hops + 1, &item, out);
            return;
        }
        self.place_dead_letter(r, e, seq, item, out);
    }

    fn place_dead_letter(
        &self,
        r: &Router,
        e: &Entity,
        seq: i64,
        item: &Item,
        out: &mut Vec<Placement>,
    ) {
        out.push(Placement {
            store: e.key(true),
            sequence: seq,
            enqueued: item.enqueued.unwrap_or(r.now),
            // The dead-letter queue applies no time to live.
            expires: None,
            delivery_count: item.delivery_count,
            state: PlacedState::Active,
            extra: item.extra.clone().map(Box::new),
        });
    }
}
