//! Items the `protocol!` macro expands to. Not part of the stable API.
//!
//! The `Sealed*` traits are the seal of the protocol family: only code that
//! names this hidden module can implement them, and only `protocol!` should.
//!
//! Everything here is defined elsewhere in the crate (or, for the
//! dispatch chain's `Either` and `ready`, in futures-util) and only
//! re-exported, so the macro's paths stay `$crate::__private::…`; nothing
//! in the crate imports this module.

pub use crate::model::envelope::{LocalEnvelope, RemoteReply, ReplyTarget, Undecodable};
pub use crate::model::protocol::{SealedAsk, SealedMessage, SealedProtocol, SealedTell};
pub use crate::runtime::dispatch::{
    Deferred, Direct, Dispatch, Handles, Outcome, decode_as, handle_local,
};
pub use futures_util::future::{Either, ready};

const OFFSET_BASIS: u64 = 0xcbf2_9ce4_8422_2325;

/// `hash` (FNV-1a 64) carried over `part` and then the byte 0xff, which no
/// UTF-8 text contains, so parts cannot run into each other.
const fn fnv_part(mut hash: u64, part: &str) -> u64 {
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    let bytes = part.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        hash = (hash ^ bytes[i] as u64).wrapping_mul(PRIME);
        i += 1;
    }
    (hash ^ 0xff).wrapping_mul(PRIME)
}

/// FNV-1a 64 over `parts`, each followed by the byte 0xff: a protocol's
/// fingerprint.
pub const fn fingerprint(parts: &[&str]) -> u64 {
    let mut hash = OFFSET_BASIS;
    let mut p = 0;
    while p < parts.len() {
        hash = fnv_part(hash, parts[p]);
        p += 1;
    }
    hash
}

/// The fingerprints of a protocol up to each of its lines: entry `i` is
/// [`fingerprint`] over the wire name and lines `0..=i`.
pub const fn line_fingerprints<const N: usize>(wire: &str, lines: [&str; N]) -> [u64; N] {
    let mut out = [0; N];
    let mut hash = fnv_part(OFFSET_BASIS, wire);
    let mut i = 0;
    while i < N {
        hash = fnv_part(hash, lines[i]);
        out[i] = hash;
        i += 1;
    }
    out
}

/// Whether `name` is a usable protocol wire name: 1 to 64 bytes of ASCII
/// letters, digits, `.`, `_` and `-`.
pub const fn valid_wire_name(name: &str) -> bool {
    let bytes = name.as_bytes();
    if bytes.is_empty() || bytes.len() > 64 {
        return false;
    }
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        if !(b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-') {
            return false;
        }
        i += 1;
    }
    true
}

/// The remote-envelope path, exposed for `benches/envelope.rs` only.
pub mod bench {
    use crate::model::envelope::ReplyTarget;
    use crate::model::identity::{NodeId, UniqueAddress};
    use crate::sharding::fast::{self, DataRef, EnvelopeRef};
    use crate::sharding::wire::{DataMsg, DataMsgOut};

    fn target() -> ReplyTarget {
        ReplyTarget {
            origin: UniqueAddress {
                addr: std::net::SocketAddr::from(([127, 0, 0, 1], 7355)),
                node_id: NodeId(0x1234_5678_9abc_def0),
                incarnation: 1_796_000_000_000_000,
            },
            ask_id: 1_000_000,
        }
    }

    fn envelope<'a>(entity_id: &'a str, payload: &'a [u8]) -> EnvelopeRef<'a> {
        EnvelopeRef {
            type_name: "pinger",
            fingerprint: 0x0123_4567_89ab_cdef,
            shard: 42,
            generation: 3,
            entity_id,
            index: 0,
            hops: 0,
            reply_to: Some(target()),
            payload,
            trace: None,
            delivery: None,
            line: None,
        }
    }

    /// Encodes one data-channel envelope through serde.
    pub fn encode_envelope_serde(entity_id: &str, payload: &[u8]) -> Vec<u8> {
        DataMsgOut::Envelope(envelope(entity_id, payload)).encode()
    }

    /// Encodes the same envelope as `Remote::forward` does (by hand) for
    /// a version-2 pipe.
    pub fn encode_envelope_fast(entity_id: &str, payload: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        fast::encode_envelope(&mut out, &envelope(entity_id, payload));
        out
    }

    /// Encodes the same envelope in the compact form `Remote::forward`
    /// writes for a version-3 pipe.
    pub fn encode_envelope_compact(entity_id: &str, payload: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        fast::encode_envelope_compact(&mut out, &envelope(entity_id, payload));
        out
    }

    /// Decodes a data-channel message through serde; the payload length of
    /// an envelope (0 for anything else).
    pub fn decode_envelope_serde(bytes: &[u8]) -> usize {
        match ciborium::from_reader::<DataMsg, _>(bytes) {
            Ok(DataMsg::Envelope(envelope)) => envelope.payload.len(),
            _ => 0,
        }
    }

