//! A file system in memory that fails the way disks and crashes do, for tests.
//!
//! Each file keeps two contents: what the process sees (the page cache) and what is on the
//! disk. Writes change the first; a successful sync copies every write made since the last one
//! to the disk. A failed sync drops those writes from the disk's future for good, as Linux
//! does after a failed `fsync` (the pages are marked clean): a later sync that succeeds does not
//! bring them back. Directory changes (create, rename, remove) are on the disk only once the
//! directory is synced.
//!
//! A [`Plan`] chooses, by the count of operations, when the process is killed (every operation
//! after fails, nothing more changes) and when writes or syncs start failing with `ENOSPC` or
//! `EIO`. [`FaultFs::crash`] then gives the file system the next process finds: after a kill,
//! what the page cache held; after a power loss, the disk, with none, a prefix, or random
//! 4 KiB pages of what was written since the last sync.

use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use super::vfs::{OpenMode, VFile, Vfs};

/// A small seeded generator (SplitMix64): the same seed gives the same faults.
#[derive(Clone, Debug)]
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A number in `0..n` (`n` > 0).
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }

    /// An index in `0..n` (`n` > 0).
    pub(crate) fn index(&mut self, n: usize) -> usize {
        usize::try_from(self.below(n as u64)).unwrap_or(0)
    }

    pub(crate) fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

/// How writes or syncs fail.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Failure {
    /// Writes fail with `ENOSPC` (a prefix of the failing write may land).
    NoSpaceOnWrite,
    /// Writes fail with `EIO`.
    IoErrorOnWrite,
    /// Syncs fail with `EIO`, and the writes they should have made durable are lost.
    IoErrorOnSync,
}

/// When things go wrong, counted in mutating operations (create, write, sync, set_len, rename,
/// remove).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Plan {
    /// The process dies at this operation: it does not happen (a write may land in part).
    pub(crate) kill_at: Option<u64>,
    /// The process dies at the n-th operation of this kind (`write`, `sync`, `create`,
    /// `rename`, `remove`, `truncate`), counted from when the plan is made.
    pub(crate) kill_on: Option<(&'static str, u64)>,
    /// From this operation on, every operation of the kind fails.
    pub(crate) fail_from: Option<(u64, Failure)>,
}

/// What survives a crash.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Crash {
    /// The process died; the kernel kept everything it was given.
    Kill,
    /// Power loss: only what was synced survives.
    PowerLossDropAll,
    /// Power loss: of the writes since the last sync, a prefix survives (the last in part).
    PowerLossPrefix,
    /// Power loss: random sectors (512 bytes) or pages (4 KiB) of what was written since the
    /// last sync survive.
    PowerLossPages,
}

impl Crash {
    /// One of the four, at random.
    pub(crate) fn random(rng: &mut Rng) -> Crash {
        match rng.below(4) {
            0 => Crash::Kill,
            1 => Crash::PowerLossDropAll,
            2 => Crash::PowerLossPrefix,
            _ => Crash::PowerLossPages,
        }
    }
}

impl Failure {
    /// One of the three, or (one time in `1 + none`) none: a kill is planned instead.
    pub(crate) fn random(rng: &mut Rng, none: u64) -> Option<Failure> {
        match rng.below(3 + none) {
            0 => Some(Failure::NoSpaceOnWrite),
            1 => Some(Failure::IoErrorOnWrite),
            2 => Some(Failure::IoErrorOnSync),
            _ => None,
        }
    }
}

#[derive(Clone, Debug)]
enum Change {
    Write { offset: u64, data: Vec<u8> },
    SetLen(u64),
}

#[derive(Clone, Debug, Default)]
struct Inode {
    /// What reads see.
    data: Vec<u8>,
    /// What is on the disk.
    disk: Vec<u8>,
    /// Changes since the last sync, oldest first.
    unsynced: Vec<Change>,
}

