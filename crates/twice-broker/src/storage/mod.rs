//! The log: an append-only sequence of checksummed records in segment files.
//!
//! The broker's state is the replay of this log. [`Log::append`] buffers a record and returns
//! its [`Location`] at once; [`Log::commit`] hands everything buffered to one writer thread,
//! which writes it and calls `fdatasync`; a commit is acknowledged through [`DurableWatch`]
//! only after that. Commits queued while the writer is busy share its next fsync (group
//! commit), so the cost of an fsync is paid once per batch, not once per operation.
//!
//! Reads of recent records come from an in-memory cache bounded in bytes; older ones are read
//! back with `pread`. Every read is checked against the record's CRC.
//!
//! Each commit writes one block per segment it touches: a header with the commit's number
//! and the highest commit already durable, then its records (see `format`). On [`Log::open`],
//! the newest segment is read block by block; an incomplete block at its end is a torn write
//! and is truncated with a warning, unless a complete block follows that was written when the
//! incomplete one was already durable (then it was acknowledged, and it is damage).
//! Damage anywhere else, a gap in the segment ids or a damaged header is an error: acknowledged
//! data is never skipped silently.
//!
//! The log never needs a new file descriptor at a moment a client chooses: every segment is
//! held open from the start, the directory too, and the file of the next segment is created
//! ahead of time (if that fails, the active segment grows past its size until it succeeds).

pub mod data;
#[cfg(test)]
pub(crate) mod fault;
mod format;
mod replay;
mod scan;
mod vfs;
mod writer;

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{Arc, mpsc};
use std::thread::JoinHandle;

use bytes::{Bytes, BytesMut};
use tokio::sync::watch;

use format::{BLOCK_LEN, Block, SegmentHeader, frame_crc, frame_header};
pub(crate) use format::{FRAME_LEN, HEADER_LEN, MAX_RECORD_LEN};
pub(crate) use replay::Replay;
use scan::{ScanError, Scanned, SegmentScan, durable_block_after};
pub(crate) use vfs::{OpenMode, RealFs, VFile, Vfs};
use writer::{Chunk, DurableState, Job, Shared, Writer};

/// The default size at which the log starts a new segment: 64 MiB.
pub(crate) const DEFAULT_SEGMENT_SIZE: u64 = 64 << 20;
/// The most bytes between two records that one read of both takes in (see
/// [`Log::read_many`]).
const MAX_READ_GAP: u64 = 16 << 10;
/// The most bytes one read of many records takes in.
const MAX_READ_SPAN: u64 = 1 << 20;

/// The default bound of the read cache of recent records: 32 MiB.
pub(crate) const DEFAULT_CACHE_BYTES: usize = 32 << 20;
/// The size of the blocks records are encoded into. A block is freed once the writer has
/// written every frame cut from it and the read cache has let them go.
const ARENA_BLOCK: usize = 256 << 10;

/// An error of the log.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub(crate) enum StorageError {
    /// A file operation failed.
    #[error("I/O error on {path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The operating system's error.
        #[source]
        source: io::Error,
    },
    /// A record that is not the damaged tail of the newest segment fails its checksum or is
    /// malformed: acknowledged data is damaged, and the log refuses to guess.
    #[error("corrupt record in log segment {segment} at byte offset {offset}")]
    Corrupt {
        /// The segment id (the number in its file name).
        segment: u64,
        /// The byte offset of the damaged record in the segment file.
        offset: u64,
    },
    /// Another process (or another broker in this process) has the data directory open.
    #[error("the data directory {0} is already in use")]
    Locked(PathBuf),
    /// A segment was written by a newer or unknown format version.
    #[error(
        "log segment {segment} has format version {version}; this build reads versions 2 and 3"
    )]
    UnsupportedVersion {
        /// The segment id.
        segment: u64,
        /// The version in its header.
        version: u32,
    },
    /// A record could not be encoded.
    #[error("a log record cannot be encoded: {0}")]
    Encode(String),
    /// A record is larger than the log accepts.
    #[error("a log record of {len} bytes exceeds the limit of {max} bytes")]
    RecordTooLarge {
        /// The record's size.
        len: usize,
        /// The limit.
        max: u32,
    },
    /// A write or fsync failed earlier; the log accepts no more writes because what reached
    /// the disk after a failed fsync cannot be known.
    #[error("the log stopped after a failed write: {0}")]
    Failed(Arc<io::Error>),
    /// A segment between the oldest and the newest is missing: the records it held cannot be
    /// replayed, and the log refuses to open rather than skip them.
    #[error("log segment {segment} is missing between segments {before} and {after}")]
    MissingSegment {
        /// The id of the missing segment.
        segment: u64,
        /// The segment before the gap.
        before: u64,
        /// The segment after the gap.
        after: u64,
    },
    /// The location names a segment that does not exist (any more).
    #[error("no record at segment {segment} offset {offset}")]
    NotFound {
        /// The segment id.
        segment: u64,
        /// The byte offset.
        offset: u64,
    },
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> StorageError + '_ {
    move |source| StorageError::Io { path: path.to_owned(), source }
}

