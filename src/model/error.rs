//! The one error type of the sharding layer.
//!
//! Every variant says what happened and whether the message it concerns may
//! have been processed: callers decide on retries from that (delivery is
//! at-most-once per attempt; see `SPEC.md`).

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::model::extractor::ShardId;
use crate::model::identity::UniqueAddress;

/// Why the coordinator refused a region (`ShardingError::RegionRefused`):
/// both configurations of the type.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
#[error(
    "the coordinator refused this node's region of `{type_name}` (fingerprint {fingerprint:016x}, {num_shards} shards): {reason}"
)]
pub struct RegionRefusal {
    /// The entity type.
    pub type_name: &'static str,
    /// This region's protocol fingerprint.
    pub fingerprint: u64,
    /// This region's shard count.
    pub num_shards: u32,
    /// The fingerprint the type has in the cluster (`None` when the region
    /// was refused for its shard count alone).
    pub cluster_fingerprint: Option<u64>,
    /// The shard count the type has in the cluster (as above).
    pub cluster_num_shards: Option<u32>,
    /// The first line (1-based) of the protocol at which this region's
    /// version and the cluster's differ, neither extending the other
    /// (SPEC §13.6); `None` when the refusal is not about the lines.
    pub differing_line: Option<u32>,
    /// The coordinator's words.
    pub reason: String,
}

