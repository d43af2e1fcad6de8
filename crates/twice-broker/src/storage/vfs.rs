//! The file operations the log uses, behind a small trait.
//!
//! The real implementation, [`RealFs`], is the operating system's. Tests put a
//! fault-injecting one in its place (`storage::fault`) to lose power, fail writes and fsyncs,
//! and stop the process at any step, which cannot be done reliably with a real disk.

use std::fmt;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;

/// How a file is opened.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum OpenMode {
    /// An existing file, for reading.
    Read,
    /// An existing file, for reading and writing.
    ReadWrite,
    /// A new empty file for reading and writing, replacing any file of that name.
    Create,
}

/// A file system, as the log needs it.
pub(crate) trait Vfs: fmt::Debug + Send + Sync {
    /// Creates a directory and its parents.
    fn create_dir_all(&self, dir: &Path) -> io::Result<()>;
    /// Takes the exclusive lock of a directory for the life of the returned guard, or `None`
    /// when someone else holds it.
    fn lock(&self, dir: &Path) -> io::Result<Option<Box<dyn fmt::Debug + Send + Sync>>>;
    /// The names of the entries of a directory.
    fn list(&self, dir: &Path) -> io::Result<Vec<String>>;
    /// Opens a file.
    fn open(&self, path: &Path, mode: OpenMode) -> io::Result<Arc<dyn VFile>>;
    /// Opens a directory, to make its entries durable with [`VFile::sync`].
    fn open_dir(&self, dir: &Path) -> io::Result<Arc<dyn VFile>>;
    /// Renames a file, replacing any file of the new name.
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()>;
    /// Removes a file.
    fn remove(&self, path: &Path) -> io::Result<()>;
}

/// An open file.
pub(crate) trait VFile: fmt::Debug + Send + Sync {
    /// Reads at `offset`; returns how many bytes were read (0 at the end).
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize>;
    /// Writes all of `buf` at `offset`.
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()>;
    /// Makes the file's data durable (`fdatasync`; for a directory, `fsync`).
    fn sync(&self) -> io::Result<()>;
    /// The file's length.
    fn len(&self) -> io::Result<u64>;
    /// Cuts or extends the file to `len`.
    fn set_len(&self, len: u64) -> io::Result<()>;
}

/// Reads exactly `buf.len()` bytes at `offset`.
pub(crate) fn read_exact_at(f: &dyn VFile, mut buf: &mut [u8], mut offset: u64) -> io::Result<()> {
    while !buf.is_empty() {
        match f.read_at(buf, offset) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => {
                buf = &mut buf[n..];
                offset += n as u64;
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// A sequential reader over a [`VFile`], from a position.
#[derive(Debug)]
pub(crate) struct AtReader {
    pub(crate) file: Arc<dyn VFile>,
    pub(crate) pos: u64,
}

impl io::Read for AtReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.file.read_at(buf, self.pos)?;
        self.pos += n as u64;
        Ok(n)
    }
}

/// The operating system's file system.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct RealFs;

#[derive(Debug)]
struct RealFile(File);

impl VFile for RealFile {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        self.0.read_at(buf, offset)
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.0.write_all_at(buf, offset)
    }

    fn sync(&self) -> io::Result<()> {
        self.0.sync_data()
    }

    fn len(&self) -> io::Result<u64> {
        Ok(self.0.metadata()?.len())
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        self.0.set_len(len)
    }
}

#[derive(Debug)]
struct RealDir(File);

impl VFile for RealDir {
    fn read_at(&self, _: &mut [u8], _: u64) -> io::Result<usize> {
        Err(io::ErrorKind::IsADirectory.into())
    }

    fn write_at(&self, _: &[u8], _: u64) -> io::Result<()> {
        Err(io::ErrorKind::IsADirectory.into())
    }

    fn sync(&self) -> io::Result<()> {
        self.0.sync_all()
    }

    fn len(&self) -> io::Result<u64> {
        Ok(0)
    }

    fn set_len(&self, _: u64) -> io::Result<()> {
        Err(io::ErrorKind::IsADirectory.into())
    }
}

impl Vfs for RealFs {
    fn create_dir_all(&self, dir: &Path) -> io::Result<()> {
        std::fs::create_dir_all(dir)
    }

    fn lock(&self, dir: &Path) -> io::Result<Option<Box<dyn fmt::Debug + Send + Sync>>> {
        let f = OpenOptions::new()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .open(dir.join("LOCK"))?;
        match rustix::fs::flock(&f, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
            Ok(()) => {
                // The holder's process id, for `twice data check` to name: only a hint (the
                // lock is what counts), so a failure to write it changes nothing.
                let _ = f.set_len(0).and_then(|()| {
                    std::io::Write::write_all(
                        &mut &f,
                        format!("{}\n", std::process::id()).as_bytes(),
                    )
                });
                Ok(Some(Box::new(f)))
            }
            Err(e) if e == rustix::io::Errno::WOULDBLOCK => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    fn list(&self, dir: &Path) -> io::Result<Vec<String>> {
        let mut out = Vec::new();
        for entry in std::fs::read_dir(dir)? {
            if let Some(name) = entry?.file_name().to_str() {
                out.push(name.to_owned());
            }
        }
        Ok(out)
    }

    fn open(&self, path: &Path, mode: OpenMode) -> io::Result<Arc<dyn VFile>> {
        let mut o = OpenOptions::new();
        match mode {
            OpenMode::Read => o.read(true),
            OpenMode::ReadWrite => o.read(true).write(true),
            OpenMode::Create => o.read(true).write(true).create(true).truncate(true),
        };
        Ok(Arc::new(RealFile(o.open(path)?)))
    }

    fn open_dir(&self, dir: &Path) -> io::Result<Arc<dyn VFile>> {
        Ok(Arc::new(RealDir(File::open(dir)?)))
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        std::fs::rename(from, to)
    }

    fn remove(&self, path: &Path) -> io::Result<()> {
        std::fs::remove_file(path)
    }
}
