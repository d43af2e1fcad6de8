//! The conformance kit against every transport: the embedded broker, the Service Bus client
//! on `twice serve`, RabbitMQ and NATS JetStream, each with the SQLite, PostgreSQL and MariaDB
//! inboxes.
//!
//! The embedded broker and `twice serve` are restarted for real in the reconnect scenario
//! (they run in the test). RabbitMQ and NATS are shared by every test on the machine, so here
//! their connections are cut at a proxy and their restart row says `not run`; the ignored
//! tests at the end restart them for real, and `.ci/run` runs those in a step of its own.
//!
//! `docs/transports.md` holds the table this test measured, not the expectations: the
//! expectations only decide whether the test passes.

mod harness;
mod outbox;

use twice_testkit::conformance::sessions::no_sessions;
use twice_testkit::conformance::{self, Report, not_run};
use twice_testkit::process::ServerRestart;

use self::harness::{
    Embedded, NATS_INSTEAD_OF_SESSIONS, Nats, RABBITMQ_INSTEAD_OF_SESSIONS, RabbitMq, ServiceBus,
};

/// What the embedded broker does differently from Service Bus in the kit.
fn embedded_expected() -> Report {
    conformance::expected(
        "embedded (twice-broker)",
        &[
            (conformance::RECONNECT, conformance::REOPENED),
            (conformance::RECONNECT_CUT, &not_run(conformance::IN_PROCESS)),
            (conformance::IN_FLIGHT, &not_run(conformance::IN_PROCESS)),
            (conformance::LOCK_MISMATCH, &not_run(harness::EMBEDDED_LOCK)),
        ],
    )
}

/// What the Service Bus client on `twice serve` does differently from Service Bus in the kit.
fn servicebus_expected() -> Report {
    conformance::expected(
        "twice serve (twice-servicebus-client)",
        &[
            (conformance::RECONNECT_CUT, &not_run(conformance::RESTART_ONLY)),
            // The client takes the entity's properties from `ReceiverOptions::entity_info`
            // (AMQP does not carry them); each delivery's lock is the broker's all the same.
            (conformance::LOCK_MISMATCH, "reports a lock of 30s; the broker's is 5s"),
        ],
    )
}

/// A message without an id on a transport whose default identity policy dead-letters it.
const NO_ID_DEAD_LETTERED: &str = "no: never handed out, dead-lettered as MissingMessageId (an \
    identity policy names it otherwise)";

/// What RabbitMQ does differently from Service Bus in the kit.
fn rabbitmq_expected() -> Report {
    conformance::expected(
        "RabbitMQ (twice-rabbitmq)",
        &[
            (
                conformance::DUPLICATES,
                "no: both copies are delivered; the inbox claim completes the second",
            ),
            (conformance::DEFER, "no: Unsupported"),
            (conformance::RELEASE, "no: the release counts a delivery"),
            (conformance::SESSION_ORDER, &no_sessions(RABBITMQ_INSTEAD_OF_SESSIONS)),
            (conformance::RECONNECT, &not_run(conformance::SHARED_SERVER)),
            (conformance::LOCK_MISMATCH, &not_run(harness::RABBITMQ_LOCK)),
            (conformance::FOREIGN_PRODUCER, NO_ID_DEAD_LETTERED),
        ],
    )
}

/// What NATS JetStream does differently from Service Bus in the kit.
fn nats_expected() -> Report {
    conformance::expected(
        "NATS JetStream (twice-nats)",
        &[
            (conformance::DEFER, "no: Unsupported"),
            (conformance::RELEASE, "no: the release counts a delivery"),
            (conformance::SESSION_ORDER, &no_sessions(NATS_INSTEAD_OF_SESSIONS)),
            (conformance::RECONNECT, &not_run(conformance::SHARED_SERVER)),
            (conformance::FOREIGN_PRODUCER, NO_ID_DEAD_LETTERED),
        ],
    )
}

/// Every transport's kit, two at a time; `None` for one whose broker is unreachable (with `CI`
/// unset).
async fn measure() -> [Option<Report>; 4] {
    let (rabbitmq, nats) = (RabbitMq::default(), Nats::default());
    let (embedded, rabbitmq) = tokio::join!(
        bounded("embedded", conformance::run(&Embedded)),
        bounded("RabbitMQ", conformance::run(&rabbitmq))
    );
    let (servicebus, nats) = tokio::join!(
        bounded("Service Bus client", conformance::run(&ServiceBus)),
        bounded("NATS", conformance::run(&nats))
    );
    [embedded, servicebus, rabbitmq, nats]
}

/// A transport's whole kit takes about a minute here: one still running after ten has hung
/// (every scenario's own waits are bounded), and fails naming its transport rather than
/// holding the run.
async fn bounded<T>(transport: &str, kit: impl std::future::Future<Output = T>) -> T {
    const WHOLE_KIT: std::time::Duration = std::time::Duration::from_secs(600);
    match tokio::time::timeout(WHOLE_KIT, kit).await {
        Ok(report) => report,
        Err(_) => panic!("the kit on {transport} did not finish within {WHOLE_KIT:?}"),
    }
}

