//! Live migration: the states a handoff took from a shard's entities move
//! from the old owner to the new one (SPEC §13.16).
//!
//! ```text
//!  old owner A                                         new owner B
//!  HandOff: each entity finishes its mailbox,
//!  dehydrates, stops; ShardStopped ──► coordinator ──► Home{B, g, from: A}
//!  Home{B, g}: the states wait for B, in chunks       slot waits (messages buffer)
//!         ◄──────── Request Pull{type, shard, g, chunk 0}
//!  Reply Chunk{states, last} ────────►  ... chunk by chunk, until `last`
//!         ◄──────── Oneway Done{type, shard, g}       install: each entity starts
//!  the states go                                      from its state, then the buffer
//! ```
//!
//! Pulls travel as transport requests on the migration channel (bulk lane),
//! so a lost connection loses one chunk's request, which is asked again;
//! the new owner gives up at the type's migration timeout (or at once when
//! the old owner is down, or has nothing for it) and its entities start
//! from the factory.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

use crate::entity::MigratedState;
use crate::model::extractor::ShardId;
use crate::model::identity::UniqueAddress;
use crate::runtime::mailbox::States;
use crate::runtime::region::{ChunkAnswer, Region, StatesPull};
use crate::sharding::wire::{MigratedEntry, MigrationReply, MigrationRequest, encode_cbor};
use crate::transport::{Incoming, RequestError, SendFailure, Transport};
use crate::wire::RemoteFailure;
use crate::wire::channels::SHARDING_MIGRATION;

/// How long one pull waits for its chunk before it is asked again.
const PULL_TIMEOUT: Duration = Duration::from_secs(1);
/// How long to wait before asking again after `NotYet` or a failed pull.
const RETRY: Duration = Duration::from_millis(20);

/// Fetches the states kept on `from` for this node, which hosts `shard`
/// of `type_name` under `generation`, chunk by chunk, within `timeout`.
pub(crate) async fn fetch(
    transport: Transport,
    type_name: &'static str,
    shard: ShardId,
    generation: u64,
    from: UniqueAddress,
    timeout: Duration,
) -> Result<States, String> {
    let deadline = tokio::time::Instant::now() + timeout;
    let mut pull = StatesPull::default();
    loop {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        if left.is_zero() {
            return Err(format!(
                "timed out after {timeout:?} ({} chunks, {} states fetched)",
                pull.chunk(),
                pull.received()
            ));
        }
        let request = MigrationRequest::Pull {
            type_name: type_name.to_owned(),
            shard: shard.0,
            generation,
            chunk: pull.chunk(),
        };
        let answer = transport
            .request(
                &from,
                SHARDING_MIGRATION,
                encode_cbor(&request),
                left.min(PULL_TIMEOUT),
            )
            .await;
        match answer {
            Ok(bytes) => match ciborium::from_reader::<MigrationReply, _>(&bytes[..]) {
                Ok(MigrationReply::Chunk { states: got, last }) => {
                    let got = got.into_iter().map(
                        |MigratedEntry(id, version, bytes, position, deliveries)| {
                            let state = MigratedState {
                                version,
                                bytes,
                                position,
                                deliveries,
                            };
                            (id.into(), state)
                        },
                    );
                    if let Some(states) = pull.got(got.collect(), last) {
                        let done = MigrationRequest::Done {
                            type_name: type_name.to_owned(),
                            shard: shard.0,
                            generation,
                        };
                        // Lost, the states expire on the old owner instead.
                        let _ = transport.send(&from, SHARDING_MIGRATION, encode_cbor(&done));
                        return Ok(states);
                    }
                    continue;
                }
                Ok(MigrationReply::NotYet) => {}
                Ok(MigrationReply::Nothing { reason }) => {
                    return Err(format!("the old owner has none: {reason}"));
                }
                Err(error) => return Err(format!("an answer that does not decode: {error}")),
            },
            Err(RequestError::NotSent(error))
                if matches!(error.reason, SendFailure::MarkedDown) =>
            {
                return Err("the old owner is down".into());
            }
            Err(RequestError::Remote(RemoteFailure::NoHandler(_))) => {
                return Err("the old owner does not serve migrations".into());
            }
            Err(RequestError::Remote(RemoteFailure::Failed(reason))) => {
                return Err(format!("the old owner failed: {reason}"));
            }
            // Lost with a connection, timed out, overloaded: ask again.
            Err(error) => {
                tracing::debug!(type_name, %shard, %from, %error, "a migration pull failed; asking again");
            }
        }
        tokio::time::sleep(
            RETRY.min(deadline.saturating_duration_since(tokio::time::Instant::now())),
        )
        .await;
    }
}

/// Answers one request on the migration channel (on the reader task of
/// its pipe: it only copies references to the kept chunks and encodes),
/// `region` giving this node's region of a type. A request that does not
/// decode, or names a type with no region here, is refused; the pipe goes
/// on.
pub(crate) fn serve(region: impl FnOnce(&str) -> Option<Arc<Region>>, incoming: Incoming) {
    let request = match ciborium::from_reader::<MigrationRequest, _>(&incoming.payload[..]) {
        Ok(request) => request,
        Err(error) => {
            tracing::warn!(from = %incoming.from, %error, "a migration request that does not decode: refused");
            if let Some(reply) = incoming.reply {
                let _ = reply.fail(format!("the request does not decode: {error}"));
            }
            return;
        }
    };
    match request {
        MigrationRequest::Pull {
            type_name,
            shard,
            generation,
            chunk,
        } => {
            let Some(reply) = incoming.reply else {
                return; // a pull sent oneway has nowhere to be answered
            };
            let answer = match region(&type_name) {
                Some(region) if shard < region.num_shards() => region.table().migration_chunk(
                    &incoming.from,
                    ShardId(shard),
                    generation,
                    chunk,
                ),
                Some(_) => ChunkAnswer::Nothing("no such shard"),
                None => ChunkAnswer::Nothing("no region of the type"),
            };
            let answer = match answer {
                ChunkAnswer::Chunk { states, last } => MigrationReply::Chunk {
                    states: states
                        .into_iter()
                        .map(|(id, s)| {
                            MigratedEntry(
                                id.to_string(),
                                s.version,
                                s.bytes,
                                s.position,
                                s.deliveries,
                            )
                        })
                        .collect(),
                    last,
                },
                ChunkAnswer::NotYet => MigrationReply::NotYet,
                ChunkAnswer::Nothing(reason) => MigrationReply::Nothing {
                    reason: reason.into(),
                },
            };
            let bytes: Bytes = encode_cbor(&answer);
            if let Err(error) = reply.reply(bytes) {
                tracing::warn!(from = %incoming.from, %type_name, shard, error = %error.reason, "a migration chunk was not sent");
            }
        }
        MigrationRequest::Done {
            type_name,
            shard,
            generation,
        } => {
            if let Some(region) = region(&type_name)
                && shard < region.num_shards()
            {
                region
                    .table()
                    .migration_done(&incoming.from, ShardId(shard), generation);
            }
        }
    }
}
