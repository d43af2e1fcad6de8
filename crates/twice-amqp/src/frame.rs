//! Frames: the 8-byte header, the body, and the protocol headers that open a connection.

use bytes::{Buf, Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt};

use crate::performative::Performative;

/// The protocol header of plain AMQP.
pub const AMQP_HEADER: [u8; 8] = *b"AMQP\x00\x01\x00\x00";
/// The protocol header that starts SASL.
pub const SASL_HEADER: [u8; 8] = *b"AMQP\x03\x01\x00\x00";
/// The smallest `max-frame-size` the specification allows.
pub const MIN_MAX_FRAME_SIZE: u32 = 512;

/// Frame type of AMQP frames.
pub const TYPE_AMQP: u8 = 0;
/// Frame type of SASL frames.
pub const TYPE_SASL: u8 = 1;

/// A frame read off the wire.
#[derive(Debug, Clone, PartialEq)]
pub struct Frame {
    /// 0 for AMQP, 1 for SASL.
    pub kind: u8,
    /// The channel.
    pub channel: u16,
    /// The body after the extended header; empty for a heartbeat.
    pub body: Bytes,
}

/// Why reading frames stopped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ReadError {
    /// The peer closed the connection.
    #[error("connection closed by the peer")]
    Closed,
    /// An I/O error.
    #[error("i/o error: {0}")]
    Io(#[from] std::io::Error),
    /// A frame header that cannot be valid.
    #[error("malformed frame header (size {size}, data offset {doff})")]
    BadHeader {
        /// The declared size.
        size: u32,
        /// The declared data offset.
        doff: u8,
    },
    /// A frame larger than the negotiated maximum.
    #[error("frame of {size} bytes exceeds the maximum of {max}")]
    TooLarge {
        /// The declared size.
        size: u32,
        /// The limit.
        max: u32,
    },
}

/// Reads frames from a stream, enforcing a maximum size.
#[derive(Debug)]
pub struct FrameReader<R> {
    io: R,
    buf: BytesMut,
    max_frame_size: u32,
}

impl<R: AsyncRead + Unpin> FrameReader<R> {
    /// A reader with the given limit on frame size.
    pub fn new(io: R, max_frame_size: u32) -> Self {
        Self { io, buf: BytesMut::with_capacity(8 * 1024), max_frame_size }
    }

    /// Changes the frame-size limit.
    pub fn set_max_frame_size(&mut self, max: u32) {
        self.max_frame_size = max;
    }

    /// Reads the 8-byte protocol header.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: bytes read so far stay buffered for the next call.
    pub async fn read_protocol_header(&mut self) -> Result<[u8; 8], ReadError> {
        self.fill(8).await?;
        let mut h = [0u8; 8];
        h.copy_from_slice(&self.buf[..8]);
        self.buf.advance(8);
        Ok(h)
    }

    /// Reads the next frame.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a partly read frame stays buffered and the next call completes it.
    pub async fn read_frame(&mut self) -> Result<Frame, ReadError> {
        self.fill(8).await?;
        let total = self.frame_size()?;
        self.fill(total).await?;
        Ok(self.split_frame(total))
    }

    /// The next frame if the bytes read so far hold all of it, without reading more: a reader
    /// takes the frames that arrived together before it answers them.
    pub fn buffered_frame(&mut self) -> Option<Result<Frame, ReadError>> {
        if self.buf.len() < 8 {
            return None;
        }
        match self.frame_size() {
            Ok(total) if self.buf.len() < total => None,
            Ok(total) => Some(Ok(self.split_frame(total))),
            Err(e) => Some(Err(e)),
        }
    }

    /// The size of the frame whose 8-byte header starts the buffer, checked.
    fn frame_size(&self) -> Result<usize, ReadError> {
        let size = u32::from_be_bytes([self.buf[0], self.buf[1], self.buf[2], self.buf[3]]);
        let doff = self.buf[4];
        if size < 8 || doff < 2 || u32::from(doff) * 4 > size {
            return Err(ReadError::BadHeader { size, doff });
        }
        if size > self.max_frame_size {
            return Err(ReadError::TooLarge { size, max: self.max_frame_size });
        }
        usize::try_from(size).map_err(|_| ReadError::BadHeader { size, doff })
    }

    /// Takes the frame of `total` bytes at the start of the buffer.
    fn split_frame(&mut self, total: usize) -> Frame {
        let mut frame = self.buf.split_to(total).freeze();
        let kind = frame[5];
        let channel = u16::from_be_bytes([frame[6], frame[7]]);
        frame.advance(usize::from(frame[4]) * 4);
        Frame { kind, channel, body: frame }
    }

