//! The runtime's side of the log: records appended and committed once per turn, segments
//! rolled with a checkpoint and compacted, and message bodies read back for deliveries.

use std::sync::Arc;

use bytes::{BufMut, BytesMut};
use twice::Message;

use super::Runtime;
use super::reply::{Delivered, DeliveredBody, decode};
use crate::engine::{self, Body, Delivery, Engine, Record};
use crate::error::Error;
use crate::storage::{self, Log, StorageError};

/// The most records whose vector's memory is kept from one turn to the next.
const MAX_KEPT_RECORDS: usize = 1 << 16;

/// Compaction relocates the live messages of the oldest segment once at most this many remain
/// there, so that a few long-lived messages do not keep a whole segment on disk.
const COMPACT_MAX_LIVE: usize = 4096;

/// ... and only while their records hold at most this share of a segment (1/n): a move then
/// never fills the active segment by itself, and each segment's worth of writes carries at most
/// a quarter of a segment of moved records, whatever the backlog (write amplification ≤ 4/3
/// plus checkpoints).
const COMPACT_MAX_SHARE: u64 = 4;

impl Runtime {
    /// Appends the engine's records, starts a new segment (with a checkpoint) when the active
    /// one is full, compacts, and commits once.
    pub(super) fn persist(&mut self) -> Result<(), Error> {
        let Some(log) = self.log.as_mut() else { return Ok(()) };
        let mut records = std::mem::take(&mut self.records);
        self.engine.swap_records(&mut records);
        if records.is_empty() {
            self.records = records;
            return Ok(());
        }
        append_records(&mut self.engine, log, &records)?;
        self.stats.records += records.len() as u64;
        records.clear();
        // A burst should not keep its memory for good.
        if records.capacity() <= MAX_KEPT_RECORDS {
            self.records = records;
        }
        if log.should_roll() {
            // The checkpoint restates the state after every record so far, so replaying from
            // the new segment's start (once older ones are gone) rebuilds the same state.
            log.roll();
            let checkpoint = self.engine.checkpoint_records();
            append_records(&mut self.engine, log, &checkpoint)?;
            self.stats.records += checkpoint.len() as u64;
            self.rolled = true;
        }
        self.compact()?;
        if let Some(log) = self.log.as_mut() {
            let before = log.last_commit();
            let seq = log.commit().map_err(storage_error)?;
            if seq != before {
                self.stats.commits += 1;
            }
        }
        Ok(())
    }

    /// Deletes the oldest segments that hold no live message, and relocates the last few live
    /// messages of the oldest one so that it can go too.
    fn compact(&mut self) -> Result<(), Error> {
        let Some(log) = self.log.as_mut() else { return Ok(()) };
        loop {
            let Some(oldest) = log.segments().next() else { return Ok(()) };
            if oldest == log.active_segment() {
                return Ok(());
            }
            let seg = u32::try_from(oldest).map_err(|_| segment_overflow(oldest))?;
            let refs = self.engine.segment_refs(seg);
            if refs == 0 {
                log.remove_segment(oldest).map_err(storage_error)?;
                continue;
            }
            let live_bytes = self.engine.segment_live_bytes(seg);
            if !self.rolled
                || refs > COMPACT_MAX_LIVE
                || live_bytes > log.segment_size() / COMPACT_MAX_SHARE
            {
                return Ok(());
            }
            self.rolled = false;
            for m in self.engine.live_in_segment(seg) {
                let message = load_message(log, m.location)?;
                self.engine.relocate(&m, message);
            }
            let records = self.engine.take_records();
            append_records(&mut self.engine, log, &records)?;
            self.stats.records += records.len() as u64;
            // The segment is removed on a later pass, once nothing points into it.
            if self.engine.segment_refs(seg) != 0 {
                return Ok(());
            }
        }
    }

