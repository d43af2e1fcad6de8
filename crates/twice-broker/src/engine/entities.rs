//! Entities made, changed and removed: creation, update, rule changes, a configuration applied
//! whole, deletion and the reset of every entity, with the checks each passes first (names,
//! immutable properties, the namespace's caps).

use std::collections::HashMap;

use twice::Timestamp;

use super::state::{Entity, Kind};
use super::{Engine, EntityId, EntityRef, Record, RuleChange, with_default_rule};
use crate::config::EntityDefinition;
use crate::error::Error;

impl Engine {
    /// Creates an entity; a subscription's topic must exist.
    pub(crate) fn create_entity(
        &mut self,
        now: Timestamp,
        definition: EntityDefinition,
    ) -> Result<EntityRef, Error> {
        self.tick(now);
        let definition = with_default_rule(definition);
        self.check_definition(&definition, &[])?;
        let path = definition.path();
        if self.by_path.contains_key(&path.to_ascii_lowercase()) {
            return Err(Error::EntityAlreadyExists(path));
        }
        self.check_limits(std::slice::from_ref(&definition))?;
        let id = EntityId(self.next_entity_id);
        self.emit_all(Record::entity_with_limits(id, definition, 1))?;
        self.resolve(&path)
    }

    /// The entity at `path` (any case), which must exist.
    fn existing(&self, path: &str) -> Result<&Entity, Error> {
        let slot = self.by_path.get(&path.to_ascii_lowercase());
        slot.and_then(|&slot| self.ent(slot)).ok_or_else(|| Error::EntityNotFound(path.to_owned()))
    }

    /// Changes the properties (and a subscription's rules) of an existing entity.
    /// `RequiresDuplicateDetection` and `RequiresSession` cannot change.
    pub(crate) fn update_entity(
        &mut self,
        now: Timestamp,
        definition: EntityDefinition,
    ) -> Result<(), Error> {
        self.tick(now);
        self.check_definition(&definition, &[])?;
        let path = definition.path();
        let e = self.existing(&path)?;
        check_immutable(e, &definition)?;
        self.check_limits(std::slice::from_ref(&definition))?;
        let (id, next_sequence) = (e.id, e.next_seq);
        self.emit_all(Record::entity_with_limits(id, definition, next_sequence))
    }

    /// Changes a subscription's rules to those of `definition` (its properties stay), which
    /// must differ from them by `change`: writes that one rule, not the subscription.
    pub(crate) fn change_rules(
        &mut self,
        now: Timestamp,
        definition: EntityDefinition,
        change: RuleChange,
    ) -> Result<(), Error> {
        self.tick(now);
        self.check_definition(&definition, &[])?;
        let path = definition.path();
        let e = self.existing(&path)?;
        if !matches!(e.kind, Kind::Subscription { .. }) {
            return Err(Error::InvalidOperation("only subscriptions have rules".to_owned()));
        }
        self.check_limits(std::slice::from_ref(&definition))?;
        let subscription = e.id;
        self.emit(match change {
            RuleChange::Added(rule) => Record::RuleAdded { subscription, rule },
            RuleChange::Removed(name) => Record::RuleRemoved { subscription, name },
        })
    }

    /// Creates the entities that do not exist and updates those that do, all or nothing
    /// (how a configuration file is applied).
    pub(crate) fn apply_definitions(
        &mut self,
        now: Timestamp,
        definitions: &[EntityDefinition],
    ) -> Result<(), Error> {
        self.tick(now);
        for (i, d) in definitions.iter().enumerate() {
            self.check_definition(d, &definitions[..i])?;
            let key = d.path().to_ascii_lowercase();
            if let Some(earlier) =
                definitions[..i].iter().find(|e| e.path().to_ascii_lowercase() == key)
            {
                return Err(Error::EntityAlreadyExists(earlier.path()));
            }
            if let Some(e) = self.by_path.get(&key).and_then(|&s| self.ent(s)) {
                check_immutable(e, d)?;
            }
        }
        self.check_limits(definitions)?;
        for d in definitions {
            let path = d.path();
            // A configuration declares each subscription whole: one declared without rules
            // has the `$Default` rule, whatever was done to its rules since.
            let d = with_default_rule(d.clone());
            match self.by_path.get(&path.to_ascii_lowercase()).and_then(|&s| self.ent(s)) {
                Some(e) => {
                    let (id, next_sequence) = (e.id, e.next_seq);
                    self.emit_all(Record::entity_with_limits(id, d, next_sequence))?;
                }
                None => {
                    let id = EntityId(self.next_entity_id);
                    self.emit_all(Record::entity_with_limits(id, d, 1))?;
                }
            }
        }
        Ok(())
    }

