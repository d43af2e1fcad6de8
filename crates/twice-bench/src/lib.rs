//! The benchmark suite of twice: runs the side-by-side benchmarks (the release builds of the
//! workspace's bench examples, as child processes, each printing one JSON line of results with
//! `--json`), then writes `report.md` with tables and ratios and PNG plots.
//!
//! `cargo run --release -p twice-bench -- [--quick] [--out DIR] [--only a,b] [--skip c,d]`.
//! The parts: a. `twice serve` beside RabbitMQ and NATS JetStream; b. the processor per
//! transport beside pgbench; c. claim latency as the inbox grows; d. recovery time.

pub mod nats;
pub mod plot;
pub mod report;
pub mod results;
pub mod suite;

use std::path::{Path, PathBuf};

use results::{Machine, Outcome, PartResult};

/// Writes `report.md`, `results.json` and one PNG per part that has results into `dir`
/// (created if missing); returns the files written.
///
/// A plot that cannot be drawn is named in `report.md` instead and does not stop the others.
///
/// # Errors
/// When the directory or a file cannot be written.
pub fn write_report(
    dir: &Path,
    machine: &Machine,
    parts: &[PartResult],
) -> anyhow::Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir)?;
    let mut written = Vec::new();
    let mut failed_plots = Vec::new();
    for part in parts {
        let Some(file) = report::plot_file(&part.outcome) else { continue };
        let path = dir.join(file);
        let drawn = match &part.outcome {
            Outcome::Brokers(rows) => plot::brokers(&path, rows),
            Outcome::Transports(t) => plot::transports(&path, t),
            Outcome::Claim(c) => plot::claim(&path, c),
            Outcome::Recovery(r) => plot::recovery(&path, r),
            Outcome::Failed(_) | Outcome::Skipped => continue,
        };
        match drawn {
            Ok(()) => written.push(path),
            Err(e) => failed_plots.push(format!("{file}: {e}")),
        }
    }
    let mut md = report::markdown(machine, parts);
    for f in &failed_plots {
        md.push_str(&format!("Plot not drawn: {f}\n\n"));
    }
    let path = dir.join("report.md");
    std::fs::write(&path, md)?;
    written.push(path);
    let path = dir.join("results.json");
    let json = serde_json::json!({ "machine": machine, "parts": parts });
    std::fs::write(&path, serde_json::to_string_pretty(&json)?)?;
    written.push(path);
    Ok(written)
}
