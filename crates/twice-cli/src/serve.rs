//! `twice serve`: the broker over AMQP 1.0 for the official Service Bus SDKs.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use twice::Stopwatch;
use twice_broker::config::Config;
use twice_broker::{Broker, BrokerOptions};
use twice_servicebus::dev_tls::DevCertificate;
use twice_servicebus::sas::{Claims, Keys};
use twice_servicebus::{Server, ServerError, ServerOptions};

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
    /// The host name clients reach the server by: it goes into the connection string, and
    /// tokens must name it in their audience (a server on loopback also takes `localhost`).
    #[arg(long, value_name = "NAME", default_value = "localhost")]
    hostname: String,
    /// Another host name the HTTP port answers to (repeatable), besides localhost, 127.0.0.1,
    /// ::1, --hostname and the --http address: a request naming any other in its Host header
    /// gets 421, except /health, so a web page that rebinds its own name to this address (DNS
    /// rebinding) reaches nothing.
    #[arg(long = "allow-host", value_name = "NAME")]
    allow_hosts: Vec<String>,
    /// The HTTP address for the web console, the administration API, `/health`, `/metrics`
    /// and `/entities` (https with --tls-cert).
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:5300")]
    http: SocketAddr,
    /// Serve no HTTP port.
    #[arg(long, conflicts_with = "http")]
    no_http: bool,
    /// The most HTTP requests answered at once; more wait for a slot.
    #[arg(long, value_name = "N", default_value_t = 64,
          value_parser = clap::value_parser!(u32).range(1..=4096))]
    http_max_answering: u32,
    /// The most HTTP connections still sending their request; a new one evicts the oldest, so
    /// idle sockets cannot lock out a client.
    #[arg(long, value_name = "N", default_value_t = 256,
          value_parser = clap::value_parser!(u32).range(1..=65_536))]
    http_max_receiving: u32,
    /// The largest HTTP request body accepted, in bytes (1 KiB to 64 MiB); a larger one gets
    /// 413 before it is sent.
    #[arg(long, value_name = "BYTES", default_value_t = 1024 * 1024,
          value_parser = clap::value_parser!(u32).range(1024..=64 * 1024 * 1024))]
    http_max_body: u32,
    /// Seconds an HTTP client has for its TLS handshake and its request, and the server for
    /// its answer.
    #[arg(long, value_name = "SECS", default_value_t = 10,
          value_parser = clap::value_parser!(u64).range(1..=3600))]
    http_timeout: u64,
    /// Where the broker keeps its data; it restarts with every acknowledged message.
    #[arg(long, value_name = "DIR", default_value = "twice-data", conflicts_with = "in_memory")]
    data_dir: PathBuf,
    /// Keep nothing on disk (for tests): everything is gone when the process ends.
    #[arg(long)]
    in_memory: bool,
    /// A shared access key, as NAME=KEY, or NAME=KEY:CLAIMS to allow only some of
    /// Send,Listen,Manage (Manage implies the others; without claims a key has all three);
    /// repeatable. Default: the emulator's RootManageSharedAccessKey=SAS_KEY_VALUE, so its
    /// connection string works unchanged.
    #[arg(long = "sas-key", value_name = "NAME=KEY[:CLAIMS]", value_parser = parse_key)]
    sas_keys: Vec<(String, String, Claims)>,
    /// The most connections served at once; one more is answered with
    /// `amqp:resource-limit-exceeded`. Capped so that connections never exhaust the
    /// process's file descriptors (whose soft limit is raised to the hard limit at start).
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
    /// The most queues and topics the namespace may hold (Service Bus Standard: 10,000).
    #[arg(long, value_name = "N", default_value_t = 10_000)]
    max_entities: usize,
    /// The most subscriptions one topic may have (Service Bus Standard: 2,000).
    #[arg(long, value_name = "N", default_value_t = 2_000)]
    max_subscriptions_per_topic: usize,
    /// The most rules one subscription may have.
    #[arg(long, value_name = "N", default_value_t = 2_000)]
    max_rules_per_subscription: usize,
    /// Serve amqps (TLS, as Azure does on port 5671) with this certificate chain (PEM), and
    /// https on the HTTP port; needs --tls-key. The printed connection string then leaves out
    /// UseDevelopmentEmulator, so clients use TLS.
    #[arg(long, value_name = "FILE", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// The private key (PEM) of --tls-cert.
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Serve plain http only on the HTTP port. Without it (and without --tls-cert), the port
    /// also speaks https with a development certificate made on first start in the data
    /// directory's `dev-https/` (a temporary directory with --in-memory), so that the SDKs'
    /// administration clients, which only speak https, work once they trust its `ca.pem`.
    #[arg(long, conflicts_with_all = ["tls_cert", "no_http"])]
    no_dev_https: bool,
}

