//! Senders: single messages, batches, scheduled messages; and a sender whose message ids are
//! derived from business keys, so a retried send is a duplicate the entity can drop.

use std::sync::Arc;

use bytes::Bytes;
use sha2::{Digest, Sha256};
use twice::{Message, MessageId, SequenceNumber, Timestamp};
use twice_amqp::codec::Value;
use twice_amqp::mapping::{self, BATCH_FORMAT};
use twice_amqp::performative::{Outcome, ROLE_SENDER, desc, described_list};
use twice_amqp::servicebus::{Condition, ManagementReply, ManagementRequest, Scheduled};

use crate::client::{Conn, Inner, Management, ServiceBusClient};
use crate::error::Error;

/// The longest message id Service Bus accepts.
pub const MAX_MESSAGE_ID_LEN: usize = 128;

#[derive(Debug)]
struct SendLink {
    conn: Arc<Conn>,
    handle: u32,
    id: u64,
}

/// A sender to a queue or topic. After a connection loss the next send reconnects and
/// attaches again. A send whose outcome is unknown (the connection died, or no answer within
/// the operation timeout) fails with a transient error; whether the message was stored is
/// unknown, so resend it with the same message id (see [`StableIdSender`]).
#[derive(Debug)]
pub struct Sender {
    client: Arc<Inner>,
    entity: String,
    link: tokio::sync::Mutex<Option<SendLink>>,
    mgmt: Management,
}

impl ServiceBusClient {
    /// A sender to `entity`. Nothing is attached until the first send.
    pub fn sender(&self, entity: &str) -> Sender {
        Sender {
            client: self.inner.clone(),
            entity: entity.to_owned(),
            link: tokio::sync::Mutex::new(None),
            mgmt: Management::default(),
        }
    }
}

/// Gives a message without an id a random one, as the SDKs do.
fn with_id(mut m: Message) -> Message {
    if m.message_id.is_none() {
        m.message_id = Some(MessageId::random());
    }
    m
}

impl Sender {
    /// The entity path.
    pub fn entity_path(&self) -> &str {
        &self.entity
    }

    async fn link(&self) -> Result<(Arc<Conn>, u32, u64), Error> {
        let mut guard = self.link.lock().await;
        if let Some(l) = guard.as_ref().filter(|l| !l.conn.engine.is_closed()) {
            return Ok((l.conn.clone(), l.handle, l.id));
        }
        let conn = self.client.connection().await?;
        conn.authorize(&self.client, &self.entity).await?;
        let name = format!("{}-sender-{}", self.entity, uuid::Uuid::new_v4().simple());
        let link = conn
            .engine
            .attach(crate::engine::LinkSpec {
                name: name.clone(),
                role: ROLE_SENDER,
                snd_settle_mode: Some(0),
                rcv_settle_mode: Some(0),
                source: Some(described_list(desc::SOURCE, vec![Value::string(name)])),
                target: Some(described_list(
                    desc::TARGET,
                    vec![Value::string(self.entity.clone())],
                )),
                properties: None,
                initial_credit: 0,
                auto_credit: false,
            })
            .await?;
        *guard = Some(SendLink { conn: conn.clone(), handle: link.handle, id: link.id });
        Ok((conn, link.handle, link.id))
    }

    async fn transfer(&self, payload: Vec<u8>, format: u32) -> Result<(), Error> {
        let timeout = self.client.options.get_operation_timeout();
        let attempt = async {
            let (conn, handle, id) = self.link().await?;
            let outcome = conn.engine.send(handle, id, payload, format, false).await;
            if outcome.is_err() {
                // The link may be gone; attach a fresh one next time.
                self.link.lock().await.take();
            }
            outcome
        };
        match tokio::time::timeout(timeout, attempt).await.unwrap_or(Err(Error::Timeout))? {
            Outcome::Accepted => Ok(()),
            Outcome::Rejected(Some(e)) => Err(Error::from_amqp(&e)),
            other => Err(Error::Amqp {
                condition: Condition::InternalError.into(),
                description: Some(format!("the send was not accepted: {other:?}")),
            }),
        }
    }

    /// Sends one message and waits until the entity has accepted it.
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe: the message may be stored after the future is dropped.
    pub async fn send_message(&self, message: Message) -> Result<(), Error> {
        self.transfer(mapping::encode_message(&with_id(message)), 0).await
    }

    /// Sends messages as one batch: all are stored, or none.
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe, as [`Sender::send_message`].
    pub async fn send_batch(&self, messages: Vec<Message>) -> Result<(), Error> {
        if messages.is_empty() {
            return Ok(());
        }
        let messages: Vec<Message> = messages.into_iter().map(with_id).collect();
        let mut payload = Vec::new();
        // The envelope carries the first message's id, as the SDKs write it.
        let first =
            messages[0].message_id.as_ref().map_or(Value::Null, |id| Value::string(id.as_str()));
        described_list(0x73, vec![first]).encode(&mut payload);
        for m in &messages {
            Value::described(0x75, Value::Binary(Bytes::from(mapping::encode_message(m))))
                .encode(&mut payload);
        }
        self.transfer(payload, BATCH_FORMAT).await
    }

