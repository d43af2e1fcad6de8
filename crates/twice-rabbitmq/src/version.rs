//! The version of the RabbitMQ server, read at connect from its `connection.start`, and the
//! semantics that depend on it.
//!
//! lapin does not keep the `server-properties` of `connection.start`, so the transport opens a
//! connection of its own for a moment: it sends the AMQP 0-9-1 protocol header, reads the
//! server's first frame, and closes.

use std::fmt;
use std::time::Duration;

use lapin::types::AMQPValue;
use lapin::uri::AMQPUri;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

/// A RabbitMQ version, `major.minor.patch`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct ServerVersion {
    /// The major version.
    pub major: u32,
    /// The minor version.
    pub minor: u32,
    /// The patch version.
    pub patch: u32,
}

impl fmt::Display for ServerVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

impl ServerVersion {
    /// A version.
    pub const fn new(major: u32, minor: u32, patch: u32) -> Self {
        Self { major, minor, patch }
    }

    /// Parses `4.3.0`, `3.10.8`, `4.0.0-rc.2` (the pre-release is ignored).
    pub fn parse(s: &str) -> Option<Self> {
        let core = s.split(['-', '+']).next()?;
        let mut parts = core.split('.').map(str::parse::<u32>);
        let major = parts.next()?.ok()?;
        let minor = parts.next().unwrap_or(Ok(0)).ok()?;
        let patch = parts.next().unwrap_or(Ok(0)).ok()?;
        Some(Self { major, minor, patch })
    }

    /// RabbitMQ 4.0 gives a quorum queue declared without `x-delivery-limit` a limit of 20,
    /// and takes `-1` for no limit.
    pub fn has_default_delivery_limit(self) -> bool {
        self >= Self::new(4, 0, 0)
    }

    /// RabbitMQ 4.3 no longer counts a requeueing `basic.nack` in a quorum queue's
    /// delivery count (only `basic.reject` counts), nor a delivery requeued because its channel
    /// closed.
    pub fn counts_nack(self) -> bool {
        self < Self::new(4, 3, 0)
    }

    /// RabbitMQ 3.12 takes a consumer's own `x-consumer-timeout`.
    pub fn has_consumer_timeout_argument(self) -> bool {
        self >= Self::new(3, 12, 0)
    }
}

/// Reads the server's version from its `connection.start`; `None` when the server says none
/// (a broker other than RabbitMQ) or the URI's scheme is not plain `amqp`.
pub(crate) async fn probe(uri: &str) -> std::io::Result<Option<ServerVersion>> {
    let Ok(parsed) = uri.parse::<AMQPUri>() else { return Ok(None) };
    if !matches!(parsed.scheme, lapin::uri::AMQPScheme::AMQP) {
        return Ok(None);
    }
    let addr = (parsed.authority.host.as_str(), parsed.authority.port);
    let read = async {
        let mut socket = tokio::net::TcpStream::connect(addr).await?;
        socket.write_all(b"AMQP\x00\x00\x09\x01").await?;
        let mut header = [0u8; 7];
        socket.read_exact(&mut header).await?;
        let size = u32::from_be_bytes([header[3], header[4], header[5], header[6]]);
        // connection.start is small; anything larger is not it.
        if header[0] != 1 || size > 64 * 1024 {
            return Ok(None);
        }
        let mut payload = vec![0u8; usize::try_from(size).unwrap_or(0) + 1];
        socket.read_exact(&mut payload).await?;
        Ok(version_of_start(&payload))
    };
    tokio::time::timeout(Duration::from_secs(10), read)
        .await
        .unwrap_or_else(|_| Err(std::io::ErrorKind::TimedOut.into()))
}

/// The version in the `server-properties` of a `connection.start` method frame's payload.
fn version_of_start(payload: &[u8]) -> Option<ServerVersion> {
    // class 10 (connection), method 10 (start), version-major, version-minor, then the table.
    if payload.len() < 6 || payload[..4] != [0, 10, 0, 10] {
        return None;
    }
    let (_, table) = lapin::types::parsing::parse_field_table(&payload[6..]).ok()?;
    match table.inner().get("version")? {
        AMQPValue::LongString(s) => ServerVersion::parse(&String::from_utf8_lossy(s.as_bytes())),
        AMQPValue::ShortString(s) => ServerVersion::parse(s.as_str()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_parse_and_order() {
        assert_eq!(ServerVersion::parse("3.10.8"), Some(ServerVersion::new(3, 10, 8)));
        assert_eq!(ServerVersion::parse("4.3.0-rc.1"), Some(ServerVersion::new(4, 3, 0)));
        assert_eq!(ServerVersion::parse("4"), Some(ServerVersion::new(4, 0, 0)));
        assert_eq!(ServerVersion::parse("x"), None);
        let v310 = ServerVersion::new(3, 10, 8);
        assert!(v310.counts_nack() && !v310.has_default_delivery_limit());
        assert!(!v310.has_consumer_timeout_argument());
        let v40 = ServerVersion::new(4, 0, 9);
        assert!(v40.counts_nack() && v40.has_default_delivery_limit());
        let v43 = ServerVersion::new(4, 3, 0);
        assert!(!v43.counts_nack() && v43.has_consumer_timeout_argument());
    }
}