fn parse_key(s: &str) -> Result<(String, String, Claims), String> {
    let (name, rest) = s.split_once('=').unwrap_or((s, ""));
    // Claims follow the last colon when they parse as claims; otherwise the colon is the key's.
    let (key, claims) = match rest.rsplit_once(':') {
        Some((key, list)) => match Claims::parse(list) {
            Some(claims) => (key, claims),
            None if list.chars().all(|c| c.is_ascii_alphabetic() || c == ',')
                && !list.is_empty() =>
            {
                return Err(format!("unknown claim in '{list}': expected Send, Listen or Manage"));
            }
            None => (rest, Claims::ALL),
        },
        None => (rest, Claims::ALL),
    };
    if name.is_empty() || key.is_empty() {
        return Err("expected NAME=KEY or NAME=KEY:CLAIMS, name and key non-empty".to_owned());
    }
    Ok((name.to_owned(), key.to_owned(), claims))
}

/// Runs the server until SIGINT or SIGTERM.
pub(crate) async fn run(args: ServeArgs) -> anyhow::Result<ExitCode> {
    let started = Stopwatch::start();
    let mut options = if args.in_memory {
        BrokerOptions::in_memory()
    } else {
        BrokerOptions::durable(&args.data_dir)
    }
    .max_entities(args.max_entities)
    .max_subscriptions_per_topic(args.max_subscriptions_per_topic)
    .max_rules_per_subscription(args.max_rules_per_subscription);
    if let Some(path) = &args.config {
        let config = Config::from_path(path)
            .with_context(|| format!("reading the configuration {}", path.display()))?;
        options = options.config(config);
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
        for (name, key, claims) in &args.sas_keys {
            keys.insert_with_claims(name, key, *claims);
        }
        keys
    };
    let default_key = args.sas_keys.is_empty();
    let fds = raise_descriptor_limit();
    let (max_connections, max_pending) = connection_limits(
        usize::try_from(args.max_connections).unwrap_or(usize::MAX),
        ServerOptions::new().get_max_pending_connections(),
        fds,
    );
    if max_connections < usize::try_from(args.max_connections).unwrap_or(usize::MAX) {
        eprintln!(
            "warning: serving at most {max_connections} connections, not {}: the process may open {} files",
            args.max_connections,
            fds.unwrap_or(0)
        );
    }
    if default_key && !args.amqp.ip().is_loopback() {
        eprintln!(
            "warning: listening on {} with the emulator's well-known key: anyone who can reach this address can use every entity; give your own key with --sas-key NAME=KEY",
            args.amqp
        );
    }
    let server_options = ServerOptions::new()
        .hostname(args.hostname.clone())
        .amqp_addr(args.amqp)
        .http_addr(if args.no_http { None } else { Some(args.http) })
        .keys(keys)
        .max_connections(max_connections)
        .max_pending_connections(max_pending)
        .max_frame_size(args.max_frame_size)
        .max_links_per_session(usize::try_from(args.max_links_per_session).unwrap_or(usize::MAX))
        .max_unsettled_per_link(args.max_unsettled_per_link)
        .max_http_answering(usize::try_from(args.http_max_answering).unwrap_or(usize::MAX))
        .max_http_receiving(usize::try_from(args.http_max_receiving).unwrap_or(usize::MAX))
        .max_http_body(usize::try_from(args.http_max_body).unwrap_or(usize::MAX))
        .http_receive_timeout(Duration::from_secs(args.http_timeout))
        .http_answer_timeout(Duration::from_secs(args.http_timeout));
    let server_options =
        args.allow_hosts.iter().fold(server_options, |o, name| o.allow_host(name.clone()));
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
    // Kept for the process's life: with --in-memory the development certificate is there.
    let mut dev_dir = None;
    let (server_options, dev_ca) = if args.tls_cert.is_none() && !args.no_http && !args.no_dev_https
    {
        let dir = if args.in_memory {
            let tmp = tempfile::Builder::new()
                .prefix("twice-serve-")
                .tempdir()
                .context("making a temporary directory for the development certificate")?;
            dev_dir.insert(tmp).path().to_owned()
        } else {
            args.data_dir.join("dev-https")
        };
        let cert = DevCertificate::load_or_create(&dir, &dev_names(&args.hostname, args.http))
            .context(
                "making the HTTP port's development certificate (--no-dev-https goes without)",
            )?;
        let options = server_options
            .http_tls_pem(&cert.cert_pem, &cert.key_pem)
            .context("loading the development certificate")?;
        let ca = std::path::absolute(&cert.ca_file).unwrap_or(cert.ca_file);
        (options, Some(ca))
    } else {
        (server_options, None)
    };
    let server = match Server::bind(server_options, broker.clone()).await {
        Ok(server) => server,
        // The AMQP port is bound first: an address both flags give is --amqp's.
        Err(ServerError::Bind { addr, source, .. }) => {
            let flag = if addr == args.amqp { "--amqp" } else { "--http" };
            return Err(crate::errors::bind_error(flag, addr, &source));
        }
        Err(e) => return Err(e.into()),
    };
    let storage = if args.in_memory {
        "in memory (nothing is kept)".to_owned()
    } else {
        format!("durable in {}", args.data_dir.display())
    };
    let scheme = if args.tls_cert.is_some() { "amqps (TLS)" } else { "AMQP 1.0" };
    println!("twice serve: Service Bus over {scheme} on {}, {storage}", server.amqp_addr());
    if let Some(http) = server.http_addr() {
        // With a certificate, the HTTP port speaks https with it (see --tls-cert).
        let web = if args.tls_cert.is_some() { "https" } else { "http" };
        println!("web console: {web}://{http}/");
        println!(
            "health and metrics: {web}://{http}/health  {web}://{http}/metrics  {web}://{http}/entities"
        );
        // `twice dlq`, `twice demo` and `twice health` find the administration API by it.
        println!("administration API: export TWICE_ADMIN_URL={web}://{http}");
        if let Some(ca) = &dev_ca {
            let ca = ca.display();
            println!(
                "https on the same port for the SDKs' administration clients, with Endpoint=sb://{}:{} in the connection string: trust {ca}",
                args.hostname,
                http.port()
            );
            println!(
                "  Python: export REQUESTS_CA_BUNDLE={ca}   Node.js: export NODE_EXTRA_CA_CERTS={ca}"
            );
        }
    }
    println!(
        "connections: at most {max_connections} at once, {max_pending} more in their handshake"
    );
    if default_key {
        println!("connection string: {}", server.connection_string());
    } else {
        // A key of the user's own is a secret: it is not printed.
        let name = args.sas_keys.first().map_or("", |(name, _, _)| name.as_str());
        // The emulator flag means plain AMQP to the SDKs; over TLS it must not be there.
        let plain = if args.tls_cert.is_some() { "" } else { "UseDevelopmentEmulator=true;" };
        println!(
            "connection string: Endpoint=sb://{}:{};SharedAccessKeyName={name};SharedAccessKey=<the key of {name}>;{plain}",
            args.hostname,
            server.amqp_addr().port()
        );
    }
    let shutdown = shutdown_signal();
    println!("ready in {} ms; Ctrl-C stops", started.elapsed().as_millis());
    server.run(shutdown).await.context("serving")?;
    broker.shutdown().await;
    if args.in_memory {
        println!("twice serve: stopped; in memory, nothing was kept");
    } else {
        println!("twice serve: stopped; every acknowledged message is on disk");
    }
    Ok(ExitCode::SUCCESS)
}

