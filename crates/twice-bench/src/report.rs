//! `report.md`: the machine, then one section per part with its table, the ratios computed
//! within the run, the load average around it and its plot.

use std::fmt::Write as _;

use crate::results::{
    BrokerRow, ClaimBench, Machine, Outcome, PartResult, Recovery, TransportsBench,
};

/// The file name of each part's plot, if it has one.
pub fn plot_file(outcome: &Outcome) -> Option<&'static str> {
    match outcome {
        Outcome::Brokers(_) => Some("brokers.png"),
        Outcome::Transports(_) => Some("transports.png"),
        Outcome::Claim(_) => Some("claim_latency.png"),
        Outcome::Recovery(_) => Some("recovery.png"),
        Outcome::Failed(_) | Outcome::Skipped => None,
    }
}

/// `a / b` as "1.23×", or "–" when either is missing or `b` is zero.
pub fn ratio(a: Option<f64>, b: Option<f64>) -> String {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => format!("{:.2}×", a / b),
        _ => "–".to_owned(),
    }
}

fn rate(r: Option<f64>) -> String {
    r.map_or_else(|| "not run".to_owned(), |r| format!("{r:.0}"))
}

/// The whole report as markdown.
pub fn markdown(machine: &Machine, parts: &[PartResult]) -> String {
    let mut md = String::new();
    let _ = writeln!(md, "# twice benchmark report\n");
    if machine.quick {
        let _ = writeln!(
            md,
            "**`--quick`**: small counts, to check that the suite runs; not numbers to quote.\n"
        );
    }
    let _ = writeln!(
        md,
        "- date: {}\n- commit: `{}`\n- machine: {} cores, {} MiB\n",
        machine.date, machine.commit, machine.cores, machine.memory_mib
    );
    let _ = writeln!(
        md,
        "Every ratio is between numbers of this run. The load average (1, 5, 15 min, from \
         `/proc/loadavg`) is given before and after each part: on a shared machine a high one \
         makes every number of the part pessimistic.\n"
    );
    for part in parts {
        let _ = writeln!(md, "## {}\n", part.title);
        if matches!(part.outcome, Outcome::Skipped) {
            let _ = writeln!(md, "Skipped.\n");
            continue;
        }
        let _ = writeln!(
            md,
            "Load average before: {}; after: {}; {:.0} s.\n",
            part.load_before, part.load_after, part.seconds
        );
        match &part.outcome {
            Outcome::Brokers(rows) => brokers(&mut md, rows),
            Outcome::Transports(t) => transports(&mut md, t),
            Outcome::Claim(c) => claim(&mut md, c),
            Outcome::Recovery(r) => recovery(&mut md, r),
            Outcome::Failed(e) => {
                let _ = writeln!(md, "**Failed**: {}\n", e.replace('\n', " "));
            }
            Outcome::Skipped => {}
        }
        if let Some(file) = plot_file(&part.outcome) {
            let _ = writeln!(md, "![{}]({file})\n", part.title);
        }
    }
    md
}

fn brokers(md: &mut String, rows: &[BrokerRow]) {
    let _ = writeln!(
        md,
        "| system | durable before the acknowledgement | publish msg/s | receive + ack msg/s | \
         server CPU µs/msg (publish) | note |\n|---|---|---:|---:|---:|---|"
    );
    for r in rows {
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} | {} | {} |",
            r.system,
            r.durability,
            rate(r.publish),
            rate(r.receive),
            r.server_cpu_us.map_or_else(|| "–".to_owned(), |c| format!("{c:.1}")),
            r.note
        );
    }
    let Some(twice) = rows.iter().find(|r| r.system.starts_with("twice")) else {
        let _ = writeln!(md);
        return;
    };
    let _ = writeln!(md, "\n| twice ÷ | publish | receive + ack |\n|---|---:|---:|");
    for other in rows.iter().filter(|r| !r.system.starts_with("twice")) {
        if other.publish.is_none() && other.receive.is_none() {
            continue;
        }
        let _ = writeln!(
            md,
            "| {} | {} | {} |",
            other.system,
            ratio(twice.publish, other.publish),
            ratio(twice.receive, other.receive)
        );
    }
    let _ = writeln!(md);
}

fn transports(md: &mut String, t: &TransportsBench) {
    let _ = writeln!(
        md,
        "{} messages of 256 bytes per measurement; the processor with the PostgreSQL inbox at \
         16 concurrent calls.\n",
        t.messages
    );
    let _ = writeln!(
        md,
        "| transport | consume + complete msg/s | processor msg/s | processor, batches of {} \
         msg/s | processor ÷ pgbench | batches ÷ pgbench |\n|---|---:|---:|---:|---:|---:|",
        t.batch
    );
    for r in &t.rows {
        let _ = writeln!(
            md,
            "| {} | {:.0} | {:.0} | {} | {} | {} |",
            r.transport,
            r.consume,
            r.processor,
            rate(r.batches),
            ratio(Some(r.processor), t.pgbench_tps),
            ratio(r.batches, t.pgbench_tps)
        );
    }
    let _ = writeln!(
        md,
        "\npgbench, the claim's SQL alone, 16 clients: {}\n",
        t.pgbench_tps.map_or_else(|| "not installed".to_owned(), |t| format!("{t:.0} tps"))
    );
    let durable: Vec<String> = t
        .rows
        .iter()
        .map(|r| format!("{}: {}", r.transport, crate::results::transport_durability(&r.transport)))
        .collect();
    let _ = writeln!(
        md,
        "Durable before the acknowledgement: the processor's claim, committed in PostgreSQL \
         (fsync'd) before each completion; the completion, per transport: {}.\n",
        durable.join("; ")
    );
}

fn claim(md: &mut String, c: &ClaimBench) {
    let _ = writeln!(md, "{} claims per point, one transaction each, PostgreSQL.\n", c.samples);
    let _ = writeln!(
        md,
        "| ids in the inbox | ids | mean µs | p50 µs | p99 µs | WAL bytes/claim |\n\
         |---:|---|---:|---:|---:|---:|"
    );
    for p in &c.points {
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} | {} | {} |",
            p.rows_before, p.ids, p.mean_us, p.p50_us, p.p99_us, p.wal_bytes_per_claim
        );
    }
    let _ = writeln!(md);
}

fn recovery(md: &mut String, r: &Recovery) {
    let _ = writeln!(
        md,
        "A durable broker filled with {} messages of 1 KiB, then opened again (the recovery).\n",
        r.messages
    );
    let _ = writeln!(
        md,
        "| step | time ms | s per million messages | active messages | RSS MiB |\n\
         |---|---:|---:|---:|---:|"
    );
    for (step, b, per_million) in [
        ("fill", &r.fill, r.fill_s_per_million()),
        ("reopen (recovery)", &r.reopen, r.reopen_s_per_million()),
    ] {
        let _ = writeln!(
            md,
            "| {step} | {} | {per_million:.2} | {} | {} |",
            b.elapsed_ms,
            b.active,
            b.rss_kib / 1024
        );
    }
    let _ = writeln!(md);
}