/// Where a record lives: segment id, byte offset of its frame, and payload length.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct Location {
    /// The segment id.
    pub(crate) segment: u64,
    /// The byte offset of the record's frame in the segment file.
    pub(crate) offset: u64,
    /// The payload length.
    pub(crate) len: u32,
}

/// Options of the log.
#[derive(Clone, Debug)]
pub(crate) struct LogOptions {
    /// The size at which [`Log::should_roll`] says to start a new segment.
    pub(crate) segment_size: u64,
    /// The bound, in payload bytes, of the cache of recently appended records.
    pub(crate) cache_bytes: usize,
    /// The file system the log is kept on.
    pub(crate) vfs: Arc<dyn Vfs>,
}

impl Default for LogOptions {
    fn default() -> Self {
        Self {
            segment_size: DEFAULT_SEGMENT_SIZE,
            cache_bytes: DEFAULT_CACHE_BYTES,
            vfs: Arc::new(RealFs),
        }
    }
}

/// A handle to wait until commits are durable. Cheap to clone.
#[derive(Clone, Debug)]
pub(crate) struct DurableWatch {
    rx: watch::Receiver<DurableState>,
    shared: Arc<Shared>,
}

impl DurableWatch {
    /// Waits until commit `seq` is on disk.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only observes the writer.
    pub(crate) async fn wait(&mut self, seq: u64) -> Result<(), StorageError> {
        let state =
            self.rx.wait_for(|s| s.seq >= seq || s.failed.is_some()).await.map_err(|_| {
                StorageError::Failed(Arc::new(io::Error::other("log writer stopped")))
            })?;
        check_state(&state, seq)
    }

    /// Blocks the thread until commit `seq` is on disk.
    pub(crate) fn wait_blocking(&self, seq: u64) -> Result<(), StorageError> {
        let mut g =
            self.shared.durable_sync.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        while g.seq < seq && g.failed.is_none() {
            g = self.shared.durable_cv.wait(g).unwrap_or_else(std::sync::PoisonError::into_inner);
        }
        check_state(&g, seq)
    }

    /// The highest durable commit, or the failure that stopped the log.
    pub(crate) fn current(&self) -> Result<u64, StorageError> {
        let s = self.rx.borrow();
        match &s.failed {
            Some(e) => Err(StorageError::Failed(e.clone())),
            None => Ok(s.seq),
        }
    }
}

fn check_state(s: &DurableState, seq: u64) -> Result<(), StorageError> {
    if s.seq >= seq {
        return Ok(());
    }
    match &s.failed {
        Some(e) => Err(StorageError::Failed(e.clone())),
        None => Ok(()),
    }
}

/// Whether the broker's storage failed: set once by the task that owns the log, read by every
/// broker handle (without asking that task, which stops taking commands once it failed).
#[derive(Clone, Debug, Default)]
pub(crate) struct FailureCell(Arc<std::sync::OnceLock<String>>);

impl FailureCell {
    /// Records the failure; the first one stays.
    pub(crate) fn set(&self, e: &dyn std::fmt::Display) {
        let _ = self.0.set(e.to_string());
    }

    /// The failure, if there was one.
    pub(crate) fn get(&self) -> Option<&str> {
        self.0.get().map(String::as_str)
    }
}

/// A record read back during replay.
#[derive(Debug)]
pub(crate) struct ReplayRecord {
    pub(crate) location: Location,
    pub(crate) payload: Bytes,
}