/// The names the development certificate is made for: loopback by its name and addresses, the
/// host name clients use, and the HTTP address when it is a particular one.
fn dev_names(hostname: &str, http: SocketAddr) -> Vec<String> {
    let mut names: Vec<String> = ["localhost", "127.0.0.1", "::1"].map(str::to_owned).into();
    for name in [hostname.to_owned(), http.ip().to_string()] {
        let any = http.ip().is_unspecified() && name == http.ip().to_string();
        if !any && !names.iter().any(|n| n.eq_ignore_ascii_case(&name)) {
            names.push(name);
        }
    }
    names
}

/// Descriptors kept apart for the broker's files, the listeners, the HTTP side port and the
/// runtime, whatever the number of connections.
const RESERVED_DESCRIPTORS: u64 = 64;

/// Raises the soft limit on open files to the hard limit; returns the limit now in force
/// (`None` when it cannot be read).
fn raise_descriptor_limit() -> Option<u64> {
    rlimit::increase_nofile_limit(u64::MAX).ok()
}

/// The connection limits that fit in `fds` descriptors: each connection, pending or served,
/// holds one, and [`RESERVED_DESCRIPTORS`] stay free for everything else.
fn connection_limits(connections: usize, pending: usize, fds: Option<u64>) -> (usize, usize) {
    let Some(fds) = fds else { return (connections, pending) };
    let budget = usize::try_from(fds.saturating_sub(RESERVED_DESCRIPTORS)).unwrap_or(usize::MAX);
    let pending = pending.min(budget / 4).max(1);
    let connections = connections.min(budget.saturating_sub(pending)).max(1);
    (connections, pending)
}

/// Resolves on SIGINT or SIGTERM. The handlers are installed when this is called, not when
/// the future is first polled, so a signal that comes right after the "ready" line stops the
/// server cleanly instead of killing the process.
pub(crate) fn shutdown_signal() -> impl std::future::Future<Output = ()> {
    use tokio::signal::unix::{SignalKind, signal};
    let term = signal(SignalKind::terminate());
    let int = signal(SignalKind::interrupt());
    async move {
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
}

#[cfg(test)]
mod tests {
    use super::parse_key;
    use twice_servicebus::sas::{Claim, Claims};

    #[test]
    fn keys_parse_with_and_without_claims() {
        let (name, key, claims) = parse_key("sender=abc:Send").unwrap();
        assert_eq!((name.as_str(), key.as_str()), ("sender", "abc"));
        assert!(claims.allows(Claim::Send) && !claims.allows(Claim::Listen));
        assert_eq!(parse_key("root=k").unwrap().2, Claims::ALL);
        // A colon the key itself holds stays in the key.
        assert_eq!(parse_key("a=b:c/d+e=").unwrap().1, "b:c/d+e=");
        assert!(parse_key("a=b:Sned").is_err(), "a misspelt claim is an error");
        assert!(parse_key("=k").is_err() && parse_key("n=").is_err());
    }
}
