//! A TCP proxy whose connections a test can cut, to see a client lose its connection to a real
//! server without stopping the server (which other tests share), and which can rewrite what
//! passes through it, to show a client a server that behaves as another version would
//! ([`amqp`]), a connection that dies at an exact point ([`CutAfter`]), or a request that never
//! reaches the server ([`nats::Swallow`]).

pub mod amqp;
pub mod nats;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::{AbortHandle, JoinHandle};

/// What happens to a connection after a chunk has been forwarded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flow {
    /// Go on.
    Continue,
    /// Close both sides now: nothing more passes in either direction.
    Cut,
}

/// Rewrites the bytes of one proxied connection. Each call gets what was read from one side and
/// appends to `out` what to write to the other; the proxy reads one side at a time, so a
/// [`Flow::Cut`] after a chunk to the server means the server's answer never reaches the client.
pub trait Rewrite: Send + 'static {
    /// Bytes from the client, on their way to the server.
    fn to_server(&mut self, bytes: &[u8], out: &mut Vec<u8>) -> Flow {
        out.extend_from_slice(bytes);
        Flow::Continue
    }

    /// Bytes from the server, on their way to the client.
    fn to_client(&mut self, bytes: &[u8], out: &mut Vec<u8>) -> Flow {
        out.extend_from_slice(bytes);
        Flow::Continue
    }
}

/// Forwards everything as it is.
#[derive(Debug, Default)]
pub struct Verbatim;

impl Rewrite for Verbatim {}

/// Cuts the connection right after the first chunk from the client that contains `needle` has
/// reached the server, before any answer comes back: the server acted on the request, and the
/// client never hears that it did. Armed once for the whole proxy (every connection shares it).
#[derive(Clone, Debug)]
pub struct CutAfter {
    needle: Vec<u8>,
    armed: Arc<AtomicBool>,
}

impl CutAfter {
    /// Arms a cut after the first client chunk containing `needle`.
    pub fn new(needle: impl Into<Vec<u8>>) -> Self {
        Self { needle: needle.into(), armed: Arc::new(AtomicBool::new(true)) }
    }

    /// Whether the cut has happened.
    pub fn fired(&self) -> bool {
        !self.armed.load(Ordering::SeqCst)
    }
}

impl Rewrite for CutAfter {
    fn to_server(&mut self, bytes: &[u8], out: &mut Vec<u8>) -> Flow {
        out.extend_from_slice(bytes);
        let hit =
            !self.needle.is_empty() && bytes.windows(self.needle.len()).any(|w| w == self.needle);
        if hit && self.armed.swap(false, Ordering::SeqCst) { Flow::Cut } else { Flow::Continue }
    }
}

type Factory = Arc<dyn Fn() -> Box<dyn Rewrite> + Send + Sync>;

/// A proxy on a free loopback port to one server; stops on `Drop`.
#[derive(Debug)]
pub struct Proxy {
    addr: SocketAddr,
    // A std Mutex: held to push or drain handles, never across an await.
    connections: Arc<Mutex<Vec<AbortHandle>>>,
    accept: JoinHandle<()>,
}

impl Proxy {
    /// Starts a proxy to `target` (`host:port`) that forwards everything as it is.
    ///
    /// # Errors
    ///
    /// When `target` does not accept a connection, or no port is free.
    pub async fn start(target: &str) -> std::io::Result<Self> {
        Self::start_with(target, || Box::new(Verbatim)).await
    }

    /// Starts a proxy to `target` whose connections each pass through a rewrite made by
    /// `rewrite`.
    ///
    /// # Errors
    ///
    /// When `target` does not accept a connection, or no port is free.
    pub async fn start_with(
        target: &str,
        rewrite: impl Fn() -> Box<dyn Rewrite> + Send + Sync + 'static,
    ) -> std::io::Result<Self> {
        drop(TcpStream::connect(target).await?);
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let connections: Arc<Mutex<Vec<AbortHandle>>> = Arc::default();
        let target = target.to_owned();
        let list = Arc::clone(&connections);
        let factory: Factory = Arc::new(rewrite);
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let target = target.clone();
                let rewrite = factory();
                let task = tokio::spawn(async move {
                    if let Ok(server) = TcpStream::connect(&target).await {
                        let _ = relay(client, server, rewrite).await;
                    }
                });
                list.lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .push(task.abort_handle());
            }
        });
        Ok(Self { addr, connections, accept })
    }

    /// The address clients connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Closes every connection made so far; new ones are proxied as before.
    pub fn cut(&self) {
        let cut: Vec<_> = std::mem::take(
            &mut *self.connections.lock().unwrap_or_else(std::sync::PoisonError::into_inner),
        );
        for c in cut {
            c.abort();
        }
    }
}

/// Copies both ways through `rewrite`, one read at a time, until a side closes or the rewrite
/// cuts.
async fn relay(
    mut client: TcpStream,
    mut server: TcpStream,
    mut rewrite: Box<dyn Rewrite>,
) -> std::io::Result<()> {
    let (mut from_client, mut to_server_buf) = (vec![0u8; 64 * 1024], Vec::new());
    let (mut from_server, mut to_client_buf) = (vec![0u8; 64 * 1024], Vec::new());
    loop {
        // Reading a TcpStream is cancel safe: the branch not taken read nothing.
        tokio::select! {
            n = client.read(&mut from_client) => {
                let n = n?;
                if n == 0 {
                    return Ok(());
                }
                to_server_buf.clear();
                let flow = rewrite.to_server(&from_client[..n], &mut to_server_buf);
                server.write_all(&to_server_buf).await?;
                if flow == Flow::Cut {
                    server.flush().await?;
                    return Ok(());
                }
            }
            n = server.read(&mut from_server) => {
                let n = n?;
                if n == 0 {
                    return Ok(());
                }
                to_client_buf.clear();
                let flow = rewrite.to_client(&from_server[..n], &mut to_client_buf);
                client.write_all(&to_client_buf).await?;
                if flow == Flow::Cut {
                    return Ok(());
                }
            }
        }
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.cut();
        self.accept.abort();
    }
}
