//! The client: options, the connection (made on first use, made again after a loss with
//! exponential backoff and jitter), claims-based security and request/response links.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use rand::Rng;
use tokio::sync::oneshot;
use twice::{SharedClock, Timestamp};
use twice_amqp::codec::Value;
use twice_amqp::performative::{ROLE_RECEIVER, ROLE_SENDER, desc, described_list};
use twice_amqp::servicebus::{
    ManagementReply, ManagementRequest, OPERATION, Reply, Request, SERVER_TIMEOUT,
};
use uuid::Uuid;

use crate::connstr::ConnectionString;
use crate::endpoint::AdminEndpoint;
use crate::engine::{Engine, LinkEvent, LinkSpec};
use crate::error::Error;
use crate::tls::TlsOptions;
use crate::token::{SasKeyProvider, SasSignatureProvider, TokenProvider, refresh_at};

/// How the client reconnects.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RetryOptions {
    /// The wait after the first failed attempt (default 100 ms); it doubles with every
    /// further failure.
    pub initial_backoff: Duration,
    /// The longest wait between attempts (default 30 s).
    pub max_backoff: Duration,
}

impl Default for RetryOptions {
    fn default() -> Self {
        Self { initial_backoff: Duration::from_millis(100), max_backoff: Duration::from_secs(30) }
    }
}

impl RetryOptions {
    /// The wait before attempt `failures + 1`: exponential, capped, with jitter (a random
    /// point in its upper half), so that many clients cut off together do not return together.
    pub fn backoff(&self, failures: u32) -> Duration {
        let exp = self.initial_backoff.saturating_mul(1u32 << failures.saturating_sub(1).min(20));
        let cap = exp.min(self.max_backoff);
        let half = cap / 2;
        half + rand::rng().random_range(Duration::ZERO..=half)
    }
}

/// What a client connects to and how.
#[derive(Clone)]
pub struct ClientOptions {
    host: String,
    port: u16,
    tls: Option<TlsOptions>,
    token_provider: Arc<dyn TokenProvider>,
    pub(crate) clock: SharedClock,
    retry: RetryOptions,
    operation_timeout: Duration,
    admin_endpoint: Option<AdminEndpoint>,
}

impl fmt::Debug for ClientOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClientOptions")
            .field("host", &self.host)
            .field("port", &self.port)
            .field("tls", &self.tls)
            .field("token_provider", &self.token_provider)
            .field("retry", &self.retry)
            .field("operation_timeout", &self.operation_timeout)
            .field("admin_endpoint", &self.admin_endpoint)
            .finish()
    }
}

impl ClientOptions {
    /// A namespace at `host:port` with these credentials, over TLS with the webpki roots
    /// (what Azure needs).
    pub fn new(host: impl Into<String>, port: u16, token_provider: impl TokenProvider) -> Self {
        Self {
            host: host.into(),
            port,
            tls: Some(TlsOptions::webpki_roots()),
            token_provider: Arc::new(token_provider),
            clock: SharedClock::system(),
            retry: RetryOptions::default(),
            operation_timeout: Duration::from_secs(60),
            admin_endpoint: None,
        }
    }

    /// Options from a connection string: its host and port, TLS unless it names a
    /// development emulator, and its key or signature.
    pub fn from_connection_string(s: &str) -> Result<Self, Error> {
        let cs: ConnectionString = s.parse()?;
        let mut o = match (cs.key_name(), cs.key(), cs.signature()) {
            (_, _, Some(sig)) => Self::new(cs.host(), cs.port(), SasSignatureProvider::new(sig)?),
            (Some(name), Some(key), None) => {
                Self::new(cs.host(), cs.port(), SasKeyProvider::new(name, key))
            }
            _ => return Err(Error::ConnectionString("no credentials".into())),
        };
        if !cs.use_tls() {
            o.tls = None;
        }
        Ok(o)
    }

    /// TLS settings, or `None` for plain AMQP (the emulator, `twice serve` without TLS).
    #[must_use]
    pub fn tls(mut self, tls: Option<TlsOptions>) -> Self {
        self.tls = tls;
        self
    }

    /// The token provider (SAS key, SAS signature, Entra ID).
    #[must_use]
    pub fn token_provider(mut self, provider: impl TokenProvider) -> Self {
        self.token_provider = Arc::new(provider);
        self
    }

