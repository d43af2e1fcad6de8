//! Settlement of a locked message, both ways: as the AMQP outcome of a disposition on its link,
//! and as the body of a `$management` `update-disposition` request (research §8.3).
//!
//! | settlement   | outcome on the link                                    | `disposition-status` |
//! |--------------|--------------------------------------------------------|----------------------|
//! | complete     | `accepted`                                             | `completed`          |
//! | abandon      | `modified` (delivery-failed, annotations)              | `abandoned`          |
//! | defer        | `modified` (delivery-failed, undeliverable-here)       | `defered`            |
//! | dead-letter  | `rejected` with `com.microsoft:dead-letter` and reason | `suspended`          |
//! | release      | `released`                                             | (`abandoned`)        |

use twice::{DeadLetterReason, Properties};

use super::condition::Condition;
use crate::codec::Value;
use crate::mapping;
use crate::performative::{AmqpError, Outcome};

/// The info keys of a dead-letter error, and the names the SDKs give them.
const REASON: &str = "DeadLetterReason";
const DESCRIPTION: &str = "DeadLetterErrorDescription";

/// What a receiver asks of the broker for a locked message.
#[derive(Clone, Debug, PartialEq)]
pub enum Settle {
    /// Done: remove it.
    Complete,
    /// Unlock it for redelivery, counting a delivery, after merging these properties.
    Abandon(Properties),
    /// Set it aside, receivable only by sequence number, after merging these properties.
    Defer(Properties),
    /// Move it to the dead-letter queue, after merging these properties.
    DeadLetter(DeadLetterReason, Properties),
    /// Unlock it without counting a delivery (it never reached a handler). `$management` has
    /// no such disposition: there it is an abandon.
    Release,
}

impl Settle {
    /// The outcome a receiver sends on the message's link.
    pub fn to_outcome(&self) -> Outcome {
        match self {
            Settle::Complete => Outcome::Accepted,
            Settle::Release => Outcome::Released,
            Settle::Abandon(props) => Outcome::Modified {
                delivery_failed: true,
                undeliverable_here: false,
                message_annotations: annotations(props),
            },
            Settle::Defer(props) => Outcome::Modified {
                delivery_failed: true,
                undeliverable_here: true,
                message_annotations: annotations(props),
            },
            Settle::DeadLetter(why, props) => {
                let mut info = vec![
                    (Value::symbol(REASON), Value::string(why.reason.clone())),
                    (Value::symbol(DESCRIPTION), Value::string(why.description.clone())),
                ];
                info.extend(
                    props
                        .iter()
                        .map(|(k, v)| (Value::string(k.clone()), mapping::from_twice_value(v))),
                );
                Outcome::Rejected(Some(AmqpError {
                    condition: Condition::DeadLetter.into(),
                    description: Some(why.description.clone()),
                    info: Some(Value::Map(info)),
                }))
            }
        }
    }

    /// What an outcome on a link asks of the broker; `None` for a state that settles nothing
    /// (`received`, or one twice does not know).
    pub fn from_outcome(outcome: &Outcome) -> Option<Self> {
        let props = |a: &Option<Value>| mapping::properties_of(a.as_ref(), &[]);
        Some(match outcome {
            Outcome::Accepted => Settle::Complete,
            Outcome::Released => Settle::Release,
            Outcome::Modified { undeliverable_here: true, message_annotations, .. } => {
                Settle::Defer(props(message_annotations))
            }
            Outcome::Modified { message_annotations, .. } => {
                Settle::Abandon(props(message_annotations))
            }
            Outcome::Rejected(err) => dead_letter_of(err.as_ref()),
            Outcome::Other => return None,
        })
    }

    /// The outcome a server echoes once it applied `outcome`: the same type, without the
    /// dead-letter error a `rejected` came with (which the SDKs would take for a failure);
    /// a state that settles nothing is echoed as `accepted`.
    pub fn echo_of(outcome: &Outcome) -> Outcome {
        match outcome {
            Outcome::Rejected(_) => Outcome::Rejected(None),
            Outcome::Other => Outcome::Accepted,
            other => other.clone(),
        }
    }

    /// Whether an echo of this settlement reports a failure rather than the settlement itself:
    /// a `rejected` with an error other than the dead-letter one.
    pub fn echo_error(echo: &Outcome) -> Option<&AmqpError> {
        match echo {
            Outcome::Rejected(Some(e)) if e.condition != Condition::DeadLetter => Some(e),
            _ => None,
        }
    }

    /// The fields of an `update-disposition` request body for this settlement (without the
    /// lock tokens and session).
    pub fn to_disposition(&self) -> Vec<(Value, Value)> {
        let status = |s: &str| (Value::string("disposition-status"), Value::string(s));
        let modify = |props: &Properties| {
            (!props.is_empty())
                .then(|| (Value::string("properties-to-modify"), properties_map(props)))
        };
        let mut out = Vec::new();
        match self {
            Settle::Complete => out.push(status("completed")),
            // A lock through `$management` cannot be released without counting; abandon is
            // the nearest.
            Settle::Release => out.push(status("abandoned")),
            Settle::Abandon(props) => {
                out.push(status("abandoned"));
                out.push((Value::string("properties-to-modify"), properties_map(props)));
            }
            // The service spells it this way.
            Settle::Defer(props) => {
                out.push(status("defered"));
                out.extend(modify(props));
            }
            Settle::DeadLetter(why, props) => {
                out.push(status("suspended"));
                out.push((Value::string("deadletter-reason"), Value::string(why.reason.clone())));
                out.push((
                    Value::string("deadletter-description"),
                    Value::string(why.description.clone()),
                ));
                out.extend(modify(props));
            }
        }
        out
    }

    /// The settlement an `update-disposition` request body asks for.
    pub fn from_disposition(body: &Value) -> Result<Self, String> {
        let text = |k: &str| body.get(k).and_then(Value::as_str).unwrap_or_default().to_owned();
        let props = mapping::properties_of(body.get("properties-to-modify"), &[]);
        Ok(match text("disposition-status").as_str() {
            "completed" => Settle::Complete,
            "abandoned" => Settle::Abandon(props),
            "defered" | "deferred" => Settle::Defer(props),
            "suspended" => Settle::DeadLetter(
                DeadLetterReason::new(text("deadletter-reason"), text("deadletter-description")),
                props,
            ),
            other => return Err(format!("unknown disposition-status '{other}'")),
        })
    }
}

/// The dead-letter settlement a `rejected` outcome asks for: the reason and description from
/// the error's info (the description falls back to the error's), the other info entries as
/// properties to merge.
fn dead_letter_of(err: Option<&AmqpError>) -> Settle {
    let info = err.and_then(|e| e.info.as_ref());
    let text = |k: &str| info.and_then(|i| i.get(k)).and_then(|v| v.as_str()).map(str::to_owned);
    let reason = text(REASON);
    let description = text(DESCRIPTION).or_else(|| err.and_then(|e| e.description.clone()));
    let properties = mapping::properties_of(info, &[REASON, DESCRIPTION]);
    let why = DeadLetterReason::new(reason.unwrap_or_default(), description.unwrap_or_default());
    Settle::DeadLetter(why, properties)
}

/// Properties as an AMQP map with string keys.
pub fn properties_map(props: &Properties) -> Value {
    Value::Map(
        props
            .iter()
            .map(|(k, v)| (Value::string(k.clone()), mapping::from_twice_value(v)))
            .collect(),
    )
}

fn annotations(props: &Properties) -> Option<Value> {
    (!props.is_empty()).then(|| properties_map(props))
}
