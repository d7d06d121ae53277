//! The inbound data path, run inline on each pipe's reader task: envelopes
//! decoded (the canonical form read in place), checked against the local
//! region and delivered; replies completed; passivation requests applied.

use std::sync::Arc;
use std::time::Duration;

use crate::model::envelope::Delivery;
use crate::model::envelope::{RemoteReply, ReplySink};
use crate::model::extractor::ShardId;
use crate::model::identity::UniqueAddress;
use crate::model::protocol::{LineCheck, check_line};
use crate::ops::telemetry::TraceContext;
use crate::sharding::fast::{self, DataRef, DeliveryRef, EnvelopeRef};
use crate::sharding::remote::Remote;
use crate::sharding::wire::{CompactEnvelope, CompactEnvelopeRef, DataMsg, RemoteError, ReplyBody};
use crate::util::warn_limit::{WarnLimit, warn_limited};

use super::SystemPort;

/// Warnings about undecodable data messages from authenticated peers, at
/// most ten per ten seconds in this process (the rest at debug).
static BAD_DATA: WarnLimit = WarnLimit::new(10, Duration::from_secs(10));
/// Tells of a later protocol version than this node's (no asker hears of
/// them): rate-limited warnings, so that a rolling upgrade that sends new
/// messages to old nodes is seen.
static LATER_TELLS: WarnLimit = WarnLimit::new(10, Duration::from_secs(10));

/// The inbound data path: decode, check, deliver. Runs on a reader task.
pub(super) fn handle_data(
    shared: &dyn SystemPort,
    remote: &Arc<Remote>,
    from: &UniqueAddress,
    payload: &[u8],
) {
    // The hot messages in their canonical form, read in place.
    match fast::decode(payload, from) {
        Some(DataRef::Envelope(envelope)) => {
            return deliver_envelope(shared, remote, from, envelope);
        }
        Some(DataRef::ReplyOk { ask_id, value }) => {
            return remote.complete(from, ask_id, Ok(value));
        }
        None => {}
    }
    let msg: DataMsg = match ciborium::from_reader(payload) {
        Ok(msg) => msg,
        Err(error) => {
            warn_limited!(BAD_DATA, "undecodable sharding data message dropped"; %from, %error);
            return;
        }
    };
    match msg {
        DataMsg::Reply { ask_id, result } => match result {
            ReplyBody::Ok(bytes) => remote.complete(from, ask_id, Ok(&bytes)),
            ReplyBody::Err(error) => remote.complete(from, ask_id, Err(error)),
        },
        DataMsg::Envelope(e) => {
            let envelope = EnvelopeRef {
                type_name: &e.type_name,
                fingerprint: e.fingerprint,
                shard: e.shard,
                generation: e.generation,
                entity_id: &e.entity_id,
                index: e.index,
                hops: e.hops,
                reply_to: e.reply_to,
                payload: &e.payload,
                // (Only the canonical form's trace is read.)
                trace: None,
                delivery: e
                    .delivery
                    .as_ref()
                    .map(|(producer, epoch, seq)| DeliveryRef(producer, *epoch, *seq)),
                line: e.line,
            };
            deliver_envelope(shared, remote, from, envelope);
        }
        DataMsg::E(CompactEnvelope(t, fingerprint, shard, generation, e, index, ask, payload)) => {
            let c =
                CompactEnvelopeRef(&t, fingerprint, shard, generation, &e, index, ask, &payload);
            deliver_envelope(shared, remote, from, EnvelopeRef::from_compact(c, from));
        }
        DataMsg::R(ask_id, bytes) => remote.complete(from, ask_id, Ok(&bytes)),
        DataMsg::Passivate {
            type_name,
            shard,
            entity_id,
        } => {
            if let Some(region) = shared.region(&type_name)
                && shard < region.num_shards()
                && let Err(error) =
                    region.passivate_from(ShardId(shard), &entity_id.into(), None, true)
            {
                tracing::debug!(%from, %error, "remote passivation request dropped");
            }
        }
    }
}

/// Checks a remote envelope against the local region and delivers it; every
/// refusal is answered to the asker.
fn deliver_envelope(
    shared: &dyn SystemPort,
    remote: &Arc<Remote>,
    from: &UniqueAddress,
    envelope: EnvelopeRef<'_>,
) {
    let sink: Arc<dyn ReplySink> = remote.clone();
    let reply = envelope
        .reply_to
        .map(|target| RemoteReply::new(target, sink));
    let refuse = |reply: Option<RemoteReply>, error: RemoteError| {
        tracing::debug!(%from, type_name = %envelope.type_name, ?error, "remote envelope refused");
        if let Some(reply) = reply {
            reply.fail_remote(error);
        }
    };
    let Some(region) = shared.region(envelope.type_name) else {
        return refuse(reply, RemoteError::NotRegistered);
    };
    let carried = envelope.line.unwrap_or(envelope.fingerprint);
    match check_line(region.lines, region.fingerprint, envelope.index, carried) {
        LineCheck::Known => {}
        LineCheck::Beyond => {
            // (Only for the shard the entity is in, by this node's count.)
            if envelope.shard < region.num_shards()
                && (region.extract)(envelope.entity_id, region.num_shards())
                    == ShardId(envelope.shard)
            {
                region.needs_newer(ShardId(envelope.shard));
            }
            if reply.is_none() {
                warn_limited!(LATER_TELLS, "a tell of a later protocol version than this node's dropped"; %from, type_name = %envelope.type_name, line = u32::from(envelope.index) + 1, lines = region.lines.len());
            }
            return refuse(
                reply,
                RemoteError::UnknownMessage {
                    line: u32::from(envelope.index) + 1,
                    lines: u32::try_from(region.lines.len()).unwrap_or(u32::MAX),
                },
            );
        }
        LineCheck::Differs => {
            return refuse(
                reply,
                RemoteError::ProtocolMismatch {
                    receiver: region.line_fingerprint(envelope.index),
                    sender: carried,
                },
            );
        }
    }
    if envelope.shard >= region.num_shards()
        || (region.extract)(envelope.entity_id, region.num_shards()) != ShardId(envelope.shard)
    {
        // Out of range, or not the shard this node's extractor and shard
        // count put the entity in (a node configured differently): refused,
        // so one entity never lives in two shards.
        return refuse(
            reply,
            RemoteError::InvalidShard {
                shard: envelope.shard,
                num_shards: region.num_shards(),
            },
        );
    }
    let hops = envelope.hops.saturating_add(1);
    match (region.decode)(envelope.index, envelope.payload, reply, hops) {
        Ok(mut local) => {
            local.set_routed_under(envelope.generation);
            if let Some(DeliveryRef(producer, epoch, seq)) = envelope.delivery {
                local.set_delivery(Delivery {
                    producer: producer.into(),
                    epoch,
                    seq,
                });
            }
            if let Some(tracing) = region.tracing()
                && let Some(parent) = envelope.trace.and_then(|t| TraceContext::from_bytes(&t))
            {
                let span = tracing::info_span!(
                    "datum.receive",
                    entity_type = region.type_name,
                    entity_id = envelope.entity_id,
                );
                tracing.propagation().set_parent(&span, parent);
                local.set_trace(span);
            }
            // On error the envelope has been answered inside `deliver`.
            let _ = region.deliver_str(ShardId(envelope.shard), envelope.entity_id, local);
        }
        Err(undecodable) => {
            tracing::debug!(%from, error = %undecodable.error, "remote envelope does not decode");
            if let Some(reply) = undecodable.reply {
                reply.fail(&undecodable.error);
            }
        }
    }
}