    /// The clock used for token refresh and backoff.
    #[must_use]
    pub fn clock(mut self, clock: SharedClock) -> Self {
        self.clock = clock;
        self
    }

    /// Reconnect backoff.
    #[must_use]
    pub fn retry(mut self, retry: RetryOptions) -> Self {
        self.retry = retry;
        self
    }

    /// How long a connect, attach, send or management request may take (default 60 s).
    #[must_use]
    pub fn operation_timeout(mut self, timeout: Duration) -> Self {
        self.operation_timeout = timeout;
        self
    }

    /// Where the namespace's administration API is, from which a receiver reads its entity's
    /// properties (default: `https://HOST` with TLS, as Azure serves it; `http://HOST:5300`
    /// without, the emulator's and `twice serve`'s default `--http`).
    #[must_use]
    pub fn admin_endpoint(mut self, endpoint: Option<AdminEndpoint>) -> Self {
        self.admin_endpoint = endpoint;
        self
    }

    /// Where the namespace's administration API is: the one set, or the default.
    pub fn get_admin_endpoint(&self) -> AdminEndpoint {
        self.admin_endpoint.clone().unwrap_or_else(|| match self.tls {
            Some(_) => AdminEndpoint::https(self.host.clone(), 443),
            None => AdminEndpoint::http(self.host.clone(), 5300),
        })
    }

    /// The token provider.
    pub(crate) fn provider(&self) -> &dyn TokenProvider {
        self.token_provider.as_ref()
    }

    /// The host.
    pub fn get_host(&self) -> &str {
        &self.host
    }

    /// The port.
    pub fn get_port(&self) -> u16 {
        self.port
    }

    /// The TLS settings, if the client uses TLS.
    pub fn get_tls(&self) -> Option<&TlsOptions> {
        self.tls.as_ref()
    }

    /// The clock used for token refresh and backoff.
    pub fn get_clock(&self) -> &SharedClock {
        &self.clock
    }

    /// Reconnect backoff.
    pub fn get_retry(&self) -> &RetryOptions {
        &self.retry
    }

    /// How long a connect, attach, send or management request may take.
    pub fn get_operation_timeout(&self) -> Duration {
        self.operation_timeout
    }
}

/// A connection to a Service Bus namespace, shared by the senders and receivers made from it.
/// Cheap to clone.
#[derive(Clone, Debug)]
pub struct ServiceBusClient {
    pub(crate) inner: Arc<Inner>,
}

#[derive(Debug)]
pub(crate) struct Inner {
    pub(crate) options: ClientOptions,
    slot: tokio::sync::Mutex<Slot>,
}

#[derive(Debug, Default)]
struct Slot {
    conn: Option<Arc<Conn>>,
    failures: u32,
    retry_at: Option<Timestamp>,
}

/// One live connection and what it holds: the `$cbs` link pair and the tokens put on it.
#[derive(Debug)]
pub(crate) struct Conn {
    pub(crate) engine: Engine,
    cbs: tokio::sync::Mutex<Option<Rpc>>,
    authorized: Mutex<HashSet<String>>,
}

impl ServiceBusClient {
    /// A client with these options. Nothing connects until the first operation.
    pub fn new(options: ClientOptions) -> Self {
        Self { inner: Arc::new(Inner { options, slot: tokio::sync::Mutex::new(Slot::default()) }) }
    }

    /// A client for a connection string (`Endpoint=sb://…;SharedAccessKeyName=…;…`).
    pub fn from_connection_string(s: &str) -> Result<Self, Error> {
        Ok(Self::new(ClientOptions::from_connection_string(s)?))
    }

    /// The options.
    pub fn options(&self) -> &ClientOptions {
        &self.inner.options
    }

    /// Connects now (the first operation would otherwise), so a wrong address or key shows at
    /// once.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a connection made after the future is dropped is kept for the next call.
    pub async fn connect(&self) -> Result<(), Error> {
        self.inner.connection().await.map(|_| ())
    }

    /// Closes the connection; later operations connect again.
    pub async fn close(&self) {
        let mut slot = self.inner.slot.lock().await;
        if let Some(c) = slot.conn.take() {
            c.engine.close();
        }
    }
}

