//! Replies: what a command's caller gets back, and the replies the runtime holds until the
//! commit they depend on is durable.

use std::sync::Arc;

use bytes::Bytes;
use tokio::sync::oneshot;
use twice::{LockToken, Message, ReceivedMessage};

use crate::engine::{self, AcceptedSession, Record};
use crate::error::Error;
use crate::storage;

/// Messages handed to a caller to drop. The broker lets go of a message on its own task
/// (completed, expired, deleted), but the message was allocated by the caller that sent it:
/// freeing it there is cheaper, and takes the work off the broker's one thread.
pub(crate) type Freed = Vec<Arc<Message>>;

/// What the caller of a command gets back.
#[derive(Debug)]
pub(crate) struct Answer<T> {
    pub(crate) result: Result<T, Error>,
    /// Memory for the caller to free (see [`Freed`]).
    pub(crate) freed: Freed,
}

/// The reply channel of one command.
#[derive(Debug)]
pub(crate) struct Reply<T>(oneshot::Sender<Answer<T>>);

impl<T> Reply<T> {
    /// A reply channel and the receiver its caller waits on.
    pub(crate) fn channel() -> (Self, oneshot::Receiver<Answer<T>>) {
        let (tx, rx) = oneshot::channel();
        (Reply(tx), rx)
    }

    /// Sends the result; gives it back if the caller is gone.
    pub(crate) fn send(self, result: Result<T, Error>) -> Result<(), Result<T, Error>> {
        self.send_freeing(result, &mut Vec::new())
    }

    /// Sends the result with `freed` for the caller to drop; when the caller is gone, gives
    /// back the result and leaves `freed` for the next reply.
    pub(super) fn send_freeing(
        self,
        result: Result<T, Error>,
        freed: &mut Freed,
    ) -> Result<(), Result<T, Error>> {
        let answer = Answer { result, freed: std::mem::take(freed) };
        self.0.send(answer).map_err(|a| {
            *freed = a.freed;
            a.result
        })
    }
}

/// The most freed messages the broker holds for its callers: past it (with no reply going out
/// for long) it drops them itself.
pub(super) const MAX_FREED: usize = 1 << 16;
/// A delivered (or peeked) message on its way to the caller, who turns it into a
/// [`ReceivedMessage`] with [`Delivered::into_received`].
#[derive(Debug)]
pub(crate) struct Delivered {
    pub(super) body: DeliveredBody,
    pub(super) meta: engine::DeliveryMeta,
}

#[derive(Debug)]
pub(super) enum DeliveredBody {
    /// The message, shared with the broker.
    Message(Arc<Message>),
    /// The encoded log record that carries the message.
    Record { record: Bytes, location: storage::Location },
}

impl Delivered {
    /// The lock of this delivery, if it has one.
    pub(crate) fn lock_token(&self) -> Option<LockToken> {
        self.meta.lock_token
    }

    /// The message as the `twice` vocabulary has it (see [`engine::received_message`]).
    pub(crate) fn into_received(self) -> Result<ReceivedMessage, Error> {
        match self.body {
            DeliveredBody::Message(m) => Ok(engine::received_message(&m, &self.meta)),
            DeliveredBody::Record { record, location } => {
                let m = decode(&record, location)?.into_message().ok_or_else(|| {
                    Error::Corrupt(format!(
                        "the log record at segment {} offset {} carries no message",
                        location.segment, location.offset
                    ))
                })?;
                Ok(engine::received_message_owned(m, &self.meta))
            }
        }
    }
}

/// A reply held until its turn's commit is durable.
#[derive(Debug)]
pub(super) enum Done {
    /// A reply with nothing to undo if its caller is gone.
    Plain(Box<dyn PlainReply>),
    /// Messages locked for a caller: released if the caller is gone.
    Deliveries {
        reply: Reply<Vec<Delivered>>,
        result: Result<Vec<Delivered>, Error>,
        /// With relaxed delivery counts, the commit the reply waits for (instead of its
        /// turn's): the last one that changed the delivered messages before this delivery.
        after: Option<u64>,
    },
    /// A session locked for a caller: released if the caller is gone.
    Session {
        reply: Reply<Option<AcceptedSession>>,
        result: Result<Option<AcceptedSession>, Error>,
    },
}

/// A typed reply, boxed so that one queue holds the replies of every command.
pub(super) trait PlainReply: Send + std::fmt::Debug {
    fn send(self: Box<Self>, freed: &mut Freed);
    fn fail(self: Box<Self>, e: Error);
}

#[derive(Debug)]
struct Pending<T>(Reply<T>, Result<T, Error>);

impl<T: Send + std::fmt::Debug + 'static> PlainReply for Pending<T> {
    fn send(self: Box<Self>, freed: &mut Freed) {
        // The caller may have gone; what it asked for is done either way.
        let _ = self.0.send_freeing(self.1, freed);
    }

    fn fail(self: Box<Self>, e: Error) {
        let _ = self.0.send(Err(e));
    }
}

pub(super) fn plain<T: Send + std::fmt::Debug + 'static>(
    reply: Reply<T>,
    result: Result<T, Error>,
) -> Done {
    Done::Plain(Box::new(Pending(reply, result)))
}

/// Decodes a log record (a delivery's record is decoded by its caller, see
/// [`Delivered::into_received`]).
pub(super) fn decode(bytes: &[u8], loc: storage::Location) -> Result<Record, Error> {
    postcard::from_bytes(bytes).map_err(|e| {
        Error::Corrupt(format!(
            "the log record at segment {} offset {} cannot be decoded: {e}",
            loc.segment, loc.offset
        ))
    })
}
