//! [`FrameCodec`]: length-prefixed CBOR frames for tokio-util's `Framed`.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use tokio_util::codec::{Decoder, Encoder};

use super::fast;
use super::frame::Frame;

/// Bytes of the big-endian `u32` length prefix in front of every frame body.
pub const LEN_PREFIX: usize = 4;

/// Default largest frame body accepted or produced: 4 MiB.
pub const DEFAULT_MAX_FRAME_LEN: usize = 4 * 1024 * 1024;

/// Largest frame body accepted or produced during the handshake, before the
/// peer has proven anything: 4 KiB (a `Hello` with a long cluster name and
/// address is a few hundred bytes).
pub const HANDSHAKE_MAX_FRAME_LEN: usize = 4 * 1024;

/// Most the decoder reserves ahead of the bytes that have arrived, for a
/// frame whose body is still incomplete. A peer that announces a large frame
/// and sends nothing more costs at most this much, not the announced length.
pub const RESERVE_CHUNK: usize = 64 * 1024;

/// Scratch space ciborium uses for short strings while decoding. Byte-string
/// payloads do not go through it (see `wire::payload`), so it can stay small;
/// a smaller buffer is cheaper to zero on every decode.
const SCRATCH: usize = 256;

/// Errors of encoding or decoding a frame. Any of them ends the connection
/// the frame travelled on (and only that connection).
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    /// The length prefix (decoding) or the encoded body (encoding) exceeds
    /// the codec's maximum. Nothing was allocated for it; when encoding, the
    /// output buffer is left as it was.
    #[error("frame body of {len} bytes exceeds the maximum of {max} bytes")]
    FrameTooLarge {
        /// The announced or produced body length.
        len: u64,
        /// The codec's maximum body length.
        max: usize,
    },
    /// The body is not one well-formed CBOR item of the [`Frame`] schema
    /// (this includes an empty body).
    #[error("malformed frame body: {0}")]
    Malformed(String),
    /// The body holds a complete [`Frame`] followed by extra bytes.
    #[error("{0} trailing bytes after the frame's CBOR item")]
    TrailingBytes(usize),
    /// The frame could not be serialized; the output buffer is left as it
    /// was.
    #[error("frame could not be encoded: {0}")]
    Encode(String),
    /// Reading or writing the underlying stream failed.
    #[error("i/o error: {0}")]
    Io(#[from] std::io::Error),
}

/// Codec for frames: a big-endian `u32` body length, then the CBOR body.
///
/// `max_frame_len` bounds the body (the prefix is not counted) in both
/// directions; it is clamped to `u32::MAX`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameCodec {
    max_frame_len: usize,
}

impl FrameCodec {
    /// A codec accepting bodies of at most `max_frame_len` bytes.
    pub fn new(max_frame_len: usize) -> Self {
        let cap = usize::try_from(u32::MAX).unwrap_or(usize::MAX);
        FrameCodec {
            max_frame_len: max_frame_len.min(cap),
        }
    }

    /// The largest body this codec accepts or produces.
    pub fn max_frame_len(&self) -> usize {
        self.max_frame_len
    }

    /// Decodes one complete body (without its length prefix).
    pub fn decode_body(body: &[u8]) -> Result<Frame, WireError> {
        match fast::decode(body, None) {
            Some(frame) => Ok(frame),
            None => Self::decode_body_serde(body),
        }
    }

    /// Decodes one complete body held in `Bytes`: large payloads of the hot
    /// frames are slices of it rather than copies.
    fn decode_body_shared(body: &Bytes) -> Result<Frame, WireError> {
        match fast::decode(body, Some(body)) {
            Some(frame) => Ok(frame),
            None => Self::decode_body_serde(body),
        }
    }

    /// The general decoder (serde over ciborium), for every frame form.
    pub(crate) fn decode_body_serde(body: &[u8]) -> Result<Frame, WireError> {
        let mut scratch = [0u8; SCRATCH];
        let mut rest = body;
        let frame: Frame = ciborium::de::from_reader_with_buffer(&mut rest, &mut scratch)
            .map_err(|e| WireError::Malformed(e.to_string()))?;
        if !rest.is_empty() {
            return Err(WireError::TrailingBytes(rest.len()));
        }
        Ok(frame)
    }
}

impl Default for FrameCodec {
    fn default() -> Self {
        FrameCodec::new(DEFAULT_MAX_FRAME_LEN)
    }
}

impl Decoder for FrameCodec {
    type Item = Frame;
    type Error = WireError;

