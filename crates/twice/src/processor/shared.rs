//! What every message's processing shares, whatever the transport: the handler, the inbox, the
//! options in force, the counters and the hooks, and the span of one message.

use std::sync::Arc;

use super::{BusinessKeyDuplicate, Hooks, Mode};
use crate::clock::SharedClock;
use crate::counters::Counters;
use crate::error::ProcessError;
use crate::health::Activity;
use crate::ids::MessageId;
use crate::message::ReceivedMessage;
use crate::retry::RetryPolicy;
use crate::trace_context;

/// What every message's processing shares, whatever the transport.
pub(crate) struct Core<I, H> {
    pub(crate) inbox: Arc<I>,
    pub(crate) handler: Arc<H>,
    pub(crate) consumer: String,
    /// The transport's [`messaging.system`](crate::Transport::system) and the entity path,
    /// for the spans.
    pub(crate) system: &'static str,
    pub(crate) destination: String,
    pub(crate) mode: Mode,
    pub(crate) retry: RetryPolicy,
    pub(crate) clock: SharedClock,
    pub(crate) counters: Arc<Counters>,
    pub(crate) activity: Arc<Activity>,
    pub(crate) hooks: Hooks,
}

impl<I, H> Core<I, H> {
    /// The span of one message's processing, named and with fields as the OpenTelemetry
    /// semantic conventions for messaging name them; its `twice.outcome` is recorded when the
    /// message is settled, and its `trace_parent` is the sender's W3C trace context, if the
    /// message carries a valid one.
    pub(crate) fn span(&self, msg: &ReceivedMessage) -> tracing::Span {
        let span = tracing::info_span!(
            "twice.process",
            "otel.name" = %format_args!("process {}", self.destination),
            "otel.kind" = "consumer",
            "messaging.system" = self.system,
            "messaging.operation.type" = "process",
            "messaging.operation.name" = "process",
            "messaging.destination.name" = %self.destination,
            "messaging.consumer.group.name" = %self.consumer,
            "messaging.message.id" = %msg.message_id(),
            "messaging.servicebus.message.delivery_count" = msg.delivery_count,
            "trace_parent" = tracing::field::Empty,
            "twice.outcome" = tracing::field::Empty,
        );
        if let Some(parent) = trace_context::extract(&msg.message) {
            span.record("trace_parent", tracing::field::display(parent));
            #[cfg(feature = "opentelemetry")]
            trace_context::set_otel_parent(&span, &parent);
        }
        span
    }

    pub(crate) fn report(&self, error: ProcessError) {
        match &self.hooks.on_error {
            Some(f) => f(&error),
            None => tracing::warn!(consumer = %self.consumer, "{error}"),
        }
    }

    /// Logs a completion by business key at warn level and tells the hook.
    pub(super) fn business_key_duplicate(&self, id: &MessageId, constraint: &str, at_commit: bool) {
        tracing::warn!(
            consumer = %self.consumer,
            message_id = %id,
            %constraint,
            at_commit,
            "completed as a duplicate by business key, without its work"
        );
        if let Some(f) = &self.hooks.on_business_key {
            f(&BusinessKeyDuplicate {
                message_id: id.clone(),
                constraint: constraint.to_owned(),
                at_commit,
            });
        }
    }
}
