//! Tools for an operator facing a data directory: check it, cut a damaged log at a chosen
//! point, and export an entity's messages from a log that will not open.
//!
//! None of these run the broker. [`check`] and [`export`] only read (they work on a directory
//! a broker has open, and on one it refuses); [`repair`] takes the directory's lock.
//!
//! ```no_run
//! # fn main() -> Result<(), twice_broker::Error> {
//! let report = twice_broker::data::check(std::path::Path::new("./data"))?;
//! for s in &report.segments {
//!     println!("segment {}: {} bytes, {} records, damage {:?}", s.id, s.bytes, s.records, s.damage);
//! }
//! # Ok(())
//! # }
//! ```

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;
use std::sync::Arc;

use twice::{SequenceNumber, Timestamp};

use super::format::{self, HEADER_LEN};
use super::scan::{ScanError, Scanned, SegmentScan, durable_block_after};
use super::vfs::{OpenMode, RealFs, VFile, Vfs};
use super::{Location, StorageError, read_record};
use crate::Error;
use crate::engine::{self, Body, Engine, EngineOptions, Record};
use crate::runtime::storage_error;

/// What [`check`] found in one segment.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct SegmentReport {
    /// The segment id (the number in its file name).
    pub id: u64,
    /// The size of its file.
    pub bytes: u64,
    /// Complete commit blocks read before the end or the damage.
    pub commits: u64,
    /// Records in those blocks.
    pub records: u64,
    /// Messages whose body lives in this segment, once the log is replayed.
    pub live_messages: u64,
    /// The bytes of the records holding them: what compaction would move.
    pub live_bytes: u64,
    /// The byte offset of the first damage, if any.
    pub damage: Option<u64>,
}

impl SegmentReport {
    /// The share of the file still needed, from 0 to 1.
    pub fn live_ratio(&self) -> f64 {
        if self.bytes == 0 {
            return 0.0;
        }
        // reason: a display ratio; a file size beyond 2^53 bytes loses only precision.
        #[allow(clippy::cast_precision_loss)]
        let r = self.live_bytes as f64 / self.bytes as f64;
        r
    }
}

/// What [`check`] found about one entity, after replaying what could be replayed.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct EntityReport {
    /// The entity's path.
    pub path: String,
    /// Available plus locked messages.
    pub active: u64,
    /// Deferred messages.
    pub deferred: u64,
    /// Scheduled messages.
    pub scheduled: u64,
    /// Messages in its dead-letter queue.
    pub dead_letter: u64,
}

/// Whether a broker would open the directory.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Verdict {
    /// It opens as it is.
    Opens,
    /// It opens after cutting a torn tail that was never acknowledged.
    OpensAfterTruncating {
        /// The newest segment.
        segment: u64,
        /// Where it is cut.
        offset: u64,
    },
    /// It refuses to open: acknowledged data is damaged or missing.
    Refuses(String),
}

/// The result of [`check`].
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct CheckReport {
    /// Every segment, oldest first.
    pub segments: Vec<SegmentReport>,
    /// A segment missing between the oldest and the newest.
    pub missing_segment: Option<u64>,
    /// The entities of the state the log replays to (up to the first damage).
    pub entities: Vec<EntityReport>,
    /// Whether a broker would open it (once no broker holds it).
    pub verdict: Verdict,
    /// A running broker holds the directory: the log was read as that broker had written it
    /// so far.
    pub in_use: Option<InUse>,
}

/// A running broker holds the data directory's lock.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct InUse {
    /// The holder's process id, as it wrote it in the lock file.
    pub pid: Option<u32>,
}

/// Whether a running broker holds `dir`'s lock. The lock is tried and at once released; a
/// directory without a lock file has never been opened by a broker. Nothing is created.
fn in_use(dir: &Path) -> Option<InUse> {
    let path = dir.join("LOCK");
    let file = std::fs::File::open(&path).ok()?;
    match rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
        Err(e) if e == rustix::io::Errno::WOULDBLOCK => {
            let pid = std::fs::read_to_string(&path).ok().and_then(|s| s.trim().parse().ok());
            Some(InUse { pid })
        }
        // Taken (and released with the file), or not lockable at all: no broker holds it.
        _ => None,
    }
}

