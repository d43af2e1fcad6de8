//! `twice reset`: empties every entity of `twice serve` at once, for test suites that want a
//! clean namespace between tests without restarting the server.

use std::process::ExitCode;

use crate::dlq::admin::{AdminError, Auth, ServeUrlArgs};

/// Options of `twice reset`.
#[derive(Debug, clap::Args)]
pub(crate) struct ResetArgs {
    #[command(flatten)]
    serve: ServeUrlArgs,
    /// The key to sign with, as NAME=KEY (it needs the Manage claim on the whole namespace).
    /// Default: the emulator's RootManageSharedAccessKey=SAS_KEY_VALUE, `twice serve`'s default.
    #[arg(long, value_name = "NAME=KEY", value_parser = parse_key)]
    sas_key: Option<(String, String)>,
    /// Print nothing on success.
    #[arg(long, short)]
    quiet: bool,
}

fn parse_key(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((name, key)) if !name.is_empty() && !key.is_empty() => {
            Ok((name.to_owned(), key.to_owned()))
        }
        _ => Err("expected NAME=KEY, name and key non-empty".to_owned()),
    }
}

/// Resets every entity; exit status 0 when done.
pub(crate) async fn run(args: ResetArgs) -> anyhow::Result<ExitCode> {
    let (name, key) = args
        .sas_key
        .unwrap_or_else(|| ("RootManageSharedAccessKey".to_owned(), "SAS_KEY_VALUE".to_owned()));
    let client = args.serve.client(Auth::Key { name, key })?;
    let (entities, elapsed_ms) = match client.reset().await {
        Ok(done) => done,
        // Named with this command's own option.
        Err(AdminError::Unreachable { url, reason }) => {
            eprintln!(
                "error: cannot reach the administration API at {url}: {reason} (give --url or \
                 set TWICE_ADMIN_URL: twice serve prints it)"
            );
            return Ok(ExitCode::FAILURE);
        }
        Err(e) => {
            eprintln!("error: {e}");
            return Ok(ExitCode::FAILURE);
        }
    };
    if !args.quiet {
        println!(
            "reset {entities} entities at {} in {elapsed_ms:.1} ms: every message, lock, session state and remembered id is gone; the entities and their rules stay",
            args.serve.url
        );
    }
    Ok(ExitCode::SUCCESS)
}
