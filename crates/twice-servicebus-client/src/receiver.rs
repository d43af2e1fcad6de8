//! Receivers: peek-lock or receive-and-delete on a queue or subscription, and session
//! receivers; settlement, lock renewal and deferred messages.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::sync::mpsc;
use twice::{
    DeadLetterReason, EntityInfo, LockToken, Properties, ReceivedMessage, SequenceNumber,
    SessionId, Timestamp, TransportError,
};
use twice_amqp::codec::Value;
use twice_amqp::mapping;
use twice_amqp::performative::{ROLE_RECEIVER, desc, described_list};
pub(crate) use twice_amqp::servicebus::Settle;
use twice_amqp::servicebus::{
    ManagementReply, ManagementRequest, ReplyMessage, SESSION_FILTER, TIMEOUT_PROPERTY,
};

use crate::client::{Conn, Inner, Management, ServiceBusClient};
use crate::engine::{Engine, Incoming, LinkEvent, LinkSpec};
use crate::error::{Error, condition};
use crate::options::{ReceiveMode, ReceiverOptions};

/// How long [`Receiver::release_and_close`] waits for transfers sent before the service saw
/// the credit taken back.
const IN_FLIGHT_WAIT: Duration = Duration::from_millis(200);

/// How a delivery is settled.
#[derive(Clone, Debug)]
enum Via {
    /// On the link it came on, while that link lives (`attached`).
    Link { engine: Engine, handle: u32, id: u64, delivery_id: u32, attached: Arc<AtomicBool> },
    /// Through `$management` with its lock token (deferred messages).
    Management,
    /// Received without a lock.
    Unlocked,
}

/// A received message and what is needed to settle it.
#[derive(Debug)]
pub struct ServiceBusDelivery {
    message: ReceivedMessage,
    via: Via,
    /// Set once a settlement of this delivery went out: a delivery is settled at most once on
    /// its link, and the service does not answer a second disposition.
    settled: std::sync::atomic::AtomicBool,
}

impl twice::Delivery for ServiceBusDelivery {
    fn message(&self) -> &ReceivedMessage {
        &self.message
    }
}

impl ServiceBusDelivery {
    /// The message.
    pub fn message(&self) -> &ReceivedMessage {
        &self.message
    }

    /// The lock token, for a locked delivery.
    pub fn lock_token(&self) -> Option<LockToken> {
        self.message.lock_token
    }
}

/// The link a receiver reads from.
#[derive(Debug)]
pub(crate) struct RecvLink {
    pub(crate) conn: Arc<Conn>,
    pub(crate) handle: u32,
    pub(crate) id: u64,
    events: mpsc::UnboundedReceiver<LinkEvent>,
    /// Whether the link is still attached (the engine clears it).
    pub(crate) attached: Arc<AtomicBool>,
}

/// What the pieces of a receiver share.
#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) client: Arc<Inner>,
    pub(crate) entity: String,
    options: ReceiverOptions,
    /// What the options say of the entity, or the Service Bus defaults.
    info: EntityInfo,
    /// What was read from the namespace (or settled on without it), once read.
    read: std::sync::OnceLock<EntityInfo>,
    /// The inbox scope: the path in lower case, since Service Bus names are case-insensitive.
    pub(crate) scope: String,
    mgmt: Management,
}

/// A receiver on a queue, a subscription (`topic/Subscriptions/name`) or a dead-letter queue
/// (`queue/$DeadLetterQueue`). It implements [`twice::Transport`], so a [`twice::Processor`]
/// can run on it. After a connection loss the next `receive` reconnects and attaches again;
/// messages received on the lost link can no longer be settled (their settlement fails with
/// lock-lost, and the service delivers them again when their lock expires).
#[derive(Debug)]
pub struct Receiver {
    pub(crate) shared: Arc<Shared>,
    link: tokio::sync::Mutex<Option<RecvLink>>,
}

