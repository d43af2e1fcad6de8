//! What the engine writes to the log: one [`Record`] per state change.

use std::sync::Arc;

use bytes::Bytes;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use twice::{Message, MessageId, Properties, SessionId, Timestamp};

use crate::config::{EntityDefinition, Filter, Rule};

/// The persistent id of an entity: assigned at creation, never reused, restated by every
/// checkpoint. Records name entities by it rather than by path, so that a deleted and
/// re-created entity of the same name is a different entity.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub(crate) struct EntityId(pub(crate) u64);

/// One queue-like store: the main queue of a queue or subscription (or the scheduled messages
/// of a topic), or its dead-letter queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub(crate) struct StoreKey {
    /// The entity.
    pub(crate) entity: EntityId,
    /// Whether this is the entity's `$DeadLetterQueue`.
    pub(crate) dead_letter: bool,
}

/// A message as written to the log: the sender's message, shared, not copied.
///
/// Serialized as the [`Message`] itself.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct StoredMessage(pub(crate) Arc<Message>);

impl Serialize for StoredMessage {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.0.serialize(s)
    }
}

impl<'de> Deserialize<'de> for StoredMessage {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Message::deserialize(d).map(|m| Self(Arc::new(m)))
    }
}

/// The state of a message in its store, as recorded.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum PlacedState {
    /// Available to receivers.
    Active,
    /// Locked by a receiver (locks themselves are not recorded: after a restart the message is
    /// available again with its delivery count raised).
    Locked,
    /// Deferred: receivable by sequence number only.
    Deferred,
    /// Deferred, and locked by a receive-by-sequence-number.
    DeferredLocked,
    /// Waiting for its scheduled enqueue time (kept in the `enqueued` field).
    Scheduled,
}

/// What the broker set on a message beyond the common fields: the application properties
/// changed by abandon, defer or dead-letter, and the dead-letter fields.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub(crate) struct Extra {
    /// Properties merged over the sender's application properties.
    pub(crate) properties: Properties,
    /// `DeadLetterReason`.
    pub(crate) dead_letter_reason: Option<String>,
    /// `DeadLetterErrorDescription`.
    pub(crate) dead_letter_description: Option<String>,
    /// The entity the message was dead-lettered in, when it was forwarded from there.
    pub(crate) dead_letter_source: Option<String>,
    /// The time to live a dead-lettered message had, given back to it when it is resubmitted
    /// (its body may be on disk by then).
    pub(crate) time_to_live: Option<std::time::Duration>,
    /// What a subscription rule's action changed in this copy, beyond the properties it set
    /// (which are in `properties`).
    pub(crate) action: Option<Box<crate::sql::Changes>>,
}

impl Extra {
    pub(crate) fn is_empty(&self) -> bool {
        self.properties.is_empty()
            && self.dead_letter_reason.is_none()
            && self.dead_letter_description.is_none()
            && self.dead_letter_source.is_none()
            && self.time_to_live.is_none()
            && self.action.is_none()
    }
}

/// A message in one store, with everything the broker keeps about it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub(crate) struct Placement {
    /// The store.
    pub(crate) store: StoreKey,
    /// Its sequence number there.
    pub(crate) sequence: i64,
    /// When it entered the store (for a scheduled message: when it will).
    pub(crate) enqueued: Timestamp,
    /// When it expires, if it does.
    pub(crate) expires: Option<Timestamp>,
    /// The delivery count of its next (or current) delivery: 1 before the first.
    pub(crate) delivery_count: u32,
    /// Its state.
    pub(crate) state: PlacedState,
    /// Broker-set properties and dead-letter fields (rare, so boxed).
    pub(crate) extra: Option<Box<Extra>>,
}

/// Identifies the in-memory copy of a message body, so that the runtime can tell the engine
/// where the record carrying it landed ([`super::Engine::set_location`]). Not persisted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct BodyKey {
    pub(crate) index: u32,
    pub(crate) generation: u32,
}

impl BodyKey {
    /// No body (a send that reached no subscription, or a record read back from the log).
    pub(crate) const NONE: BodyKey = BodyKey { index: u32::MAX, generation: 0 };
}

