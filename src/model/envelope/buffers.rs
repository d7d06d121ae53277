//! Per-thread buffers of the hot path: one to encode a message or reply
//! into, one to build a data frame in, and ciborium's decode scratch.

use serde::de::DeserializeOwned;

thread_local! {
    /// A buffer to encode one message or reply into before it is framed, so
    /// the hot path does not allocate for it.
    static SCRATCH: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
    /// A buffer to build one data message in, sent from there
    /// (`with_frame`).
    static FRAME: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Runs `f` with this thread's scratch buffer, emptied (a fresh buffer when
/// `f` is re-entered).
pub(crate) fn with_scratch<T>(f: impl FnOnce(&mut Vec<u8>) -> T) -> T {
    with_buffer(&SCRATCH, f)
}

/// Runs `f` on this thread's frame buffer, cleared: a payload is built
/// there and sent from there (`Transport::send_slice` copies it into the
/// pipe's queue), with no allocation of its own.
pub(crate) fn with_frame<T>(f: impl FnOnce(&mut Vec<u8>) -> T) -> T {
    with_buffer(&FRAME, f)
}

fn with_buffer<T>(
    key: &'static std::thread::LocalKey<std::cell::RefCell<Vec<u8>>>,
    f: impl FnOnce(&mut Vec<u8>) -> T,
) -> T {
    key.with(|cell| match cell.try_borrow_mut() {
        Ok(mut buf) => {
            buf.clear();
            let out = f(&mut buf);
            if buf.capacity() > 64 * 1024 {
                *buf = Vec::new();
            }
            out
        }
        Err(_) => f(&mut Vec::new()),
    })
}

thread_local! {
    /// ciborium's decode scratch (4 KiB, as `from_reader` uses), zeroed once
    /// per thread instead of on every call.
    static CBOR_SCRATCH: std::cell::RefCell<Vec<u8>> = std::cell::RefCell::new(vec![0; 4096]);
}

/// Decodes one user message or reply as `ciborium::from_reader` does, fast.
///
/// Most values go through cbor4ii, which reads a small struct 2.7 times
/// faster than ciborium (`benches/envelope.rs`). Whatever cbor4ii refuses —
/// a float ciborium wrote shorter than its type (`1.0f64` is a half float),
/// a unit written as `null`, any tag, anything malformed — is decoded again
/// by ciborium, whose error is the one reported. So every value ciborium
/// writes reads as ciborium reads it (the property tests check both
/// paths); the few inputs ciborium refuses and cbor4ii reads are named in
/// SPEC §13.4. Both limit nesting to 256 levels: deep input is an error,
/// never a stack overflow.
pub(crate) fn from_cbor<T: DeserializeOwned>(
    bytes: &[u8],
) -> Result<T, ciborium::de::Error<std::io::Error>> {
    cbor4ii::serde::from_slice(bytes).or_else(|_| from_ciborium(bytes))
}

/// Decodes one CBOR value with ciborium, without zeroing its 4 KiB
/// scratch buffer on every call (which costs more than decoding a small
/// message).
pub(crate) fn from_ciborium<T: DeserializeOwned>(
    bytes: &[u8],
) -> Result<T, ciborium::de::Error<std::io::Error>> {
    CBOR_SCRATCH.with(|cell| match cell.try_borrow_mut() {
        Ok(mut scratch) => ciborium::de::from_reader_with_buffer(bytes, &mut scratch[..]),
        // Re-entered (a `Deserialize` impl that decodes CBOR itself).
        Err(_) => ciborium::from_reader(bytes),
    })
}

#[cfg(test)]
#[path = "cbor_tests.rs"]
mod cbor_tests;
