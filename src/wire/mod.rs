//! The wire: how one node's bytes reach another.
//!
//! Every message between two nodes travels as one **frame**:
//!
//! ```text
//! +----------------------+--------------------------------------+
//! | length: u32, big-end | body: one CBOR data item (`Frame`)   |
//! +----------------------+--------------------------------------+
//!   4 bytes                `length` bytes, 0 < length <= max
//! ```
//!
//! The body is a [`Frame`] encoded with ciborium (serde). Upper layers
//! (membership, sharding) never add variants here: they put their own
//! already-encoded messages into the opaque `payload` of a
//! [`Frame::Oneway`] or [`Frame::Request`], tagged with a small `channel`
//! number that says which layer the payload belongs to. Payloads are CBOR
//! byte strings (major type 2), not arrays of integers.
//!
//! [`FrameCodec`] is the tokio-util codec for this format. Its decoder checks
//! the length prefix against the configured maximum before it reserves or
//! allocates anything, then reserves for an incomplete body at most
//! [`RESERVE_CHUNK`] beyond the bytes that have arrived, uses checked arithmetic, rejects trailing bytes after
//! the CBOR item, and never panics: any input yields a frame, "need more
//! bytes", or a [`WireError`]. Its encoder writes straight into the output
//! `BytesMut` and patches the length afterwards. The three hot variants
//! (`Oneway`, `Request`, `Reply{Ok}`) are encoded and decoded by hand in
//! exactly the bytes serde produces (see `fast.rs`); everything else, and any
//! body not in that canonical form, goes through serde and ciborium.
//!
//! ```
//! use bytes::{Bytes, BytesMut};
//! use datum_cluster_sharding::wire::{Frame, FrameCodec};
//! use tokio_util::codec::{Decoder, Encoder};
//!
//! let mut codec = FrameCodec::new(1024);
//! let mut buf = BytesMut::new();
//! let frame = Frame::Oneway { channel: 7, payload: Bytes::from_static(b"hi") };
//! codec.encode(&frame, &mut buf).unwrap();
//! assert_eq!(codec.decode(&mut buf).unwrap(), Some(frame));
//! assert!(buf.is_empty());
//! ```

pub(crate) mod cbor;
pub mod channels;
mod codec;
mod fast;
mod frame;
pub(crate) mod payload;

pub use codec::{
    DEFAULT_MAX_FRAME_LEN, FrameCodec, HANDSHAKE_MAX_FRAME_LEN, LEN_PREFIX, RESERVE_CHUNK,
    WireError,
};
pub use frame::{
    COMPACT_DATA_VERSION, Channel, Frame, LINE_FINGERPRINT_VERSION, MIN_PROTOCOL_VERSION,
    PROTOCOL_VERSION, RejectReason, RemoteFailure, ReplyResult,
};

#[cfg(test)]
mod tests;
