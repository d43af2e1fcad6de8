//! `twice outbox`: look into an outbox table: what waits to be sent, how old the oldest row
//! is, which rows the broker refused for good (parked, with their reason); retry or discard
//! parked rows once their cause is fixed.

use std::fmt::Write as _;
use std::process::ExitCode;

use anyhow::{Context as _, bail};
use serde::Serialize;
use sqlx::{MySql, Postgres, Sqlite};
use twice::{OutboxStore as _, SharedClock};
use twice_sqlx::{OutboxOptions, OutboxRow, RowState, SqlxOutbox};

/// Options of `twice outbox`.
#[derive(Debug, clap::Args)]
pub(crate) struct OutboxArgs {
    /// The database: `postgres://…`, `mysql://…` or `sqlite:PATH` (default: the
    /// `TWICE_STORE` environment variable).
    #[arg(long, value_name = "URL", global = true)]
    store: Option<String>,
    /// The outbox table.
    #[arg(long, value_name = "NAME", default_value = "twice_outbox", global = true)]
    table: String,
    #[command(subcommand)]
    command: OutboxCommand,
}

#[derive(Debug, clap::Subcommand)]
enum OutboxCommand {
    /// Rows waiting to be sent, the age of the oldest, parked rows and sent rows kept.
    Status {
        /// One JSON object instead of text.
        #[arg(long)]
        json: bool,
    },
    /// The rows, oldest first: parked ones by default, with their reason.
    List {
        /// List the pending rows instead.
        #[arg(long, conflicts_with = "all")]
        pending: bool,
        /// List every row.
        #[arg(long)]
        all: bool,
        /// At most this many.
        #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u32).range(1..=100_000))]
        max: u32,
        /// One JSON object per row instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Make parked rows pending again (after fixing what made the broker refuse them: a
    /// missing entity created, a size limit raised); a relay sends them next.
    Retry {
        /// The rows (their `seq`), or `--all`.
        #[arg(long = "seq", value_name = "SEQ", required_unless_present = "all")]
        seqs: Vec<i64>,
        /// Every parked row.
        #[arg(long)]
        all: bool,
    },
    /// Delete parked rows: they are never sent.
    Discard {
        /// The rows (their `seq`), or `--all`.
        #[arg(long = "seq", value_name = "SEQ", required_unless_present = "all")]
        seqs: Vec<i64>,
        /// Every parked row.
        #[arg(long)]
        all: bool,
        /// Do not ask.
        #[arg(long)]
        yes: bool,
    },
}

/// An outbox on one of the three databases.
enum AnyOutbox {
    Postgres(SqlxOutbox<Postgres>),
    MySql(SqlxOutbox<MySql>),
    Sqlite(SqlxOutbox<Sqlite>),
}

/// Calls the same method on whichever outbox it is.
macro_rules! on {
    ($outbox:expr, $o:ident => $call:expr) => {
        match $outbox {
            AnyOutbox::Postgres($o) => $call,
            AnyOutbox::MySql($o) => $call,
            AnyOutbox::Sqlite($o) => $call,
        }
    };
}

impl AnyOutbox {
    async fn open(store: &str, table: &str) -> anyhow::Result<Self> {
        // Never migrates: a missing table is an error that names its migration.
        let options = OutboxOptions::new().table(table).migrate(false);
        Ok(if store.starts_with("postgres://") || store.starts_with("postgresql://") {
            let pool = sqlx::PgPool::connect(store).await.context("connecting to PostgreSQL")?;
            Self::Postgres(SqlxOutbox::new(pool, options).await?)
        } else if store.starts_with("mysql://") || store.starts_with("mariadb://") {
            let url = store.replacen("mariadb://", "mysql://", 1);
            let pool = sqlx::MySqlPool::connect(&url).await.context("connecting to MariaDB")?;
            Self::MySql(SqlxOutbox::new(pool, options).await?)
        } else if let Some(path) = store.strip_prefix("sqlite:") {
            let path = std::path::Path::new(path.trim_start_matches("//"));
            if !path.exists() {
                bail!("the SQLite database {} does not exist", path.display());
            }
            let pool = sqlx::SqlitePool::connect_with(twice_sqlx::sqlite::connect_options(path))
                .await
                .with_context(|| format!("opening the SQLite database {}", path.display()))?;
            Self::Sqlite(SqlxOutbox::new(pool, options).await?)
        } else {
            bail!("unknown store {store:?}: use postgres://…, mysql://… or sqlite:PATH");
        })
    }

    async fn stats(&self) -> anyhow::Result<twice::outbox::OutboxStats> {
        Ok(on!(self, o => o.stats().await)?)
    }

    async fn list(&self, state: Option<RowState>, max: u32) -> anyhow::Result<Vec<OutboxRow>> {
        Ok(on!(self, o => o.list(state, max).await)?)
    }

    async fn retry(&self, seqs: Option<&[i64]>) -> anyhow::Result<u64> {
        Ok(on!(self, o => o.retry_parked(seqs).await)?)
    }

