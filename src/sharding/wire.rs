//! The sharding layer's messages between nodes, and the wire form of its errors.
//!
//! Two transport channels carry them (numbers in [`crate::wire::channels`]):
//! the data channel carries envelopes, passivation requests and replies
//! ([`DataMsg`]); the control channel, on the pipes' priority lane, carries
//! the coordinator's protocol ([`ControlMsg`]). Both are CBOR through serde,
//! each message one `Oneway` frame payload. SPEC.md §13 gives the byte layout.

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::entity::DeliveryRow;
use crate::model::envelope::ReplyTarget;
pub use crate::model::error::RemoteError;
use crate::model::identity::UniqueAddress;
pub(crate) use crate::sharding::fast::{CompactEnvelopeRef, EnvelopeRef};
use crate::wire::payload;

/// A message on the data channel, as decoded by the receiver.
#[derive(Debug, Deserialize)]
pub(crate) enum DataMsg {
    /// A message for an entity.
    Envelope(Envelope),
    /// Passivate an entity (sent where its shard lives).
    Passivate {
        /// The protocol's wire name.
        type_name: String,
        /// The entity's shard.
        shard: u32,
        /// The entity.
        entity_id: String,
    },
    /// The answer to an ask, sent to the node that asked.
    Reply {
        /// The asker's ask id.
        ask_id: u64,
        /// The encoded reply, or why there is none.
        result: ReplyBody,
    },
    /// The compact form of an envelope its origin sends (protocol version
    /// 3): hops 0, asked by the pipe's peer if asked.
    E(CompactEnvelope),
    /// The compact form of an `Ok` reply (protocol version 3): the ask id
    /// and the encoded reply.
    R(u64, #[serde(with = "payload")] Bytes),
}

/// [`DataMsg::E`]'s array: type name, fingerprint, shard, generation,
/// entity id, index, ask id (`None` for a tell), payload.
#[derive(Debug, Deserialize)]
pub(crate) struct CompactEnvelope(
    pub(crate) String,
    pub(crate) u64,
    pub(crate) u32,
    pub(crate) u64,
    pub(crate) String,
    pub(crate) u16,
    pub(crate) Option<u64>,
    #[serde(with = "payload")] pub(crate) Bytes,
);

/// An entity message on its way to the node that hosts its shard.
#[derive(Debug, Deserialize)]
pub(crate) struct Envelope {
    pub(crate) type_name: String,
    pub(crate) fingerprint: u64,
    pub(crate) shard: u32,
    pub(crate) generation: u64,
    pub(crate) entity_id: String,
    pub(crate) index: u16,
    pub(crate) hops: u8,
    pub(crate) reply_to: Option<ReplyTarget>,
    #[serde(with = "payload")]
    pub(crate) payload: Bytes,
    /// A reliable producer's tag, `[producer, epoch, seq]` (SPEC §13.17).
    #[serde(default)]
    pub(crate) delivery: Option<(String, u64, u64)>,
    /// The fingerprint of the message's own line, when `fingerprint` is
    /// the protocol's whole one (SPEC §13.6).
    #[serde(default)]
    pub(crate) line: Option<u64>,
}

/// The encoding side of [`DataMsg`]: the same shape, borrowing its fields.
#[derive(Debug, Serialize)]
pub(crate) enum DataMsgOut<'a> {
    Envelope(EnvelopeRef<'a>),
    Passivate {
        type_name: &'a str,
        shard: u32,
        entity_id: &'a str,
    },
    Reply {
        ask_id: u64,
        result: ReplyBodyOut<'a>,
    },
    /// Written by `fast::encode_envelope_compact`; serde's encoding is
    /// what tests compare with.
    #[cfg_attr(not(test), allow(dead_code))]
    E(CompactEnvelopeRef<'a>),
    /// Written by `fast::encode_reply_ok_compact`; likewise.
    #[cfg_attr(not(test), allow(dead_code))]
    R(u64, #[serde(with = "payload::borrowed")] &'a [u8]),
}

/// A reply's body: the CBOR-encoded reply value, or an error.
#[derive(Debug, Deserialize)]
pub(crate) enum ReplyBody {
    Ok(#[serde(with = "payload")] Bytes),
    Err(RemoteError),
}

/// The encoding side of [`ReplyBody`].
#[derive(Debug, Serialize)]
pub(crate) enum ReplyBodyOut<'a> {
    /// Written by `fast::encode_reply_ok` in these exact bytes; serde's
    /// encoding of it is what tests compare with.
    #[cfg_attr(not(test), allow(dead_code))]
    Ok(#[serde(with = "payload::borrowed")] &'a [u8]),
    Err(&'a RemoteError),
}

impl DataMsgOut<'_> {
    /// CBOR bytes of the message.
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(96);
        // Writing into a Vec cannot fail, and every field serializes.
        if let Err(error) = ciborium::into_writer(self, &mut out) {
            tracing::error!(%error, "BUG: a sharding data message did not encode");
        }
        out
    }
}

/// A new owner's request on the migration channel (a transport `Request`
/// frame), to the old owner of a shard it now hosts.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum MigrationRequest {
    /// Chunk `chunk` (from 0) of the states kept for the asker, which
    /// hosts `shard` of `type_name` under `generation`.
    Pull {
        type_name: String,
        shard: u32,
        generation: u64,
        chunk: u32,
    },
    /// The asker has every chunk: the old owner may drop them.
    Done {
        type_name: String,
        shard: u32,
        generation: u64,
    },
}

/// The old owner's answer to a [`MigrationRequest::Pull`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum MigrationReply {
    /// The chunk: `[entity_id, version, state, position]` each; `last`:
    /// nothing follows.
    Chunk {
        states: Vec<MigratedEntry>,
        last: bool,
    },
    /// The shard has not moved on from the old owner yet: ask again.
    NotYet,
    /// No states for the asker (why).
    Nothing { reason: String },
}

/// One entity's state in a [`MigrationReply::Chunk`]: its id, the
/// version of its encoding, the state, (of a durable type) where it
/// stands in its store, else 0, and its deliveries table if not empty.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct MigratedEntry(
    pub(crate) String,
    pub(crate) u32,
    #[serde(with = "payload")] pub(crate) Bytes,
    pub(crate) u64,
    /// Its deliveries table (SPEC §13.17): present only when not empty.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub(crate) Vec<DeliveryRow>,
);