/// A log read as far as it can be, with its state replayed up to the first damage.
struct Salvage {
    engine: Engine,
    files: BTreeMap<u64, (Arc<dyn VFile>, u32)>,
    report: CheckReport,
}

fn scan_error(dir: &Path, id: u64) -> impl Fn(ScanError) -> StorageError + '_ {
    move |e| match e {
        ScanError::Storage(e) => e,
        ScanError::Io(source) => {
            StorageError::Io { path: dir.join(format::segment_file_name(id)), source }
        }
    }
}

fn salvage(dir: &Path) -> Result<Salvage, Error> {
    let vfs = RealFs;
    let io = |source| storage_error(StorageError::Io { path: dir.to_owned(), source });
    let mut ids: Vec<u64> = vfs
        .list(dir)
        .map_err(io)?
        .iter()
        .filter_map(|n| format::parse_segment_file_name(n))
        .collect();
    ids.sort_unstable();
    let missing_segment = ids.windows(2).find(|w| w[1] != w[0] + 1).map(|w| w[0] + 1);
    let mut engine = Engine::new(EngineOptions::default());
    let mut files = BTreeMap::new();
    let mut segments = Vec::new();
    let mut verdict = match missing_segment {
        Some(m) => Verdict::Refuses(format!("log segment {m} is missing")),
        None => Verdict::Opens,
    };
    // Records are replayed until the first damage or gap: what follows cannot be trusted to
    // apply on top of what is missing.
    let mut replaying = true;
    // The segment last read to its end: its id, its length and its last commit.
    let mut previous: Option<(u64, u64, u64)> = None;
    let last = ids.last().copied();
    for &id in &ids {
        let path = dir.join(format::segment_file_name(id));
        let file = vfs
            .open(&path, OpenMode::Read)
            .map_err(|source| storage_error(StorageError::Io { path: path.clone(), source }))?;
        let bytes = file
            .len()
            .map_err(|source| storage_error(StorageError::Io { path: path.clone(), source }))?;
        let mut report = SegmentReport {
            id,
            bytes,
            commits: 0,
            records: 0,
            live_messages: 0,
            live_bytes: 0,
            damage: None,
        };
        if replaying && missing_segment.is_some_and(|m| m < id) {
            replaying = false;
        }
        let mut scan = match SegmentScan::open(file.clone(), id, bytes) {
            Ok(s) => s,
            Err(e) => {
                let e = scan_error(dir, id)(e);
                report.damage = Some(0);
                if matches!(verdict, Verdict::Opens | Verdict::OpensAfterTruncating { .. }) {
                    verdict = Verdict::Refuses(e.to_string());
                }
                replaying = false;
                segments.push(report);
                continue;
            }
        };
        files.insert(id, (file.clone(), scan.header.salt));
        // The segment before this one must end at the commit that started this one.
        let cut_before = previous
            .take()
            .filter(|&(_, _, last_seq)| last_seq < scan.header.predecessor_ends_at());
        if let Some((before, end, _)) = cut_before {
            if let Some(r) = segments.iter_mut().find(|r| r.id == before) {
                r.damage = Some(end);
            }
            if verdict == Verdict::Opens {
                verdict = Verdict::Refuses(
                    StorageError::Corrupt { segment: before, offset: end }.to_string(),
                );
            }
            replaying = false;
        }
        loop {
            match scan
                .next_block()
                .map_err(|e| storage_error(scan_error(dir, id)(ScanError::Io(e))))?
            {
                Scanned::Block { offset, body, records, .. } => {
                    report.commits += 1;
                    report.records += records.len() as u64;
                    if !replaying {
                        continue;
                    }
                    for (at, len) in records {
                        let start = at + 8;
                        let payload = &body[start..start + usize::try_from(len).unwrap_or(0)];
                        let location = Location {
                            segment: id,
                            offset: offset + format::BLOCK_LEN + at as u64,
                            len,
                        };
                        let record: Record = postcard::from_bytes(payload).map_err(|e| {
                            Error::Corrupt(format!(
                                "the log record at segment {id} offset {} cannot be decoded: {e}",
                                location.offset
                            ))
                        })?;
                        engine.replay(record, engine_location(location)?)?;
                    }
                }
                Scanned::End => {
                    let floor = scan.header.first_seq.saturating_sub(1);
                    previous = Some((id, bytes, scan.last_seq().unwrap_or(floor)));
                    break;
                }
                Scanned::Damaged { block, at, header } => {
                    report.damage = Some(at);
                    replaying = false;
                    let torn = Some(id) == last
                        && !durable_block_after(
                            file.as_ref(),
                            scan.header.salt,
                            block + 1,
                            bytes,
                            scan.damaged_seq(header),
                        )
                        .map_err(|source| {
                            storage_error(StorageError::Io { path: path.clone(), source })
                        })?;
                    if verdict == Verdict::Opens {
                        verdict = if torn {
                            Verdict::OpensAfterTruncating { segment: id, offset: block }
                        } else {
                            Verdict::Refuses(
                                StorageError::Corrupt { segment: id, offset: at }.to_string(),
                            )
                        };
                    }
                    break;
                }
            }
        }
        segments.push(report);
    }
    engine.finish_recovery(Timestamp::UNIX_EPOCH)?;
    for s in &mut segments {
        if let Ok(seg) = u32::try_from(s.id) {
            s.live_messages = engine.segment_refs(seg) as u64;
            s.live_bytes = engine.segment_live_bytes(seg);
        }
    }
    let mut entities = Vec::new();
    for (e, path) in engine.entities() {
        let c = engine.counts(e)?;
        entities.push(EntityReport {
            path,
            active: c.active,
            deferred: c.deferred,
            scheduled: c.scheduled,
            dead_letter: c.dead_letter,
        });
    }
    Ok(Salvage {
        engine,
        files,
        report: CheckReport { segments, missing_segment, entities, verdict, in_use: None },
    })
}

