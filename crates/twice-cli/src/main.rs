//! `twice`: the command-line front end.
//!
//! This is the only crate that reads argv and the environment and writes to stdout.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod chaos;
mod data;
mod demo;
mod dlq;
mod errors;
mod health;
mod outbox;
mod reset;
mod serve;

/// Message handling that stays correct when the broker delivers twice.
#[derive(Debug, Parser)]
#[command(name = "twice", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the shipping example under injected faults: a naive handler and the twice
    /// processor side by side, on the embedded broker.
    Demo(demo::DemoArgs),
    /// Serve the broker over AMQP 1.0 to the official Azure Service Bus SDKs, with the
    /// emulator's connection string.
    Serve(serve::ServeArgs),
    /// Check, repair or export a broker's data directory (the broker must not be running for
    /// a repair).
    Data(data::DataArgs),
    /// Look into a namespace's dead-letter queues (twice serve or Service Bus): list the
    /// counts, show, resubmit, purge or export dead-lettered messages, or watch the counts.
    Dlq(dlq::DlqArgs),
    /// Look into an outbox table: rows waiting to be sent, the oldest one's age, rows the
    /// broker refused for good (parked, with their reason); retry or discard parked rows.
    Outbox(outbox::OutboxArgs),
    /// Ask twice serve whether it serves (`/health`): exit status 0 if so, 1 otherwise, for a
    /// container's healthcheck.
    Health(health::HealthArgs),
    /// Empty every entity of twice serve at once (messages of every kind, locks, session
    /// states, remembered ids), keeping the entities and their rules: for test suites.
    Reset(reset::ResetArgs),
    /// Run the whole system in separate processes (twice serve, RabbitMQ or NATS, processors,
    /// PostgreSQL) under SIGKILLs, SIGSTOPs, broker and database restarts, and check that
    /// every acknowledged order was handled exactly once.
    Chaos(chaos::ChaosArgs),
    /// One processor process of `twice chaos` (started by it).
    #[command(hide = true)]
    ChaosWorker(chaos::worker::WorkerArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging(&cli.command);
    // `twice dlq` explains its own errors in one line.
    let hints = !matches!(cli.command, Command::Dlq(_));
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        match cli.command {
            Command::Demo(args) => demo::run(args).await,
            Command::Serve(args) => serve::run(args).await,
            Command::Data(args) => data::run(args),
            Command::Dlq(args) => dlq::run(args).await,
            Command::Outbox(args) => outbox::run(args).await,
            Command::Health(args) => health::run(args).await,
            Command::Reset(args) => reset::run(args).await,
            Command::Chaos(args) => chaos::run(args).await,
            Command::ChaosWorker(args) => chaos::worker::run(args).await,
        }
    });
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {}", errors::render(&e));
            if let Some(hint) = hint_for(&e).filter(|_| hints) {
                eprintln!("hint: {hint}");
            }
            ExitCode::FAILURE
        }
    }
}

/// A hint for errors a user can fix.
fn hint_for(e: &anyhow::Error) -> Option<String> {
    let text = errors::render(e);
    if text.contains("postgres://") || text.contains("mysql://") || text.contains("sqlite:") {
        return Some("check that the database server is running and the URL is right".into());
    }
    if text.contains("cannot connect") || text.contains("Connection refused") {
        return Some(
            "check that the server is running and that the address (host and port) is right".into(),
        );
    }
    None
}

/// Logs go to stderr, filtered by `RUST_LOG` (for example `RUST_LOG=twice_servicebus=debug`).
/// Without it, `twice serve` logs warnings and errors, and `twice demo` only errors: the faults
/// it injects on purpose are its report's business, not the log's.
fn init_logging(command: &Command) {
    let default = match command {
        Command::Serve(_) | Command::Data(_) => "warn",
        // The broker restarts it makes cut its own RabbitMQ connections, which lapin logs.
        Command::Chaos(_) => "warn,lapin=off",
        // The watcher's warnings are what it is for.
        Command::Dlq(args) if args.is_watch() => "warn",
        // Its errors are reported on stderr, once; the client's retries are not news.
        Command::Dlq(_) | Command::Outbox(_) | Command::Health(_) | Command::Reset(_) => "error",
        // A processor of a chaos run meets lost connections on purpose.
        Command::Demo(_) | Command::ChaosWorker(_) => "error",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    // Colours only for a person: a log read by a program or kept in a file stays plain text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(ansi)
        .try_init();
}