impl Inner {
    /// The live connection, made (again) if needed. After a failure the next attempt waits
    /// out the backoff first.
    pub(crate) async fn connection(&self) -> Result<Arc<Conn>, Error> {
        let mut slot = self.slot.lock().await;
        if let Some(c) = slot.conn.as_ref().filter(|c| !c.engine.is_closed()) {
            return Ok(c.clone());
        }
        if let Some(at) = slot.retry_at {
            self.options.clock.sleep_until(at).await;
        }
        let o = &self.options;
        let attempt = tokio::time::timeout(
            o.operation_timeout,
            crate::tls::connect(&o.host, o.port, o.tls.as_ref()),
        )
        .await;
        match attempt.unwrap_or(Err(Error::Timeout)) {
            Ok(engine) => {
                tracing::debug!(host = %o.host, port = o.port, "connected");
                slot.failures = 0;
                slot.retry_at = None;
                let conn = Arc::new(Conn {
                    engine,
                    cbs: tokio::sync::Mutex::new(None),
                    authorized: Mutex::new(HashSet::new()),
                });
                slot.conn = Some(conn.clone());
                Ok(conn)
            }
            Err(e) => {
                slot.failures = slot.failures.saturating_add(1);
                let wait = o.retry.backoff(slot.failures);
                tracing::debug!(error = %e, failures = slot.failures, ?wait, "connect failed");
                slot.retry_at = Some(o.clock.now().saturating_add(wait));
                slot.conn = None;
                Err(e)
            }
        }
    }

    /// The audience of an entity's token.
    fn audience(&self, entity: &str) -> String {
        format!("sb://{}/{}", self.options.host, entity)
    }
}

impl Conn {
    /// Puts a token for `entity` on this connection unless one is there, and keeps it fresh
    /// until the connection closes.
    pub(crate) async fn authorize(
        self: &Arc<Self>,
        inner: &Arc<Inner>,
        entity: &str,
    ) -> Result<(), Error> {
        let audience = inner.audience(entity);
        if self.lock_authorized().contains(&audience) {
            return Ok(());
        }
        let expires_at = self.put_token(inner, &audience).await?;
        if !self.lock_authorized().insert(audience.clone()) {
            return Ok(());
        }
        let conn = Arc::downgrade(self);
        let inner = Arc::downgrade(inner);
        tokio::spawn(refresh(conn, inner, audience, expires_at));
        Ok(())
    }

    fn lock_authorized(&self) -> std::sync::MutexGuard<'_, HashSet<String>> {
        // A panic while holding this lock cannot leave the set inconsistent; go on with it.
        self.authorized.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    async fn put_token(&self, inner: &Inner, audience: &str) -> Result<Timestamp, Error> {
        let token = inner.options.token_provider.token(audience).await?;
        let rpc = {
            let mut cbs = self.cbs.lock().await;
            match cbs.as_ref().filter(|r| !r.is_closed()) {
                Some(r) => r.clone(),
                None => {
                    let r = Rpc::open(&self.engine, "$cbs").await?;
                    *cbs = Some(r.clone());
                    r
                }
            }
        };
        let request = put_token_request(&token, audience);
        let reply = rpc.request(request, inner.options.operation_timeout).await?;
        reply_ok(reply, "put-token")?;
        Ok(token.expires_at())
    }
}

/// A `$cbs` put-token request.
fn put_token_request(token: &crate::token::AccessToken, audience: &str) -> Request {
    let mut request = Request::new("put-token", Value::string(token.token()));
    request.properties = put_token_properties(token, audience);
    request
}

/// The application properties of a `$cbs` put-token request: the token's type tells the
/// service how to read it (a shared access signature, or an Entra ID `jwt`).
fn put_token_properties(token: &crate::token::AccessToken, audience: &str) -> Vec<(Value, Value)> {
    vec![
        (Value::string(OPERATION), Value::string("put-token")),
        (Value::string("type"), Value::string(token.token_type().as_cbs_type())),
        (Value::string("name"), Value::string(audience)),
        (Value::string("expiration"), Value::Timestamp(token.expires_at().as_millis())),
    ]
}

