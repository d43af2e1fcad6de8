//! The compact sequence-number containers against the standard ones.

use std::collections::{BTreeMap, BTreeSet};

use crate::engine::seqmap::{SeqMap, SeqSet};

/// The containers behave like the standard ones under random operations.
#[test]
fn they_behave_like_btree_collections() {
    let mut rng = 7u64;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let mut map = SeqMap::default();
    let mut set = SeqSet::default();
    let (mut want_map, mut want_set) = (BTreeMap::new(), BTreeSet::new());
    for step in 0..20_000 {
        // Mostly near the end and the front, like a queue, with negative numbers too.
        let seq = i64::try_from(next() % 300).unwrap_or(0) - 20 + i64::from(step / 100);
        match next() % 4 {
            0 | 1 => {
                assert_eq!(map.insert(seq, step), want_map.insert(seq, step));
                assert_eq!(set.insert(seq), want_set.insert(seq));
            }
            2 => {
                assert_eq!(map.remove(seq), want_map.remove(&seq));
                assert_eq!(set.remove(seq), want_set.remove(&seq));
            }
            _ => {
                assert_eq!(map.get(seq), want_map.get(&seq));
                let from = seq - 5;
                let got: Vec<_> = map.range_from(from).take(7).map(|(s, v)| (s, *v)).collect();
                let want: Vec<_> = want_map.range(from..).take(7).map(|(s, v)| (*s, *v)).collect();
                assert_eq!(got, want);
            }
        }
        assert_eq!(map.len(), want_map.len());
        assert_eq!(map.contains_key(seq), want_map.contains_key(&seq));
        assert_eq!(set.first(), want_set.first().copied());
        assert_eq!(set.is_empty(), want_set.is_empty());
    }
    assert!(map.keys().eq(want_map.keys().copied()));
    assert!(map.iter().map(|(s, v)| (s, *v)).eq(want_map.iter().map(|(s, v)| (*s, *v))));
    assert!(set.iter().eq(want_set.iter().copied()));
}
