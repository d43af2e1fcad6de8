//! What a connection may use: the paths its tokens name, each until its token expires.

use std::net::SocketAddr;

use crate::options::ServerOptions;
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

/// The schemes a token's audience may name.
const AUDIENCE_SCHEMES: [&str; 5] = ["sb", "amqp", "amqps", "http", "https"];

/// The authority of a token's audience, parsed strictly.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Audience {
    /// The host, lowercased; an IPv6 literal without its brackets.
    pub(crate) host: String,
    /// The port, when the audience names one.
    pub(crate) port: Option<u16>,
}

/// The host and port of a token's audience (`sb://host:port/path`, `amqp://host/path`), or
/// `None` when it is not a plain `scheme://host[:port]` with a known scheme: userinfo
/// (`sb://localhost:1@evil.example/` names `evil.example`), percent-encoding, a backslash
/// or any character a host name cannot hold makes it no audience of this server, rather
/// than something to guess at.
pub(crate) fn audience(resource: &str) -> Option<Audience> {
    let (scheme, rest) = resource.split_once("://")?;
    if !AUDIENCE_SCHEMES.iter().any(|s| s.eq_ignore_ascii_case(scheme)) {
        return None;
    }
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let authority = &rest[..end];
    let (host, port) = match authority.strip_prefix('[') {
        // An IPv6 literal: `[::1]:5673`.
        Some(v6) => {
            let (literal, after) = v6.split_once(']')?;
            let ip: std::net::Ipv6Addr = literal.parse().ok()?;
            (ip.to_string(), after)
        }
        None => {
            let at = authority.find(':').unwrap_or(authority.len());
            let host = &authority[..at];
            let label_ok = |l: &str| {
                !l.is_empty()
                    && !l.starts_with('-')
                    && !l.ends_with('-')
                    && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
            };
            if !host.split('.').all(label_ok) {
                return None;
            }
            (host.to_ascii_lowercase(), &authority[at..])
        }
    };
    let port = match port {
        "" => None,
        p => {
            let digits = p.strip_prefix(':')?;
            if digits.is_empty() || digits.len() > 5 || !digits.bytes().all(|b| b.is_ascii_digit())
            {
                return None;
            }
            Some(digits.parse::<u16>().ok().filter(|&p| p != 0)?)
        }
    };
    Some(Audience { host, port })
}

/// Whether a token's audience names this server: the host name it serves under, or, for a
/// server that listens on loopback only, any loopback name; and, when the audience names a
/// port, one of `ports`, this server's (a port of 0 among them is one not known here, which
/// lets any port through).
pub(crate) fn audience_is_ours(
    resource: &str,
    hostname: &str,
    addr: SocketAddr,
    ports: &[u16],
) -> bool {
    let Some(Audience { host, port }) = audience(resource) else { return false };
    if let Some(port) = port
        && !ports.contains(&0)
        && !ports.contains(&port)
    {
        return false;
    }
    if host.eq_ignore_ascii_case(hostname) {
        return true;
    }
    addr.ip().is_loopback() && matches!(host.as_str(), "localhost" | "127.0.0.1" | "::1")
}

/// The ports this server is known by, for [`audience_is_ours`]: its AMQP and HTTP ports as
/// configured, and `addr`'s, the address of the listener a request came through (a
/// configured port of 0 is not known until the listener is bound).
pub(crate) fn server_ports(opts: &ServerOptions, addr: SocketAddr) -> [u16; 3] {
    let amqp = opts.amqp_addr.port();
    [amqp, opts.http_addr.map_or(amqp, |a| a.port()), addr.port()]
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
    fn audiences_are_parsed_strictly() {
        let local = SocketAddr::from(([127, 0, 0, 1], 5673));
        for refused in [
            "sb://localhost:1@evil.example/q1",
            "sb://user@localhost/q1",
            "sb://localhost%2Fevil/q1",
            "sb://local%68ost/q1",
            "sb://evil.example\\@localhost/q1",
            "sb://evil.example#@localhost/q1",
            "sb://evil.example?@localhost/q1",
            "ftp://localhost/q1",
            "file://localhost/q1",
            "sb:///q1",
            "sb://localhost:/q1",
            "sb://localhost:99999/q1",
            "sb://localhost:+5673/q1",
            "sb://localhost :5673/q1",
            "sb://[::1%25eth0]/q1",
            "sb://[::1/q1",
            "sb://localhost./q1",
            "sb://localhost:5673:5673/q1",
        ] {
            assert!(!audience_is_ours(refused, "localhost", local, &[5673]), "{refused}");
        }
        // A port must be one of the server's.
        assert!(!audience_is_ours("sb://localhost:1/q1", "localhost", local, &[5673, 5300]));
        assert!(audience_is_ours("sb://localhost:5300/q1", "localhost", local, &[5673, 5300]));
        assert!(audience_is_ours("SB://LocalHost/q1", "localhost", local, &[5673]));
        for scheme in ["sb", "amqp", "amqps", "http", "https"] {
            let a = format!("{scheme}://localhost:5673");
            assert!(audience_is_ours(&a, "localhost", local, &[5673]), "{a}");
        }
        let v6 = Audience { host: "::1".into(), port: Some(5673) };
        assert_eq!(audience("sb://[::1]:5673/q1"), Some(v6));
        assert_eq!(audience("sb://localhost:1@evil.example/"), None);
    }

    #[test]
    fn audiences_name_their_host() {
        let local = SocketAddr::from(([127, 0, 0, 1], 5673));
        let any = SocketAddr::from(([0, 0, 0, 0], 5673));
        let ports = [5673, 5300];
        assert!(audience_is_ours("sb://localhost:5673/q1", "localhost", any, &ports));
        assert!(audience_is_ours("amqp://127.0.0.1/q1", "localhost", local, &ports));
        assert!(audience_is_ours("sb://[::1]:5673/q1", "localhost", local, &ports));
        assert!(!audience_is_ours("amqp://127.0.0.1/q1", "box.lan", any, &ports));
        assert!(!audience_is_ours("sb://evil.example.com/q1", "localhost", local, &ports));
        assert!(!audience_is_ours("q1", "localhost", local, &ports));
        // A server bound to port 0 does not know its port here: any is taken.
        assert!(audience_is_ours("sb://localhost:41234/q1", "localhost", local, &[0, 5300]));
    }
}
