//! The log under seeded faults: power loss, kills at every step, failing writes and syncs,
//! damaged closed segments. Each case prints its seed when it fails; `TWICE_FAULT_SEED=N`
//! runs one case, `TWICE_FAULT_CASES=N` sets how many run.

use std::path::Path;

use super::fault::{Crash, Failure, FaultFs, Plan, Rng};
use super::*;

/// How many seeded cases a suite runs (`TWICE_FAULT_CASES`), or the one seed to run
/// (`TWICE_FAULT_SEED`).
pub(crate) fn seeds(default_cases: u64, salt: u64) -> Vec<u64> {
    if let Some(seed) = std::env::var("TWICE_FAULT_SEED").ok().and_then(|s| s.parse().ok()) {
        return vec![seed];
    }
    let cases = std::env::var("TWICE_FAULT_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default_cases);
    // A different base per run, printed, so that CI explores new schedules over time and any
    // failure can be replayed.
    let base = Rng::new(salt ^ u64::from(std::process::id())).next_u64();
    eprintln!("fault suite base seed {base} ({cases} cases); replay one with TWICE_FAULT_SEED");
    (0..cases).map(|i| base.wrapping_add(i)).collect()
}

thread_local! {
    /// The kinds of operation that planned kills stopped, in the suite running on this thread.
    static KILLS: std::cell::RefCell<std::collections::BTreeMap<&'static str, u64>> =
        std::cell::RefCell::default();
}

/// Counts where a planned kill landed, for the suite's summary.
pub(crate) fn note_kill(fs: &FaultFs) {
    if let Some(kind) = fs.killed_at() {
        KILLS.with(|k| *k.borrow_mut().entry(kind).or_default() += 1);
    }
}

/// Runs `case` for every seed; reports the failing seeds.
pub(crate) fn run_seeded(default_cases: u64, salt: u64, case: impl Fn(u64) -> Result<(), String>) {
    KILLS.with(|k| k.borrow_mut().clear());
    let mut failed = Vec::new();
    for seed in seeds(default_cases, salt) {
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| case(seed)));
        match r {
            Ok(Ok(())) => {}
            Ok(Err(e)) => failed.push(format!("seed {seed}: {e}")),
            Err(_) => failed.push(format!("seed {seed}: panicked")),
        }
        if failed.len() >= 5 {
            break;
        }
    }
    KILLS.with(|k| eprintln!("planned kills landed in: {:?}", k.borrow()));
    assert!(
        failed.is_empty(),
        "failing cases (TWICE_FAULT_SEED=N to replay):\n{}",
        failed.join("\n")
    );
}

#[derive(Clone, Debug)]
struct Written {
    location: Location,
    payload: Bytes,
    /// The commit (counted from 1 in this run) that carried it.
    commit: u64,
}

fn data_dir() -> &'static Path {
    Path::new("/fault/data")
}

fn options(fs: &FaultFs, segment_size: u64, cache_bytes: usize) -> LogOptions {
    LogOptions { segment_size, cache_bytes, vfs: Arc::new(fs.clone()) }
}

fn random_payload(rng: &mut Rng) -> Bytes {
    let n = if rng.chance(20) { rng.index(5000) } else { rng.index(300) };
    let fill = u8::try_from(rng.below(256)).unwrap_or(0);
    Bytes::from(
        (0..n).map(|i| fill.wrapping_add(u8::try_from(i % 251).unwrap_or(0))).collect::<Vec<_>>(),
    )
}

