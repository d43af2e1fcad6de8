//! The report writer, the plots and the parsing of the examples' JSON lines, on fixed results
//! (nothing here is timed or runs a benchmark).

use std::path::Path;

use twice_bench::results::{
    AmqpBench, BrokerChild, BrokerRow, ClaimBench, Machine, Outcome, PartResult, Recovery,
    TransportsBench, json_line,
};

/// Lines as the examples print them with `--json`, after their human output.
const AMQP_OUTPUT: &str = r#"| phase | system | msg/s | p50 ms | p99 ms | server CPU µs/msg | client CPU µs/msg |
|---|---|---|---|---|---|---|
| publish, 256 in flight | twice | 40000 | 5.10 | 9.00 | 20.0 | 10.0 |
{"bench":"amqp_bench","messages":5000,"runs":1,"rows":[{"client_cpu_us":10.0,"p50_ms":5.1,"p99_ms":9.0,"phase":"publish","rate":40000.0,"server_cpu_us":20.0,"system":"twice"},{"client_cpu_us":8.0,"p50_ms":null,"p99_ms":null,"phase":"receive","rate":30000.0,"server_cpu_us":15.0,"system":"twice"},{"client_cpu_us":12.0,"p50_ms":20.0,"p99_ms":40.0,"phase":"publish","rate":10000.0,"server_cpu_us":80.0,"system":"rabbitmq"},{"client_cpu_us":9.0,"p50_ms":null,"p99_ms":null,"phase":"receive","rate":15000.0,"server_cpu_us":60.0,"system":"rabbitmq"}]}
"#;
const TRANSPORTS_OUTPUT: &str = r#"| embedded (durable) | 50000 | 9000 | 20000 |
{"bench":"bench_transports","batch":32,"messages":2000,"pgbench_tps":12000.0,"rows":[{"batches":20000.0,"consume":50000.0,"processor":9000.0,"transport":"embedded (durable)"},{"batches":null,"consume":20000.0,"processor":6000.0,"transport":"NATS JetStream (file)"}]}
"#;
const CLAIM_OUTPUT: &str = r#"rows_before=0 samples=500 ids=random mean_us=300 p50_us=250 p99_us=900 wal_bytes_per_claim=400
{"bench":"bench_claim_latency","points":[{"ids":"random","mean_us":300,"p50_us":250,"p99_us":900,"rows_before":0,"wal_bytes_per_claim":400},{"ids":"time-ordered","mean_us":280,"p50_us":240,"p99_us":800,"rows_before":0,"wal_bytes_per_claim":380},{"ids":"random","mean_us":350,"p50_us":300,"p99_us":1200,"rows_before":100000,"wal_bytes_per_claim":900},{"ids":"time-ordered","mean_us":290,"p50_us":250,"p99_us":850,"rows_before":100000,"wal_bytes_per_claim":390}],"samples":500}
"#;
const FILL_OUTPUT: &str = "active 100000\nrss_kib 65536\nelapsed_ms 2500\n\
{\"active\":100000,\"bench\":\"broker_child\",\"elapsed_ms\":2500,\"mode\":\"fill\",\"rss_kib\":65536}\n";
const REOPEN_OUTPUT: &str = "active 100000\nrss_kib 40960\nelapsed_ms 400\n\
{\"active\":100000,\"bench\":\"broker_child\",\"elapsed_ms\":400,\"mode\":\"reopen\",\"rss_kib\":40960}\n";

const PNG_SIGNATURE: &[u8] = b"\x89PNG\r\n\x1a\n";

fn part(title: &str, outcome: Outcome) -> PartResult {
    PartResult {
        title: title.to_owned(),
        load_before: "1.50 1.20 1.00".to_owned(),
        load_after: "2.50 1.40 1.10".to_owned(),
        seconds: 12.0,
        outcome,
    }
}

fn broker_rows(amqp: &AmqpBench) -> Vec<BrokerRow> {
    let rate = |phase: &str, system: &str| {
        amqp.rows.iter().find(|r| r.phase == phase && r.system == system).map(|r| r.rate)
    };
    vec![
        BrokerRow {
            system: "twice serve (AMQP 1.0)".to_owned(),
            durability: "fsync'd (group commit)".to_owned(),
            publish: rate("publish", "twice"),
            receive: rate("receive", "twice"),
            server_cpu_us: Some(20.0),
            note: String::new(),
        },
        BrokerRow {
            system: "RabbitMQ quorum queue".to_owned(),
            durability: "fsync'd".to_owned(),
            publish: rate("publish", "rabbitmq"),
            receive: rate("receive", "rabbitmq"),
            server_cpu_us: Some(80.0),
            note: String::new(),
        },
        BrokerRow {
            system: "NATS JetStream (file, sync_always)".to_owned(),
            durability: "fsync'd".to_owned(),
            publish: None,
            receive: None,
            server_cpu_us: None,
            note: "not run: needs a restart".to_owned(),
        },
    ]
}

