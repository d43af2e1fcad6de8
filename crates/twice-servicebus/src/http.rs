//! The HTTP side port: its listener, and the bodies it serves (health, Prometheus text and the
//! entity list).

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::backend::{Backend, EntityStats};
use crate::metrics::EntityCounters;
use crate::shared::Shared;

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

pub(crate) async fn serve<B: Backend>(listener: TcpListener, shared: Arc<Shared<B>>) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let shared = shared.clone();
        tokio::spawn(async move {
            let _ =
                tokio::time::timeout(Duration::from_secs(10), http_request(stream, &shared)).await;
        });
    }
}

async fn http_request<B: Backend>(
    mut stream: TcpStream,
    shared: &Shared<B>,
) -> std::io::Result<()> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = stream.read(&mut chunk).await?;
        if n == 0 || buf.len() > 16 * 1024 {
            return Ok(());
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    let head = String::from_utf8_lossy(&buf);
    let mut parts = head.split_whitespace();
    let method = parts.next().unwrap_or("");
    let path = parts.next().unwrap_or("").split('?').next().unwrap_or("");
    let (status, content_type, body) = match (method, path) {
        ("GET", "/health") => {
            let (status, body) = health(shared.backend.health());
            (status, "application/json", body)
        }
        ("GET", "/metrics") => ("200 OK", "text/plain; version=0.0.4", metrics_text(shared).await),
        ("GET", "/entities") => ("200 OK", "application/json", entities_json(shared).await),
        ("GET", _) => ("404 Not Found", "text/plain", "not found\n".to_owned()),
        _ => ("405 Method Not Allowed", "text/plain", "method not allowed\n".to_owned()),
    };
    let response = format!(
        "HTTP/1.1 {status}\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(response.as_bytes()).await?;
    stream.shutdown().await
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
