//! Hand-written encoding of the hot frames, byte-identical to serde's.
//!
//! `Oneway`, `Request` and `Reply{Ok}` carry nearly all traffic. Going
//! through serde and ciborium costs about a third of a pipe's CPU (decode
//! dominates: a header parse and an identifier match per field). These
//! functions write and read exactly the bytes ciborium produces for those
//! variants — the canonical form: definite lengths, shortest integer heads,
//! fields in declaration order:
//!
//! ```text
//! Request: a1 67 "Request" a3 64 "corr" <uint> 67 "channel" <uint> 67 "payload" <bstr>
//! Oneway:  a1 66 "Oneway"  a2 67 "channel" <uint> 67 "payload" <bstr>
//! Reply:   a1 65 "Reply"   a2 64 "corr" <uint> 66 "result" a1 62 "Ok" <bstr>
//! ```
//!
//! The decoder accepts only that exact form and returns `None` for
//! anything else, which the codec then hands to the general serde decoder.
//! So the fast path changes speed, never meaning: a tested property is that
//! whenever it decodes a body, serde decodes the same frame from it.

use bytes::{Bytes, BytesMut};

use super::frame::{Frame, ReplyResult};

use super::cbor::{MAJOR_MAP, MAJOR_UINT, Reader, put_bytes, put_head, put_text};

/// Encodes a hot frame's body; `false` (nothing written) for other frames.
pub(crate) fn encode(frame: &Frame, dst: &mut BytesMut) -> bool {
    match frame {
        Frame::Oneway { channel, payload } => {
            encode_oneway(dst, *channel, payload);
            true
        }
        Frame::Request {
            corr,
            channel,
            payload,
        } => {
            dst.reserve(48 + payload.len());
            put_head(dst, MAJOR_MAP, 1);
            put_text(dst, "Request");
            put_head(dst, MAJOR_MAP, 3);
            put_text(dst, "corr");
            put_head(dst, MAJOR_UINT, *corr);
            put_text(dst, "channel");
            put_head(dst, MAJOR_UINT, u64::from(*channel));
            put_text(dst, "payload");
            put_bytes(dst, payload);
            true
        }
        Frame::Reply {
            corr,
            result: ReplyResult::Ok(payload),
        } => {
            dst.reserve(40 + payload.len());
            put_head(dst, MAJOR_MAP, 1);
            put_text(dst, "Reply");
            put_head(dst, MAJOR_MAP, 2);
            put_text(dst, "corr");
            put_head(dst, MAJOR_UINT, *corr);
            put_text(dst, "result");
            put_head(dst, MAJOR_MAP, 1);
            put_text(dst, "Ok");
            put_bytes(dst, payload);
            true
        }
        _ => false,
    }
}

/// Encodes the body of a `Oneway` frame carrying `payload`.
pub(crate) fn encode_oneway(dst: &mut BytesMut, channel: u16, payload: &[u8]) {
    dst.reserve(32 + payload.len());
    put_head(dst, MAJOR_MAP, 1);
    put_text(dst, "Oneway");
    put_head(dst, MAJOR_MAP, 2);
    put_text(dst, "channel");
    put_head(dst, MAJOR_UINT, u64::from(channel));
    put_text(dst, "payload");
    put_bytes(dst, payload);
}

/// The channel and payload of a `Oneway` body in canonical form, read in
/// place; `None` for anything else (which `decode` then handles, or not).
/// Accepts exactly the `Oneway` bodies `decode` accepts.
pub(crate) fn peek_oneway(body: &[u8]) -> Option<(u16, &[u8])> {
    let mut r = Reader::new(body);
    r.expect(MAJOR_MAP, 1)?;
    if r.text_bytes()? != b"Oneway" {
        return None;
    }
    r.expect(MAJOR_MAP, 2)?;
    r.key("channel")?;
    let channel = u16::try_from(r.uint()?).ok()?;
    r.key("payload")?;
    let payload = r.bytes()?;
    r.at_end().then_some((channel, payload))
}

/// Payloads at least this long are sliced out of the frame's `Bytes` instead
/// of copied. Shorter ones are copied: a small slice would keep the whole
/// read buffer it came from alive for as long as an upper layer holds it.
pub(crate) const SLICE_MIN: usize = 16 * 1024;

/// A payload read from `body`: sliced out of `shared` (the same bytes) when
/// large enough, copied otherwise.
fn payload(r: &mut Reader<'_>, shared: Option<&Bytes>) -> Option<Bytes> {
    let s = r.bytes()?;
    let end = r.pos();
    match shared {
        Some(b) if s.len() >= SLICE_MIN => Some(b.slice(end - s.len()..end)),
        _ => Some(Bytes::copy_from_slice(s)),
    }
}

/// Decodes a hot frame in canonical form; `None` for anything else.
/// `shared`, when given, holds the same bytes as `body`: large payloads are
/// then sliced from it without a copy.
pub(crate) fn decode(body: &[u8], shared: Option<&Bytes>) -> Option<Frame> {
    let mut r = Reader::new(body);
    r.expect(MAJOR_MAP, 1)?;
    let frame = match r.text_bytes()? {
        b"Oneway" => {
            r.expect(MAJOR_MAP, 2)?;
            r.key("channel")?;
            let channel = u16::try_from(r.uint()?).ok()?;
            r.key("payload")?;
            Frame::Oneway {
                channel,
                payload: payload(&mut r, shared)?,
            }
        }
        b"Request" => {
            r.expect(MAJOR_MAP, 3)?;
            r.key("corr")?;
            let corr = r.uint()?;
            r.key("channel")?;
            let channel = u16::try_from(r.uint()?).ok()?;
            r.key("payload")?;
            Frame::Request {
                corr,
                channel,
                payload: payload(&mut r, shared)?,
            }
        }
        b"Reply" => {
            r.expect(MAJOR_MAP, 2)?;
            r.key("corr")?;
            let corr = r.uint()?;
            r.key("result")?;
            r.expect(MAJOR_MAP, 1)?;
            r.key("Ok")?;
            Frame::Reply {
                corr,
                result: ReplyResult::Ok(payload(&mut r, shared)?),
            }
        }
        _ => return None,
    };
    r.at_end().then_some(frame)
}
