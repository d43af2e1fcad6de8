//! The on-disk format of the log: segment headers, commit blocks and record frames.
//!
//! A segment file starts with a 40-byte header:
//!
//! | bytes | field |
//! |---|---|
//! | 0..8 | magic `TWICELOG` |
//! | 8..12 | format version, little-endian `u32` (currently 3; 2 is still read) |
//! | 12..16 | CRC-32 of the other 36 header bytes |
//! | 16..24 | segment id, little-endian `u64` |
//! | 24..28 | salt: random, drawn when the segment is created |
//! | 28..32 | reserved, zero |
//! | 32..40 | the lowest commit number a block of this segment may carry |
//!
//! Then commit blocks follow back to back. Each is what one commit put in this segment: a
//! 32-byte block header, then its records.
//!
//! | bytes | field |
//! |---|---|
//! | 0..4 | magic `TWCB` |
//! | 4..8 | salted CRC-32 of the other 28 header bytes |
//! | 8..16 | body length: the bytes of the records that follow |
//! | 16..24 | commit number; the blocks of a segment carry consecutive numbers |
//! | 24..32 | watermark: every commit up to this number was durable when this one was written |
//!
//! Each record is framed as `[len u32 LE][crc u32 LE][payload]`, where `crc` is the salted
//! CRC-32 of the four length bytes followed by the payload.
//!
//! Every checksum starts from the segment's salt, which never leaves the disk: bytes a client
//! chose (a message body that holds a well-formed frame or block) never pass for the log's
//! own. A block is complete when its header checks and its records exactly fill its body; the
//! watermark tells recovery whether damage can be a torn write (only the newest commits, not
//! yet durable when a later complete block was written, can be torn).
//!
//! The commit that starts a segment writes a block (empty if it has no records there) both to
//! the segment it closes and to the one it starts, whose header names it as the first commit.
//! The new segment takes its name only once the one it closes is durable, so every closed
//! segment ends with a block of the commit its successor names first: a closed segment cut at
//! a block boundary, which its own scan cannot see, is told by that (version 3). Version 2
//! wrote those blocks only when the commit had records there, so its closed segments end at
//! least at the commit before.

use super::StorageError;

/// The first bytes of every segment file.
pub(crate) const MAGIC: [u8; 8] = *b"TWICELOG";
/// The first bytes of every commit block.
pub(crate) const BLOCK_MAGIC: [u8; 4] = *b"TWCB";
/// The format version this build writes.
pub(crate) const VERSION: u32 = 3;
/// The oldest format version this build reads.
pub(crate) const OLDEST_VERSION: u32 = 2;
/// The size of a segment header.
pub(crate) const HEADER_LEN: u64 = 40;
/// The size of a commit block header.
pub(crate) const BLOCK_LEN: u64 = 32;
/// The size of a record frame header (`len` + `crc`).
pub(crate) const FRAME_LEN: u64 = 8;
/// The largest payload one record may carry. A length field above it is corruption.
pub(crate) const MAX_RECORD_LEN: u32 = 64 << 20;

/// What a segment header says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SegmentHeader {
    /// The seed of every checksum in the segment.
    pub(crate) salt: u32,
    /// The lowest commit number a block of the segment may carry.
    pub(crate) first_seq: u64,
    /// The format version it was written in.
    pub(crate) version: u32,
}

impl SegmentHeader {
    /// A header this build writes.
    pub(crate) fn new(salt: u32, first_seq: u64) -> Self {
        Self { salt, first_seq, version: VERSION }
    }

    /// The first commit whose block a closed segment must hold, when the segment after it
    /// has this header: the commit that started that one (see the module's text).
    pub(crate) fn predecessor_ends_at(&self) -> u64 {
        if self.version >= 3 { self.first_seq } else { self.first_seq.saturating_sub(1) }
    }

    /// The header of segment `id`, in the version it names.
    pub(crate) fn encode(&self, id: u64) -> [u8; 40] {
        let mut h = [0u8; 40];
        h[..8].copy_from_slice(&MAGIC);
        h[8..12].copy_from_slice(&self.version.to_le_bytes());
        h[16..24].copy_from_slice(&id.to_le_bytes());
        h[24..28].copy_from_slice(&self.salt.to_le_bytes());
        h[32..40].copy_from_slice(&self.first_seq.to_le_bytes());
        let crc = header_crc(&h);
        h[12..16].copy_from_slice(&crc.to_le_bytes());
        h
    }

