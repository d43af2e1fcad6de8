//! A fake external service (a payment or mail API) on a loopback HTTP port: it records every
//! call with its `Idempotency-Key` header, and counts the effects that really happened by
//! request path.
//!
//! Two modes: [`Keys::Honour`] treats a call whose key it has seen before as a replay (the
//! original answer, no new effect), as payment and mail APIs do; [`Keys::Ignore`] makes every
//! call an effect. The kit arms a service to fail calls for its transient-error scenario: such
//! a call *takes effect* and then answers 503, as a response lost to a timeout does, so a
//! retry without the same key repeats the effect.

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use http_body_util::{BodyExt as _, Full, Limited};
use hyper::StatusCode;
use hyper::body::{Bytes, Incoming};
use hyper::header::{CONTENT_TYPE, HeaderValue};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use twice_servicebus_client::http::{self, Method, Target};

/// The largest request or answer body.
const MAX_BODY: usize = 1 << 20;

/// What the service makes of an `Idempotency-Key` header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Keys {
    /// A call whose key was seen before is a replay: the first answer again, no new effect.
    Honour,
    /// Every call is a new effect, key or not.
    Ignore,
}

/// One call the service received.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Call {
    /// The request path, which names what the call acts on (`/charges/order-7`): effects are
    /// counted by it.
    pub path: String,
    /// The `Idempotency-Key` header, if the call had one.
    pub idempotency_key: Option<String>,
    /// The request body.
    pub body: Vec<u8>,
    /// Whether the call had an effect (false for a replay of a key).
    pub effect: bool,
    /// Whether the service answered it with an error (after the effect, if any).
    pub failed: bool,
}

#[derive(Debug, Default)]
struct Ledger {
    calls: Vec<Call>,
    answers_by_key: HashMap<String, String>,
    /// Calls still to be failed (armed by the kit's transient-error scenario).
    fail_next: usize,
}

/// A running fake service; the server stops when it is dropped.
#[derive(Debug)]
pub struct FakeService {
    addr: SocketAddr,
    keys: Keys,
    // A std Mutex: held for a few map operations, never across an await.
    ledger: Arc<Mutex<Ledger>>,
    task: JoinHandle<()>,
}

