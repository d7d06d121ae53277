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

use bytes::{BufMut, Bytes, BytesMut};

use super::frame::{Frame, ReplyResult};

const MAJOR_UINT: u8 = 0;
const MAJOR_BYTES: u8 = 2;
const MAJOR_TEXT: u8 = 3;
const MAJOR_MAP: u8 = 5;

/// Writes a CBOR head with the shortest argument encoding.
fn put_head(dst: &mut BytesMut, major: u8, arg: u64) {
    let m = major << 5;
    if arg < 24 {
        dst.put_u8(m | arg as u8);
    } else if let Ok(a) = u8::try_from(arg) {
        dst.put_u8(m | 24);
        dst.put_u8(a);
    } else if let Ok(a) = u16::try_from(arg) {
        dst.put_u8(m | 25);
        dst.put_u16(a);
    } else if let Ok(a) = u32::try_from(arg) {
        dst.put_u8(m | 26);
        dst.put_u32(a);
    } else {
        dst.put_u8(m | 27);
        dst.put_u64(arg);
    }
}

fn put_text(dst: &mut BytesMut, s: &str) {
    put_head(dst, MAJOR_TEXT, s.len() as u64);
    dst.put_slice(s.as_bytes());
}

fn put_bytes(dst: &mut BytesMut, b: &[u8]) {
    put_head(dst, MAJOR_BYTES, b.len() as u64);
    dst.put_slice(b);
}

/// Encodes a hot frame's body; `false` (nothing written) for other frames.
pub(crate) fn encode(frame: &Frame, dst: &mut BytesMut) -> bool {
    match frame {
        Frame::Oneway { channel, payload } => {
            dst.reserve(32 + payload.len());
            put_head(dst, MAJOR_MAP, 1);
            put_text(dst, "Oneway");
            put_head(dst, MAJOR_MAP, 2);
            put_text(dst, "channel");
            put_head(dst, MAJOR_UINT, u64::from(*channel));
            put_text(dst, "payload");
            put_bytes(dst, payload);
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

/// Payloads at least this long are sliced out of the frame's `Bytes` instead
/// of copied. Shorter ones are copied: a small slice would keep the whole
/// read buffer it came from alive for as long as an upper layer holds it.
pub(crate) const SLICE_MIN: usize = 16 * 1024;

/// A cursor over a body that only reads canonical heads.
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    /// The same bytes as `buf`, shared, when the caller has them so.
    shared: Option<&'a Bytes>,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let end = self.pos.checked_add(n)?;
        let s = self.buf.get(self.pos..end)?;
        self.pos = end;
        Some(s)
    }

    /// A head with a definite, shortest-form argument.
    fn head(&mut self) -> Option<(u8, u64)> {
        let b = *self.take(1)?.first()?;
        let (major, info) = (b >> 5, b & 0x1f);
        let arg = match info {
            0..=23 => u64::from(info),
            24..=27 => {
                let width = 1usize << (info - 24);
                let mut a = [0u8; 8];
                a.get_mut(8 - width..)?.copy_from_slice(self.take(width)?);
                let v = u64::from_be_bytes(a);
                // Shortest form only: anything else goes to the general decoder.
                let floor = if width == 1 { 24 } else { 1u64 << (4 * width) };
                if v < floor {
                    return None;
                }
                v
            }
            _ => return None,
        };
        Some((major, arg))
    }

    fn expect(&mut self, major: u8, arg: u64) -> Option<()> {
        (self.head()? == (major, arg)).then_some(())
    }

    fn key(&mut self, name: &str) -> Option<()> {
        self.expect(MAJOR_TEXT, name.len() as u64)?;
        (self.take(name.len())? == name.as_bytes()).then_some(())
    }

    fn text(&mut self) -> Option<&'a [u8]> {
        let (major, len) = self.head()?;
        if major != MAJOR_TEXT {
            return None;
        }
        self.take(usize::try_from(len).ok()?)
    }

    fn uint(&mut self) -> Option<u64> {
        let (major, v) = self.head()?;
        (major == MAJOR_UINT).then_some(v)
    }

    fn bytes(&mut self) -> Option<Bytes> {
        let (major, len) = self.head()?;
        if major != MAJOR_BYTES {
            return None;
        }
        let start = self.pos;
        let s = self.take(usize::try_from(len).ok()?)?;
        match self.shared {
            Some(b) if s.len() >= SLICE_MIN => Some(b.slice(start..self.pos)),
            _ => Some(Bytes::copy_from_slice(s)),
        }
    }
}

/// Decodes a hot frame in canonical form; `None` for anything else.
/// `shared`, when given, holds the same bytes as `body`: large payloads are
/// then sliced from it without a copy.
pub(crate) fn decode(body: &[u8], shared: Option<&Bytes>) -> Option<Frame> {
    let mut r = Reader {
        buf: body,
        pos: 0,
        shared,
    };
    r.expect(MAJOR_MAP, 1)?;
    let frame = match r.text()? {
        b"Oneway" => {
            r.expect(MAJOR_MAP, 2)?;
            r.key("channel")?;
            let channel = u16::try_from(r.uint()?).ok()?;
            r.key("payload")?;
            Frame::Oneway {
                channel,
                payload: r.bytes()?,
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
                payload: r.bytes()?,
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
                result: ReplyResult::Ok(r.bytes()?),
            }
        }
        _ => return None,
    };
    (r.pos == body.len()).then_some(frame)
}