impl Default for BodyKey {
    /// [`BodyKey::NONE`]: a deserialized record names no in-memory body.
    fn default() -> Self {
        Self::NONE
    }
}

/// The rule recorded for a subscription that has none: its name is one no caller can give.
fn no_rules_marker() -> Rule {
    Rule::new("", Filter::False)
}

/// A subscription's rules as a [`Record::Entity`] holds them, turned into the rules it has.
///
/// An empty recorded list is the `$Default` rule: logs written before a subscription could
/// lose all its rules say so. A subscription without rules is recorded with one rule that
/// matches nothing and has an empty name (which no caller can create), so a build that knows
/// nothing of this still reads such a subscription as receiving nothing.
pub(crate) fn live_rules(recorded: &[Rule]) -> Vec<Rule> {
    match recorded {
        [] => vec![Rule::default_rule()],
        [only] if only.name.is_empty() && only.filter == Filter::False => Vec::new(),
        rules => rules.to_vec(),
    }
}

/// One change to the broker's state, in the order it happened.
///
/// Replaying every record of the log in order, then [`super::Engine::finish_recovery`],
/// rebuilds the state. Records never hold lock tokens: locks do not survive a restart.
///
/// The encoding must round-trip through a non-self-describing serde format (the runtime uses a
/// compact binary one), so no record uses `flatten`, `untagged` or skipped-if fields.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub(crate) enum Record {
    /// An entity was created or changed, or (in a checkpoint) is restated. Replay overwrites.
    Entity {
        /// Its id.
        id: EntityId,
        /// Its definition (boxed: records of this kind are rare and large).
        definition: Box<EntityDefinition>,
        /// The next sequence number of a queue or topic (1 for a new one; unused for
        /// subscriptions, which take the topic's).
        next_sequence: i64,
    },
    /// An entity and everything in it was deleted.
    EntityDeleted {
        /// Its id.
        id: EntityId,
    },
    /// A message was sent to a queue or topic. Carries the body: its location is where the
    /// message is stored.
    Sent {
        /// The queue or topic it was sent to.
        target: EntityId,
        /// The sequence number the target gave it.
        sequence: i64,
        /// When it was sent (the start of its duplicate-detection window).
        at: Timestamp,
        /// The message, with its message id set.
        message: StoredMessage,
        /// Where it landed: the target, the subscriptions whose rules matched, forwarding
        /// targets, or dead-letter queues. Empty when nothing matched.
        placements: Vec<Placement>,
        /// Whether more records of the same all-or-nothing batch follow. A batch cut short at
        /// the end of the log was never acknowledged and is dropped by recovery.
        more: bool,
        /// Which in-memory body this is (not persisted).
        #[serde(skip)]
        body: BodyKey,
    },
    /// A full restatement of a live message, written when compaction moves it out of an old
    /// segment. Replay overwrites the placements it names.
    Snapshot {
        /// The message.
        message: StoredMessage,
        /// Every store that holds it, with its current state.
        placements: Vec<Placement>,
        /// Which in-memory body this is (not persisted).
        #[serde(skip)]
        body: BodyKey,
    },
    /// Messages were locked by a peek-lock receive.
    Locked {
        /// The store.
        store: StoreKey,
        /// Their sequence numbers.
        sequences: Vec<i64>,
    },
    /// Messages left the broker: completed, received and deleted, cancelled, or expired.
    Removed {
        /// The store.
        store: StoreKey,
        /// Their sequence numbers.
        sequences: Vec<i64>,
    },
    /// A message was unlocked, deferred or activated: abandon, release, defer, lock expiry,
    /// session lock loss, recovery, or a scheduled message reaching its time.
    Updated {
        /// The store.
        store: StoreKey,
        /// The message.
        sequence: i64,
        /// Its delivery count from now on.
        delivery_count: u32,
        /// Its new state: `Active` or `Deferred`.
        state: PlacedState,
        /// Properties to merge into its broker-set properties.
        properties: Option<Properties>,
    },
    /// A message moved: to a dead-letter queue, to a forwarding target, from a topic's
    /// scheduled messages to its subscriptions, or from a dead-letter queue back to its entity.
    /// The body stays where it is.
    Moved {
        /// Where it was.
        from: StoreKey,
        /// Its sequence number there.
        sequence: i64,
        /// Where it is now (empty: it was dropped).
        to: Vec<Placement>,
    },
    /// A session's state was set (`None`: cleared).
    SessionState {
        /// The entity.
        entity: EntityId,
        /// The session.
        session: SessionId,
        /// The state.
        state: Option<Bytes>,
    },
    /// Message ids still inside their duplicate-detection window (checkpoint only), with
    /// the time each window ends.
    DuplicateIds {
        /// The queue or topic.
        entity: EntityId,
        /// The ids.
        ids: Vec<(MessageId, Timestamp)>,
    },
    /// The size limit of a queue or topic (`MaxSizeInMegabytes`), written right after each
    /// [`Record::Entity`] of one. A record of its own, not a field of `Entity`, so that logs
    /// written before the limit was kept still read (records are positional).
    EntityLimits {
        /// The queue or topic.
        id: EntityId,
        /// Its `MaxSizeInMegabytes`.
        max_size_in_megabytes: u64,
    },
    /// A rule was added to a subscription, after its others. A record of its own so that a
    /// rule change writes the rule, not the subscription with every rule it has.
    RuleAdded {
        /// The subscription.
        subscription: EntityId,
        /// The rule (boxed: records of this kind are rare and large).
        rule: Box<Rule>,
    },
    /// A rule was removed from a subscription (named without regard to case).
    RuleRemoved {
        /// The subscription.
        subscription: EntityId,
        /// The rule's name.
        name: String,
    },
}

