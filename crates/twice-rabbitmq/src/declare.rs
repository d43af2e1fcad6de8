//! The queues: declared where they are missing, and read as they are where they exist.
//!
//! AMQP 0-9-1 has no call that returns a queue's arguments, and re-declaring a queue with
//! arguments other than its own is refused with `PRECONDITION_FAILED`, which closes the
//! channel. So an existing queue is never declared with the transport's arguments: the
//! transport reads the queue's own by declaring it, on a channel of its own each time, with the
//! arguments it believes the queue has. The broker either accepts (they are the queue's) or
//! names the first argument that differs and the value the queue has for it, which the next
//! attempt takes. After a few rounds the declaration the broker accepts is the queue's own, and
//! re-declaring a queue with its own arguments changes nothing.

use lapin::options::QueueDeclareOptions;
use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{Channel, Connection};
use twice::TransportError;

use crate::convert::text;
use crate::version::ServerVersion;

/// A queue as the broker has it.
#[derive(Debug)]
pub(crate) struct Queue {
    /// Whether the transport created it just now.
    pub(crate) created: bool,
    /// Its arguments, as declared or as read back; `None` when they could not be read (then
    /// `unreadable` says why).
    pub(crate) arguments: Option<FieldTable>,
    pub(crate) unreadable: Option<String>,
}

impl Queue {
    /// The argument `name`, if the queue has it (or its arguments could not be read).
    pub(crate) fn argument(&self, name: &str) -> Option<&AMQPValue> {
        self.arguments.as_ref()?.inner().get(name)
    }

    /// Whether the queue is a quorum queue (unknown: assumed so).
    pub(crate) fn is_quorum(&self) -> bool {
        match (&self.arguments, self.argument("x-queue-type")) {
            (None, _) => true,
            (Some(_), Some(t)) => text(t).as_deref() == Some("quorum"),
            (Some(_), None) => false,
        }
    }
}

pub(crate) fn short(s: &str) -> Result<ShortString, TransportError> {
    ShortString::try_new(s)
        .map_err(|_| TransportError::Invalid(format!("queue name {s:?} is longer than 255 bytes")))
}

fn long(s: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(s))
}

/// The arguments of a queue the transport makes: a quorum queue; for the main queue the
/// delivery limit, the time to live and at-least-once dead-lettering into `dead_letter_queue`.
/// On RabbitMQ 4.0 and later a queue without a limit says so with `-1`, or 4.0's default of 20
/// would apply (and drop what a dead-letter queue has after 20 returns).
pub(crate) fn arguments(
    version: Option<ServerVersion>,
    max_delivery_count: Option<u32>,
    message_time_to_live: Option<std::time::Duration>,
    dead_letter_queue: Option<&str>,
) -> Result<FieldTable, TransportError> {
    let mut args = FieldTable::default();
    args.insert("x-queue-type".into(), long("quorum"));
    match max_delivery_count {
        // The quorum queue dead-letters a message returned with more returns than the limit:
        // a limit of n − 1 returns allows n deliveries.
        Some(n) => {
            args.insert("x-delivery-limit".into(), AMQPValue::LongLongInt(i64::from(n) - 1));
        }
        None if version.is_some_and(ServerVersion::has_default_delivery_limit) => {
            args.insert("x-delivery-limit".into(), AMQPValue::LongLongInt(-1));
        }
        None => {}
    }
    if let Some(ttl) = message_time_to_live {
        let millis = i64::try_from(ttl.as_millis()).map_err(|_| {
            TransportError::Invalid(format!("message time to live {ttl:?} is too long"))
        })?;
        args.insert("x-message-ttl".into(), AMQPValue::LongLongInt(millis));
    }
    if let Some(dlq) = dead_letter_queue {
        args.insert("x-dead-letter-exchange".into(), long(""));
        args.insert("x-dead-letter-routing-key".into(), long(dlq));
        // At-least-once dead-lettering (the message leaves the queue only once the dead-letter
        // queue has it) requires rejecting publishes on overflow.
        args.insert("x-dead-letter-strategy".into(), long("at-least-once"));
        args.insert("x-overflow".into(), long("reject-publish"));
    }
    Ok(args)
}

