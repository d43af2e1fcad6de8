//! The request/reply envelope of `$management` and `$cbs`: a message with `properties`
//! (`message-id` and `reply-to` on a request, `to` and `correlation-id` on a reply),
//! application properties (the operation; the status) and an `amqp-value` body.
//!
//! A reply carries `correlation-id` = the request's `message-id` with its AMQP type, and its
//! status as `statusCode` (int), `statusDescription` and `errorCondition` (symbol) on
//! `$management`, with dashes (`status-code`, …) on `$cbs`. A parser accepts both spellings.

use crate::codec::{DecodeError, Decoder, Value};
use crate::performative::described_list;

/// Descriptor of the `properties` section.
const PROPERTIES: u64 = 0x73;
/// Descriptor of the `application-properties` section.
const APPLICATION_PROPERTIES: u64 = 0x74;
/// Descriptor of the `amqp-value` section.
const AMQP_VALUE: u64 = 0x77;

/// The application property naming a request's operation.
pub const OPERATION: &str = "operation";

/// A request on `$management` or `$cbs`.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    /// `properties.message-id`, any AMQP type.
    pub message_id: Value,
    /// `properties.reply-to`.
    pub reply_to: Option<String>,
    /// Application properties (the operation first).
    pub properties: Vec<(Value, Value)>,
    /// The `amqp-value` body.
    pub body: Value,
}

impl Request {
    /// A request for `operation` with `body`; more application properties may follow.
    pub fn new(operation: &str, body: Value) -> Self {
        Self {
            message_id: Value::Null,
            reply_to: None,
            properties: vec![(Value::string(OPERATION), Value::string(operation))],
            body,
        }
    }

    /// Parses a request message.
    pub fn parse(payload: &[u8]) -> Result<Self, DecodeError> {
        let mut req = Request {
            message_id: Value::Null,
            reply_to: None,
            properties: Vec::new(),
            body: Value::Null,
        };
        let mut d = Decoder::new(payload);
        while !d.is_empty() {
            let v = d.value()?;
            match v.descriptor_code() {
                Some(PROPERTIES) => {
                    let f = v.undescribed().as_seq().unwrap_or(&[]);
                    req.message_id = f.first().cloned().unwrap_or(Value::Null);
                    req.reply_to = f.get(4).and_then(|r| r.as_str()).map(str::to_owned);
                }
                Some(APPLICATION_PROPERTIES) => {
                    req.properties = v.undescribed().as_map().map(<[_]>::to_vec).unwrap_or_default()
                }
                Some(AMQP_VALUE) => req.body = v.undescribed().clone(),
                _ => {}
            }
        }
        Ok(req)
    }

    /// The encoded message.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        described_list(
            PROPERTIES,
            vec![
                self.message_id.clone(),
                Value::Null,
                Value::Null,
                Value::Null,
                self.reply_to.clone().map_or(Value::Null, Value::String),
            ],
        )
        .encode(&mut out);
        Value::described(APPLICATION_PROPERTIES, Value::Map(self.properties.clone()))
            .encode(&mut out);
        Value::described(AMQP_VALUE, self.body.clone()).encode(&mut out);
        out
    }

    /// An application property.
    pub fn property(&self, key: &str) -> Option<&Value> {
        self.properties.iter().find(|(k, _)| k.as_str() == Some(key)).map(|(_, v)| v)
    }

    /// The `operation` application property.
    pub fn operation(&self) -> Option<&str> {
        self.property(OPERATION).and_then(Value::as_str)
    }
}

/// How a node spells the status properties of its replies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StatusKeys {
    /// `statusCode`, `statusDescription`, `errorCondition` (`$management`).
    Management,
    /// `status-code`, `status-description`, `error-condition` (`$cbs`).
    Cbs,
}

impl StatusKeys {
    fn names(self) -> [&'static str; 3] {
        match self {
            StatusKeys::Management => ["statusCode", "statusDescription", "errorCondition"],
            StatusKeys::Cbs => ["status-code", "status-description", "error-condition"],
        }
    }
}

