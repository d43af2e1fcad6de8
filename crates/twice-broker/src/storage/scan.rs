//! Reading a segment block by block, and telling a torn tail from damage.
//!
//! Used by [`super::Log::open`] (recovery of the newest segment), by the replay, and by the
//! data tool.

use std::io::{self, BufReader, Read};
use std::sync::Arc;

use bytes::Bytes;

use super::StorageError;
use super::format::{BLOCK_LEN, BLOCK_MAGIC, Block, HEADER_LEN, SegmentHeader, body_records};
use super::vfs::{AtReader, VFile, read_exact_at};

/// One segment, read block by block from its start.
#[derive(Debug)]
pub(crate) struct SegmentScan {
    pub(crate) id: u64,
    pub(crate) header: SegmentHeader,
    reader: BufReader<AtReader>,
    pos: u64,
    end: u64,
    /// The commit number of the last complete block read.
    prev: Option<u64>,
}

/// What comes next in a segment.
#[derive(Debug)]
pub(crate) enum Scanned {
    /// A complete block.
    Block {
        /// The offset of its header.
        offset: u64,
        /// Its body; the records are `(offset in body, payload length)`.
        body: Bytes,
        records: Vec<(usize, u32)>,
        /// Every commit up to this number was durable when the block was written.
        watermark: u64,
    },
    /// The end of the segment, right after a complete block (or the header).
    End,
    /// Something that is not a complete block.
    Damaged {
        /// The offset of the block that is not complete.
        block: u64,
        /// The offset of the first damaged byte range found: the block header, or the record
        /// in its body that fails.
        at: u64,
        /// The block's header, when it is intact.
        header: Option<Block>,
    },
}

impl SegmentScan {
    /// Starts reading segment `id` from `file`, whose first `end` bytes are to be read.
    pub(crate) fn open(file: Arc<dyn VFile>, id: u64, end: u64) -> Result<SegmentScan, ScanError> {
        if end < HEADER_LEN {
            return Err(StorageError::Corrupt { segment: id, offset: 0 }.into());
        }
        let mut h = [0u8; 40];
        read_exact_at(file.as_ref(), &mut h, 0)?;
        let header = SegmentHeader::decode(id, &h)?;
        let reader = BufReader::with_capacity(1 << 20, AtReader { file, pos: HEADER_LEN });
        Ok(SegmentScan { id, header, reader, pos: HEADER_LEN, end, prev: None })
    }

    /// Where the scan stops: the end of the segment's valid bytes.
    pub(crate) fn end(&self) -> u64 {
        self.end
    }

    /// The commit number of the last complete block read.
    pub(crate) fn last_seq(&self) -> Option<u64> {
        self.prev
    }

    /// Reads the next block. After [`Scanned::Damaged`] the scan is over.
    pub(crate) fn next_block(&mut self) -> io::Result<Scanned> {
        let offset = self.pos;
        if offset == self.end {
            return Ok(Scanned::End);
        }
        let damaged = |header| Scanned::Damaged { block: offset, at: offset, header };
        if self.end - offset < BLOCK_LEN {
            return Ok(damaged(None));
        }
        let mut h = [0u8; 32];
        self.reader.read_exact(&mut h)?;
        let Some(block) = Block::decode(self.header.salt, &h) else {
            return Ok(damaged(None));
        };
        let in_order = match self.prev {
            None => block.seq >= self.header.first_seq,
            Some(p) => Some(block.seq) == p.checked_add(1),
        };
        if !in_order {
            return Ok(damaged(None));
        }
        let left = self.end - offset - BLOCK_LEN;
        if block.body_len > left {
            // Cut short: the first record that does not fit (or fails) is where it breaks.
            let mut body = vec![0u8; usize::try_from(left).map_err(io::Error::other)?];
            self.reader.read_exact(&mut body)?;
            let bad = body_records(self.header.salt, &body).err().unwrap_or(body.len());
            let at = offset + BLOCK_LEN + bad as u64;
            return Ok(Scanned::Damaged { block: offset, at, header: Some(block) });
        }
        let len = usize::try_from(block.body_len).map_err(io::Error::other)?;
        let mut body = vec![0u8; len];
        self.reader.read_exact(&mut body)?;
        match body_records(self.header.salt, &body) {
            Ok(records) => {
                self.prev = Some(block.seq);
                self.pos = offset + BLOCK_LEN + block.body_len;
                let watermark = block.watermark;
                Ok(Scanned::Block { offset, body: Bytes::from(body), records, watermark })
            }
            Err(bad) => Ok(Scanned::Damaged {
                block: offset,
                at: offset + BLOCK_LEN + bad as u64,
                header: Some(block),
            }),
        }
    }

    /// The commit number the damaged block `header` belongs to, as far as it can be known:
    /// its own if its header is intact, else the one after the last complete block, else the
    /// lowest the segment may hold.
    pub(crate) fn damaged_seq(&self, header: Option<Block>) -> u64 {
        header.map(|b| b.seq).or_else(|| self.prev.map(|p| p + 1)).unwrap_or(self.header.first_seq)
    }
}

/// An error of a scan: a typed storage error or a failed read.
#[derive(Debug)]
pub(crate) enum ScanError {
    Storage(StorageError),
    Io(io::Error),
}

impl From<StorageError> for ScanError {
    fn from(e: StorageError) -> Self {
        Self::Storage(e)
    }
}

impl From<io::Error> for ScanError {
    fn from(e: io::Error) -> Self {
        Self::Io(e)
    }
}

/// Whether a complete block lies in `file` between `from` and `end` that was written when
/// commit `seq` was already durable. If one does, damage in commit `seq` cannot be a torn
/// write: that commit was acknowledged, and the log must refuse to open.
///
/// Any offset is tried, not only block boundaries (the damage hides where the next block
/// starts); a client cannot forge a block, because every checksum starts from the segment's
/// salt.
pub(crate) fn durable_block_after(
    file: &dyn VFile,
    salt: u32,
    from: u64,
    end: u64,
    seq: u64,
) -> io::Result<bool> {
    if end <= from {
        return Ok(false);
    }
    let mut buf = vec![0u8; usize::try_from(end - from).map_err(io::Error::other)?];
    read_exact_at(file, &mut buf, from)?;
    let header_len = usize::try_from(BLOCK_LEN).unwrap_or(32);
    let mut i = 0;
    while i + header_len <= buf.len() {
        let Some(found) = buf[i..].windows(4).position(|w| w == BLOCK_MAGIC) else { break };
        i += found;
        if let Some(block) = buf.get(i..i + header_len).and_then(|h| Block::decode(salt, h)) {
            let body_at = i + header_len;
            let body = usize::try_from(block.body_len)
                .ok()
                .and_then(|l| buf.get(body_at..body_at.checked_add(l)?));
            if block.watermark >= seq && body.is_some_and(|b| body_records(salt, b).is_ok()) {
                return Ok(true);
            }
        }
        i += 1;
    }
    Ok(false)
}
