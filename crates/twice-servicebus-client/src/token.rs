//! Tokens for claims-based security (`$cbs`): the client puts one for an entity before it
//! attaches a link to it, and puts a fresh one before the old one expires.
//!
//! Three providers come with the crate: [`SasKeyProvider`] signs tokens with a shared access
//! key (what `SharedAccessKeyName`/`SharedAccessKey` in a connection string give),
//! [`SasSignatureProvider`] hands out a ready-made signature (`SharedAccessSignature`), and any
//! type implementing [`TokenProvider`] can supply Microsoft Entra ID tokens:
//!
//! ```
//! use std::future::Future;
//! use std::pin::Pin;
//! use std::time::Duration;
//! use twice::Timestamp;
//! use twice_servicebus_client::{AccessToken, Error, TokenProvider, TokenType};
//!
//! /// Entra ID: a bearer token for the scope `https://servicebus.azure.net/.default`, obtained
//! /// by whatever identity library the application uses (a managed identity, a workload
//! /// identity, the Azure CLI). Here it comes from a function so the example makes no call.
//! #[derive(Debug)]
//! struct EntraId {
//!     fetch: fn() -> (String, Timestamp),
//! }
//!
//! impl TokenProvider for EntraId {
//!     fn token<'a>(
//!         &'a self,
//!         _audience: &'a str,
//!     ) -> Pin<Box<dyn Future<Output = Result<AccessToken, Error>> + Send + 'a>> {
//!         Box::pin(async move {
//!             let (jwt, expires_at) = (self.fetch)();
//!             // Entra tokens travel as `jwt`; one token covers every entity the identity's
//!             // role assignments allow, so the audience is not part of it.
//!             Ok(AccessToken::new(jwt, TokenType::Jwt, expires_at))
//!         })
//!     }
//! }
//!
//! let provider = EntraId {
//!     fetch: || ("eyJ0eXAiOiJKV1QiLCJhbGciOi...".to_owned(), Timestamp::from_millis(4_102_444_800_000)),
//! };
//! # let _ = provider;
//! ```
//!
//! Hand such a provider to [`crate::ClientOptions::token_provider`]. What was tested: SAS
//! tokens against `twice serve`, which checks their signatures; the Entra ID path differs only
//! in the token type the client puts to `$cbs` (`jwt` instead of
//! `servicebus.windows.net:sastoken`) and is covered by a unit test of that request, not
//! against Azure.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use twice::{SharedClock, Timestamp};

use crate::error::Error;

/// How the service should read a token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum TokenType {
    /// A shared access signature (`SharedAccessSignature sr=…&sig=…&se=…&skn=…`).
    SharedAccessSignature,
    /// A Microsoft Entra ID (OAuth 2.0) bearer token.
    Jwt,
}

impl TokenType {
    /// The `type` application property of a put-token request.
    pub fn as_cbs_type(self) -> &'static str {
        match self {
            TokenType::SharedAccessSignature => "servicebus.windows.net:sastoken",
            TokenType::Jwt => "jwt",
        }
    }
}

/// A token and when it expires. `Debug` does not show the token.
#[derive(Clone, PartialEq, Eq)]
pub struct AccessToken {
    token: String,
    token_type: TokenType,
    expires_at: Timestamp,
}

impl fmt::Debug for AccessToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AccessToken")
            .field("token_type", &self.token_type)
            .field("expires_at", &self.expires_at)
            .finish_non_exhaustive()
    }
}

impl AccessToken {
    /// A token of this type that expires at `expires_at`.
    pub fn new(token: impl Into<String>, token_type: TokenType, expires_at: Timestamp) -> Self {
        Self { token: token.into(), token_type, expires_at }
    }

    /// The token text.
    pub fn token(&self) -> &str {
        &self.token
    }

    /// The token's type.
    pub fn token_type(&self) -> TokenType {
        self.token_type
    }

    /// When the token expires.
    pub fn expires_at(&self) -> Timestamp {
        self.expires_at
    }
}

/// Supplies tokens for an audience (`sb://<host>/<entity>`).
pub trait TokenProvider: Send + Sync + fmt::Debug + 'static {
    /// A token valid for `audience`.
    ///
    /// # Cancel safety
    ///
    /// Implementations should be cancel safe; the client drops the future when the operation
    /// that needed the token is cancelled.
    fn token<'a>(
        &'a self,
        audience: &'a str,
    ) -> Pin<Box<dyn Future<Output = Result<AccessToken, Error>> + Send + 'a>>;
}

/// Signs shared access signatures with a key, valid for [`SasKeyProvider::validity`].
#[derive(Clone)]
pub struct SasKeyProvider {
    key_name: String,
    key: String,
    validity: Duration,
    clock: SharedClock,
}

impl fmt::Debug for SasKeyProvider {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SasKeyProvider")
            .field("key_name", &self.key_name)
            .field("validity", &self.validity)
            .finish_non_exhaustive()
    }
}

