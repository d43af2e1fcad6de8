//! Compact ordered containers keyed by sequence number.
//!
//! A store's messages arrive in sequence order and mostly leave from the front, so they are
//! kept in chunks of consecutive sequence numbers: a [`SeqMap`] chunk holds a bit mask and its
//! values packed in a vector, a [`SeqSet`] chunk is a 64-bit mask. A dense queue then costs
//! little more than its values (a `BTreeMap` filled in order leaves its nodes about half
//! empty), while lookups, inserts and removals stay O(log n) over the chunks.

use std::collections::BTreeMap;

/// Sequence numbers per [`SeqMap`] chunk.
const MAP_CHUNK: i64 = 32;
/// The same, as a length.
const MAP_CHUNK_LEN: usize = 32;
/// Sequence numbers per [`SeqSet`] chunk.
const SET_CHUNK: i64 = 64;

fn split(seq: i64, chunk: i64) -> (i64, u32) {
    // `rem_euclid` of a positive divisor is in 0..chunk, which fits a u32.
    let bit = u32::try_from(seq.rem_euclid(chunk)).unwrap_or(0);
    (seq.div_euclid(chunk), bit)
}

#[derive(Debug)]
struct Chunk<V> {
    /// Bit i set: sequence number `key * 32 + i` is present.
    mask: u32,
    /// The present values, in sequence order.
    vals: Vec<V>,
}

impl<V> Chunk<V> {
    /// The position in `vals` of bit `bit`.
    fn index(&self, bit: u32) -> usize {
        (self.mask & ((1u32 << bit) - 1)).count_ones() as usize
    }
}

/// An ordered map from sequence number to value.
#[derive(Debug)]
pub(super) struct SeqMap<V> {
    chunks: BTreeMap<i64, Chunk<V>>,
    len: usize,
}

impl<V> Default for SeqMap<V> {
    fn default() -> Self {
        Self { chunks: BTreeMap::new(), len: 0 }
    }
}

impl<V> SeqMap<V> {
    pub(super) fn len(&self) -> usize {
        self.len
    }

    pub(super) fn get(&self, seq: i64) -> Option<&V> {
        let (key, bit) = split(seq, MAP_CHUNK);
        let c = self.chunks.get(&key)?;
        if c.mask & (1 << bit) == 0 {
            return None;
        }
        c.vals.get(c.index(bit))
    }

    pub(super) fn contains_key(&self, seq: i64) -> bool {
        let (key, bit) = split(seq, MAP_CHUNK);
        self.chunks.get(&key).is_some_and(|c| c.mask & (1 << bit) != 0)
    }

    /// Inserts a value, returning the one it replaced.
    pub(super) fn insert(&mut self, seq: i64, v: V) -> Option<V> {
        let (key, bit) = split(seq, MAP_CHUNK);
        let c = self.chunks.entry(key).or_insert_with(|| Chunk { mask: 0, vals: Vec::new() });
        let i = c.index(bit);
        if c.mask & (1 << bit) != 0 {
            return c.vals.get_mut(i).map(|old| std::mem::replace(old, v));
        }
        if c.vals.len() == c.vals.capacity() {
            // Double (from 2), never past a full chunk: a sparse chunk stays small, a dense
            // one ends exactly full, and a chunk filled in order grows only four times.
            let len = c.vals.len();
            c.vals.reserve_exact(len.max(2).min(MAP_CHUNK_LEN - len));
        }
        c.vals.insert(i, v);
        c.mask |= 1 << bit;
        self.len += 1;
        None
    }

    pub(super) fn remove(&mut self, seq: i64) -> Option<V> {
        let (key, bit) = split(seq, MAP_CHUNK);
        let c = self.chunks.get_mut(&key)?;
        if c.mask & (1 << bit) == 0 {
            return None;
        }
        let i = c.index(bit);
        let v = c.vals.remove(i);
        c.mask &= !(1 << bit);
        self.len -= 1;
        if c.mask == 0 {
            self.chunks.remove(&key);
        } else if c.vals.capacity() >= 8 && c.vals.len() * 4 <= c.vals.capacity() {
            // A chunk left with a few stragglers gives its memory back.
            c.vals.shrink_to(c.vals.len() * 2);
        }
        Some(v)
    }

    /// Entries in sequence order.
    pub(super) fn iter(&self) -> impl Iterator<Item = (i64, &V)> + '_ {
        self.range_from(i64::MIN)
    }

    /// Entries from `from` on, in sequence order.
    pub(super) fn range_from(&self, from: i64) -> impl Iterator<Item = (i64, &V)> + '_ {
        let (first, _) = split(from, MAP_CHUNK);
        self.chunks
            .range(first..)
            .flat_map(|(&key, c)| {
                let mut mask = c.mask;
                c.vals.iter().map(move |v| {
                    let bit = mask.trailing_zeros();
                    mask &= mask - 1;
                    (key * MAP_CHUNK + i64::from(bit), v)
                })
            })
            .skip_while(move |(seq, _)| *seq < from)
    }

    /// Sequence numbers in order.
    pub(super) fn keys(&self) -> impl Iterator<Item = i64> + '_ {
        self.iter().map(|(s, _)| s)
    }
}

/// An ordered set of sequence numbers.
#[derive(Debug, Default)]
pub(super) struct SeqSet {
    chunks: BTreeMap<i64, u64>,
    len: usize,
}

impl SeqSet {
    pub(super) fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Inserts; returns whether it was absent.
    pub(super) fn insert(&mut self, seq: i64) -> bool {
        let (key, bit) = split(seq, SET_CHUNK);
        let m = self.chunks.entry(key).or_insert(0);
        let new = *m & (1 << bit) == 0;
        *m |= 1 << bit;
        self.len += usize::from(new);
        new
    }

    /// Removes; returns whether it was present.
    pub(super) fn remove(&mut self, seq: i64) -> bool {
        let (key, bit) = split(seq, SET_CHUNK);
        let Some(m) = self.chunks.get_mut(&key) else { return false };
        let was = *m & (1 << bit) != 0;
        *m &= !(1 << bit);
        if *m == 0 {
            self.chunks.remove(&key);
        }
        self.len -= usize::from(was);
        was
    }

    pub(super) fn first(&self) -> Option<i64> {
        let (&key, &m) = self.chunks.first_key_value()?;
        Some(key * SET_CHUNK + i64::from(m.trailing_zeros()))
    }

    /// Members in order.
    pub(super) fn iter(&self) -> impl Iterator<Item = i64> + '_ {
        self.chunks.iter().flat_map(|(&key, &m)| {
            let mut m = m;
            std::iter::from_fn(move || {
                if m == 0 {
                    return None;
                }
                let bit = m.trailing_zeros();
                m &= m - 1;
                Some(key * SET_CHUNK + i64::from(bit))
            })
        })
    }
}