/// One seeded case: a workload on the log with a fault planned somewhere in it, then a crash
/// of a random kind, then a reopen that must find every acknowledged record, in order, and
/// nothing that was not written.
fn log_case(seed: u64) -> Result<(), String> {
    let mut rng = Rng::new(seed);
    let fs = FaultFs::new(Plan::default(), rng.next_u64());
    let segment_size = 512 + rng.below(4096);
    let cache = rng.index(4096);
    let (mut log, replay) =
        Log::open(data_dir(), options(&fs, segment_size, cache)).map_err(|e| e.to_string())?;
    if replay.count() != 0 {
        return Err("a new log replays records".into());
    }
    let failure = Failure::random(&mut rng, 1);
    let at = 1 + rng.below(200);
    fs.plan(match failure {
        Some(f) => Plan { fail_from: Some((at, f)), ..Plan::default() },
        None => Plan { kill_at: Some(at), ..Plan::default() },
    });

    let mut written: Vec<Written> = Vec::new();
    let mut acked_commit = 0;
    let mut commit = 0;
    let mut removed_up_to = 0;
    let mut seq_of_commit = Vec::new();
    // Holding the writer now and then piles commits up into one group, written together and
    // synced once: a power loss may then keep pages of a later commit and not of an earlier.
    let gate = log.writer_gate();
    let mut held = None;
    for _ in 0..rng.below(80) {
        if rng.chance(25) {
            held = if held.is_some() { None } else { Some(gate.hold()) };
        }
        let r: Result<(), StorageError> = (|| {
            for _ in 0..1 + rng.below(4) {
                let payload = random_payload(&mut rng);
                let location = log.append(payload.clone())?;
                written.push(Written { location, payload, commit: commit + 1 });
            }
            if log.should_roll() {
                log.roll();
            }
            let seq = log.commit()?;
            commit += 1;
            seq_of_commit.push(seq);
            if rng.chance(10) && log.segments().count() > 2 {
                let oldest = log.segments().next().unwrap_or(0);
                log.remove_segment(oldest)?;
                removed_up_to = oldest;
            }
            if held.is_none() && rng.chance(30) {
                log.durable().wait_blocking(seq)?;
                acked_commit = commit;
            }
            Ok(())
        })();
        if r.is_err() {
            break;
        }
    }
    drop(held);
    // A log that failed acknowledges nothing more, however long one waits.
    if log.failure().is_some() {
        let more = log.append(Bytes::from_static(b"more")).and_then(|_| log.commit());
        if let Ok(seq) = more
            && log.durable().wait_blocking(seq).is_ok()
        {
            return Err("a failed log acknowledged a commit".into());
        }
    }
    // The process ends: killed, or (after a failure) stopped and restarted.
    note_kill(&fs);
    fs.kill();
    drop(log);
    let crash = Crash::random(&mut rng);
    let fs2 = fs.crash(crash);
    let ctx = |e: &dyn std::fmt::Display| {
        format!(
            "{crash:?} after {failure:?} at op {at}, {commit} commits, {acked_commit} acked: {e}"
        )
    };
    let (mut log, replay) =
        Log::open(data_dir(), options(&fs2, segment_size, cache)).map_err(|e| ctx(&e))?;
    let got: Vec<ReplayRecord> = replay.collect::<Result<_, _>>().map_err(|e| ctx(&e))?;

    // What was replayed is a run of what was written, starting at the first segment that is
    // still there, and ending at the end of a commit.
    let start = match got.first() {
        Some(r) => written
            .iter()
            .position(|w| w.location == r.location)
            .ok_or_else(|| ctx(&"a replayed record was never written"))?,
        None => {
            written.iter().position(|w| w.location.segment > removed_up_to).unwrap_or(written.len())
        }
    };
    for (i, r) in got.iter().enumerate() {
        let w = written.get(start + i).ok_or_else(|| ctx(&"more records than were written"))?;
        if w.location != r.location || w.payload != r.payload {
            return Err(ctx(&format!("record {i} differs from what was written")));
        }
    }
    let end = start + got.len();
    if let (Some(last), Some(next)) =
        (end.checked_sub(1).and_then(|i| written.get(i)), written.get(end))
        && last.commit == next.commit
        && last.location.segment == next.location.segment
    {
        return Err(ctx(&"a commit was replayed in part"));
    }
    // Every acknowledged record is there (unless its segment was removed on purpose).
    if let Some(missing) = written
        .iter()
        .skip(end)
        .find(|w| w.commit <= acked_commit && w.location.segment > removed_up_to)
    {
        return Err(ctx(&format!("acknowledged record at {:?} is lost", missing.location)));
    }
    if written[..start].iter().any(|w| w.location.segment > removed_up_to) {
        return Err(ctx(&"records of a segment that was not removed are missing"));
    }
    // The recovered log takes new commits, which survive the next open.
    log.append(Bytes::from_static(b"after")).map_err(|e| ctx(&e))?;
    log.flush_blocking().map_err(|e| ctx(&e))?;
    log.close().map_err(|e| ctx(&e))?;
    let (_, replay) =
        Log::open(data_dir(), options(&fs2, segment_size, cache)).map_err(|e| ctx(&e))?;
    let again = replay.collect::<Result<Vec<_>, _>>().map_err(|e| ctx(&e))?;
    if again.len() != got.len() + 1 || again.last().map(|r| r.payload.as_ref()) != Some(b"after") {
        return Err(ctx(&"the commit after recovery did not survive a reopen"));
    }
    Ok(())
}

#[test]
fn the_log_survives_seeded_power_loss_kills_and_failing_writes_and_syncs() {
    run_seeded(1500, 1, log_case);
}