impl Record {
    /// A [`Record::Entity`], with a subscription's rules in their recorded form (see
    /// [`live_rules`]).
    pub(crate) fn entity(id: EntityId, definition: EntityDefinition, next_sequence: i64) -> Record {
        let definition = match definition {
            EntityDefinition::Subscription { topic, name, properties, rules }
                if rules.is_empty() =>
            {
                EntityDefinition::subscription(topic, name, properties, vec![no_rules_marker()])
            }
            d => d,
        };
        Record::Entity { id, definition: Box::new(definition), next_sequence }
    }

    /// The records that state an entity: [`Record::entity`], then for a queue or topic its
    /// [`Record::EntityLimits`].
    pub(crate) fn entity_with_limits(
        id: EntityId,
        definition: EntityDefinition,
        next_sequence: i64,
    ) -> impl Iterator<Item = Record> {
        let max_size_in_megabytes = match &definition {
            EntityDefinition::Queue { properties, .. } => Some(properties.max_size_in_megabytes),
            EntityDefinition::Topic { properties, .. } => Some(properties.max_size_in_megabytes),
            EntityDefinition::Subscription { .. } => None,
        };
        let limits = max_size_in_megabytes
            .map(|max_size_in_megabytes| Record::EntityLimits { id, max_size_in_megabytes });
        std::iter::once(Record::entity(id, definition, next_sequence)).chain(limits)
    }

    /// The message this record carries, if it is a [`Record::Sent`] or [`Record::Snapshot`]:
    /// what a delivery whose body is stored at this record's location holds.
    pub(crate) fn message(&self) -> Option<&Arc<Message>> {
        match self {
            Record::Sent { message, .. } | Record::Snapshot { message, .. } => Some(&message.0),
            _ => None,
        }
    }

    /// The message this record carries, taken out of it.
    pub(crate) fn into_message(self) -> Option<Message> {
        match self {
            Record::Sent { message, .. } | Record::Snapshot { message, .. } => {
                Some(Arc::try_unwrap(message.0).unwrap_or_else(|shared| (*shared).clone()))
            }
            _ => None,
        }
    }

    /// The in-memory body this record carries, for [`super::Engine::set_location`] once the
    /// record is written.
    pub(crate) fn body_key(&self) -> Option<BodyKey> {
        match self {
            Record::Sent { body, .. } | Record::Snapshot { body, .. } if *body != BodyKey::NONE => {
                Some(*body)
            }
            _ => None,
        }
    }
}