    /// Deletes an entity with its messages (a topic with its subscriptions). Parked receivers
    /// on it are served with nothing.
    pub(crate) fn delete_entity(&mut self, now: Timestamp, entity: EntityRef) -> Result<(), Error> {
        self.tick(now);
        let e = self.entity(entity)?;
        let mut ids = Vec::new();
        if let Kind::Topic { subs, .. } = &e.kind {
            ids.extend(subs.iter().filter_map(|&s| self.ent(s)).map(|s| s.id));
        }
        ids.push(e.id);
        for id in ids {
            self.emit(Record::EntityDeleted { id })?;
        }
        Ok(())
    }

    /// Empties every entity at once: each is deleted with everything it holds and made again
    /// with its definition (a topic with its subscriptions and their rules), so active,
    /// scheduled, deferred and dead-lettered messages, locks, session states, sequence numbers
    /// and the duplicate-detection history are gone, and the entities and their properties
    /// stay. One turn, so one commit. Returns how many entities there are.
    pub(crate) fn reset(&mut self, now: Timestamp) -> Result<usize, Error> {
        self.tick(now);
        let entities = self.entities();
        let mut definitions = Vec::with_capacity(entities.len());
        for (e, _) in &entities {
            definitions.push(self.definition(*e)?);
        }
        // Topics and queues first: a subscription is made after its topic.
        definitions.sort_by_key(|d| matches!(d, EntityDefinition::Subscription { .. }));
        for (e, _) in entities {
            // A topic's deletion takes its subscriptions with it.
            let top = self
                .ent(e.slot)
                .is_some_and(|x| x.id == e.id && !matches!(x.kind, Kind::Subscription { .. }));
            if top {
                self.delete_entity(now, e)?;
            }
        }
        for d in &definitions {
            let id = EntityId(self.next_entity_id);
            self.emit_all(Record::entity_with_limits(id, d.clone(), 1))?;
        }
        Ok(definitions.len())
    }