impl ServiceBusClient {
    /// A receiver on `entity`. Nothing is attached until the first `receive`.
    pub fn receiver(&self, entity: &str, options: ReceiverOptions) -> Receiver {
        let info = options.entity_info_for(entity);
        Receiver {
            shared: Arc::new(Shared {
                client: self.inner.clone(),
                entity: entity.to_owned(),
                options,
                info,
                read: std::sync::OnceLock::new(),
                scope: claim_scope(entity),
                mgmt: Management::default(),
            }),
            link: tokio::sync::Mutex::new(None),
        }
    }
}

fn source(address: &str, filter: Option<Value>) -> Value {
    let mut fields = vec![Value::string(address)];
    if let Some(f) = filter {
        fields.extend([
            Value::Null,
            Value::Null,
            Value::Null,
            Value::Null,
            Value::Null,
            Value::Null,
            f,
        ]);
    }
    described_list(desc::SOURCE, fields)
}

/// Attaches a receiver link on `entity`, with a session filter when `session` is `Some`
/// (`Some(None)`: the next available session, waiting up to `wait`).
pub(crate) async fn attach_receiver(
    shared: &Shared,
    conn: &Arc<Conn>,
    session: Option<Option<&SessionId>>,
    wait: Option<Duration>,
) -> Result<(RecvLink, crate::engine::Link), Error> {
    conn.authorize(&shared.client, &shared.entity).await?;
    let filter = session.map(|sid| {
        Value::Map(vec![(
            Value::symbol(SESSION_FILTER),
            sid.map_or(Value::Null, |s| Value::string(s.as_str())),
        )])
    });
    let properties = wait.map(|w| {
        Value::Map(vec![(
            Value::symbol(TIMEOUT_PROPERTY),
            Value::Uint(u32::try_from(w.as_millis()).unwrap_or(u32::MAX)),
        )])
    });
    let (snd, rcv) = match shared.options.mode {
        ReceiveMode::PeekLock => (Some(0), Some(1)),
        ReceiveMode::ReceiveAndDelete => (Some(1), Some(0)),
    };
    let name = format!("{}-receiver-{}", shared.entity, uuid::Uuid::new_v4().simple());
    let mut link = conn
        .engine
        .attach(LinkSpec {
            name: name.clone(),
            role: ROLE_RECEIVER,
            snd_settle_mode: snd,
            rcv_settle_mode: rcv,
            source: Some(source(&shared.entity, filter)),
            target: Some(described_list(desc::TARGET, vec![Value::string(name)])),
            properties,
            initial_credit: shared.options.prefetch,
            auto_credit: false,
        })
        .await?;
    let events = link.events.take().ok_or(Error::ConnectionLost)?;
    let recv = RecvLink {
        conn: conn.clone(),
        handle: link.handle,
        id: link.id,
        events,
        attached: Arc::clone(&link.attached),
    };
    Ok((recv, link))
}

impl Shared {
    /// The entity's properties: as read, else as the options say.
    pub(crate) fn info(&self) -> &EntityInfo {
        self.read.get().unwrap_or(&self.info)
    }

    /// Reads the entity's properties from the administration API, unless the options gave
    /// them; the options' time to live overrides the one read. What was read is kept.
    async fn read_entity(&self) -> Result<EntityInfo, Error> {
        if let Some(read) = self.read.get() {
            return Ok(read.clone());
        }
        if self.options.get_entity_info().is_some() {
            return Ok(self.read.get_or_init(|| self.info.clone()).clone());
        }
        let mut read = crate::admin::entity_properties(&self.client, &self.entity).await?;
        if let Some(ttl) = self.options.get_message_time_to_live() {
            read.message_time_to_live = Some(ttl);
        }
        tracing::debug!(entity = %self.entity, ?read, "entity properties read");
        Ok(self.read.get_or_init(|| read).clone())
    }