/// CBOR bytes of a migration message.
pub(crate) fn encode_cbor<T: Serialize>(msg: &T) -> Bytes {
    let mut out = Vec::with_capacity(64);
    // Writing into a Vec cannot fail, and every field serializes.
    if let Err(error) = ciborium::into_writer(msg, &mut out) {
        tracing::error!(%error, "BUG: a sharding migration message did not encode");
    }
    out.into()
}

/// One entity type as a region registers it with the coordinator.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct TypeRegistration {
    pub(crate) type_name: String,
    pub(crate) fingerprint: u64,
    /// The protocol's fingerprint up to each of its lines (SPEC §13.6):
    /// a coordinator registers a version whose lines extend the type's, or
    /// are extended by them. Empty from a sender that names no lines (then
    /// only whole fingerprints compare).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub(crate) lines: Vec<u64>,
    pub(crate) num_shards: u32,
    /// Every home this region knows (its replica of the table, its own
    /// shards included): shard, owner, generation.
    pub(crate) homes: Vec<(u32, UniqueAddress, u64)>,
    /// A proxy-only region: it routes, and is never given shards.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub(crate) proxy: bool,
    /// The region is leaving (a graceful leave is under way): it keeps
    /// what it owns until handed off, and is given nothing new.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub(crate) leaving: bool,
    /// Shards among `homes` on this node whose handoff has stopped their
    /// entities: hosted in name only, waiting for their next home.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub(crate) stopped: Vec<u32>,
}

/// The coordinator's protocol, on the control channel.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum ControlMsg {
    /// Region → coordinator: every type this node hosts a region of, and
    /// what it hosts. Sent when a type is registered and to every new
    /// coordinator; idempotent.
    Register {
        types: Vec<TypeRegistration>,
        /// The highest coordinator epoch this node has accepted (0: none),
        /// so a new coordinator takes an epoch above every earlier one.
        #[serde(default)]
        epoch: u64,
        /// How much longer, in milliseconds, a coordinator taking over
        /// should allocate nothing for what this node knows (§13.15 rule
        /// 3): a member it saw downed within a margin, or the quiet period
        /// its coordinator's last table named. Absent when none.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        quiet_ms: Option<u64>,
        /// The application version this node runs (`ClusterConfig::
        /// app_version`, SPEC §13.2), as written; absent for `"0"` (and
        /// from builds that predate it). One that does not parse counts
        /// as `"0"`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        app_version: Option<String>,
    },
    /// Region → coordinator: this node's regions of these types stop (its
    /// sharded system shuts down); their shards need new homes.
    Unregister {
        types: Vec<String>,
        /// As `Register`'s: what this node knows of a quiet period (a
        /// stopped system's node may have seen a member downed that a new
        /// coordinator never saw).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        quiet_ms: Option<u64>,
    },
    /// Region → coordinator: where does this shard live? (Its messages wait
    /// in the region's buffer meanwhile.)
    GetHome {
        type_name: String,
        shard: u32,
        /// The highest generation the asking region has seen for the shard.
        generation: u64,
    },
    /// Coordinator → regions: the shard's home, with its allocation generation.
    Home {
        type_name: String,
        shard: u32,
        owner: UniqueAddress,
        generation: u64,
        /// The sending coordinator's epoch (its term, §13.15); a region
        /// ignores a message from an epoch below the highest it accepted.
        #[serde(default)]
        epoch: u64,
        /// The old owner, when this allocation follows its handoff of the
        /// shard (its `ShardStopped`): the new owner may fetch the states
        /// its entities handed over (§13.16). Absent otherwise.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        from: Option<UniqueAddress>,
    },
    /// Coordinator → a registering region: every known home of the type.
    Table {
        type_name: String,
        homes: Vec<(u32, UniqueAddress, u64)>,
        /// The sending coordinator's epoch (its term, §13.15); a region
        /// ignores a message from an epoch below the highest it accepted.
        #[serde(default)]
        epoch: u64,
        /// How much longer, in milliseconds, the sending coordinator
        /// allocates nothing (a takeover's quiet period, §13.15): a node
        /// that takes the role over from it by its graceful leave keeps
        /// to it. Absent when it is not quiet.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        quiet_ms: Option<u64>,
        /// The application version of every member registered with the
        /// sending coordinator, as written (`"0"` for one that names
        /// none). Absent from builds that predate it.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        app_versions: Vec<(UniqueAddress, String)>,
    },
    /// Region → coordinator: a message of a protocol line this node's
    /// version lacks reached `shard`, which it hosts: move the shard to a
    /// node of the type's newest version, if one is eligible (SPEC §13.6).
    NeedsNewer { type_name: String, shard: u32 },
    /// Region node → coordinator, once a second while placement by
    /// traffic is on (SPEC §13.11): the messages its entities sent since
    /// the last, sampled, each as `[from type, from shard, to type, to
    /// shard, count]`.
    Traffic {
        pairs: Vec<(String, u32, String, u32, u64)>,
    },
    /// Coordinator → region: the registration of this type was refused.
    Refused {
        type_name: String,
        reason: String,
        /// The type's fingerprint and shard count in the cluster's table,
        /// when the refusal is a mismatch with it.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        cluster_fingerprint: Option<u64>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        cluster_num_shards: Option<u32>,
        /// The first line (1-based) at which the region's protocol and the
        /// cluster's differ, when both named their lines.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        differing_line: Option<u32>,
    },
    /// Coordinator → the shard's owner: stop the shard's entities (each
    /// finishes its mailbox), buffer what arrives meanwhile, and report
    /// `ShardStopped`. Sent again until the report comes.
    HandOff {
        type_name: String,
        shard: u32,
        generation: u64,
        /// The sending coordinator's epoch (its term, §13.15); a region
        /// ignores a message from an epoch below the highest it accepted.
        #[serde(default)]
        epoch: u64,
    },
    /// Owner → coordinator: every entity of the shard hosted under
    /// `generation` has stopped; it may be allocated anew. Sent again until
    /// a newer home of the shard arrives.
    ShardStopped {
        type_name: String,
        shard: u32,
        generation: u64,
    },
    /// Region → coordinator: this node leaves (its system shuts down
    /// gracefully): hand off every shard it owns of these types, and give
    /// it no new ones.
    Leave { types: Vec<String> },
    /// Coordinator → a leaving region: nothing more of this type will move
    /// off it. `nowhere` false: it owns none of its shards now (the homes
    /// were sent before; it is done once it has applied them — it hosts
    /// none); true: no other region can take them, it keeps them.
    Left {
        type_name: String,
        nowhere: bool,
        /// The sending coordinator's epoch (its term, §13.15); a region
        /// ignores a message from an epoch below the highest it accepted.
        #[serde(default)]
        epoch: u64,
    },
    /// Any node → any node: what does your region of this type host?
    GetStats { id: u64, type_name: String },
    /// The answer: hosted shards with their live entities; `region` false
    /// when the node has no region of the type.
    Stats {
        id: u64,
        region: bool,
        shards: Vec<(u32, u32)>,
        /// Present when the answering node is the acting coordinator.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        coordinator: Option<ActiveCoordinator>,
        /// The answering node's application version, as `Register`'s
        /// (absent: `"0"`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        app_version: Option<String>,
        /// The asks the answering node sent to the type since its region
        /// started (absent without a region, and from older builds).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        asks: Option<AskCountsWire>,
        /// The answering node's roles (absent when it has none).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        roles: Vec<String>,
    },
}

