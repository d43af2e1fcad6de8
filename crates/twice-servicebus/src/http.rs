//! The bodies of the HTTP side port: health, Prometheus text and the entity list.

use std::collections::BTreeMap;
use std::fmt::Write;

use crate::backend::{Backend, EntityStats};
use crate::metrics::EntityCounters;
use crate::server::Shared;

fn label(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

/// `/health`: 200 while the backend serves, 503 with the reason once it cannot (a broker
/// whose storage failed acknowledges nothing until it is restarted).
pub(crate) fn health(state: Result<(), String>) -> (&'static str, String) {
    match state {
        Ok(()) => ("200 OK", r#"{"status":"healthy"}"#.to_owned()),
        Err(reason) => (
            "503 Service Unavailable",
            serde_json::json!({ "status": "unhealthy", "reason": reason }).to_string(),
        ),
    }
}

/// `/metrics`: gauges per entity and state, counters per entity and operation, connections.
pub(crate) async fn metrics_text<B: Backend>(shared: &Shared<B>) -> String {
    let stats = shared.backend.stats().await;
    let counters = shared.metrics.entities();
    render(&stats, &counters, shared.metrics.connections(), shared.metrics.connections_total())
}

pub(crate) fn render(
    stats: &[EntityStats],
    counters: &BTreeMap<String, EntityCounters>,
    connections: u64,
    connections_total: u64,
) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "# HELP twice_servicebus_messages Messages in an entity, by state.");
    let _ = writeln!(out, "# TYPE twice_servicebus_messages gauge");
    for s in stats {
        let e = label(&s.path);
        for (state, n) in [
            ("active", s.active),
            ("scheduled", s.scheduled),
            ("deferred", s.deferred),
            ("dead_letter", s.dead_letter),
        ] {
            let _ =
                writeln!(out, "twice_servicebus_messages{{entity=\"{e}\",state=\"{state}\"}} {n}");
        }
    }
    let _ = writeln!(
        out,
        "# HELP twice_servicebus_operations_total Operations on an entity through AMQP."
    );
    let _ = writeln!(out, "# TYPE twice_servicebus_operations_total counter");
    for (entity, c) in counters {
        let e = label(entity);
        for (op, n) in [
            ("send", c.sends),
            ("receive", c.receives),
            ("complete", c.completes),
            ("abandon", c.abandons),
            ("dead_letter", c.dead_letters),
            ("lock_lost", c.lock_losses),
        ] {
            let _ = writeln!(
                out,
                "twice_servicebus_operations_total{{entity=\"{e}\",operation=\"{op}\"}} {n}"
            );
        }
    }
    let _ = writeln!(out, "# HELP twice_servicebus_connections Open AMQP connections.");
    let _ = writeln!(out, "# TYPE twice_servicebus_connections gauge");
    let _ = writeln!(out, "twice_servicebus_connections {connections}");
    let _ = writeln!(out, "# HELP twice_servicebus_connections_total AMQP connections accepted.");
    let _ = writeln!(out, "# TYPE twice_servicebus_connections_total counter");
    let _ = writeln!(out, "twice_servicebus_connections_total {connections_total}");
    out
}

/// `/entities`: a JSON array of the entities and their counts.
pub(crate) async fn entities_json<B: Backend>(shared: &Shared<B>) -> String {
    let list: Vec<serde_json::Value> = shared
        .backend
        .stats()
        .await
        .iter()
        .map(|s| {
            serde_json::json!({
                "path": s.path,
                "kind": s.kind,
                "active": s.active,
                "scheduled": s.scheduled,
                "deferred": s.deferred,
                "dead_letter": s.dead_letter,
            })
        })
        .collect();
    serde_json::Value::Array(list).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn health_is_503_with_the_reason_once_storage_failed() {
        assert_eq!(super::health(Ok(())), ("200 OK", r#"{"status":"healthy"}"#.to_owned()));
        let (status, body) = super::health(Err("storage failed: No space left".to_owned()));
        assert_eq!(status, "503 Service Unavailable");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["status"], "unhealthy");
        assert_eq!(v["reason"], "storage failed: No space left");
    }

    #[test]
    fn renders_prometheus_text() {
        let stats = vec![EntityStats {
            path: "q\"1".into(),
            kind: "queue".into(),
            active: 3,
            ..EntityStats::default()
        }];
        let mut counters = BTreeMap::new();
        counters.insert("q1".to_owned(), EntityCounters { sends: 5, ..EntityCounters::default() });
        let text = render(&stats, &counters, 2, 7);
        assert!(text.contains("twice_servicebus_messages{entity=\"q\\\"1\",state=\"active\"} 3"));
        assert!(
            text.contains("twice_servicebus_operations_total{entity=\"q1\",operation=\"send\"} 5")
        );
        assert!(text.contains("twice_servicebus_connections 2\n"));
        assert!(text.contains("twice_servicebus_connections_total 7\n"));
    }
}