fn apply(buf: &mut Vec<u8>, change: &Change) {
    match change {
        Change::Write { offset, data } => {
            let start = usize::try_from(*offset).unwrap_or(usize::MAX);
            let end = start + data.len();
            if buf.len() < end {
                buf.resize(end, 0);
            }
            buf[start..end].copy_from_slice(data);
        }
        Change::SetLen(len) => buf.resize(usize::try_from(*len).unwrap_or(0), 0),
    }
}

#[derive(Clone, Debug)]
enum DirOp {
    Link(PathBuf, usize),
    Unlink(PathBuf),
}

#[derive(Debug, Default)]
struct State {
    inodes: Vec<Inode>,
    /// The names the process sees.
    names: BTreeMap<PathBuf, usize>,
    /// The names on the disk.
    disk_names: BTreeMap<PathBuf, usize>,
    /// Directory changes since the last directory sync.
    unsynced_dirs: Vec<DirOp>,
    locked: HashSet<PathBuf>,
    plan: Plan,
    /// Mutating operations so far.
    ops: u64,
    dead: bool,
    /// The kind of operation the planned kill stopped.
    killed_at: Option<&'static str>,
    /// Mutating operations so far, by kind.
    kinds: BTreeMap<&'static str, u64>,
    rng: Option<Rng>,
}

impl State {
    /// Counts a mutating operation; fails it if the process is dead or dies now.
    fn step(&mut self, kind: &'static str) -> io::Result<u64> {
        match self.step_or_die(kind) {
            Step::Go => Ok(self.ops),
            Step::DiesNow | Step::Dead => Err(killed()),
        }
    }

    fn step_or_die(&mut self, kind: &'static str) -> Step {
        if self.dead {
            return Step::Dead;
        }
        self.ops += 1;
        let n = self.kinds.entry(kind).or_default();
        *n += 1;
        if self.plan.kill_at == Some(self.ops) || self.plan.kill_on == Some((kind, *n)) {
            self.dead = true;
            self.killed_at = Some(kind);
            return Step::DiesNow;
        }
        Step::Go
    }

    fn failing(&self, kinds: &[Failure]) -> Option<Failure> {
        match self.plan.fail_from {
            Some((from, f)) if self.ops >= from && kinds.contains(&f) => Some(f),
            _ => None,
        }
    }

    fn link(&mut self, path: &Path, ino: usize) {
        self.names.insert(path.to_owned(), ino);
        self.unsynced_dirs.push(DirOp::Link(path.to_owned(), ino));
    }

    fn unlink(&mut self, path: &Path) -> Option<usize> {
        let ino = self.names.remove(path)?;
        self.unsynced_dirs.push(DirOp::Unlink(path.to_owned()));
        Some(ino)
    }

    fn rng(&mut self) -> &mut Rng {
        self.rng.get_or_insert_with(|| Rng::new(0))
    }
}

enum Step {
    Go,
    DiesNow,
    Dead,
}

fn killed() -> io::Error {
    io::Error::other("the process was killed (fault injection)")
}

fn not_found() -> io::Error {
    io::ErrorKind::NotFound.into()
}

/// The fault-injecting file system. Cheap to clone; clones share the state.
#[derive(Clone, Default)]
pub(crate) struct FaultFs {
    state: Arc<Mutex<State>>,
}

impl fmt::Debug for FaultFs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FaultFs").finish_non_exhaustive()
    }
}

impl FaultFs {
    /// An empty file system that follows `plan`, drawing its random choices from `seed`.
    pub(crate) fn new(plan: Plan, seed: u64) -> Self {
        let fs = Self::default();
        {
            let mut s = fs.lock_state();
            s.plan = plan;
            s.rng = Some(Rng::new(seed));
        }
        fs
    }