    /// Checks a header read from the file of segment `id`.
    pub(crate) fn decode(id: u64, h: &[u8]) -> Result<SegmentHeader, StorageError> {
        let corrupt = StorageError::Corrupt { segment: id, offset: 0 };
        let Ok(h) = <&[u8; 40]>::try_from(h) else { return Err(corrupt) };
        if h[..8] != MAGIC {
            return Err(corrupt);
        }
        let version = u32_at(h, 8);
        if !(OLDEST_VERSION..=VERSION).contains(&version) {
            return Err(StorageError::UnsupportedVersion { segment: id, version });
        }
        if u32_at(h, 12) != header_crc(h) || u64_at(h, 16) != id || h[28..32] != [0; 4] {
            return Err(corrupt);
        }
        Ok(SegmentHeader { salt: u32_at(h, 24), first_seq: u64_at(h, 32), version })
    }
}

fn header_crc(h: &[u8; 40]) -> u32 {
    let mut c = crc32fast::Hasher::new();
    c.update(&h[..12]);
    c.update(&h[16..]);
    c.finalize()
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    let mut raw = [0u8; 4];
    raw.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(raw)
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut raw = [0u8; 8];
    raw.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(raw)
}

/// A checksum that starts from a segment's salt.
pub(crate) fn salted(salt: u32) -> crc32fast::Hasher {
    crc32fast::Hasher::new_with_initial(salt)
}

/// The checksum of a record: salted CRC-32 over the length bytes and the payload.
pub(crate) fn frame_crc(salt: u32, len: u32, payload: &[u8]) -> u32 {
    let mut h = salted(salt);
    h.update(&len.to_le_bytes());
    h.update(payload);
    h.finalize()
}

/// Splits a frame header into its length and checksum.
pub(crate) fn frame_header(b: &[u8; 8]) -> (u32, u32) {
    (u32_at(b, 0), u32_at(b, 4))
}

/// A commit block header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Block {
    /// The bytes of the records after the header.
    pub(crate) body_len: u64,
    /// The commit number.
    pub(crate) seq: u64,
    /// Every commit up to this one was durable when this block was written.
    pub(crate) watermark: u64,
}

impl Block {
    /// The header's bytes, with a checksum from `salt`.
    pub(crate) fn encode(&self, salt: u32) -> [u8; 32] {
        let mut h = [0u8; 32];
        h[..4].copy_from_slice(&BLOCK_MAGIC);
        h[8..16].copy_from_slice(&self.body_len.to_le_bytes());
        h[16..24].copy_from_slice(&self.seq.to_le_bytes());
        h[24..32].copy_from_slice(&self.watermark.to_le_bytes());
        let crc = block_crc(salt, &h);
        h[4..8].copy_from_slice(&crc.to_le_bytes());
        h
    }

    /// Parses a block header; `None` unless its magic and salted checksum hold.
    pub(crate) fn decode(salt: u32, h: &[u8]) -> Option<Block> {
        let h = <&[u8; 32]>::try_from(h).ok()?;
        if h[..4] != BLOCK_MAGIC || u32_at(h, 4) != block_crc(salt, h) {
            return None;
        }
        Some(Block { body_len: u64_at(h, 8), seq: u64_at(h, 16), watermark: u64_at(h, 24) })
    }
}

fn block_crc(salt: u32, h: &[u8; 32]) -> u32 {
    let mut c = salted(salt);
    c.update(&h[..4]);
    c.update(&h[8..]);
    c.finalize()
}

/// The records of a block body, as `(offset in body, payload length)`, if they exactly fill
/// it and every checksum holds; else the offset in the body of the first record that fails.
pub(crate) fn body_records(salt: u32, body: &[u8]) -> Result<Vec<(usize, u32)>, usize> {
    let mut out = Vec::new();
    let mut pos = 0;
    while pos < body.len() {
        let Some(head) = body.get(pos..pos + 8) else { return Err(pos) };
        let mut h = [0u8; 8];
        h.copy_from_slice(head);
        let (len, crc) = frame_header(&h);
        let end = usize::try_from(len).ok().filter(|_| len <= MAX_RECORD_LEN).map(|l| pos + 8 + l);
        let Some(payload) = end.and_then(|end| body.get(pos + 8..end)) else { return Err(pos) };
        if frame_crc(salt, len, payload) != crc {
            return Err(pos);
        }
        out.push((pos, len));
        pos += 8 + payload.len();
    }
    Ok(out)
}

