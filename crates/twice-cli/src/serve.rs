//! `twice serve`: the broker over AMQP 1.0 for the official Service Bus SDKs.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context as _;
use twice::Stopwatch;
use twice_broker::config::Config;
use twice_broker::{Broker, BrokerOptions};
use twice_servicebus::sas::Keys;
use twice_servicebus::{Server, ServerOptions};

/// Options of `twice serve`.
#[derive(Debug, clap::Args)]
pub(crate) struct ServeArgs {
    /// The entities, in the Service Bus emulator's Config.json format (applied on every start;
    /// entities already in the data directory stay). Without it the broker starts with what its
    /// data directory holds.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// The AMQP address. 5673 by default, because 5672 is RabbitMQ's on many machines; binding
    /// beyond loopback must be asked for.
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:5673")]
    amqp: SocketAddr,
    /// The HTTP address for `/health`, `/metrics` and `/entities`.
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:5300")]
    http: SocketAddr,
    /// Serve no HTTP port.
    #[arg(long, conflicts_with = "http")]
    no_http: bool,
    /// Where the broker keeps its data; it restarts with every acknowledged message.
    #[arg(long, value_name = "DIR", default_value = "twice-data", conflicts_with = "in_memory")]
    data_dir: PathBuf,
    /// Keep nothing on disk (for tests): everything is gone when the process ends.
    #[arg(long)]
    in_memory: bool,
    /// A shared access key, as NAME=KEY; repeatable. Default: the emulator's
    /// RootManageSharedAccessKey=SAS_KEY_VALUE, so its connection string works unchanged.
    #[arg(long = "sas-key", value_name = "NAME=KEY", value_parser = parse_key)]
    sas_keys: Vec<(String, String)>,
    /// The most connections served at once; one more is answered with
    /// `amqp:resource-limit-exceeded`.
    #[arg(long, value_name = "N", default_value_t = 1024,
          value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    max_connections: u32,
    /// The largest AMQP frame accepted, in bytes (512 to 16 MiB).
    #[arg(long, value_name = "BYTES", default_value_t = 1024 * 1024,
          value_parser = clap::value_parser!(u32).range(512..=16 * 1024 * 1024))]
    max_frame_size: u32,
    /// The most links one AMQP session may attach.
    #[arg(long, value_name = "N", default_value_t = 256,
          value_parser = clap::value_parser!(u32).range(1..=65_536))]
    max_links_per_session: u32,
    /// The most unsettled deliveries one receiver link may hold.
    #[arg(long, value_name = "N", default_value_t = 5000,
          value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    max_unsettled_per_link: u32,
    /// Serve amqps (TLS, as Azure does on port 5671) with this certificate chain (PEM); needs
    /// --tls-key. The printed connection string then leaves out UseDevelopmentEmulator, so
    /// clients use TLS.
    #[arg(long, value_name = "FILE", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// The private key (PEM) of --tls-cert.
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
}

fn parse_key(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((name, key)) if !name.is_empty() && !key.is_empty() => {
            Ok((name.to_owned(), key.to_owned()))
        }
        _ => Err("expected NAME=KEY, both non-empty".to_owned()),
    }
}

/// Runs the server until SIGINT or SIGTERM.
pub(crate) async fn run(args: ServeArgs) -> anyhow::Result<ExitCode> {
    let started = Stopwatch::start();
    let mut options = if args.in_memory {
        BrokerOptions::in_memory()
    } else {
        BrokerOptions::durable(&args.data_dir)
    };
    if let Some(path) = &args.config {
        let config = Config::from_path(path)
            .with_context(|| format!("reading the configuration {}", path.display()))?;
        options = options.with_config(config);
    }
    if !args.in_memory {
        std::fs::create_dir_all(&args.data_dir)
            .with_context(|| format!("creating the data directory {}", args.data_dir.display()))?;
    }
    let broker = Broker::open(options).await.context("opening the broker")?;
    let keys = if args.sas_keys.is_empty() {
        Keys::emulator_default()
    } else {
        let mut keys = Keys::new();
        for (name, key) in &args.sas_keys {
            keys.insert(name, key);
        }
        keys
    };
    let server_options = ServerOptions::new()
        .amqp_addr(args.amqp)
        .http_addr(if args.no_http { None } else { Some(args.http) })
        .keys(keys)
        .max_connections(usize::try_from(args.max_connections).unwrap_or(usize::MAX))
        .max_frame_size(args.max_frame_size)
        .max_links_per_session(usize::try_from(args.max_links_per_session).unwrap_or(usize::MAX))
        .max_unsettled_per_link(args.max_unsettled_per_link);
    let server_options = match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => {
            let read =
                |p: &PathBuf| std::fs::read(p).with_context(|| format!("reading {}", p.display()));
            server_options
                .tls_pem(&read(cert)?, &read(key)?)
                .context("loading the TLS certificate")?
        }
        _ => server_options,
    };
    let server = Server::bind(server_options, broker.clone()).await?;
    let storage = if args.in_memory {
        "in memory (nothing is kept)".to_owned()
    } else {
        format!("durable in {}", args.data_dir.display())
    };
    let scheme = if args.tls_cert.is_some() { "amqps (TLS)" } else { "AMQP 1.0" };
    println!("twice serve: Service Bus over {scheme} on {}, {storage}", server.amqp_addr());
    if let Some(http) = server.http_addr() {
        println!(
            "health and metrics: http://{http}/health  http://{http}/metrics  http://{http}/entities"
        );
    }
    println!("connection string: {}", server.connection_string());
    println!("ready in {} ms; Ctrl-C stops", started.elapsed().as_millis());
    server.run(shutdown_signal()).await.context("serving")?;
    broker.shutdown().await;
    println!("twice serve: stopped; every acknowledged message is on disk");
    Ok(ExitCode::SUCCESS)
}

/// Resolves on SIGINT or SIGTERM.
async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let term = signal(SignalKind::terminate());
    let int = signal(SignalKind::interrupt());
    match (term, int) {
        (Ok(mut term), Ok(mut int)) => {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
        }
        // Without signal handlers, Ctrl-C still ends the process (without the clean flush).
        _ => std::future::pending().await,
    }
}
