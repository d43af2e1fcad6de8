//! Rewrites of the NATS client protocol: requests that never reach the server.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use super::{Flow, Rewrite};

/// While armed, removes from what a client sends every `PUB` whose subject starts with a
/// prefix (e.g. `$JS.API.CONSUMER.MSG.NEXT.`, a pull request): the server never hears of it,
/// as when the request was lost with a server that was killed. Everything else passes. Shared
/// by every connection of the proxy.
#[derive(Clone, Debug)]
pub struct Swallow {
    needle: Vec<u8>,
    armed: Arc<AtomicBool>,
    dropped: Arc<AtomicUsize>,
}

impl Swallow {
    /// A rewrite of `PUB <prefix>…` commands, disarmed.
    pub fn new(prefix: &str) -> Self {
        Self {
            needle: format!("PUB {prefix}").into_bytes(),
            armed: Arc::default(),
            dropped: Arc::default(),
        }
    }

    /// Starts or stops removing the commands.
    pub fn arm(&self, on: bool) {
        self.armed.store(on, Ordering::SeqCst);
    }

    /// How many commands were removed.
    pub fn dropped(&self) -> usize {
        self.dropped.load(Ordering::SeqCst)
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

impl Rewrite for Swallow {
    fn to_server(&mut self, bytes: &[u8], out: &mut Vec<u8>) -> Flow {
        if !self.armed.load(Ordering::SeqCst) {
            out.extend_from_slice(bytes);
            return Flow::Continue;
        }
        let mut rest = bytes;
        while let Some(at) = find(rest, &self.needle) {
            out.extend_from_slice(&rest[..at]);
            let command = &rest[at..];
            // `PUB <subject> [reply] <size>\r\n<payload>\r\n`, whole in this chunk.
            let size = find(command, b"\r\n").and_then(|eol| {
                let line = std::str::from_utf8(&command[..eol]).ok()?;
                let size: usize = line.rsplit(' ').next()?.parse().ok()?;
                Some(eol + 2 + size + 2).filter(|&end| end <= command.len())
            });
            let Some(end) = size else {
                // Split across reads: passed on as it is.
                out.extend_from_slice(command);
                return Flow::Continue;
            };
            self.dropped.fetch_add(1, Ordering::SeqCst);
            rest = &command[end..];
        }
        out.extend_from_slice(rest);
        Flow::Continue
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_armed_prefix_is_removed_and_the_rest_passes_in_order() {
        let mut s = Swallow::new("$JS.API.CONSUMER.MSG.NEXT.");
        let input = b"SUB _INBOX.1 7\r\nPUB $JS.API.CONSUMER.MSG.NEXT.S.c _INBOX.1 11\r\n{\"batch\":1}\r\nPING\r\n";
        let mut out = Vec::new();
        s.to_server(input, &mut out);
        assert_eq!(out, input, "disarmed: everything passes");
        s.arm(true);
        out.clear();
        s.to_server(input, &mut out);
        assert_eq!(out, b"SUB _INBOX.1 7\r\nPING\r\n");
        assert_eq!(s.dropped(), 1);
    }
}