    async fn management(&self, req: ManagementRequest) -> Result<ManagementReply, Error> {
        let conn = self.client.connection().await?;
        self.mgmt.call(&self.client, &conn, &self.entity, req).await
    }

    /// Schedules messages to appear at `at`; returns their sequence numbers (for
    /// [`Sender::cancel_scheduled_messages`]).
    pub async fn schedule_messages(
        &self,
        messages: Vec<Message>,
        at: Timestamp,
    ) -> Result<Vec<SequenceNumber>, Error> {
        let messages = messages
            .into_iter()
            .map(|m| {
                let m = with_id(m).with_scheduled_enqueue_time(at);
                Scheduled {
                    message: Bytes::from(mapping::encode_message(&m)),
                    message_id: m.message_id.as_ref().map(|id| id.as_str().to_owned()),
                    session_id: m.session_id.as_ref().map(|s| s.as_str().to_owned()),
                    partition_key: m.partition_key.clone(),
                }
            })
            .collect();
        match self.management(ManagementRequest::ScheduleMessage { messages }).await? {
            ManagementReply::SequenceNumbers(seqs) => Ok(seqs),
            _ => Ok(Vec::new()),
        }
    }

    /// Cancels scheduled messages by sequence number.
    pub async fn cancel_scheduled_messages(&self, seqs: &[SequenceNumber]) -> Result<(), Error> {
        let req = ManagementRequest::CancelScheduledMessage { sequence_numbers: seqs.to_vec() };
        self.management(req).await.map(|_| ())
    }

    /// Detaches the link.
    pub async fn close(&self) {
        if let Some(l) = self.link.lock().await.take() {
            l.conn.engine.detach(l.handle, l.id);
        }
    }
}

/// The message id for an event about a business entity: `<business key>:<event type>`, or,
/// when that is longer than Service Bus allows, its SHA-256 in hex.
///
/// ```
/// use twice_servicebus_client::stable_message_id;
///
/// assert_eq!(stable_message_id("order-42", "OrderPlaced").as_str(), "order-42:OrderPlaced");
/// let long = stable_message_id(&"k".repeat(200), "OrderPlaced");
/// assert_eq!(long.as_str().len(), 64);
/// ```
pub fn stable_message_id(business_key: &str, event_type: &str) -> MessageId {
    let id = format!("{business_key}:{event_type}");
    if id.len() <= MAX_MESSAGE_ID_LEN {
        return MessageId::new(id);
    }
    let digest = Sha256::digest(id.as_bytes());
    MessageId::new(digest.iter().map(|b| format!("{b:02x}")).collect::<String>())
}

/// A sender that keeps message ids stable, as the seed asks of senders: "Senders must set
/// MessageId to something stable, such as the order ID plus the event type".
///
/// The id is derived from a business key and an event type ([`stable_message_id`]), so the
/// same event always carries the same id. A send that fails with a transient error (the
/// connection died, the service did not answer in time) may or may not have been stored; it is
/// sent again, with the same id, up to [`StableIdSender::max_attempts`] times.
///
/// This pairs with two safeguards downstream. With duplicate detection on the queue or topic,
/// Service Bus drops a copy whose id it has seen within the detection window, so a retried
/// send is stored once. Without it (or after the window) the copy is delivered, and the
/// processor's inbox recognises the id and skips the handler: the effect still happens once.
/// Random ids would defeat both.
#[derive(Debug)]
pub struct StableIdSender {
    sender: Sender,
    max_attempts: u32,
    retry: crate::client::RetryOptions,
}

impl StableIdSender {
    /// Wraps a sender; five attempts per send by default.
    pub fn new(sender: Sender) -> Self {
        Self { sender, max_attempts: 5, retry: crate::client::RetryOptions::default() }
    }

    /// How many times a send is tried before its error is returned.
    #[must_use]
    pub fn max_attempts(mut self, n: u32) -> Self {
        self.max_attempts = n.max(1);
        self
    }

    /// The sender underneath.
    pub fn sender(&self) -> &Sender {
        &self.sender
    }

    /// Sends `message` with the id of (`business_key`, `event_type`), retrying transient
    /// failures with the same id. Returns the id.
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe: the message may be stored after the future is dropped (sending it
    /// again with the same key is harmless).
    pub async fn send(
        &self,
        business_key: &str,
        event_type: &str,
        message: Message,
    ) -> Result<MessageId, Error> {
        let id = stable_message_id(business_key, event_type);
        let message = message.with_message_id(id.clone());
        let mut attempt = 1;
        loop {
            match self.sender.send_message(message.clone()).await {
                Ok(()) => return Ok(id),
                Err(e) if e.is_transient() && attempt < self.max_attempts => {
                    tracing::debug!(message_id = %id.as_str(), attempt, error = %e, "send failed; sending again with the same id");
                    tokio::time::sleep(self.retry.backoff(attempt)).await;
                    attempt += 1;
                }
                Err(e) => return Err(e),
            }
        }
    }
}