    fn lock_state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The kind of operation (`write`, `sync`, `create`, `rename`, `remove`, `truncate`) the
    /// planned kill stopped, if it happened.
    pub(crate) fn killed_at(&self) -> Option<&'static str> {
        self.lock_state().killed_at
    }

    /// Kills the process now: nothing it does from now on reaches the file system.
    pub(crate) fn kill(&self) {
        self.lock_state().dead = true;
    }

    /// The file system the next process finds after `crash`, with no faults planned. Every
    /// lock is released (the process that held them is gone).
    pub(crate) fn crash(&self, crash: Crash) -> FaultFs {
        let mut s = self.lock_state();
        s.dead = true;
        let mut rng = s.rng().clone();
        let mut next = State { rng: Some(Rng::new(rng.next_u64())), ..State::default() };
        // The names: all of them, or a prefix of the changes since the last directory sync.
        let mut names = s.disk_names.clone();
        let keep = match crash {
            Crash::Kill => s.unsynced_dirs.len(),
            Crash::PowerLossDropAll => 0,
            Crash::PowerLossPrefix | Crash::PowerLossPages => rng.index(s.unsynced_dirs.len() + 1),
        };
        for op in &s.unsynced_dirs[..keep] {
            match op {
                DirOp::Link(p, ino) => {
                    names.insert(p.clone(), *ino);
                }
                DirOp::Unlink(p) => {
                    names.remove(p);
                }
            }
        }
        let mut map = BTreeMap::new();
        for (path, ino) in names {
            let old = &s.inodes[ino];
            let data = match crash {
                Crash::Kill => old.data.clone(),
                Crash::PowerLossDropAll => old.disk.clone(),
                Crash::PowerLossPrefix => {
                    let mut d = old.disk.clone();
                    let n = rng.index(old.unsynced.len() + 1);
                    for c in &old.unsynced[..n] {
                        apply(&mut d, c);
                    }
                    if let Some(Change::Write { offset, data }) = old.unsynced.get(n) {
                        let part = rng.index(data.len() + 1);
                        apply(
                            &mut d,
                            &Change::Write { offset: *offset, data: data[..part].to_vec() },
                        );
                    }
                    d
                }
                Crash::PowerLossPages => {
                    let mut full = old.disk.clone();
                    for c in &old.unsynced {
                        apply(&mut full, c);
                    }
                    let mut d = old.disk.clone();
                    let len = if rng.chance(50) { full.len() } else { d.len().max(full.len()) };
                    d.resize(len, 0);
                    // Disks write whole sectors, not always in order; the page cache writes
                    // back whole pages.
                    let page_size = if rng.chance(50) { 512 } else { 4096 };
                    for (i, page) in full.chunks(page_size).enumerate() {
                        let at = i * page_size;
                        if d.get(at..at + page.len()) != Some(page) && rng.chance(50) {
                            d[at..at + page.len()].copy_from_slice(page);
                        }
                    }
                    d.truncate(len);
                    d
                }
            };
            let ino = *map.entry(ino).or_insert_with(|| {
                next.inodes.push(Inode { data: data.clone(), disk: data, unsynced: Vec::new() });
                next.inodes.len() - 1
            });
            next.names.insert(path.clone(), ino);
            next.disk_names.insert(path, ino);
        }
        if crash == Crash::Kill {
            // The kernel still holds what was not synced: a later power loss may take it.
            for (old, new) in &map {
                let o = &s.inodes[*old];
                next.inodes[*new].disk.clone_from(&o.disk);
                next.inodes[*new].unsynced.clone_from(&o.unsynced);
            }
            next.disk_names.clone_from(&s.disk_names);
            next.unsynced_dirs.clone_from(&s.unsynced_dirs);
            // The inode numbers of the pending directory changes refer to the old table.
            next.unsynced_dirs.retain(|op| match op {
                DirOp::Link(_, ino) => map.contains_key(ino),
                DirOp::Unlink(_) => true,
            });
            for op in &mut next.unsynced_dirs {
                if let DirOp::Link(_, ino) = op {
                    *ino = map[ino];
                }
            }
            next.disk_names = next
                .disk_names
                .into_iter()
                .filter_map(|(p, ino)| map.get(&ino).map(|&n| (p, n)))
                .collect();
        }
        FaultFs { state: Arc::new(Mutex::new(next)) }
    }

    /// Plans faults on this file system from now on (counting from its current operation).
    pub(crate) fn plan(&self, plan: Plan) {
        let mut s = self.lock_state();
        let base = s.ops;
        let kill_on =
            plan.kill_on.map(|(kind, n)| (kind, n + s.kinds.get(kind).copied().unwrap_or(0)));
        s.plan = Plan {
            kill_at: plan.kill_at.map(|k| k + base),
            kill_on,
            fail_from: plan.fail_from.map(|(k, f)| (k + base, f)),
        };
    }

    /// The content of a file as the process sees it.
    pub(crate) fn read_file(&self, path: &Path) -> Option<Vec<u8>> {
        let s = self.lock_state();
        s.names.get(path).map(|&ino| s.inodes[ino].data.clone())
    }

    /// Replaces the content of a file (durably), creating it if needed: damage from outside.
    pub(crate) fn write_file(&self, path: &Path, data: Vec<u8>) {
        let mut s = self.lock_state();
        let ino = match s.names.get(path) {
            Some(&ino) => ino,
            None => {
                s.inodes.push(Inode::default());
                let ino = s.inodes.len() - 1;
                s.names.insert(path.to_owned(), ino);
                s.disk_names.insert(path.to_owned(), ino);
                ino
            }
        };
        s.inodes[ino] = Inode { data: data.clone(), disk: data, unsynced: Vec::new() };
    }
}