#[derive(Debug)]
struct CacheEntry {
    segment: u64,
    offset: u64,
    /// The commit that carries this record; it may leave the cache once that commit's bytes
    /// have been written, because a `pread` then sees them.
    seq: u64,
    payload: Bytes,
}

/// Recently appended records, oldest first. Locations only grow, so the deque is sorted and a
/// lookup is a binary search.
#[derive(Debug, Default)]
struct Cache {
    entries: VecDeque<CacheEntry>,
    bytes: usize,
}

impl Cache {
    fn get(&self, segment: u64, offset: u64) -> Option<&Bytes> {
        let i = self
            .entries
            .binary_search_by(|e| (e.segment, e.offset).cmp(&(segment, offset)))
            .ok()?;
        Some(&self.entries[i].payload)
    }
}

/// An open segment: its file (for reading; the writer has its own handle to the active one)
/// and the salt of its checksums.
#[derive(Debug)]
struct Segment {
    file: Arc<dyn VFile>,
    salt: u32,
}

/// The file prepared to become the next segment.
#[derive(Debug)]
struct Spare {
    id: u64,
    file: Arc<dyn VFile>,
}

/// The append-only log of one data directory.
#[derive(Debug)]
pub(crate) struct Log {
    dir: PathBuf,
    options: LogOptions,
    /// The segment new records go to.
    active: u64,
    /// The length of the active segment including buffered, uncommitted records.
    active_len: u64,
    /// Every segment that exists or is about to (the active one may not have its name yet),
    /// held open.
    segments: BTreeMap<u64, Segment>,
    /// The file the next segment will be written to, created ahead of time.
    spare: Option<Spare>,
    /// Whether preparing the spare failed since it last succeeded (to warn once).
    spare_failed: bool,
    /// Records appended since the last commit.
    pending: Vec<Chunk>,
    /// Room for the next records: each is encoded at its end and split off as a frame.
    arena: BytesMut,
    /// The number of the last commit handed to the writer.
    last_seq: u64,
    cache: Cache,
    shared: Arc<Shared>,
    jobs: Option<mpsc::Sender<Job>>,
    writer: Option<JoinHandle<()>>,
    durable: DurableWatch,
    /// Held for the life of the log: the lock on it keeps other processes out.
    _lock: Box<dyn std::fmt::Debug + Send + Sync>,
}

impl Log {
    /// Opens (or creates) the log in `dir`, repairing a torn tail of the newest segment, and
    /// returns it with an iterator over every record in order.
    pub(crate) fn open(dir: &Path, options: LogOptions) -> Result<(Log, Replay), StorageError> {
        let vfs = options.vfs.clone();
        vfs.create_dir_all(dir).map_err(io_err(dir))?;
        let lock = vfs
            .lock(dir)
            .map_err(io_err(dir))?
            .ok_or_else(|| StorageError::Locked(dir.to_owned()))?;
        let mut ids = BTreeSet::new();
        for name in vfs.list(dir).map_err(io_err(dir))? {
            if let Some(id) = format::parse_segment_file_name(&name) {
                ids.insert(id);
            } else if format::is_spare_file_name(&name) {
                // Prepared for a segment that was never started: it holds nothing.
                let path = dir.join(&name);
                vfs.remove(&path).map_err(io_err(&path))?;
            }
        }
        check_contiguous(&ids)?;
        let dir_handle = vfs.open_dir(dir).map_err(io_err(dir))?;
        let mut segments = BTreeMap::new();
        let last = ids.last().copied();
        for &id in &ids {
            if Some(id) == last {
                break;
            }
            let path = dir.join(format::segment_file_name(id));
            let file = vfs.open(&path, OpenMode::Read).map_err(io_err(&path))?;
            let mut h = [0u8; 40];
            vfs::read_exact_at(file.as_ref(), &mut h, 0).map_err(|e| {
                if e.kind() == io::ErrorKind::UnexpectedEof {
                    StorageError::Corrupt { segment: id, offset: 0 }
                } else {
                    StorageError::Io { path: path.clone(), source: e }
                }
            })?;
            let header = SegmentHeader::decode(id, &h)?;
            segments.insert(id, Segment { file, salt: header.salt });
        }
        let (active, recovered) = match last {
            None => (1, create_segment(vfs.as_ref(), dir, dir_handle.as_ref(), 1, 1)?),
            Some(last) => (last, recover_last(vfs.as_ref(), dir, dir_handle.as_ref(), last)?),
        };
        let Recovered { file, salt, len: active_len, last_seq } = recovered;
        segments.insert(active, Segment { file: file.clone(), salt });

        let shared = Arc::new(Shared::new(last_seq));
        let (tx, rx) = mpsc::channel();
        let writer = Writer {
            dir: dir.to_owned(),
            vfs: vfs.clone(),
            dir_handle,
            shared: shared.clone(),
            files: [(active, file)].into_iter().collect(),
            durable_seq: last_seq,
            buf: Vec::new(),
        };
        let handle = std::thread::Builder::new()
            .name("twice-log-writer".into())
            .spawn(move || writer.run(rx))
            .map_err(io_err(dir))?;
        let replay = Replay::new(
            dir.to_owned(),
            segments.iter().map(|(&id, s)| (id, s.file.clone())).collect(),
            active_len,
        );
        let durable = DurableWatch { rx: shared.durable.subscribe(), shared: shared.clone() };
        let mut log = Log {
            dir: dir.to_owned(),
            options,
            active,
            active_len,
            segments,
            spare: None,
            spare_failed: false,
            pending: Vec::new(),
            arena: BytesMut::new(),
            last_seq,
            cache: Cache::default(),
            shared,
            jobs: Some(tx),
            writer: Some(handle),
            durable,
            _lock: lock,
        };
        log.prepare_spare();
        Ok((log, replay))
    }