    fn decode(&mut self, src: &mut BytesMut) -> Result<Option<Frame>, WireError> {
        let Some(prefix) = src.get(..LEN_PREFIX) else {
            return Ok(None);
        };
        let mut raw = [0u8; LEN_PREFIX];
        raw.copy_from_slice(prefix);
        let announced = u32::from_be_bytes(raw);
        // Check the announced length before reserving anything for it.
        let len = match usize::try_from(announced) {
            Ok(len) if len <= self.max_frame_len => len,
            _ => {
                return Err(WireError::FrameTooLarge {
                    len: u64::from(announced),
                    max: self.max_frame_len,
                });
            }
        };
        let Some(total) = LEN_PREFIX.checked_add(len) else {
            return Err(WireError::FrameTooLarge {
                len: u64::from(announced),
                max: self.max_frame_len,
            });
        };
        if src.len() < total {
            // Reserve for what is missing, but never more than one chunk
            // ahead of what has arrived: an announced length costs nothing
            // until its bytes come.
            let missing = total.saturating_sub(src.len());
            src.reserve(missing.min(RESERVE_CHUNK));
            return Ok(None);
        }
        src.advance(LEN_PREFIX);
        let body = src.split_to(len).freeze();
        FrameCodec::decode_body_shared(&body).map(Some)
    }
}

impl FrameCodec {
    /// If the complete frame at the start of `src` is a `Oneway` in
    /// canonical form: its channel, its payload in place and the frame's
    /// whole length, without consuming it. `None` while the frame is
    /// incomplete, when its announced length is over the limit, and for any
    /// other frame (`decode` then handles it, or reports it).
    pub(crate) fn peek_oneway<'a>(&self, src: &'a [u8]) -> Option<(u16, &'a [u8], usize)> {
        let prefix: [u8; LEN_PREFIX] = src.get(..LEN_PREFIX)?.try_into().ok()?;
        let len = usize::try_from(u32::from_be_bytes(prefix)).ok()?;
        if len > self.max_frame_len {
            return None;
        }
        let total = LEN_PREFIX.checked_add(len)?;
        let (channel, payload) = fast::peek_oneway(src.get(LEN_PREFIX..total)?)?;
        Some((channel, payload, total))
    }

    /// Appends a whole `Oneway` frame carrying `payload` (the same bytes as
    /// encoding `Frame::Oneway`, without building one).
    pub(crate) fn encode_oneway(
        &self,
        channel: u16,
        payload: &[u8],
        dst: &mut BytesMut,
    ) -> Result<(), WireError> {
        self.write_framed(dst, |dst| {
            fast::encode_oneway(dst, channel, payload);
            Ok(())
        })
    }

    /// Appends a length prefix and the body `body` writes, checking the
    /// body against the frame limit; on error nothing is appended.
    fn write_framed(
        &self,
        dst: &mut BytesMut,
        body: impl FnOnce(&mut BytesMut) -> Result<(), WireError>,
    ) -> Result<(), WireError> {
        let start = dst.len();
        dst.reserve(LEN_PREFIX + 32);
        dst.put_u32(0); // patched below, once the body length is known
        if let Err(e) = body(dst) {
            dst.truncate(start);
            return Err(e);
        }
        let len = dst.len().saturating_sub(start + LEN_PREFIX);
        let len32 = match u32::try_from(len) {
            Ok(l) if len <= self.max_frame_len => l,
            _ => {
                dst.truncate(start);
                return Err(WireError::FrameTooLarge {
                    len: u64::try_from(len).unwrap_or(u64::MAX),
                    max: self.max_frame_len,
                });
            }
        };
        dst[start..start + LEN_PREFIX].copy_from_slice(&len32.to_be_bytes());
        Ok(())
    }
}

impl Encoder<&Frame> for FrameCodec {
    type Error = WireError;

    fn encode(&mut self, frame: &Frame, dst: &mut BytesMut) -> Result<(), WireError> {
        self.write_framed(dst, |dst| {
            if !fast::encode(frame, dst) {
                // Hot frames are written by hand, byte-identical to serde's
                // form; the rest by serde.
                ciborium::into_writer(frame, dst.writer())
                    .map_err(|e| WireError::Encode(e.to_string()))?;
            }
            Ok(())
        })
    }
}

impl Encoder<Frame> for FrameCodec {
    type Error = WireError;

    fn encode(&mut self, frame: Frame, dst: &mut BytesMut) -> Result<(), WireError> {
        self.encode(&frame, dst)
    }
}