/// Puts a fresh token before the old one expires, for as long as the connection lives.
async fn refresh(
    conn: Weak<Conn>,
    inner: Weak<Inner>,
    audience: String,
    mut expires_at: Timestamp,
) {
    loop {
        let Some(clock) = inner.upgrade().map(|i| i.options.clock.clone()) else { return };
        let at = refresh_at(clock.now(), expires_at);
        clock.sleep_until(at).await;
        let (Some(c), Some(i)) = (conn.upgrade(), inner.upgrade()) else { return };
        if c.engine.is_closed() {
            return;
        }
        match c.put_token(&i, &audience).await {
            Ok(t) => {
                tracing::debug!(%audience, "token refreshed");
                expires_at = t;
            }
            Err(e) => {
                tracing::warn!(%audience, error = %e, "token refresh failed; retrying");
                drop(c);
                clock.sleep(Duration::from_secs(5)).await;
            }
        }
    }
}

/// A `$management` or `$cbs` reply as a result: a 2xx status is success.
fn reply_ok(reply: Reply, operation: &str) -> Result<Reply, Error> {
    if reply.is_success() {
        Ok(reply)
    } else {
        Err(Error::Management {
            operation: operation.to_owned(),
            status: reply.status,
            condition: reply.condition,
            description: reply.description,
        })
    }
}

type Pending = Arc<Mutex<HashMap<Uuid, oneshot::Sender<Reply>>>>;

/// A request/response link pair on a node (`$cbs`, `<entity>/$management`).
#[derive(Debug, Clone)]
pub(crate) struct Rpc {
    engine: Engine,
    handle: u32,
    id: u64,
    reply_to: String,
    pending: Pending,
}

impl Rpc {
    /// Attaches the reply link, then the request link.
    pub(crate) async fn open(engine: &Engine, node: &str) -> Result<Self, Error> {
        let reply_to = format!("twice-reply-{}", Uuid::new_v4().simple());
        let source = |a: &str| described_list(desc::SOURCE, vec![Value::string(a)]);
        let target = |a: &str| described_list(desc::TARGET, vec![Value::string(a)]);
        let receiver = engine
            .attach(LinkSpec {
                name: format!("{reply_to}-receiver"),
                role: ROLE_RECEIVER,
                snd_settle_mode: None,
                rcv_settle_mode: None,
                source: Some(source(node)),
                target: Some(target(&reply_to)),
                properties: None,
                initial_credit: 200,
                auto_credit: true,
            })
            .await?;
        let sender = engine
            .attach(LinkSpec {
                name: format!("{reply_to}-sender"),
                role: ROLE_SENDER,
                snd_settle_mode: Some(1),
                rcv_settle_mode: None,
                source: Some(source(&reply_to)),
                target: Some(target(node)),
                properties: None,
                initial_credit: 0,
                auto_credit: false,
            })
            .await?;
        let pending: Pending = Arc::default();
        let Some(mut events) = receiver.events else {
            return Err(Error::Invalid("a receiver link without events".into()));
        };
        let routes = pending.clone();
        tokio::spawn(async move {
            while let Some(LinkEvent::Delivery(d)) = events.recv().await {
                let Ok(reply) = Reply::parse(&d.payload) else { continue };
                let Value::Uuid(id) = reply.correlation_id else { continue };
                let waiter =
                    routes.lock().unwrap_or_else(std::sync::PoisonError::into_inner).remove(&id);
                if let Some(w) = waiter {
                    let _ = w.send(reply);
                }
            }
            // The link or the connection is gone: every caller still waiting sees that.
            routes.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clear();
        });
        Ok(Self { engine: engine.clone(), handle: sender.handle, id: sender.id, reply_to, pending })
    }

    pub(crate) fn is_closed(&self) -> bool {
        self.engine.is_closed()
    }

    pub(crate) fn engine_id(&self) -> u64 {
        self.engine.id()
    }

    /// Sends a request and waits up to `timeout` for its reply.
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe: the request may still be carried out after the future is dropped.
    pub(crate) async fn request(
        &self,
        mut request: Request,
        timeout: Duration,
    ) -> Result<Reply, Error> {
        let id = Uuid::new_v4();
        request.message_id = Value::Uuid(id);
        request.reply_to = Some(self.reply_to.clone());
        let payload = request.encode();
        let (tx, rx) = oneshot::channel();
        self.pending.lock().unwrap_or_else(std::sync::PoisonError::into_inner).insert(id, tx);
        let result = tokio::time::timeout(timeout, async {
            self.engine.send(self.handle, self.id, payload, 0, true).await?;
            rx.await.map_err(|_| Error::ConnectionLost)
        })
        .await;
        self.pending.lock().unwrap_or_else(std::sync::PoisonError::into_inner).remove(&id);
        result.unwrap_or(Err(Error::Timeout))
    }
}