/// One seeded case of damage in a closed segment: the log refuses to open, naming the
/// segment and an offset at or before the damage, and never skips a record.
fn closed_segment_case(seed: u64) -> Result<(), String> {
    let mut rng = Rng::new(seed);
    let fs = FaultFs::new(Plan::default(), rng.next_u64());
    let opts = options(&fs, 1024 + rng.below(2048), 0);
    let (mut log, _) = Log::open(data_dir(), opts.clone()).map_err(|e| e.to_string())?;
    for _ in 0..40 + rng.below(60) {
        // A commit starts a segment before its records, after them, or between them (the
        // broker's way: records, then a checkpoint in the new segment).
        let roll_first = rng.chance(20);
        if roll_first && log.should_roll() {
            log.roll();
        }
        for _ in 0..1 + rng.below(3) {
            log.append(random_payload(&mut rng)).map_err(|e| e.to_string())?;
        }
        if !roll_first && log.should_roll() {
            log.roll();
            if rng.chance(50) {
                log.append(random_payload(&mut rng)).map_err(|e| e.to_string())?;
            }
        }
        log.flush_blocking().map_err(|e| e.to_string())?;
    }
    let segments: Vec<u64> = log.segments().collect();
    log.close().map_err(|e| e.to_string())?;
    let closed = &segments[..segments.len() - 1];
    if closed.is_empty() {
        return Ok(());
    }
    let victim = closed[rng.index(closed.len())];
    let path = data_dir().join(format::segment_file_name(victim));
    let mut data = fs.read_file(&path).ok_or("segment missing")?;
    let damage = rng.index(data.len());
    let truncate = rng.chance(30);
    if truncate {
        data.truncate(damage);
    } else {
        data[damage] ^= 1 << rng.below(8);
    }
    fs.write_file(&path, data);
    let outcome = Log::open(data_dir(), opts).and_then(|(_, r)| r.collect::<Result<Vec<_>, _>>());
    match outcome {
        Err(StorageError::Corrupt { segment, offset })
            if segment == victim && offset <= damage as u64 =>
        {
            Ok(())
        }
        Err(StorageError::UnsupportedVersion { segment, .. })
            if segment == victim && damage < 12 =>
        {
            Ok(())
        }
        other => Err(format!(
            "{} at {damage} of segment {victim}: {:?}",
            if truncate { "cut" } else { "flip" },
            other.map(|r| r.len())
        )),
    }
}

#[test]
fn damage_anywhere_in_a_closed_segment_is_refused_with_its_place() {
    run_seeded(500, 2, closed_segment_case);
}

#[test]
fn a_torn_group_whose_later_commits_survive_is_truncated_not_refused() {
    let fs = FaultFs::new(Plan::default(), 7);
    let opts = options(&fs, 1 << 20, 0);
    let (mut log, _) = Log::open(data_dir(), opts.clone()).unwrap();
    log.append(Bytes::from(vec![1u8; 700])).unwrap();
    log.flush_blocking().unwrap();
    // Three commits pile up behind a held writer: one write, one sync for all three.
    let gate = log.writer_gate();
    let held = gate.hold();
    let mut group = Vec::new();
    for i in 2..5u8 {
        group.push(log.append(Bytes::from(vec![i; 700])).unwrap());
        log.commit().unwrap();
    }
    // The process dies at the sync: the group is in the page cache, not on the disk.
    fs.plan(Plan { kill_at: Some(2), ..Plan::default() });
    drop(held);
    assert!(log.durable().wait_blocking(log.last_commit()).is_err());
    drop(log);
    let after = fs.crash(Crash::Kill);
    // Power is lost too, and the sectors of the first commit of the group never reached the
    // disk while those of the later ones did.
    let path = data_dir().join(format::segment_file_name(1));
    let mut data = after.read_file(&path).unwrap();
    let first = usize::try_from(group[0].offset - BLOCK_LEN).unwrap();
    data[first..first + 512].fill(0);
    after.write_file(&path, data);
    let (_, replay) = Log::open(data_dir(), options(&after, 1 << 20, 0)).unwrap();
    let got = replay.collect::<Result<Vec<_>, _>>().unwrap();
    assert_eq!(got.len(), 1, "the acknowledged commit stays, the torn group goes");
    assert_eq!(got[0].payload, Bytes::from(vec![1u8; 700]));
}

