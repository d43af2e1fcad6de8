//! The writer thread: the only code that writes segment files.
//!
//! It takes every commit queued while it was busy, writes each touched segment with one
//! positioned write, calls `fdatasync` once per touched segment, and then publishes the highest
//! commit number as durable. This is group commit: the cost of one fsync is shared by every
//! operation that arrived while the previous one ran.

use std::collections::HashMap;
use std::io;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::Receiver;
use std::sync::{Arc, Condvar, Mutex};

use bytes::Bytes;
use tokio::sync::watch;

use super::format::{segment_file_name, spare_file_name};
use super::vfs::{VFile, Vfs};

/// Bytes for one segment, to be written at `offset`: what one commit put there.
#[derive(Debug)]
pub(crate) struct Chunk {
    pub(crate) segment: u64,
    pub(crate) offset: u64,
    /// For a chunk that starts a new segment: the prepared file it is written to (which then
    /// takes the segment's name) and the segment header.
    pub(crate) create: Option<(Arc<dyn VFile>, Bytes)>,
    /// Whether the chunk carries records, behind a block header.
    pub(crate) has_block: bool,
    /// The block header, filled in when the chunk is committed.
    pub(crate) block: Bytes,
    /// The bytes of the framed records.
    pub(crate) body_len: u64,
    /// Framed records, back to back after the block header.
    pub(crate) frames: Vec<Bytes>,
}

impl Chunk {
    fn parts(&self) -> impl Iterator<Item = &Bytes> {
        self.create.iter().map(|(_, h)| h).chain(std::iter::once(&self.block)).chain(&self.frames)
    }

    fn len(&self) -> u64 {
        self.parts().map(|f| len_u64(f)).sum()
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
    /// How many bytes the writer wrote to segment files.
    pub(crate) bytes: AtomicU64,
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
    /// The state of a log whose commits up to `seq` are durable.
    pub(crate) fn new(seq: u64) -> Self {
        let state = DurableState { seq, failed: None };
        Self {
            written: AtomicU64::new(seq),
            fsyncs: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
            durable: watch::Sender::new(state.clone()),
            durable_sync: Mutex::new(state),
            durable_cv: Condvar::new(),
            #[cfg(test)]
            gate: Mutex::new(()),
        }
    }

    fn publish(&self, state: DurableState) {
        // The watch first: a blocking waiter that wakes up then finds the same state in it
        // (a commit's watermark is read from it).
        self.durable.send_replace(state.clone());
        {
            let mut g = self.durable_sync.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            *g = state;
        }
        self.durable_cv.notify_all();
    }
}

/// The writer thread's state.
#[derive(Debug)]
pub(crate) struct Writer {
    pub(crate) dir: PathBuf,
    pub(crate) vfs: Arc<dyn Vfs>,
    /// The data directory, held open so that making its entries durable needs no new file
    /// descriptor.
    pub(crate) dir_handle: Arc<dyn VFile>,
    pub(crate) shared: Arc<Shared>,
    /// Open write handles, normally only the active segment.
    pub(crate) files: HashMap<u64, Arc<dyn VFile>>,
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
                    match self.vfs.remove(&path) {
                        Ok(()) => {}
                        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                        Err(e) => return Err(e),
                    }
                    self.dir_handle.sync()?;
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
                Some((segment, end))
                    if segment == c.segment && end == c.offset && c.create.is_none() =>
                {
                    if let Some(run) = runs.last_mut() {
                        run.push(c);
                    }
                }
                _ => runs.push(vec![c]),
            }
        }
        let n = runs.len();
        for (i, run) in runs.into_iter().enumerate() {
            let (segment, offset) = (run[0].segment, run[0].offset);
            let create = run[0].create.as_ref().map(|(f, _)| f.clone());
            self.buf.clear();
            for part in run.iter().flat_map(Chunk::parts) {
                self.buf.extend_from_slice(part);
            }
            // The frames go now: the blocks they were cut from are freed as soon as the read
            // cache lets go too.
            drop(run);
            if let Some(f) = &create {
                // Only the newest segment is written to from now on.
                self.files.clear();
                self.files.insert(segment, f.clone());
            }
            let file = self.files.get(&segment).ok_or_else(|| {
                io::Error::other(format!("log segment {segment} is not open for writing"))
            })?;
            file.write_at(&self.buf, offset)?;
            self.shared.bytes.fetch_add(len_u64(&self.buf), Ordering::Relaxed);
            if i + 1 == n {
                self.shared.written.store(seq, Ordering::Release);
            }
            file.sync()?;
            self.shared.fsyncs.fetch_add(1, Ordering::Relaxed);
            if create.is_some() {
                // The prepared file takes the segment's name only once its header and first
                // records are durable, and only once every earlier segment is complete on disk
                // (the previous run was synced above): a crash never leaves a segment with a
                // torn header, nor a hole in a segment that is not the newest.
                self.vfs.rename(
                    &self.dir.join(spare_file_name(segment)),
                    &self.dir.join(segment_file_name(segment)),
                )?;
                self.dir_handle.sync()?;
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
