//! A TCP proxy whose connections a test can cut, to see a client lose its connection to a real
//! server without stopping the server (which other tests share).

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use tokio::net::{TcpListener, TcpStream};
use tokio::task::{AbortHandle, JoinHandle};

/// A proxy on a free loopback port to one server; stops on `Drop`.
#[derive(Debug)]
pub struct Proxy {
    addr: SocketAddr,
    // A std Mutex: held to push or drain handles, never across an await.
    connections: Arc<Mutex<Vec<AbortHandle>>>,
    accept: JoinHandle<()>,
}

impl Proxy {
    /// Starts a proxy to `target` (`host:port`).
    ///
    /// # Errors
    ///
    /// When `target` does not accept a connection, or no port is free.
    pub async fn start(target: &str) -> std::io::Result<Self> {
        drop(TcpStream::connect(target).await?);
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let connections: Arc<Mutex<Vec<AbortHandle>>> = Arc::default();
        let target = target.to_owned();
        let list = Arc::clone(&connections);
        let accept = tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                let target = target.clone();
                let task = tokio::spawn(async move {
                    if let Ok(mut server) = TcpStream::connect(&target).await {
                        let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
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

impl Drop for Proxy {
    fn drop(&mut self) {
        self.cut();
        self.accept.abort();
    }
}