/// A `$management` link pair of one entity, opened on first use and again after a reconnect.
#[derive(Debug, Default)]
pub(crate) struct Management {
    rpc: tokio::sync::Mutex<Option<Rpc>>,
}

impl Management {
    /// The entity's management links on `conn`.
    pub(crate) async fn on(
        &self,
        inner: &Arc<Inner>,
        conn: &Arc<Conn>,
        entity: &str,
    ) -> Result<Rpc, Error> {
        let mut rpc = self.rpc.lock().await;
        if let Some(r) =
            rpc.as_ref().filter(|r| !r.is_closed() && r.engine_id() == conn.engine.id())
        {
            return Ok(r.clone());
        }
        conn.authorize(inner, entity).await?;
        let r = Rpc::open(&conn.engine, &format!("{entity}/$management")).await?;
        *rpc = Some(r.clone());
        Ok(r)
    }

    /// Runs an operation on the entity's management node and reads its reply; 204 (nothing
    /// found) is a success with an empty body.
    pub(crate) async fn call(
        &self,
        inner: &Arc<Inner>,
        conn: &Arc<Conn>,
        entity: &str,
        request: ManagementRequest,
    ) -> Result<ManagementReply, Error> {
        let rpc = self.on(inner, conn, entity).await?;
        let op = request.operation();
        let mut envelope = request.to_request();
        envelope.properties.push((
            Value::string(SERVER_TIMEOUT),
            Value::Uint(
                u32::try_from(inner.options.operation_timeout.as_millis()).unwrap_or(u32::MAX),
            ),
        ));
        let reply = rpc.request(envelope, inner.options.operation_timeout).await?;
        let reply = reply_ok(reply, op.name())?;
        ManagementReply::parse(op, &reply.body)
            .map_err(|e| Error::Invalid(format!("{op} reply: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::token::{AccessToken, TokenType};

    fn prop<'a>(props: &'a [(Value, Value)], key: &str) -> Option<&'a Value> {
        props.iter().find(|(k, _)| k.as_str() == Some(key)).map(|(_, v)| v)
    }

    /// An Entra ID token goes to `$cbs` as type `jwt`, a SAS token as the SAS type; both name
    /// the audience and carry the expiry as a timestamp (what the SDKs send, research §4).
    #[test]
    fn put_token_names_the_token_type() {
        let at = Timestamp::from_millis(1_700_000_000_000);
        let jwt = AccessToken::new("eyJ0eXAi", TokenType::Jwt, at);
        let props = put_token_properties(&jwt, "sb://ns.servicebus.windows.net/orders");
        assert_eq!(prop(&props, "operation"), Some(&Value::string("put-token")));
        assert_eq!(prop(&props, "type"), Some(&Value::string("jwt")));
        assert_eq!(
            prop(&props, "name"),
            Some(&Value::string("sb://ns.servicebus.windows.net/orders"))
        );
        assert_eq!(prop(&props, "expiration"), Some(&Value::Timestamp(1_700_000_000_000)));
        let sas =
            AccessToken::new("SharedAccessSignature sr=x", TokenType::SharedAccessSignature, at);
        let props = put_token_properties(&sas, "sb://h/q");
        assert_eq!(prop(&props, "type"), Some(&Value::string("servicebus.windows.net:sastoken")));
    }

    #[test]
    fn backoff_grows_with_jitter_and_a_cap() {
        let r = RetryOptions::default();
        for failures in 1..30 {
            let exp =
                r.initial_backoff.saturating_mul(1 << (failures - 1).min(20)).min(r.max_backoff);
            let d = r.backoff(failures);
            assert!(d >= exp / 2 && d <= exp, "{failures}: {d:?} outside [{:?}, {exp:?}]", exp / 2);
        }
        assert!(r.backoff(40) <= r.max_backoff);
    }
}