    /// As [`Shared::read_entity`], for the processor: when the properties cannot be read (a
    /// key without the `Manage` claim, the API unreachable or elsewhere), warns and goes on
    /// with what the options say, or the Service Bus defaults; the AMQP link reports an
    /// entity that does not exist.
    pub(crate) async fn read_entity_or_defaults(&self) -> EntityInfo {
        match self.read_entity().await {
            Ok(read) => read,
            Err(e) => {
                tracing::warn!(
                    entity = %self.entity,
                    error = %e,
                    admin = %self.client.options.get_admin_endpoint(),
                    "cannot read the entity's properties from the administration API; going \
                     on with {} (give ClientOptions::admin_endpoint and a key with the Manage \
                     claim, or ReceiverOptions::entity_info)",
                    if self.options.get_message_time_to_live().is_some() {
                        "the Service Bus defaults and the time to live given"
                    } else {
                        "the Service Bus defaults (lock 60 s, 10 deliveries, no time to live)"
                    }
                );
                self.read.get_or_init(|| self.info.clone()).clone()
            }
        }
    }

    /// Turns a transfer into a delivery; a payload that is not a message is abandoned (it
    /// comes back, and is dead-lettered by the delivery limit) rather than dropped.
    fn delivery(&self, link: &RecvLink, d: Incoming) -> Option<ServiceBusDelivery> {
        match mapping::decode_received(&d.payload) {
            Ok(mut message) => {
                let via = if d.settled {
                    Via::Unlocked
                } else {
                    if let Some(t) = mapping::lock_token_of_tag(&d.tag) {
                        message.lock_token = Some(t);
                    }
                    Via::Link {
                        engine: link.conn.engine.clone(),
                        handle: link.handle,
                        id: link.id,
                        delivery_id: d.delivery_id,
                        attached: Arc::clone(&link.attached),
                    }
                };
                if d.settled {
                    message.lock_token = None;
                    message.locked_until = None;
                }
                Some(ServiceBusDelivery { message, via, settled: Default::default() })
            }
            Err(e) => {
                tracing::warn!(entity = %self.entity, error = %e, "abandoning a delivery that is not a message");
                if !d.settled {
                    let engine = link.conn.engine.clone();
                    let (handle, id) = (link.handle, link.id);
                    let outcome = Settle::Abandon(Properties::new()).to_outcome();
                    tokio::spawn(async move {
                        let _ = engine.dispose(handle, id, d.delivery_id, outcome).await;
                    });
                }
                None
            }
        }
    }

    /// Reads up to `max` deliveries from `link`, waiting up to `max_wait` for the first.
    /// `Err(None)` means the link is gone without an error worth reporting.
    ///
    /// With credit on demand, first opens credit for `max` (at most the options' maximum),
    /// less what is already buffered, and takes back what is left when the call ends, however
    /// it ends (answered, failed, or its future dropped): the link never holds more locked
    /// messages than a call waiting on it asked for, and none while no call waits, so a caller
    /// that stops asking (a processor shutting down, a receiver dropped) leaves no message
    /// locked to a link nobody reads.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: deliveries not yet returned stay buffered for the next call.
    pub(crate) async fn read(
        &self,
        link: &mut RecvLink,
        max: usize,
        max_wait: Duration,
    ) -> Result<Vec<ServiceBusDelivery>, Option<Error>> {
        let on_demand = self.options.prefetch == 0;
        let mut open = 0u32;
        if on_demand {
            let asked = u32::try_from(max.max(1)).unwrap_or(u32::MAX);
            let want = self.options.max_credit.map_or(asked, |cap| asked.min(cap));
            let buffered = u32::try_from(link.events.len()).unwrap_or(u32::MAX);
            open = want.saturating_sub(buffered);
            if open > 0 {
                link.conn.engine.flow(link.handle, link.id, open);
            }
        }
        // Whether the call's credit was all used is not known here (what it read may have
        // been buffered before it), so what is open is taken back in any case: one flow frame.
        let _revoke = CreditBack {
            engine: link.conn.engine.clone(),
            handle: link.handle,
            id: link.id,
            open: open > 0,
        };
        self.take(link, max, max_wait).await
    }