/// The file name of segment `id`.
pub(crate) fn segment_file_name(id: u64) -> String {
    format!("{id:020}.seg")
}

/// The file name of the file prepared to become segment `id`.
pub(crate) fn spare_file_name(id: u64) -> String {
    format!("{id:020}.spare")
}

/// The segment id of a file name, if it names a segment.
pub(crate) fn parse_segment_file_name(name: &str) -> Option<u64> {
    parse_id(name.strip_suffix(".seg")?)
}

/// Whether a file name names a prepared, unused segment file.
pub(crate) fn is_spare_file_name(name: &str) -> bool {
    name.strip_suffix(".spare").and_then(parse_id).is_some()
}

fn parse_id(digits: &str) -> Option<u64> {
    if digits.len() != 20 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn encode_frame(buf: &mut Vec<u8>, salt: u32, payload: &[u8]) {
        let len = u32::try_from(payload.len()).unwrap();
        buf.extend_from_slice(&len.to_le_bytes());
        buf.extend_from_slice(&frame_crc(salt, len, payload).to_le_bytes());
        buf.extend_from_slice(payload);
    }

    #[test]
    fn bodies_round_trip_and_detect_damage() {
        let mut buf = Vec::new();
        encode_frame(&mut buf, 7, b"hello");
        encode_frame(&mut buf, 7, b"");
        encode_frame(&mut buf, 7, b"world!");
        assert_eq!(body_records(7, &buf), Ok(vec![(0, 5), (13, 0), (21, 6)]));
        // Another segment's salt makes every checksum fail.
        assert_eq!(body_records(8, &buf), Err(0));
        for cut in 1..buf.len() {
            if cut != 13 && cut != 21 {
                let first_bad = [0, 13, 21].into_iter().rfind(|&s| s < cut).unwrap();
                assert_eq!(body_records(7, &buf[..cut]), Err(first_bad), "cut at {cut}");
            }
        }
        for byte in 0..buf.len() {
            for bit in 0..8 {
                let mut b = buf.clone();
                b[byte] ^= 1 << bit;
                assert!(body_records(7, &b).is_err(), "flip {byte}.{bit}");
            }
        }
    }

    #[test]
    fn block_headers_check_their_salt() {
        let b = Block { body_len: 100, seq: 5, watermark: 3 };
        let h = b.encode(42);
        assert_eq!(Block::decode(42, &h), Some(b));
        assert_eq!(Block::decode(43, &h), None);
        for byte in 0..32 {
            let mut d = h;
            d[byte] ^= 4;
            assert_eq!(Block::decode(42, &d), None, "flip in byte {byte}");
        }
    }

    #[test]
    fn segment_names() {
        assert_eq!(segment_file_name(7), "00000000000000000007.seg");
        assert_eq!(parse_segment_file_name("00000000000000000007.seg"), Some(7));
        assert_eq!(parse_segment_file_name("7.seg"), None);
        assert_eq!(parse_segment_file_name("LOCK"), None);
        assert!(is_spare_file_name(&spare_file_name(9)));
        assert!(!is_spare_file_name(&segment_file_name(9)));
    }

    #[test]
    fn headers() {
        let sh = SegmentHeader::new(99, 12);
        let h = sh.encode(3);
        assert_eq!(SegmentHeader::decode(3, &h).unwrap(), sh);
        let v2 = SegmentHeader { version: 2, ..sh };
        assert_eq!(SegmentHeader::decode(3, &v2.encode(3)).unwrap(), v2);
        assert_eq!(sh.predecessor_ends_at(), 12);
        assert_eq!(v2.predecessor_ends_at(), 11);
        assert!(matches!(
            SegmentHeader::decode(4, &h),
            Err(StorageError::Corrupt { segment: 4, offset: 0 })
        ));
        let mut v1 = h;
        v1[8] = 1;
        assert!(matches!(
            SegmentHeader::decode(3, &v1),
            Err(StorageError::UnsupportedVersion { segment: 3, version: 1 })
        ));
        // The salt is covered: a flipped salt would otherwise fail every record after it.
        for byte in (12..40).filter(|b| !(28..32).contains(b)) {
            let mut s = h;
            s[byte] ^= 1;
            assert!(
                matches!(SegmentHeader::decode(3, &s), Err(StorageError::Corrupt { .. })),
                "flip in byte {byte}"
            );
        }
    }
}
