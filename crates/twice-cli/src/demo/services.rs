//! The payment and mail services of the demo: separate components on their own loopback HTTP
//! servers, which honour an `Idempotency-Key` header the way many payment and email APIs do.
//!
//! They count the effects that really happened (charges made, emails sent) per order, which is
//! what the demo's verdict is about. A request without a key always has an effect; a request
//! whose key was seen before returns the original answer and has none.

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, bail};
use http_body_util::{BodyExt as _, Full, Limited};
use hyper::StatusCode;
use hyper::body::{Bytes, Incoming};
use hyper::header::{CONTENT_TYPE, HeaderValue};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use serde::Deserialize;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use twice_servicebus_client::http::{self, Connection, Method, Target};

/// The largest request or answer body.
const MAX_BODY: usize = 1 << 20;
/// How long a call may take, connection included.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// What a service records: effects by order, and the idempotency keys it has answered.
#[derive(Debug, Default)]
struct Ledger {
    effects_by_order: HashMap<u64, u32>,
    effects: u64,
    replays: u64,
    answers_by_key: HashMap<String, String>,
    /// Connections accepted: a client keeps one open for its next call.
    connections: u64,
}

/// A running service (payments or mail).
#[derive(Debug)]
pub(crate) struct Service {
    addr: SocketAddr,
    // A std Mutex: held for a few map operations, never across an await.
    ledger: Arc<Mutex<Ledger>>,
    task: JoinHandle<()>,
}

#[derive(Deserialize)]
struct Call {
    order_id: u64,
}

impl Service {
    /// Starts a service on a free loopback port.
    pub(crate) async fn start(name: &'static str) -> anyhow::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await.context("binding a loopback port")?;
        let addr = listener.local_addr()?;
        let ledger = Arc::new(Mutex::new(Ledger::default()));
        let task = tokio::spawn(serve(listener, name, Arc::clone(&ledger)));
        Ok(Self { addr, ledger, task })
    }

    /// The service's address.
    pub(crate) fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Total effects (charges or emails) that really happened.
    pub(crate) fn effects(&self) -> u64 {
        self.lock().effects
    }

    /// Requests answered from the idempotency-key record instead of acting again.
    pub(crate) fn replays(&self) -> u64 {
        self.lock().replays
    }

    /// Effects for one order.
    pub(crate) fn effects_for(&self, order_id: u64) -> u32 {
        self.lock().effects_by_order.get(&order_id).copied().unwrap_or(0)
    }