/// A reply on `$management` or `$cbs`.
#[derive(Debug, Clone, PartialEq)]
pub struct Reply {
    /// `properties.to` (the request's reply-to).
    pub to: Option<String>,
    /// `properties.correlation-id` (the request's message-id).
    pub correlation_id: Value,
    /// The status, HTTP style: 2xx is success.
    pub status: i32,
    /// The status description.
    pub description: String,
    /// The error condition, if any.
    pub condition: Option<String>,
    /// The `amqp-value` body.
    pub body: Value,
    /// How the status properties are spelled.
    pub keys: StatusKeys,
}

impl Reply {
    /// A `$management` reply to `req` with a status and no body.
    pub fn to_request(req: &Request, status: i32, description: impl Into<String>) -> Self {
        Self {
            to: req.reply_to.clone(),
            correlation_id: req.message_id.clone(),
            status,
            description: description.into(),
            condition: None,
            body: Value::Null,
            keys: StatusKeys::Management,
        }
    }

    /// Whether the status is a success (2xx).
    pub fn is_success(&self) -> bool {
        (200..300).contains(&self.status)
    }

    /// The encoded message.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        described_list(
            PROPERTIES,
            vec![
                Value::Null,
                Value::Null,
                self.to.clone().map_or(Value::Null, Value::String),
                Value::Null,
                Value::Null,
                self.correlation_id.clone(),
            ],
        )
        .encode(&mut out);
        let [code, description, condition] = self.keys.names();
        let mut properties = vec![
            (Value::string(code), Value::Int(self.status)),
            (Value::string(description), Value::String(self.description.clone())),
        ];
        if let Some(c) = &self.condition {
            properties.push((Value::string(condition), Value::symbol(c.clone())));
        }
        Value::described(APPLICATION_PROPERTIES, Value::Map(properties)).encode(&mut out);
        Value::described(AMQP_VALUE, self.body.clone()).encode(&mut out);
        out
    }

    /// Parses a reply in either spelling; a status that is missing or not an int is 0.
    pub fn parse(payload: &[u8]) -> Result<Self, DecodeError> {
        let mut d = Decoder::new(payload);
        let (mut to, mut correlation_id) = (None, Value::Null);
        let (mut props, mut body) = (Value::Map(vec![]), Value::Null);
        while !d.is_empty() {
            let v = d.value()?;
            match v.descriptor_code() {
                Some(PROPERTIES) => {
                    let f = v.undescribed().as_seq().unwrap_or(&[]);
                    to = f.get(2).and_then(Value::as_str).map(str::to_owned);
                    correlation_id = f.get(5).cloned().unwrap_or(Value::Null);
                }
                Some(APPLICATION_PROPERTIES) => props = v.undescribed().clone(),
                Some(AMQP_VALUE) => body = v.undescribed().clone(),
                _ => {}
            }
        }
        let keys = if props.get("statusCode").is_some() || props.get("status-code").is_none() {
            StatusKeys::Management
        } else {
            StatusKeys::Cbs
        };
        let get = |i: usize| {
            let [a, b] = [StatusKeys::Management.names()[i], StatusKeys::Cbs.names()[i]];
            props.get(a).or_else(|| props.get(b))
        };
        Ok(Self {
            to,
            correlation_id,
            status: get(0).and_then(Value::as_i64).and_then(|s| i32::try_from(s).ok()).unwrap_or(0),
            description: get(1).and_then(Value::as_str).unwrap_or_default().to_owned(),
            condition: get(2).and_then(Value::as_str).map(str::to_owned),
            body,
            keys,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_and_its_reply_round_trip() {
        let mut req = Request::new("put-token", Value::string("token"));
        req.message_id = Value::Ulong(7);
        req.reply_to = Some("reply".into());
        req.properties.push((Value::string("name"), Value::string("sb://h/q")));
        let parsed = Request::parse(&req.encode()).unwrap();
        assert_eq!(parsed, req);
        assert_eq!(parsed.operation(), Some("put-token"));

        for keys in [StatusKeys::Management, StatusKeys::Cbs] {
            let mut reply = Reply::to_request(&parsed, 401, "no");
            reply.condition = Some("amqp:unauthorized-access".into());
            reply.keys = keys;
            let back = Reply::parse(&reply.encode()).unwrap();
            assert_eq!(back, reply);
            assert_eq!(back.correlation_id, Value::Ulong(7));
            assert!(!back.is_success());
        }
    }
}