/// What can go wrong when sending to an entity or managing the system.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ShardingError {
    /// The shard's buffer (allocation or passivation) is full. The message was
    /// not accepted and was not processed; retrying later is safe.
    #[error(
        "buffer for shard {shard_id} of entity type `{type_name}` is full; message not accepted"
    )]
    BufferOverflow {
        /// The entity type.
        type_name: &'static str,
        /// The shard whose buffer is full.
        shard_id: ShardId,
    },
    /// No reply arrived within the ask's timeout. The message may still be
    /// processed later: a retry can process it twice.
    #[error(
        "ask to `{type_name}` entity `{entity_id}` timed out after {timeout:?}; it may still be processed"
    )]
    AskTimeout {
        /// The entity type.
        type_name: &'static str,
        /// The entity asked.
        entity_id: String,
        /// The timeout that elapsed.
        timeout: Duration,
    },
    /// The entity's handler panicked on this message. The entity was restarted
    /// from its factory; later messages are served by the new instance.
    #[error("`{type_name}` entity `{entity_id}` panicked while handling the message: {panic}")]
    EntityPanicked {
        /// The entity type.
        type_name: &'static str,
        /// The entity that panicked.
        entity_id: String,
        /// The panic payload, when it was a string.
        panic: String,
    },
    /// The entity stopped before it replied (it failed to start, or was
    /// stopped while the message waited in its mailbox). The message was not
    /// processed by that incarnation.
    #[error("`{type_name}` entity `{entity_id}` stopped before replying")]
    EntityStopped {
        /// The entity type.
        type_name: &'static str,
        /// The entity.
        entity_id: String,
    },
    /// The handler returned an error of its own; passed to the asker as is.
    #[error("handler error: {0}")]
    Handler(String),
    /// The system is shutting down or has shut down, and the message never
    /// left this node (refused, or dropped from a buffer here): it was not
    /// processed.
    #[error("the sharded system is shutting down; message not processed")]
    ShuttingDown,
    /// This system stopped waiting for the reply — it shut down, or its node
    /// fenced itself (§13.9: it saw itself Down or Removed) — after the
    /// message had been handed on: written towards another node, or to an
    /// entity here. It may have been processed (another node's entity may
    /// have applied it, and its reply was cut off); a retry may process it
    /// twice.
    #[error(
        "the sharded system stopped while the message to `{type_name}` entity `{entity_id}` was in flight; it may have been processed"
    )]
    ShutDownInFlight {
        /// The entity type.
        type_name: &'static str,
        /// The entity.
        entity_id: String,
    },
    /// The entity stopped after its handler had begun on the message and
    /// before it answered: the handler was killed (it outran the stop
    /// timeout), or it dropped its [`ReplyPort`](crate::entity::ReplyPort)
    /// unanswered. It may have been processed in part or whole — a durable
    /// entity's write may be committed.
    #[error(
        "`{type_name}` entity `{entity_id}` stopped while handling the message; it may have been processed"
    )]
    HandlerInterrupted {
        /// The entity type.
        type_name: &'static str,
        /// The entity.
        entity_id: String,
    },
    /// No entity type with this protocol is registered on this system.
    #[error("entity type `{type_name}` is not registered on this system")]
    NotRegistered {
        /// The protocol's type name.
        type_name: &'static str,
    },
    /// An entity type with this name is registered already.
    #[error("entity type `{type_name}` is already registered")]
    AlreadyRegistered {
        /// The protocol's type name.
        type_name: &'static str,
    },
    /// A custom extractor returned a shard outside `0..num_shards`. Nothing was sent.
    #[error("extractor put entity `{entity_id}` in shard {shard_id}, outside 0..{num_shards}")]
    InvalidShard {
        /// The entity id.
        entity_id: String,
        /// The shard the extractor returned.
        shard_id: ShardId,
        /// The configured shard count.
        num_shards: u32,
    },
    /// The configuration is not usable; the system did not start.
    #[error("invalid configuration: {0}")]
    InvalidConfig(String),
    /// A remember-entities store failed (only under the `FailClosed` policy
    /// does this reach senders; under `FailOpen` it is logged).
    #[error("remember-entities store failed for `{type_name}` shard {shard_id}: {message}")]
    RememberEntities {
        /// The entity type.
        type_name: &'static str,
        /// The shard.
        shard_id: ShardId,
        /// The store's error.
        message: String,
    },
    /// A durable entity's journal refused or failed: its recovery read a
    /// record it cannot apply, the store failed, or — a
    /// [`PersistenceError::SequenceConflict`](crate::persistence::PersistenceError::SequenceConflict)
    /// — another incarnation of the entity wrote since this one recovered
    /// (this incarnation stops; the next message recovers a new one from
    /// the journal). What was refused was not written; a handler that
    /// failed so did not finish.
    #[error("`{type_name}` entity `{entity_id}`: {error}")]
    Persistence {
        /// The entity type.
        type_name: &'static str,
        /// The entity.
        entity_id: String,
        /// What the journal said (boxed: it keeps the error small).
        error: Box<crate::persistence::PersistenceError>,
    },
    /// The node that owns the entity's shard was lost (marked Down, or its
    /// pipe refused the message) while the message was on its way or waiting
    /// for a reply. The message may have been processed; a retry goes to the
    /// shard's new home.
    #[error(
        "the node {node} owning `{type_name}` entity `{entity_id}` was lost; the message may have been processed"
    )]
    PeerLost {
        /// The entity type.
        type_name: &'static str,
        /// The entity.
        entity_id: String,
        /// The lost node.
        node: String,
    },
    /// The cluster's coordinator refused this node's region of the type: the
    /// type is registered in the cluster with another protocol fingerprint
    /// or shard count (or this region's shard count is out of range). The
    /// message was not processed; every message to the type through this
    /// node fails so until a coordinator accepts the region (a registration
    /// the region sends again, every 10 s, after the cluster changed).
    #[error("{0}; message not processed")]
    RegionRefused(Box<RegionRefusal>),
    /// The owner's version of the protocol writes the message's line
    /// differently from this node's (their fingerprints up to that line
    /// differ, SPEC §13.6): the message was refused unprocessed.
    #[error(
        "protocol `{type_name}` differs between nodes: fingerprint {local:016x} here, {remote:016x} on {node}; message not processed"
    )]
    ProtocolMismatch {
        /// The protocol's wire name.
        type_name: &'static str,
        /// This node's fingerprint of the protocol.
        local: u64,
        /// The other node's fingerprint of it.
        remote: u64,
        /// The other node.
        node: String,
    },
    /// The message is of a later version of the protocol than the one a
    /// node on its way runs (its owner, or a node with an older home that
    /// would have forwarded it): its line is past that version's last
    /// (SPEC §13.6). Not processed; sent again once a node of a version
    /// that has the line hosts the shard, it can succeed.
    #[error(
        "message line {line} of protocol `{type_name}` is past the version on {node}, which has {lines} lines; message not processed"
    )]
    UnknownMessage {
        /// The protocol's wire name.
        type_name: &'static str,
        /// The message's line in the sender's version (1-based).
        line: u32,
        /// How many lines the owner's version has.
        lines: u32,
        /// The owner's node.
        node: String,
    },
    /// A message or reply from another node did not decode into its type. The
    /// message was not processed (for a reply: it was, but its value is lost).
    #[error("{what} from another node does not decode: {error}")]
    Undecodable {
        /// What did not decode.
        what: String,
        /// The decoder's error.
        error: String,
    },
    /// The message was forwarded between nodes too many times without
    /// reaching its shard's owner (allocation tables disagreeing); it was not
    /// processed. A retry after the tables settle succeeds.
    #[error(
        "message for `{type_name}` entity `{entity_id}` forwarded {hops} times without reaching its shard; not processed"
    )]
    TooManyHops {
        /// The entity type.
        type_name: &'static str,
        /// The entity.
        entity_id: String,
        /// How often it was forwarded.
        hops: u8,
    },
    /// Another node answered with an error this build has no variant for.
    #[error("the remote node failed: {0}")]
    Remote(String),
    /// An actor could not be spawned (ractor refused it).
    #[error("could not spawn an actor: {0}")]
    Spawn(String),
    /// BUG: an internal invariant did not hold. Please report it; the message
    /// concerned was not processed.
    #[error("BUG: {0}")]
    Bug(String),
    /// A reliable producer's message (SPEC §13.17) came from an incarnation
    /// of its producer older than one the entity has heard from (a
    /// producer restarted, or two running under one id): not processed.
    #[error(
        "reliable producer `{producer_id}` incarnation {epoch} is superseded by incarnation {current}; message not processed"
    )]
    Superseded {
        /// The producer's id.
        producer_id: String,
        /// The incarnation the message came from.
        epoch: u64,
        /// The latest incarnation the entity has heard from.
        current: u64,
    },
}