    async fn fill(&mut self, n: usize) -> Result<(), ReadError> {
        while self.buf.len() < n {
            self.buf.reserve(n - self.buf.len());
            if self.io.read_buf(&mut self.buf).await? == 0 {
                return Err(ReadError::Closed);
            }
        }
        Ok(())
    }
}

/// Appends one frame (header, performative, payload) to `out`.
pub fn write_frame(out: &mut Vec<u8>, kind: u8, channel: u16, p: &Performative, payload: &[u8]) {
    write_frame_with(out, kind, channel, p, |out| out.extend_from_slice(payload));
}

/// Appends one frame whose payload `payload` writes straight into `out` (a message encoded in
/// place, without a buffer of its own); returns the frame's size.
pub fn write_frame_with(
    out: &mut Vec<u8>,
    kind: u8,
    channel: u16,
    p: &Performative,
    payload: impl FnOnce(&mut Vec<u8>),
) -> usize {
    let start = out.len();
    out.extend_from_slice(&[0, 0, 0, 0, 2, kind]);
    out.extend_from_slice(&channel.to_be_bytes());
    p.encode(out);
    payload(out);
    let len = out.len() - start;
    let size = u32::try_from(len).unwrap_or(u32::MAX);
    out[start..start + 4].copy_from_slice(&size.to_be_bytes());
    len
}

/// An empty frame: the heartbeat that keeps an idle connection open.
pub const HEARTBEAT: [u8; 8] = [0, 0, 0, 8, 2, 0, 0, 0];

#[cfg(test)]
mod tests {
    use std::future::Future;
    use std::pin::pin;
    use std::task::{Context, Poll, Waker};

    use super::*;
    use crate::performative::Flow;

    /// Runs a future that does not wait (reads from a slice never do).
    fn now<T>(f: impl Future<Output = T>) -> T {
        match pin!(f).poll(&mut Context::from_waker(Waker::noop())) {
            Poll::Ready(v) => v,
            Poll::Pending => panic!("a read from a slice waited"),
        }
    }

    fn flow(credit: u32) -> Performative {
        Performative::Flow(Flow { link_credit: Some(credit), ..Flow::default() })
    }

    /// Frames that arrived with the one read are taken without reading; a partial frame
    /// waits for its bytes, and a bad header is an error as it is for `read_frame`.
    #[test]
    fn buffered_frames_are_taken_without_reading() {
        let mut bytes = Vec::new();
        for credit in 1..=3 {
            write_frame(&mut bytes, TYPE_AMQP, 0, &flow(credit), &[]);
        }
        let whole = bytes.len();
        write_frame(&mut bytes, TYPE_AMQP, 0, &flow(4), &[]);
        let mut reader = FrameReader::new(&bytes[..whole + 5], 512);
        assert!(reader.buffered_frame().is_none(), "nothing read yet");
        let credit = |f: Frame| match Performative::decode(&f.body).unwrap().0 {
            Performative::Flow(f) => f.link_credit,
            other => panic!("{other:?}"),
        };
        assert_eq!(credit(now(reader.read_frame()).unwrap()), Some(1));
        assert_eq!(credit(reader.buffered_frame().unwrap().unwrap()), Some(2));
        assert_eq!(credit(reader.buffered_frame().unwrap().unwrap()), Some(3));
        assert!(reader.buffered_frame().is_none(), "the fourth frame is not whole");
        assert!(matches!(now(reader.read_frame()), Err(ReadError::Closed)));

        let mut bad = Vec::new();
        write_frame(&mut bad, TYPE_AMQP, 0, &flow(1), &[]);
        bad.extend_from_slice(&[0, 0, 0, 8, 1, 0, 0, 0]);
        let mut reader = FrameReader::new(&bad[..], 512);
        now(reader.read_frame()).unwrap();
        assert!(matches!(reader.buffered_frame(), Some(Err(ReadError::BadHeader { .. }))));
        let mut large = Vec::new();
        write_frame(&mut large, TYPE_AMQP, 0, &flow(1), &[]);
        write_frame(&mut large, TYPE_AMQP, 0, &flow(1), &[0; 600]);
        let mut reader = FrameReader::new(&large[..], 512);
        now(reader.read_frame()).unwrap();
        assert!(matches!(reader.buffered_frame(), Some(Err(ReadError::TooLarge { .. }))));
    }
}