#[test]
fn a_torn_first_block_of_a_segment_is_not_taken_for_the_commit_that_rolled_it() {
    let fs = FaultFs::new(Plan::default(), 11);
    let (mut log, _) = Log::open(data_dir(), options(&fs, 1 << 20, 0)).unwrap();
    // Commit 1 writes its record to segment 1 and starts segment 2, where it writes nothing.
    log.append(Bytes::from(vec![1u8; 700])).unwrap();
    assert_eq!(log.roll(), Some(2));
    log.flush_blocking().unwrap();
    // Commits 2 and 3 pile up in segment 2 and are written together; both know commit 1 was
    // durable when they were made.
    let gate = log.writer_gate();
    let held = gate.hold();
    let torn = log.append(Bytes::from(vec![2u8; 700])).unwrap();
    log.commit().unwrap();
    log.append(Bytes::from(vec![3u8; 700])).unwrap();
    log.commit().unwrap();
    fs.plan(Plan { kill_at: Some(2), ..Plan::default() });
    drop(held);
    assert!(log.durable().wait_blocking(log.last_commit()).is_err());
    drop(log);
    let after = fs.crash(Crash::Kill);
    // Power is lost: the sectors of commit 2 never reached the disk, those of commit 3 did.
    let path = data_dir().join(format::segment_file_name(2));
    let mut data = after.read_file(&path).unwrap();
    let first = usize::try_from(torn.offset - BLOCK_LEN).unwrap();
    data[first..first + 512].fill(0);
    after.write_file(&path, data);
    let (_, replay) = Log::open(data_dir(), options(&after, 1 << 20, 0))
        .expect("a torn commit that was never acknowledged is truncated");
    let got = replay.collect::<Result<Vec<_>, _>>().unwrap();
    assert_eq!(got.len(), 1, "the acknowledged commit stays, the torn group goes");
    assert_eq!(got[0].payload, Bytes::from(vec![1u8; 700]));
}

/// How a commit starts a new segment: after its records (the broker's way, with a checkpoint
/// in the new segment or none), or before any.
#[derive(Clone, Copy, Debug)]
enum RollShape {
    RecordsThenRoll,
    RecordsRollRecords,
    RollThenRecords,
}

/// Writes commit 1 (one record in segment 1), then commit 2 that starts segment 2 in `shape`,
/// closes the log, cuts segment 1 at the start of commit 2's block in it (or, when commit 2
/// wrote nothing there, at the start of commit 1's), and opens it again.
fn cut_at_the_block_boundary_before_a_roll(shape: RollShape) -> Result<Vec<Bytes>, StorageError> {
    let fs = FaultFs::new(Plan::default(), 23);
    let (mut log, _) = Log::open(data_dir(), options(&fs, 1 << 20, 0)).unwrap();
    log.append(Bytes::from(vec![1u8; 100])).unwrap();
    log.flush_blocking().unwrap();
    let boundary = log.active_len;
    match shape {
        RollShape::RecordsThenRoll => {
            log.append(Bytes::from(vec![2u8; 100])).unwrap();
            assert_eq!(log.roll(), Some(2));
        }
        RollShape::RecordsRollRecords => {
            log.append(Bytes::from(vec![2u8; 100])).unwrap();
            assert_eq!(log.roll(), Some(2));
            log.append(Bytes::from(vec![3u8; 100])).unwrap();
        }
        RollShape::RollThenRecords => {
            assert_eq!(log.roll(), Some(2));
            log.append(Bytes::from(vec![3u8; 100])).unwrap();
        }
    }
    log.flush_blocking().unwrap();
    log.close().unwrap();
    let path = data_dir().join(format::segment_file_name(1));
    let mut data = fs.read_file(&path).unwrap();
    let cut = match shape {
        RollShape::RollThenRecords => data.len().min(usize::try_from(boundary).unwrap()),
        _ => usize::try_from(boundary).unwrap(),
    };
    let cut = if cut == data.len() { usize::try_from(HEADER_LEN).unwrap() } else { cut };
    data.truncate(cut);
    fs.write_file(&path, data);
    let (_, replay) = Log::open(data_dir(), options(&fs, 1 << 20, 0))?;
    replay.map(|r| r.map(|r| r.payload)).collect()
}

#[test]
fn a_closed_segment_cut_at_a_block_boundary_is_refused_when_no_later_block_covers_it() {
    for shape in
        [RollShape::RecordsThenRoll, RollShape::RecordsRollRecords, RollShape::RollThenRecords]
    {
        match cut_at_the_block_boundary_before_a_roll(shape) {
            Err(StorageError::Corrupt { segment: 1, .. }) => {}
            other => panic!(
                "{shape:?}: a closed segment lost its last commit: {:?}",
                other.map(|r| r.len())
            ),
        }
    }
}
