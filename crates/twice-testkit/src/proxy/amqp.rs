//! A RabbitMQ of another version, made from the machine's: a [`Rewrite`] of AMQP 0-9-1 frames
//! that shows the client the semantics of a newer server where they differ from the one that
//! runs here (3.10). Only RabbitMQ 3.10 runs on these machines; this is how the transport's
//! answers to 4.0 and 4.3 are tested, and it is an emulation of the documented differences,
//! not the newer server:
//!
//! - the version in `connection.start`'s `server-properties` is the one given;
//! - 4.0 and later ([`Emulation::default_delivery_limit`]): a quorum queue declared without
//!   `x-delivery-limit` gets RabbitMQ 4.0's default of 20, and `-1` (4.0's "no limit") is
//!   removed, which on 3.10 means no limit;
//! - 4.3 and later ([`Emulation::nack_does_not_count`]): a requeueing `basic.nack` no longer
//!   counts a delivery, so no delivery carries `x-delivery-count` and no declared
//!   `x-delivery-limit` reaches the server (which would count those returns). This hides the
//!   server's counting entirely, as 4.3 does for every return the transport makes.

use amq_protocol::frame::{AMQPFrame, gen_frame, parse_frame};
use amq_protocol::protocol::{AMQPClass, connection, queue};
use amq_protocol::types::{AMQPValue, FieldTable, LongString};

use super::{Flow, Rewrite};

/// The differences of a newer RabbitMQ that the proxy shows.
#[derive(Clone, Debug)]
pub struct Emulation {
    version: String,
    default_delivery_limit: bool,
    nack_does_not_count: bool,
}

impl Emulation {
    /// RabbitMQ 4.0: the version, and quorum queues' default delivery limit of 20.
    pub fn v4_0() -> Self {
        Self { version: "4.0.9".into(), default_delivery_limit: true, nack_does_not_count: false }
    }

    /// RabbitMQ 4.3: as 4.0, and a requeueing `basic.nack` that no longer counts a delivery.
    pub fn v4_3() -> Self {
        Self { version: "4.3.0".into(), default_delivery_limit: true, nack_does_not_count: true }
    }

    /// The version the server announces.
    pub fn version(&self) -> &str {
        &self.version
    }

    /// Whether quorum queues get 4.0's default delivery limit.
    pub fn default_delivery_limit(&self) -> bool {
        self.default_delivery_limit
    }

    /// Whether requeueing nacks go uncounted (4.3).
    pub fn nack_does_not_count(&self) -> bool {
        self.nack_does_not_count
    }

    /// The rewrite of one connection.
    pub fn rewrite(&self) -> Box<dyn Rewrite> {
        Box::new(AmqpRewrite {
            emulation: self.clone(),
            to_server: Framer { header_left: 8, buffer: Vec::new() },
            to_client: Framer { header_left: 0, buffer: Vec::new() },
        })
    }
}

/// Splits one direction of a connection into frames.
struct Framer {
    /// Bytes of the protocol header still to pass (the client's first 8 bytes).
    header_left: usize,
    buffer: Vec<u8>,
}

impl Framer {
    /// Takes `bytes` and calls `frame` with each whole frame, appending the results to `out`.
    fn feed(
        &mut self,
        bytes: &[u8],
        out: &mut Vec<u8>,
        mut frame: impl FnMut(&[u8], &mut Vec<u8>),
    ) {
        let mut bytes = bytes;
        if self.header_left > 0 {
            let n = self.header_left.min(bytes.len());
            out.extend_from_slice(&bytes[..n]);
            self.header_left -= n;
            bytes = &bytes[n..];
        }
        self.buffer.extend_from_slice(bytes);
        let mut start = 0;
        loop {
            let rest = &self.buffer[start..];
            if rest.len() < 7 {
                break;
            }
            let size = u32::from_be_bytes([rest[3], rest[4], rest[5], rest[6]]) as usize;
            let whole = 7 + size + 1;
            if rest.len() < whole {
                break;
            }
            frame(&rest[..whole], out);
            start += whole;
        }
        self.buffer.drain(..start);
    }
}

struct AmqpRewrite {
    emulation: Emulation,
    to_server: Framer,
    to_client: Framer,
}

