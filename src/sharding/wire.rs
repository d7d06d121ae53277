//! The sharding layer's messages between nodes, and the wire form of its errors.
//!
//! Two transport channels carry them (numbers in [`crate::wire::channels`]):
//! the data channel carries envelopes, passivation requests and replies
//! ([`DataMsg`]); the control channel, on the pipes' priority lane, carries
//! the coordinator's protocol ([`ControlMsg`]). Both are CBOR through serde,
//! each message one `Oneway` frame payload. SPEC.md §13 gives the byte layout.

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::error::ShardingError;
use crate::identity::UniqueAddress;
use crate::private::ReplyTarget;
use crate::wire::payload;

/// Borrowed serde helper for a byte-string field (the encoding side of
/// [`payload`]).
mod bytes_ref {
    use serde::Serializer;

    pub(crate) fn serialize<S: Serializer>(bytes: &&[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(bytes)
    }
}

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
}

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
}

/// The encoding side of [`DataMsg`]: the same shape, borrowing its fields.
#[derive(Debug, Serialize)]
pub(crate) enum DataMsgOut<'a> {
    Envelope(EnvelopeOut<'a>),
    Passivate {
        type_name: &'a str,
        shard: u32,
        entity_id: &'a str,
    },
    Reply {
        ask_id: u64,
        result: ReplyBodyOut<'a>,
    },
}

/// The encoding side of [`Envelope`].
#[derive(Debug, Serialize)]
pub(crate) struct EnvelopeOut<'a> {
    pub(crate) type_name: &'a str,
    pub(crate) fingerprint: u64,
    pub(crate) shard: u32,
    pub(crate) generation: u64,
    pub(crate) entity_id: &'a str,
    pub(crate) index: u16,
    pub(crate) hops: u8,
    pub(crate) reply_to: Option<ReplyTarget>,
    #[serde(with = "bytes_ref")]
    pub(crate) payload: &'a [u8],
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
    Ok(#[serde(with = "bytes_ref")] &'a [u8]),
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

/// One entity type as a region registers it with the coordinator.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct TypeRegistration {
    pub(crate) type_name: String,
    pub(crate) fingerprint: u64,
    pub(crate) num_shards: u32,
    /// Every home this region knows (its replica of the table, its own
    /// shards included): shard, owner, generation.
    pub(crate) homes: Vec<(u32, UniqueAddress, u64)>,
}

/// The coordinator's protocol, on the control channel.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum ControlMsg {
    /// Region → coordinator: every type this node hosts a region of, and
    /// what it hosts. Sent when a type is registered and to every new
    /// coordinator; idempotent.
    Register { types: Vec<TypeRegistration> },
    /// Region → coordinator: where does this shard live? (Its messages wait
    /// in the region's buffer meanwhile.)
    GetHome { type_name: String, shard: u32 },
    /// Coordinator → regions: the shard's home, with its allocation generation.
    Home {
        type_name: String,
        shard: u32,
        owner: UniqueAddress,
        generation: u64,
    },
    /// Coordinator → a registering region: every known home of the type.
    Table {
        type_name: String,
        homes: Vec<(u32, UniqueAddress, u64)>,
    },
    /// Coordinator → region: the registration of this type was refused.
    Refused { type_name: String, reason: String },
}

impl ControlMsg {
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(64);
        if let Err(error) = ciborium::into_writer(self, &mut out) {
            tracing::error!(%error, "BUG: a sharding control message did not encode");
        }
        out
    }
}

/// A [`ShardingError`] as it crosses the wire: the variants without the
/// fields the asker knows already (type name, entity id).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum RemoteError {
    /// The shard's buffer on the remote node is full; not processed.
    BufferOverflow {
        /// The shard.
        shard: u32,
    },
    /// The handler panicked.
    EntityPanicked {
        /// The panic message.
        panic: String,
    },
    /// The entity stopped before replying.
    EntityStopped,
    /// The handler returned an error.
    Handler(String),
    /// The remote system is shutting down; not processed.
    ShuttingDown,
    /// The type is not registered on the remote node; not processed.
    NotRegistered,
    /// The shard is out of the remote node's range; not processed.
    InvalidShard {
        /// The shard named.
        shard: u32,
        /// The remote node's shard count.
        num_shards: u32,
    },
    /// The remote remember-entities store failed (FailClosed).
    RememberEntities {
        /// The shard.
        shard: u32,
        /// The store's error.
        message: String,
    },
    /// The receiver's fingerprint of the protocol differs; not processed.
    ProtocolMismatch {
        /// The receiver's fingerprint.
        receiver: u64,
        /// The fingerprint the envelope carried.
        sender: u64,
    },
    /// The message did not decode on the receiver; not processed.
    Undecodable {
        /// What did not decode.
        what: String,
        /// The decoder's error.
        error: String,
    },
    /// Forwarded too often; not processed.
    TooManyHops {
        /// How often.
        hops: u8,
    },
    /// A node further on was lost.
    PeerLost {
        /// That node.
        node: String,
    },
    /// Anything else, as text.
    Other(String),
}