impl SasKeyProvider {
    /// Tokens signed with `key` under `key_name`, valid for one hour (as the SDKs sign them).
    pub fn new(key_name: impl Into<String>, key: impl Into<String>) -> Self {
        Self {
            key_name: key_name.into(),
            key: key.into(),
            validity: Duration::from_secs(3600),
            clock: SharedClock::system(),
        }
    }

    /// How long each token is valid (default one hour).
    #[must_use]
    pub fn validity(mut self, validity: Duration) -> Self {
        self.validity = validity;
        self
    }

    /// Reads time from this clock (tests move it).
    #[must_use]
    pub fn clock(mut self, clock: SharedClock) -> Self {
        self.clock = clock;
        self
    }

    /// A token for `audience`, signed now.
    pub fn sign(&self, audience: &str) -> AccessToken {
        let expires_at = self.clock.now().saturating_add(self.validity);
        let expiry_secs = expires_at.as_millis() / 1000;
        let token = twice_amqp::sas::sign(audience, &self.key_name, &self.key, expiry_secs);
        AccessToken::new(
            token,
            TokenType::SharedAccessSignature,
            Timestamp::from_millis(expiry_secs * 1000),
        )
    }
}

impl TokenProvider for SasKeyProvider {
    fn token<'a>(
        &'a self,
        audience: &'a str,
    ) -> Pin<Box<dyn Future<Output = Result<AccessToken, Error>> + Send + 'a>> {
        Box::pin(async move { Ok(self.sign(audience)) })
    }
}

/// A fixed shared access signature, as `SharedAccessSignature=` in a connection string gives
/// one. It cannot be renewed: once it expires, puts fail with an authorization error.
#[derive(Clone)]
pub struct SasSignatureProvider {
    token: AccessToken,
}

impl fmt::Debug for SasSignatureProvider {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SasSignatureProvider").field("token", &self.token).finish()
    }
}

impl SasSignatureProvider {
    /// The signature; its expiry is read from its `se` field.
    pub fn new(signature: impl Into<String>) -> Result<Self, Error> {
        let signature = signature.into();
        let se = signature
            .split(['&', ' '])
            .find_map(|p| p.strip_prefix("se="))
            .and_then(|s| s.parse::<i64>().ok())
            .ok_or_else(|| Error::ConnectionString("the signature has no expiry (se=)".into()))?;
        let token = AccessToken::new(
            signature,
            TokenType::SharedAccessSignature,
            Timestamp::from_millis(se.saturating_mul(1000)),
        );
        Ok(Self { token })
    }
}

impl TokenProvider for SasSignatureProvider {
    fn token<'a>(
        &'a self,
        _audience: &'a str,
    ) -> Pin<Box<dyn Future<Output = Result<AccessToken, Error>> + Send + 'a>> {
        Box::pin(async move { Ok(self.token.clone()) })
    }
}

/// When to put a fresh token: 10 % of its lifetime before expiry, at least 30 s and at most
/// 5 minutes before, and never in the past.
pub(crate) fn refresh_at(now: Timestamp, expires_at: Timestamp) -> Timestamp {
    let life = expires_at.duration_since(now);
    let margin = (life / 10).clamp(Duration::from_secs(30), Duration::from_secs(300));
    let at = expires_at.saturating_sub(margin);
    if at < now { now.saturating_add(life / 2) } else { at }
}

#[cfg(test)]
mod tests {
    use super::*;
    use twice::ManualClock;
    use twice_amqp::sas::Keys;

    #[test]
    fn signed_tokens_validate_against_the_key() {
        let clock = ManualClock::new(Timestamp::from_millis(1_000_000_000));
        let p = SasKeyProvider::new("RootManageSharedAccessKey", "SAS_KEY_VALUE")
            .clock(SharedClock::new(clock));
        let t = p.sign("sb://localhost:5673/orders");
        let grant = Keys::emulator_default().validate(t.token(), 1_000_000).unwrap();
        assert_eq!(grant.resource, "sb://localhost:5673/orders");
        assert_eq!(t.expires_at(), Timestamp::from_millis(1_000_000_000 + 3_600_000));
        assert!(!format!("{t:?}").contains("sig="));
    }

    #[test]
    fn a_fixed_signature_reports_its_expiry() {
        let p = SasSignatureProvider::new("SharedAccessSignature sr=a&sig=b&se=1700000000&skn=k")
            .unwrap();
        assert_eq!(p.token.expires_at(), Timestamp::from_millis(1_700_000_000_000));
        assert!(SasSignatureProvider::new("SharedAccessSignature sr=a").is_err());
    }

    #[test]
    fn refresh_comes_before_expiry() {
        let now = Timestamp::from_millis(0);
        let hour = Timestamp::from_millis(3_600_000);
        assert_eq!(refresh_at(now, hour), Timestamp::from_millis(3_300_000));
        let soon = Timestamp::from_millis(40_000);
        assert_eq!(refresh_at(now, soon), Timestamp::from_millis(10_000));
        assert!(refresh_at(now, Timestamp::from_millis(10_000)) > now);
    }
}
