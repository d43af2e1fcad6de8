//! A broker process for the crash and memory tests of twice-broker (not a user-facing tool).
//!
//! `broker_child load <dir> <senders> <prefix>`: sends to queue `load` from concurrent senders
//! until killed, printing `<message id> <sequence number>` for every acknowledged send (ids
//! start with `prefix`). A receiver completes the messages of sender 0, printing
//! `completing <message id>` before and `completed <message id>` after every acknowledged
//! completion, and abandons the others. With
//! `TWICE_CHILD_RELAXED=1` the broker runs with relaxed delivery counts.
//!
//! `broker_child fill <dir> <count> [--json]`: queues `count` messages of 1 KiB, then prints
//! `active <n>`, `rss_kib <n>` (the process's resident memory) and `elapsed_ms <n>`.
//!
//! `broker_child reopen <dir> [--json]`: opens the directory, prints `active <n>`, `rss_kib <n>`
//! and `elapsed_ms <n>`.
//!
//! With `--json`, `fill` and `reopen` also print, last, the same numbers as one line of JSON
//! (for `twice-bench`).
//!
//! `broker_child no-fds <dir>`: opens a broker with 4 KiB segments, then opens files until the
//! process has no file descriptor left, then sends 300 messages of 512 bytes (enough to fill
//! many segments) and receives and completes them all (reading bodies back from disk). Prints
//! `sent <n>`, `completed <n>` and `health <Healthy|...>`, or the first error.
//!
//! `broker_child no-space <dir>`: sends messages of 1 KiB until a send fails (run it with a
//! file size limit), printing `acked <id>` for each acknowledged one, then `health <...>` and
//! whether a later send was refused (`late send refused`).
//!
//! `broker_child amplification <dir> <backlog MiB> <message KiB> <rounds>`: queues a backlog of
//! that many MiB in messages of that size in queue `backlog` (never consumed), then sends,
//! receives and completes `rounds` messages of the same size in queue `work`, and prints the
//! bytes sent and written during the rounds and their ratio (the write amplification).

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use twice::Message;
use twice::clock::Stopwatch;
use twice_broker::config::QueueProperties;
use twice_broker::{Broker, BrokerOptions, Error};

fn rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// Prints the numbers of `fill` and `reopen`, and their JSON line when `flag` is `--json`.
fn report(mode: &str, active: impl Into<u64>, elapsed: Duration, flag: Option<&String>) {
    let (active, rss) = (active.into(), rss_kib());
    let elapsed_ms = u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX);
    println!("active {active}");
    println!("rss_kib {rss}");
    println!("elapsed_ms {elapsed_ms}");
    if flag.is_some_and(|f| f == "--json") {
        let line = serde_json::json!({
            "bench": "broker_child",
            "mode": mode,
            "active": active,
            "rss_kib": rss,
            "elapsed_ms": elapsed_ms,
        });
        println!("{line}");
    }
}