fn fixed_parts() -> anyhow::Result<Vec<PartResult>> {
    let amqp: AmqpBench = json_line(AMQP_OUTPUT, "amqp_bench")?;
    let transports: TransportsBench = json_line(TRANSPORTS_OUTPUT, "bench_transports")?;
    let claim: ClaimBench = json_line(CLAIM_OUTPUT, "bench_claim_latency")?;
    let fill: BrokerChild = json_line(FILL_OUTPUT, "broker_child")?;
    let reopen: BrokerChild = json_line(REOPEN_OUTPUT, "broker_child")?;
    Ok(vec![
        part("a. Brokers", Outcome::Brokers(broker_rows(&amqp))),
        part("b. Transports", Outcome::Transports(transports)),
        part("c. Claim latency", Outcome::Claim(claim)),
        part("d. Recovery", Outcome::Recovery(Recovery { messages: 100_000, fill, reopen })),
        part("e. A part that failed", Outcome::Failed("connection refused".to_owned())),
        part("f. A part left out", Outcome::Skipped),
    ])
}

fn machine() -> Machine {
    Machine {
        cores: 2,
        memory_mib: 24_000,
        date: "2026-12-05 00:00:00 UTC".to_owned(),
        commit: "abc1234".to_owned(),
        quick: true,
    }
}

fn assert_png(path: &Path) {
    let bytes = std::fs::read(path).unwrap_or_default();
    assert!(bytes.len() > 1000, "{} has {} bytes", path.display(), bytes.len());
    assert!(bytes.starts_with(PNG_SIGNATURE), "{} is not a PNG", path.display());
}

#[test]
fn the_json_line_of_each_example_parses() -> anyhow::Result<()> {
    let amqp: AmqpBench = json_line(AMQP_OUTPUT, "amqp_bench")?;
    assert_eq!((amqp.messages, amqp.runs, amqp.rows.len()), (5_000, 1, 4));
    assert_eq!(amqp.rows[0].p50_ms, Some(5.1));
    assert_eq!(amqp.rows[1].p50_ms, None);
    let t: TransportsBench = json_line(TRANSPORTS_OUTPUT, "bench_transports")?;
    assert_eq!((t.batch, t.rows.len(), t.pgbench_tps), (32, 2, Some(12_000.0)));
    assert_eq!(t.rows[1].batches, None);
    let c: ClaimBench = json_line(CLAIM_OUTPUT, "bench_claim_latency")?;
    assert_eq!(c.points.len(), 4);
    assert_eq!((c.points[2].rows_before, c.points[2].p99_us), (100_000, 1_200));
    let fill: BrokerChild = json_line(FILL_OUTPUT, "broker_child")?;
    assert_eq!((fill.mode.as_str(), fill.active, fill.elapsed_ms), ("fill", 100_000, 2_500));
    Ok(())
}

