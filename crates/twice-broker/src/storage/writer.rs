//! The writer thread: the only code that writes segment files.
//!
//! It takes every commit queued while it was busy, writes each touched segment with one
//! positioned write, calls `fdatasync` once per touched segment, and then publishes the highest
//! commit number as durable. This is group commit: the cost of one fsync is shared by every
//! operation that arrived while the previous one ran.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::Receiver;
use std::sync::{Arc, Condvar, Mutex};

use bytes::Bytes;
use tokio::sync::watch;

use super::format::segment_file_name;

/// Bytes for one segment, to be written at `offset`.
#[derive(Debug)]
pub(crate) struct Chunk {
    pub(crate) segment: u64,
    pub(crate) offset: u64,
    /// Whether this chunk starts a new segment file (it then begins with the header).
    pub(crate) create: bool,
    /// Framed records (or a segment header), back to back from `offset`.
    pub(crate) frames: Vec<Bytes>,
}

impl Chunk {
    fn len(&self) -> u64 {
        self.frames.iter().map(|f| len_u64(f)).sum()
    }
}

/// Work for the writer thread, in order.
#[derive(Debug)]
pub(crate) enum Job {
    /// Write and sync these chunks; then commit `seq` is durable.
    Commit { seq: u64, chunks: Vec<Chunk> },
    /// Delete a segment file, after everything queued before it is durable.
    Remove { segment: u64 },
}

/// What the writer has made durable, as seen by waiters.
#[derive(Clone, Debug, Default)]
pub(crate) struct DurableState {
    /// Every commit up to this number is on disk.
    pub(crate) seq: u64,
    /// Set when a write or sync failed: nothing after it can be trusted, so the log stops.
    pub(crate) failed: Option<Arc<io::Error>>,
}

/// State shared by the log and its writer thread.
#[derive(Debug)]
pub(crate) struct Shared {
    /// The highest commit whose bytes have been handed to the kernel: a `pread` sees them,
    /// so the read cache may drop them.
    pub(crate) written: AtomicU64,
    /// How many `fdatasync` calls the writer made on segment files.
    pub(crate) fsyncs: AtomicU64,
    /// Durability for async waiters.
    pub(crate) durable: watch::Sender<DurableState>,
    /// Durability for blocking waiters. A std mutex: held only to copy or replace a small
    /// value, never across I/O.
    pub(crate) durable_sync: Mutex<DurableState>,
    pub(crate) durable_cv: Condvar,
    /// Lets a test hold the writer still so that commits pile up behind it.
    #[cfg(test)]
    pub(crate) gate: Mutex<()>,
}

impl Shared {
    pub(crate) fn new() -> Self {
        Self {
            written: AtomicU64::new(0),
            fsyncs: AtomicU64::new(0),
            durable: watch::Sender::new(DurableState::default()),
            durable_sync: Mutex::new(DurableState::default()),
            durable_cv: Condvar::new(),
            #[cfg(test)]
            gate: Mutex::new(()),
        }
    }

    fn publish(&self, state: DurableState) {
        {
            let mut g = self.durable_sync.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            *g = state.clone();
        }
        self.durable_cv.notify_all();
        self.durable.send_replace(state);
    }
}

/// The writer thread's state.
#[derive(Debug)]
pub(crate) struct Writer {
    pub(crate) dir: PathBuf,
    pub(crate) shared: Arc<Shared>,
    /// Open write handles, normally only the active segment.
    pub(crate) files: HashMap<u64, File>,
    pub(crate) durable_seq: u64,
    /// Where a run of frames is gathered for one write; kept between commits so that its
    /// memory is reused.
    pub(crate) buf: Vec<u8>,
}

impl Writer {
    /// Runs until the log drops its sender (or a write fails).
    pub(crate) fn run(mut self, jobs: Receiver<Job>) {
        while let Ok(first) = jobs.recv() {
            #[cfg(test)]
            let gate = self.shared.gate.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            let mut group = vec![first];
            group.extend(jobs.try_iter());
            #[cfg(test)]
            drop(gate);
            if let Err(e) = self.process(group) {
                tracing::error!(error = %e, dir = %self.dir.display(), "log write failed; the log stops accepting writes");
                self.shared
                    .publish(DurableState { seq: self.durable_seq, failed: Some(Arc::new(e)) });
                return;
            }
        }
    }

