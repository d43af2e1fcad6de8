//! Connection strings, as the Service Bus SDKs accept them.

use std::fmt;

use crate::error::Error;

/// The parts of a Service Bus connection string.
///
/// ```
/// use twice_servicebus_client::ConnectionString;
///
/// let cs: ConnectionString = "Endpoint=sb://shop.servicebus.windows.net/;\
///     SharedAccessKeyName=send;SharedAccessKey=c2VjcmV0;EntityPath=orders".parse()?;
/// assert_eq!(cs.host(), "shop.servicebus.windows.net");
/// assert_eq!(cs.port(), 5671); // amqps
/// assert!(cs.use_tls());
/// assert_eq!(cs.entity_path(), Some("orders"));
/// # Ok::<(), twice_servicebus_client::Error>(())
/// ```
///
/// Keys are matched without regard to case, as the Python SDK does. With
/// `UseDevelopmentEmulator=true` the client speaks plain AMQP (port 5672 unless the endpoint
/// names one), as the SDKs do for the emulator and `twice serve`; otherwise it uses TLS on
/// port 5671 (or the endpoint's port). `Debug` never shows the key or the signature.
#[derive(Clone, PartialEq, Eq)]
pub struct ConnectionString {
    host: String,
    port: Option<u16>,
    key_name: Option<String>,
    key: Option<String>,
    signature: Option<String>,
    entity_path: Option<String>,
    emulator: bool,
}

impl fmt::Debug for ConnectionString {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConnectionString")
            .field("host", &self.host)
            .field("port", &self.port())
            .field("key_name", &self.key_name)
            .field("key", &self.key.as_ref().map(|_| "<redacted>"))
            .field("signature", &self.signature.as_ref().map(|_| "<redacted>"))
            .field("entity_path", &self.entity_path)
            .field("emulator", &self.emulator)
            .finish()
    }
}

impl ConnectionString {
    /// The host name of the namespace.
    pub fn host(&self) -> &str {
        &self.host
    }

    /// The AMQP port: the endpoint's, else 5672 for the emulator and 5671 (amqps) otherwise.
    pub fn port(&self) -> u16 {
        self.port.unwrap_or(if self.emulator { 5672 } else { 5671 })
    }

    /// Whether the connection uses TLS (every connection except to a development emulator).
    pub fn use_tls(&self) -> bool {
        !self.emulator
    }

    /// `SharedAccessKeyName`.
    pub fn key_name(&self) -> Option<&str> {
        self.key_name.as_deref()
    }

    /// `SharedAccessKey`.
    pub fn key(&self) -> Option<&str> {
        self.key.as_deref()
    }

    /// `SharedAccessSignature`: a ready-made token.
    pub fn signature(&self) -> Option<&str> {
        self.signature.as_deref()
    }

    /// `EntityPath`: the queue or topic the string is scoped to.
    pub fn entity_path(&self) -> Option<&str> {
        self.entity_path.as_deref()
    }

    /// Whether `UseDevelopmentEmulator=true`.
    pub fn is_emulator(&self) -> bool {
        self.emulator
    }
}

impl std::str::FromStr for ConnectionString {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Error> {
        let bad = |m: &str| Error::ConnectionString(m.to_owned());
        let mut endpoint = None;
        let mut cs = ConnectionString {
            host: String::new(),
            port: None,
            key_name: None,
            key: None,
            signature: None,
            entity_path: None,
            emulator: false,
        };
        for part in s.split(';').map(str::trim).filter(|p| !p.is_empty()) {
            // Only the first `=` separates: keys and signatures end in base64 padding.
            let (k, v) = part.split_once('=').ok_or_else(|| bad("a part has no '='"))?;
            let v = v.trim().to_owned();
            match k.trim().to_ascii_lowercase().as_str() {
                "endpoint" => endpoint = Some(v),
                "sharedaccesskeyname" => cs.key_name = Some(v),
                "sharedaccesskey" => cs.key = Some(v),
                "sharedaccesssignature" => cs.signature = Some(v),
                "entitypath" => cs.entity_path = Some(v),
                "usedevelopmentemulator" => cs.emulator = v.eq_ignore_ascii_case("true"),
                // The SDKs ignore keys they do not know (e.g. TransportType).
                _ => {}
            }
        }
        let endpoint = endpoint.ok_or_else(|| bad("Endpoint is missing"))?;
        let rest = endpoint.split_once("://").map_or(endpoint.as_str(), |(_, r)| r);
        let authority = rest.split('/').next().unwrap_or("");
        let (host, port) = match authority.rsplit_once(':') {
            Some((h, p)) => {
                (h, Some(p.parse::<u16>().map_err(|_| bad("the port is not a number"))?))
            }
            None => (authority, None),
        };
        if host.is_empty() {
            return Err(bad("Endpoint has no host"));
        }
        cs.host = host.to_owned();
        cs.port = port;
        if cs.signature.is_none() && (cs.key_name.is_none() || cs.key.is_none()) {
            return Err(bad(
                "give SharedAccessKeyName and SharedAccessKey, or SharedAccessSignature",
            ));
        }
        Ok(cs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_what_the_sdks_accept() {
        let cs: ConnectionString = "Endpoint=sb://localhost:5673;SharedAccessKeyName=RootManageSharedAccessKey;SharedAccessKey=SAS_KEY_VALUE;UseDevelopmentEmulator=true;".parse().unwrap();
        assert_eq!((cs.host(), cs.port(), cs.use_tls()), ("localhost", 5673, false));
        assert_eq!(cs.key(), Some("SAS_KEY_VALUE"));
        let cs: ConnectionString =
            "endpoint=sb://localhost;sharedaccesskeyname=k;sharedaccesskey=a==;usedevelopmentemulator=TRUE"
                .parse()
                .unwrap();
        assert_eq!((cs.port(), cs.use_tls(), cs.key()), (5672, false, Some("a==")));
        let cs: ConnectionString = "Endpoint=sb://ns.servicebus.windows.net/;SharedAccessSignature=SharedAccessSignature sr=x&sig=y%3D&se=1&skn=k;EntityPath=q".parse().unwrap();
        assert_eq!((cs.port(), cs.use_tls()), (5671, true));
        assert_eq!(cs.signature(), Some("SharedAccessSignature sr=x&sig=y%3D&se=1&skn=k"));
        assert_eq!(cs.entity_path(), Some("q"));
    }

    #[test]
    fn refuses_incomplete_strings_and_hides_secrets() {
        for s in [
            "",
            "SharedAccessKey=x",
            "Endpoint=sb://h;SharedAccessKeyName=k",
            "Endpoint=sb://h:x;SharedAccessSignature=s",
            "Endpoint",
        ] {
            assert!(
                matches!(s.parse::<ConnectionString>(), Err(Error::ConnectionString(_))),
                "{s}"
            );
        }
        let cs: ConnectionString =
            "Endpoint=sb://h;SharedAccessKeyName=k;SharedAccessKey=topsecret".parse().unwrap();
        assert!(!format!("{cs:?}").contains("topsecret"));
    }
}
