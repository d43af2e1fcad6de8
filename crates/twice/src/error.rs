//! Errors: what a handler raises, how the processor classifies it, and what the processor
//! reports.

use std::error::Error as StdError;
use std::fmt;
use std::time::Duration;

use crate::ids::MessageId;
use crate::transport::TransportError;

/// A boxed error that can cross tasks.
pub type BoxError = Box<dyn StdError + Send + Sync + 'static>;

/// How a handler's error is to be treated.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum HandlerErrorKind {
    /// Raised with `?` and not classified by the handler: the processor asks the inbox store
    /// ([`Inbox::classify`](crate::Inbox::classify)) whether it is the violation of a registered
    /// business key; otherwise it is treated as transient.
    Unclassified,
    /// Retrying may succeed: roll back and abandon (the broker dead-letters the message after
    /// MaxDeliveryCount deliveries).
    Transient,
    /// Retrying cannot succeed: roll back and dead-letter the message with this reason.
    Permanent {
        /// The dead-letter reason, e.g. `InvalidOrder`.
        reason: String,
    },
}

/// An error raised by a handler, with how it should be treated.
///
/// Any error converts into one with `?` (as [`HandlerErrorKind::Unclassified`]); use
/// [`HandlerError::transient`], [`HandlerError::permanent`] or [`ResultExt`] to say more. It
/// deliberately does not implement [`std::error::Error`], so that the blanket conversion from
/// every error type is possible (as with `anyhow::Error`).
pub struct HandlerError {
    kind: HandlerErrorKind,
    error: BoxError,
}

impl HandlerError {
    /// A transient error: roll back and abandon.
    pub fn transient(error: impl Into<BoxError>) -> Self {
        Self { kind: HandlerErrorKind::Transient, error: error.into() }
    }

    /// A permanent error: roll back and dead-letter with `reason`.
    pub fn permanent(reason: impl Into<String>, error: impl Into<BoxError>) -> Self {
        Self { kind: HandlerErrorKind::Permanent { reason: reason.into() }, error: error.into() }
    }

    /// An unclassified error (what `?` produces).
    pub fn unclassified(error: impl Into<BoxError>) -> Self {
        Self { kind: HandlerErrorKind::Unclassified, error: error.into() }
    }

    /// How the error is to be treated.
    pub fn kind(&self) -> &HandlerErrorKind {
        &self.kind
    }

    /// The underlying error.
    pub fn error(&self) -> &(dyn StdError + Send + Sync + 'static) {
        &*self.error
    }

    /// The underlying error, owned.
    pub fn into_error(self) -> BoxError {
        self.error
    }

    /// The error and its sources, joined with `: `; used as a dead-letter description.
    pub fn chain(&self) -> String {
        error_chain(&*self.error)
    }
}

impl<E> From<E> for HandlerError
where
    E: StdError + Send + Sync + 'static,
{
    fn from(error: E) -> Self {
        Self::unclassified(error)
    }
}

impl fmt::Debug for HandlerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HandlerError")
            .field("kind", &self.kind)
            .field("error", &self.error)
            .finish()
    }
}

impl fmt::Display for HandlerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.chain())
    }
}

/// Classifies a `Result`'s error for the processor.
pub trait ResultExt<T> {
    /// Marks the error as transient (roll back, abandon).
    fn transient(self) -> Result<T, HandlerError>;
    /// Marks the error as permanent (roll back, dead-letter with `reason`).
    fn permanent(self, reason: &str) -> Result<T, HandlerError>;
}

impl<T, E> ResultExt<T> for Result<T, E>
where
    E: Into<BoxError>,
{
    fn transient(self) -> Result<T, HandlerError> {
        self.map_err(HandlerError::transient)
    }

    fn permanent(self, reason: &str) -> Result<T, HandlerError> {
        self.map_err(|e| HandlerError::permanent(reason, e))
    }
}