fn engine_location(loc: Location) -> Result<engine::Location, Error> {
    let segment = u32::try_from(loc.segment)
        .map_err(|_| Error::Corrupt(format!("log segment id {} is out of range", loc.segment)))?;
    Ok(engine::Location { segment, offset: loc.offset, len: loc.len })
}

/// Reads every segment of the data directory in `dir`: what each holds, where it is damaged,
/// the entities and counts of the state it replays to, whether a broker would open it, and
/// whether a running broker holds it now (then the log is read as that broker had written it
/// so far). Changes nothing.
pub fn check(dir: &Path) -> Result<CheckReport, Error> {
    let in_use = in_use(dir);
    salvage(dir).map(|s| CheckReport { in_use, ..s.report })
}

/// What cutting the log at a point loses, from [`plan_repair`].
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct RepairPlan {
    /// The segment cut.
    pub segment: u64,
    /// Where it is cut (below the header size: the whole segment goes).
    pub offset: u64,
    /// The bytes of that segment from the cut to its end.
    pub bytes_cut: u64,
    /// The complete records among them.
    pub records_cut: u64,
    /// The later segments, removed whole.
    pub segments_removed: Vec<u64>,
    /// The complete records in those.
    pub records_removed: u64,
}

/// Says what cutting the log at `segment`:`offset` would lose. Changes nothing.
pub fn plan_repair(dir: &Path, segment: u64, offset: u64) -> Result<RepairPlan, Error> {
    let report = check(dir)?;
    let Some(seg) = report.segments.iter().find(|s| s.id == segment) else {
        return Err(storage_error(StorageError::NotFound { segment, offset }));
    };
    if offset > seg.bytes {
        return Err(Error::InvalidArgument(format!(
            "segment {segment} has {} bytes; it cannot be cut at {offset}",
            seg.bytes
        )));
    }
    let records_cut =
        if offset < HEADER_LEN { seg.records } else { records_from(dir, segment, offset)? };
    let later: Vec<&SegmentReport> = report.segments.iter().filter(|s| s.id > segment).collect();
    Ok(RepairPlan {
        segment,
        offset,
        bytes_cut: seg.bytes - offset,
        records_cut,
        segments_removed: later.iter().map(|s| s.id).collect(),
        records_removed: later.iter().map(|s| s.records).sum(),
    })
}

