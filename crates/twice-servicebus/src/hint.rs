//! Log lines that tell a misconfigured client's owner what to change (TLS to a plain port,
//! plain to a TLS port), written at most once a minute each, so that a client retrying in a
//! loop, or a flood of such connections, cannot fill the log.

use std::sync::atomic::{AtomicI64, Ordering};

use twice::Timestamp;

/// How often one kind of hint is written at most.
const EVERY_MS: i64 = 60_000;

/// One kind of hint: when it was last written.
#[derive(Debug)]
pub(crate) struct Hint(AtomicI64);

impl Hint {
    pub(crate) const fn new() -> Self {
        Self(AtomicI64::new(i64::MIN))
    }

    /// Whether to write the hint now (and then not again for a minute).
    pub(crate) fn due(&self, now: Timestamp) -> bool {
        let now = now.as_millis();
        let last = self.0.load(Ordering::Relaxed);
        now.saturating_sub(last) >= EVERY_MS
            && self.0.compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed).is_ok()
    }
}

/// An https client on the plain HTTP port.
pub(crate) static HTTPS_ON_PLAIN_HTTP: Hint = Hint::new();
/// A plain http client on the https-only HTTP port.
pub(crate) static HTTP_ON_HTTPS: Hint = Hint::new();
/// A TLS handshake on the HTTP port that failed (often: the client does not trust the CA).
pub(crate) static HTTPS_HANDSHAKE: Hint = Hint::new();
/// An amqps (TLS) client on the plain AMQP port.
pub(crate) static AMQPS_ON_PLAIN_AMQP: Hint = Hint::new();
/// A plain AMQP client on the amqps port.
pub(crate) static AMQP_ON_AMQPS: Hint = Hint::new();

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn once_a_minute() {
        let hint = Hint::new();
        let t = Timestamp::from_millis(1_000_000);
        assert!(hint.due(t));
        assert!(!hint.due(t));
        assert!(!hint.due(Timestamp::from_millis(1_000_000 + EVERY_MS - 1)));
        assert!(hint.due(Timestamp::from_millis(1_000_000 + EVERY_MS)));
    }
}