/// JSON lines exactly as the release examples printed them with `--json` (2026-12-05, small
/// counts): `amqp_bench --messages 2000 --runs 1`, `bench_transports 500 32`,
/// `bench_claim_latency 50 0,2000`, `broker_child fill DIR 2000` and `reopen DIR`.
const PRINTED: [(&str, &str); 5] = [
    (
        "amqp_bench",
        r#"{"bench":"amqp_bench","messages":2000,"rows":[{"client_cpu_us":5.0,"p50_ms":3.807617,"p99_ms":7.802031,"phase":"publish","rate":58673.47028581842,"server_cpu_us":5.0,"system":"twice"},{"client_cpu_us":0.0,"p50_ms":5.306960999999999,"p99_ms":9.735268,"phase":"receive","rate":37274.13504903692,"server_cpu_us":10.0,"system":"twice"},{"client_cpu_us":35.0,"p50_ms":19.94097,"p99_ms":561.8495340000001,"phase":"publish","rate":2851.599104061781,"server_cpu_us":55.0,"system":"rabbitmq"},{"client_cpu_us":65.0,"p50_ms":null,"p99_ms":null,"phase":"receive","rate":9089.768614167924,"server_cpu_us":70.0,"system":"rabbitmq"}],"runs":1}"#,
    ),
    (
        "bench_transports",
        r#"{"batch":32,"bench":"bench_transports","messages":500,"pgbench_tps":4463.849933,"rows":[{"batches":7126.804118391952,"consume":35504.4115296458,"processor":2047.6744143950136,"transport":"embedded (durable)"},{"batches":5368.528316957569,"consume":46029.11009804108,"processor":2342.21854406468,"transport":"Service Bus client → twice serve (durable)"},{"batches":5717.761002095708,"consume":24246.238984024396,"processor":2433.3296036879387,"transport":"RabbitMQ (quorum queue)"},{"batches":7218.958787628426,"consume":37298.7861035465,"processor":1813.5214439643653,"transport":"NATS JetStream (file)"}]}"#,
    ),
    (
        "bench_claim_latency",
        r#"{"bench":"bench_claim_latency","points":[{"ids":"random","mean_us":170,"p50_us":133,"p99_us":788,"rows_before":0,"wal_bytes_per_claim":455},{"ids":"time-ordered","mean_us":122,"p50_us":113,"p99_us":236,"rows_before":0,"wal_bytes_per_claim":449},{"ids":"random","mean_us":146,"p50_us":137,"p99_us":334,"rows_before":2000,"wal_bytes_per_claim":614},{"ids":"time-ordered","mean_us":170,"p50_us":161,"p99_us":298,"rows_before":2000,"wal_bytes_per_claim":538}],"samples":50}"#,
    ),
    (
        "broker_child",
        r#"{"active":2000,"bench":"broker_child","elapsed_ms":27,"mode":"fill","rss_kib":10804}"#,
    ),
    (
        "broker_child",
        r#"{"active":2000,"bench":"broker_child","elapsed_ms":6,"mode":"reopen","rss_kib":6532}"#,
    ),
];

#[test]
fn lines_the_examples_printed_parse() -> anyhow::Result<()> {
    let [(a, amqp), (t, transports), (c, claim), (f, fill), (r, reopen)] = PRINTED;
    let amqp: AmqpBench = json_line(amqp, a)?;
    assert_eq!(amqp.rows.len(), 4);
    assert!(amqp.rows.iter().any(|r| r.system == "rabbitmq" && r.phase == "receive"));
    let transports: TransportsBench = json_line(transports, t)?;
    assert_eq!((transports.rows.len(), transports.batch), (4, 32));
    assert!(transports.pgbench_tps.is_some());
    assert!(transports.rows.iter().all(|r| r.batches.is_some()));
    let claim: ClaimBench = json_line(claim, c)?;
    assert_eq!(claim.points.iter().map(|p| p.rows_before).max(), Some(2000));
    let fill: BrokerChild = json_line(fill, f)?;
    let reopen: BrokerChild = json_line(reopen, r)?;
    assert_eq!((fill.mode.as_str(), reopen.mode.as_str()), ("fill", "reopen"));
    assert_eq!((fill.active, reopen.active), (2000, 2000));
    Ok(())
}

#[test]
fn an_output_without_the_json_line_is_an_error_not_a_crash() {
    let e = json_line::<ClaimBench>("rows_before=0 samples=5\n", "bench_claim_latency");
    assert!(e.is_err_and(|e| e.to_string().contains("no JSON line")));
    let e = json_line::<ClaimBench>(
        "{\"bench\":\"bench_claim_latency\",\"points\":7}\n",
        "bench_claim_latency",
    );
    assert!(e.is_err());
    // Another example's line is not taken for this one's.
    assert!(json_line::<AmqpBench>(FILL_OUTPUT, "amqp_bench").is_err());
}