/// The complete records of `segment` that start at or after `offset`.
fn records_from(dir: &Path, segment: u64, offset: u64) -> Result<u64, Error> {
    let path = dir.join(format::segment_file_name(segment));
    let io = |source| storage_error(StorageError::Io { path: path.clone(), source });
    let file = RealFs.open(&path, OpenMode::Read).map_err(io)?;
    let len = file.len().map_err(io)?;
    let mut scan = SegmentScan::open(file, segment, len)
        .map_err(|e| storage_error(scan_error(dir, segment)(e)))?;
    let mut n = 0;
    while let Scanned::Block { offset: at, records, .. } = scan.next_block().map_err(io)? {
        n += records.iter().filter(|(r, _)| at + format::BLOCK_LEN + *r as u64 >= offset).count()
            as u64;
    }
    Ok(n)
}

/// Cuts the log as `plan` says: truncates its segment (or removes it, for a cut inside the
/// header) and removes every later one, durably. Takes the directory's lock: fails with
/// [`Error::DirectoryInUse`] while a broker has it open.
pub fn repair(dir: &Path, plan: &RepairPlan) -> Result<(), Error> {
    let vfs = RealFs;
    let io = |path: &Path| {
        let path = path.to_owned();
        move |source| storage_error(StorageError::Io { path, source })
    };
    let _lock =
        vfs.lock(dir).map_err(io(dir))?.ok_or_else(|| Error::DirectoryInUse(dir.to_owned()))?;
    // Newest first, so that a crash half-way leaves a log without gaps.
    for &id in plan.segments_removed.iter().rev() {
        let path = dir.join(format::segment_file_name(id));
        vfs.remove(&path).map_err(io(&path))?;
    }
    let path = dir.join(format::segment_file_name(plan.segment));
    if plan.offset < HEADER_LEN {
        vfs.remove(&path).map_err(io(&path))?;
    } else {
        let file = vfs.open(&path, OpenMode::ReadWrite).map_err(io(&path))?;
        file.set_len(plan.offset).map_err(io(&path))?;
        file.sync().map_err(io(&path))?;
    }
    vfs.open_dir(dir).and_then(|d| d.sync()).map_err(io(dir))?;
    Ok(())
}

/// Writes the messages of entity `entity` (a queue, a subscription as
/// `topic/Subscriptions/name`, or either with `/$DeadLetterQueue`) as JSON lines to `out`, in
/// sequence-number order, from the state the log replays to up to its first damage. Returns
/// how many were written. Changes nothing in the directory.
///
/// Each line is the message as [`twice::export::to_json`] writes it (the shape `twice dlq
/// export` writes too), with its body as a string: the text itself when it is UTF-8
/// (`"body_encoding": "utf8"`), else base64.
pub fn export(dir: &Path, entity: &str, out: &mut dyn Write) -> Result<u64, Error> {
    let s = salvage(dir)?;
    let e = s.engine.resolve(entity)?;
    let mut from = SequenceNumber::new(0);
    let mut n = 0;
    loop {
        let page = s.engine.peek(Timestamp::UNIX_EPOCH, e, from, 256, None)?;
        let Some(last) = page.last() else { return Ok(n) };
        from = last.meta.sequence_number.next();
        for d in page {
            let received = match d.body {
                Body::Memory(m) => engine::received_message(&m, &d.meta),
                Body::Stored(loc) => {
                    let location = Location {
                        segment: u64::from(loc.segment),
                        offset: loc.offset,
                        len: loc.len,
                    };
                    let (file, salt) = s.files.get(&location.segment).ok_or(storage_error(
                        StorageError::NotFound {
                            segment: location.segment,
                            offset: location.offset,
                        },
                    ))?;
                    let path = || dir.join(format::segment_file_name(location.segment));
                    let bytes =
                        read_record(file.as_ref(), *salt, location, path).map_err(storage_error)?;
                    let record: Record = postcard::from_bytes(&bytes).map_err(|e| {
                        Error::Corrupt(format!("a log record cannot be decoded: {e}"))
                    })?;
                    let m = record.into_message().ok_or_else(|| {
                        Error::Corrupt("a message's log record carries no message".to_owned())
                    })?;
                    engine::received_message_owned(m, &d.meta)
                }
            };
            let line = json_line(&received)?;
            out.write_all(line.as_bytes()).map_err(Error::Io)?;
            n += 1;
        }
    }
}

fn json_line(m: &twice::ReceivedMessage) -> Result<String, Error> {
    let mut line = twice::export::to_json(m).to_string();
    line.push('\n');
    Ok(line)
}
