//! `twice serve` in process on a free port, on an in-memory broker whose clock the tests move.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::sync::oneshot;
use twice::{Clock, ManualClock, SharedClock, SystemClock};
use twice_broker::config::QueueProperties;
use twice_broker::{Broker, BrokerOptions};
use twice_servicebus::{Server, ServerOptions};
use twice_servicebus_client::{AdminEndpoint, ClientOptions, ServiceBusClient};

/// A running server; stops when dropped.
pub(crate) struct Serve {
    pub(crate) addr: SocketAddr,
    /// The administration API's address, when the server serves one.
    pub(crate) http: Option<SocketAddr>,
    pub(crate) connection_string: String,
    pub(crate) broker: Broker,
    pub(crate) clock: ManualClock,
    options: ServerOptions,
    stop: Option<oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Serve {
    /// A server with queues `q` (lock 30 s, 3 deliveries), `dup` (duplicate detection),
    /// `sess` (sessions).
    pub(crate) async fn start() -> Self {
        Self::start_with(ServerOptions::new()).await
    }

    pub(crate) async fn start_with(options: ServerOptions) -> Self {
        Self::start_serving(options.http_addr(None)).await
    }

    /// As [`Serve::start`], with the HTTP port (the administration API) on a free port.
    pub(crate) async fn start_with_admin() -> Self {
        let http = SocketAddr::from(([127, 0, 0, 1], 0));
        Self::start_serving(ServerOptions::new().http_addr(Some(http))).await
    }

    async fn start_serving(options: ServerOptions) -> Self {
        let clock = ManualClock::new(SystemClock.now());
        let shared = SharedClock::from(clock.clone());
        let broker =
            Broker::open(BrokerOptions::in_memory().clock(shared)).await.expect("open broker");
        let q = QueueProperties::default()
            .with_lock_duration(Duration::from_secs(30))
            .with_max_delivery_count(3);
        broker.create_queue("q", q.clone()).await.expect("queue");
        let mut dup = q.clone();
        dup.requires_duplicate_detection = true;
        dup.duplicate_detection_history_time_window = Duration::from_secs(600);
        broker.create_queue("dup", dup).await.expect("queue");
        let mut sess = q;
        sess.requires_session = true;
        broker.create_queue("sess", sess).await.expect("queue");
        let options = options.amqp_addr(SocketAddr::from(([127, 0, 0, 1], 0)));
        let mut s = Self {
            addr: options.get_amqp_addr(),
            http: None,
            connection_string: String::new(),
            broker,
            clock,
            options,
            stop: None,
            task: None,
        };
        s.listen().await;
        s
    }

    async fn listen(&mut self) {
        let options =
            self.options.clone().amqp_addr(self.addr).clock(SharedClock::from(self.clock.clone()));
        let server = Server::bind(options, self.broker.clone()).await.expect("bind");
        self.addr = server.amqp_addr();
        self.http = server.http_addr();
        self.connection_string = server.connection_string();
        let (stop, stopped) = oneshot::channel::<()>();
        self.stop = Some(stop);
        self.task = Some(tokio::spawn(async move {
            let _ = server
                .run(async move {
                    let _ = stopped.await;
                })
                .await;
        }));
    }

    /// Stops serving: every connection is closed and new ones are refused until
    /// [`Serve::resume`].
    pub(crate) async fn pause(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.task.take() {
            let _ = t.await;
        }
    }

    /// Serves again on the same port and broker.
    pub(crate) async fn resume(&mut self) {
        self.listen().await;
    }

    /// Stops serving (closing every connection) and serves again on the same port and broker:
    /// what a client sees of a broker restart or a network cut.
    pub(crate) async fn restart(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.task.take() {
            let _ = t.await;
        }
        self.listen().await;
    }

    /// A client with this server's connection string.
    pub(crate) fn client(&self) -> ServiceBusClient {
        let options = ClientOptions::from_connection_string(&self.connection_string)
            .expect("connection string")
            .operation_timeout(Duration::from_secs(10))
            .admin_endpoint(self.http.map(|a| AdminEndpoint::http(a.ip().to_string(), a.port())));
        ServiceBusClient::new(options)
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
    }
}

impl Serve {
    /// The server's current time.
    pub(crate) fn clock_now(&self) -> twice::Timestamp {
        self.clock.now()
    }
}