/// Plays the kit on every transport, checks each report against what that transport is
/// expected to do differently, and checks that `docs/transports.md` holds the table of what
/// was measured in this run (a transport that did not run would show `not run` in every
/// cell; then the docs are not checked, and the table is printed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_transport_passes_the_kit_and_the_docs_show_what_it_measured() {
    let expected =
        [embedded_expected(), servicebus_expected(), rabbitmq_expected(), nats_expected()];
    let measured = measure().await;
    let mut columns = Vec::new();
    let mut differences = Vec::new();
    let mut not_run = Vec::new();
    for (m, e) in measured.into_iter().zip(&expected) {
        match m {
            Some(report) => {
                for (capability, cell) in &report.cells {
                    let want = e.cells.get(capability).map_or("", String::as_str);
                    if cell != want {
                        differences.push(format!(
                            "{}: {capability}: measured {cell:?}, expected {want:?}",
                            report.transport
                        ));
                    }
                }
                columns.push(report);
            }
            None => {
                not_run.push(e.transport.clone());
                columns.push(Report::not_run(&e.transport));
            }
        }
    }
    let table = conformance::render_table(&columns);
    let docs = if not_run.is_empty() {
        check_docs(&table)
    } else {
        eprintln!("not run: {not_run:?}; docs/transports.md not checked. Measured:\n{table}");
        Ok(())
    };
    assert!(differences.is_empty(), "the kit measured otherwise:\n{}", differences.join("\n"));
    docs.unwrap_or_else(|e| panic!("{e}"));
}

/// The processor scenarios again with the processor taking batches of up to 8 messages per
/// transaction, on every transport and store: each must end as it does one message at a time
/// (the work once, the poison dead-lettered, a lost lock or a crash after the commit harmless).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_transport_passes_the_processor_scenarios_with_batches() {
    const BATCH: usize = 8;
    let (rabbitmq, nats) = (RabbitMq::default(), Nats::default());
    let (embedded, rabbitmq) = tokio::join!(
        conformance::run_batched(&Embedded, BATCH),
        conformance::run_batched(&rabbitmq, BATCH)
    );
    let (servicebus, nats) = tokio::join!(
        conformance::run_batched(&ServiceBus, BATCH),
        conformance::run_batched(&nats, BATCH)
    );
    let mut ran = 0;
    for report in [embedded, servicebus, rabbitmq, nats].into_iter().flatten() {
        ran += 1;
        assert_eq!(report.cells.len(), 5, "{}: {:?}", report.transport, report.cells);
        for (capability, cell) in &report.cells {
            assert_eq!(cell, conformance::YES, "{}: {capability}", report.transport);
        }
    }
    if ran == 0 {
        eprintln!("not run: no transport's services are reachable");
    }
}

/// The table in `docs/transports.md` must be `table`, the one this run measured; when it is
/// not, the file is rewritten with it (for review) and the error says so.
fn check_docs(table: &str) -> Result<(), String> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/transports.md");
    let doc = std::fs::read_to_string(&path).expect("docs/transports.md");
    const START: &str = "<!-- capability table: generated by the conformance kit -->\n";
    const END: &str = "<!-- end of the capability table -->";
    let (Some(start), Some(end)) = (doc.find(START), doc.find(END)) else {
        panic!("docs/transports.md lacks the table markers");
    };
    let current = &doc[start + START.len()..end];
    if current != table {
        // Write the measured table so that the diff can be reviewed and committed, and fail.
        let updated = format!("{}{START}{table}{}", &doc[..start], &doc[end..]);
        std::fs::write(&path, updated).expect("writing docs/transports.md");
        return Err(format!(
            "docs/transports.md did not hold the measured table; it was rewritten:\n{table}"
        ));
    }
    Ok(())
}

/// A restart of a machine's server: `command_var` overrides the command, `addr_var` the
/// address (to restart a server of one's own instead of the machine's).
fn restart_of(command_var: &str, command: &str, addr_var: &str, addr: &str) -> ServerRestart {
    ServerRestart::new(
        std::env::var(command_var).unwrap_or_else(|_| command.to_owned()),
        std::env::var(addr_var).unwrap_or_else(|_| addr.to_owned()),
    )
}

/// RabbitMQ stopped and started again (`rabbitmqctl stop_app && rabbitmqctl start_app`) while a
/// transport is connected: the transport reconnects and nothing sent before is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "restarts the machine's RabbitMQ, which every other test uses; .ci/run runs it alone"]
async fn rabbitmq_reconnects_after_a_real_restart() {
    let restart = restart_of(
        "TWICE_KIT_RABBITMQ_RESTART",
        "rabbitmqctl stop_app && rabbitmqctl start_app",
        "TWICE_KIT_RABBITMQ_ADDR",
        "127.0.0.1:5672",
    );
    let harness = RabbitMq { restart: Some(restart) };
    let Some(cell) = conformance::reconnect(&harness).await else { return };
    assert_eq!(cell, conformance::YES);
}

/// NATS stopped and started again (the server process killed and started on its JetStream
/// directory) while a transport is connected: the transport reconnects and nothing sent before
/// is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "restarts the machine's NATS, which every other test uses; .ci/run runs it alone"]
async fn nats_reconnects_after_a_real_restart() {
    let restart = restart_of(
        "TWICE_KIT_NATS_RESTART",
        "start-stop-daemon --stop --oknodo --retry 10 --exec /usr/sbin/nats-server && \
         start-stop-daemon --start --oknodo --background --exec /usr/sbin/nats-server -- \
         -a 127.0.0.1 -p 4222 -js -sd /var/lib/nats-server -l /var/log/nats-server.log",
        "TWICE_KIT_NATS_ADDR",
        "127.0.0.1:4222",
    );
    let harness = Nats { restart: Some(restart) };
    let Some(cell) = conformance::reconnect(&harness).await else { return };
    assert_eq!(cell, conformance::YES);
}
