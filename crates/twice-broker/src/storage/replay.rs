//! Replaying the log: every record, oldest first, one block at a time, refusing what would
//! skip acknowledged data (damage, a closed segment cut short, commits missing between two
//! segments).

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::Arc;

use super::format::{self, BLOCK_LEN, FRAME_LEN, SegmentHeader};
use super::scan::{ScanError, Scanned, SegmentScan};
use super::vfs::VFile;
use super::{Location, ReplayRecord, StorageError, io_err};

/// Streams every record of the log, oldest first, one block at a time.
#[derive(Debug)]
pub(crate) struct Replay {
    dir: PathBuf,
    segments: VecDeque<(u64, Arc<dyn VFile>)>,
    /// The valid length of the newest segment, as found by [`Log::open`].
    last_end: u64,
    current: Option<ReplaySegment>,
    /// The segment replayed before the current one: its id, its end, and the number of its
    /// last commit (or the one before its first, when it holds none).
    previous: Option<(u64, u64, u64)>,
    /// Commits missing between two segments: the segment they should have ended, its end, and
    /// the first missing commit number. They are refused once a later block proves one of them
    /// was durable.
    gap: Option<(u64, u64, u64)>,
}

impl Replay {
    /// A replay of `segments`, oldest first, the newest valid up to `last_end`.
    pub(super) fn new(
        dir: PathBuf,
        segments: VecDeque<(u64, Arc<dyn VFile>)>,
        last_end: u64,
    ) -> Self {
        Self { dir, segments, last_end, current: None, previous: None, gap: None }
    }
}

#[derive(Debug)]
struct ReplaySegment {
    scan: SegmentScan,
    /// The records of the current block not yet returned.
    records: VecDeque<ReplayRecord>,
}

impl Replay {
    fn next_record(&mut self) -> Result<Option<ReplayRecord>, StorageError> {
        loop {
            if let Some(r) = self.current.as_mut().and_then(|c| c.records.pop_front()) {
                return Ok(Some(r));
            }
            let Some(cur) = self.current.as_mut() else {
                let Some((id, file)) = self.segments.pop_front() else { return Ok(None) };
                let path = self.dir.join(format::segment_file_name(id));
                let end = if self.segments.is_empty() {
                    self.last_end
                } else {
                    file.len().map_err(io_err(&path))?
                };
                let scan = SegmentScan::open(file, id, end).map_err(|e| match e {
                    ScanError::Storage(e) => e,
                    ScanError::Io(e) => StorageError::Io { path: path.clone(), source: e },
                })?;
                self.check_predecessor(&scan.header)?;
                self.note_gap(scan.header.first_seq);
                self.current = Some(ReplaySegment { scan, records: VecDeque::new() });
                continue;
            };
            let id = cur.scan.id;
            let first_of_segment = cur.scan.last_seq().is_none();
            let next = cur.scan.next_block().map_err(|e| StorageError::Io {
                path: self.dir.join(format::segment_file_name(id)),
                source: e,
            })?;
            let seq = cur.scan.last_seq().unwrap_or(0);
            match next {
                Scanned::Block { offset, body, records, watermark } => {
                    if first_of_segment {
                        self.note_gap(seq);
                    }
                    self.check_gap(watermark)?;
                    let Some(cur) = self.current.as_mut() else { return Ok(None) };
                    let body_at = offset + BLOCK_LEN;
                    cur.records.extend(records.into_iter().map(|(at, len)| {
                        let start = at + usize::try_from(FRAME_LEN).unwrap_or(8);
                        let end = start + usize::try_from(len).unwrap_or(0);
                        ReplayRecord {
                            location: Location { segment: id, offset: body_at + at as u64, len },
                            payload: body.slice(start..end),
                        }
                    }));
                }
                Scanned::End => {
                    let last = cur.scan.last_seq();
                    let floor = cur.scan.header.first_seq.saturating_sub(1);
                    self.previous = Some((id, cur.scan.end(), last.unwrap_or(floor)));
                    self.current = None;
                }
                Scanned::Damaged { at, .. } => {
                    // Stop here for good: a replay that went on would skip acknowledged data.
                    self.segments.clear();
                    self.current = None;
                    return Err(StorageError::Corrupt { segment: id, offset: at });
                }
            }
        }
    }
}

impl Replay {
    /// Notes the commits missing before a segment whose first commit is `seq` (or can be no
    /// lower than `seq`): commits are numbered across the whole log and each one writes to the
    /// active segment, so a gap means the segment before lost its last blocks. That is either
    /// a cut at a block boundary (damage, which its own scan cannot see) or commits that never
    /// became durable before a power loss (a torn tail, harmless): [`Replay::check_gap`] tells
    /// them apart.
    fn note_gap(&mut self, seq: u64) {
        let Some((before, end, last)) = self.previous else { return };
        if self.gap.is_none() && seq > last.saturating_add(1) {
            self.gap = Some((before, end, last.saturating_add(1)));
        }
    }

    /// Refuses the log when the segment before one with `header` ends before the commit that
    /// started it: that segment was complete on disk before its successor took its name, so
    /// its end was cut (at a block boundary, which its own scan cannot see).
    fn check_predecessor(&mut self, header: &SegmentHeader) -> Result<(), StorageError> {
        let Some((segment, offset, last)) = self.previous else { return Ok(()) };
        if last >= header.predecessor_ends_at() {
            return Ok(());
        }
        tracing::error!(segment, offset, "log segment lost its last commits");
        self.segments.clear();
        self.current = None;
        Err(StorageError::Corrupt { segment, offset })
    }

    /// Refuses the log once a block written after a gap says a missing commit was durable
    /// (its watermark covers it): acknowledged data is gone, and replay must not skip it.
    fn check_gap(&mut self, watermark: u64) -> Result<(), StorageError> {
        let Some((segment, offset, missing)) = self.gap else { return Ok(()) };
        if watermark < missing {
            return Ok(());
        }
        tracing::error!(segment, offset, "log segment lost commits that were durable");
        self.segments.clear();
        self.current = None;
        Err(StorageError::Corrupt { segment, offset })
    }
}

impl Iterator for Replay {
    type Item = Result<ReplayRecord, StorageError>;

    fn next(&mut self) -> Option<Self::Item> {
        self.next_record().transpose()
    }
}