/// The error of a declaration: its reply code and text, when the broker refused it.
fn refusal(e: &lapin::Error) -> Option<(AMQPErrorKind, String)> {
    match e.kind() {
        lapin::ErrorKind::ProtocolError(amqp) => {
            Some((amqp.kind().clone(), amqp.get_message().as_str().to_owned()))
        }
        _ => None,
    }
}

async fn declare_on(
    connection: &Connection,
    queue: &str,
    options: QueueDeclareOptions,
    arguments: FieldTable,
) -> Result<Result<(), (AMQPErrorKind, String)>, TransportError> {
    let channel: Channel =
        connection.create_channel().await.map_err(|e| crate::map_error(queue, e))?;
    match channel.queue_declare(short(queue)?, options, arguments).await {
        Ok(_) => {
            let _ = channel.close(200, "declared".into()).await;
            Ok(Ok(()))
        }
        Err(e) => match refusal(&e) {
            // The broker closed the channel with its refusal.
            Some(refused) => Ok(Err(refused)),
            None => Err(crate::map_error(queue, e)),
        },
    }
}

/// Finds `queue`: declares it with `wanted` when it is missing (and `declare` allows), or reads
/// the arguments of the one that exists, never changing it.
///
/// # Errors
///
/// [`TransportError::EntityNotFound`] for a missing queue the transport may not declare; a
/// transport error when the broker is unreachable or refuses otherwise.
pub(crate) async fn find(
    connection: &Connection,
    queue: &str,
    wanted: FieldTable,
    declare: bool,
) -> Result<Queue, TransportError> {
    let passive = QueueDeclareOptions { passive: true, ..QueueDeclareOptions::default() };
    match declare_on(connection, queue, passive, FieldTable::default()).await? {
        Ok(()) => {}
        Err((AMQPErrorKind::Soft(AMQPSoftError::NOTFOUND), _)) if declare => {
            let durable = QueueDeclareOptions { durable: true, ..QueueDeclareOptions::default() };
            return match declare_on(connection, queue, durable, wanted.clone()).await? {
                Ok(()) => Ok(Queue { created: true, arguments: Some(wanted), unreadable: None }),
                // Made by someone else in the meantime: read it as it is.
                Err((AMQPErrorKind::Soft(AMQPSoftError::PRECONDITIONFAILED), _)) => {
                    read(connection, queue, wanted).await
                }
                Err((_, text)) => Err(refused(queue, &text)),
            };
        }
        Err((AMQPErrorKind::Soft(AMQPSoftError::NOTFOUND), _)) => {
            return Err(TransportError::EntityNotFound(queue.to_owned()));
        }
        Err((_, text)) => return Err(refused(queue, &text)),
    }
    read(connection, queue, wanted).await
}

fn refused(queue: &str, text: &str) -> TransportError {
    TransportError::Invalid(format!("queue {queue:?}: RabbitMQ refused it: {text}"))
}

/// Reads the arguments of `queue`, which exists, starting from `guess`.
async fn read(
    connection: &Connection,
    queue: &str,
    guess: FieldTable,
) -> Result<Queue, TransportError> {
    let mut arguments = guess;
    let mut durable = true;
    let mut last = String::new();
    for _ in 0..16 {
        let options = QueueDeclareOptions { durable, ..QueueDeclareOptions::default() };
        match declare_on(connection, queue, options, arguments.clone()).await? {
            Ok(()) => {
                return Ok(Queue { created: false, arguments: Some(arguments), unreadable: None });
            }
            Err((AMQPErrorKind::Soft(AMQPSoftError::PRECONDITIONFAILED), text)) => {
                match inequivalent(&text) {
                    Some(Difference::Durable(d)) => durable = d,
                    Some(Difference::Argument(name, Some(value))) => {
                        arguments.insert(name.as_str().into(), value);
                    }
                    Some(Difference::Argument(name, None)) => {
                        arguments = without(&arguments, &name);
                    }
                    None => {
                        last = text;
                        break;
                    }
                }
                last = String::new();
            }
            Err((_, text)) => {
                last = text;
                break;
            }
        }
    }
    Ok(Queue { created: false, arguments: None, unreadable: Some(last) })
}