    fn process(&mut self, group: Vec<Job>) -> io::Result<()> {
        let mut batch: Vec<Chunk> = Vec::new();
        let mut batch_seq = None;
        for job in group {
            match job {
                Job::Commit { seq, chunks } => {
                    batch.extend(chunks);
                    batch_seq = Some(seq);
                }
                Job::Remove { segment } => {
                    // Everything queued before the removal must be durable first: the
                    // removal is only safe because those records restate what it held.
                    if let Some(seq) = batch_seq.take() {
                        self.flush(std::mem::take(&mut batch), seq)?;
                    }
                    self.files.remove(&segment);
                    let path = self.dir.join(segment_file_name(segment));
                    match std::fs::remove_file(&path) {
                        Ok(()) => {}
                        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                        Err(e) => return Err(e),
                    }
                    sync_dir(&self.dir)?;
                }
            }
        }
        if let Some(seq) = batch_seq {
            self.flush(batch, seq)?;
        }
        Ok(())
    }

    /// Writes `chunks` (contiguous runs per segment, in segment order) with one write and one
    /// fdatasync per segment, then publishes `seq` as durable.
    fn flush(&mut self, chunks: Vec<Chunk>, seq: u64) -> io::Result<()> {
        // Contiguous chunks of one segment form a run: one write, one sync.
        let mut runs: Vec<Vec<Chunk>> = Vec::new();
        for c in chunks {
            match runs.last_mut().and_then(|r| r.last().map(|l| (l.segment, l.offset + l.len()))) {
                Some((segment, end)) if segment == c.segment && end == c.offset && !c.create => {
                    if let Some(run) = runs.last_mut() {
                        run.push(c);
                    }
                }
                _ => runs.push(vec![c]),
            }
        }
        let n = runs.len();
        for (i, run) in runs.into_iter().enumerate() {
            let (segment, offset, create) = (run[0].segment, run[0].offset, run[0].create);
            self.buf.clear();
            for frame in run.iter().flat_map(|c| &c.frames) {
                self.buf.extend_from_slice(frame);
            }
            // The frames go now: the blocks they were cut from are freed as soon as the read
            // cache lets go too.
            drop(run);
            if create {
                // A segment file exists only once every earlier segment is complete on disk
                // (the previous run was synced below), so a crash never leaves a hole in a
                // segment that is not the last one.
                let f = OpenOptions::new()
                    .read(true)
                    .write(true)
                    .create(true)
                    .truncate(true)
                    .open(self.dir.join(segment_file_name(segment)))?;
                // Only the newest segment is written to from now on.
                self.files.clear();
                self.files.insert(segment, f);
            }
            let file = match self.files.get(&segment) {
                Some(f) => f,
                None => {
                    let f = OpenOptions::new()
                        .write(true)
                        .open(self.dir.join(segment_file_name(segment)))?;
                    self.files.entry(segment).or_insert(f)
                }
            };
            file.write_all_at(&self.buf, offset)?;
            if i + 1 == n {
                self.shared.written.store(seq, Ordering::Release);
            }
            file.sync_data()?;
            self.shared.fsyncs.fetch_add(1, Ordering::Relaxed);
            if create {
                sync_dir(&self.dir)?;
            }
        }
        // A burst of large commits should not keep its buffer for good.
        if self.buf.capacity() > MAX_KEPT_BUFFER {
            self.buf = Vec::new();
        }
        self.durable_seq = seq;
        self.shared.publish(DurableState { seq, failed: None });
        Ok(())
    }
}

/// The largest write buffer the writer keeps between commits.
const MAX_KEPT_BUFFER: usize = 8 << 20;

fn len_u64(b: &[u8]) -> u64 {
    u64::try_from(b.len()).unwrap_or(u64::MAX)
}

/// Makes a directory's entries (created or removed files) durable.
pub(crate) fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}