#[derive(Debug)]
struct FaultFile {
    fs: FaultFs,
    ino: usize,
    /// A directory handle: only `sync` applies.
    dir: bool,
    writable: bool,
}

impl Vfs for FaultFs {
    fn create_dir_all(&self, _: &Path) -> io::Result<()> {
        // Directories are implicit: a file's name holds its directory.
        if self.lock_state().dead { Err(killed()) } else { Ok(()) }
    }

    fn lock(&self, dir: &Path) -> io::Result<Option<Box<dyn fmt::Debug + Send + Sync>>> {
        let mut s = self.lock_state();
        if s.dead {
            return Err(killed());
        }
        if !s.locked.insert(dir.to_owned()) {
            return Ok(None);
        }
        Ok(Some(Box::new(DirLock { fs: self.clone(), dir: dir.to_owned() })))
    }

    fn list(&self, dir: &Path) -> io::Result<Vec<String>> {
        let s = self.lock_state();
        if s.dead {
            return Err(killed());
        }
        Ok(s.names
            .keys()
            .filter(|p| p.parent() == Some(dir))
            .filter_map(|p| p.file_name()?.to_str().map(str::to_owned))
            .collect())
    }

    fn open(&self, path: &Path, mode: OpenMode) -> io::Result<Arc<dyn VFile>> {
        let mut s = self.lock_state();
        let ino = match mode {
            OpenMode::Read | OpenMode::ReadWrite => {
                if s.dead {
                    return Err(killed());
                }
                *s.names.get(path).ok_or_else(not_found)?
            }
            OpenMode::Create => {
                s.step("create")?;
                if s.failing(&[Failure::NoSpaceOnWrite]).is_some() {
                    return Err(io::Error::from_raw_os_error(28));
                }
                // A new inode takes the name; one that had it lives on in open handles.
                s.inodes.push(Inode::default());
                let ino = s.inodes.len() - 1;
                s.link(path, ino);
                ino
            }
        };
        Ok(Arc::new(FaultFile {
            fs: self.clone(),
            ino,
            dir: false,
            writable: mode != OpenMode::Read,
        }))
    }

    fn open_dir(&self, _: &Path) -> io::Result<Arc<dyn VFile>> {
        if self.lock_state().dead {
            return Err(killed());
        }
        Ok(Arc::new(FaultFile { fs: self.clone(), ino: 0, dir: true, writable: false }))
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        let mut s = self.lock_state();
        s.step("rename")?;
        let ino = s.unlink(from).ok_or_else(not_found)?;
        s.unlink(to);
        s.link(to, ino);
        Ok(())
    }

