//! The whole broker on a failing disk: seeded kills at every file operation (in the middle of
//! sends, completions, segment rolls, checkpoints, compaction and segment deletion), power
//! loss after them, and writes or fsyncs that fail with `ENOSPC` or `EIO`. After a restart,
//! every acknowledged send is there unless its completion was acknowledged, no acknowledged
//! completion comes back, and nothing appears that was never sent; the same for the rules
//! added to and removed from a subscription (each written as a record of its own). A broker
//! whose storage failed says so in [`crate::Broker::health`] and acknowledges nothing more.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::Duration;

use tokio::sync::mpsc;
use twice::{ManualClock, Message, SequenceNumber, SharedClock};

use super::fault::{Crash, Failure, FaultFs, Plan, Rng};
use super::fault_tests::run_seeded;
use super::*;
use crate::config::{Filter, QueueProperties, Rule, SubscriptionProperties, TopicProperties};
use crate::runtime::{Runtime, RuntimeOptions};
use crate::sql::SqlFilter;
use crate::{Broker, Error, Health, engine};

fn data_dir() -> &'static Path {
    Path::new("/fault/broker")
}

/// A durable runtime on `fs`, on a thread of its own.
fn start(fs: &FaultFs, segment_size: u64, relaxed: bool) -> Result<Broker, Error> {
    let clock = SharedClock::from(ManualClock::default());
    let (tx, rx) = mpsc::channel(64);
    let failure = FailureCell::default();
    let options = RuntimeOptions {
        dir: Some(data_dir().to_owned()),
        log: LogOptions { segment_size, cache_bytes: 1024, vfs: Arc::new(fs.clone()) },
        engine: engine::EngineOptions {
            deferred_serving: true,
            collect_freed: true,
            ..engine::EngineOptions::default()
        },
        clock: clock.clone(),
        max_commands_per_turn: 64,
        definitions: Vec::new(),
        relaxed_delivery_counts: relaxed,
        failure: failure.clone(),
    };
    let runtime = Runtime::open(options, rx)?;
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread().enable_time().build();
        rt.expect("a runtime").block_on(runtime.run());
    });
    Ok(Broker::from_channel_with_failure(tx, clock, failure))
}

async fn ids_in(broker: &Broker, path: &str) -> Result<Vec<String>, Error> {
    let mut out = Vec::new();
    let mut from = SequenceNumber::new(0);
    loop {
        let page = broker.peek(path, from, 1000).await?;
        let Some(last) = page.last() else { return Ok(out) };
        from = last.sequence_number.next();
        out.extend(page.iter().map(|m| m.message_id().to_string()));
    }
}

