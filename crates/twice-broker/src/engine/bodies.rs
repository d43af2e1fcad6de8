//! Message bodies: one slot per message, shared by all its placements, in memory or in the log
//! (or both, while the cache of recently stored bodies holds it), with the live bodies counted
//! per log segment for compaction.

use std::collections::VecDeque;
use std::sync::Arc;

use twice::Message;

use super::fasthash::FastMap;
use super::{Body, Location};

/// Where a body is.
#[derive(Clone, Debug)]
pub(super) enum BodyData {
    /// A free slot.
    Empty,
    /// In memory only (memory mode, or not yet written).
    Memory(Arc<Message>),
    /// In the log.
    Stored(Location),
    /// In the log, and still in memory: it was stored recently (see [`Bodies::with_cache`]).
    Cached(Location, Arc<Message>),
}

#[derive(Debug)]
struct BodySlot {
    data: BodyData,
    /// Placements referring to it.
    refs: u32,
    /// Bumped when the slot is freed, so a stale [`super::record::BodyKey`] is recognised.
    generation: u32,
    /// Placements that need the message in memory (to route it later without reading it
    /// back): scheduled messages and messages that may be forwarded when dead-lettered.
    pins: u32,
    /// What the message counts for against its entity's `MaxSizeInMegabytes`.
    size: u32,
}

/// What a cached message counts for against the cache's bound: its body and a rough
/// allowance for its headers and the allocation.
fn cached_size(m: &Message) -> usize {
    m.body.len() + 256
}

/// Counts a body stored at `loc` as live in its segment.
fn add_live(seg_refs: &mut FastMap<u32, (usize, u64)>, loc: Location) {
    let live = seg_refs.entry(loc.segment).or_default();
    live.0 += 1;
    live.1 += u64::from(loc.len);
}

/// Message bodies, shared by every placement of the same message (a topic's subscriptions, a
/// dead-lettered copy, a resubmitted one).
#[derive(Debug, Default)]
pub(super) struct Bodies {
    slots: Vec<BodySlot>,
    free: Vec<u32>,
    /// Messages kept in memory for pinned bodies that are also stored.
    pinned: FastMap<u32, Arc<Message>>,
    /// Live bodies per log segment: how many, and the bytes of the records holding them.
    pub(super) seg_refs: FastMap<u32, (usize, u64)>,
    /// [`BodyData::Cached`] slots, oldest first, with their generation and size. A freed slot
    /// leaves its entry behind; the generation tells it apart.
    recent: VecDeque<(u32, u32, usize)>,
    /// The bytes of the live cached bodies.
    recent_bytes: usize,
    /// The bound of `recent_bytes`.
    cache_bytes: usize,
    /// Messages this store let go of, kept for [`Bodies::take_freed`] when collecting them.
    freed: Option<Vec<Arc<Message>>>,
}

impl Bodies {
    /// Bodies that stay in memory after they are stored, up to `cache_bytes` of the most
    /// recent ones: a queue whose receivers keep up then never reads a body back from disk.
    pub(super) fn with_cache(cache_bytes: usize) -> Self {
        Self { cache_bytes, ..Self::default() }
    }

    /// Keeps the messages this store lets go of for [`Bodies::take_freed`] instead of dropping
    /// them.
    pub(super) fn collect_freed(&mut self) {
        self.freed.get_or_insert_with(Vec::new);
    }

    /// The messages let go of since the last call (see [`Bodies::collect_freed`]).
    pub(super) fn take_freed(&mut self) -> Vec<Arc<Message>> {
        // The next batch is likely as large as this one: start it at that size.
        self.freed
            .as_mut()
            .map(|f| std::mem::replace(f, Vec::with_capacity(f.len().min(4096))))
            .unwrap_or_default()
    }

    /// Lets go of a message: dropped here, or kept for the caller of `take_freed`.
    fn free_message(&mut self, m: Arc<Message>) {
        if let Some(f) = &mut self.freed {
            f.push(m);
        }
    }

    /// A new slot with no references, for a message of `size` bytes.
    pub(super) fn alloc(&mut self, data: BodyData, size: u32) -> u32 {
        if let BodyData::Stored(loc) = &data {
            add_live(&mut self.seg_refs, *loc);
        }
        match self.free.pop() {
            Some(i) => {
                if let Some(slot) = self.slots.get_mut(i as usize) {
                    slot.data = data;
                    slot.refs = 0;
                    slot.pins = 0;
                    slot.size = size;
                }
                i
            }
            None => {
                self.slots.push(BodySlot { data, refs: 0, generation: 0, pins: 0, size });
                u32::try_from(self.slots.len() - 1).unwrap_or(u32::MAX - 1)
            }
        }
    }

    /// The size of the message in slot `i` (see [`Bodies::alloc`]).
    pub(super) fn size(&self, i: u32) -> u64 {
        self.slots.get(i as usize).map_or(0, |s| u64::from(s.size))
    }

    pub(super) fn generation(&self, i: u32) -> u32 {
        self.slots.get(i as usize).map_or(0, |s| s.generation)
    }

    pub(super) fn refs(&self, i: u32) -> u32 {
        self.slots.get(i as usize).map_or(0, |s| s.refs)
    }

    pub(super) fn incref(&mut self, i: u32) {
        if let Some(s) = self.slots.get_mut(i as usize) {
            s.refs += 1;
        }
    }