    fn remove(&self, path: &Path) -> io::Result<()> {
        let mut s = self.lock_state();
        s.step("remove")?;
        s.unlink(path).map(|_| ()).ok_or_else(not_found)
    }
}

#[derive(Debug)]
struct DirLock {
    fs: FaultFs,
    dir: PathBuf,
}

impl Drop for DirLock {
    fn drop(&mut self) {
        self.fs.lock_state().locked.remove(&self.dir);
    }
}

impl VFile for FaultFile {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        let s = self.fs.lock_state();
        if s.dead {
            return Err(killed());
        }
        if self.dir {
            return Err(io::ErrorKind::IsADirectory.into());
        }
        let data = &s.inodes[self.ino].data;
        let start = usize::try_from(offset).unwrap_or(usize::MAX).min(data.len());
        let n = buf.len().min(data.len() - start);
        buf[..n].copy_from_slice(&data[start..start + n]);
        Ok(n)
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        let mut guard = self.fs.lock_state();
        let s = &mut *guard;
        if self.dir || !self.writable {
            return Err(io::Error::from_raw_os_error(9));
        }
        match s.step_or_die("write") {
            Step::Go => {}
            Step::DiesNow => {
                // Killed in the middle of the write: a prefix of it reached the kernel.
                let part = s.rng().index(buf.len() + 1);
                let change = Change::Write { offset, data: buf[..part].to_vec() };
                let inode = &mut s.inodes[self.ino];
                apply(&mut inode.data, &change);
                inode.unsynced.push(change);
                return Err(killed());
            }
            Step::Dead => return Err(killed()),
        }
        match s.failing(&[Failure::NoSpaceOnWrite, Failure::IoErrorOnWrite]) {
            Some(Failure::NoSpaceOnWrite) => {
                let part = s.rng().index(buf.len() + 1);
                let change = Change::Write { offset, data: buf[..part].to_vec() };
                let inode = &mut s.inodes[self.ino];
                apply(&mut inode.data, &change);
                inode.unsynced.push(change);
                return Err(io::Error::from_raw_os_error(28));
            }
            Some(_) => return Err(io::Error::from_raw_os_error(5)),
            None => {}
        }
        let change = Change::Write { offset, data: buf.to_vec() };
        let inode = &mut s.inodes[self.ino];
        apply(&mut inode.data, &change);
        inode.unsynced.push(change);
        Ok(())
    }

    fn sync(&self) -> io::Result<()> {
        let mut s = self.fs.lock_state();
        s.step("sync")?;
        let failing = s.failing(&[Failure::IoErrorOnSync]).is_some();
        if self.dir {
            if failing {
                s.unsynced_dirs.clear();
                // The directory as the process sees it may never reach the disk; keep the
                // disk's names as they were.
                return Err(io::Error::from_raw_os_error(5));
            }
            let ops = std::mem::take(&mut s.unsynced_dirs);
            for op in ops {
                match op {
                    DirOp::Link(p, ino) => {
                        s.disk_names.insert(p, ino);
                    }
                    DirOp::Unlink(p) => {
                        s.disk_names.remove(&p);
                    }
                }
            }
            return Ok(());
        }
        let inode = &mut s.inodes[self.ino];
        let changes = std::mem::take(&mut inode.unsynced);
        if failing {
            // The kernel marks the pages clean and forgets the error: what they held never
            // reaches the disk, whatever a later sync says.
            return Err(io::Error::from_raw_os_error(5));
        }
        for c in &changes {
            apply(&mut inode.disk, c);
        }
        Ok(())
    }

    fn len(&self) -> io::Result<u64> {
        let s = self.fs.lock_state();
        if s.dead {
            return Err(killed());
        }
        Ok(s.inodes.get(self.ino).map_or(0, |i| i.data.len() as u64))
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        let mut s = self.fs.lock_state();
        s.step("truncate")?;
        let change = Change::SetLen(len);
        let inode = &mut s.inodes[self.ino];
        apply(&mut inode.data, &change);
        inode.unsynced.push(change);
        Ok(())
    }
}