    /// Connections accepted so far.
    #[cfg(test)]
    fn connections(&self) -> u64 {
        self.lock().connections
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Ledger> {
        self.ledger.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn serve(listener: TcpListener, name: &'static str, ledger: Arc<Mutex<Ledger>>) {
    let ids = Arc::new(Mutex::new(0u64));
    loop {
        let Ok((stream, _)) = listener.accept().await else { continue };
        let _ = stream.set_nodelay(true);
        ledger.lock().unwrap_or_else(std::sync::PoisonError::into_inner).connections += 1;
        let ledger = Arc::clone(&ledger);
        let ids = Arc::clone(&ids);
        tokio::spawn(async move {
            // Keep-alive: a client sends its requests one after another on one connection.
            let service = service_fn(|request: hyper::Request<Incoming>| {
                let (ledger, ids) = (Arc::clone(&ledger), Arc::clone(&ids));
                async move { Ok::<_, Infallible>(answer(request, name, &ledger, &ids).await) }
            });
            // A connection error only ends that connection; the client retries on a new one.
            let _ = http1::Builder::new().serve_connection(TokioIo::new(stream), service).await;
        });
    }
}

/// The answer to one request: the recorded answer for a key seen before, a new effect
/// otherwise.
async fn answer(
    request: hyper::Request<Incoming>,
    name: &'static str,
    ledger: &Mutex<Ledger>,
    ids: &Mutex<u64>,
) -> hyper::Response<Full<Bytes>> {
    let idempotency_key = request
        .headers()
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .map(|v| v.trim().to_owned());
    let body = match Limited::new(request.into_body(), MAX_BODY).collect().await {
        Ok(body) => body.to_bytes(),
        Err(e) => {
            return json(StatusCode::BAD_REQUEST, format!("{{\"error\":{:?}}}", e.to_string()));
        }
    };
    let order = match serde_json::from_slice::<Call>(&body) {
        Ok(r) => r,
        Err(e) => {
            return json(StatusCode::BAD_REQUEST, format!("{{\"error\":{:?}}}", e.to_string()));
        }
    };
    let mut l = ledger.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some(answer) = idempotency_key.as_ref().and_then(|k| l.answers_by_key.get(k)) {
        let answer = answer.clone();
        l.replays += 1;
        return json(StatusCode::OK, answer);
    }
    let id = {
        let mut n = ids.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        *n += 1;
        *n
    };
    let answer = format!("{{\"id\":\"{name}-{id}\"}}");
    *l.effects_by_order.entry(order.order_id).or_default() += 1;
    l.effects += 1;
    if let Some(k) = idempotency_key {
        l.answers_by_key.insert(k, answer.clone());
    }
    json(StatusCode::OK, answer)
}

fn json(status: StatusCode, body: String) -> hyper::Response<Full<Bytes>> {
    let mut response = hyper::Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

/// A keep-alive HTTP client for one service.
#[derive(Debug)]
pub(crate) struct Client {
    target: Target,
    // Idle connections; a std Mutex held only to push or pop.
    idle: Mutex<Vec<Connection>>,
}

impl Client {
    /// A client of the service at `addr`.
    pub(crate) fn new(addr: SocketAddr) -> Self {
        Self {
            target: Target::http(addr.ip().to_string(), addr.port()),
            idle: Mutex::new(Vec::new()),
        }
    }

    /// POSTs a JSON body, with an idempotency key when given; returns the response body.
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe: a request cut off midway may or may not have reached the service, which
    /// is exactly why callers pass an idempotency key.
    pub(crate) async fn post(
        &self,
        path: &str,
        idempotency_key: Option<&str>,
        body: &[u8],
    ) -> anyhow::Result<Vec<u8>> {
        let pooled = self.idle();
        let mut conn = match pooled {
            Some(c) => c,
            None => Connection::open(&self.target, REQUEST_TIMEOUT)
                .await
                .context("connecting to the service")?,
        };
        let mut request = http::Request::new(Method::POST, path)
            .body("application/json", body.to_vec())
            .timeout(REQUEST_TIMEOUT)
            .max_body(MAX_BODY);
        if let Some(k) = idempotency_key {
            request = request.header("Idempotency-Key", k);
        }
        let resp = conn.send(&request).await?;
        if resp.status() != StatusCode::OK {
            bail!("the service answered {}: {}", resp.status().as_u16(), resp.text());
        }
        self.idle.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(conn);
        Ok(resp.into_body().to_vec())
    }

    /// An idle connection the service has not closed.
    fn idle(&self) -> Option<Connection> {
        let mut idle = self.idle.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        while let Some(c) = idle.pop() {
            if c.is_open() {
                return Some(c);
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn keys_make_repeats_harmless_and_no_key_repeats_the_effect() {
        let svc = Service::start("payments").await.unwrap();
        let client = Client::new(svc.addr());
        let body = br#"{"order_id":7,"amount":100}"#;
        let a = client.post("/charges", Some("k1"), body).await.unwrap();
        let b = client.post("/charges", Some("k1"), body).await.unwrap();
        assert_eq!(a, b, "a replay returns the original answer");
        assert_eq!(svc.effects_for(7), 1);
        client.post("/charges", None, body).await.unwrap();
        client.post("/charges", None, body).await.unwrap();
        assert_eq!(svc.effects_for(7), 3);
        assert_eq!(svc.effects(), 3);
        assert_eq!(svc.replays(), 1);
        assert!(client.post("/charges", None, b"not json").await.is_err());
    }

    /// Calls one after another share one connection; one closed by the service is not used
    /// again.
    #[tokio::test]
    async fn calls_one_after_another_share_a_connection() {
        let svc = Service::start("mail").await.unwrap();
        let client = Client::new(svc.addr());
        for order in 0..5 {
            let body = format!(r#"{{"order_id":{order}}}"#);
            client.post("/emails", Some(&format!("k{order}")), body.as_bytes()).await.unwrap();
        }
        assert_eq!(svc.effects(), 5);
        assert_eq!(svc.connections(), 1, "keep-alive");
        // A rejected call drops its connection: the next one opens another.
        assert!(client.post("/emails", None, b"not json").await.is_err());
        client.post("/emails", None, br#"{"order_id":9}"#).await.unwrap();
        assert_eq!(svc.connections(), 2);
    }
}
