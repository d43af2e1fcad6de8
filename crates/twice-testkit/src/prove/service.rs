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
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

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
        ServiceClient { addr: self.addr }
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
            // A broken connection only ends that call; the client sees an error.
            let _ = answer(stream, keys, &ledger).await;
        });
    }
}

/// Answers the one request of a connection and closes it.
async fn answer(stream: TcpStream, keys: Keys, ledger: &Mutex<Ledger>) -> std::io::Result<()> {
    let (read, mut write) = stream.into_split();
    let mut read = BufReader::new(read);
    let Some(request) = read_message(&mut read).await? else { return Ok(()) };
    let path = request.start.split_whitespace().nth(1).unwrap_or("/").to_owned();
    let (status, body) = {
        let mut l = ledger.lock().unwrap_or_else(PoisonError::into_inner);
        let n = l.calls.len() + 1;
        let key = request.idempotency_key.clone();
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
        l.calls.push(Call {
            path,
            idempotency_key: key,
            body: request.body,
            effect: replay.is_none(),
            failed,
        });
        if failed { (503, "{\"error\":\"timed out\"}".to_owned()) } else { (200, answer) }
    };
    let head = format!(
        "HTTP/1.1 {status} {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n",
        if status == 200 { "OK" } else { "Service Unavailable" },
        body.len()
    );
    write.write_all(head.as_bytes()).await?;
    write.write_all(body.as_bytes()).await?;
    write.shutdown().await
}

/// One parsed HTTP/1.1 message.
struct HttpMessage {
    start: String,
    idempotency_key: Option<String>,
    body: Vec<u8>,
}

/// Reads one HTTP/1.1 message with a Content-Length body; `None` on a clean end of stream.
async fn read_message<R: AsyncBufReadExt + Unpin>(
    r: &mut R,
) -> std::io::Result<Option<HttpMessage>> {
    let mut start = String::new();
    if r.read_line(&mut start).await? == 0 {
        return Ok(None);
    }
    let mut len = 0usize;
    let mut idempotency_key = None;
    let mut line = String::new();
    loop {
        line.clear();
        if r.read_line(&mut line).await? == 0 {
            return Err(std::io::Error::other("connection closed inside the headers"));
        }
        let l = line.trim_end();
        if l.is_empty() {
            break;
        }
        if let Some((name, value)) = l.split_once(':') {
            let value = value.trim();
            if name.eq_ignore_ascii_case("content-length") {
                len = value.parse().map_err(std::io::Error::other)?;
            } else if name.eq_ignore_ascii_case("idempotency-key") {
                idempotency_key = Some(value.to_owned());
            }
        }
    }
    if len > 1 << 20 {
        return Err(std::io::Error::other("body too large"));
    }
    let mut body = vec![0; len];
    r.read_exact(&mut body).await?;
    Ok(Some(HttpMessage { start: start.trim_end().to_owned(), idempotency_key, body }))
}

/// A client of a [`FakeService`]: one connection per call.
#[derive(Clone, Debug)]
pub struct ServiceClient {
    addr: SocketAddr,
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
        let stream = TcpStream::connect(self.addr).await?;
        let (read, mut write) = stream.into_split();
        let key = idempotency_key.map(|k| format!("Idempotency-Key: {k}\r\n")).unwrap_or_default();
        let head = format!(
            "POST {path} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\n{key}\
             Content-Length: {}\r\n\r\n",
            self.addr,
            body.len()
        );
        write.write_all(head.as_bytes()).await?;
        write.write_all(body).await?;
        let mut read = BufReader::new(read);
        let answer = read_message(&mut read)
            .await?
            .ok_or_else(|| std::io::Error::other("the service closed the connection"))?;
        let status = answer.start.split_whitespace().nth(1).unwrap_or("");
        if status != "200" {
            return Err(std::io::Error::other(format!(
                "the service answered {status}: {}",
                String::from_utf8_lossy(&answer.body)
            )));
        }
        Ok(answer.body)
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
}
