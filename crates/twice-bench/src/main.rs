//! `cargo run --release -p twice-bench -- [--quick] [--out DIR] [--only a,b] [--skip c]
//! [--no-build]`: builds the bench examples (release), runs the suite's parts in order, and
//! writes `DIR/report.md` (default `target/bench-report/`) with PNG plots.

use std::path::PathBuf;

use anyhow::Context as _;
use twice_bench::suite::{self, Options, PARTS};

const USAGE: &str = "usage: twice-bench [--quick] [--out DIR] [--only a,b,c,d] [--skip a,b,c,d] \
                     [--no-build]\n  a: twice serve vs RabbitMQ quorum vs NATS JetStream\n  \
                     b: the processor per transport beside pgbench\n  c: claim latency as the \
                     inbox grows\n  d: recovery time (broker fill + reopen)";

fn letters(list: &str) -> anyhow::Result<Vec<char>> {
    list.split(',')
        .map(|p| {
            let p = p.trim();
            PARTS
                .iter()
                .find(|(letter, _)| p.len() == 1 && p.starts_with(*letter))
                .map(|(letter, _)| *letter)
                .with_context(|| format!("unknown part {p:?}\n{USAGE}"))
        })
        .collect()
}

fn main() -> anyhow::Result<()> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let root = root.canonicalize().unwrap_or(root);
    let target =
        std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| root.join("target"), PathBuf::from);
    let mut out = target.join("bench-report");
    let mut quick = false;
    let mut build = true;
    let mut parts: Vec<char> = PARTS.iter().map(|(l, _)| *l).collect();
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--quick" => quick = true,
            "--no-build" => build = false,
            "--out" => out = args.next().context("--out DIR")?.into(),
            "--only" => parts = letters(&args.next().context("--only a,b")?)?,
            "--skip" => {
                let skip = letters(&args.next().context("--skip a,b")?)?;
                parts.retain(|p| !skip.contains(p));
            }
            "-h" | "--help" => {
                println!("{USAGE}");
                return Ok(());
            }
            other => anyhow::bail!("unknown argument {other:?}\n{USAGE}"),
        }
    }

    let machine = suite::machine(&root, quick);
    println!(
        "twice benchmark suite: {} cores, {} MiB, {}, commit {}, load average {}",
        machine.cores,
        machine.memory_mib,
        machine.date,
        machine.commit,
        suite::load_average()
    );
    if build {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
        println!("building the examples (release)…");
        let status = suite::build_command(&cargo, &root).status()?;
        anyhow::ensure!(status.success(), "building the examples failed: {status}");
    }
    let options = Options { quick, parts, build, root, release_dir: target.join("release") };
    let results = options.run();
    let written = twice_bench::write_report(&out, &machine, &results)?;
    println!();
    for path in written {
        println!("wrote {}", path.display());
    }
    Ok(())
}
