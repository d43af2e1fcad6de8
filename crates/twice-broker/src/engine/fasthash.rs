//! The hasher of the maps keyed by what the engine makes itself.

use std::collections::HashMap;

/// A fast hasher for keys the engine makes itself (entity ids, lock tokens, slots), which
/// callers cannot choose: the multiply-rotate hash of rustc's `FxHasher`. Keys that callers
/// choose (message ids, session ids) keep the standard, flood-resistant hasher.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct FastHash;

impl std::hash::BuildHasher for FastHash {
    type Hasher = FastHasher;
    fn build_hasher(&self) -> FastHasher {
        FastHasher(0)
    }
}

/// See [`FastHash`].
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct FastHasher(u64);

impl FastHasher {
    fn add(&mut self, word: u64) {
        self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }
}

impl std::hash::Hasher for FastHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.add(u64::from_le_bytes(word));
        }
    }

    fn write_u32(&mut self, n: u32) {
        self.add(u64::from(n));
    }

    fn write_u64(&mut self, n: u64) {
        self.add(n);
    }
}

/// A map keyed by engine-made keys.
pub(super) type FastMap<K, V> = HashMap<K, V, FastHash>;
