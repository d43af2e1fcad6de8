//! What a connection may use: the paths its tokens name, each until its token expires.

use std::net::SocketAddr;

use crate::sas::{Claim, Claims};

/// The most grants a connection keeps; a token for a path already granted replaces the old one.
const MAX_GRANTS: usize = 1024;

/// One path a connection may use, and until when.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Grant {
    /// A normalised path; empty for every path (SASL PLAIN with a configured key).
    path: String,
    /// Unix seconds after which the grant is void; `None` for no end.
    expiry: Option<i64>,
    /// What the key that signed it may do.
    claims: Claims,
}

/// The grants of one connection.
#[derive(Debug, Default)]
pub(crate) struct Grants(Vec<Grant>);

impl Grants {
    /// Every path, for good, within the claims of the key a connection authenticated with.
    pub(crate) fn everything(claims: Claims) -> Self {
        Self(vec![Grant { path: String::new(), expiry: None, claims }])
    }

    /// Grants `path` until `expiry`, replacing a grant of the same path. Returns false when
    /// the connection already holds as many grants as it may.
    pub(crate) fn insert(&mut self, path: String, expiry: i64, claims: Claims, now: i64) -> bool {
        self.0.retain(|g| g.path != path && g.expiry.is_none_or(|e| e >= now));
        if self.0.len() >= MAX_GRANTS {
            return false;
        }
        self.0.push(Grant { path, expiry: Some(expiry), claims });
        true
    }

    /// Whether `path` may be used at `now` (unix seconds) for `need` (`None`: for anything
    /// at all): a grant of the path itself or of a path it is under (a token for an entity
    /// covers its management node) that has not expired and whose claims allow it.
    pub(crate) fn allows(&self, path: &str, now: i64, need: Option<Claim>) -> bool {
        self.0.iter().any(|g| {
            g.expiry.is_none_or(|e| e >= now)
                && match need {
                    Some(c) => g.claims.allows(c),
                    None => g.claims != Claims::NONE,
                }
                && (g.path.is_empty()
                    || path == g.path
                    || path.strip_prefix(g.path.as_str()).is_some_and(|rest| rest.starts_with('/')))
        })
    }
}

/// The host of a token's audience (`sb://host:port/path`, `amqp://host/path`), lowercased.
pub(crate) fn audience_host(resource: &str) -> Option<String> {
    let (_, rest) = resource.split_once("://")?;
    let authority = rest.split('/').next().unwrap_or("");
    let host = match authority.strip_prefix('[') {
        // An IPv6 literal: `[::1]:5673`.
        Some(v6) => v6.split(']').next().unwrap_or(""),
        None => authority.split(':').next().unwrap_or(""),
    };
    Some(host.to_ascii_lowercase())
}

/// Whether a token's audience names this server: the host name it serves under, or, for a
/// server that listens on loopback only, any loopback name.
pub(crate) fn audience_is_ours(resource: &str, hostname: &str, addr: SocketAddr) -> bool {
    let Some(host) = audience_host(resource) else { return false };
    if host.eq_ignore_ascii_case(hostname) {
        return true;
    }
    addr.ip().is_loopback() && matches!(host.as_str(), "localhost" | "127.0.0.1" | "::1")
}

/// Compares two secrets in time that depends only on their lengths, so a wrong password
/// reveals nothing through how long its refusal takes.
pub(crate) fn same_secret(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grants_cover_their_path_and_what_is_under_it_until_they_expire() {
        let mut g = Grants::default();
        let send = Some(Claim::Send);
        assert!(g.insert("q1".into(), 100, Claims::ALL, 0));
        assert!(g.allows("q1", 100, send));
        assert!(g.allows("q1/$management", 50, None));
        assert!(!g.allows("q10", 50, send), "a prefix of the name is not a parent path");
        assert!(!g.allows("q1", 101, send), "expired");
        assert!(Grants::everything(Claims::ALL).allows("anything", i64::MAX, send));
        let listen_only = Claims::NONE.with(Claim::Listen);
        assert!(g.insert("q2".into(), 100, listen_only, 0));
        assert!(g.allows("q2", 0, Some(Claim::Listen)) && !g.allows("q2", 0, send));
    }

    #[test]
    fn secrets_are_equal_only_byte_for_byte() {
        assert!(same_secret(b"SAS_KEY_VALUE", b"SAS_KEY_VALUE"));
        assert!(!same_secret(b"SAS_KEY_VALUE", b"SAS_KEY_VALUF"));
        assert!(!same_secret(b"SAS_KEY_VALUE", b"SAS_KEY_VALU"));
        assert!(!same_secret(b"", b"x"));
    }

    #[test]
    fn audiences_name_their_host() {
        let local = SocketAddr::from(([127, 0, 0, 1], 5673));
        let any = SocketAddr::from(([0, 0, 0, 0], 5673));
        assert!(audience_is_ours("sb://localhost:5673/q1", "localhost", any));
        assert!(audience_is_ours("amqp://127.0.0.1/q1", "localhost", local));
        assert!(audience_is_ours("sb://[::1]:5673/q1", "localhost", local));
        assert!(!audience_is_ours("amqp://127.0.0.1/q1", "box.lan", any));
        assert!(!audience_is_ours("sb://evil.example.com/q1", "localhost", local));
        assert!(!audience_is_ours("q1", "localhost", local));
    }
}