/// `frame` as it is, or re-encoded after `change` changed it.
fn rewrite_frame(raw: &[u8], out: &mut Vec<u8>, change: impl FnOnce(&mut AMQPFrame) -> bool) {
    let Ok((_, mut frame)) = parse_frame(raw) else {
        out.extend_from_slice(raw);
        return;
    };
    if !change(&mut frame) {
        out.extend_from_slice(raw);
        return;
    }
    match cookie_factory::r#gen(gen_frame(&frame), Vec::new()) {
        Ok((bytes, _)) => out.extend_from_slice(&bytes),
        Err(_) => out.extend_from_slice(raw),
    }
}

impl Rewrite for AmqpRewrite {
    fn to_server(&mut self, bytes: &[u8], out: &mut Vec<u8>) -> Flow {
        let emulation = self.emulation.clone();
        self.to_server.feed(bytes, out, |raw, out| {
            rewrite_frame(raw, out, |frame| {
                let AMQPFrame::Method(_, AMQPClass::Queue(queue::AMQPMethod::Declare(d))) = frame
                else {
                    return false;
                };
                declare(&emulation, &mut d.arguments)
            });
        });
        Flow::Continue
    }

    fn to_client(&mut self, bytes: &[u8], out: &mut Vec<u8>) -> Flow {
        let emulation = self.emulation.clone();
        self.to_client.feed(bytes, out, |raw, out| {
            rewrite_frame(raw, out, |frame| match frame {
                AMQPFrame::Method(
                    _,
                    AMQPClass::Connection(connection::AMQPMethod::Start(start)),
                ) => {
                    start.server_properties.insert(
                        "version".into(),
                        AMQPValue::LongString(LongString::from(emulation.version.as_str())),
                    );
                    true
                }
                AMQPFrame::Header(_, header) if emulation.nack_does_not_count => {
                    let Some(headers) = header.properties.headers().clone() else {
                        return false;
                    };
                    if !headers.inner().contains_key("x-delivery-count") {
                        return false;
                    }
                    let mut kept = FieldTable::default();
                    for (k, v) in &headers {
                        if k.as_str() != "x-delivery-count" {
                            kept.insert(k.clone(), v.clone());
                        }
                    }
                    header.properties = header.properties.clone().with_headers(kept);
                    true
                }
                _ => false,
            });
        });
        Flow::Continue
    }
}

/// The arguments of a queue declaration as the emulated server takes them.
fn declare(emulation: &Emulation, arguments: &mut FieldTable) -> bool {
    let quorum = arguments.inner().get("x-queue-type").is_some_and(|t| match t {
        AMQPValue::LongString(s) => s.as_bytes() == b"quorum",
        AMQPValue::ShortString(s) => s.as_str() == "quorum",
        _ => false,
    });
    if !quorum {
        return false;
    }
    let limit = arguments.inner().get("x-delivery-limit").and_then(integer);
    let mut kept = FieldTable::default();
    for (k, v) in arguments.inner() {
        if k.as_str() != "x-delivery-limit" {
            kept.insert(k.clone(), v.clone());
        }
    }
    let server_limit = if emulation.nack_does_not_count {
        // The server counts no return the transport makes: no limit is ever reached.
        None
    } else {
        match limit {
            Some(n) if n < 0 => None,
            Some(n) => Some(n),
            None if emulation.default_delivery_limit => Some(20),
            None => None,
        }
    };
    if let Some(n) = server_limit {
        kept.insert("x-delivery-limit".into(), AMQPValue::LongLongInt(n));
    }
    *arguments = kept;
    true
}

fn integer(v: &AMQPValue) -> Option<i64> {
    match v {
        AMQPValue::ShortShortInt(n) => Some(i64::from(*n)),
        AMQPValue::ShortShortUInt(n) => Some(i64::from(*n)),
        AMQPValue::ShortInt(n) => Some(i64::from(*n)),
        AMQPValue::ShortUInt(n) => Some(i64::from(*n)),
        AMQPValue::LongInt(n) => Some(i64::from(*n)),
        AMQPValue::LongUInt(n) => Some(i64::from(*n)),
        AMQPValue::LongLongInt(n) => Some(*n),
        _ => None,
    }
}