    /// Turns engine deliveries into replies. A body in memory goes as it is; a stored one as
    /// the bytes of the record holding it (from the read cache, or read from its segment),
    /// which the caller decodes: the broker's task does the least work per message.
    pub(super) fn materialize(&self, deliveries: Vec<Delivery>) -> Result<Vec<Delivered>, Error> {
        let location = |loc: &engine::Location| storage::Location {
            segment: u64::from(loc.segment),
            offset: loc.offset,
            len: loc.len,
        };
        let stored: Vec<storage::Location> = deliveries
            .iter()
            .filter_map(|d| match &d.body {
                Body::Stored(loc) => Some(location(loc)),
                Body::Memory(_) => None,
            })
            .collect();
        let mut records = if stored.is_empty() {
            Vec::new()
        } else {
            let log = self
                .log
                .as_ref()
                .ok_or_else(|| Error::Corrupt("a stored body without a log".to_owned()))?;
            log.read_many(&stored).map_err(storage_error)?
        }
        .into_iter()
        .zip(stored);
        let mut out = Vec::with_capacity(deliveries.len());
        for d in deliveries {
            let body = match d.body {
                Body::Memory(m) => DeliveredBody::Message(m),
                Body::Stored(_) => {
                    let (record, location) = records.next().ok_or_else(|| {
                        Error::Corrupt("a stored body was not read back".to_owned())
                    })?;
                    DeliveredBody::Record { record, location }
                }
            };
            out.push(Delivered { body, meta: d.meta });
        }
        Ok(out)
    }
}

/// Encodes records, appends them, and tells the engine where bodies landed.
pub(super) fn append_records(
    engine: &mut Engine,
    log: &mut Log,
    records: &[Record],
) -> Result<(), Error> {
    for r in records {
        let hint = r.message().map_or(64, |m| m.body.len() + 256);
        let loc = log
            .append_with(hint, |buf| {
                postcard::serialize_with_flavor(r, Encoder(buf)).map_err(|e| e.to_string())
            })
            .map_err(storage_error)?;
        if let Some(key) = r.body_key() {
            engine.set_location(key, engine_location(loc)?);
        }
    }
    Ok(())
}

/// Encodes a record straight into the log's buffer.
struct Encoder<'a>(&'a mut BytesMut);

impl postcard::ser_flavors::Flavor for Encoder<'_> {
    type Output = ();

    fn try_push(&mut self, data: u8) -> postcard::Result<()> {
        self.0.put_u8(data);
        Ok(())
    }

    fn try_extend(&mut self, data: &[u8]) -> postcard::Result<()> {
        self.0.extend_from_slice(data);
        Ok(())
    }

    fn finalize(self) -> postcard::Result<()> {
        Ok(())
    }
}

/// Reads the message stored in the record at `loc`.
fn load_message(log: &Log, loc: engine::Location) -> Result<Arc<Message>, Error> {
    let sloc =
        storage::Location { segment: u64::from(loc.segment), offset: loc.offset, len: loc.len };
    let bytes = log.read(sloc).map_err(storage_error)?;
    let record: Record = decode(&bytes, sloc)?;
    record.message().cloned().ok_or_else(|| {
        Error::Corrupt(format!(
            "the log record at segment {} offset {} carries no message",
            loc.segment, loc.offset
        ))
    })
}

pub(super) fn engine_location(loc: storage::Location) -> Result<engine::Location, Error> {
    let segment = u32::try_from(loc.segment).map_err(|_| segment_overflow(loc.segment))?;
    Ok(engine::Location { segment, offset: loc.offset, len: loc.len })
}

fn segment_overflow(segment: u64) -> Error {
    Error::Corrupt(format!("log segment id {segment} is out of range"))
}

/// Maps a storage error to the public error.
pub(crate) fn storage_error(e: StorageError) -> Error {
    match e {
        StorageError::Io { path, source } => {
            Error::Io(std::io::Error::new(source.kind(), format!("{}: {source}", path.display())))
        }
        StorageError::Corrupt { segment, offset } => Error::CorruptLog { segment, offset },
        StorageError::Locked(dir) => Error::DirectoryInUse(dir),
        StorageError::MissingSegment { segment, .. } => Error::MissingSegment { segment },
        StorageError::Failed(io) => Error::Io(std::io::Error::new(io.kind(), io.to_string())),
        other => Error::Corrupt(other.to_string()),
    }
}
