//! `LIKE` patterns: `%` for any run of characters, `_` for one character, the rest literal.
//!
//! A pattern is matched as a nondeterministic automaton whose states are the positions in
//! the pattern, all of them simulated at once in a bit set (Baeza-Yates and Gonnet's
//! shift-and, with `%` as a state that loops on any character). Each character of the value
//! costs a few operations per 64 pattern elements, whatever the pattern and the value: no
//! backtracking, so no input makes matching slower than that.

use super::SqlError;

/// One element of a `LIKE` pattern.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Pat {
    /// `%`: any run of characters, the empty one included.
    Any,
    /// `_`: exactly one character.
    One,
    /// This character.
    Lit(char),
}

/// A `LIKE` pattern as elements; the escape character makes the next `%`, `_` or itself literal.
pub(super) fn compile_like(
    pattern: &str,
    escape: Option<char>,
    at: usize,
) -> Result<LikePattern, SqlError> {
    let mut out = Vec::with_capacity(pattern.len());
    let mut chars = pattern.chars();
    while let Some(c) = chars.next() {
        if Some(c) == escape {
            match chars.next() {
                Some(next) => out.push(Pat::Lit(next)),
                None => {
                    return Err(SqlError::new(
                        at,
                        "the LIKE pattern ends with its escape character",
                    ));
                }
            }
        } else {
            out.push(match c {
                '%' => Pat::Any,
                '_' => Pat::One,
                c => Pat::Lit(c),
            });
        }
    }
    Ok(LikePattern::new(out))
}

/// A compiled `LIKE` pattern.
///
/// State `i` means "the first `i` elements matched"; the value matches when state `len` is
/// reached at its end. Masks hold one bit per state.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct LikePattern {
    /// Pattern elements (consecutive `%` merged into one).
    len: usize,
    /// States `i` whose element is `%`.
    any: Box<[u64]>,
    /// States `i` whose element is `_`.
    one: Box<[u64]>,
    /// For a character that many elements name: the states whose element it is. At most 64
    /// characters can name more elements than there are words in a mask, so these take
    /// O(pattern) memory in all.
    dense: Vec<(char, Box<[u64]>)>,
    /// For the other characters: the states whose element they are, fewer than the words of
    /// a mask, so testing them one by one costs no more than a mask operation.
    sparse: Vec<(char, Box<[u32]>)>,
}

impl LikePattern {
    /// The pattern of these elements.
    pub(super) fn new(mut elems: Vec<Pat>) -> Self {
        elems.dedup_by(|a, b| *a == Pat::Any && *b == Pat::Any);
        let len = elems.len();
        let words = len / 64 + 1;
        let mask = || vec![0u64; words].into_boxed_slice();
        let (mut any, mut one) = (mask(), mask());
        let mut by_char: Vec<(char, u32)> = Vec::new();
        for (i, e) in elems.iter().enumerate() {
            match *e {
                Pat::Any => set(&mut any, i),
                Pat::One => set(&mut one, i),
                // The expression is at most a few KiB, so a position fits.
                Pat::Lit(c) => by_char.push((c, u32::try_from(i).unwrap_or(u32::MAX))),
            }
        }
        by_char.sort_unstable();
        let (mut dense, mut sparse) = (Vec::new(), Vec::new());
        for run in by_char.chunk_by(|a, b| a.0 == b.0) {
            let c = run[0].0;
            if run.len() > words {
                let mut m = mask();
                for &(_, i) in run {
                    set(&mut m, i as usize);
                }
                dense.push((c, m));
            } else {
                sparse.push((c, run.iter().map(|&(_, i)| i).collect()));
            }
        }
        Self { len, any, one, dense, sparse }
    }

    /// Whether `s` matches the pattern.
    pub(super) fn matches(&self, s: &str) -> bool {
        self.matches_counting(s, &mut 0)
    }

    /// Whether `s` matches the pattern; adds the work done to `steps` (mask words and
    /// positions visited).
    pub(super) fn matches_counting(&self, s: &str, steps: &mut u64) -> bool {
        let words = self.any.len();
        let mut state = vec![0u64; 2 * words];
        let (now, next) = state.split_at_mut(words);
        now[0] = 1;
        self.close(now);
        for c in s.chars() {
            *steps += words as u64;
            let dense =
                self.dense.binary_search_by(|(d, _)| d.cmp(&c)).ok().map(|i| &self.dense[i].1);
            // Elements that consume `c` move on by one; `%` stays.
            let mut carry = 0;
            for w in 0..words {
                let mut step = now[w] & self.one[w];
                if let Some(d) = dense {
                    step |= now[w] & d[w];
                }
                next[w] = (step << 1) | carry | (now[w] & self.any[w]);
                carry = step >> 63;
            }
            if let Ok(i) = self.sparse.binary_search_by(|(d, _)| d.cmp(&c)) {
                for &i in self.sparse[i].1.iter() {
                    *steps += 1;
                    let i = i as usize;
                    if get(now, i) {
                        set(next, i + 1);
                    }
                }
            }
            self.close(next);
            if next.iter().all(|&w| w == 0) {
                return false;
            }
            now.copy_from_slice(next);
        }
        get(now, self.len)
    }

    /// Adds the states reachable without a character: past each `%` (never two in a row).
    fn close(&self, states: &mut [u64]) {
        let mut carry = 0;
        for (w, any) in states.iter_mut().zip(self.any.iter()) {
            let skip = *w & any;
            *w |= (skip << 1) | carry;
            carry = skip >> 63;
        }
    }
}

fn set(mask: &mut [u64], i: usize) {
    mask[i / 64] |= 1 << (i % 64);
}

fn get(mask: &[u64], i: usize) -> bool {
    mask[i / 64] >> (i % 64) & 1 == 1
}