impl FakeService {
    /// Starts a service on a free loopback port.
    ///
    /// # Errors
    ///
    /// When no loopback port can be bound.
    pub async fn start(keys: Keys) -> std::io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let ledger = Arc::new(Mutex::new(Ledger::default()));
        let task = tokio::spawn(serve(listener, keys, Arc::clone(&ledger)));
        Ok(Self { addr, keys, ledger, task })
    }

    /// The service's address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// How the service treats idempotency keys.
    pub fn keys(&self) -> Keys {
        self.keys
    }

    /// A client of this service, for the handler under test.
    pub fn client(&self) -> ServiceClient {
        ServiceClient { target: Target::http(self.addr.ip().to_string(), self.addr.port()) }
    }

    /// Every call received so far, in order.
    pub fn calls(&self) -> Vec<Call> {
        self.lock().calls.clone()
    }

    /// Effects that really happened on `path`.
    pub fn effects_on(&self, path: &str) -> u64 {
        self.lock().calls.iter().filter(|c| c.effect && c.path == path).count() as u64
    }

    /// Effects by path.
    pub fn effects(&self) -> HashMap<String, u64> {
        let mut by_path = HashMap::new();
        for c in self.lock().calls.iter().filter(|c| c.effect) {
            *by_path.entry(c.path.clone()).or_default() += 1;
        }
        by_path
    }

    /// Makes the next `n` calls take effect and then answer 503.
    pub(crate) fn fail_next(&self, n: usize) {
        self.lock().fail_next = n;
    }

    /// Calls answered with an error so far.
    pub(crate) fn failed_calls(&self) -> usize {
        self.lock().calls.iter().filter(|c| c.failed).count()
    }

    fn lock(&self) -> MutexGuard<'_, Ledger> {
        self.ledger.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Drop for FakeService {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn serve(listener: TcpListener, keys: Keys, ledger: Arc<Mutex<Ledger>>) {
    loop {
        let Ok((stream, _)) = listener.accept().await else { continue };
        let ledger = Arc::clone(&ledger);
        tokio::spawn(async move {
            let service = service_fn(|request: hyper::Request<Incoming>| {
                let ledger = Arc::clone(&ledger);
                async move { Ok::<_, Infallible>(answer(request, keys, &ledger).await) }
            });
            // One request per connection, as the client makes them; a broken connection only
            // ends that call, and the client sees an error.
            let _ = http1::Builder::new()
                .keep_alive(false)
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

/// Records one call and answers it.
async fn answer(
    request: hyper::Request<Incoming>,
    keys: Keys,
    ledger: &Mutex<Ledger>,
) -> hyper::Response<Full<Bytes>> {
    let path = request.uri().path_and_query().map_or("/", |p| p.as_str()).to_owned();
    let key = request
        .headers()
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .map(|v| v.trim().to_owned());
    let body = match Limited::new(request.into_body(), MAX_BODY).collect().await {
        Ok(body) => body.to_bytes().to_vec(),
        Err(e) => {
            return json(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("{{\"error\":{:?}}}", e.to_string()),
            );
        }
    };
    let mut l = ledger.lock().unwrap_or_else(PoisonError::into_inner);
    let n = l.calls.len() + 1;
    let replay = match (keys, &key) {
        (Keys::Honour, Some(k)) => l.answers_by_key.get(k).cloned(),
        _ => None,
    };
    let answer = replay.clone().unwrap_or_else(|| format!("{{\"id\":\"effect-{n}\"}}"));
    let failed = replay.is_none() && l.fail_next > 0;
    if failed {
        l.fail_next -= 1;
    }
    if let (None, Some(k)) = (&replay, &key) {
        l.answers_by_key.insert(k.clone(), answer.clone());
    }
    l.calls.push(Call { path, idempotency_key: key, body, effect: replay.is_none(), failed });
    if failed {
        json(StatusCode::SERVICE_UNAVAILABLE, "{\"error\":\"timed out\"}".to_owned())
    } else {
        json(StatusCode::OK, answer)
    }
}

fn json(status: StatusCode, body: String) -> hyper::Response<Full<Bytes>> {
    let mut response = hyper::Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

/// A client of a [`FakeService`]: one connection per call.
#[derive(Clone, Debug)]
pub struct ServiceClient {
    target: Target,
}

impl ServiceClient {
    /// POSTs `body` to `path`, with an `Idempotency-Key` header when `idempotency_key` is
    /// given; returns the answer's body.
    ///
    /// # Errors
    ///
    /// A connection error, or an answer other than 200 (the call may still have taken
    /// effect: retry it with the same key).
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe: a call cut off midway may or may not have reached the service.
    pub async fn post(
        &self,
        path: &str,
        idempotency_key: Option<&str>,
        body: &[u8],
    ) -> std::io::Result<Vec<u8>> {
        let mut request = http::Request::new(Method::POST, path)
            .body("application/json", body.to_vec())
            .max_body(MAX_BODY);
        if let Some(k) = idempotency_key {
            request = request.header("Idempotency-Key", k);
        }
        let answer = http::request(&self.target, request).await.map_err(std::io::Error::other)?;
        if answer.status() != StatusCode::OK {
            return Err(std::io::Error::other(format!(
                "the service answered {}: {}",
                answer.status().as_u16(),
                answer.text()
            )));
        }
        Ok(answer.into_body().to_vec())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn an_honoured_key_makes_a_replay_no_effect_and_an_ignored_one_does_not() {
        let honour = FakeService::start(Keys::Honour).await.unwrap();
        let c = honour.client();
        let a = c.post("/charges/7", Some("k1"), b"{}").await.unwrap();
        let b = c.post("/charges/7", Some("k1"), b"{}").await.unwrap();
        assert_eq!(a, b, "a replay returns the first answer");
        c.post("/charges/7", None, b"{}").await.unwrap();
        assert_eq!(honour.effects_on("/charges/7"), 2);
        assert_eq!(honour.calls().len(), 3);
        assert_eq!(honour.calls()[1].idempotency_key.as_deref(), Some("k1"));

        let ignore = FakeService::start(Keys::Ignore).await.unwrap();
        let c = ignore.client();
        c.post("/charges/7", Some("k1"), b"{}").await.unwrap();
        c.post("/charges/7", Some("k1"), b"{}").await.unwrap();
        assert_eq!(ignore.effects_on("/charges/7"), 2);
    }

    #[tokio::test]
    async fn a_failed_call_takes_effect_and_its_keyed_retry_does_not() {
        let s = FakeService::start(Keys::Honour).await.unwrap();
        s.fail_next(1);
        let c = s.client();
        let err = c.post("/mail/1", Some("k"), b"{}").await.expect_err("armed to fail");
        assert!(err.to_string().contains("503"), "{err}");
        c.post("/mail/1", Some("k"), b"{}").await.expect("the retry is a replay");
        assert_eq!(s.effects_on("/mail/1"), 1);
        assert_eq!(s.failed_calls(), 1);
    }

    /// The service answers one call per connection and closes it, even when the client would
    /// keep it open: each call of the kit is a connection of its own.
    #[tokio::test]
    async fn a_connection_carries_one_call() {
        let s = FakeService::start(Keys::Honour).await.unwrap();
        let target = Target::http(s.addr().ip().to_string(), s.addr().port());
        let wait = std::time::Duration::from_secs(10);
        let mut conn = http::Connection::open(&target, wait).await.unwrap();
        let call = http::Request::new(Method::POST, "/charges/1")
            .header("Idempotency-Key", "k")
            .body("application/json", "{}");
        let answer = conn.send(&call).await.unwrap();
        assert_eq!(answer.status(), StatusCode::OK);
        assert_eq!(answer.text(), "{\"id\":\"effect-1\"}");
        let closed = async {
            while conn.is_open() {
                tokio::task::yield_now().await;
            }
        };
        tokio::time::timeout(wait, closed).await.expect("the service closes the connection");
        assert_eq!(s.calls()[0].idempotency_key.as_deref(), Some("k"));
        assert_eq!(s.calls()[0].path, "/charges/1");
    }
}
