//! The `$management` operations: their wire names, the claim each needs, and their request
//! and reply bodies, encoded by the client and parsed by the server (and back for replies).

use bytes::Bytes;
use twice::{LockToken, SequenceNumber, SessionId, Timestamp};

use super::envelope::Request;
use super::settle::Settle;
use crate::codec::{Array, Value, code};
use crate::sas::Claim;

macro_rules! operations {
    ($($(#[$doc:meta])* $variant:ident = $name:literal, $claim:ident;)*) => {
        /// A `$management` operation.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        #[non_exhaustive]
        pub enum Operation {
            $($(#[$doc])* $variant,)*
        }

        impl Operation {
            /// Every operation, for tables and tests.
            pub const ALL: &'static [Operation] = &[$(Operation::$variant,)*];

            /// The operation's name on the wire (the `operation` application property).
            pub const fn name(self) -> &'static str {
                match self {
                    $(Operation::$variant => $name,)*
                }
            }

            /// The claim a token needs for it: scheduling is sending, rules are managing, the
            /// rest (peek, locks, settlement, deferred messages, sessions) is listening.
            pub const fn claim(self) -> Claim {
                match self {
                    $(Operation::$variant => Claim::$claim,)*
                }
            }
        }
    };
}

operations! {
    /// Renews message locks.
    RenewLock = "com.microsoft:renew-lock", Listen;
    /// Settles locked messages by lock token.
    UpdateDisposition = "com.microsoft:update-disposition", Listen;
    /// Reads messages without locking them.
    PeekMessage = "com.microsoft:peek-message", Listen;
    /// Schedules messages.
    ScheduleMessage = "com.microsoft:schedule-message", Send;
    /// Cancels scheduled messages.
    CancelScheduledMessage = "com.microsoft:cancel-scheduled-message", Send;
    /// Receives deferred messages by sequence number.
    ReceiveBySequenceNumber = "com.microsoft:receive-by-sequence-number", Listen;
    /// Renews a session lock.
    RenewSessionLock = "com.microsoft:renew-session-lock", Listen;
    /// Reads a session's state.
    GetSessionState = "com.microsoft:get-session-state", Listen;
    /// Sets (or clears) a session's state.
    SetSessionState = "com.microsoft:set-session-state", Listen;
    /// Lists the sessions with messages.
    GetMessageSessions = "com.microsoft:get-message-sessions", Listen;
    /// Adds a rule to a subscription.
    AddRule = "com.microsoft:add-rule", Manage;
    /// Removes a rule.
    RemoveRule = "com.microsoft:remove-rule", Manage;
    /// Lists a subscription's rules.
    EnumerateRules = "com.microsoft:enumerate-rules", Manage;
}

impl Operation {
    /// The operation a name names, if twice knows it.
    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.iter().copied().find(|o| o.name() == name)
    }
}

impl std::fmt::Display for Operation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Why a request cannot be run.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    /// The operation is not one twice knows.
    #[error("operation '{0}' is not supported")]
    Unsupported(String),
    /// The body lacks a field, or holds one of the wrong type.
    #[error("{0}")]
    Invalid(String),
}

/// A message to schedule, with the ids the request names beside it.
#[derive(Clone, Debug, PartialEq)]
pub struct Scheduled {
    /// The encoded AMQP message.
    pub message: Bytes,
    /// `message-id`.
    pub message_id: Option<String>,
    /// `session-id`.
    pub session_id: Option<String>,
    /// `partition-key`.
    pub partition_key: Option<String>,
}

/// A `$management` request with its body.
#[derive(Clone, Debug, PartialEq)]
pub enum ManagementRequest {
    /// `renew-lock`.
    RenewLock {
        /// The locks.
        lock_tokens: Vec<LockToken>,
    },
    /// `update-disposition`.
    UpdateDisposition {
        /// The locks.
        lock_tokens: Vec<LockToken>,
        /// How they are settled.
        settle: Settle,
        /// The session they belong to.
        session_id: Option<SessionId>,
    },
    /// `peek-message`.
    PeekMessage {
        /// The first sequence number (default 1).
        from: i64,
        /// How many (default 1).
        count: i64,
        /// Only this session's messages.
        session_id: Option<SessionId>,
    },
    /// `schedule-message`.
    ScheduleMessage {
        /// The messages.
        messages: Vec<Scheduled>,
    },
    /// `cancel-scheduled-message`.
    CancelScheduledMessage {
        /// The scheduled messages.
        sequence_numbers: Vec<SequenceNumber>,
    },
    /// `receive-by-sequence-number`.
    ReceiveBySequenceNumber {
        /// The deferred messages.
        sequence_numbers: Vec<SequenceNumber>,
        /// Remove them at once instead of locking them (`receiver-settle-mode` 0).
        receive_and_delete: bool,
        /// The session they belong to.
        session_id: Option<SessionId>,
    },
    /// `renew-session-lock`.
    RenewSessionLock {
        /// The session.
        session_id: SessionId,
    },
    /// `get-session-state`.
    GetSessionState {
        /// The session.
        session_id: SessionId,
    },
    /// `set-session-state`.
    SetSessionState {
        /// The session.
        session_id: SessionId,
        /// The new state; `None` clears it.
        state: Option<Bytes>,
    },
    /// `get-message-sessions`.
    GetMessageSessions {
        /// How many to skip (default 0).
        skip: i64,
        /// How many at most (default 100).
        top: i64,
    },
    /// `add-rule`.
    AddRule {
        /// `rule-name`.
        name: String,
        /// `rule-description`: a map with `sql-filter` or `correlation-filter`, and
        /// `sql-rule-action`.
        description: Value,
    },
    /// `remove-rule`.
    RemoveRule {
        /// `rule-name`.
        name: String,
    },
    /// `enumerate-rules`.
    EnumerateRules {
        /// How many to skip (default 0).
        skip: i64,
        /// How many at most (default 100).
        top: i64,
    },
}

impl ManagementRequest {
    /// The operation.
    pub fn operation(&self) -> Operation {
        match self {
            ManagementRequest::RenewLock { .. } => Operation::RenewLock,
            ManagementRequest::UpdateDisposition { .. } => Operation::UpdateDisposition,
            ManagementRequest::PeekMessage { .. } => Operation::PeekMessage,
            ManagementRequest::ScheduleMessage { .. } => Operation::ScheduleMessage,
            ManagementRequest::CancelScheduledMessage { .. } => Operation::CancelScheduledMessage,
            ManagementRequest::ReceiveBySequenceNumber { .. } => Operation::ReceiveBySequenceNumber,
            ManagementRequest::RenewSessionLock { .. } => Operation::RenewSessionLock,
            ManagementRequest::GetSessionState { .. } => Operation::GetSessionState,
            ManagementRequest::SetSessionState { .. } => Operation::SetSessionState,
            ManagementRequest::GetMessageSessions { .. } => Operation::GetMessageSessions,
            ManagementRequest::AddRule { .. } => Operation::AddRule,
            ManagementRequest::RemoveRule { .. } => Operation::RemoveRule,
            ManagementRequest::EnumerateRules { .. } => Operation::EnumerateRules,
        }
    }

    /// The request message (without message-id and reply-to, which the sender sets).
    pub fn to_request(&self) -> Request {
        Request::new(self.operation().name(), self.body())
    }

    /// The `amqp-value` body.
    pub fn body(&self) -> Value {
        use ManagementRequest as R;
        let mut b: Vec<(Value, Value)> = Vec::new();
        let mut put = |k: &str, v: Value| b.push((Value::string(k), v));
        let session = |s: &Option<SessionId>| s.as_ref().map(|s| Value::string(s.as_str()));
        match self {
            R::RenewLock { lock_tokens } => put("lock-tokens", uuid_array(lock_tokens)),
            R::UpdateDisposition { lock_tokens, settle, session_id } => {
                for (k, v) in settle.to_disposition() {
                    b.push((k, v));
                }
                b.push((Value::string("lock-tokens"), uuid_array(lock_tokens)));
                if let Some(s) = session(session_id) {
                    b.push((Value::string("session-id"), s));
                }
            }
            R::PeekMessage { from, count, session_id } => {
                put("from-sequence-number", Value::Long(*from));
                put("message-count", Value::Int(i32::try_from(*count).unwrap_or(i32::MAX)));
                if let Some(s) = session(session_id) {
                    put("session-id", s);
                }
            }
            R::ScheduleMessage { messages } => {
                put("messages", Value::List(messages.iter().map(scheduled_value).collect()))
            }
            R::CancelScheduledMessage { sequence_numbers } => {
                put("sequence-numbers", long_array(sequence_numbers))
            }
            R::ReceiveBySequenceNumber { sequence_numbers, receive_and_delete, session_id } => {
                put("sequence-numbers", long_array(sequence_numbers));
                put("receiver-settle-mode", Value::Uint(if *receive_and_delete { 0 } else { 1 }));
                if let Some(s) = session(session_id) {
                    put("session-id", s);
                }
            }
            R::RenewSessionLock { session_id } | R::GetSessionState { session_id } => {
                put("session-id", Value::string(session_id.as_str()))
            }
            R::SetSessionState { session_id, state } => {
                put("session-state", state.clone().map_or(Value::Null, Value::Binary));
                put("session-id", Value::string(session_id.as_str()));
            }
            R::GetMessageSessions { skip, top } | R::EnumerateRules { skip, top } => {
                put("skip", Value::Int(i32::try_from(*skip).unwrap_or(i32::MAX)));
                put("top", Value::Int(i32::try_from(*top).unwrap_or(i32::MAX)));
            }
            R::AddRule { name, description } => {
                put("rule-name", Value::string(name.clone()));
                put("rule-description", description.clone());
            }
            R::RemoveRule { name } => put("rule-name", Value::string(name.clone())),
        }
        Value::Map(b)
    }

    /// Parses a request: its operation and body.
    pub fn parse(req: &Request) -> Result<Self, RequestError> {
        let name = req.operation().unwrap_or("");
        let op = Operation::parse(name).ok_or_else(|| RequestError::Unsupported(name.into()))?;
        Self::parse_body(op, &req.body)
    }

    /// Parses the body of an `op` request.
    pub fn parse_body(op: Operation, body: &Value) -> Result<Self, RequestError> {
        use ManagementRequest as R;
        let session_id = || text(body, "session-id").map(SessionId::new);
        let required_session =
            || session_id().ok_or_else(|| RequestError::Invalid("'session-id' is missing".into()));
        Ok(match op {
            Operation::RenewLock => R::RenewLock { lock_tokens: uuids(body, "lock-tokens")? },
            Operation::UpdateDisposition => {
                let settle = Settle::from_disposition(body).map_err(RequestError::Invalid)?;
                R::UpdateDisposition {
                    settle,
                    lock_tokens: uuids(body, "lock-tokens")?,
                    session_id: session_id(),
                }
            }
            Operation::PeekMessage => R::PeekMessage {
                from: int(body, "from-sequence-number").unwrap_or(1),
                count: int(body, "message-count").unwrap_or(1),
                session_id: session_id(),
            },
            Operation::ScheduleMessage => {
                let items = body
                    .get("messages")
                    .and_then(Value::as_seq)
                    .ok_or_else(|| invalid("'messages' is missing"))?;
                R::ScheduleMessage {
                    messages: items.iter().map(scheduled_of).collect::<Result<_, _>>()?,
                }
            }
            Operation::CancelScheduledMessage => {
                R::CancelScheduledMessage { sequence_numbers: longs(body, "sequence-numbers")? }
            }
            Operation::ReceiveBySequenceNumber => R::ReceiveBySequenceNumber {
                sequence_numbers: longs(body, "sequence-numbers")?,
                receive_and_delete: int(body, "receiver-settle-mode") == Some(0),
                session_id: session_id(),
            },
            Operation::RenewSessionLock => R::RenewSessionLock { session_id: required_session()? },
            Operation::GetSessionState => R::GetSessionState { session_id: required_session()? },
            Operation::SetSessionState => {
                let session_id = required_session()?;
                let state = match body.get("session-state") {
                    Some(Value::Binary(b)) => Some(b.clone()),
                    Some(Value::Null) | None => None,
                    Some(_) => return Err(invalid("'session-state' must be binary")),
                };
                R::SetSessionState { session_id, state }
            }
            Operation::GetMessageSessions => R::GetMessageSessions {
                skip: int(body, "skip").unwrap_or(0),
                top: int(body, "top").unwrap_or(100),
            },
            Operation::AddRule => R::AddRule {
                name: rule_name(body)?,
                description: body
                    .get("rule-description")
                    .cloned()
                    .ok_or_else(|| invalid("'rule-description' is missing"))?,
            },
            Operation::RemoveRule => R::RemoveRule { name: rule_name(body)? },
            Operation::EnumerateRules => R::EnumerateRules {
                skip: int(body, "skip").unwrap_or(0),
                top: int(body, "top").unwrap_or(100),
            },
        })
    }
}

/// A message in a `peek-message` or `receive-by-sequence-number` reply.
#[derive(Clone, Debug, PartialEq)]
pub struct ReplyMessage {
    /// The lock token of a message received locked.
    pub lock_token: Option<LockToken>,
    /// The encoded AMQP message.
    pub message: Bytes,
}

/// The body of a successful `$management` reply.
#[derive(Clone, Debug, PartialEq)]
pub enum ManagementReply {
    /// Nothing (an empty map).
    Empty,
    /// `renew-lock`: the new expiry of each lock.
    Expirations(Vec<Timestamp>),
    /// `peek-message`, `receive-by-sequence-number`.
    Messages(Vec<ReplyMessage>),
    /// `schedule-message`: the sequence numbers given.
    SequenceNumbers(Vec<SequenceNumber>),
    /// `renew-session-lock`: the new expiry.
    Expiration(Timestamp),
    /// `get-session-state`.
    SessionState(Option<Bytes>),
    /// `get-message-sessions`.
    Sessions {
        /// How many were skipped.
        skip: i64,
        /// The sessions.
        ids: Vec<SessionId>,
    },
    /// `enumerate-rules`: each rule as a described `rule-description`.
    Rules(Vec<Value>),
}

impl ManagementReply {
    /// The `amqp-value` body.
    pub fn to_value(&self) -> Value {
        let one = |k: &str, v: Value| Value::Map(vec![(Value::string(k), v)]);
        match self {
            ManagementReply::Empty => Value::Map(vec![]),
            ManagementReply::Expirations(t) => {
                one("expirations", Value::timestamp_array(t.iter().map(|t| t.as_millis())))
            }
            ManagementReply::Messages(items) => {
                one("messages", Value::List(items.iter().map(reply_message_value).collect()))
            }
            ManagementReply::SequenceNumbers(s) => {
                one("sequence-numbers", Value::long_array(s.iter().map(|s| s.get())))
            }
            ManagementReply::Expiration(t) => one("expiration", Value::Timestamp(t.as_millis())),
            ManagementReply::SessionState(s) => {
                one("session-state", s.clone().map_or(Value::Null, Value::Binary))
            }
            ManagementReply::Sessions { skip, ids } => Value::Map(vec![
                (Value::string("skip"), Value::Int(i32::try_from(*skip).unwrap_or(i32::MAX))),
                (
                    Value::string("sessions-ids"),
                    Value::string_array(ids.iter().map(|s| s.as_str().to_owned())),
                ),
            ]),
            ManagementReply::Rules(r) => one("rules", Value::List(r.clone())),
        }
    }

    /// Parses the body of a successful reply to `op`; an empty body (no messages, no
    /// sessions) is an empty list. Entries it cannot read are left out.
    pub fn parse(op: Operation, body: &Value) -> Result<Self, RequestError> {
        let seq = |k: &str| body.get(k).and_then(Value::as_seq).unwrap_or(&[]);
        Ok(match op {
            Operation::RenewLock => ManagementReply::Expirations(
                seq("expirations").iter().filter_map(timestamp).collect(),
            ),
            Operation::PeekMessage | Operation::ReceiveBySequenceNumber => {
                ManagementReply::Messages(
                    seq("messages").iter().filter_map(reply_message_of).collect(),
                )
            }
            Operation::ScheduleMessage => ManagementReply::SequenceNumbers(
                seq("sequence-numbers")
                    .iter()
                    .filter_map(Value::as_i64)
                    .map(SequenceNumber::new)
                    .collect(),
            ),
            Operation::RenewSessionLock => ManagementReply::Expiration(
                body.get("expiration")
                    .and_then(timestamp)
                    .ok_or_else(|| invalid("renew-session-lock reply without an expiration"))?,
            ),
            Operation::GetSessionState => ManagementReply::SessionState(
                body.get("session-state").and_then(Value::as_binary).cloned(),
            ),
            Operation::GetMessageSessions => ManagementReply::Sessions {
                skip: int(body, "skip").unwrap_or(0),
                ids: seq("sessions-ids")
                    .iter()
                    .filter_map(Value::as_str)
                    .map(SessionId::new)
                    .collect(),
            },
            Operation::EnumerateRules => ManagementReply::Rules(seq("rules").to_vec()),
            Operation::UpdateDisposition
            | Operation::CancelScheduledMessage
            | Operation::SetSessionState
            | Operation::AddRule
            | Operation::RemoveRule => ManagementReply::Empty,
        })
    }
}

fn invalid(description: &str) -> RequestError {
    RequestError::Invalid(description.to_owned())
}

fn text(body: &Value, key: &str) -> Option<String> {
    body.get(key).and_then(Value::as_str).map(str::to_owned)
}

fn int(body: &Value, key: &str) -> Option<i64> {
    body.get(key).and_then(Value::as_i64)
}

fn timestamp(v: &Value) -> Option<Timestamp> {
    match v {
        Value::Timestamp(t) => Some(Timestamp::from_millis(*t)),
        _ => None,
    }
}

fn rule_name(body: &Value) -> Result<String, RequestError> {
    text(body, "rule-name").ok_or_else(|| invalid("'rule-name' is missing"))
}

fn uuid_array(tokens: &[LockToken]) -> Value {
    Value::Array(Array::new(code::UUID, tokens.iter().map(|t| Value::Uuid(*t.as_uuid())).collect()))
}

fn long_array(seqs: &[SequenceNumber]) -> Value {
    Value::long_array(seqs.iter().map(|s| s.get()))
}

fn uuids(body: &Value, key: &str) -> Result<Vec<LockToken>, RequestError> {
    let items = body
        .get(key)
        .and_then(Value::as_seq)
        .ok_or_else(|| RequestError::Invalid(format!("'{key}' is missing")))?;
    items
        .iter()
        .map(|v| match v {
            Value::Uuid(u) => Ok(LockToken::from_uuid(*u)),
            _ => Err(RequestError::Invalid(format!("'{key}' must hold uuids"))),
        })
        .collect()
}

fn longs(body: &Value, key: &str) -> Result<Vec<SequenceNumber>, RequestError> {
    let items = body
        .get(key)
        .and_then(Value::as_seq)
        .ok_or_else(|| RequestError::Invalid(format!("'{key}' is missing")))?;
    items
        .iter()
        .map(|v| {
            v.as_i64()
                .map(SequenceNumber::new)
                .ok_or_else(|| RequestError::Invalid(format!("'{key}' must hold longs")))
        })
        .collect()
}

fn scheduled_value(m: &Scheduled) -> Value {
    let mut entry = vec![(
        Value::string("message-id"),
        m.message_id.clone().map_or(Value::Null, Value::String),
    )];
    if let Some(sid) = &m.session_id {
        entry.push((Value::string("session-id"), Value::string(sid.clone())));
    }
    if let Some(pk) = &m.partition_key {
        entry.push((Value::string("partition-key"), Value::string(pk.clone())));
    }
    entry.push((Value::string("message"), Value::Binary(m.message.clone())));
    Value::Map(entry)
}

fn scheduled_of(item: &Value) -> Result<Scheduled, RequestError> {
    let message = item
        .get("message")
        .and_then(Value::as_binary)
        .cloned()
        .ok_or_else(|| invalid("a scheduled message has no 'message'"))?;
    Ok(Scheduled {
        message,
        message_id: text(item, "message-id"),
        session_id: text(item, "session-id"),
        partition_key: text(item, "partition-key"),
    })
}

fn reply_message_value(m: &ReplyMessage) -> Value {
    let mut entry = Vec::new();
    if let Some(lock) = m.lock_token {
        entry.push((Value::string("lock-token"), Value::Uuid(*lock.as_uuid())));
    }
    entry.push((Value::string("message"), Value::Binary(m.message.clone())));
    Value::Map(entry)
}

fn reply_message_of(item: &Value) -> Option<ReplyMessage> {
    let message = item.get("message").and_then(Value::as_binary)?.clone();
    let lock_token = match item.get("lock-token") {
        Some(Value::Uuid(u)) => Some(LockToken::from_uuid(*u)),
        _ => None,
    };
    Some(ReplyMessage { lock_token, message })
}
