//! twice: message handlers whose effects happen once, although the broker delivers at least
//! once.
//!
//! This crate holds the vocabulary shared by every part of twice: messages and their ids, the
//! [`Transport`](transport::Transport) a broker offers, and the one [`clock`]. It depends on no
//! database driver and no broker client.

pub mod clock;
pub mod ids;
pub mod message;
pub mod transport;

pub use clock::{Clock, ManualClock, SharedClock, SystemClock, Timestamp};
pub use ids::{LockToken, MessageId, SequenceNumber, SessionId};
pub use message::{Message, MessageState, Properties, ReceivedMessage, Value};
pub use transport::{
    DeadLetterReason, Delivery, EntityInfo, SessionReceiver, SessionTransport, Transport,
    TransportError,
};