impl From<&ShardingError> for RemoteError {
    fn from(error: &ShardingError) -> Self {
        use ShardingError as E;
        match error {
            E::BufferOverflow { shard_id, .. } => RemoteError::BufferOverflow { shard: shard_id.0 },
            E::EntityPanicked { panic, .. } => RemoteError::EntityPanicked {
                panic: panic.clone(),
            },
            E::EntityStopped { .. } => RemoteError::EntityStopped,
            E::Handler(message) => RemoteError::Handler(message.clone()),
            E::ShuttingDown => RemoteError::ShuttingDown,
            E::NotRegistered { .. } => RemoteError::NotRegistered,
            E::InvalidShard {
                shard_id,
                num_shards,
                ..
            } => RemoteError::InvalidShard {
                shard: shard_id.0,
                num_shards: *num_shards,
            },
            E::RememberEntities {
                shard_id, message, ..
            } => RemoteError::RememberEntities {
                shard: shard_id.0,
                message: message.clone(),
            },
            E::ProtocolMismatch { local, remote, .. } => RemoteError::ProtocolMismatch {
                receiver: *local,
                sender: *remote,
            },
            E::Undecodable { what, error } => RemoteError::Undecodable {
                what: what.clone(),
                error: error.clone(),
            },
            E::TooManyHops { hops, .. } => RemoteError::TooManyHops { hops: *hops },
            E::PeerLost { node, .. } => RemoteError::PeerLost { node: node.clone() },
            other => RemoteError::Other(other.to_string()),
        }
    }
}

impl RemoteError {
    /// The error as the asker sees it: `node` answered for `entity_id` of `type_name`.
    pub(crate) fn into_error(
        self,
        type_name: &'static str,
        entity_id: &str,
        node: &UniqueAddress,
    ) -> ShardingError {
        use crate::extractor::ShardId;
        match self {
            RemoteError::BufferOverflow { shard } => ShardingError::BufferOverflow {
                type_name,
                shard_id: ShardId(shard),
            },
            RemoteError::EntityPanicked { panic } => ShardingError::EntityPanicked {
                type_name,
                entity_id: entity_id.to_owned(),
                panic,
            },
            RemoteError::EntityStopped => ShardingError::EntityStopped {
                type_name,
                entity_id: entity_id.to_owned(),
            },
            RemoteError::Handler(message) => ShardingError::Handler(message),
            RemoteError::ShuttingDown => ShardingError::ShuttingDown,
            RemoteError::NotRegistered => ShardingError::NotRegistered { type_name },
            RemoteError::InvalidShard { shard, num_shards } => ShardingError::InvalidShard {
                entity_id: entity_id.to_owned(),
                shard_id: ShardId(shard),
                num_shards,
            },
            RemoteError::RememberEntities { shard, message } => ShardingError::RememberEntities {
                type_name,
                shard_id: ShardId(shard),
                message,
            },
            RemoteError::ProtocolMismatch { receiver, sender } => ShardingError::ProtocolMismatch {
                type_name,
                local: sender,
                remote: receiver,
                node: node.to_string(),
            },
            RemoteError::Undecodable { what, error } => ShardingError::Undecodable { what, error },
            RemoteError::TooManyHops { hops } => ShardingError::TooManyHops {
                type_name,
                entity_id: entity_id.to_owned(),
                hops,
            },
            RemoteError::PeerLost { node } => ShardingError::PeerLost {
                type_name,
                entity_id: entity_id.to_owned(),
                node,
            },
            RemoteError::Other(message) => ShardingError::Remote(message),
        }
    }
}
