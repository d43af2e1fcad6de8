//! Sending: send, schedule and cancel scheduled messages; the checks a batch passes first
//! (sizes, ids, the entity's `MaxSizeInMegabytes`), duplicate detection, the message ids the
//! engine assigns, and the size a message counts for.

use std::sync::Arc;

use twice::{Message, MessageId, SequenceNumber, Timestamp, Value};

use super::route::Router;
use super::state::{Entity, Kind, St, StoreIx};
use super::{
    BodyKey, Engine, EntityRef, MAX_BATCH_MESSAGES, MAX_ID_LEN, Record, SendOutcome, record,
};
use crate::error::Error;

impl Engine {
    /// Sends a batch to a queue or topic, all or nothing: every message is checked first
    /// (size, batch size, ids, session id on a session queue), then each is enqueued (or
    /// scheduled, if its `scheduled_enqueue_time` is in the future). A message without a
    /// message id gets a random one (32 hex digits).
    ///
    /// Batch rules (Service Bus): at most 4500 messages, and the batch's total size at most
    /// the maximum message size.
    #[cfg(test)]
    pub(crate) fn send(
        &mut self,
        now: Timestamp,
        entity: EntityRef,
        messages: Vec<Message>,
    ) -> Result<Vec<SendOutcome>, Error> {
        self.send_shared(now, entity, messages.into_iter().map(Arc::new).collect())
    }

    /// [`Engine::send`] of messages already shared: the engine keeps them as they are (a
    /// message without a message id is copied once to get one).
    pub(crate) fn send_shared(
        &mut self,
        now: Timestamp,
        entity: EntityRef,
        mut messages: Vec<Arc<Message>>,
    ) -> Result<Vec<SendOutcome>, Error> {
        self.tick(now);
        let slot = self.send_target(entity)?;
        self.validate_batch(slot, &messages)?;
        for m in &mut messages {
            if m.message_id.is_none() {
                let id = self.random_message_id();
                Arc::make_mut(m).message_id = Some(id);
            }
        }
        let out = self.enqueue(now, slot, messages, true)?;
        self.pump(now);
        Ok(out)
    }

    /// Schedules messages for `at`; returns their sequence numbers (to cancel them).
    pub(crate) fn schedule(
        &mut self,
        now: Timestamp,
        entity: EntityRef,
        messages: Vec<Message>,
        at: Timestamp,
    ) -> Result<Vec<SequenceNumber>, Error> {
        self.tick(now);
        let slot = self.send_target(entity)?;
        let mut messages: Vec<Arc<Message>> = messages.into_iter().map(Arc::new).collect();
        self.validate_batch(slot, &messages)?;
        for m in &mut messages {
            let m = Arc::make_mut(m);
            m.scheduled_enqueue_time = Some(at);
            if m.message_id.is_none() {
                m.message_id = Some(self.random_message_id());
            }
        }
        // Scheduling is not subject to duplicate detection: the caller needs a sequence number
        // for every message.
        let out = self.enqueue(now, slot, messages, false)?;
        self.pump(now);
        Ok(out
            .into_iter()
            .filter_map(|o| match o {
                SendOutcome::Enqueued(s) => Some(s),
                SendOutcome::Duplicate => None,
            })
            .collect())
    }

    /// Cancels scheduled messages of a queue or topic, all or nothing.
    pub(crate) fn cancel_scheduled(
        &mut self,
        now: Timestamp,
        entity: EntityRef,
        sequence_numbers: &[SequenceNumber],
    ) -> Result<(), Error> {
        self.tick(now);
        let slot = self.send_target(entity)?;
        let six = StoreIx::new(slot, false);
        let store =
            self.store(six).ok_or_else(|| Error::EntityNotFound("(deleted entity)".to_owned()))?;
        let mut seqs = Vec::with_capacity(sequence_numbers.len());
        for s in sequence_numbers {
            let seq = s.get();
            match store.msgs.get(seq) {
                Some(m) if m.state == St::Scheduled && !seqs.contains(&seq) => seqs.push(seq),
                _ => return Err(Error::MessageNotFound(seq)),
            }
        }
        if !seqs.is_empty() {
            let key = self.key(six)?;
            self.emit(Record::Removed { store: key, sequences: seqs })?;
        }
        self.pump(now);
        Ok(())
    }

    pub(super) fn validate_batch(&self, slot: u32, messages: &[Arc<Message>]) -> Result<(), Error> {
        if messages.len() > MAX_BATCH_MESSAGES {
            return Err(Error::InvalidArgument(format!(
                "a batch holds at most {MAX_BATCH_MESSAGES} messages, not {}",
                messages.len()
            )));
        }
        let limit = self.opts.max_message_size;
        let e =
            self.ent(slot).ok_or_else(|| Error::EntityNotFound("(deleted entity)".to_owned()))?;
        let mut total = 0usize;
        for m in messages {
            let size = message_size(m);
            if size > limit {
                return Err(Error::MessageSizeExceeded { size, limit });
            }
            total = total.saturating_add(size);
            if let Some(id) = &m.message_id {
                check_id("message id", id.as_str())?;
            }
            if let Some(id) = &m.session_id {
                check_id("session id", id.as_str())?;
            }
            if let Some(key) = &m.partition_key
                && key.len() > MAX_ID_LEN
            {
                return Err(Error::InvalidArgument(format!(
                    "a partition key has at most {MAX_ID_LEN} characters"
                )));
            }
            if m.time_to_live.is_some_and(|t| t.is_zero()) {
                return Err(Error::InvalidArgument("a time to live must be positive".to_owned()));
            }
            if m.session_id.is_none() && e.requires_session() {
                return Err(Error::SessionIdRequired(e.path.clone()));
            }
        }
        if total > limit {
            return Err(Error::MessageSizeExceeded { size: total, limit });
        }
        self.check_quota(slot, total)
    }