    /// Creates the file of the next segment ahead of time, if it is not there yet. A failure
    /// (no file descriptor left, say) is not an error: the active segment grows past its size
    /// until a later attempt succeeds.
    fn prepare_spare(&mut self) {
        let id = self.active + 1;
        if self.spare.as_ref().is_some_and(|s| s.id == id) {
            return;
        }
        let path = self.dir.join(format::spare_file_name(id));
        match self.options.vfs.open(&path, OpenMode::Create) {
            Ok(file) => {
                self.spare = Some(Spare { id, file });
                self.spare_failed = false;
            }
            Err(e) => {
                if !self.spare_failed {
                    tracing::warn!(error = %e, path = %path.display(), "cannot prepare the next log segment; the active one grows until this succeeds");
                }
                self.spare_failed = true;
            }
        }
    }

    /// Buffers a record and returns where it will live. It is durable once the next
    /// [`Log::commit`] is.
    #[cfg(test)]
    pub(crate) fn append(&mut self, payload: Bytes) -> Result<Location, StorageError> {
        self.append_with(payload.len(), |buf| {
            buf.extend_from_slice(&payload);
            Ok(())
        })
    }

    /// Buffers a record whose payload `encode` writes at the end of the buffer it is given
    /// (about `size_hint` bytes), and returns where it will live. Encoding in place saves a
    /// buffer and a copy per record: frames are cut from large shared blocks, which both the
    /// writer and the read cache then refer to.
    pub(crate) fn append_with(
        &mut self,
        size_hint: usize,
        encode: impl FnOnce(&mut BytesMut) -> Result<(), String>,
    ) -> Result<Location, StorageError> {
        let frame_len = usize::try_from(FRAME_LEN).unwrap_or(8);
        if self.arena.capacity() < frame_len + size_hint {
            self.arena.reserve(ARENA_BLOCK.max(frame_len + size_hint));
        }
        self.arena.extend_from_slice(&[0u8; 8]);
        if let Err(e) = encode(&mut self.arena) {
            self.arena.clear();
            return Err(StorageError::Encode(e));
        }
        let payload_len = self.arena.len() - frame_len;
        let Some(len) = u32::try_from(payload_len).ok().filter(|&l| l <= MAX_RECORD_LEN) else {
            self.arena.clear();
            return Err(StorageError::RecordTooLarge { len: payload_len, max: MAX_RECORD_LEN });
        };
        let segment = self.active;
        let salt = self.segments.get(&segment).map_or(0, |s| s.salt);
        let crc = frame_crc(salt, len, &self.arena[frame_len..]);
        self.arena[..4].copy_from_slice(&len.to_le_bytes());
        self.arena[4..8].copy_from_slice(&crc.to_le_bytes());
        let frame = self.arena.split().freeze();
        let payload = frame.slice(frame_len..);
        // The first record of this commit in this segment opens a block.
        let chunk = match self.pending.last_mut() {
            Some(c) if c.segment == segment => c,
            _ => {
                self.pending.push(Chunk {
                    segment,
                    offset: self.active_len,
                    create: None,
                    has_block: false,
                    block: Bytes::new(),
                    body_len: 0,
                    frames: Vec::new(),
                });
                let Some(c) = self.pending.last_mut() else { unreachable!("just pushed") };
                c
            }
        };
        if !chunk.has_block {
            chunk.has_block = true;
            self.active_len += BLOCK_LEN;
        }
        let frame_bytes = FRAME_LEN + u64::from(len);
        chunk.frames.push(frame);
        chunk.body_len += frame_bytes;
        let offset = self.active_len;
        self.active_len += frame_bytes;
        self.cache_insert(segment, offset, payload);
        Ok(Location { segment, offset, len })
    }