/// Whether the message an error concerns was processed: what a caller
/// needs to decide on a retry ([`ShardingError::processed`]; SPEC §11).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Processed {
    /// It was not: it never reached a handler (or the error concerns no
    /// message). Retrying cannot process it twice.
    No,
    /// It may have been, in part or whole: a retry may process it twice.
    Maybe,
    /// It was: the handler ran (a reply's value may be lost).
    Yes,
}

impl ShardingError {
    /// Whether the message this error answered may have been processed
    /// (SPEC §11's "processed?" column). An error a handler returns is
    /// passed to the asker as is: `Handler` says the handler ran; another
    /// variant it passes on from a call of its own (a nested ask's
    /// `AskTimeout`, say) tells of that call, not of this message.
    pub fn processed(&self) -> Processed {
        use crate::persistence::PersistenceError as P;
        use ShardingError as E;
        match self {
            E::BufferOverflow { .. }
            | E::ShuttingDown
            | E::EntityStopped { .. }
            | E::NotRegistered { .. }
            | E::AlreadyRegistered { .. }
            | E::InvalidShard { .. }
            | E::InvalidConfig(_)
            | E::RememberEntities { .. }
            | E::RegionRefused(_)
            | E::ProtocolMismatch { .. }
            | E::UnknownMessage { .. }
            | E::TooManyHops { .. }
            | E::Remote(_)
            | E::Spawn(_)
            | E::Bug(_)
            | E::Superseded { .. } => Processed::No,
            E::AskTimeout { .. }
            | E::PeerLost { .. }
            | E::ShutDownInFlight { .. }
            | E::HandlerInterrupted { .. }
            | E::EntityPanicked { .. } => Processed::Maybe,
            E::Handler(_) => Processed::Yes,
            // A reply that did not decode was the answer of a handler
            // that ran; a message that did not decode reached none.
            E::Undecodable { what, .. } if what == "reply" => Processed::Yes,
            E::Undecodable { .. } => Processed::No,
            E::Persistence { error, .. } => match **error {
                // The store failed: the write may have committed before
                // its answer was lost.
                P::Store(_) => Processed::Maybe,
                // A write refused as invalid leaves the handler's other
                // doings, and a durable state's change in memory, in place.
                P::Invalid(_) => Processed::Maybe,
                P::SequenceConflict { .. }
                | P::RevisionConflict { .. }
                | P::Corrupt { .. }
                | P::Unavailable(_) => Processed::No,
            },
        }
    }