    /// Checks a definition against the entities and the definitions before it in a batch.
    pub(super) fn check_definition(
        &self,
        d: &EntityDefinition,
        earlier: &[EntityDefinition],
    ) -> Result<(), Error> {
        d.validate()?;
        let own = d.path().to_ascii_lowercase();
        let forwards = match d {
            EntityDefinition::Queue { properties, .. } => [
                properties.forward_to.as_deref(),
                properties.forward_dead_lettered_messages_to.as_deref(),
            ],
            EntityDefinition::Subscription { properties, .. } => [
                properties.forward_to.as_deref(),
                properties.forward_dead_lettered_messages_to.as_deref(),
            ],
            _ => [None, None],
        };
        if forwards[0].is_some_and(|f| f.to_ascii_lowercase() == own) {
            return Err(Error::InvalidProperty {
                property: "ForwardTo",
                reason: "an entity cannot forward to itself".to_owned(),
            });
        }
        if let EntityDefinition::Subscription { topic, .. } = d {
            let key = topic.to_ascii_lowercase();
            let exists = self.by_path.get(&key).and_then(|&s| self.ent(s)).is_some_and(Entity::is_topic)
                || earlier.iter().any(|e| {
                    matches!(e, EntityDefinition::Topic { name, .. } if name.to_ascii_lowercase() == key)
                });
            if !exists {
                return Err(Error::EntityNotFound(topic.clone()));
            }
        }
        Ok(())
    }
    /// Checks that creating or changing these entities keeps the namespace within its
    /// [`super::Limits`]: the queues and topics it holds, each topic's subscriptions and each
    /// subscription's rules. A change that does not add to a count past its cap (a
    /// subscription that already had more rules, from a broker with a higher cap) passes.
    pub(super) fn check_limits(&self, definitions: &[EntityDefinition]) -> Result<(), Error> {
        let limits = self.opts.limits;
        let exists =
            |path: &str| self.by_path.get(&path.to_ascii_lowercase()).and_then(|&s| self.ent(s));
        let mut entities = None;
        let mut new_entities = 0usize;
        let mut new_subs: HashMap<String, usize> = HashMap::new();
        for d in definitions {
            let path = d.path();
            let existing = exists(&path);
            match d {
                EntityDefinition::Queue { .. } | EntityDefinition::Topic { .. } => {
                    if existing.is_some() {
                        continue;
                    }
                    new_entities += 1;
                    let held = *entities.get_or_insert_with(|| {
                        self.entities
                            .iter()
                            .flatten()
                            .filter(|e| !matches!(e.kind, Kind::Subscription { .. }))
                            .count()
                    });
                    if held + new_entities > limits.max_entities {
                        return Err(Error::LimitExceeded {
                            path,
                            holder: "the namespace".to_owned(),
                            held: held + new_entities - 1,
                            what: "queues and topics",
                            limit: limits.max_entities,
                            option: "max_entities",
                        });
                    }
                }
                EntityDefinition::Subscription { topic, rules, .. } => {
                    let held_rules = match existing.map(|e| &e.kind) {
                        Some(Kind::Subscription { rules, .. }) => rules.len(),
                        _ => 0,
                    };
                    if rules.len() > limits.max_rules_per_subscription && rules.len() > held_rules {
                        let rule = rules.last().map_or("", |r| r.name.as_str());
                        return Err(Error::LimitExceeded {
                            path: format!("{path}/Rules/{rule}"),
                            holder: format!("subscription {path:?}"),
                            held: held_rules,
                            what: "rules",
                            limit: limits.max_rules_per_subscription,
                            option: "max_rules_per_subscription",
                        });
                    }
                    if existing.is_some() {
                        continue;
                    }
                    let key = topic.to_ascii_lowercase();
                    let adding = new_subs.entry(key.clone()).or_default();
                    *adding += 1;
                    let held = match exists(&key).map(|e| &e.kind) {
                        Some(Kind::Topic { subs, .. }) => subs.len(),
                        _ => 0,
                    };
                    if held + *adding > limits.max_subscriptions_per_topic {
                        return Err(Error::LimitExceeded {
                            path,
                            holder: format!("topic {topic:?}"),
                            held: held + *adding - 1,
                            what: "subscriptions",
                            limit: limits.max_subscriptions_per_topic,
                            option: "max_subscriptions_per_topic",
                        });
                    }
                }
            }
        }
        Ok(())
    }
}

pub(super) fn check_immutable(e: &Entity, d: &EntityDefinition) -> Result<(), Error> {
    let immutable = |property| Err(Error::ImmutableProperty { entity: e.path.clone(), property });
    match (&e.kind, d) {
        (Kind::Queue(old), EntityDefinition::Queue { properties, .. }) => {
            if old.requires_duplicate_detection != properties.requires_duplicate_detection {
                return immutable("RequiresDuplicateDetection");
            }
            if old.requires_session != properties.requires_session {
                return immutable("RequiresSession");
            }
            Ok(())
        }
        (Kind::Topic { props, .. }, EntityDefinition::Topic { properties, .. }) => {
            if props.requires_duplicate_detection != properties.requires_duplicate_detection {
                return immutable("RequiresDuplicateDetection");
            }
            Ok(())
        }
        (Kind::Subscription { props, .. }, EntityDefinition::Subscription { properties, .. }) => {
            if props.requires_session != properties.requires_session {
                return immutable("RequiresSession");
            }
            Ok(())
        }
        _ => Err(Error::EntityAlreadyExists(e.path.clone())),
    }
}