    /// The receiving part of [`Shared::read`]. Cancel safe: it awaits only before it reads
    /// the first delivery.
    async fn take(
        &self,
        link: &mut RecvLink,
        max: usize,
        max_wait: Duration,
    ) -> Result<Vec<ServiceBusDelivery>, Option<Error>> {
        let on_demand = self.options.prefetch == 0;
        let mut out = Vec::new();
        let mut taken = 0u32;
        let first = match tokio::time::timeout(max_wait, link.events.recv()).await {
            Err(_) => return Ok(out),
            Ok(ev) => ev,
        };
        let mut next = first;
        loop {
            match next {
                Some(LinkEvent::Delivery(d)) => {
                    taken += 1;
                    out.extend(self.delivery(link, d));
                }
                Some(LinkEvent::Detached(e)) => {
                    if out.is_empty() {
                        return Err(e.as_ref().map(Error::from_amqp));
                    }
                    break;
                }
                None if out.is_empty() => return Err(None),
                None => break,
            }
            if out.len() >= max.max(1) {
                break;
            }
            next = match link.events.try_recv() {
                Ok(ev) => Some(ev),
                Err(mpsc::error::TryRecvError::Empty) => break,
                Err(mpsc::error::TryRecvError::Disconnected) => None,
            };
        }
        if !on_demand && taken > 0 {
            // Keep the prefetch where it was: one more for every message taken off the link.
            link.conn.engine.flow(link.handle, link.id, taken);
        }
        Ok(out)
    }

    pub(crate) async fn settle(
        &self,
        d: &ServiceBusDelivery,
        how: Settle,
        session: Option<&SessionHold>,
    ) -> Result<(), Error> {
        match &d.via {
            Via::Unlocked => Err(Error::Invalid("the message was received without a lock".into())),
            Via::Link { engine, handle, id, delivery_id, .. } => {
                if d.settled.swap(true, std::sync::atomic::Ordering::AcqRel) {
                    return Err(lost(false));
                }
                let timeout = self.client.options.get_operation_timeout();
                let dispose = engine.dispose(*handle, *id, *delivery_id, how.to_outcome());
                let echo = tokio::time::timeout(timeout, dispose)
                    .await
                    .unwrap_or(Err(Error::Timeout))
                    .map_err(|e| match e {
                        // The link died with the connection: its locks are gone.
                        Error::ConnectionLost => lost(session.is_some()),
                        e => e,
                    })?;
                match Settle::echo_error(&echo) {
                    Some(e) => Err(Error::from_amqp(e)),
                    None => Ok(()),
                }
            }
            Via::Management => {
                let lock =
                    d.message.lock_token.ok_or_else(|| Error::Invalid("no lock token".into()))?;
                let req = ManagementRequest::UpdateDisposition {
                    lock_tokens: vec![lock],
                    settle: how,
                    session_id: session.map(|s| s.session_id.clone()),
                };
                self.management(session, req).await.map(|_| ())
            }
        }
    }

    /// Runs a `$management` request: one of a session through the session's connection,
    /// while the session is held (the request names it).
    pub(crate) async fn management(
        &self,
        session: Option<&SessionHold>,
        req: ManagementRequest,
    ) -> Result<ManagementReply, Error> {
        match session {
            Some(s) => {
                if s.conn.engine.is_closed() || !s.attached.load(Ordering::Acquire) {
                    return Err(lost(true));
                }
                self.mgmt.call(&self.client, &s.conn, &self.entity, req).await
            }
            None => {
                let conn = self.client.connection().await?;
                self.mgmt.call(&self.client, &conn, &self.entity, req).await
            }
        }
    }