async fn broker_case(seed: u64) -> Result<(), String> {
    let mut rng = Rng::new(seed);
    let fs = FaultFs::new(Plan::default(), rng.next_u64());
    let segment_size = 512 + rng.below(4096);
    let relaxed = rng.chance(30);
    let broker = start(&fs, segment_size, relaxed).map_err(|e| e.to_string())?;
    broker.create_queue("q", QueueProperties::default()).await.map_err(|e| e.to_string())?;
    broker.create_topic("t", TopicProperties::default()).await.map_err(|e| e.to_string())?;
    let sub = SubscriptionProperties::default();
    broker.create_subscription("t", "s", sub).await.map_err(|e| e.to_string())?;

    let failure = Failure::random(&mut rng, 2);
    let at = 1 + rng.below(250);
    // A kill lands at a random operation, or at the n-th of a kind, so that rolls (create,
    // rename), compaction's deletions (remove) and recovery's cuts get their share.
    const KINDS: [&str; 5] = ["write", "sync", "create", "rename", "remove"];
    let kind = KINDS[rng.index(KINDS.len())];
    fs.plan(match failure {
        Some(f) => Plan { fail_from: Some((at, f)), ..Plan::default() },
        None if rng.chance(50) => Plan { kill_at: Some(at), ..Plan::default() },
        None => Plan { kill_on: Some((kind, 1 + rng.below(4))), ..Plan::default() },
    });

    let mut sent = BTreeSet::new();
    let mut attempted = BTreeSet::new();
    let mut completed = BTreeSet::new();
    let mut completing = BTreeSet::new();
    let mut storage_error = false;
    let mut next = 0u32;
    // Rules: acknowledged and not removed, ever attempted, removals attempted and acknowledged.
    let mut rules = BTreeSet::from(["$Default".to_owned()]);
    let mut adding = BTreeSet::new();
    let mut removing = BTreeSet::new();
    let mut removed = BTreeSet::new();
    for _ in 0..rng.below(120) {
        let r: Result<(), Error> = async {
            if rng.chance(10) {
                if !rules.is_empty() && rng.chance(40) {
                    let name =
                        rules.iter().nth(rng.index(rules.len())).cloned().unwrap_or_default();
                    removing.insert(name.clone());
                    broker.delete_rule("t", "s", &name).await?;
                    rules.remove(&name);
                    removed.insert(name);
                } else {
                    let name = format!("r{next}");
                    next += 1;
                    let text = format!("p = '{}'", "x".repeat(rng.index(2000)));
                    let filter = SqlFilter::parse(&text)
                        .map_err(|e| Error::InvalidArgument(e.to_string()))?;
                    adding.insert(name.clone());
                    broker
                        .create_rule("t", "s", Rule::new(name.clone(), Filter::Sql(filter)))
                        .await?;
                    rules.insert(name);
                }
            } else if rng.chance(50) {
                let mut batch = Vec::new();
                let mut ids = Vec::new();
                for _ in 0..1 + rng.below(4) {
                    let id = format!("m{next}");
                    next += 1;
                    let n = if rng.chance(10) { rng.index(3000) } else { rng.index(200) };
                    batch.push(Message::new(vec![7u8; n]).with_message_id(id.clone()));
                    attempted.insert(id.clone());
                    ids.push(id);
                }
                broker.send_batch("q", batch).await?;
                sent.extend(ids);
            } else {
                let got = broker.receive("q", 1 + rng.index(5), Duration::ZERO).await?;
                for m in got {
                    if rng.chance(80) {
                        let id = m.message_id().to_string();
                        completing.insert(id.clone());
                        broker.complete(m.lock_token.ok_or(Error::MessageLockLost)?).await?;
                        completed.insert(id);
                    }
                }
            }
            Ok(())
        }
        .await;
        match r {
            Ok(()) => {}
            Err(Error::Io(_)) => {
                storage_error = true;
                break;
            }
            Err(e) => return Err(format!("unexpected error: {e}")),
        }
    }
    // A broker whose disk fails says so, and acknowledges nothing more. (A killed process
    // has no health to report: its reads fail too, before any write tells the log.)
    if storage_error && failure.is_some() {
        if !matches!(broker.health(), Health::StorageFailed(_)) {
            return Err(format!("health after a storage error: {:?}", broker.health()));
        }
        if broker.send("q", Message::new("late").with_message_id("late")).await.is_ok() {
            return Err("a broker whose storage failed acknowledged a send".into());
        }
    }
    // The process ends: killed, or (after a failure) stopped and started again with a disk
    // that works.
    super::fault_tests::note_kill(&fs);
    fs.kill();
    broker.shutdown().await;
    drop(broker);
    let crash = Crash::random(&mut rng);
    let fs2 = fs.crash(crash);
    let ctx = |e: &dyn std::fmt::Display| {
        format!(
            "{crash:?} after {failure:?} at op {at}, segment size {segment_size}, relaxed {relaxed}: {e}"
        )
    };
    let broker = start(&fs2, segment_size, relaxed).map_err(|e| ctx(&e))?;
    let ids = ids_in(&broker, "q").await.map_err(|e| ctx(&e))?;
    let mut seen = BTreeMap::new();
    for id in &ids {
        *seen.entry(id.as_str()).or_insert(0) += 1;
    }
    if let Some((id, n)) = seen.iter().find(|(_, n)| **n > 1) {
        return Err(ctx(&format!("{id} is there {n} times")));
    }
    if let Some(id) = ids.iter().find(|id| !attempted.contains(*id)) {
        return Err(ctx(&format!("{id} was never sent")));
    }
    if let Some(id) = ids.iter().find(|id| completed.contains(*id)) {
        return Err(ctx(&format!("{id} came back after its completion was acknowledged")));
    }
    if let Some(id) =
        sent.iter().find(|id| !completing.contains(*id) && !seen.contains_key(id.as_str()))
    {
        return Err(ctx(&format!("acknowledged send {id} is lost")));
    }
    let got: BTreeSet<String> = broker
        .get_rules("t", "s")
        .await
        .map_err(|e| ctx(&e))?
        .into_iter()
        .map(|r| r.name)
        .collect();
    if let Some(r) = rules.iter().find(|r| !removing.contains(*r) && !got.contains(*r)) {
        return Err(ctx(&format!("acknowledged rule {r} is lost")));
    }
    if let Some(r) = removed.iter().find(|r| got.contains(*r)) {
        return Err(ctx(&format!("rule {r} came back after its removal was acknowledged")));
    }
    if let Some(r) = got.iter().find(|r| *r != "$Default" && !adding.contains(*r)) {
        return Err(ctx(&format!("rule {r} was never added")));
    }
    // The recovered broker works.
    broker.send("q", Message::new("after").with_message_id("after")).await.map_err(|e| ctx(&e))?;
    broker.shutdown().await;
    Ok(())
}

#[test]
fn the_broker_survives_seeded_kills_power_loss_and_failing_disks() {
    let rt = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
    run_seeded(1200, 3, |seed| rt.block_on(broker_case(seed)));
}
