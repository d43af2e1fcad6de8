//! `twice data`: look into a broker's data directory without running the broker: check it,
//! cut a damaged log where the operator decides, export an entity's messages.

use std::io::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context as _;
use twice_broker::data::{self, Verdict};

/// Options of `twice data`.
#[derive(Debug, clap::Args)]
pub(crate) struct DataArgs {
    #[command(subcommand)]
    command: DataCommand,
}

#[derive(Debug, clap::Subcommand)]
enum DataCommand {
    /// Verify every segment; print its records, bytes and live ratio, the entities and their
    /// counts, and whether the broker would open the directory (exit status 1 if not).
    Check {
        /// The data directory.
        dir: PathBuf,
    },
    /// Cut the log at SEGMENT:OFFSET (as `twice data check` or the broker's error names it):
    /// the segment is truncated there and every later segment removed. Prints what is lost
    /// first; `--dry-run` stops there.
    Repair {
        /// The data directory.
        dir: PathBuf,
        /// Where to cut, as SEGMENT:OFFSET.
        #[arg(long, value_name = "SEGMENT:OFFSET", value_parser = parse_cut)]
        truncate_at: (u64, u64),
        /// Print what would be lost and change nothing.
        #[arg(long)]
        dry_run: bool,
    },
    /// Write an entity's messages as JSON lines (to stdout or `--output`), from the state the
    /// log replays to up to its first damage: a way to rescue data from a log that will not
    /// open.
    Export {
        /// The data directory.
        dir: PathBuf,
        /// A queue, `TOPIC/Subscriptions/NAME`, or either with `/$DeadLetterQueue`.
        #[arg(long, value_name = "NAME")]
        entity: String,
        /// Write here instead of stdout.
        #[arg(long, value_name = "FILE")]
        output: Option<PathBuf>,
    },
}

fn parse_cut(s: &str) -> Result<(u64, u64), String> {
    let (segment, offset) =
        s.split_once(':').ok_or_else(|| format!("expected SEGMENT:OFFSET, got {s:?}"))?;
    let n = |v: &str| v.trim().parse::<u64>().map_err(|e| format!("{v:?}: {e}"));
    Ok((n(segment)?, n(offset)?))
}

pub(crate) fn run(args: DataArgs) -> anyhow::Result<ExitCode> {
    match args.command {
        DataCommand::Check { dir } => check(&dir),
        DataCommand::Repair { dir, truncate_at: (segment, offset), dry_run } => {
            let plan = data::plan_repair(&dir, segment, offset)
                .with_context(|| format!("planning the cut of {}", dir.display()))?;
            println!(
                "cutting segment {} at byte {}: {} bytes and {} complete records of it are lost",
                plan.segment, plan.offset, plan.bytes_cut, plan.records_cut
            );
            if !plan.segments_removed.is_empty() {
                println!(
                    "removing the later segments {:?}: {} records are lost",
                    plan.segments_removed, plan.records_removed
                );
            }
            if dry_run {
                println!("dry run: nothing changed");
                return Ok(ExitCode::SUCCESS);
            }
            data::repair(&dir, &plan).with_context(|| format!("cutting {}", dir.display()))?;
            println!("done");
            Ok(ExitCode::SUCCESS)
        }
        DataCommand::Export { dir, entity, output } => {
            let n = match output {
                Some(path) => {
                    let file = std::fs::File::create(&path)
                        .with_context(|| format!("creating {}", path.display()))?;
                    let mut out = std::io::BufWriter::new(file);
                    let n = data::export(&dir, &entity, &mut out)?;
                    out.flush().with_context(|| format!("writing {}", path.display()))?;
                    n
                }
                None => {
                    let stdout = std::io::stdout();
                    let mut out = std::io::BufWriter::new(stdout.lock());
                    let n = data::export(&dir, &entity, &mut out)?;
                    out.flush()?;
                    n
                }
            };
            eprintln!("exported {n} messages of {entity}");
            Ok(ExitCode::SUCCESS)
        }
    }
}

fn check(dir: &std::path::Path) -> anyhow::Result<ExitCode> {
    let report = data::check(dir).with_context(|| format!("checking {}", dir.display()))?;
    println!(
        "{:>8} {:>12} {:>8} {:>9} {:>8} {:>12} {:>6}  damage",
        "segment", "bytes", "commits", "records", "live", "live bytes", "ratio"
    );
    for s in &report.segments {
        let damage = s.damage.map_or_else(|| "-".to_owned(), |d| format!("at byte {d}"));
        println!(
            "{:>8} {:>12} {:>8} {:>9} {:>8} {:>12} {:>5.1}%  {damage}",
            s.id,
            s.bytes,
            s.commits,
            s.records,
            s.live_messages,
            s.live_bytes,
            100.0 * s.live_ratio()
        );
    }
    if let Some(m) = report.missing_segment {
        println!("segment {m} is missing");
    }
    println!();
    println!(
        "{:<40} {:>9} {:>9} {:>9} {:>11}",
        "entity", "active", "deferred", "scheduled", "dead-letter"
    );
    for e in &report.entities {
        println!(
            "{:<40} {:>9} {:>9} {:>9} {:>11}",
            e.path, e.active, e.deferred, e.scheduled, e.dead_letter
        );
    }
    println!();
    if let Some(held) = report.in_use {
        let pid = held.pid.map_or_else(String::new, |pid| format!(" (pid {pid})"));
        println!(
            "a running broker holds this directory{pid}: what is above is its log as written so far, and another broker cannot open it until that one stops"
        );
    }
    match report.verdict {
        Verdict::Opens if report.in_use.is_some() => {
            println!("the log as read now is sound: a broker opens it once the running one stops");
            Ok(ExitCode::SUCCESS)
        }
        Verdict::Opens => {
            println!("the broker opens this directory");
            Ok(ExitCode::SUCCESS)
        }
        Verdict::OpensAfterTruncating { segment, offset } => {
            println!(
                "the broker opens this directory after cutting an unacknowledged torn tail at {segment}:{offset}"
            );
            Ok(ExitCode::SUCCESS)
        }
        Verdict::Refuses(why) => {
            println!("the broker refuses this directory: {why}");
            println!(
                "to cut the log there (losing what follows): twice data repair DIR --truncate-at SEGMENT:OFFSET"
            );
            Ok(ExitCode::FAILURE)
        }
        other => {
            println!("{other:?}");
            Ok(ExitCode::FAILURE)
        }
    }
}