    /// Decodes a user message or reply as the receiving node does
    /// (cbor4ii, with ciborium for what cbor4ii leaves).
    pub fn decode_message<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Option<T> {
        crate::model::envelope::from_cbor(bytes).ok()
    }

    /// Decodes it with ciborium alone, as the receiving node did before.
    pub fn decode_message_ciborium<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Option<T> {
        crate::model::envelope::from_ciborium(bytes).ok()
    }

    /// A write-behind queue over an in-memory store, for timing what
    /// recording one id costs the region (the push only).
    pub struct RememberQueue(std::sync::Arc<crate::persistence::remember::writer::Remember>);

    impl RememberQueue {
        /// A queue of `capacity` records in front of an in-memory store.
        pub fn new(capacity: usize) -> Self {
            let config = crate::RememberEntitiesConfig::default().with_queue_capacity(capacity);
            RememberQueue(
                crate::persistence::remember::writer::Remember::start(
                    std::sync::Arc::new(crate::InMemoryStore::new()),
                    &config,
                )
                .expect("writer thread"),
            )
        }

        /// Queues one start record, as a region does when it spawns an entity.
        pub fn push(&self, entity_id: &std::sync::Arc<str>) {
            self.0.record(
                "bench",
                crate::ShardId(1),
                entity_id,
                crate::RememberEntitiesOperation::RecordStarted,
            );
        }
    }

    /// Decodes it as the inbound path does (by hand, in place), long or
    /// compact.
    pub fn decode_envelope_fast(bytes: &[u8]) -> usize {
        match fast::decode(bytes, &target().origin) {
            Some(DataRef::Envelope(envelope)) => envelope.payload.len(),
            _ => 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{fingerprint, line_fingerprints, valid_wire_name};
    use crate::model::protocol::Protocol;
    use serde::{Deserialize, Serialize};

    #[derive(Serialize, Deserialize)]
    pub struct Push(pub u64);
    #[derive(Serialize, Deserialize)]
    pub struct Home;

    crate::protocol! {
        /// SPEC §13's example protocol.
        pub protocol Tally = "tally" {
            tell Push;
            ask Home -> String;
        }
    }

    mod msgs {
        use serde::{Deserialize, Serialize};
        #[derive(Serialize, Deserialize)]
        pub struct Get;
    }

    crate::protocol! {
        pub protocol Paths = "paths" {
            ask msgs::Get -> Vec<u64>;
        }
    }

    #[test]
    fn spec_fingerprint_test_vector() {
        // SPEC §13.6: FNV-1a 64 over "tally" ff "tell Push" ff "ask Home -> String" ff.
        assert_eq!(fingerprint(&[]), 0xcbf2_9ce4_8422_2325);
        assert_eq!(
            fingerprint(&["tally", "tell Push", "ask Home -> String"]),
            0x10f4_3ecc_488b_4809
        );
        assert_eq!(<Tally as Protocol>::FINGERPRINT, 0x10f4_3ecc_488b_4809);
        // The fingerprint stopped after each line.
        assert_eq!(
            <Tally as Protocol>::LINES,
            [0xbcac_9f54_39be_15f0, 0x10f4_3ecc_488b_4809]
        );
        assert_eq!(line_fingerprints("tally", []), [0u64; 0]);
    }

    #[test]
    fn fingerprint_lines_are_stringified_as_rustc_prints_them() {
        // The message path is stringified token by token (rustc 1.95 puts
        // spaces around `::`); the reply, a `ty` fragment, is printed as a
        // type (no spaces around `<>`). SPEC §13.6 pins both.
        assert_eq!(<Paths as Protocol>::MESSAGES[0].name, "msgs :: Get");
        assert_eq!(
            <Paths as Protocol>::FINGERPRINT,
            fingerprint(&["paths", "ask msgs :: Get -> Vec<u64>"])
        );
    }

    #[test]
    fn spec_payload_forms() {
        // SPEC §13.4: a unit struct message is CBOR null, a newtype struct its value.
        let mut bytes = Vec::new();
        ciborium::into_writer(&Home, &mut bytes).expect("encodes");
        assert_eq!(bytes, [0xf6]);
        let mut bytes = Vec::new();
        ciborium::into_writer(&Push(7), &mut bytes).expect("encodes");
        assert_eq!(bytes, [0x07]);
    }

    #[test]
    fn wire_names() {
        assert!(valid_wire_name("tally"));
        assert!(valid_wire_name("A.z_0-9"));
        assert!(valid_wire_name(&"x".repeat(64)));
        assert!(!valid_wire_name(&"x".repeat(65)));
        assert!(!valid_wire_name(""));
        assert!(!valid_wire_name("has space"));
        assert!(!valid_wire_name("café"));
        assert!(!valid_wire_name("a/b"));
    }
}
