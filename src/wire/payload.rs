//! Serde helper: a [`Bytes`] field encoded as a CBOR byte string.
//!
//! Plain serde would encode `Bytes`/`Vec<u8>` as an array of small integers
//! (one CBOR item per byte). With `#[serde(with = "payload")]` the field is a
//! single byte string, and decoding takes ciborium's `byte_buf` path, which
//! accepts any length (bounded by the frame) and hands over the buffer without
//! a second copy.

use std::fmt;

use bytes::Bytes;
use serde::de::{Error, Visitor};
use serde::{Deserializer, Serializer};

pub(crate) fn serialize<S: Serializer>(bytes: &Bytes, serializer: S) -> Result<S::Ok, S::Error> {
    serializer.serialize_bytes(bytes)
}

pub(crate) fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Bytes, D::Error> {
    deserializer.deserialize_byte_buf(BytesVisitor)
}

struct BytesVisitor;

impl<'de> Visitor<'de> for BytesVisitor {
    type Value = Bytes;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a byte string")
    }

    fn visit_bytes<E: Error>(self, v: &[u8]) -> Result<Bytes, E> {
        Ok(Bytes::copy_from_slice(v))
    }

    fn visit_byte_buf<E: Error>(self, v: Vec<u8>) -> Result<Bytes, E> {
        Ok(Bytes::from(v))
    }
}

/// The same encoding for a borrowed byte-string field (encode side only).
pub(crate) mod borrowed {
    use serde::Serializer;

    pub(crate) fn serialize<S: Serializer>(bytes: &&[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(bytes)
    }
}
