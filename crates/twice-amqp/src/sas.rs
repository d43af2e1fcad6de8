//! Shared access signatures: the tokens the SDKs put to `$cbs`, checked against the keys.
//!
//! A token reads `SharedAccessSignature sr=<url-encoded resource>&sig=<url-encoded base64
//! HMAC-SHA256>&se=<expiry, unix seconds>&skn=<key name>`, fields in any order. The signature
//! covers the resource exactly as it appears in the token, a newline, and the expiry.

use std::collections::BTreeMap;

use base64::Engine;
use hmac::{Hmac, Mac};
use sha2::Sha256;

/// Why a token is refused. The variants never carry the token or a key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SasError {
    /// The token is not a shared access signature.
    #[error("the token is not a well-formed shared access signature")]
    Malformed,
    /// The key name is not configured.
    #[error("unknown shared access key name")]
    UnknownKey,
    /// The signature does not match the key.
    #[error("the signature does not match")]
    BadSignature,
    /// The token has expired.
    #[error("the token has expired")]
    Expired,
}

/// A validated token: which resource it grants.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    /// The decoded resource URI (`sr`).
    pub resource: String,
    /// The key name used.
    pub key_name: String,
    /// Expiry, unix seconds.
    pub expiry: i64,
}

/// What a token signed with a key may do, as in a Service Bus shared access rule.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Claim {
    /// Send to an entity.
    Send,
    /// Receive from an entity, and settle, peek and renew locks.
    Listen,
    /// Manage an entity (rules); implies `Send` and `Listen`.
    Manage,
}

/// The claims of a key. The default, and what [`Keys::insert`] gives, is all of them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Claims {
    send: bool,
    listen: bool,
    manage: bool,
}

impl Default for Claims {
    fn default() -> Self {
        Self::ALL
    }
}

impl Claims {
    /// `Send`, `Listen` and `Manage`.
    pub const ALL: Claims = Claims { send: true, listen: true, manage: true };
    /// No claim at all.
    pub const NONE: Claims = Claims { send: false, listen: false, manage: false };

    /// These claims and `c`.
    #[must_use]
    pub fn with(mut self, c: Claim) -> Self {
        match c {
            Claim::Send => self.send = true,
            Claim::Listen => self.listen = true,
            Claim::Manage => self.manage = true,
        }
        self
    }

    /// Whether these claims allow `c` (`Manage` allows everything).
    pub fn allows(&self, c: Claim) -> bool {
        self.manage
            || match c {
                Claim::Send => self.send,
                Claim::Listen => self.listen,
                Claim::Manage => false,
            }
    }

    /// Parses a comma-separated list such as `Send,Listen` (case-insensitive).
    pub fn parse(s: &str) -> Option<Self> {
        let mut claims = Self::NONE;
        for part in s.split(',') {
            let c = match part.trim().to_ascii_lowercase().as_str() {
                "send" => Claim::Send,
                "listen" => Claim::Listen,
                "manage" => Claim::Manage,
                _ => return None,
            };
            claims = claims.with(c);
        }
        Some(claims)
    }
}

/// The configured keys, by name, with their claims. `Debug` shows only the names.
#[derive(Clone, Default)]
pub struct Keys(BTreeMap<String, String>, BTreeMap<String, Claims>);

impl std::fmt::Debug for Keys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_set().entries(self.0.keys()).finish()
    }
}

impl Keys {
    /// No keys.
    pub fn new() -> Self {
        Self::default()
    }

    /// The official emulator's key: `RootManageSharedAccessKey` = `SAS_KEY_VALUE`.
    pub fn emulator_default() -> Self {
        let mut k = Self::new();
        k.insert("RootManageSharedAccessKey", "SAS_KEY_VALUE");
        k
    }

    /// Adds or replaces a key, with every claim.
    pub fn insert(&mut self, name: impl Into<String>, key: impl Into<String>) {
        self.insert_with_claims(name, key, Claims::ALL);
    }

    /// Adds or replaces a key whose tokens may do only what `claims` allow.
    pub fn insert_with_claims(
        &mut self,
        name: impl Into<String>,
        key: impl Into<String>,
        claims: Claims,
    ) {
        let name = name.into();
        self.1.insert(name.clone(), claims);
        self.0.insert(name, key.into());
    }

    /// The claims of a key (none for a name that is not configured).
    pub fn claims(&self, name: &str) -> Claims {
        self.1.get(name).copied().unwrap_or(Claims::NONE)
    }

