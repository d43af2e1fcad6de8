//! The W3C trace context of a message, carried in its application properties, so that a trace
//! runs from the sender to the handler.
//!
//! The sender [`inject`]s its span's context as `traceparent`, and as `Diagnostic-Id`, the
//! property the Service Bus SDKs set with the same W3C format; the processor [`extract`]s it
//! and records it on the message's span (and, with the `opentelemetry` feature, makes it the
//! span's parent).
//!
//! ```
//! use twice::Message;
//! use twice::trace_context::{TraceParent, extract, inject};
//!
//! let parent: TraceParent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".parse()?;
//! let mut message = Message::new("{}");
//! inject(&mut message, &parent);
//! assert_eq!(extract(&message), Some(parent));
//! # Ok::<(), twice::trace_context::TraceParentError>(())
//! ```

use std::fmt;
use std::str::FromStr;

use crate::message::{Message, Value};

/// The application property of the W3C trace context.
pub const TRACEPARENT: &str = "traceparent";

/// The application property the Service Bus SDKs set to the same W3C `traceparent` value.
pub const DIAGNOSTIC_ID: &str = "Diagnostic-Id";

/// A W3C `traceparent`: the trace a message belongs to and the span that sent it.
///
/// Its text form is `00-<trace id: 32 hex>-<parent id: 16 hex>-<flags: 2 hex>`, lowercase.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TraceParent {
    trace_id: [u8; 16],
    parent_id: [u8; 8],
    flags: u8,
}

/// Why a `traceparent` value was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TraceParentError {
    /// The value is not `version-traceid-parentid-flags` with fields of 2, 32, 16 and 2
    /// lowercase hex digits.
    #[error("a traceparent is `00-` then 32, 16 and 2 lowercase hex digits joined by `-`")]
    Malformed,
    /// Version `ff`, which the W3C format forbids.
    #[error("traceparent version ff is invalid")]
    InvalidVersion,
    /// The trace id or the parent id is all zeros.
    #[error("the trace id and parent id of a traceparent must not be all zeros")]
    ZeroId,
}

impl TraceParent {
    /// A trace parent; `sampled` sets the sampled flag.
    ///
    /// # Errors
    ///
    /// [`TraceParentError::ZeroId`] when either id is all zeros.
    pub fn new(
        trace_id: [u8; 16],
        parent_id: [u8; 8],
        sampled: bool,
    ) -> Result<Self, TraceParentError> {
        if trace_id == [0; 16] || parent_id == [0; 8] {
            return Err(TraceParentError::ZeroId);
        }
        Ok(Self { trace_id, parent_id, flags: u8::from(sampled) })
    }

    /// The trace id.
    pub fn trace_id(&self) -> [u8; 16] {
        self.trace_id
    }

    /// The id of the span that sent the message.
    pub fn parent_id(&self) -> [u8; 8] {
        self.parent_id
    }

    /// The trace flags (bit 0: sampled).
    pub fn flags(&self) -> u8 {
        self.flags
    }

    /// Whether the sender sampled the trace.
    pub fn sampled(&self) -> bool {
        self.flags & 1 == 1
    }
}

/// Lowercase hex digits into `out`; `None` unless `s` is exactly that many of them.
fn hex<const N: usize>(s: &str) -> Option<[u8; N]> {
    fn digit(c: u8) -> Option<u8> {
        match c {
            b'0'..=b'9' => Some(c - b'0'),
            b'a'..=b'f' => Some(c - b'a' + 10),
            _ => None,
        }
    }
    let bytes = s.as_bytes();
    if bytes.len() != 2 * N {
        return None;
    }
    let mut out = [0; N];
    for (o, pair) in out.iter_mut().zip(bytes.chunks_exact(2)) {
        *o = digit(pair[0])? << 4 | digit(pair[1])?;
    }
    Some(out)
}

impl FromStr for TraceParent {
    type Err = TraceParentError;

