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
        let size = u32::from_be_bytes([self.buf[0], self.buf[1], self.buf[2], self.buf[3]]);
        let doff = self.buf[4];
        if size < 8 || doff < 2 || u32::from(doff) * 4 > size {
            return Err(ReadError::BadHeader { size, doff });
        }
        if size > self.max_frame_size {
            return Err(ReadError::TooLarge { size, max: self.max_frame_size });
        }
        let total = usize::try_from(size).map_err(|_| ReadError::BadHeader { size, doff })?;
        self.fill(total).await?;
        let mut frame = self.buf.split_to(total).freeze();
        let kind = frame[5];
        let channel = u16::from_be_bytes([frame[6], frame[7]]);
        frame.advance(usize::from(doff) * 4);
        Ok(Frame { kind, channel, body: frame })
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
    let start = out.len();
    out.extend_from_slice(&[0, 0, 0, 0, 2, kind]);
    out.extend_from_slice(&channel.to_be_bytes());
    p.encode(out);
    out.extend_from_slice(payload);
    let size = u32::try_from(out.len() - start).unwrap_or(u32::MAX);
    out[start..start + 4].copy_from_slice(&size.to_be_bytes());
}

/// An empty frame: the heartbeat that keeps an idle connection open.
pub const HEARTBEAT: [u8; 8] = [0, 0, 0, 8, 2, 0, 0, 0];