    /// Fails with [`Error::QuotaExceeded`] when `adding` bytes sent to the queue or topic in
    /// `slot` would take it past its `MaxSizeInMegabytes`. A topic's send is counted once per
    /// subscription, the most copies it can make.
    fn check_quota(&self, slot: u32, adding: usize) -> Result<(), Error> {
        let Some(e) = self.ent(slot) else { return Ok(()) };
        let Some(max) = e.max_size_in_megabytes() else { return Ok(()) };
        let copies = match &e.kind {
            Kind::Topic { subs, .. } => subs.len().max(1),
            _ => 1,
        };
        let adding = u64::try_from(adding.saturating_mul(copies)).unwrap_or(u64::MAX);
        let size = self.entity_bytes(slot);
        if size.saturating_add(adding) > max.saturating_mul(1024 * 1024) {
            return Err(Error::QuotaExceeded {
                entity: e.path.clone(),
                size,
                adding,
                max_size_in_megabytes: max,
            });
        }
        Ok(())
    }

    /// The bytes an entity holds against its `MaxSizeInMegabytes`: its own and its dead-letter
    /// queue's, and for a topic its subscriptions' too (each copy counts).
    pub(super) fn entity_bytes(&self, slot: u32) -> u64 {
        let Some(e) = self.ent(slot) else { return 0 };
        let own = |e: &Entity| e.store(false).bytes + e.store(true).bytes;
        let mut total = own(e);
        if let Kind::Topic { subs, .. } = &e.kind {
            total += subs.iter().filter_map(|&s| self.ent(s)).map(own).sum::<u64>();
        }
        total
    }

    /// Enqueues validated messages, one `Sent` record each.
    pub(super) fn enqueue(
        &mut self,
        now: Timestamp,
        slot: u32,
        messages: Vec<Arc<Message>>,
        dedup: bool,
    ) -> Result<Vec<SendOutcome>, Error> {
        let n = messages.len();
        let mut out = Vec::with_capacity(n);
        let first_record = self.records.len();
        let target = self
            .ent(slot)
            .map(|e| e.id)
            .ok_or_else(|| Error::EntityNotFound("(deleted entity)".to_owned()))?;
        for (i, m) in messages.into_iter().enumerate() {
            if dedup && self.is_duplicate(now, slot, &m) {
                out.push(SendOutcome::Duplicate);
                self.count(slot, |c| c.duplicates += 1);
                continue;
            }
            let message = m;
            let mut router = Router::new(now);
            let mut placements = Vec::new();
            let seq = self.route_send(&mut router, slot, &message, &mut placements)?;
            self.emit(Record::Sent {
                target,
                sequence: seq,
                at: now,
                message: record::StoredMessage(message),
                placements,
                more: i + 1 < n,
                body: BodyKey::NONE,
            })?;
            self.count(slot, |c| c.sent += 1);
            out.push(SendOutcome::Enqueued(SequenceNumber::new(seq)));
        }
        // A duplicate at the end of the batch leaves the last record saying more follow.
        if let Some(Record::Sent { more, .. }) = self.records[first_record..].last_mut() {
            *more = false;
        }
        Ok(out)
    }

    pub(super) fn is_duplicate(&self, now: Timestamp, slot: u32, m: &Message) -> bool {
        let (Some(e), Some(id)) = (self.ent(slot), &m.message_id) else { return false };
        e.dedup_window().is_some() && e.dedup.ids.get(id).is_some_and(|&end| end > now)
    }

    pub(super) fn random_message_id(&mut self) -> MessageId {
        const HEX: &[u8; 16] = b"0123456789abcdef";
        let mut id = [0u8; 32];
        let words = [self.next_u64(), self.next_u64()];
        for (i, digit) in id.iter_mut().enumerate() {
            let word = words[i / 16];
            let shift = 60 - 4 * (i % 16);
            *digit = HEX[usize::try_from((word >> shift) & 0xf).unwrap_or(0)];
        }
        MessageId::new(std::str::from_utf8(&id).map(str::to_owned).unwrap_or_default())
    }
}

pub(super) fn check_id(what: &str, id: &str) -> Result<(), Error> {
    if id.is_empty() || id.len() > MAX_ID_LEN {
        return Err(Error::InvalidArgument(format!("a {what} has 1 to {MAX_ID_LEN} characters")));
    }
    Ok(())
}

/// The size a message counts for against the size limit: its body, its header strings, and
/// its application property names and values.
pub(crate) fn message_size(m: &Message) -> usize {
    let strings = [
        m.message_id.as_ref().map(|i| i.as_str().len()),
        m.session_id.as_ref().map(|i| i.as_str().len()),
        m.correlation_id.as_ref().map(String::len),
        m.subject.as_ref().map(String::len),
        m.content_type.as_ref().map(String::len),
        m.to.as_ref().map(String::len),
        m.reply_to.as_ref().map(String::len),
        m.reply_to_session_id.as_ref().map(String::len),
        m.partition_key.as_ref().map(String::len),
    ];
    let props: usize = m.application_properties.iter().map(|(k, v)| k.len() + value_size(v)).sum();
    m.body.len() + strings.into_iter().flatten().sum::<usize>() + props
}

fn value_size(v: &Value) -> usize {
    match v {
        Value::Null | Value::Bool(_) | Value::Ubyte(_) | Value::Byte(_) => 1,
        Value::Ushort(_) | Value::Short(_) => 2,
        Value::Uint(_) | Value::Int(_) | Value::Float(_) | Value::Char(_) => 4,
        Value::Uuid(_) => 16,
        Value::Binary(b) => b.len(),
        Value::String(s) | Value::Symbol(s) => s.len(),
        _ => 8,
    }
}