    /// Drops a reference; the last one frees the slot.
    pub(super) fn decref(&mut self, i: u32) {
        let Some(s) = self.slots.get_mut(i as usize) else { return };
        s.refs = s.refs.saturating_sub(1);
        if s.refs == 0 {
            let old = std::mem::replace(&mut s.data, BodyData::Empty);
            s.pins = 0;
            s.generation = s.generation.wrapping_add(1);
            match old {
                BodyData::Stored(loc) => self.dec_segment(loc),
                BodyData::Cached(loc, m) => {
                    self.dec_segment(loc);
                    self.recent_bytes = self.recent_bytes.saturating_sub(cached_size(&m));
                    self.free_message(m);
                }
                BodyData::Memory(m) => self.free_message(m),
                BodyData::Empty => {}
            }
            if let Some(m) = self.pinned.remove(&i) {
                self.free_message(m);
            }
            self.free.push(i);
        }
    }

    fn dec_segment(&mut self, loc: Location) {
        if let Some(live) = self.seg_refs.get_mut(&loc.segment) {
            live.0 = live.0.saturating_sub(1);
            live.1 = live.1.saturating_sub(u64::from(loc.len));
            if live.0 == 0 {
                self.seg_refs.remove(&loc.segment);
            }
        }
    }

    pub(super) fn pin(&mut self, i: u32) {
        if let Some(s) = self.slots.get_mut(i as usize) {
            s.pins += 1;
        }
    }

    pub(super) fn unpin(&mut self, i: u32) {
        if let Some(s) = self.slots.get_mut(i as usize) {
            s.pins = s.pins.saturating_sub(1);
            if s.pins == 0
                && let Some(m) = self.pinned.remove(&i)
            {
                self.free_message(m);
            }
        }
    }

    /// Keeps `message` in memory for a pinned, stored body (replay and relocation know it).
    pub(super) fn keep_if_pinned(&mut self, i: u32, message: &Arc<Message>) {
        if let Some(s) = self.slots.get(i as usize)
            && s.pins > 0
            && matches!(s.data, BodyData::Stored(_))
        {
            self.pinned.insert(i, Arc::clone(message));
        }
    }

    /// Records where the body was written. The in-memory copy stays while the cache has room
    /// (the oldest cached bodies are dropped to make it), or while the body is pinned.
    pub(super) fn set_location(&mut self, i: u32, generation: u32, loc: Location) {
        let cache = self.cache_bytes > 0;
        let Some(s) = self.slots.get_mut(i as usize) else { return };
        if s.generation != generation || s.refs == 0 {
            return;
        }
        let old = std::mem::replace(&mut s.data, BodyData::Stored(loc));
        let pinned = s.pins > 0;
        add_live(&mut self.seg_refs, loc);
        match old {
            BodyData::Stored(o) => self.dec_segment(o),
            BodyData::Cached(o, m) => {
                // Relocated while cached: it keeps its place in the cache.
                s.data = BodyData::Cached(loc, m);
                self.dec_segment(o);
            }
            BodyData::Memory(m) if cache => {
                let size = cached_size(&m);
                s.data = BodyData::Cached(loc, m);
                self.recent.push_back((i, generation, size));
                self.recent_bytes += size;
                self.evict();
            }
            BodyData::Memory(m) if pinned => {
                self.pinned.insert(i, m);
            }
            BodyData::Memory(_) | BodyData::Empty => {}
        }
    }

    /// Drops the oldest cached bodies until the cache is within its bound.
    fn evict(&mut self) {
        while self.recent_bytes > self.cache_bytes {
            let Some((i, generation, size)) = self.recent.pop_front() else {
                self.recent_bytes = 0;
                return;
            };
            let Some(s) = self.slots.get_mut(i as usize) else { continue };
            // A freed (or freed and reused) slot was already subtracted.
            if s.generation != generation {
                continue;
            }
            let BodyData::Cached(loc, _) = s.data else { continue };
            self.recent_bytes = self.recent_bytes.saturating_sub(size);
            if let BodyData::Cached(_, m) = std::mem::replace(&mut s.data, BodyData::Stored(loc)) {
                if s.pins > 0 {
                    self.pinned.insert(i, m);
                } else {
                    self.free_message(m);
                }
            }
        }
        // Entries of freed slots pile up when messages leave faster than the cache turns
        // over: drop them from the front.
        while let Some(&(i, generation, _)) = self.recent.front() {
            if self.slots.get(i as usize).is_some_and(|s| s.generation == generation) {
                break;
            }
            self.recent.pop_front();
        }
    }

    /// The message, if it is in memory.
    pub(super) fn message(&self, i: u32) -> Option<Arc<Message>> {
        match &self.slots.get(i as usize)?.data {
            BodyData::Memory(m) | BodyData::Cached(_, m) => Some(Arc::clone(m)),
            BodyData::Stored(_) => self.pinned.get(&i).cloned(),
            BodyData::Empty => None,
        }
    }

    /// The body as a delivery carries it: in memory if it is, else its location.
    pub(super) fn body(&self, i: u32) -> Body {
        match self.slots.get(i as usize).map(|s| &s.data) {
            Some(BodyData::Memory(m) | BodyData::Cached(_, m)) => Body::Memory(Arc::clone(m)),
            Some(BodyData::Stored(loc)) => match self.pinned.get(&i) {
                Some(m) => Body::Memory(Arc::clone(m)),
                None => Body::Stored(*loc),
            },
            // Unreachable for a live message; an empty message keeps the caller going.
            _ => Body::Memory(Arc::new(Message::default())),
        }
    }

    pub(super) fn location(&self, i: u32) -> Option<Location> {
        match self.slots.get(i as usize)?.data {
            BodyData::Stored(loc) | BodyData::Cached(loc, _) => Some(loc),
            _ => None,
        }
    }
}
