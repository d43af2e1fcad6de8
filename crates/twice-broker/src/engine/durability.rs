//! Durability: the records the engine hands to the log, replay, recovery, checkpoints and
//! compaction, with the recorded form of a message's placement.

use std::sync::Arc;

use twice::{Message, Timestamp};

use super::record::{self, BodyKey, Placement, Record, StoreKey};
use super::state::{Meta, StoreIx};
use super::{Engine, Location, MessageRef};
use crate::error::Error;
use std::collections::HashMap;

impl Engine {
    /// The records of every change since the last call, in order. Write them, sync once, and
    /// only then release the replies of the calls that made them.
    pub(crate) fn take_records(&mut self) -> Vec<Record> {
        std::mem::take(&mut self.records)
    }

    /// [`Engine::take_records`] by swapping with `out`, an empty vector: the engine goes on
    /// with `out`'s memory, so that neither side grows a vector from nothing on every turn.
    pub(crate) fn swap_records(&mut self, out: &mut Vec<Record>) {
        out.clear();
        std::mem::swap(&mut self.records, out);
    }

    /// Tells the engine where a record carrying a body ([`Record::body_key`]) was written: the
    /// engine drops its in-memory copy and delivers the location from now on.
    pub(crate) fn set_location(&mut self, body: BodyKey, location: Location) {
        self.aux.bodies.set_location(body.index, body.generation, location);
    }

    /// Applies one record of the log during recovery, in log order.
    pub(crate) fn replay(&mut self, record: Record, location: Location) -> Result<(), Error> {
        let batch_part = matches!(record, Record::Sent { .. });
        if !self.pending_batch.is_empty() && !batch_part {
            return Err(Error::Corrupt("a send batch is interrupted by another record".to_owned()));
        }
        if let Record::Sent { more: true, .. } = record {
            self.pending_batch.push((record, location));
            return Ok(());
        }
        let batch = std::mem::take(&mut self.pending_batch);
        for (mut r, loc) in batch {
            self.apply(&mut r, Some(loc))?;
        }
        let mut record = record;
        self.apply(&mut record, Some(location))
    }

    /// Ends recovery: drops a send batch cut short at the end of the log, makes the messages
    /// that were locked at the crash available again with their delivery count raised (see
    /// the module documentation), and processes what is due at `now`.
    pub(crate) fn finish_recovery(&mut self, now: Timestamp) -> Result<(), Error> {
        self.pending_batch.clear();
        let mut locked = Vec::new();
        for (slot, e) in self.entities.iter().enumerate() {
            let Some(e) = e else { continue };
            let Ok(slot) = u32::try_from(slot) else { continue };
            for dead_letter in [false, true] {
                let six = StoreIx::new(slot, dead_letter);
                locked.extend(
                    e.store(dead_letter)
                        .msgs
                        .iter()
                        .filter(|(_, m)| m.is_locked())
                        .map(|(s, _)| (six, s)),
                );
            }
        }
        for (six, seq) in locked {
            self.unlock_counted(now, six, seq, None)?;
        }
        self.run_timers(now)?;
        self.pump(now);
        Ok(())
    }

    /// Records restating all small state: entities (properties, rules, next sequence numbers),
    /// session states, and duplicate-detection ids still in their window. Written at the start
    /// of every segment; replaying them overwrites, and twice is harmless.
    pub(crate) fn checkpoint_records(&self) -> Vec<Record> {
        let mut out = Vec::new();
        for e in self.entities.iter().flatten() {
            out.extend(Record::entity_with_limits(e.id, self.definition_of(e), e.next_seq));
        }
        for e in self.entities.iter().flatten() {
            if let Some(ss) = &e.main.sessions {
                let mut states: Vec<_> = ss
                    .table
                    .iter()
                    .filter_map(|(&sid, s)| {
                        Some((self.aux.names.name(sid)?.clone(), s.state.clone()?))
                    })
                    .collect();
                states.sort_by(|a, b| a.0.cmp(&b.0));
                for (session, state) in states {
                    out.push(Record::SessionState { entity: e.id, session, state: Some(state) });
                }
            }
            let ids: Vec<_> = e
                .dedup
                .order
                .iter()
                .filter(|(t, id)| e.dedup.ids.get(id) == Some(t))
                .map(|(t, id)| (id.clone(), *t))
                .collect();
            for chunk in ids.chunks(1024) {
                out.push(Record::DuplicateIds { entity: e.id, ids: chunk.to_vec() });
            }
        }
        out
    }