async fn open_queue(dir: &str, queue: &str) -> Result<Broker, Error> {
    let relaxed = std::env::var("TWICE_CHILD_RELAXED").is_ok_and(|v| v == "1");
    let options = BrokerOptions::durable(dir).relaxed_delivery_counts(relaxed);
    let broker = Broker::open(options).await?;
    // The largest quota Service Bus offers: a backlog of millions of messages fits.
    let properties = QueueProperties::default()
        .with_max_size_in_megabytes(twice_broker::config::MAX_MAX_SIZE_IN_MEGABYTES);
    match broker.create_queue(queue, properties).await {
        Ok(()) | Err(Error::EntityAlreadyExists(_)) => Ok(broker),
        Err(e) => Err(e),
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let arg = |i: usize| args.get(i).cloned().ok_or(format!("missing argument {i}"));
    match arg(1)?.as_str() {
        "no-fds" => {
            let options = BrokerOptions::durable(arg(2)?).segment_size(4096);
            let broker = Broker::open(options).await?;
            broker.create_queue("q", QueueProperties::default()).await?;
            // Every descriptor the process may open is taken: from now on, only what the
            // broker reserved is there.
            let mut held = Vec::new();
            while let Ok(f) = std::fs::File::open("/dev/null") {
                held.push(f);
            }
            let mut sent = 0;
            for i in 0..300 {
                let m = Message::new(vec![b'x'; 512]).with_message_id(format!("m{i}"));
                if let Err(e) = broker.send("q", m).await {
                    println!("send failed: {e}");
                    break;
                }
                sent += 1;
            }
            println!("sent {sent}");
            let mut completed = 0;
            while completed < sent {
                match broker.receive("q", 50, Duration::ZERO).await {
                    Ok(got) if got.is_empty() => break,
                    Ok(got) => {
                        for m in got {
                            let Some(t) = m.lock_token else { continue };
                            if let Err(e) = broker.complete(t).await {
                                println!("complete failed: {e}");
                                break;
                            }
                            completed += 1;
                        }
                    }
                    Err(e) => {
                        println!("receive failed: {e}");
                        break;
                    }
                }
            }
            println!("completed {completed}");
            println!("health {:?}", broker.health());
            drop(held);
            broker.shutdown().await;
        }
        "no-space" => {
            let broker = open_queue(&arg(2)?, "q").await?;
            for i in 0.. {
                let id = format!("m{i}");
                let m = Message::new(vec![b'x'; 1024]).with_message_id(id.as_str());
                if broker.send("q", m).await.is_err() {
                    break;
                }
                println!("acked {id}");
            }
            let health = broker.health();
            println!(
                "health {}",
                if matches!(health, twice_broker::Health::StorageFailed(_)) {
                    "StorageFailed"
                } else {
                    "other"
                }
            );
            if broker.send("q", Message::new("late").with_message_id("late")).await.is_err() {
                println!("late send refused");
            }
            broker.shutdown().await;
        }
        "amplification" => {
            let broker = open_queue(&arg(2)?, "backlog").await?;
            broker.create_queue("work", QueueProperties::default()).await?;
            let backlog_mib: usize = arg(3)?.parse()?;
            let size = arg(4)?.parse::<usize>()? * 1024;
            let rounds: usize = arg(5)?.parse()?;
            let backlog = (backlog_mib << 20) / size;
            for n in 0..backlog {
                let m = Message::new(vec![b'b'; size]).with_message_id(format!("b{n}"));
                broker.send("backlog", m).await?;
            }
            let before = broker.storage_statistics().await?;
            let watch = Stopwatch::start();
            for n in 0..rounds {
                let m = Message::new(vec![b'w'; size]).with_message_id(format!("w{n}"));
                broker.send("work", m).await?;
                for got in broker.receive("work", 1, Duration::from_secs(1)).await? {
                    if let Some(t) = got.lock_token {
                        broker.complete(t).await?;
                    }
                }
            }
            let after = broker.storage_statistics().await?;
            let sent = (rounds * size) as u64;
            let written = after.bytes_written - before.bytes_written;
            println!("backlog_messages {backlog}");
            println!("bytes_sent {sent}");
            println!("bytes_written {written}");
            println!("amplification {:.2}", written as f64 / sent as f64);
            println!("segments {}", after.segments);
            println!("elapsed_ms {}", watch.elapsed().as_millis());
            broker.shutdown().await;
        }
        "load" => {
            let broker = open_queue(&arg(2)?, "load").await?;
            let senders: usize = arg(3)?.parse()?;
            let prefix = arg(4)?;
            let out = Arc::new(Mutex::new(std::io::stdout()));
            let mut tasks = Vec::new();
            for s in 0..senders {
                let (broker, out, prefix) = (broker.clone(), out.clone(), prefix.clone());
                tasks.push(tokio::spawn(async move {
                    for n in 0u64.. {
                        let id = format!("{prefix}-s{s}-{n}");
                        let m = Message::new(vec![b'x'; 512]).with_message_id(id.as_str());
                        let Ok(outcome) = broker.send("load", m).await else { return };
                        let seq = outcome.sequence_number().map_or(-1, |s| s.get());
                        // One line per acknowledgement, flushed at once: the parent kills
                        // this process at any moment and trusts every line it read.
                        let mut out = out.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                        let _ = writeln!(out, "{id} {seq}");
                        let _ = out.flush();
                    }
                }));
            }
            // A receiver that locks, completes and abandons keeps lock, removal and
            // delivery-count records in the log too.
            let receiver = broker.clone();
            tasks.push(tokio::spawn(async move {
                loop {
                    let Ok(got) = receiver.receive("load", 8, Duration::from_millis(50)).await
                    else {
                        return;
                    };
                    for m in got {
                        let Some(t) = m.lock_token else { continue };
                        if m.message_id().as_str().contains("-s0-") {
                            // Said before the call: a kill between the acknowledgement and
                            // the line below leaves a message gone that the parent would
                            // otherwise count as lost.
                            {
                                let mut out =
                                    out.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                                let _ = writeln!(out, "completing {}", m.message_id());
                                let _ = out.flush();
                            }
                            if receiver.complete(t).await.is_ok() {
                                let mut out =
                                    out.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                                let _ = writeln!(out, "completed {}", m.message_id());
                                let _ = out.flush();
                            }
                        } else {
                            let _ = receiver.abandon(t, Default::default()).await;
                        }
                    }
                }
            }));
            for t in tasks {
                t.await?;
            }
        }
        "fill" => {
            let watch = Stopwatch::start();
            let broker = open_queue(&arg(2)?, "fill").await?;
            let count: usize = arg(3)?.parse()?;
            let tasks: Vec<_> = (0..4)
                .map(|t| {
                    let broker = broker.clone();
                    tokio::spawn(async move {
                        let mut i = t * 100;
                        while i < count {
                            let batch: Vec<Message> = (i..count.min(i + 100))
                                .map(|n| {
                                    Message::new(vec![b'm'; 1024]).with_message_id(format!("m{n}"))
                                })
                                .collect();
                            broker.send_batch("fill", batch).await?;
                            i += 400;
                        }
                        Ok::<(), Error>(())
                    })
                })
                .collect();
            for t in tasks {
                t.await??;
            }
            let counts = broker.counts("fill").await?;
            report("fill", counts.active, watch.elapsed(), args.get(4));
            broker.shutdown().await;
        }
        "reopen" => {
            let watch = Stopwatch::start();
            let broker = open_queue(&arg(2)?, "fill").await?;
            let counts = broker.counts("fill").await?;
            report("reopen", counts.active, watch.elapsed(), args.get(3));
            broker.shutdown().await;
        }
        other => return Err(format!("unknown mode {other}").into()),
    }
    Ok(())
}
