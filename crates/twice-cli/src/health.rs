//! `twice health`: asks `twice serve` whether it serves, for a container's healthcheck (no
//! shell, no curl): exit status 0 when `/health` answers 200, 1 otherwise, with one line saying
//! why.

use std::process::ExitCode;

use crate::dlq::admin::{AdminError, Auth, ServeUrlArgs};

/// Options of `twice health`.
#[derive(Debug, clap::Args)]
pub(crate) struct HealthArgs {
    #[command(flatten)]
    serve: ServeUrlArgs,
    /// Print nothing when healthy.
    #[arg(long, short)]
    quiet: bool,
}

/// Exit status 0 when `/health` answers 200; otherwise 1, with the reason on stderr.
pub(crate) async fn run(args: HealthArgs) -> anyhow::Result<ExitCode> {
    let client = args.serve.client(Auth::Anonymous)?;
    match client.health().await {
        Ok((200, _)) => {
            if !args.quiet {
                println!("healthy: {}/health", args.serve.url);
            }
            Ok(ExitCode::SUCCESS)
        }
        Ok((status, body)) => {
            eprintln!("unhealthy: {}/health answered {status}: {}", args.serve.url, reason(&body));
            Ok(ExitCode::FAILURE)
        }
        // Named with this command's own option.
        Err(AdminError::Unreachable { url, reason }) => {
            eprintln!(
                "unhealthy: cannot reach the administration API at {url}: {reason} (give --url or \
                 set TWICE_ADMIN_URL: twice serve prints it)"
            );
            Ok(ExitCode::FAILURE)
        }
        Err(AdminError::NotTls { url }) => {
            eprintln!("unhealthy: {url} does not answer TLS: give its http:// address with --url");
            Ok(ExitCode::FAILURE)
        }
        Err(e) => {
            eprintln!("unhealthy: {e}");
            Ok(ExitCode::FAILURE)
        }
    }
}

/// The `reason` of a JSON health body, else the body itself on one line.
fn reason(body: &str) -> String {
    serde_json::from_str::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v.get("reason").and_then(|r| r.as_str()).map(str::to_owned))
        .unwrap_or_else(|| body.split_whitespace().collect::<Vec<_>>().join(" "))
}

#[cfg(test)]
mod tests {
    use super::reason;

    #[test]
    fn the_reason_is_read_from_the_json_body_or_the_body_is_one_line() {
        assert_eq!(
            reason(r#"{"status":"unhealthy","reason":"storage failed: disk full"}"#),
            "storage failed: disk full"
        );
        assert_eq!(reason("bad\ngateway "), "bad gateway");
    }
}
