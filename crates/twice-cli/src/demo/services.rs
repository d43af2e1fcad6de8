//! The payment and mail services of the demo: separate components on their own loopback HTTP
//! servers, which honour an `Idempotency-Key` header the way many payment and email APIs do.
//!
//! They count the effects that really happened (charges made, emails sent) per order, which is
//! what the demo's verdict is about. A request without a key always has an effect; a request
//! whose key was seen before returns the original answer and has none.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use anyhow::{Context, anyhow, bail};
use serde::Deserialize;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// What a service records: effects by order, and the idempotency keys it has answered.
#[derive(Debug, Default)]
struct Ledger {
    effects_by_order: HashMap<u64, u32>,
    effects: u64,
    replays: u64,
    answers_by_key: HashMap<String, String>,
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
struct Request {
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
        let ledger = Arc::clone(&ledger);
        let ids = Arc::clone(&ids);
        tokio::spawn(async move {
            // A connection error only ends that connection; the client retries on a new one.
            let _ = serve_connection(stream, name, ledger, ids).await;
        });
    }
}

async fn serve_connection(
    stream: TcpStream,
    name: &'static str,
    ledger: Arc<Mutex<Ledger>>,
    ids: Arc<Mutex<u64>>,
) -> anyhow::Result<()> {
    let (read, mut write) = stream.into_split();
    let mut read = BufReader::new(read);
    while let Some(req) = read_message(&mut read, true).await? {
        let (status, body) = match serde_json::from_slice::<Request>(&req.body) {
            Err(e) => (400, format!("{{\"error\":{:?}}}", e.to_string())),
            Ok(r) => {
                let mut l = ledger.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                match req.idempotency_key.as_ref().and_then(|k| l.answers_by_key.get(k)) {
                    Some(answer) => {
                        let answer = answer.clone();
                        l.replays += 1;
                        (200, answer)
                    }
                    None => {
                        let id = {
                            let mut n =
                                ids.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                            *n += 1;
                            *n
                        };
                        let answer = format!("{{\"id\":\"{name}-{id}\"}}");
                        *l.effects_by_order.entry(r.order_id).or_default() += 1;
                        l.effects += 1;
                        if let Some(k) = req.idempotency_key {
                            l.answers_by_key.insert(k, answer.clone());
                        }
                        (200, answer)
                    }
                }
            }
        };
        let head = format!(
            "HTTP/1.1 {status} {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            if status == 200 { "OK" } else { "Bad Request" },
            body.len()
        );
        write.write_all(head.as_bytes()).await?;
        write.write_all(body.as_bytes()).await?;
    }
    Ok(())
}

/// One parsed HTTP/1.1 message (request or response).
struct HttpMessage {
    status: u16,
    idempotency_key: Option<String>,
    body: Vec<u8>,
}

/// Reads one HTTP/1.1 message with a Content-Length body; `None` on a clean end of stream.
async fn read_message<R: AsyncBufReadExt + Unpin>(
    r: &mut R,
    is_request: bool,
) -> anyhow::Result<Option<HttpMessage>> {
    let mut line = String::new();
    if r.read_line(&mut line).await? == 0 {
        return Ok(None);
    }
    let status = if is_request {
        0
    } else {
        line.split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| anyhow!("malformed status line {line:?}"))?
    };
    let mut len = 0usize;
    let mut idempotency_key = None;
    loop {
        line.clear();
        if r.read_line(&mut line).await? == 0 {
            bail!("connection closed inside the headers");
        }
        let l = line.trim_end();
        if l.is_empty() {
            break;
        }
        if let Some((name, value)) = l.split_once(':') {
            let value = value.trim();
            if name.eq_ignore_ascii_case("content-length") {
                len = value.parse().context("bad Content-Length")?;
            } else if name.eq_ignore_ascii_case("idempotency-key") {
                idempotency_key = Some(value.to_owned());
            }
        }
    }
    if len > 1 << 20 {
        bail!("body of {len} bytes is too large");
    }
    let mut body = vec![0; len];
    r.read_exact(&mut body).await?;
    Ok(Some(HttpMessage { status, idempotency_key, body }))
}

/// A keep-alive HTTP client for one service.
#[derive(Debug)]
pub(crate) struct Client {
    addr: SocketAddr,
    // Idle connections; a std Mutex held only to push or pop.
    idle: Mutex<Vec<BufReader<TcpStream>>>,
}

impl Client {
    /// A client of the service at `addr`.
    pub(crate) fn new(addr: SocketAddr) -> Self {
        Self { addr, idle: Mutex::new(Vec::new()) }
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
        let pooled = self.idle.lock().unwrap_or_else(std::sync::PoisonError::into_inner).pop();
        let mut conn = match pooled {
            Some(c) => c,
            None => {
                let s = TcpStream::connect(self.addr).await.context("connecting to the service")?;
                s.set_nodelay(true)?;
                BufReader::new(s)
            }
        };
        let key = idempotency_key.map(|k| format!("Idempotency-Key: {k}\r\n")).unwrap_or_default();
        let head = format!(
            "POST {path} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\n{key}Content-Length: {}\r\n\r\n",
            self.addr,
            body.len()
        );
        conn.get_mut().write_all(head.as_bytes()).await?;
        conn.get_mut().write_all(body).await?;
        let resp = read_message(&mut conn, false)
            .await?
            .ok_or_else(|| anyhow!("the service closed the connection"))?;
        if resp.status != 200 {
            bail!("the service answered {}: {}", resp.status, String::from_utf8_lossy(&resp.body));
        }
        self.idle.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(conn);
        Ok(resp.body)
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
}
