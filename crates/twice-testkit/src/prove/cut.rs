//! The cut of a COMMIT: a rewrite of the proxy in front of the store that, armed, closes the
//! connection at the next COMMIT, after forwarding it or before.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};

use crate::proxy::{Flow, Rewrite};

/// What the armed cut does with the next COMMIT.
const DISARMED: u8 = 0;
const AFTER: u8 = 1;
const BEFORE: u8 = 2;

/// A cut of the next COMMIT on any connection of the proxy, armed for one COMMIT at a time.
#[derive(Clone, Debug)]
pub(super) struct CommitCut(Arc<CutState>);

#[derive(Debug)]
struct CutState {
    /// The bytes of a COMMIT as the driver sends it.
    needle: &'static [u8],
    armed: AtomicU8,
    fired: AtomicBool,
}

impl CommitCut {
    pub(super) fn new(needle: &'static [u8]) -> Self {
        Self(Arc::new(CutState {
            needle,
            armed: AtomicU8::new(DISARMED),
            fired: AtomicBool::new(false),
        }))
    }

    /// Arms the cut of the next COMMIT: before the server gets it, or after.
    pub(super) fn arm(&self, before: bool) {
        self.0.fired.store(false, Ordering::SeqCst);
        self.0.armed.store(if before { BEFORE } else { AFTER }, Ordering::SeqCst);
    }

    /// Whether the cut happened since it was last armed.
    pub(super) fn fired(&self) -> bool {
        self.0.fired.load(Ordering::SeqCst)
    }
}

impl Rewrite for CommitCut {
    fn to_server(&mut self, bytes: &[u8], out: &mut Vec<u8>) -> Flow {
        let needle = self.0.needle;
        let hit = !needle.is_empty()
            && self.0.armed.load(Ordering::SeqCst) != DISARMED
            && bytes.windows(needle.len()).any(|w| w == needle);
        if !hit {
            out.extend_from_slice(bytes);
            return Flow::Continue;
        }
        let how = self.0.armed.swap(DISARMED, Ordering::SeqCst);
        self.0.fired.store(true, Ordering::SeqCst);
        if how == AFTER {
            out.extend_from_slice(bytes);
        }
        Flow::Cut
    }
}