    async fn renew_lock(&self, d: &ServiceBusDelivery) -> Result<Timestamp, Error> {
        let lock =
            d.message.lock_token.ok_or_else(|| Error::Invalid("the message has no lock".into()))?;
        if let Via::Link { engine, attached, .. } = &d.via
            && (engine.is_closed() || !attached.load(Ordering::Acquire))
        {
            // The lock belongs to the link, which is gone: a renewal through `$management`
            // could still keep the message locked on the service, for a delivery that can
            // never be settled; so the lock is lost here, at once.
            return Err(lost(false));
        }
        let req = ManagementRequest::RenewLock { lock_tokens: vec![lock] };
        match self.management(None, req).await? {
            ManagementReply::Expirations(t) if !t.is_empty() => Ok(t[0]),
            _ => Err(Error::Invalid("renew-lock reply without an expiration".into())),
        }
    }

    pub(crate) async fn peek(
        &self,
        session: Option<&SessionHold>,
        from: Option<SequenceNumber>,
        max: u32,
    ) -> Result<Vec<ReceivedMessage>, Error> {
        let req = ManagementRequest::PeekMessage {
            from: from.map_or(1, SequenceNumber::get).max(0),
            count: i64::from(max.max(1)),
            session_id: session.map(|s| s.session_id.clone()),
        };
        let mut out = Vec::new();
        for item in messages(self.management(session, req).await?) {
            let mut message = mapping::decode_received(&item.message)
                .map_err(|e| Error::Invalid(e.to_string()))?;
            // A peeked message is not locked, whatever its annotations say.
            message.lock_token = None;
            message.locked_until = None;
            out.push(message);
        }
        Ok(out)
    }

    pub(crate) async fn receive_deferred(
        &self,
        session: Option<&SessionHold>,
        seqs: &[SequenceNumber],
    ) -> Result<Vec<ServiceBusDelivery>, Error> {
        let req = ManagementRequest::ReceiveBySequenceNumber {
            sequence_numbers: seqs.to_vec(),
            receive_and_delete: self.options.mode == ReceiveMode::ReceiveAndDelete,
            session_id: session.map(|s| s.session_id.clone()),
        };
        let mut out = Vec::new();
        for item in messages(self.management(session, req).await?) {
            let mut message = mapping::decode_received(&item.message)
                .map_err(|e| Error::Invalid(e.to_string()))?;
            if let Some(lock) = item.lock_token {
                message.lock_token = Some(lock);
            }
            let via = if message.lock_token.is_some() { Via::Management } else { Via::Unlocked };
            out.push(ServiceBusDelivery { message, via, settled: Default::default() });
        }
        Ok(out)
    }
}

/// The messages of a `peek-message` or `receive-by-sequence-number` reply.
fn messages(reply: ManagementReply) -> Vec<ReplyMessage> {
    match reply {
        ManagementReply::Messages(m) => m,
        _ => Vec::new(),
    }
}

pub(crate) fn lost(session: bool) -> Error {
    let condition =
        if session { condition::SESSION_LOCK_LOST } else { condition::MESSAGE_LOCK_LOST };
    Error::Amqp {
        condition: condition.into(),
        description: Some("the link the message came on is gone".into()),
    }
}

impl Receiver {
    /// The entity path.
    pub fn entity_path(&self) -> &str {
        &self.shared.entity
    }

    /// The entity's properties (lock duration, MaxDeliveryCount, time to live, sessions,
    /// duplicate detection), read once from the namespace's administration API
    /// ([`ClientOptions::admin_endpoint`](crate::ClientOptions::admin_endpoint)) unless
    /// [`ReceiverOptions::entity_info`] gave them; [`ReceiverOptions::message_time_to_live`]
    /// overrides the time to live read. Reading needs the `Manage` claim. The processor reads
    /// them as it starts ([`twice::Transport::read_entity`]); when it cannot, the receiver
    /// warns and goes on with what the options say, or the Service Bus defaults.
    ///
    /// # Errors
    ///
    /// When the API cannot be reached, refuses the key, or has no such entity
    /// ([`Error::is_not_found`], [`Error::is_unauthorized`]).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe.
    pub async fn entity_properties(&self) -> Result<EntityInfo, Error> {
        self.shared.read_entity().await
    }