    async fn discard(&self, seqs: Option<&[i64]>) -> anyhow::Result<u64> {
        Ok(on!(self, o => o.discard_parked(seqs).await)?)
    }
}

/// `twice outbox status --json`.
#[derive(Debug, Serialize)]
struct Status {
    pending: u64,
    oldest_pending_seconds: Option<f64>,
    parked: u64,
    sent_kept: u64,
}

/// A row of `twice outbox list --json`.
#[derive(Debug, Serialize)]
struct Row<'a> {
    seq: i64,
    state: &'static str,
    destination: &'a str,
    message_id: &'a str,
    session_id: Option<&'a str>,
    created_at_ms: i64,
    attempts: u32,
    last_error: Option<&'a str>,
    body_bytes: usize,
}

fn state_name(state: RowState) -> &'static str {
    match state {
        RowState::Pending => "pending",
        RowState::Sent => "sent",
        _ => "parked",
    }
}

pub(crate) async fn run(args: OutboxArgs) -> anyhow::Result<ExitCode> {
    let store = args.store.clone().or_else(|| std::env::var("TWICE_STORE").ok());
    let Some(store) = store.as_deref() else {
        bail!(
            "give the database with --store URL (or TWICE_STORE): postgres://…, mysql://… or sqlite:PATH"
        );
    };
    let outbox = AnyOutbox::open(store, &args.table).await?;
    match args.command {
        OutboxCommand::Status { json } => {
            let s = outbox.stats().await?;
            let now = SharedClock::system().now();
            let age = s.oldest_pending.map(|t| now.duration_since(t).as_secs_f64());
            let status = Status {
                pending: s.pending,
                oldest_pending_seconds: age,
                parked: s.parked,
                sent_kept: s.sent,
            };
            if json {
                println!("{}", serde_json::to_string(&status)?);
            } else {
                println!("pending   {}", status.pending);
                match age {
                    Some(a) => println!("oldest    {a:.1} s"),
                    None => println!("oldest    -"),
                }
                println!("parked    {}", status.parked);
                println!("sent kept {}", status.sent_kept);
                if status.parked > 0 {
                    println!(
                        "\n{} parked rows: the broker refused them for good; `twice outbox list` \
                         shows why, `twice outbox retry` sends them again once that is fixed",
                        status.parked
                    );
                }
            }
        }
        OutboxCommand::List { pending, all, max, json } => {
            let state = if all {
                None
            } else if pending {
                Some(RowState::Pending)
            } else {
                Some(RowState::Parked)
            };
            let rows = outbox.list(state, max).await?;
            if json {
                for r in &rows {
                    let row = Row {
                        seq: r.seq,
                        state: state_name(r.state),
                        destination: &r.destination,
                        message_id: r.message_id.as_str(),
                        session_id: r.message.session_id.as_ref().map(twice::SessionId::as_str),
                        created_at_ms: r.created_at.as_millis(),
                        attempts: r.attempts,
                        last_error: r.last_error.as_deref(),
                        body_bytes: r.message.body.len(),
                    };
                    println!("{}", serde_json::to_string(&row)?);
                }
            } else {
                print!("{}", table(&rows));
            }
        }
        OutboxCommand::Retry { seqs, all } => {
            let n = outbox.retry(if all { None } else { Some(&seqs) }).await?;
            println!("{n} parked rows made pending again");
        }
        OutboxCommand::Discard { seqs, all, yes } => {
            let chosen = if all { None } else { Some(seqs.as_slice()) };
            if !yes && !confirm("delete the chosen parked rows? they will never be sent")? {
                println!("nothing deleted");
                return Ok(ExitCode::SUCCESS);
            }
            let n = outbox.discard(chosen).await?;
            println!("{n} parked rows deleted");
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Asks on the terminal; without one, refuses and says to pass `--yes`.
fn confirm(question: &str) -> anyhow::Result<bool> {
    use std::io::{IsTerminal as _, Write as _};
    if !std::io::stdin().is_terminal() {
        bail!("{question}: confirm with --yes when not on a terminal");
    }
    eprint!("{question} [y/N] ");
    std::io::stderr().flush()?;
    let mut answer = String::new();
    std::io::stdin().read_line(&mut answer)?;
    Ok(matches!(answer.trim(), "y" | "Y" | "yes" | "YES" | "Yes"))
}

/// The rows as a text table.
fn table(rows: &[OutboxRow]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:>8}  {:<8}  {:<24}  {:<36}  {:>8}  REASON",
        "SEQ", "STATE", "DESTINATION", "MESSAGE ID", "ATTEMPTS"
    );
    for r in rows {
        let _ = writeln!(
            out,
            "{:>8}  {:<8}  {:<24}  {:<36}  {:>8}  {}",
            r.seq,
            state_name(r.state),
            r.destination,
            r.message_id.as_str(),
            r.attempts,
            r.last_error.as_deref().unwrap_or("")
        );
    }
    if rows.is_empty() {
        let _ = writeln!(out, "(none)");
    }
    out
}