#[test]
fn fixed_results_become_markdown_tables_and_png_plots() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let written = twice_bench::write_report(dir.path(), &machine(), &fixed_parts()?)?;
    for png in ["brokers.png", "transports.png", "claim_latency.png", "recovery.png"] {
        let path = dir.path().join(png);
        assert!(written.contains(&path), "{png} not in {written:?}");
        assert_png(&path);
    }
    let md = std::fs::read_to_string(dir.path().join("report.md"))?;
    for expected in [
        "- commit: `abc1234`",
        "- machine: 2 cores, 24000 MiB",
        "Load average before: 1.50 1.20 1.00; after: 2.50 1.40 1.10",
        "| twice serve (AMQP 1.0) | fsync'd (group commit) | 40000 | 30000 | 20.0 |  |",
        "| NATS JetStream (file, sync_always) | fsync'd | not run | not run | – | not run: needs a restart |",
        // Ratios within the run: 40000 / 10000 and 30000 / 15000.
        "| RabbitMQ quorum queue | 4.00× | 2.00× |",
        // The processor beside pgbench: 9000 / 12000, 20000 / 12000.
        "| embedded (durable) | 50000 | 9000 | 20000 | 0.75× | 1.67× |",
        "| NATS JetStream (file) | 20000 | 6000 | not run | 0.50× | – |",
        "| 100000 | random | 350 | 300 | 1200 | 900 |",
        // 400 ms for 100,000 messages: 4 s per million.
        "| reopen (recovery) | 400 | 4.00 | 100000 | 40 |",
        "**Failed**: connection refused",
        "## f. A part left out\n\nSkipped.",
        "![a. Brokers](brokers.png)",
        "![c. Claim latency](claim_latency.png)",
    ] {
        assert!(md.contains(expected), "report.md lacks {expected:?}:\n{md}");
    }
    assert!(!md.contains("NATS JetStream (file, sync_always) | –"), "a row not run has no ratio");
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("results.json"))?)?;
    assert_eq!(json["parts"].as_array().map(Vec::len), Some(6));
    Ok(())
}

#[test]
fn empty_results_still_make_a_report_and_plots() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let parts = vec![
        part("a", Outcome::Brokers(Vec::new())),
        part("c", Outcome::Claim(ClaimBench { samples: 0, points: Vec::new() })),
    ];
    twice_bench::write_report(dir.path(), &machine(), &parts)?;
    assert_png(&dir.path().join("brokers.png"));
    assert_png(&dir.path().join("claim_latency.png"));
    let md = std::fs::read_to_string(dir.path().join("report.md"))?;
    assert!(md.contains("| system | durable before the acknowledgement |"));
    Ok(())
}

/// The machine's `nats-server`, or `None` with the reason printed (a failure in CI).
fn machine_nats_server() -> Option<std::path::PathBuf> {
    let found = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths).map(|d| d.join("nats-server")).find(|p| p.is_file())
    });
    assert!(
        found.is_some() || std::env::var_os("CI").is_none(),
        "nats-server is not on PATH (.ci/run installs it)"
    );
    if found.is_none() {
        eprintln!("skipped: nats-server is not on PATH");
    }
    found
}

#[test]
fn a_nats_server_the_suite_starts_is_measured_and_gone_when_dropped() -> anyhow::Result<()> {
    use twice_bench::nats::{Server, Sync, run};
    let Some(binary) = machine_nats_server() else { return Ok(()) };
    let server = Server::start(&binary, Sync::Default)?;
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let rates = runtime.block_on(run(&server.url, 300, "TWICE_BENCH_TEST", Some(server.pid())))?;
    assert!(rates.publish > 0.0 && rates.receive > 0.0, "{rates:?}");
    assert!(rates.server_cpu_us.is_some(), "the started server's CPU is read from its pid");
    assert!(!rates.server_version.is_empty());
    let port = server.url.rsplit(':').next().unwrap_or_default().parse::<u16>()?;
    drop(server);
    assert!(
        std::net::TcpStream::connect(("127.0.0.1", port)).is_err(),
        "the server is stopped when dropped"
    );
    Ok(())
}

#[test]
fn a_nats_server_that_cannot_start_is_an_error_naming_it() {
    let missing = Path::new("/nonexistent/nats-server");
    let err = twice_bench::nats::Server::start(missing, twice_bench::nats::Sync::Always)
        .expect_err("no such binary");
    assert!(err.to_string().contains("/nonexistent/nats-server"), "{err}");
}

#[test]
fn each_transport_row_says_what_was_durable_before_its_completion() -> anyhow::Result<()> {
    use twice_bench::results::transport_durability;
    assert_eq!(transport_durability("embedded (durable)"), "fsync'd (group commit)");
    assert_eq!(
        transport_durability("Service Bus client → twice serve (durable)"),
        "fsync'd (group commit)"
    );
    assert!(transport_durability("RabbitMQ (quorum queue)").contains("Raft"));
    assert!(transport_durability("NATS JetStream (file)").contains("not fsync'd"));
    assert_eq!(transport_durability("carrier pigeon"), "not known");
    let dir = tempfile::tempdir()?;
    twice_bench::write_report(dir.path(), &machine(), &fixed_parts()?)?;
    let md = std::fs::read_to_string(dir.path().join("report.md"))?;
    assert!(
        md.contains("the completion, per transport: embedded (durable): fsync'd (group commit)"),
        "{md}"
    );
    Ok(())
}