    /// Whether the active segment has reached the segment size (and the next one can start).
    pub(crate) fn should_roll(&mut self) -> bool {
        if self.active_len < self.options.segment_size {
            return false;
        }
        self.prepare_spare();
        self.spare.is_some()
    }

    /// Starts a new segment; records appended from now on go to it. Returns its id, or `None`
    /// when its file could not be prepared (see [`Log::should_roll`]).
    pub(crate) fn roll(&mut self) -> Option<u64> {
        self.prepare_spare();
        let spare = self.spare.take()?;
        // The commit that starts a segment ends the one it closes with a block, empty if it
        // has no records there, and opens the new one with another: every closed segment then
        // ends at the commit its successor names first, and a cut at a block boundary shows.
        if !self.pending.last().is_some_and(|c| c.segment == self.active && c.has_block) {
            self.pending.push(Chunk {
                segment: self.active,
                offset: self.active_len,
                create: None,
                has_block: true,
                block: Bytes::new(),
                body_len: 0,
                frames: Vec::new(),
            });
            self.active_len += BLOCK_LEN;
        }
        // The first commit number is settled by [`Log::commit`]; this one is a lower bound.
        let header = SegmentHeader::new(new_salt(), self.last_seq + 1);
        self.active = spare.id;
        self.active_len = HEADER_LEN + BLOCK_LEN;
        self.segments.insert(self.active, Segment { file: spare.file.clone(), salt: header.salt });
        self.pending.push(Chunk {
            segment: self.active,
            offset: 0,
            create: Some((spare.file, Bytes::copy_from_slice(&header.encode(self.active)))),
            has_block: true,
            block: Bytes::new(),
            body_len: 0,
            frames: Vec::new(),
        });
        self.prepare_spare();
        Some(self.active)
    }

    /// The id of the segment new records go to.
    pub(crate) fn active_segment(&self) -> u64 {
        self.active
    }

