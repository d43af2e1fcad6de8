//! The Service Bus vocabulary over AMQP, one for twice's server and its client: the error
//! conditions ([`Condition`]), the `$management` and `$cbs` request/reply envelope
//! ([`Request`], [`Reply`]), the `$management` operations with their bodies
//! ([`Operation`], [`ManagementRequest`], [`ManagementReply`]), and settlement as an outcome
//! and as a disposition ([`Settle`]).
//!
//! ```
//! use twice_amqp::servicebus::{ManagementRequest, Operation, Request};
//! use twice::LockToken;
//!
//! let sent = ManagementRequest::RenewLock { lock_tokens: vec![LockToken::random()] };
//! let bytes = sent.to_request().encode();
//! let received = ManagementRequest::parse(&Request::parse(&bytes)?).unwrap();
//! assert_eq!(received.operation(), Operation::RenewLock);
//! assert_eq!(received, sent);
//! # Ok::<(), twice_amqp::codec::DecodeError>(())
//! ```

mod condition;
mod envelope;
mod operation;
mod settle;

pub use condition::{
    Condition, LOCKED_UNTIL_UTC, SERVER_TIMEOUT, SESSION_FILTER, TIMEOUT_PROPERTY,
};
pub use envelope::{OPERATION, Reply, Request, StatusKeys};
pub use operation::{
    ManagementReply, ManagementRequest, Operation, ReplyMessage, RequestError, Scheduled,
};
pub use settle::{Settle, properties_map};