    /// Receives up to `max_messages`, waiting up to `max_wait` for the first. Connects and
    /// attaches as needed; after a lost link it attaches again within the same wait.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe once attached: messages not yet returned stay buffered for the next call.
    /// A drop during an attach leaves that link unused until the connection closes.
    pub async fn receive_messages(
        &self,
        max_messages: usize,
        max_wait: Duration,
    ) -> Result<Vec<ServiceBusDelivery>, Error> {
        let clock = self.shared.client.options.clock.clone();
        let deadline = clock.now().saturating_add(max_wait);
        let mut guard = self.link.lock().await;
        loop {
            let alive = guard.as_ref().is_some_and(|l| !l.conn.engine.is_closed());
            if !alive {
                let conn = self.shared.client.connection().await?;
                let (link, _) = attach_receiver(&self.shared, &conn, None, None).await?;
                *guard = Some(link);
            }
            let Some(link) = guard.as_mut() else { continue };
            let left = deadline.duration_since(clock.now());
            match self.shared.read(link, max_messages, left).await {
                Ok(v) => return Ok(v),
                Err(e) => {
                    *guard = None;
                    match e {
                        Some(e) if !e.is_transient() => return Err(e),
                        _ if clock.now() >= deadline => return Ok(Vec::new()),
                        _ => {
                            tracing::debug!(entity = %self.shared.entity, "receiver link lost; attaching again")
                        }
                    }
                }
            }
        }
    }

    /// Completes a message.
    pub async fn complete_message(&self, d: &ServiceBusDelivery) -> Result<(), Error> {
        self.shared.settle(d, Settle::Complete, None).await
    }

    /// Abandons a message, merging `properties` into its application properties.
    pub async fn abandon_message(
        &self,
        d: &ServiceBusDelivery,
        properties: Properties,
    ) -> Result<(), Error> {
        self.shared.settle(d, Settle::Abandon(properties), None).await
    }

    /// Moves a message to the dead-letter queue with a reason and description.
    pub async fn dead_letter_message(
        &self,
        d: &ServiceBusDelivery,
        reason: DeadLetterReason,
    ) -> Result<(), Error> {
        self.shared.settle(d, Settle::DeadLetter(reason, Properties::new()), None).await
    }

    /// Defers a message: it stays, receivable only by sequence number.
    pub async fn defer_message(&self, d: &ServiceBusDelivery) -> Result<(), Error> {
        self.shared.settle(d, Settle::Defer(Properties::new()), None).await
    }

    /// Renews a message's lock through `$management`; returns the new locked-until time.
    pub async fn renew_message_lock(&self, d: &ServiceBusDelivery) -> Result<Timestamp, Error> {
        self.shared.renew_lock(d).await
    }

    /// Receives deferred messages by sequence number (through `$management`).
    pub async fn receive_deferred_messages(
        &self,
        seqs: &[SequenceNumber],
    ) -> Result<Vec<ServiceBusDelivery>, Error> {
        self.shared.receive_deferred(None, seqs).await
    }

    /// Peeks at up to `max` messages from sequence number `from` on (`None`: from the first),
    /// through `$management` (`com.microsoft:peek-message`): nothing is locked, no delivery
    /// count grows, and the messages stay for every receiver. Works on queues, subscriptions
    /// and their `$DeadLetterQueue`s; to page through an entity, ask again from the last
    /// sequence number plus one. An empty result means nothing from `from` on.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a peek changes nothing.
    pub async fn peek_messages(
        &self,
        from: Option<SequenceNumber>,
        max: u32,
    ) -> Result<Vec<ReceivedMessage>, Error> {
        self.shared.peek(None, from, max).await
    }