    /// The ids of every segment, oldest first.
    pub(crate) fn segments(&self) -> impl Iterator<Item = u64> + '_ {
        self.segments.keys().copied()
    }

    /// The size at which the log starts a new segment.
    pub(crate) fn segment_size(&self) -> u64 {
        self.options.segment_size
    }

    /// Hands everything appended since the last commit to the writer and returns the commit's
    /// number, to wait on with [`Log::durable`]. With nothing appended it returns the previous
    /// number.
    pub(crate) fn commit(&mut self) -> Result<u64, StorageError> {
        if self.pending.is_empty() {
            return Ok(self.last_seq);
        }
        let watermark = self.durable.current()?;
        let seq = self.last_seq + 1;
        let mut chunks = std::mem::take(&mut self.pending);
        for c in &mut chunks {
            let salt = self.segments.get(&c.segment).map_or(0, |s| s.salt);
            if let Some((_, header)) = c.create.as_mut() {
                // The header names the first commit with a block in the segment exactly: this
                // one if it wrote there, else the next. Recovery reads a damaged first block as
                // that commit, and must not take it for the commit that only started the
                // segment (which is durable, and would make a torn write look like damage).
                let first_seq = if c.has_block { seq } else { seq + 1 };
                *header =
                    Bytes::copy_from_slice(&SegmentHeader::new(salt, first_seq).encode(c.segment));
            }
            if c.has_block {
                let block = Block { body_len: c.body_len, seq, watermark };
                c.block = Bytes::copy_from_slice(&block.encode(salt));
            }
        }
        self.send(Job::Commit { seq, chunks })?;
        self.last_seq = seq;
        Ok(seq)
    }

    /// The number of the last commit handed to the writer.
    pub(crate) fn last_commit(&self) -> u64 {
        self.last_seq
    }

    /// A handle to wait for commits.
    pub(crate) fn durable(&self) -> DurableWatch {
        self.durable.clone()
    }

    /// Commits and blocks until everything appended so far is durable.
    pub(crate) fn flush_blocking(&mut self) -> Result<(), StorageError> {
        let seq = self.commit()?;
        self.durable.wait_blocking(seq)
    }

    /// A handle that holds the writer still, for tests of what waits for durability.
    #[cfg(test)]
    pub(crate) fn writer_gate(&self) -> WriterGate {
        WriterGate(self.shared.clone())
    }

    /// How many `fdatasync` calls the writer has made on segment files.
    pub(crate) fn fsyncs(&self) -> u64 {
        self.shared.fsyncs.load(Ordering::Relaxed)
    }

    /// How many bytes the writer has written to segment files.
    pub(crate) fn bytes_written(&self) -> u64 {
        self.shared.bytes.load(Ordering::Relaxed)
    }

    /// The failure that stopped the log, if one did.
    #[cfg(test)]
    pub(crate) fn failure(&self) -> Option<StorageError> {
        self.durable.current().err()
    }

    /// Deletes a segment that is not the active one, once everything committed before this
    /// call is durable. Records in it can no longer be read.
    pub(crate) fn remove_segment(&mut self, segment: u64) -> Result<(), StorageError> {
        if segment == self.active || !self.segments.contains_key(&segment) {
            return Err(StorageError::NotFound { segment, offset: 0 });
        }
        // Anything appended but not committed is committed first, so the order of the
        // writer's jobs is the order of the caller's calls.
        self.commit()?;
        self.send(Job::Remove { segment })?;
        self.segments.remove(&segment);
        self.cache.entries.retain(|e| e.segment != segment);
        self.cache.bytes = self.cache.entries.iter().map(|e| e.payload.len()).sum();
        Ok(())
    }

    /// Reads a record back, from the cache if it is recent, else from its file.
    pub(crate) fn read(&self, loc: Location) -> Result<Bytes, StorageError> {
        if let Some(b) = self.cache.get(loc.segment, loc.offset) {
            return Ok(b.clone());
        }
        let Some(seg) = self.segments.get(&loc.segment) else {
            return Err(StorageError::NotFound { segment: loc.segment, offset: loc.offset });
        };
        read_record(seg.file.as_ref(), seg.salt, loc, || {
            self.dir.join(format::segment_file_name(loc.segment))
        })
    }

    /// Reads records back, each as [`Log::read`] does, with one read for the records that lie
    /// close together in a segment (a batch of messages stored together, received together
    /// once the cache has let them go) instead of one read each.
    pub(crate) fn read_many(&self, locs: &[Location]) -> Result<Vec<Bytes>, StorageError> {
        let mut out = Vec::with_capacity(locs.len());
        let mut i = 0;
        while let Some(&first) = locs.get(i) {
            if let Some(b) = self.cache.get(first.segment, first.offset) {
                out.push(b.clone());
                i += 1;
                continue;
            }
            // The run of records after it, in order, that the cache does not hold.
            let mut end = first.offset + u64::from(first.len) + 8;
            let mut j = i + 1;
            while let Some(&next) = locs.get(j) {
                let next_end = next.offset + u64::from(next.len) + 8;
                let close = next.segment == first.segment
                    && next.offset >= end
                    && next.offset - end <= MAX_READ_GAP
                    && next_end - first.offset <= MAX_READ_SPAN;
                if !close || self.cache.get(next.segment, next.offset).is_some() {
                    break;
                }
                end = next_end;
                j += 1;
            }
            let run = &locs[i..j];
            match self.read_run(first, end, run) {
                Some(records) => out.extend(records),
                // One by one, for each record's own answer.
                None => {
                    for &loc in run {
                        out.push(self.read(loc)?);
                    }
                }
            }
            i = j;
        }
        Ok(out)
    }

    /// The records of `run` (two or more, in order, from `first` to `end`) read with one
    /// read; `None` if that read or any of the records fails.
    fn read_run(&self, first: Location, end: u64, run: &[Location]) -> Option<Vec<Bytes>> {
        if run.len() < 2 {
            return None;
        }
        let seg = self.segments.get(&first.segment)?;
        let mut buf = vec![0u8; usize::try_from(end - first.offset).ok()?];
        vfs::read_exact_at(seg.file.as_ref(), &mut buf, first.offset).ok()?;
        let buf = Bytes::from(buf);
        run.iter()
            .map(|loc| {
                let start = usize::try_from(loc.offset - first.offset).ok()?;
                let len = usize::try_from(loc.len).ok()?;
                let frame = buf.get(start..start + len + 8)?;
                check_frame(seg.salt, *loc, frame).ok()?;
                Some(buf.slice(start + 8..start + 8 + len))
            })
            .collect()
    }

    /// Commits what is buffered, waits for it, and stops the writer thread.
    pub(crate) fn close(mut self) -> Result<(), StorageError> {
        let r = self.flush_blocking();
        self.stop_writer();
        r
    }

    fn stop_writer(&mut self) {
        self.jobs = None;
        if let Some(h) = self.writer.take() {
            let _ = h.join();
        }
    }

    fn send(&self, job: Job) -> Result<(), StorageError> {
        let jobs = self.jobs.as_ref().ok_or_else(stopped)?;
        jobs.send(job).map_err(|_| self.durable.current().err().unwrap_or_else(stopped))
    }

    fn cache_insert(&mut self, segment: u64, offset: u64, payload: Bytes) {
        self.cache.bytes += payload.len();
        self.cache.entries.push_back(CacheEntry {
            segment,
            offset,
            seq: self.last_seq + 1,
            payload,
        });
        let written = self.shared.written.load(Ordering::Acquire);
        while self.cache.bytes > self.options.cache_bytes {
            match self.cache.entries.front() {
                Some(e) if e.seq <= written => {
                    self.cache.bytes -= e.payload.len();
                    self.cache.entries.pop_front();
                }
                _ => break,
            }
        }
    }
}

