//! A broker process killed with SIGKILL under load loses no acknowledged send, and brings back
//! no acknowledged completion: with strict and with relaxed delivery counts.

use std::collections::{HashMap, HashSet};
use std::process::Command;

use twice::ManualClock;
use twice_testkit::process::Child;

use crate::support::{example_bin, open, peek_all};

#[tokio::test]
async fn every_acknowledged_send_survives_sigkill() {
    survives_sigkill(false).await;
}

#[tokio::test]
async fn with_relaxed_delivery_counts_every_acknowledged_send_survives_sigkill() {
    survives_sigkill(true).await;
}

async fn survives_sigkill(relaxed: bool) {
    let dir = tempfile::tempdir().unwrap();
    let mut acked: HashMap<String, i64> = HashMap::new();
    let mut completed: HashSet<String> = HashSet::new();
    // Completions asked for: one the child was killed in may have happened.
    let mut completing: HashSet<String> = HashSet::new();
    // One line of the child: an acknowledged send, a completion asked for, or an acknowledged
    // completion.
    let mut record = |line: &str| {
        if let Some(id) = line.strip_prefix("completed ") {
            completed.insert(id.to_owned());
        } else if let Some(id) = line.strip_prefix("completing ") {
            completing.insert(id.to_owned());
        } else if let Some((id, seq)) = line.split_once(' ')
            && let Ok(seq) = seq.parse()
        {
            acked.insert(id.to_owned(), seq);
        }
    };
    // Two kills in a row: the second run starts from the log the first one left.
    for run in 0..2 {
        let mut child = Child::spawn(
            Command::new(example_bin("broker_child"))
                .args(["load", dir.path().to_str().unwrap(), "8", &format!("run{run}")])
                .env("TWICE_CHILD_RELAXED", if relaxed { "1" } else { "0" }),
        );
        for _ in 0..3000 {
            let line = child.next_line().expect("the child stopped early");
            record(&line);
        }
        // Acknowledgements printed before the kill landed are acknowledged too.
        for line in child.kill() {
            record(&line);
        }
    }
    assert!(acked.len() >= 4000, "only {} acknowledged sends", acked.len());
    assert!(!completed.is_empty(), "the child completed nothing");

    let broker = open(dir.path(), &ManualClock::default()).await;
    let mut present: HashMap<String, i64> = HashMap::new();
    for path in ["load", "load/$DeadLetterQueue"] {
        for m in peek_all(&broker, path).await {
            present.insert(m.message_id().to_string(), m.sequence_number.get());
        }
    }
    let back: Vec<_> = completed.iter().filter(|id| present.contains_key(*id)).collect();
    assert!(back.is_empty(), "{} completed messages came back, e.g. {:?}", back.len(), &back[..1]);
    let missing: Vec<_> =
        acked.keys().filter(|id| !present.contains_key(*id) && !completing.contains(*id)).collect();
    assert!(
        missing.is_empty(),
        "{} acknowledged sends lost, e.g. {:?}",
        missing.len(),
        &missing[..missing.len().min(5)]
    );
    let in_queue = peek_all(&broker, "load").await;
    for m in &in_queue {
        if let Some(seq) = acked.get(m.message_id().as_str()) {
            assert_eq!(m.sequence_number.get(), *seq, "{}", m.message_id());
        }
    }
}
