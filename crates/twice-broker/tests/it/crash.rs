//! A broker process killed with SIGKILL under load loses no acknowledged send.

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

use twice::ManualClock;

use crate::support::{example_bin, open, peek_all};

#[tokio::test]
async fn every_acknowledged_send_survives_sigkill() {
    let dir = tempfile::tempdir().unwrap();
    let mut acked: HashMap<String, i64> = HashMap::new();
    // Two kills in a row: the second run starts from the log the first one left.
    for run in 0..2 {
        let mut child = Command::new(example_bin("broker_child"))
            .args(["load", dir.path().to_str().unwrap(), "8", &format!("run{run}")])
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn broker_child");
        let stdout = child.stdout.take().unwrap();
        let mut lines = BufReader::new(stdout).lines();
        let mut this_run = 0;
        while this_run < 3000 {
            let line = lines.next().expect("the child stopped early").unwrap();
            let (id, seq) = line.split_once(' ').unwrap();
            acked.insert(id.to_owned(), seq.parse().unwrap());
            this_run += 1;
        }
        // `kill` sends SIGKILL on Unix: no destructor, no flush, no shutdown runs.
        child.kill().unwrap();
        // Acknowledgements printed before the kill landed are acknowledged too.
        for line in lines {
            let Ok(line) = line else { break };
            if let Some((id, seq)) = line.split_once(' ') {
                if let Ok(seq) = seq.parse() {
                    acked.insert(id.to_owned(), seq);
                }
            }
        }
        child.wait().unwrap();
        assert!(acked.len() >= 3000 * (run + 1));
    }

    let broker = open(dir.path(), &ManualClock::default()).await;
    let mut present: HashMap<String, i64> = HashMap::new();
    for path in ["load", "load/$DeadLetterQueue"] {
        for m in peek_all(&broker, path).await {
            present.insert(m.message_id().to_string(), m.sequence_number.get());
        }
    }
    let missing: Vec<_> = acked.keys().filter(|id| !present.contains_key(*id)).collect();
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
