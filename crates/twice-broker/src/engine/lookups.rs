//! Lookups: an entity path resolved to an [`EntityRef`]; the entity, store, message or session
//! an index names; an entity's definition, information and counts; the store a send or a
//! receive uses; and the counters a change adds to.

use twice::EntityInfo;

use super::state::{Entity, Kind, Meta, Session, Store, StoreIx};
use super::{Counters, DEAD_LETTER_SUFFIX, Engine, EntityCounts, EntityRef, StoreKey};
use crate::config::EntityDefinition;
use crate::error::Error;

impl Engine {
    /// Resolves `queue`, `topic`, `topic/Subscriptions/sub`, and any of these followed by
    /// `/$DeadLetterQueue` (case-insensitive, as every entity path).
    pub(crate) fn resolve(&self, path: &str) -> Result<EntityRef, Error> {
        let n = path.len().saturating_sub(DEAD_LETTER_SUFFIX.len());
        let (base, dead_letter) = match (path.get(..n), path.get(n..)) {
            (Some(base), Some(tail)) if tail.eq_ignore_ascii_case(DEAD_LETTER_SUFFIX) => {
                (base, true)
            }
            _ => (path, false),
        };
        // Most paths are already lower case: look them up without a copy.
        let slot = if base.bytes().any(|b| b.is_ascii_uppercase()) {
            self.by_path.get(&base.to_ascii_lowercase())
        } else {
            self.by_path.get(base)
        };
        let slot = *slot.ok_or_else(|| Error::EntityNotFound(path.to_owned()))?;
        let e = self.ent(slot).ok_or_else(|| Error::EntityNotFound(path.to_owned()))?;
        if dead_letter && e.is_topic() {
            return Err(Error::EntityNotFound(path.to_owned()));
        }
        Ok(EntityRef { slot, id: e.id, dead_letter })
    }

    /// The definition of an entity as it is now.
    pub(crate) fn definition(&self, entity: EntityRef) -> Result<EntityDefinition, Error> {
        let e = self.entity(entity)?;
        Ok(self.definition_of(e))
    }

    /// What a processor needs to know about the entity.
    pub(crate) fn entity_info(&self, entity: EntityRef) -> Result<EntityInfo, Error> {
        let e = self.entity(entity)?;
        let mut path = e.path.clone();
        if entity.dead_letter {
            path.push_str(DEAD_LETTER_SUFFIX);
        }
        let mut info = EntityInfo::new(path);
        info.lock_duration = e.lock_duration();
        info.max_delivery_count =
            (!entity.dead_letter && !e.is_topic()).then(|| e.max_delivery_count());
        info.duplicate_detection_window = e.dedup_window();
        info.requires_session = !entity.dead_letter && e.requires_session();
        Ok(info)
    }

    /// Every entity with its path, in creation order.
    pub(crate) fn entities(&self) -> Vec<(EntityRef, String)> {
        self.entities
            .iter()
            .enumerate()
            .filter_map(|(slot, e)| {
                let e = e.as_ref()?;
                let slot = u32::try_from(slot).ok()?;
                Some((EntityRef { slot, id: e.id, dead_letter: false }, e.path.clone()))
            })
            .collect()
    }

    /// Runtime counts of an entity (of a topic: its scheduled messages). O(1).
    pub(crate) fn counts(&self, entity: EntityRef) -> Result<EntityCounts, Error> {
        let e = self.entity(entity)?;
        let c = e.main.counts;
        Ok(EntityCounts {
            active: c.active,
            locked: c.locked,
            deferred: c.deferred,
            scheduled: c.scheduled,
            dead_letter: e.dlq.msgs.len() as u64,
        })
    }

    /// Monotone counters of an entity since the engine started.
    pub(crate) fn counters(&self, entity: EntityRef) -> Result<Counters, Error> {
        Ok(self.entity(entity)?.counters)
    }

    /// Monotone counters of the whole engine since it started.
    pub(crate) fn total_counters(&self) -> Counters {
        self.totals
    }

    pub(super) fn ent(&self, slot: u32) -> Option<&Entity> {
        self.entities.get(slot as usize).and_then(Option::as_ref)
    }

    pub(super) fn ent_mut(&mut self, slot: u32) -> Option<&mut Entity> {
        self.entities.get_mut(slot as usize).and_then(Option::as_mut)
    }

    pub(super) fn entity(&self, r: EntityRef) -> Result<&Entity, Error> {
        self.ent(r.slot)
            .filter(|e| e.id == r.id)
            .ok_or_else(|| Error::EntityNotFound(format!("entity #{} (deleted)", r.id.0)))
    }

    pub(super) fn store(&self, six: StoreIx) -> Option<&Store> {
        self.ent(six.slot()).map(|e| e.store(six.is_dlq()))
    }

    pub(super) fn store_mut(&mut self, six: StoreIx) -> Option<&mut Store> {
        self.ent_mut(six.slot()).map(|e| e.store_mut(six.is_dlq()))
    }

    pub(super) fn meta(&self, six: StoreIx, seq: i64) -> Option<&Meta> {
        self.store(six)?.msgs.get(seq)
    }

    pub(super) fn session_mut(&mut self, six: StoreIx, sid: u32) -> Option<&mut Session> {
        self.store_mut(six)?.sessions.as_mut()?.table.get_mut(&sid)
    }

    pub(super) fn key(&self, six: StoreIx) -> Result<StoreKey, Error> {
        self.ent(six.slot())
            .map(|e| e.key(six.is_dlq()))
            .ok_or_else(|| Error::Corrupt("a store of a deleted entity".to_owned()))
    }

    pub(super) fn count(&mut self, slot: u32, f: impl Fn(&mut Counters)) {
        f(&mut self.totals);
        if let Some(e) = self.ent_mut(slot) {
            f(&mut e.counters);
        }
    }

    pub(super) fn definition_of(&self, e: &Entity) -> EntityDefinition {
        match &e.kind {
            Kind::Queue(p) => EntityDefinition::queue(e.path.clone(), p.clone()),
            Kind::Topic { props, .. } => EntityDefinition::topic(e.path.clone(), props.clone()),
            Kind::Subscription { topic, name, props, rules } => EntityDefinition::subscription(
                self.ent(*topic).map(|t| t.path.clone()).unwrap_or_default(),
                name.clone(),
                props.clone(),
                rules.clone(),
            ),
        }
    }

    pub(super) fn send_target(&self, r: EntityRef) -> Result<u32, Error> {
        let e = self.entity(r)?;
        if r.dead_letter || matches!(e.kind, Kind::Subscription { .. }) {
            return Err(Error::InvalidOperation(format!(
                "cannot send to {:?}: send to a queue or topic",
                e.path
            )));
        }
        Ok(r.slot)
    }

    pub(super) fn receive_store(&self, r: EntityRef) -> Result<StoreIx, Error> {
        let e = self.entity(r)?;
        if e.is_topic() {
            return Err(Error::InvalidOperation(format!(
                "cannot receive from topic {:?}: receive from one of its subscriptions",
                e.path
            )));
        }
        Ok(r.six())
    }
}