impl Drop for Log {
    fn drop(&mut self) {
        // Whatever was committed is written before the thread ends; uncommitted appends were
        // never acknowledged and are dropped.
        self.stop_writer();
    }
}

/// Holds the writer still while a guard from [`WriterGate::hold`] lives: commits queue up
/// and none becomes durable.
#[cfg(test)]
#[derive(Debug)]
pub(crate) struct WriterGate(Arc<Shared>);

#[cfg(test)]
impl WriterGate {
    pub(crate) fn hold(&self) -> std::sync::MutexGuard<'_, ()> {
        self.0.gate.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Reads the record at `loc` from `file` (whose salt is `salt`) and checks it.
/// Reads the record at `loc`; `path` names the file in an error (it is made only then: a
/// receive reads a record per message whose body is no longer cached).
fn read_record(
    file: &dyn VFile,
    salt: u32,
    loc: Location,
    path: impl FnOnce() -> PathBuf,
) -> Result<Bytes, StorageError> {
    let len = usize::try_from(loc.len).map_err(|_| corrupt(loc))?;
    let mut buf = vec![0u8; len + 8];
    vfs::read_exact_at(file, &mut buf, loc.offset).map_err(|e| {
        if e.kind() == io::ErrorKind::UnexpectedEof {
            corrupt(loc)
        } else {
            StorageError::Io { path: path(), source: e }
        }
    })?;
    check_frame(salt, loc, &buf)?;
    let mut b = Bytes::from(buf);
    Ok(b.split_off(8))
}

/// Checks that `frame` (header and payload) is the record `loc` says is there.
fn check_frame(salt: u32, loc: Location, frame: &[u8]) -> Result<(), StorageError> {
    let (Some(header), Some(payload)) = (frame.first_chunk::<8>(), frame.get(8..)) else {
        return Err(corrupt(loc));
    };
    let (flen, crc) = frame_header(header);
    if flen != loc.len || frame_crc(salt, flen, payload) != crc {
        return Err(corrupt(loc));
    }
    Ok(())
}

/// A random salt for a new segment's checksums.
fn new_salt() -> u32 {
    let b = uuid::Uuid::new_v4().into_bytes();
    u32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

/// Refuses a log with a gap in its segment ids: segments are only ever removed oldest first,
/// so a gap means records that were acknowledged are gone.
fn check_contiguous(ids: &BTreeSet<u64>) -> Result<(), StorageError> {
    let mut it = ids.iter().copied();
    let Some(mut before) = it.next() else { return Ok(()) };
    for after in it {
        if after != before + 1 {
            return Err(StorageError::MissingSegment { segment: before + 1, before, after });
        }
        before = after;
    }
    Ok(())
}

fn stopped() -> StorageError {
    StorageError::Failed(Arc::new(io::Error::other("log writer stopped")))
}

fn corrupt(loc: Location) -> StorageError {
    StorageError::Corrupt { segment: loc.segment, offset: loc.offset }
}

/// The newest segment as recovery left it.
struct Recovered {
    file: Arc<dyn VFile>,
    salt: u32,
    /// Its valid length.
    len: u64,
    /// The number of its last commit (or the one before its first).
    last_seq: u64,
}

/// Creates segment `id` with only its header, durably.
fn create_segment(
    vfs: &dyn Vfs,
    dir: &Path,
    dir_handle: &dyn VFile,
    id: u64,
    first_seq: u64,
) -> Result<Recovered, StorageError> {
    let path = dir.join(format::segment_file_name(id));
    let salt = new_salt();
    let header = SegmentHeader::new(salt, first_seq).encode(id);
    let io = io_err(&path);
    let file = vfs.open(&path, OpenMode::Create).map_err(io_err(&path))?;
    file.write_at(&header, 0)
        .and_then(|()| file.sync())
        .and_then(|()| dir_handle.sync())
        .map_err(io)?;
    Ok(Recovered { file, salt, len: HEADER_LEN, last_seq: first_seq.saturating_sub(1) })
}

/// Validates the newest segment, truncating a torn tail, and returns it open for writing.
fn recover_last(
    vfs: &dyn Vfs,
    dir: &Path,
    dir_handle: &dyn VFile,
    id: u64,
) -> Result<Recovered, StorageError> {
    let path = dir.join(format::segment_file_name(id));
    let file = vfs.open(&path, OpenMode::ReadWrite).map_err(io_err(&path))?;
    let file_len = file.len().map_err(io_err(&path))?;
    if file_len < HEADER_LEN {
        // A segment takes its name only once its header is durable; an operator's copy or a
        // file system that lost it leaves it short. It holds nothing that was acknowledged.
        tracing::warn!(
            segment = id,
            len = file_len,
            "log segment header is incomplete; rewriting it"
        );
        drop(file);
        return create_segment(vfs, dir, dir_handle, id, 1);
    }
    let scan_err = |e: ScanError| match e {
        ScanError::Storage(e) => e,
        ScanError::Io(e) => StorageError::Io { path: path.clone(), source: e },
    };
    let mut scan = SegmentScan::open(file.clone(), id, file_len).map_err(scan_err)?;
    let valid_end = loop {
        match scan.next_block().map_err(io_err(&path))? {
            Scanned::Block { .. } => {}
            Scanned::End => break file_len,
            Scanned::Damaged { block, at, header } => {
                let seq = scan.damaged_seq(header);
                if durable_block_after(file.as_ref(), scan.header.salt, block + 1, file_len, seq)
                    .map_err(io_err(&path))?
                {
                    return Err(StorageError::Corrupt { segment: id, offset: at });
                }
                break block;
            }
        }
    };
    if valid_end < file_len {
        tracing::warn!(
            segment = id,
            offset = valid_end,
            dropped = file_len - valid_end,
            "truncating a torn tail of the log (commits never acknowledged)"
        );
        file.set_len(valid_end).map_err(io_err(&path))?;
    }
    // What recovery kept may have been written but never synced (after a crash of the process
    // alone): it is made durable before any new commit can claim it was.
    file.sync().map_err(io_err(&path))?;
    // New commits number on from the last one here, and never below what the header allows.
    let floor = scan.header.first_seq.saturating_sub(1);
    let last_seq = scan.last_seq().unwrap_or(floor).max(floor);
    Ok(Recovered { file, salt: scan.header.salt, len: valid_end, last_seq })
}

#[cfg(test)]
mod broker_fault_tests;
#[cfg(test)]
mod fault_tests;
#[cfg(test)]
mod tests;
