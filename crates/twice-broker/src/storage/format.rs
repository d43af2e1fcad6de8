//! The on-disk format of the log: segment headers and record frames.
//!
//! A segment file starts with a 24-byte header:
//!
//! | bytes | field |
//! |---|---|
//! | 0..8 | magic `TWICELOG` |
//! | 8..12 | format version, little-endian `u32` (currently 1) |
//! | 12..16 | reserved, zero |
//! | 16..24 | segment id, little-endian `u64` |
//!
//! Then records follow back to back, each framed as `[len u32 LE][crc u32 LE][payload]`, where
//! `crc` is the CRC-32 (IEEE) of the four length bytes followed by the payload. Covering the
//! length means a zero-filled or garbled header never passes as a record.

use super::StorageError;

/// The first bytes of every segment file.
pub(crate) const MAGIC: [u8; 8] = *b"TWICELOG";
/// The format version this build writes and reads.
pub(crate) const VERSION: u32 = 1;
/// The size of a segment header.
pub(crate) const HEADER_LEN: u64 = 24;
/// The size of a record frame header (`len` + `crc`).
pub(crate) const FRAME_LEN: u64 = 8;
/// The largest payload one record may carry. A length field above it is corruption.
pub(crate) const MAX_RECORD_LEN: u32 = 64 << 20;

/// The header of segment `id`.
pub(crate) fn segment_header(id: u64) -> [u8; 24] {
    let mut h = [0u8; 24];
    h[..8].copy_from_slice(&MAGIC);
    h[8..12].copy_from_slice(&VERSION.to_le_bytes());
    h[16..24].copy_from_slice(&id.to_le_bytes());
    h
}

/// Checks a segment header read from the file of segment `id`.
pub(crate) fn check_header(id: u64, h: &[u8]) -> Result<(), StorageError> {
    if h.len() < 24 || h[..8] != MAGIC || h[12..16] != [0; 4] {
        return Err(StorageError::Corrupt { segment: id, offset: 0 });
    }
    let version = u32::from_le_bytes([h[8], h[9], h[10], h[11]]);
    if version != VERSION {
        return Err(StorageError::UnsupportedVersion { segment: id, version });
    }
    let mut raw = [0u8; 8];
    raw.copy_from_slice(&h[16..24]);
    if u64::from_le_bytes(raw) != id {
        return Err(StorageError::Corrupt { segment: id, offset: 0 });
    }
    Ok(())
}

/// The checksum of a record: CRC-32 over the length bytes and the payload.
pub(crate) fn frame_crc(len: u32, payload: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    h.update(&len.to_le_bytes());
    h.update(payload);
    h.finalize()
}

/// Appends the frame of `payload` to `buf`. The caller has checked the length.
#[cfg(test)]
pub(crate) fn encode_frame(buf: &mut Vec<u8>, len: u32, payload: &[u8]) {
    buf.reserve(payload.len() + 8);
    buf.extend_from_slice(&len.to_le_bytes());
    buf.extend_from_slice(&frame_crc(len, payload).to_le_bytes());
    buf.extend_from_slice(payload);
}

/// Splits a frame header into its length and checksum.
pub(crate) fn frame_header(b: &[u8; 8]) -> (u32, u32) {
    (u32::from_le_bytes([b[0], b[1], b[2], b[3]]), u32::from_le_bytes([b[4], b[5], b[6], b[7]]))
}

/// What lies at one position of a segment held in memory.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Frame {
    /// A valid record whose payload is `buf[pos + 8 .. pos + 8 + len]`.
    Valid {
        /// The payload length.
        len: u32,
    },
    /// A record whose frame or payload runs past the end of the data.
    Incomplete,
    /// Bytes that are not a valid record.
    Bad,
}

/// Parses the frame at `pos` in `buf`.
pub(crate) fn parse_frame(buf: &[u8], pos: usize) -> Frame {
    let Some(head) = buf.get(pos..pos + 8) else {
        return Frame::Incomplete;
    };
    let mut h = [0u8; 8];
    h.copy_from_slice(head);
    let (len, crc) = frame_header(&h);
    if len > MAX_RECORD_LEN {
        return Frame::Bad;
    }
    let Some(payload) = usize::try_from(len).ok().and_then(|l| buf.get(pos + 8..pos + 8 + l))
    else {
        return Frame::Incomplete;
    };
    if frame_crc(len, payload) == crc { Frame::Valid { len } } else { Frame::Bad }
}

/// Whether any valid record starts at or after `from` in `buf`.
///
/// Used only on a damaged tail, to tell a torn write (nothing valid follows: truncate) from
/// corruption in the middle of acknowledged data (something valid follows: refuse to open).
pub(crate) fn any_valid_after(buf: &[u8], from: usize) -> bool {
    (from..buf.len().saturating_sub(7))
        .any(|pos| matches!(parse_frame(buf, pos), Frame::Valid { .. }))
}

/// The file name of segment `id`.
pub(crate) fn segment_file_name(id: u64) -> String {
    format!("{id:020}.seg")
}

/// The segment id of a file name, if it names a segment.
pub(crate) fn parse_segment_file_name(name: &str) -> Option<u64> {
    let digits = name.strip_suffix(".seg")?;
    if digits.len() != 20 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_and_detect_damage() {
        let mut buf = Vec::new();
        encode_frame(&mut buf, 5, b"hello");
        assert_eq!(parse_frame(&buf, 0), Frame::Valid { len: 5 });
        for cut in 0..buf.len() {
            assert_eq!(parse_frame(&buf[..cut], 0), Frame::Incomplete, "cut at {cut}");
        }
        for byte in 0..buf.len() {
            for bit in 0..8 {
                let mut b = buf.clone();
                b[byte] ^= 1 << bit;
                assert_ne!(parse_frame(&b, 0), Frame::Valid { len: 5 }, "flip {byte}.{bit}");
            }
        }
        assert_eq!(parse_frame(&[0u8; 64], 0), Frame::Bad);
    }

    #[test]
    fn segment_names() {
        assert_eq!(segment_file_name(7), "00000000000000000007.seg");
        assert_eq!(parse_segment_file_name("00000000000000000007.seg"), Some(7));
        assert_eq!(parse_segment_file_name("7.seg"), None);
        assert_eq!(parse_segment_file_name("LOCK"), None);
    }

    #[test]
    fn headers() {
        let h = segment_header(3);
        check_header(3, &h).unwrap();
        assert!(matches!(
            check_header(4, &h),
            Err(StorageError::Corrupt { segment: 4, offset: 0 })
        ));
        let mut v2 = h;
        v2[8] = 2;
        assert!(matches!(
            check_header(3, &v2),
            Err(StorageError::UnsupportedVersion { segment: 3, version: 2 })
        ));
    }
}