    /// The variant's name in snake case: the `kind` label of the
    /// `datum_ask_failures_total` metric (SPEC §14).
    pub fn kind(&self) -> &'static str {
        match self {
            ShardingError::BufferOverflow { .. } => "buffer_overflow",
            ShardingError::AskTimeout { .. } => "ask_timeout",
            ShardingError::EntityPanicked { .. } => "entity_panicked",
            ShardingError::EntityStopped { .. } => "entity_stopped",
            ShardingError::Handler(_) => "handler",
            ShardingError::ShuttingDown => "shutting_down",
            ShardingError::ShutDownInFlight { .. } => "shut_down_in_flight",
            ShardingError::HandlerInterrupted { .. } => "handler_interrupted",
            ShardingError::NotRegistered { .. } => "not_registered",
            ShardingError::AlreadyRegistered { .. } => "already_registered",
            ShardingError::InvalidShard { .. } => "invalid_shard",
            ShardingError::InvalidConfig(_) => "invalid_config",
            ShardingError::RememberEntities { .. } => "remember_entities",
            ShardingError::Persistence { .. } => "persistence",
            ShardingError::PeerLost { .. } => "peer_lost",
            ShardingError::RegionRefused(_) => "region_refused",
            ShardingError::ProtocolMismatch { .. } => "protocol_mismatch",
            ShardingError::UnknownMessage { .. } => "unknown_message",
            ShardingError::Undecodable { .. } => "undecodable",
            ShardingError::TooManyHops { .. } => "too_many_hops",
            ShardingError::Remote(_) => "remote",
            ShardingError::Spawn(_) => "spawn",
            ShardingError::Bug(_) => "bug",
            ShardingError::Superseded { .. } => "superseded",
        }
    }
}

impl ShardingError {
    /// The error a handler returned (or failed its `ReplyPort` with), as
    /// its asker gets it. The handler ran, so the asker must not read "not
    /// processed": `Handler` stays, as does `Persistence` (the store's
    /// answer to this message's own write, whose column §11 gives); any
    /// other variant — one the handler passed on from a call of its own, a
    /// nested ask's `AskTimeout` or `NotRegistered`, say — becomes
    /// `Handler` with its text.
    pub(crate) fn answered_by_handler(self, of: (&str, &str)) -> ShardingError {
        self.answered_after(of, false)
    }

    /// [`answered_by_handler`](Self::answered_by_handler) of the entity
    /// `of` (type name, id), for a handler that `wrote` already (a write of
    /// its accepted while it handled this message): then a `Persistence`
    /// error of a later write is `Handler` too, since the message was
    /// processed in part. A `Persistence` error of another entity (passed
    /// on from a nested ask) is `Handler` as well: its column tells of
    /// that entity's write, not of this message.
    pub(crate) fn answered_after(self, of: (&str, &str), wrote: bool) -> ShardingError {
        match self {
            ShardingError::Handler(_) => self,
            ShardingError::Persistence {
                type_name,
                ref entity_id,
                ..
            } if !wrote && (type_name, entity_id.as_str()) == of => self,
            other => ShardingError::Handler(other.to_string()),
        }
    }
}