    /// Parses as the W3C Trace Context says: version `00` is exactly four fields; a later
    /// version may carry more after a `-`, which is ignored.
    fn from_str(s: &str) -> Result<Self, TraceParentError> {
        let head = s.get(..55).ok_or(TraceParentError::Malformed)?;
        let rest = &s[55..];
        let mut fields = head.split('-');
        let (Some(version), Some(trace), Some(parent), Some(flags), None) =
            (fields.next(), fields.next(), fields.next(), fields.next(), fields.next())
        else {
            return Err(TraceParentError::Malformed);
        };
        let [version] = hex::<1>(version).ok_or(TraceParentError::Malformed)?;
        if version == 0xff {
            return Err(TraceParentError::InvalidVersion);
        }
        if (version == 0 && !rest.is_empty()) || (!rest.is_empty() && !rest.starts_with('-')) {
            return Err(TraceParentError::Malformed);
        }
        let trace_id = hex::<16>(trace).ok_or(TraceParentError::Malformed)?;
        let parent_id = hex::<8>(parent).ok_or(TraceParentError::Malformed)?;
        let [flags] = hex::<1>(flags).ok_or(TraceParentError::Malformed)?;
        let mut parsed = Self::new(trace_id, parent_id, false)?;
        parsed.flags = flags;
        Ok(parsed)
    }
}

impl fmt::Display for TraceParent {
    /// Writes version `00`, whatever version was parsed, as a forwarder must.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("00-")?;
        for b in self.trace_id {
            write!(f, "{b:02x}")?;
        }
        f.write_str("-")?;
        for b in self.parent_id {
            write!(f, "{b:02x}")?;
        }
        write!(f, "-{:02x}", self.flags)
    }
}

/// The trace context of `message`: its `traceparent` property if that is valid, else its
/// `Diagnostic-Id` if that is. Invalid or missing values give `None`, never an error: a bad
/// header must not stop a message from being processed.
pub fn extract(message: &Message) -> Option<TraceParent> {
    [TRACEPARENT, DIAGNOSTIC_ID].into_iter().find_map(|name| {
        message.application_properties.get(name)?.as_str()?.parse::<TraceParent>().ok()
    })
}

/// Sets `traceparent` and `Diagnostic-Id` on `message` to `parent`.
pub fn inject(message: &mut Message, parent: &TraceParent) {
    let value = parent.to_string();
    message.application_properties.insert(DIAGNOSTIC_ID.to_owned(), Value::from(value.as_str()));
    message.application_properties.insert(TRACEPARENT.to_owned(), Value::from(value));
}

/// Makes `parent`, a remote span, the OpenTelemetry parent of `span`.
#[cfg(feature = "opentelemetry")]
pub(crate) fn set_otel_parent(span: &tracing::Span, parent: &TraceParent) {
    use opentelemetry::trace::{
        SpanContext, SpanId, TraceContextExt as _, TraceFlags, TraceId, TraceState,
    };
    use tracing_opentelemetry::OpenTelemetrySpanExt as _;

    let remote = SpanContext::new(
        TraceId::from_bytes(parent.trace_id),
        SpanId::from_bytes(parent.parent_id),
        TraceFlags::new(parent.flags),
        true,
        TraceState::default(),
    );
    // Without an OpenTelemetry layer in the subscriber there is no parent to set; the
    // `trace_parent` field still records it.
    let _ = span.set_parent(opentelemetry::Context::new().with_remote_span_context(remote));
}

/// The trace context of `span` as OpenTelemetry sees it, for a sender to [`inject`]: `None`
/// when the subscriber has no OpenTelemetry layer, or the span is not recorded.
#[cfg(feature = "opentelemetry")]
pub fn of_span(span: &tracing::Span) -> Option<TraceParent> {
    use opentelemetry::trace::TraceContextExt as _;
    use tracing_opentelemetry::OpenTelemetrySpanExt as _;

    let cx = span.context();
    let otel = cx.span();
    let context = otel.span_context();
    if !context.is_valid() {
        return None;
    }
    let mut parent = TraceParent::new(
        context.trace_id().to_bytes(),
        context.span_id().to_bytes(),
        context.is_sampled(),
    )
    .ok()?;
    parent.flags = context.trace_flags().to_u8();
    Some(parent)
}

