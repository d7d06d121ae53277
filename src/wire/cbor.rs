//! The few CBOR primitives the hand-written codecs share (`wire/fast.rs` for
//! frames, `sharding/fast.rs` for data messages): heads in their shortest
//! form, and a reader that accepts only that canonical form, so anything
//! else can be handed to serde.

use bytes::BufMut;

pub(crate) const MAJOR_UINT: u8 = 0;
pub(crate) const MAJOR_BYTES: u8 = 2;
pub(crate) const MAJOR_TEXT: u8 = 3;
pub(crate) const MAJOR_ARRAY: u8 = 4;
pub(crate) const MAJOR_MAP: u8 = 5;
/// The simple value `null`.
pub(crate) const NULL: u8 = 0xf6;

/// Writes a CBOR head with the shortest argument encoding.
///
/// Always inlined, as every writer here and every step of the reader that
/// reads a head: each remote message calls them many times, and a call's
/// own entry and exit cost more than most steps (BENCHMARKS.md,
/// "Instructions per message, counted").
#[inline(always)]
pub(crate) fn put_head(dst: &mut impl BufMut, major: u8, arg: u64) {
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

#[inline(always)]
pub(crate) fn put_text(dst: &mut impl BufMut, s: &str) {
    put_head(dst, MAJOR_TEXT, s.len() as u64);
    dst.put_slice(s.as_bytes());
}

#[inline(always)]
pub(crate) fn put_bytes(dst: &mut impl BufMut, b: &[u8]) {
    put_head(dst, MAJOR_BYTES, b.len() as u64);
    dst.put_slice(b);
}

#[inline(always)]
pub(crate) fn put_uint(dst: &mut impl BufMut, v: u64) {
    put_head(dst, MAJOR_UINT, v);
}

/// A cursor over a body that only reads canonical heads.
pub(crate) struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub(crate) fn new(buf: &'a [u8]) -> Self {
        Reader { buf, pos: 0 }
    }

    /// How far the reader has got.
    pub(crate) fn pos(&self) -> usize {
        self.pos
    }

    /// Whether everything was read.
    pub(crate) fn at_end(&self) -> bool {
        self.pos == self.buf.len()
    }

    #[inline(always)]
    pub(crate) fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let end = self.pos.checked_add(n)?;
        let s = self.buf.get(self.pos..end)?;
        self.pos = end;
        Some(s)
    }

    pub(crate) fn peek(&self) -> Option<u8> {
        self.buf.get(self.pos).copied()
    }

    /// A head with a definite, shortest-form argument.
    #[inline(always)]
    pub(crate) fn head(&mut self) -> Option<(u8, u64)> {
        let b = *self.take(1)?.first()?;
        let (major, info) = (b >> 5, b & 0x1f);
        // Each width read as its own fixed-size array (no copy of a length
        // known only at run time); shortest form only: anything else goes
        // to the general decoder.
        let (arg, floor) = match info {
            0..=23 => return Some((major, u64::from(info))),
            24 => (u64::from(self.array::<1>()?[0]), 24),
            25 => (u64::from(u16::from_be_bytes(self.array()?)), 1 << 8),
            26 => (u64::from(u32::from_be_bytes(self.array()?)), 1 << 16),
            27 => (u64::from_be_bytes(self.array()?), 1 << 32),
            _ => return None,
        };
        (arg >= floor).then_some((major, arg))
    }

    /// The next `N` bytes.
    #[inline(always)]
    fn array<const N: usize>(&mut self) -> Option<[u8; N]> {
        self.take(N)?.try_into().ok()
    }

    #[inline(always)]
    pub(crate) fn expect(&mut self, major: u8, arg: u64) -> Option<()> {
        (self.head()? == (major, arg)).then_some(())
    }

    /// A text key equal to `name`.
    #[inline(always)]
    pub(crate) fn key(&mut self, name: &str) -> Option<()> {
        self.expect(MAJOR_TEXT, name.len() as u64)?;
        (self.take(name.len())? == name.as_bytes()).then_some(())
    }

    /// A text string's bytes (not checked as UTF-8).
    #[inline(always)]
    pub(crate) fn text_bytes(&mut self) -> Option<&'a [u8]> {
        let (major, len) = self.head()?;
        if major != MAJOR_TEXT {
            return None;
        }
        self.take(usize::try_from(len).ok()?)
    }

    /// A text string, checked as UTF-8.
    #[inline(always)]
    pub(crate) fn text(&mut self) -> Option<&'a str> {
        std::str::from_utf8(self.text_bytes()?).ok()
    }

    #[inline(always)]
    pub(crate) fn uint(&mut self) -> Option<u64> {
        let (major, v) = self.head()?;
        (major == MAJOR_UINT).then_some(v)
    }

    /// A byte string's contents.
    #[inline(always)]
    pub(crate) fn bytes(&mut self) -> Option<&'a [u8]> {
        let (major, len) = self.head()?;
        if major != MAJOR_BYTES {
            return None;
        }
        self.take(usize::try_from(len).ok()?)
    }
}
