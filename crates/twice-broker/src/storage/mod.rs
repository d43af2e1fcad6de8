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
//! On [`Log::open`], a damaged tail of the newest segment (a record cut short by a crash, or
//! garbage with no valid record after it) is truncated with a warning: it was never
//! acknowledged. Damage anywhere else is [`StorageError::Corrupt`]: acknowledged data is never
//! skipped silently.

mod format;
mod writer;

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::fs::{File, OpenOptions};
use std::io::{self, BufReader, Read, Seek, SeekFrom};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, mpsc};
use std::thread::JoinHandle;

use bytes::{Bytes, BytesMut};
use tokio::sync::watch;

pub(crate) use format::{FRAME_LEN, HEADER_LEN, MAX_RECORD_LEN};
use format::{any_valid_after, check_header, frame_crc, frame_header};
use writer::{Chunk, DurableState, Job, Shared, Writer, sync_dir};

/// The default size at which the log starts a new segment: 64 MiB.
pub(crate) const DEFAULT_SEGMENT_SIZE: u64 = 64 << 20;
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
    #[error("log segment {segment} has format version {version}; this build reads version 1")]
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
}

impl Default for LogOptions {
    fn default() -> Self {
        Self { segment_size: DEFAULT_SEGMENT_SIZE, cache_bytes: DEFAULT_CACHE_BYTES }
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

/// The append-only log of one data directory.
#[derive(Debug)]
pub(crate) struct Log {
    dir: PathBuf,
    options: LogOptions,
    /// The segment new records go to.
    active: u64,
    /// The length of the active segment including buffered, uncommitted records.
    active_len: u64,
    /// Every segment that exists or is about to (the active one may not have a file yet).
    segments: BTreeSet<u64>,
    /// Records appended since the last commit.
    pending: Vec<Chunk>,
    /// Room for the next records: each is encoded at its end and split off as a frame.
    arena: BytesMut,
    /// The number of the last commit handed to the writer.
    last_seq: u64,
    cache: Cache,
    /// Read handles by segment. A std mutex: held only to look up or insert a handle, never
    /// across the read itself.
    readers: Mutex<HashMap<u64, Arc<File>>>,
    shared: Arc<Shared>,
    jobs: Option<mpsc::Sender<Job>>,
    writer: Option<JoinHandle<()>>,
    durable: DurableWatch,
    /// Held for the life of the log: the `flock` on it keeps other processes out.
    _lock: File,
}

impl Log {
    /// Opens (or creates) the log in `dir`, repairing a torn tail of the newest segment, and
    /// returns it with an iterator over every record in order.
    pub(crate) fn open(dir: &Path, options: LogOptions) -> Result<(Log, Replay), StorageError> {
        std::fs::create_dir_all(dir).map_err(io_err(dir))?;
        let lock = lock_dir(dir)?;
        let mut ids = BTreeSet::new();
        for entry in std::fs::read_dir(dir).map_err(io_err(dir))? {
            let entry = entry.map_err(io_err(dir))?;
            if let Some(id) = entry.file_name().to_str().and_then(format::parse_segment_file_name) {
                ids.insert(id);
            }
        }
        check_contiguous(&ids)?;
        let mut files = HashMap::new();
        let (active, active_len) = match ids.last().copied() {
            None => {
                let f = create_segment(dir, 1)?;
                files.insert(1, f);
                ids.insert(1);
                (1, HEADER_LEN)
            }
            Some(last) => {
                let (f, len) = recover_last(dir, last)?;
                files.insert(last, f);
                (last, len)
            }
        };
        let shared = Arc::new(Shared::new());
        let (tx, rx) = mpsc::channel();
        let writer = Writer {
            dir: dir.to_owned(),
            shared: shared.clone(),
            files,
            durable_seq: 0,
            buf: Vec::new(),
        };
        let handle = std::thread::Builder::new()
            .name("twice-log-writer".into())
            .spawn(move || writer.run(rx))
            .map_err(io_err(dir))?;
        let replay = Replay {
            dir: dir.to_owned(),
            segments: ids.iter().copied().collect(),
            last_end: active_len,
            current: None,
        };
        let durable = DurableWatch { rx: shared.durable.subscribe(), shared: shared.clone() };
        let log = Log {
            dir: dir.to_owned(),
            options,
            active,
            active_len,
            segments: ids,
            pending: Vec::new(),
            arena: BytesMut::new(),
            last_seq: 0,
            cache: Cache::default(),
            readers: Mutex::new(HashMap::new()),
            shared,
            jobs: Some(tx),
            writer: Some(handle),
            durable,
            _lock: lock,
        };
        Ok((log, replay))
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
        let crc = frame_crc(len, &self.arena[frame_len..]);
        self.arena[..4].copy_from_slice(&len.to_le_bytes());
        self.arena[4..8].copy_from_slice(&crc.to_le_bytes());
        let frame = self.arena.split().freeze();
        let payload = frame.slice(frame_len..);
        let offset = self.active_len;
        let segment = self.active;
        match self.pending.last_mut() {
            Some(c) if c.segment == segment => c.frames.push(frame),
            _ => self.pending.push(Chunk { segment, offset, create: false, frames: vec![frame] }),
        }
        self.active_len += FRAME_LEN + u64::from(len);
        self.cache_insert(segment, offset, payload);
        Ok(Location { segment, offset, len })
    }

    /// Whether the active segment has reached the segment size.
    pub(crate) fn should_roll(&self) -> bool {
        self.active_len >= self.options.segment_size
    }

    /// Starts a new segment; records appended from now on go to it. Returns its id.
    pub(crate) fn roll(&mut self) -> u64 {
        self.active += 1;
        self.active_len = HEADER_LEN;
        self.segments.insert(self.active);
        self.pending.push(Chunk {
            segment: self.active,
            offset: 0,
            create: true,
            frames: vec![Bytes::copy_from_slice(&format::segment_header(self.active))],
        });
        self.active
    }

    /// The id of the segment new records go to.
    pub(crate) fn active_segment(&self) -> u64 {
        self.active
    }

    /// The ids of every segment, oldest first.
    pub(crate) fn segments(&self) -> impl Iterator<Item = u64> + '_ {
        self.segments.iter().copied()
    }

    /// Hands everything appended since the last commit to the writer and returns the commit's
    /// number, to wait on with [`Log::durable`]. With nothing appended it returns the previous
    /// number.
    pub(crate) fn commit(&mut self) -> Result<u64, StorageError> {
        if self.pending.is_empty() {
            return Ok(self.last_seq);
        }
        self.durable.current()?;
        let seq = self.last_seq + 1;
        let chunks = std::mem::take(&mut self.pending);
        self.send(Job::Commit { seq, chunks })?;
        self.last_seq = seq;
        Ok(seq)
    }

    /// The number of the last commit handed to the writer (0 before the first).
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

    /// Deletes a segment that is not the active one, once everything committed before this
    /// call is durable. Records in it can no longer be read.
    pub(crate) fn remove_segment(&mut self, segment: u64) -> Result<(), StorageError> {
        if segment == self.active || !self.segments.contains(&segment) {
            return Err(StorageError::NotFound { segment, offset: 0 });
        }
        // Anything appended but not committed is committed first, so the order of the
        // writer's jobs is the order of the caller's calls.
        self.commit()?;
        self.send(Job::Remove { segment })?;
        self.segments.remove(&segment);
        self.readers.lock().unwrap_or_else(std::sync::PoisonError::into_inner).remove(&segment);
        self.cache.entries.retain(|e| e.segment != segment);
        self.cache.bytes = self.cache.entries.iter().map(|e| e.payload.len()).sum();
        Ok(())
    }

    /// Reads a record back, from the cache if it is recent, else from its file.
    pub(crate) fn read(&self, loc: Location) -> Result<Bytes, StorageError> {
        if let Some(b) = self.cache.get(loc.segment, loc.offset) {
            return Ok(b.clone());
        }
        if !self.segments.contains(&loc.segment) {
            return Err(StorageError::NotFound { segment: loc.segment, offset: loc.offset });
        }
        let file = self.reader(loc.segment)?;
        let len = usize::try_from(loc.len).map_err(|_| corrupt(loc))?;
        let mut buf = vec![0u8; len + 8];
        file.read_exact_at(&mut buf, loc.offset).map_err(|e| {
            if e.kind() == io::ErrorKind::UnexpectedEof {
                corrupt(loc)
            } else {
                StorageError::Io {
                    path: self.dir.join(format::segment_file_name(loc.segment)),
                    source: e,
                }
            }
        })?;
        let mut h = [0u8; 8];
        h.copy_from_slice(&buf[..8]);
        let (flen, crc) = frame_header(&h);
        if flen != loc.len || frame_crc(flen, &buf[8..]) != crc {
            return Err(corrupt(loc));
        }
        let mut b = Bytes::from(buf);
        Ok(b.split_off(8))
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

    fn reader(&self, segment: u64) -> Result<Arc<File>, StorageError> {
        let mut readers = self.readers.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(f) = readers.get(&segment) {
            return Ok(f.clone());
        }
        let path = self.dir.join(format::segment_file_name(segment));
        let f = Arc::new(File::open(&path).map_err(io_err(&path))?);
        readers.insert(segment, f.clone());
        Ok(f)
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

fn lock_dir(dir: &Path) -> Result<File, StorageError> {
    let path = dir.join("LOCK");
    let f = OpenOptions::new()
        .create(true)
        .truncate(false)
        .read(true)
        .write(true)
        .open(&path)
        .map_err(io_err(&path))?;
    match rustix::fs::flock(&f, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
        Ok(()) => Ok(f),
        Err(e) if e == rustix::io::Errno::WOULDBLOCK => Err(StorageError::Locked(dir.to_owned())),
        Err(e) => Err(StorageError::Io { path, source: e.into() }),
    }
}

fn create_segment(dir: &Path, id: u64) -> Result<File, StorageError> {
    let path = dir.join(format::segment_file_name(id));
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&path)
        .map_err(io_err(&path))?;
    f.write_all_at(&format::segment_header(id), 0).map_err(io_err(&path))?;
    f.sync_data().map_err(io_err(&path))?;
    sync_dir(dir).map_err(io_err(dir))?;
    Ok(f)
}

/// Validates the newest segment, truncating a torn tail, and returns it open for writing with
/// its valid length.
fn recover_last(dir: &Path, id: u64) -> Result<(File, u64), StorageError> {
    let path = dir.join(format::segment_file_name(id));
    let file = OpenOptions::new().read(true).write(true).open(&path).map_err(io_err(&path))?;
    let file_len = file.metadata().map_err(io_err(&path))?.len();
    if file_len < HEADER_LEN {
        // The crash came while the segment was being created: it holds nothing.
        tracing::warn!(
            segment = id,
            len = file_len,
            "log segment header is incomplete; rewriting it"
        );
        drop(file);
        return Ok((create_segment(dir, id)?, HEADER_LEN));
    }
    let mut header = [0u8; 24];
    file.read_exact_at(&mut header, 0).map_err(io_err(&path))?;
    check_header(id, &header)?;

    let mut reader = BufReader::with_capacity(1 << 20, &file);
    reader.seek(SeekFrom::Start(HEADER_LEN)).map_err(io_err(&path))?;
    let mut pos = HEADER_LEN;
    let mut payload = Vec::new();
    let valid_end = loop {
        match read_frame(&mut reader, &mut payload, file_len - pos).map_err(io_err(&path))? {
            ReadFrame::Valid(len) => pos += FRAME_LEN + u64::from(len),
            ReadFrame::End => break pos,
            ReadFrame::Incomplete | ReadFrame::Bad => {
                // Damage: it is a torn tail only if no valid record follows it.
                let mut rest = Vec::new();
                let mut f = &file;
                f.seek(SeekFrom::Start(pos)).map_err(io_err(&path))?;
                f.read_to_end(&mut rest).map_err(io_err(&path))?;
                if any_valid_after(&rest, 1) {
                    return Err(StorageError::Corrupt { segment: id, offset: pos });
                }
                break pos;
            }
        }
    };
    if valid_end < file_len {
        tracing::warn!(
            segment = id,
            offset = valid_end,
            dropped = file_len - valid_end,
            "truncating a torn tail of the log (records never acknowledged)"
        );
        file.set_len(valid_end).map_err(io_err(&path))?;
        file.sync_all().map_err(io_err(&path))?;
    }
    Ok((file, valid_end))
}

enum ReadFrame {
    Valid(u32),
    End,
    Incomplete,
    Bad,
}

/// Reads the next frame into `payload`, with `left` bytes left in the file.
fn read_frame(r: &mut impl Read, payload: &mut Vec<u8>, left: u64) -> io::Result<ReadFrame> {
    if left == 0 {
        return Ok(ReadFrame::End);
    }
    if left < FRAME_LEN {
        return Ok(ReadFrame::Incomplete);
    }
    let mut h = [0u8; 8];
    r.read_exact(&mut h)?;
    let (len, crc) = frame_header(&h);
    if len > MAX_RECORD_LEN {
        return Ok(ReadFrame::Bad);
    }
    if u64::from(len) > left - FRAME_LEN {
        return Ok(ReadFrame::Incomplete);
    }
    let n = usize::try_from(len).map_err(io::Error::other)?;
    payload.clear();
    payload.resize(n, 0);
    r.read_exact(payload)?;
    Ok(if frame_crc(len, payload) == crc { ReadFrame::Valid(len) } else { ReadFrame::Bad })
}

/// Streams every record of the log, oldest first, one at a time.
#[derive(Debug)]
pub(crate) struct Replay {
    dir: PathBuf,
    segments: VecDeque<u64>,
    /// The valid length of the newest segment, as found by [`Log::open`].
    last_end: u64,
    current: Option<ReplaySegment>,
}

#[derive(Debug)]
struct ReplaySegment {
    id: u64,
    reader: BufReader<File>,
    pos: u64,
    end: u64,
}

impl Replay {
    fn next_record(&mut self) -> Result<Option<ReplayRecord>, StorageError> {
        loop {
            if self.current.is_none() {
                let Some(id) = self.segments.pop_front() else { return Ok(None) };
                let path = self.dir.join(format::segment_file_name(id));
                let file = File::open(&path).map_err(io_err(&path))?;
                let end = if self.segments.is_empty() {
                    self.last_end
                } else {
                    file.metadata().map_err(io_err(&path))?.len()
                };
                let mut reader = BufReader::with_capacity(1 << 20, file);
                let mut header = [0u8; 24];
                if end < HEADER_LEN {
                    return Err(StorageError::Corrupt { segment: id, offset: 0 });
                }
                reader.read_exact(&mut header).map_err(io_err(&path))?;
                check_header(id, &header)?;
                self.current = Some(ReplaySegment { id, reader, pos: HEADER_LEN, end });
            }
            let Some(seg) = self.current.as_mut() else { continue };
            let mut payload = Vec::new();
            let left = seg.end - seg.pos;
            let frame =
                read_frame(&mut seg.reader, &mut payload, left).map_err(|e| StorageError::Io {
                    path: self.dir.join(format::segment_file_name(seg.id)),
                    source: e,
                })?;
            match frame {
                ReadFrame::Valid(len) => {
                    let location = Location { segment: seg.id, offset: seg.pos, len };
                    seg.pos += FRAME_LEN + u64::from(len);
                    return Ok(Some(ReplayRecord { location, payload: Bytes::from(payload) }));
                }
                ReadFrame::End => self.current = None,
                ReadFrame::Incomplete | ReadFrame::Bad => {
                    let offset = seg.pos;
                    let segment = seg.id;
                    // Stop here for good: a replay that went on would skip acknowledged data.
                    self.segments.clear();
                    self.current = None;
                    return Err(StorageError::Corrupt { segment, offset });
                }
            }
        }
    }
}

impl Iterator for Replay {
    type Item = Result<ReplayRecord, StorageError>;

    fn next(&mut self) -> Option<Self::Item> {
        self.next_record().transpose()
    }
}

#[cfg(test)]
mod tests;