/// A node's ask counts, in its `Stats` answer.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct AskCountsWire {
    /// Answered asks by latency bucket (SPEC §14's bounds, one more above).
    pub(crate) answered: Vec<u64>,
    /// Failed asks by kind.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub(crate) failed: Vec<(String, u64)>,
}

/// A coordinator's word on itself, in its `Stats` answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct ActiveCoordinator {
    pub(crate) epoch: u64,
    pub(crate) allocating: bool,
}

impl ControlMsg {
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(64);
        if let Err(error) = ciborium::into_writer(self, &mut out) {
            tracing::error!(%error, "BUG: a sharding control message did not encode");
        }
        out
    }

    /// The epoch a coordinator stamped on this message; `None` for the
    /// messages coordinators do not send.
    pub(crate) fn coordinator_epoch(&self) -> Option<u64> {
        match self {
            ControlMsg::Home { epoch, .. }
            | ControlMsg::Table { epoch, .. }
            | ControlMsg::HandOff { epoch, .. }
            | ControlMsg::Left { epoch, .. } => Some(*epoch),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::identity::NodeId;
    use crate::sharding::fast::DeliveryRef;

    /// Hex bytes written in rows, as SPEC prints them.
    fn hex(rows: &str) -> Vec<u8> {
        rows.split_whitespace()
            .map(|b| u8::from_str_radix(b, 16).expect("hex byte"))
            .collect()
    }

    fn origin() -> UniqueAddress {
        UniqueAddress {
            addr: "127.0.0.1:7355".parse().expect("literal address"),
            node_id: NodeId(0x0123_4567_89ab_cdef),
            incarnation: 1_700_000_000_000_000,
        }
    }

    /// The fingerprint of `Tally = "tally" { tell Push; ask Home -> String; }`
    /// (SPEC §13, and `private::tests`).
    const TALLY_FINGERPRINT: u64 = 0x10f4_3ecc_488b_4809;

    /// The `Home` message of that protocol, a unit struct: CBOR `null`.
    const HOME_PAYLOAD: [u8; 1] = [0xf6];

    fn example_envelope() -> DataMsgOut<'static> {
        DataMsgOut::Envelope(EnvelopeRef {
            type_name: "tally",
            fingerprint: TALLY_FINGERPRINT,
            shard: 5,
            generation: 3,
            entity_id: "tally-1",
            index: 1,
            hops: 0,
            reply_to: Some(ReplyTarget {
                origin: origin(),
                ask_id: 7,
            }),
            payload: &HOME_PAYLOAD,
            trace: None,
            delivery: None,
            line: None,
        })
    }

    #[test]
    fn spec_envelope_example_bytes() {
        // As printed in SPEC §13.4, row by row.
        let spec = "
            a1 68 45 6e 76 65 6c 6f 70 65
            a9 69 74 79 70 65 5f 6e 61 6d 65 65 74 61 6c 6c 79
            6b 66 69 6e 67 65 72 70 72 69 6e 74 1b 10 f4 3e cc 48 8b 48 09
            65 73 68 61 72 64 05
            6a 67 65 6e 65 72 61 74 69 6f 6e 03
            69 65 6e 74 69 74 79 5f 69 64 67 74 61 6c 6c 79 2d 31
            65 69 6e 64 65 78 01
            64 68 6f 70 73 00
            68 72 65 70 6c 79 5f 74 6f a2
            66 6f 72 69 67 69 6e a3
            64 61 64 64 72 a1 62 56 34 82 84 18 7f 00 00 01 19 1c bb
            67 6e 6f 64 65 5f 69 64 1b 01 23 45 67 89 ab cd ef
            6b 69 6e 63 61 72 6e 61 74 69 6f 6e 1b 00 06 0a 24 18 1e 40 00
            66 61 73 6b 5f 69 64 07
            67 70 61 79 6c 6f 61 64 41 f6
        ";
        let bytes = example_envelope().encode();
        assert_eq!(bytes, hex(spec));
        assert_eq!(bytes.len(), 191);
    }

    #[test]
    fn spec_compact_example_bytes() {
        // SPEC §13.4's compact forms (protocol version 3): the example ask
        // as `E`, sent by ORIGIN itself, and its answer as `R`.
        let DataMsgOut::Envelope(envelope) = example_envelope() else {
            unreachable!()
        };
        assert!(envelope.is_compact_from(&origin()));
        let spec = "
            a1 61 45 88
            65 74 61 6c 6c 79
            1b 10 f4 3e cc 48 8b 48 09
            05 03
            67 74 61 6c 6c 79 2d 31
            01 07 41 f6
        ";
        let mut fast = Vec::new();
        crate::sharding::fast::encode_envelope_compact(&mut fast, &envelope);
        assert_eq!(fast, hex(spec));
        assert_eq!(fast.len(), 33);
        let serde = DataMsgOut::E(CompactEnvelopeRef(
            "tally",
            TALLY_FINGERPRINT,
            5,
            3,
            "tally-1",
            1,
            Some(7),
            &HOME_PAYLOAD,
        ));
        assert_eq!(serde.encode(), fast);
        // Read from ORIGIN's pipe it is the long form's envelope.
        let read = crate::sharding::fast::decode(&fast, &origin());
        assert_eq!(
            read,
            Some(crate::sharding::fast::DataRef::Envelope(envelope))
        );
        // As a tell, `null` (f6) where the ask id was.
        let mut tell = envelope;
        tell.reply_to = None;
        let mut told = Vec::new();
        crate::sharding::fast::encode_envelope_compact(&mut told, &tell);
        assert_eq!(told[..30], fast[..30]);
        assert_eq!(told[30..], [0xf6, 0x41, 0xf6]);
        // The answer "n1".
        let mut reply = Vec::new();
        crate::sharding::fast::encode_reply_ok_compact(&mut reply, 7, &[0x62, 0x6e, 0x31]);
        assert_eq!(reply, hex("a1 61 52 82 07 43 62 6e 31"));
        assert_eq!(DataMsgOut::R(7, &[0x62, 0x6e, 0x31]).encode(), reply);
    }

    #[test]
    fn spec_traced_envelope_example_bytes() {
        // SPEC §13.4's envelope with a trace context (SPEC §14.2): the map
        // head a9 becomes aa, and ten more bytes follow the payload.
        let DataMsgOut::Envelope(mut envelope) = example_envelope() else {
            unreachable!()
        };
        let context = crate::ops::telemetry::TraceContext {
            trace_id: *b"\x4b\xf9\x2f\x35\x77\xb3\x4d\xa6\xa3\xce\x92\x9d\x0e\x0e\x47\x36",
            span_id: *b"\x00\xf0\x67\xaa\x0b\xa9\x02\xb7",
            flags: 1,
        };
        envelope.trace = Some(context.to_bytes());
        let traced = DataMsgOut::Envelope(envelope).encode();
        let plain = example_envelope().encode();
        assert_eq!(traced[10], 0xaa);
        assert_eq!(traced[11..plain.len()], plain[11..]);
        let spec = "
            65 74 72 61 63 65 58 1a
            00 4b f9 2f 35 77 b3 4d a6 a3 ce 92 9d 0e 0e 47 36
            00 f0 67 aa 0b a9 02 b7 01
        ";
        assert_eq!(traced[plain.len()..], hex(spec));
        assert_eq!(traced.len(), 191 + 34);
        // The hand codec writes the same bytes.
        let mut fast = Vec::new();
        crate::sharding::fast::encode_envelope(&mut fast, &envelope);
        assert_eq!(fast, traced);
    }

    #[test]
    fn spec_reliable_envelope_example_bytes() {
        // SPEC §13.17's envelope: §13.4's with a reliable producer's tag
        // (producer "orders", epoch 1796000000000000, seq 7): the map head
        // a9 becomes aa, and 27 bytes follow the payload.
        let DataMsgOut::Envelope(mut envelope) = example_envelope() else {
            unreachable!()
        };
        envelope.delivery = Some(DeliveryRef("orders", 1_796_000_000_000_000, 7));
        let tagged = DataMsgOut::Envelope(envelope).encode();
        let plain = example_envelope().encode();
        assert_eq!(tagged[10], 0xaa);
        assert_eq!(tagged[11..plain.len()], plain[11..]);
        let spec = "
            68 64 65 6c 69 76 65 72 79 83
            66 6f 72 64 65 72 73
            1b 00 06 61 73 d6 04 40 00
            07
        ";
        assert_eq!(tagged[plain.len()..], hex(spec));
        assert_eq!(tagged.len(), 191 + 27);
        let mut fast = Vec::new();
        crate::sharding::fast::encode_envelope(&mut fast, &envelope);
        assert_eq!(fast, tagged);
        // Both decoders read the tag.
        let Some(crate::sharding::fast::DataRef::Envelope(read)) =
            crate::sharding::fast::decode(&tagged, &origin())
        else {
            panic!("the tagged envelope decodes");
        };
        assert_eq!(read.delivery, envelope.delivery);
        let Ok(DataMsg::Envelope(e)) = ciborium::from_reader::<DataMsg, _>(&tagged[..]) else {
            panic!("serde reads the tagged envelope");
        };
        assert_eq!(
            e.delivery,
            Some(("orders".into(), 1_796_000_000_000_000, 7))
        );
    }

    #[test]
    fn a_migrated_entry_carries_its_deliveries_only_when_it_has_some() {
        let bare = MigratedEntry("a-1".into(), 1, Bytes::from_static(&[0xf6]), 0, Vec::new());
        let bytes = encode_cbor(&bare);
        assert_eq!(bytes[0], 0x84, "four elements, as before the table");
        let back: MigratedEntry = ciborium::from_reader(&bytes[..]).expect("decodes");
        assert_eq!(back, bare);
        let rows = vec![DeliveryRow("orders".into(), 9, 4)];
        let tagged = MigratedEntry("a-1".into(), 1, Bytes::from_static(&[0xf6]), 0, rows);
        let bytes = encode_cbor(&tagged);
        assert_eq!(bytes[0], 0x85, "a fifth element: the table");
        let back: MigratedEntry = ciborium::from_reader(&bytes[..]).expect("decodes");
        assert_eq!(back, tagged);
    }

    #[test]
    fn spec_reply_example_bytes() {
        // The reply `"n1"` (a String: CBOR text 62 6e 31) to ask 7.
        let reply_value: &[u8] = &[0x62, 0x6e, 0x31];
        let msg = DataMsgOut::Reply {
            ask_id: 7,
            result: ReplyBodyOut::Ok(reply_value),
        };
        let spec = "
            a1 65 52 65 70 6c 79
            a2 66 61 73 6b 5f 69 64 07
            66 72 65 73 75 6c 74 a1 62 4f 6b 43 62 6e 31
        ";
        assert_eq!(msg.encode(), hex(spec));
    }

    #[test]
    fn spec_error_and_passivate_bytes() {
        // An error reply: {"Reply": {"ask_id": 9, "result": {"Err": "EntityStopped"}}}.
        let stopped = RemoteError::EntityStopped;
        let msg = DataMsgOut::Reply {
            ask_id: 9,
            result: ReplyBodyOut::Err(&stopped),
        };
        let spec = "
            a1 65 52 65 70 6c 79
            a2 66 61 73 6b 5f 69 64 09
            66 72 65 73 75 6c 74 a1 63 45 72 72
            6d 45 6e 74 69 74 79 53 74 6f 70 70 65 64
        ";
        assert_eq!(msg.encode(), hex(spec));
        // A struct variant: {"TooManyHops": {"hops": 4}}.
        let mut bytes = Vec::new();
        ciborium::into_writer(&RemoteError::TooManyHops { hops: 4 }, &mut bytes).expect("encodes");
        assert_eq!(
            bytes,
            hex("a1 6b 54 6f 6f 4d 61 6e 79 48 6f 70 73 a1 64 68 6f 70 73 04")
        );
        // A newtype variant: {"Handler": "no"}.
        let mut bytes = Vec::new();
        ciborium::into_writer(&RemoteError::Handler("no".into()), &mut bytes).expect("encodes");
        assert_eq!(bytes, hex("a1 67 48 61 6e 64 6c 65 72 62 6e 6f"));
        // {"Passivate": {"type_name": "tally", "shard": 5, "entity_id": "tally-1"}}.
        let msg = DataMsgOut::Passivate {
            type_name: "tally",
            shard: 5,
            entity_id: "tally-1",
        };
        let spec = "
            a1 69 50 61 73 73 69 76 61 74 65
            a3 69 74 79 70 65 5f 6e 61 6d 65 65 74 61 6c 6c 79
            65 73 68 61 72 64 05
            69 65 6e 74 69 74 79 5f 69 64 67 74 61 6c 6c 79 2d 31
        ";
        assert_eq!(msg.encode(), hex(spec));
    }

    /// SPEC §13.16's examples: a `Home` naming the old owner, and the
    /// migration channel's messages, byte for byte; each decodes back.
    #[test]
    fn spec_migration_example_bytes() {
        let home = ControlMsg::Home {
            type_name: "tally".into(),
            shard: 5,
            owner: origin(),
            generation: 3,
            epoch: 2,
            from: Some(origin()),
        };
        let spec = format!(
            "a1 64 48 6f 6d 65
             a6 69 74 79 70 65 5f 6e 61 6d 65 65 74 61 6c 6c 79
             65 73 68 61 72 64 05
             65 6f 77 6e 65 72 {ORIGIN}
             6a 67 65 6e 65 72 61 74 69 6f 6e 03
             65 65 70 6f 63 68 02
             64 66 72 6f 6d {ORIGIN}"
        );
        assert_eq!(home.encode(), hex(&spec));
        let pull = MigrationRequest::Pull {
            type_name: "tally".into(),
            shard: 5,
            generation: 3,
            chunk: 0,
        };
        let spec = "
            a1 64 50 75 6c 6c a4 69 74 79 70 65 5f 6e 61 6d 65 65 74 61 6c 6c 79
            65 73 68 61 72 64 05 6a 67 65 6e 65 72 61 74 69 6f 6e 03 65 63 68 75 6e 6b 00
        ";
        let done = MigrationRequest::Done {
            type_name: "tally".into(),
            shard: 5,
            generation: 3,
        };
        let done_spec = "
            a1 64 44 6f 6e 65 a3 69 74 79 70 65 5f 6e 61 6d 65 65 74 61 6c 6c 79
            65 73 68 61 72 64 05 6a 67 65 6e 65 72 61 74 69 6f 6e 03
        ";
        for (request, spec) in [(pull, spec), (done, done_spec)] {
            assert_eq!(encode_cbor(&request)[..], hex(spec)[..]);
            let back: MigrationRequest = ciborium::from_reader(&hex(spec)[..]).expect("decodes");
            assert_eq!(back, request);
        }
        let mut state = Vec::new();
        ciborium::into_writer(&10u64, &mut state).expect("encodes");
        let chunk = MigrationReply::Chunk {
            states: vec![MigratedEntry("a-1".into(), 1, state.into(), 0, Vec::new())],
            last: true,
        };
        let chunk_spec = "
            a1 65 43 68 75 6e 6b a2 66 73 74 61 74 65 73 81 84 63 61 2d 31 01 41 0a 00
            64 6c 61 73 74 f5
        ";
        let not_yet_spec = "66 4e 6f 74 59 65 74";
        for (reply, spec) in [(chunk, chunk_spec), (MigrationReply::NotYet, not_yet_spec)] {
            assert_eq!(encode_cbor(&reply)[..], hex(spec)[..]);
            let back: MigrationReply = ciborium::from_reader(&hex(spec)[..]).expect("decodes");
            assert_eq!(back, reply);
        }
        // A Home without `from` (every other one) is the 5-entry map of §13.2.
        let home: ControlMsg =
            ciborium::from_reader(&hex(&spec_home_without_from())[..]).expect("decodes");
        assert!(matches!(home, ControlMsg::Home { from: None, .. }));
    }

    /// §13.2's `Home{type_name: "tally", shard: 5, owner: ORIGIN,
    /// generation: 3, epoch: 2}`.
    fn spec_home_without_from() -> String {
        format!(
            "a1 64 48 6f 6d 65
             a5 69 74 79 70 65 5f 6e 61 6d 65 65 74 61 6c 6c 79
             65 73 68 61 72 64 05
             65 6f 77 6e 65 72 {ORIGIN}
             6a 67 65 6e 65 72 61 74 69 6f 6e 03
             65 65 70 6f 63 68 02"
        )
    }

    /// The `UniqueAddress` of [`origin`], as SPEC §9.1 encodes it.
    const ORIGIN: &str = "
        a3 64 61 64 64 72 a1 62 56 34 82 84 18 7f 00 00 01 19 1c bb
        67 6e 6f 64 65 5f 69 64 1b 01 23 45 67 89 ab cd ef
        6b 69 6e 63 61 72 6e 61 74 69 6f 6e 1b 00 06 0a 24 18 1e 40 00
    ";

    #[test]
    fn spec_control_example_bytes() {
        let get_home = ControlMsg::GetHome {
            type_name: "tally".into(),
            shard: 5,
            generation: 2,
        };
        let spec = "
            a1 67 47 65 74 48 6f 6d 65
            a3 69 74 79 70 65 5f 6e 61 6d 65 65 74 61 6c 6c 79
            65 73 68 61 72 64 05
            6a 67 65 6e 65 72 61 74 69 6f 6e 02
        ";
        assert_eq!(get_home.encode(), hex(spec));
        let home = ControlMsg::Home {
            type_name: "tally".into(),
            shard: 5,
            owner: origin(),
            generation: 3,
            epoch: 2,
            from: None,
        };
        assert_eq!(home.encode(), hex(&spec_home_without_from()));
        // A home in a table or registration is an array [shard, owner, generation].
        let table = ControlMsg::Table {
            type_name: "tally".into(),
            homes: vec![(5, origin(), 3)],
            epoch: 2,
            quiet_ms: None,
            app_versions: Vec::new(),
        };
        let spec = format!(
            "a1 65 54 61 62 6c 65
             a3 69 74 79 70 65 5f 6e 61 6d 65 65 74 61 6c 6c 79
             65 68 6f 6d 65 73 81 83 05 {ORIGIN} 03
             65 65 70 6f 63 68 02"
        );
        assert_eq!(table.encode(), hex(&spec));
        // With the members' application versions: one more key.
        let versioned = ControlMsg::Table {
            type_name: "tally".into(),
            homes: vec![(5, origin(), 3)],
            epoch: 2,
            quiet_ms: None,
            app_versions: vec![(origin(), "2.1".into())],
        };
        let spec = format!(
            "a1 65 54 61 62 6c 65
             a4 69 74 79 70 65 5f 6e 61 6d 65 65 74 61 6c 6c 79
             65 68 6f 6d 65 73 81 83 05 {ORIGIN} 03
             65 65 70 6f 63 68 02
             6c 61 70 70 5f 76 65 72 73 69 6f 6e 73 81 82 {ORIGIN} 63 32 2e 31"
        );
        assert_eq!(versioned.encode(), hex(&spec));
        // The handoff and stats messages (SPEC §13.11, §13.13).
        let handoff = ControlMsg::HandOff {
            type_name: "tally".into(),
            shard: 5,
            generation: 3,
            epoch: 2,
        };
        let spec = "
            a1 67 48 61 6e 64 4f 66 66
            a4 69 74 79 70 65 5f 6e 61 6d 65 65 74 61 6c 6c 79
            65 73 68 61 72 64 05
            6a 67 65 6e 65 72 61 74 69 6f 6e 03
            65 65 70 6f 63 68 02
        ";
        assert_eq!(handoff.encode(), hex(spec));
        let stopped = ControlMsg::ShardStopped {
            type_name: "tally".into(),
            shard: 5,
            generation: 3,
        };
        let spec = "
            a1 6c 53 68 61 72 64 53 74 6f 70 70 65 64
            a3 69 74 79 70 65 5f 6e 61 6d 65 65 74 61 6c 6c 79
            65 73 68 61 72 64 05
            6a 67 65 6e 65 72 61 74 69 6f 6e 03
        ";
        assert_eq!(stopped.encode(), hex(spec));
        let leave = ControlMsg::Leave {
            types: vec!["tally".into()],
        };
        let spec = "a1 65 4c 65 61 76 65 a1 65 74 79 70 65 73 81 65 74 61 6c 6c 79";
        assert_eq!(leave.encode(), hex(spec));
        let left = ControlMsg::Left {
            type_name: "tally".into(),
            nowhere: false,
            epoch: 2,
        };
        let spec = "
            a1 64 4c 65 66 74
            a3 69 74 79 70 65 5f 6e 61 6d 65 65 74 61 6c 6c 79
            67 6e 6f 77 68 65 72 65 f4 65 65 70 6f 63 68 02
        ";
        assert_eq!(left.encode(), hex(spec));
        let register = ControlMsg::Register {
            types: Vec::new(),
            epoch: 2,
            quiet_ms: None,
            app_version: None,
        };
        let spec = "a1 68 52 65 67 69 73 74 65 72 a2 65 74 79 70 65 73 80 65 65 70 6f 63 68 02";
        assert_eq!(register.encode(), hex(spec));
        // With an application version: one more key, its text.
        let versioned = ControlMsg::Register {
            types: Vec::new(),
            epoch: 2,
            quiet_ms: None,
            app_version: Some("2.1".into()),
        };
        let spec = "a1 68 52 65 67 69 73 74 65 72 a3 65 74 79 70 65 73 80 65 65 70 6f 63 68 02
                    6b 61 70 70 5f 76 65 72 73 69 6f 6e 63 32 2e 31";
        assert_eq!(versioned.encode(), hex(spec));
        // A message from a peer that predates epochs decodes as epoch 0.
        let old_home = hex(&format!(
            "a1 64 48 6f 6d 65
             a4 69 74 79 70 65 5f 6e 61 6d 65 65 74 61 6c 6c 79
             65 73 68 61 72 64 05
             65 6f 77 6e 65 72 {ORIGIN}
             6a 67 65 6e 65 72 61 74 69 6f 6e 03"
        ));
        let decoded: ControlMsg = ciborium::from_reader(&old_home[..]).expect("decodes");
        assert_eq!(decoded.coordinator_epoch(), Some(0));
        let get_stats = ControlMsg::GetStats {
            id: 7,
            type_name: "tally".into(),
        };
        let spec = "
            a1 68 47 65 74 53 74 61 74 73
            a2 62 69 64 07 69 74 79 70 65 5f 6e 61 6d 65 65 74 61 6c 6c 79
        ";
        assert_eq!(get_stats.encode(), hex(spec));
        let stats = ControlMsg::Stats {
            id: 7,
            region: true,
            shards: vec![(5, 2)],
            coordinator: None,
            app_version: None,
            asks: None,
            roles: Vec::new(),
        };
        let spec = "
            a1 65 53 74 61 74 73
            a3 62 69 64 07 66 72 65 67 69 6f 6e f5
            66 73 68 61 72 64 73 81 82 05 02
        ";
        assert_eq!(stats.encode(), hex(spec));
        // With ask counts (two buckets here; 23 from a node) and a role.
        let counted = ControlMsg::Stats {
            id: 7,
            region: true,
            shards: vec![(5, 2)],
            coordinator: None,
            app_version: None,
            asks: Some(AskCountsWire {
                answered: vec![0, 3],
                failed: vec![("ask_timeout".into(), 1)],
            }),
            roles: vec!["web".into()],
        };
        let spec = "
            a1 65 53 74 61 74 73
            a5 62 69 64 07 66 72 65 67 69 6f 6e f5
            66 73 68 61 72 64 73 81 82 05 02
            64 61 73 6b 73 a2 68 61 6e 73 77 65 72 65 64 82 00 03
            66 66 61 69 6c 65 64 81 82 6b 61 73 6b 5f 74 69 6d 65 6f 75 74 01
            65 72 6f 6c 65 73 81 63 77 65 62
        ";
        assert_eq!(counted.encode(), hex(spec));
        let decoded: ControlMsg = ciborium::from_reader(&hex(spec)[..]).expect("decodes");
        assert_eq!(decoded, counted);
        // A proxy-only registration carries `proxy: true`; a hosting one
        // leaves the field out (and a registration without it hosts).
        let registration = TypeRegistration {
            stopped: Vec::new(),
            type_name: "tally".into(),
            fingerprint: 1,
            lines: vec![],
            num_shards: 8,
            homes: vec![],
            proxy: true,
            leaving: false,
        };
        let mut bytes = Vec::new();
        ciborium::into_writer(&registration, &mut bytes).expect("encodes");
        let spec = "
            a5 69 74 79 70 65 5f 6e 61 6d 65 65 74 61 6c 6c 79
            6b 66 69 6e 67 65 72 70 72 69 6e 74 01
            6a 6e 75 6d 5f 73 68 61 72 64 73 08
            65 68 6f 6d 65 73 80
            65 70 72 6f 78 79 f5
        ";
        assert_eq!(bytes, hex(spec));
        let hosting = TypeRegistration {
            stopped: Vec::new(),
            proxy: false,
            ..registration
        };
        let mut bytes = Vec::new();
        ciborium::into_writer(&hosting, &mut bytes).expect("encodes");
        assert_eq!(bytes[0], 0xa4, "four fields: no `proxy`");
        // With the protocol's lines (SPEC §13.6), as every node sends it.
        let versioned = TypeRegistration {
            fingerprint: TALLY_FINGERPRINT,
            lines: vec![0xbcac_9f54_39be_15f0, TALLY_FINGERPRINT],
            ..hosting.clone()
        };
        let mut versioned_bytes = Vec::new();
        ciborium::into_writer(&versioned, &mut versioned_bytes).expect("encodes");
        let spec = "
            a5 69 74 79 70 65 5f 6e 61 6d 65 65 74 61 6c 6c 79 6b 66 69 6e 67 65 72 70
            72 69 6e 74 1b 10 f4 3e cc 48 8b 48 09 65 6c 69 6e 65 73 82 1b bc ac 9f 54
            39 be 15 f0 1b 10 f4 3e cc 48 8b 48 09 6a 6e 75 6d 5f 73 68 61 72 64 73 08
            65 68 6f 6d 65 73 80
        ";
        assert_eq!(versioned_bytes, hex(spec));
        let back: TypeRegistration = ciborium::from_reader(&bytes[..]).expect("decodes");
        assert_eq!(back, hosting);
        for msg in [
            get_home, home, table, handoff, stopped, leave, left, get_stats, stats,
        ] {
            let back: ControlMsg = ciborium::from_reader(&msg.encode()[..]).expect("decodes");
            assert_eq!(back, msg);
        }
    }

    #[test]
    fn what_data_msg_out_encodes_data_msg_decodes() {
        let decode =
            |bytes: Vec<u8>| -> DataMsg { ciborium::from_reader(&bytes[..]).expect("decodes") };
        let DataMsg::Envelope(envelope) = decode(example_envelope().encode()) else {
            panic!("not an envelope")
        };
        assert_eq!(envelope.type_name, "tally");
        assert_eq!(envelope.fingerprint, TALLY_FINGERPRINT);
        assert_eq!(envelope.shard, 5);
        assert_eq!(envelope.generation, 3);
        assert_eq!(envelope.entity_id, "tally-1");
        assert_eq!(envelope.index, 1);
        assert_eq!(envelope.hops, 0);
        assert_eq!(
            envelope.reply_to,
            Some(ReplyTarget {
                origin: origin(),
                ask_id: 7
            })
        );
        assert_eq!(&envelope.payload[..], &HOME_PAYLOAD);

        // A tell: no reply target (CBOR null), an empty payload.
        let tell = DataMsgOut::Envelope(EnvelopeRef {
            type_name: "tally",
            fingerprint: 1,
            shard: u32::MAX,
            generation: u64::MAX,
            entity_id: "",
            index: u16::MAX,
            hops: u8::MAX,
            reply_to: None,
            payload: &[],
            trace: None,
            delivery: None,
            line: None,
        });
        let DataMsg::Envelope(envelope) = decode(tell.encode()) else {
            panic!("not an envelope")
        };
        assert_eq!(
            (
                envelope.shard,
                envelope.generation,
                envelope.index,
                envelope.hops
            ),
            (u32::MAX, u64::MAX, u16::MAX, u8::MAX)
        );
        assert_eq!(envelope.reply_to, None);
        assert!(envelope.payload.is_empty());

        let passivate = DataMsgOut::Passivate {
            type_name: "tally",
            shard: 5,
            entity_id: "tally-1",
        };
        let DataMsg::Passivate {
            type_name,
            shard,
            entity_id,
        } = decode(passivate.encode())
        else {
            panic!("not a passivation")
        };
        assert_eq!(
            (type_name.as_str(), shard, entity_id.as_str()),
            ("tally", 5, "tally-1")
        );

        let ok = DataMsgOut::Reply {
            ask_id: 7,
            result: ReplyBodyOut::Ok(&[0x62, 0x6e, 0x31]),
        };
        let DataMsg::Reply {
            ask_id: 7,
            result: ReplyBody::Ok(bytes),
        } = decode(ok.encode())
        else {
            panic!("not an Ok reply to ask 7")
        };
        assert_eq!(&bytes[..], &[0x62, 0x6e, 0x31]);

        let errors = [
            RemoteError::BufferOverflow { shard: 3 },
            RemoteError::EntityPanicked { panic: "p".into() },
            RemoteError::EntityStopped,
            RemoteError::HandlerInterrupted,
            RemoteError::Handler("h".into()),
            RemoteError::ShuttingDown,
            RemoteError::NotRegistered,
            RemoteError::InvalidShard {
                shard: 40,
                num_shards: 32,
            },
            RemoteError::RememberEntities {
                shard: 1,
                message: "m".into(),
            },
            RemoteError::ProtocolMismatch {
                receiver: 1,
                sender: 2,
            },
            RemoteError::UnknownMessage { line: 3, lines: 2 },
            RemoteError::Undecodable {
                what: "w".into(),
                error: "e".into(),
            },
            RemoteError::TooManyHops { hops: 4 },
            RemoteError::PeerLost { node: "n".into() },
            RemoteError::Persistence(Box::new(
                crate::persistence::PersistenceError::SequenceConflict {
                    persistence_id: crate::persistence::PersistenceId::new("t", "e"),
                    expected: 0,
                    actual: 1,
                },
            )),
            RemoteError::Other("o".into()),
        ];
        for error in errors {
            let msg = DataMsgOut::Reply {
                ask_id: 1,
                result: ReplyBodyOut::Err(&error),
            };
            let DataMsg::Reply {
                ask_id: 1,
                result: ReplyBody::Err(back),
            } = decode(msg.encode())
            else {
                panic!("not an Err reply")
            };
            assert_eq!(back, error);
        }
    }

    /// A durable entity's error reaches a remote asker as the same typed
    /// error (SPEC §13.4's `Persistence` row).
    #[test]
    fn a_persistence_error_crosses_the_wire_typed() {
        use crate::ShardingError;
        use crate::persistence::{PersistenceError, PersistenceId};
        let conflict = PersistenceError::SequenceConflict {
            persistence_id: PersistenceId::new("tally", "x"),
            expected: 0,
            actual: 1,
        };
        let error = ShardingError::Persistence {
            type_name: "tally",
            entity_id: "x".into(),
            error: Box::new(conflict.clone()),
        };
        let node = UniqueAddress {
            addr: "127.0.0.1:1".parse().expect("an address"),
            node_id: crate::model::identity::NodeId(1),
            incarnation: 1,
        };
        let back = RemoteError::from(&error).into_error("tally", "x", &node);
        assert_eq!(back, error);
        let mut bytes = Vec::new();
        ciborium::into_writer(&RemoteError::Persistence(Box::new(conflict)), &mut bytes)
            .expect("encode");
        let text = String::from_utf8_lossy(&bytes);
        assert!(text.contains("Persistence") && text.contains("SequenceConflict"));
    }
}