/// The result of a sharding operation.
pub type ShardingResult<T> = Result<T, ShardingError>;

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
    /// The entity stopped while its handler ran on the message; it may have
    /// been processed.
    HandlerInterrupted,
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
    /// The message's line is past the receiver's version of the protocol;
    /// not processed.
    UnknownMessage {
        /// The message's line (1-based).
        line: u32,
        /// How many lines the receiver's version has.
        lines: u32,
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
    /// A durable entity's journal or state store refused or failed.
    Persistence(Box<crate::persistence::PersistenceError>),
    /// Anything else, as text.
    Other(String),
    /// A reliable producer's incarnation was superseded; not processed.
    Superseded {
        /// The producer's id.
        producer_id: String,
        /// The incarnation the message came from.
        epoch: u64,
        /// The latest incarnation the entity has heard from.
        current: u64,
    },
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
            E::HandlerInterrupted { .. } => RemoteError::HandlerInterrupted,
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
            E::UnknownMessage { line, lines, .. } => RemoteError::UnknownMessage {
                line: *line,
                lines: *lines,
            },
            E::Undecodable { what, error } => RemoteError::Undecodable {
                what: what.clone(),
                error: error.clone(),
            },
            E::TooManyHops { hops, .. } => RemoteError::TooManyHops { hops: *hops },
            E::PeerLost { node, .. } => RemoteError::PeerLost { node: node.clone() },
            E::Persistence { error, .. } => RemoteError::Persistence(error.clone()),
            E::Superseded {
                producer_id,
                epoch,
                current,
            } => RemoteError::Superseded {
                producer_id: producer_id.clone(),
                epoch: *epoch,
                current: *current,
            },
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
            RemoteError::HandlerInterrupted => ShardingError::HandlerInterrupted {
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
            RemoteError::UnknownMessage { line, lines } => ShardingError::UnknownMessage {
                type_name,
                line,
                lines,
                node: node.to_string(),
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
            RemoteError::Persistence(error) => ShardingError::Persistence {
                type_name,
                entity_id: entity_id.to_owned(),
                error,
            },
            RemoteError::Other(message) => ShardingError::Remote(message),
            RemoteError::Superseded {
                producer_id,
                epoch,
                current,
            } => ShardingError::Superseded {
                producer_id,
                epoch,
                current,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::persistence::{PersistenceError, PersistenceId};

    /// SPEC §11's "processed?" column, row by row: an error that says "not
    /// processed" must never answer a message that left for a handler.
    #[test]
    fn each_error_says_whether_its_message_may_have_been_processed() {
        let id = || "e".to_string();
        let store = |error| ShardingError::Persistence {
            type_name: "t",
            entity_id: id(),
            error: Box::new(error),
        };
        let pid = || PersistenceId::new("t", "e");
        let refusal = RegionRefusal {
            type_name: "t",
            fingerprint: 1,
            num_shards: 2,
            cluster_fingerprint: None,
            cluster_num_shards: None,
            differing_line: None,
            reason: "r".into(),
        };
        use Processed::{Maybe, No, Yes};
        let table = [
            (
                ShardingError::BufferOverflow {
                    type_name: "t",
                    shard_id: ShardId(1),
                },
                No,
            ),
            (
                ShardingError::AskTimeout {
                    type_name: "t",
                    entity_id: id(),
                    timeout: Duration::ZERO,
                },
                Maybe,
            ),
            (
                ShardingError::EntityPanicked {
                    type_name: "t",
                    entity_id: id(),
                    panic: "p".into(),
                },
                Maybe,
            ),
            (
                ShardingError::EntityStopped {
                    type_name: "t",
                    entity_id: id(),
                },
                No,
            ),
            (ShardingError::Handler("h".into()), Yes),
            (ShardingError::ShuttingDown, No),
            (
                ShardingError::ShutDownInFlight {
                    type_name: "t",
                    entity_id: id(),
                },
                Maybe,
            ),
            (
                ShardingError::HandlerInterrupted {
                    type_name: "t",
                    entity_id: id(),
                },
                Maybe,
            ),
            (ShardingError::NotRegistered { type_name: "t" }, No),
            (
                ShardingError::PeerLost {
                    type_name: "t",
                    entity_id: id(),
                    node: "n".into(),
                },
                Maybe,
            ),
            (ShardingError::RegionRefused(Box::new(refusal)), No),
            (
                ShardingError::Undecodable {
                    what: "reply".into(),
                    error: "x".into(),
                },
                Yes,
            ),
            (
                ShardingError::Undecodable {
                    what: "message 1 of `t`".into(),
                    error: "x".into(),
                },
                No,
            ),
            (
                ShardingError::TooManyHops {
                    type_name: "t",
                    entity_id: id(),
                    hops: 4,
                },
                No,
            ),
            (
                ShardingError::UnknownMessage {
                    type_name: "t",
                    line: 3,
                    lines: 2,
                    node: "n".into(),
                },
                No,
            ),
            (ShardingError::Remote("r".into()), No),
            (store(PersistenceError::Store("down".into())), Maybe),
            (store(PersistenceError::Invalid("i".into())), Maybe),
            (store(PersistenceError::Unavailable("late".into())), No),
            (
                store(PersistenceError::SequenceConflict {
                    persistence_id: pid(),
                    expected: 1,
                    actual: 2,
                }),
                No,
            ),
            (
                store(PersistenceError::RevisionConflict {
                    persistence_id: pid(),
                    expected: 1,
                    actual: 2,
                }),
                No,
            ),
            (
                store(PersistenceError::Corrupt {
                    persistence_id: pid(),
                    what: "w".into(),
                }),
                No,
            ),
        ];
        for (error, processed) in table {
            assert_eq!(error.processed(), processed, "{error:?}");
        }
    }

    /// The failure kinds a region registers at 0 are kinds errors have,
    /// so no zero series sits beside a real one.
    #[test]
    fn the_usual_failure_kinds_registered_at_start_are_kinds() {
        let (t, e) = ("t", || "e".to_string());
        let errors = [
            ShardingError::AskTimeout {
                type_name: t,
                entity_id: e(),
                timeout: Duration::ZERO,
            },
            ShardingError::PeerLost {
                type_name: t,
                entity_id: e(),
                node: "n".into(),
            },
            ShardingError::EntityStopped {
                type_name: t,
                entity_id: e(),
            },
            ShardingError::EntityPanicked {
                type_name: t,
                entity_id: e(),
                panic: "p".into(),
            },
            ShardingError::Handler("h".into()),
            ShardingError::ShuttingDown,
            ShardingError::ShutDownInFlight {
                type_name: t,
                entity_id: e(),
            },
            ShardingError::HandlerInterrupted {
                type_name: t,
                entity_id: e(),
            },
            ShardingError::BufferOverflow {
                type_name: t,
                shard_id: ShardId(0),
            },
            ShardingError::Persistence {
                type_name: t,
                entity_id: e(),
                error: Box::new(PersistenceError::Store("s".into())),
            },
        ];
        assert_eq!(
            errors.map(|e| e.kind()),
            crate::ops::telemetry::USUAL_ASK_FAILURES
        );
    }

    /// A handler ran, so what it answers never reads "not processed": an
    /// error it passes on from a call of its own becomes `Handler`.
    #[test]
    fn a_handlers_own_error_answer_says_it_ran() {
        let nested = ShardingError::NotRegistered { type_name: "other" };
        let answered = nested.clone().answered_by_handler(("t", "e"));
        assert_eq!(answered, ShardingError::Handler(nested.to_string()));
        assert_eq!(answered.processed(), Processed::Yes);
        let own = ShardingError::Handler("no".into());
        assert_eq!(own.clone().answered_by_handler(("t", "e")), own);
        let store = ShardingError::Persistence {
            type_name: "t",
            entity_id: "e".into(),
            error: Box::new(PersistenceError::Store("away".into())),
        };
        assert_eq!(store.clone().answered_by_handler(("t", "e")), store);
        // Another entity's store error, passed on from a nested ask, tells
        // of that entity, not of this message.
        let nested = store.clone().answered_by_handler(("t", "other"));
        assert_eq!(nested, ShardingError::Handler(store.to_string()));
        // After a write of its was accepted, a later write's error says
        // the message was processed in part.
        let later = store.clone().answered_after(("t", "e"), true);
        assert_eq!(later, ShardingError::Handler(store.to_string()));
        assert_eq!(later.processed(), Processed::Yes);
    }

    /// The "maybe" errors that begin on one node keep their meaning on
    /// the asker's: a handler interrupted there is interrupted here.
    #[test]
    fn an_interrupted_handler_reaches_a_remote_asker_as_maybe_processed() {
        let node = UniqueAddress {
            addr: std::net::SocketAddr::from(([127, 0, 0, 1], 7000)),
            node_id: crate::model::identity::NodeId(1),
            incarnation: 1,
        };
        let interrupted = ShardingError::HandlerInterrupted {
            type_name: "t",
            entity_id: "e".into(),
        };
        let back = RemoteError::from(&interrupted).into_error("t", "e", &node);
        assert_eq!(back, interrupted);
        assert_eq!(back.processed(), Processed::Maybe);
    }
}