#[cfg(test)]
mod tests {
    use super::*;

    const VALID: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn a_valid_traceparent_round_trips() {
        let p: TraceParent = VALID.parse().expect("valid");
        assert_eq!(p.trace_id()[..4], [0x4b, 0xf9, 0x2f, 0x35]);
        assert_eq!(p.parent_id(), [0x00, 0xf0, 0x67, 0xaa, 0x0b, 0xa9, 0x02, 0xb7]);
        assert!(p.sampled());
        assert_eq!(p.to_string(), VALID);
        let unsampled: TraceParent =
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00".parse().expect("valid");
        assert!(!unsampled.sampled());
    }

    #[test]
    fn bad_values_are_refused_with_the_reason() {
        use TraceParentError::{InvalidVersion, Malformed, ZeroId};
        let cases: &[(&str, TraceParentError)] = &[
            ("", Malformed),
            ("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7", Malformed),
            ("00-4BF92F3577B34DA6A3CE929D0E0E4736-00F067AA0BA902B7-01", Malformed),
            ("00-4bf92f3577b34da6a3ce929d0e0e473-600f067aa0ba902b7-01", Malformed),
            ("00_4bf92f3577b34da6a3ce929d0e0e4736_00f067aa0ba902b7_01", Malformed),
            ("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-", Malformed),
            ("0g-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", Malformed),
            ("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01x", Malformed),
            ("ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", InvalidVersion),
            ("00-00000000000000000000000000000000-00f067aa0ba902b7-01", ZeroId),
            ("00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01", ZeroId),
            // Legacy hierarchical Request-Id, which older SDKs put in Diagnostic-Id.
            ("|4bf92f3577b34da6a3ce929d0e0e4736.00f067aa0ba902b7.", Malformed),
            ("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0é", Malformed),
        ];
        for (value, error) in cases {
            assert_eq!(value.parse::<TraceParent>().as_ref(), Err(error), "{value:?}");
        }
    }

    #[test]
    fn a_later_version_may_carry_more_fields_and_is_written_as_version_00() {
        let p: TraceParent =
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-future".parse().expect("ok");
        assert_eq!(p.to_string(), VALID);
    }

    #[test]
    fn extract_prefers_a_valid_traceparent_then_falls_back_to_diagnostic_id() {
        let other = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
        let both =
            Message::new("").with_property(TRACEPARENT, VALID).with_property(DIAGNOSTIC_ID, other);
        assert_eq!(extract(&both).map(|p| p.to_string()).as_deref(), Some(VALID));
        let bad_then_good =
            Message::new("").with_property(TRACEPARENT, "junk").with_property(DIAGNOSTIC_ID, other);
        assert_eq!(extract(&bad_then_good).map(|p| p.to_string()).as_deref(), Some(other));
        let not_a_string = Message::new("").with_property(TRACEPARENT, 7_i64);
        assert_eq!(extract(&not_a_string), None);
        assert_eq!(extract(&Message::new("")), None);
    }

    #[test]
    fn inject_sets_both_properties() {
        let p: TraceParent = VALID.parse().expect("valid");
        let mut m = Message::new("").with_property(TRACEPARENT, "stale");
        inject(&mut m, &p);
        for name in [TRACEPARENT, DIAGNOSTIC_ID] {
            assert_eq!(m.application_properties[name].as_str(), Some(VALID), "{name}");
        }
        assert_eq!(TraceParent::new([0; 16], [1; 8], true), Err(TraceParentError::ZeroId));
    }
}