    /// The key of a name.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.0.get(name).map(String::as_str)
    }

    /// The first key, by name order.
    pub fn first(&self) -> Option<(&str, &str)> {
        self.0.iter().next().map(|(k, v)| (k.as_str(), v.as_str()))
    }

    /// Whether any key is configured.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Checks a token at time `now` (unix seconds).
    pub fn validate(&self, token: &str, now_secs: i64) -> Result<Grant, SasError> {
        let rest =
            token.trim().strip_prefix("SharedAccessSignature ").ok_or(SasError::Malformed)?;
        let (mut sr, mut sig, mut se, mut skn) = (None, None, None, None);
        for part in rest.split('&') {
            let (k, v) = part.split_once('=').ok_or(SasError::Malformed)?;
            match k {
                "sr" => sr = Some(v),
                "sig" => sig = Some(v),
                "se" => se = Some(v),
                "skn" => skn = Some(v),
                _ => {}
            }
        }
        let (sr, sig, se, skn) = match (sr, sig, se, skn) {
            (Some(a), Some(b), Some(c), Some(d)) => (a, b, c, d),
            _ => return Err(SasError::Malformed),
        };
        let key_name = url_decode(skn).ok_or(SasError::Malformed)?;
        let key = self.get(&key_name).ok_or(SasError::UnknownKey)?;
        let expiry: i64 = se.parse().map_err(|_| SasError::Malformed)?;
        let sig = url_decode(sig).ok_or(SasError::Malformed)?;
        let sig = base64::engine::general_purpose::STANDARD
            .decode(sig.as_bytes())
            .map_err(|_| SasError::Malformed)?;
        let mut mac =
            Hmac::<Sha256>::new_from_slice(key.as_bytes()).map_err(|_| SasError::Malformed)?;
        mac.update(sr.as_bytes());
        mac.update(b"\n");
        mac.update(se.as_bytes());
        mac.verify_slice(&sig).map_err(|_| SasError::BadSignature)?;
        if expiry < now_secs {
            return Err(SasError::Expired);
        }
        let resource = url_decode(sr).ok_or(SasError::Malformed)?;
        Ok(Grant { resource, key_name, expiry })
    }
}

/// Signs a token the way the SDKs do (for tests and tools).
pub fn sign(resource: &str, key_name: &str, key: &str, expiry: i64) -> String {
    let sr = url_encode(resource);
    let mut mac = match Hmac::<Sha256>::new_from_slice(key.as_bytes()) {
        Ok(m) => m,
        // HMAC accepts keys of any length; this arm cannot be taken.
        Err(_) => return String::new(),
    };
    mac.update(format!("{sr}\n{expiry}").as_bytes());
    let sig = base64::engine::general_purpose::STANDARD.encode(mac.finalize().into_bytes());
    format!(
        "SharedAccessSignature sr={sr}&sig={}&se={expiry}&skn={}",
        url_encode(&sig),
        url_encode(key_name)
    )
}

/// Percent-decoding (`+` is a space, as `quote_plus` writes it).
pub fn url_decode(s: &str) -> Option<String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' => {
                let hex = std::str::from_utf8(bytes.get(i + 1..i + 3)?).ok()?;
                out.push(u8::from_str_radix(hex, 16).ok()?);
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8(out).ok()
}

/// Percent-encoding of everything but unreserved characters.
pub fn url_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len() * 3);
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn claims_parse_and_manage_implies_the_others() {
        let send = Claims::parse("Send").unwrap();
        assert!(send.allows(Claim::Send) && !send.allows(Claim::Listen));
        let manage = Claims::parse("manage").unwrap();
        assert!(manage.allows(Claim::Send) && manage.allows(Claim::Listen));
        assert_eq!(Claims::parse("Send,Bogus"), None);
        let mut keys = Keys::new();
        keys.insert_with_claims("s", "k", send);
        assert_eq!(keys.claims("s"), send);
        assert_eq!(keys.claims("nobody"), Claims::NONE);
        assert_eq!(Keys::emulator_default().claims("RootManageSharedAccessKey"), Claims::ALL);
    }

    #[test]
    fn accepts_a_token_signed_with_the_key() {
        let keys = Keys::emulator_default();
        let t = sign("sb://localhost:5673/q1", "RootManageSharedAccessKey", "SAS_KEY_VALUE", 2000);
        let g = keys.validate(&t, 1000).unwrap();
        assert_eq!(g.resource, "sb://localhost:5673/q1");
        assert_eq!(g.key_name, "RootManageSharedAccessKey");
    }

    #[test]
    fn refuses_wrong_key_expiry_unknown_name_and_garbage() {
        let keys = Keys::emulator_default();
        let wrong = sign("sb://h/q", "RootManageSharedAccessKey", "other", 2000);
        assert_eq!(keys.validate(&wrong, 1000), Err(SasError::BadSignature));
        let old = sign("sb://h/q", "RootManageSharedAccessKey", "SAS_KEY_VALUE", 999);
        assert_eq!(keys.validate(&old, 1000), Err(SasError::Expired));
        let unknown = sign("sb://h/q", "nobody", "SAS_KEY_VALUE", 2000);
        assert_eq!(keys.validate(&unknown, 1000), Err(SasError::UnknownKey));
        assert_eq!(keys.validate("Bearer x", 1000), Err(SasError::Malformed));
        assert_eq!(keys.validate("SharedAccessSignature sr=a", 1000), Err(SasError::Malformed));
    }

    /// A token exactly as the Python SDK put it on the wire (from its frame log), signed with
    /// `SAS_KEY_VALUE` for `sb://localhost:5673/q1`.
    #[test]
    fn accepts_the_python_sdk_token_from_the_wire() {
        let keys = Keys::emulator_default();
        let token = "SharedAccessSignature sr=sb%3A%2F%2Flocalhost%3A5673%2Fq1&sig=cGyZDmc9zQXd4MHS250Rh0%2BEUqogTzvUyv6ljoRrjXY%3D&se=1796032403&skn=RootManageSharedAccessKey";
        let g = keys.validate(token, 1_796_028_803).unwrap();
        assert_eq!(g.resource, "sb://localhost:5673/q1");
        assert_eq!(keys.validate(token, 1_796_032_404), Err(SasError::Expired));
    }
}