    /// Live messages whose body is stored in `segment`. O(1).
    pub(crate) fn segment_refs(&self, segment: u32) -> usize {
        self.aux.bodies.seg_refs.get(&segment).map_or(0, |l| l.0)
    }

    /// The bytes of the records holding the live messages stored in `segment`: what
    /// compaction would write to move them. O(1).
    pub(crate) fn segment_live_bytes(&self, segment: u32) -> u64 {
        self.aux.bodies.seg_refs.get(&segment).map_or(0, |l| l.1)
    }

    /// The live messages stored in `segment`, in log order, for compaction: read each body
    /// and pass it to [`Engine::relocate`]. This scans every message (compaction is rare).
    pub(crate) fn live_in_segment(&self, segment: u32) -> Vec<MessageRef> {
        let mut by_body: HashMap<u32, usize> = HashMap::new();
        let mut out: Vec<MessageRef> = Vec::new();
        for (slot, e) in self.entities.iter().enumerate() {
            let (Some(e), Ok(slot)) = (e, u32::try_from(slot)) else { continue };
            for dead_letter in [false, true] {
                let six = StoreIx::new(slot, dead_letter);
                for (seq, m) in e.store(dead_letter).msgs.iter() {
                    let Some(loc) = self.aux.bodies.location(m.body) else { continue };
                    if loc.segment != segment {
                        continue;
                    }
                    let i = *by_body.entry(m.body).or_insert_with(|| {
                        out.push(MessageRef {
                            location: loc,
                            body: BodyKey {
                                index: m.body,
                                generation: self.aux.bodies.generation(m.body),
                            },
                            placements: Vec::new(),
                        });
                        out.len() - 1
                    });
                    out[i].placements.push((six, seq));
                }
            }
        }
        out.sort_by_key(|r| r.location.offset);
        out
    }

    /// Emits a [`Record::Snapshot`] of a live message from [`Engine::live_in_segment`] so that
    /// its old segment can go; `message` is its body as read from there. Does nothing if the
    /// message changed since (it is no longer live, or was moved or copied): call
    /// `live_in_segment` again.
    pub(crate) fn relocate(&mut self, msg: &MessageRef, message: Arc<Message>) {
        let b = msg.body;
        if self.aux.bodies.generation(b.index) != b.generation
            || self.aux.bodies.location(b.index) != Some(msg.location)
        {
            return;
        }
        let mut placements = Vec::with_capacity(msg.placements.len());
        for &(six, seq) in &msg.placements {
            let (Some(m), Ok(key)) = (self.meta(six, seq), self.key(six)) else { continue };
            if m.body == b.index {
                placements.push(placement_of(key, seq, m));
            }
        }
        if placements.is_empty() || placements.len() != self.aux.bodies.refs(b.index) as usize {
            return;
        }
        self.aux.bodies.keep_if_pinned(b.index, &message);
        let rec = Record::Snapshot { message: record::StoredMessage(message), placements, body: b };
        if self.opts.durable {
            self.records.push(rec);
        }
    }
}

/// The recorded form of a message's current state in a store.
pub(super) fn placement_of(store: StoreKey, seq: i64, m: &Meta) -> Placement {
    Placement {
        store,
        sequence: seq,
        enqueued: m.enqueued,
        expires: (m.expires != Timestamp::MAX).then_some(m.expires),
        delivery_count: m.delivery_count,
        state: m.state.into(),
        extra: m.extra.as_deref().cloned().map(Box::new),
    }
}