/// What an inbox store makes of an error (see [`Inbox::classify`](crate::Inbox::classify)).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ErrorClass {
    /// The violation of a unique constraint registered as a business key: the same business
    /// event was already processed under another message id. Roll back and complete.
    BusinessKeyDuplicate {
        /// The constraint (or index) name.
        constraint: String,
    },
    /// Retrying may succeed (deadlock, serialization failure, lost connection).
    Transient,
    /// Retrying cannot succeed.
    Permanent,
    /// The store does not know; the processor treats it as transient.
    Unknown,
}

/// Where in the processor an error happened.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorSource {
    /// Receiving messages or accepting a session.
    Receive,
    /// Beginning the inbox transaction or claiming the message id.
    Claim,
    /// The user's handler (an error it returned, or a panic).
    Handler,
    /// Committing or rolling back the inbox transaction.
    Commit,
    /// Settling the message with the broker (complete, abandon, dead-letter, defer, release).
    Settle,
    /// Renewing the lock of a message or of a session.
    RenewLock,
}

impl fmt::Display for ErrorSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Receive => "receive",
            Self::Claim => "claim",
            Self::Handler => "handler",
            Self::Commit => "commit",
            Self::Settle => "settle",
            Self::RenewLock => "renew lock",
        })
    }
}

/// An error the processor met while running, passed to the error callback
/// ([`Processor::on_error`](crate::Processor::on_error)). The processor keeps running.
#[derive(Debug)]
pub struct ProcessError {
    source: ErrorSource,
    message_id: Option<MessageId>,
    error: BoxError,
}

impl ProcessError {
    pub(crate) fn new(
        source: ErrorSource,
        message_id: Option<&MessageId>,
        error: impl Into<BoxError>,
    ) -> Self {
        Self { source, message_id: message_id.cloned(), error: error.into() }
    }

    /// Where the error happened.
    pub fn error_source(&self) -> ErrorSource {
        self.source
    }

    /// The message being processed, if any.
    pub fn message_id(&self) -> Option<&MessageId> {
        self.message_id.as_ref()
    }

    /// The error.
    pub fn error(&self) -> &(dyn StdError + Send + Sync + 'static) {
        &*self.error
    }
}

impl fmt::Display for ProcessError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.message_id {
            Some(id) => {
                write!(f, "{} error on message {id}: {}", self.source, error_chain(&*self.error))
            }
            None => write!(f, "{} error: {}", self.source, error_chain(&*self.error)),
        }
    }
}

/// Why a processor did not start, or stopped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ProcessorError {
    /// The inbox forgets processed ids before the broker stops redelivering them, so a late
    /// redelivery would run the handler again.
    #[error(
        "the inbox keeps processed message ids for {retention}, but {entity} can redeliver a \
         message for {horizon} ({explanation}); raise the inbox retention to at least {horizon}"
    )]
    RetentionTooShort {
        /// The entity path.
        entity: String,
        /// The inbox retention, formatted.
        retention: String,
        /// The redelivery horizon, formatted (`forever` when deliveries are unlimited).
        horizon: String,
        /// How the horizon was computed, with the numbers.
        explanation: String,
    },
    /// The options are inconsistent.
    #[error("invalid processor options: {0}")]
    InvalidOptions(String),
    /// The transport closed.
    #[error("the transport closed")]
    Transport(#[source] TransportError),
}

/// Formats a duration for an error message, in the largest whole unit that fits.
pub(crate) fn format_duration(d: Duration) -> String {
    let secs = d.as_secs();
    if d.subsec_millis() != 0 || secs == 0 {
        format!("{} ms", d.as_millis())
    } else if secs.is_multiple_of(86_400) {
        format!("{} d", secs / 86_400)
    } else if secs.is_multiple_of(3600) {
        format!("{} h", secs / 3600)
    } else if secs.is_multiple_of(60) {
        format!("{} min", secs / 60)
    } else {
        format!("{secs} s")
    }
}

/// An error and its sources, joined with `: `.
pub(crate) fn error_chain(error: &(dyn StdError + 'static)) -> String {
    let mut out = error.to_string();
    let mut next = error.source();
    while let Some(e) = next {
        let s = e.to_string();
        // Wrappers often repeat their source's text; do not print it twice.
        if !out.ends_with(&s) {
            out.push_str(": ");
            out.push_str(&s);
        }
        next = e.source();
    }
    out
}
