//! Where a namespace's administration API is (ATOM over HTTP(S)).

use crate::error::Error;

/// Where a namespace's administration API is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AdminEndpoint {
    https: bool,
    host: String,
    port: u16,
}

impl AdminEndpoint {
    /// `https://host:port`.
    pub fn https(host: impl Into<String>, port: u16) -> Self {
        Self { https: true, host: host.into(), port }
    }

    /// `http://host:port` (the emulator, `twice serve` without a certificate).
    pub fn http(host: impl Into<String>, port: u16) -> Self {
        Self { https: false, host: host.into(), port }
    }

    /// Reads `http://HOST[:PORT]` or `https://HOST[:PORT]` (80 and 443 by default).
    ///
    /// # Errors
    ///
    /// [`Error::Invalid`] for anything else.
    pub fn parse(url: &str) -> Result<Self, Error> {
        let bad = || Error::Invalid(format!("expected http(s)://HOST[:PORT], got {url:?}"));
        let (https, rest) = match url.split_once("://") {
            Some(("https", rest)) => (true, rest),
            Some(("http", rest)) => (false, rest),
            _ => return Err(bad()),
        };
        let authority = rest.trim_end_matches('/');
        if authority.is_empty() || authority.contains('/') {
            return Err(bad());
        }
        let (host, port) = match authority.rsplit_once(':') {
            Some((h, p)) => (h, p.parse().map_err(|_| bad())?),
            None => (authority, if https { 443 } else { 80 }),
        };
        Ok(Self { https, host: host.to_owned(), port })
    }

    /// Whether the API is reached over https.
    pub fn is_https(&self) -> bool {
        self.https
    }

    /// The host.
    pub fn host(&self) -> &str {
        &self.host
    }

    /// The port.
    pub fn port(&self) -> u16 {
        self.port
    }
}

impl std::fmt::Display for AdminEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let scheme = if self.https { "https" } else { "http" };
        write!(f, "{scheme}://{}:{}", self.host, self.port)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_parse_with_and_without_ports() {
        assert_eq!(
            AdminEndpoint::parse("http://127.0.0.1:5300").ok(),
            Some(AdminEndpoint::http("127.0.0.1", 5300))
        );
        assert_eq!(
            AdminEndpoint::parse("https://ns.servicebus.windows.net/").ok(),
            Some(AdminEndpoint::https("ns.servicebus.windows.net", 443))
        );
        assert!(AdminEndpoint::parse("amqp://x").is_err());
        assert!(AdminEndpoint::parse("http://x/path").is_err());
    }
}