fn without(arguments: &FieldTable, name: &str) -> FieldTable {
    let mut kept = FieldTable::default();
    for (k, v) in arguments.inner() {
        if k.as_str() != name {
            kept.insert(k.clone(), v.clone());
        }
    }
    kept
}

/// What a `PRECONDITION_FAILED` says differs.
#[derive(Debug, PartialEq)]
enum Difference {
    /// The queue's `durable` flag.
    Durable(bool),
    /// The queue's value of an argument (`None`: it has none).
    Argument(String, Option<AMQPValue>),
}

/// Reads RabbitMQ's `inequivalent arg 'NAME' for queue 'Q' in vhost 'V': received ... but
/// current is none` or `... but current is the value 'VALUE' of type 'TYPE'`.
fn inequivalent(text: &str) -> Option<Difference> {
    let (_, rest) = text.split_once("inequivalent arg '")?;
    let (name, rest) = rest.split_once('\'')?;
    let (_, current) = rest.rsplit_once("but current is ")?;
    if name == "durable" {
        return Some(Difference::Durable(current.trim_matches('\'').starts_with("true")));
    }
    if current.starts_with("none") {
        return Some(Difference::Argument(name.to_owned(), None));
    }
    let value = if let Some((_, typed)) = current.split_once("the value '") {
        // `the value 'VALUE' of type 'TYPE'`
        let (value, rest) = typed.rsplit_once("' of type '")?;
        match rest.trim_end_matches('\'') {
            "longstr" | "shortstr" => long(value),
            "bool" => AMQPValue::Boolean(value == "true"),
            "byte" | "unsignedbyte" | "short" | "unsignedshort" | "signedint" | "unsignedint"
            | "long" | "signedshort" => AMQPValue::LongLongInt(value.parse().ok()?),
            _ => return None,
        }
    } else {
        // `'VALUE'` (RabbitMQ 3.10 for numbers): a number, or else text.
        let value = current.strip_prefix('\'')?.rsplit_once('\'')?.0;
        value.parse().map_or_else(|_| long(value), AMQPValue::LongLongInt)
    };
    Some(Difference::Argument(name.to_owned(), Some(value)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_brokers_refusals_name_the_value_the_queue_has() {
        let t = "PRECONDITION_FAILED - inequivalent arg 'x-delivery-limit' for queue 'q' in vhost \
                 '/': received the value '9' of type 'signedint' but current is none";
        assert_eq!(inequivalent(t), Some(Difference::Argument("x-delivery-limit".into(), None)));
        let t = "PRECONDITION_FAILED - inequivalent arg 'x-queue-type' for queue 'q' in vhost \
                 '/': received the value 'quorum' of type 'longstr' but current is the value \
                 'classic' of type 'longstr'";
        assert_eq!(
            inequivalent(t),
            Some(Difference::Argument("x-queue-type".into(), Some(long("classic"))))
        );
        let t = "PRECONDITION_FAILED - inequivalent arg 'x-max-length' for queue 'q' in vhost \
                 '/': received none but current is the value '100' of type 'long'";
        assert_eq!(
            inequivalent(t),
            Some(Difference::Argument("x-max-length".into(), Some(AMQPValue::LongLongInt(100))))
        );
        let t = "PRECONDITION_FAILED - inequivalent arg 'x-delivery-limit' for queue 'q' in vhost \
                 '/': received '4' but current is '2'";
        assert_eq!(
            inequivalent(t),
            Some(Difference::Argument("x-delivery-limit".into(), Some(AMQPValue::LongLongInt(2))))
        );
        let t = "PRECONDITION_FAILED - inequivalent arg 'durable' for queue 'q' in vhost '/': \
                 received 'true' but current is 'false'";
        assert_eq!(inequivalent(t), Some(Difference::Durable(false)));
        assert_eq!(inequivalent("PRECONDITION_FAILED - something else"), None);
    }
}