    /// Releases `held` (messages this receiver took and did not settle) and every message
    /// already buffered or on its way, after taking back the link's credit so that none of
    /// them is delivered to this receiver again, then detaches the link. The messages are
    /// available to other receivers at once (with no delivery counted), rather than when
    /// their locks expire as after [`Receiver::close`].
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe: messages not yet released when the future is dropped stay locked until
    /// their locks expire.
    pub async fn release_and_close(&self, held: Vec<ServiceBusDelivery>) {
        let mut guard = self.link.lock().await;
        let mut all = held;
        if let Some(link) = guard.as_mut() {
            link.conn.engine.stop_credit(link.handle, link.id);
            // Transfers the service sent before it saw the credit go.
            while let Ok(Some(LinkEvent::Delivery(d))) =
                tokio::time::timeout(IN_FLIGHT_WAIT, link.events.recv()).await
            {
                all.extend(self.shared.delivery(link, d));
            }
        }
        for d in &all {
            let _ = self.shared.settle(d, Settle::Release, None).await;
        }
        if let Some(l) = guard.take() {
            l.conn.engine.detach(l.handle, l.id);
        }
    }

    /// Detaches the link; buffered messages go back when their locks expire.
    pub async fn close(&self) {
        if let Some(l) = self.link.lock().await.take() {
            l.conn.engine.detach(l.handle, l.id);
        }
    }
}

impl twice::Receive for Receiver {
    type Delivery = ServiceBusDelivery;

    async fn receive(
        &self,
        max_messages: usize,
        max_wait: Duration,
    ) -> Result<Vec<ServiceBusDelivery>, TransportError> {
        Ok(self.receive_messages(max_messages, max_wait).await?)
    }

    async fn complete(&self, d: &ServiceBusDelivery) -> Result<(), TransportError> {
        Ok(self.complete_message(d).await?)
    }

    async fn abandon(
        &self,
        d: &ServiceBusDelivery,
        properties: Properties,
    ) -> Result<(), TransportError> {
        Ok(self.abandon_message(d, properties).await?)
    }

    async fn dead_letter(
        &self,
        d: &ServiceBusDelivery,
        reason: DeadLetterReason,
    ) -> Result<(), TransportError> {
        Ok(self.dead_letter_message(d, reason).await?)
    }

    async fn defer(&self, d: &ServiceBusDelivery) -> Result<(), TransportError> {
        Ok(self.defer_message(d).await?)
    }
}

impl twice::Transport for Receiver {
    fn entity(&self) -> &EntityInfo {
        self.shared.info()
    }

    fn claim_scope(&self) -> &str {
        &self.shared.scope
    }

    async fn read_entity(&self) -> Result<EntityInfo, TransportError> {
        Ok(self.shared.read_entity_or_defaults().await)
    }

    fn system(&self) -> &'static str {
        "servicebus"
    }

    async fn release(&self, d: &ServiceBusDelivery) -> Result<(), TransportError> {
        Ok(self.shared.settle(d, Settle::Release, None).await?)
    }

    async fn renew_lock(&self, d: &ServiceBusDelivery) -> Result<Timestamp, TransportError> {
        Ok(self.renew_message_lock(d).await?)
    }
}

/// Takes back a link's credit when dropped, if `open`.
struct CreditBack {
    engine: Engine,
    handle: u32,
    id: u64,
    open: bool,
}

impl Drop for CreditBack {
    fn drop(&mut self) {
        if self.open {
            self.engine.stop_credit(self.handle, self.id);
        }
    }
}

/// The claim scope of an entity path: Service Bus compares entity names (and the
/// `$DeadLetterQueue` sub-queue's) without case, so every spelling of one entity is one scope;
/// a dead-letter queue keeps its suffix and is a scope of its own.
fn claim_scope(path: &str) -> String {
    path.trim_matches('/').to_ascii_lowercase()
}

/// The connection and id of a locked session.
#[derive(Debug)]
pub(crate) struct SessionHold {
    pub(crate) conn: Arc<Conn>,
    pub(crate) session_id: SessionId,
    /// Whether the session's link is still attached: the session lock is the link's.
    pub(crate) attached: Arc<AtomicBool>,
}
