//! Hand-written encoding of the hot data-channel messages, byte-identical to
//! serde's (SPEC §13.4), as `wire/fast.rs` does for frames.
//!
//! An envelope and a reply cross the wire for every remote ask. Through
//! serde and ciborium, their decode alone took about a tenth of a node's CPU
//! under W1 (a header parse, an identifier match and a `String` per field).
//! These functions write exactly the canonical bytes ciborium produces
//! (definite lengths, shortest heads, declaration order) and read them back
//! borrowing from the body, with no allocation. The decoder accepts only
//! that form — an `Ok` reply, an envelope whose reply target is absent or
//! has an IPv4 or IPv6 origin — and returns `None` for anything else, which
//! the caller hands to serde: the fast path changes speed, never meaning
//! (a tested property) — but for an envelope's trace context (SPEC §14.2),
//! which only this decoder reads: through serde a traced envelope is
//! delivered without it.
//!
//! Protocol version 3 added two compact forms, positional arrays with no
//! field names: `E` for an envelope its origin sends (hops 0, no trace,
//! no delivery tag), whose asker is the pipe's peer, and `R` for an `Ok`
//! reply. They go only over pipes at version 3 or later; the long forms
//! stay for everything else and for older peers.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use crate::model::envelope::ReplyTarget;
use crate::model::identity::{NodeId, UniqueAddress};
use crate::ops::telemetry::TraceContext;

use crate::wire::cbor::{
    MAJOR_ARRAY, MAJOR_MAP, NULL, Reader, put_bytes, put_head, put_text, put_uint,
};

fn put_address(out: &mut Vec<u8>, a: &UniqueAddress) {
    put_head(out, MAJOR_MAP, 3);
    put_text(out, "addr");
    put_head(out, MAJOR_MAP, 1);
    match a.addr.ip() {
        IpAddr::V4(ip) => put_ip(out, "V4", &ip.octets(), a.addr.port()),
        IpAddr::V6(ip) => put_ip(out, "V6", &ip.octets(), a.addr.port()),
    }
    put_text(out, "node_id");
    put_uint(out, a.node_id.0);
    put_text(out, "incarnation");
    put_uint(out, a.incarnation);
}

/// serde's non-human-readable `SocketAddr`: `{family: [[octets..], port]}`.
fn put_ip(out: &mut Vec<u8>, family: &str, octets: &[u8], port: u16) {
    put_text(out, family);
    put_head(out, MAJOR_ARRAY, 2);
    put_head(out, MAJOR_ARRAY, octets.len() as u64);
    for b in octets {
        put_uint(out, u64::from(*b));
    }
    put_uint(out, u64::from(port));
}

/// The fields of an envelope, borrowed: what the hand codec writes and
/// reads, and (through serde) the encoding side of
/// [`Envelope`](crate::sharding::wire::Envelope).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub(crate) struct EnvelopeRef<'a> {
    pub(crate) type_name: &'a str,
    pub(crate) fingerprint: u64,
    pub(crate) shard: u32,
    pub(crate) generation: u64,
    pub(crate) entity_id: &'a str,
    pub(crate) index: u16,
    pub(crate) hops: u8,
    pub(crate) reply_to: Option<ReplyTarget>,
    #[serde(with = "crate::wire::payload::borrowed")]
    pub(crate) payload: &'a [u8],
    /// The sender's trace context (tracing on, SPEC §14.2): `trace`, a
    /// 26-byte string, after `payload`; absent without one.
    #[serde(
        skip_serializing_if = "Option::is_none",
        serialize_with = "trace_bytes"
    )]
    pub(crate) trace: Option<[u8; TraceContext::WIRE_LEN]>,
    /// A reliable producer's tag (SPEC §13.17): `delivery`, after `payload`
    /// and `trace`; absent without one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) delivery: Option<DeliveryRef<'a>>,
    /// The fingerprint of the message's own protocol line, when
    /// `fingerprint` is the protocol's whole one (a long form sent where
    /// the pipe's version is not known to read a line's, SPEC §13.6):
    /// `line`, last; absent otherwise. A receiver checks it rather than
    /// `fingerprint`; a build that predates it ignores it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) line: Option<u64>,
}

impl<'a> EnvelopeRef<'a> {
    /// The envelope a compact `E` carries, come over the pipe from `from`:
    /// sent by its origin (no hop yet), asked (if asked) by `from`.
    pub(crate) fn from_compact(c: CompactEnvelopeRef<'a>, from: &UniqueAddress) -> Self {
        let CompactEnvelopeRef(
            type_name,
            fingerprint,
            shard,
            generation,
            entity_id,
            index,
            ask,
            payload,
        ) = c;
        EnvelopeRef {
            type_name,
            fingerprint,
            shard,
            generation,
            entity_id,
            index,
            hops: 0,
            reply_to: ask.map(|ask_id| ReplyTarget {
                origin: *from,
                ask_id,
            }),
            payload,
            trace: None,
            delivery: None,
            line: None,
        }
    }

    /// Whether the compact form `E` can carry this envelope from `me`:
    /// sent by its origin (no hop yet, asked by `me` if asked at all),
    /// with no trace context and no delivery tag.
    pub(crate) fn is_compact_from(&self, me: &UniqueAddress) -> bool {
        self.hops == 0
            && self.trace.is_none()
            && self.delivery.is_none()
            && self.reply_to.is_none_or(|target| target.origin == *me)
    }
}

/// A compact envelope's fields (`DataMsg::E`), borrowed: serde's encoding
/// side, and what both decoders hand to [`EnvelopeRef::from_compact`].
#[derive(Clone, Copy, Debug, serde::Serialize)]
pub(crate) struct CompactEnvelopeRef<'a>(
    pub(crate) &'a str,
    pub(crate) u64,
    pub(crate) u32,
    pub(crate) u64,
    pub(crate) &'a str,
    pub(crate) u16,
    pub(crate) Option<u64>,
    #[serde(with = "crate::wire::payload::borrowed")] pub(crate) &'a [u8],
);

/// A reliable producer's tag as it travels: the array `[producer, epoch,
/// seq]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub(crate) struct DeliveryRef<'a>(pub(crate) &'a str, pub(crate) u64, pub(crate) u64);

/// serde's side of `trace`: a byte string (only called with `Some`).
fn trace_bytes<S: serde::Serializer>(
    trace: &Option<[u8; TraceContext::WIRE_LEN]>,
    s: S,
) -> Result<S::Ok, S::Error> {
    s.serialize_bytes(trace.as_ref().map_or(&[][..], |t| &t[..]))
}

/// Appends the canonical CBOR of `DataMsg::Envelope(e)` to `out`.
pub(crate) fn encode_envelope(out: &mut Vec<u8>, e: &EnvelopeRef<'_>) {
    out.reserve(160 + e.type_name.len() + e.entity_id.len() + e.payload.len());
    put_head(out, MAJOR_MAP, 1);
    put_text(out, "Envelope");
    let optional = u64::from(e.trace.is_some())
        + u64::from(e.delivery.is_some())
        + u64::from(e.line.is_some());
    put_head(out, MAJOR_MAP, 9 + optional);
    put_text(out, "type_name");
    put_text(out, e.type_name);
    put_text(out, "fingerprint");
    put_uint(out, e.fingerprint);
    put_text(out, "shard");
    put_uint(out, u64::from(e.shard));
    put_text(out, "generation");
    put_uint(out, e.generation);
    put_text(out, "entity_id");
    put_text(out, e.entity_id);
    put_text(out, "index");
    put_uint(out, u64::from(e.index));
    put_text(out, "hops");
    put_uint(out, u64::from(e.hops));
    put_text(out, "reply_to");
    match &e.reply_to {
        None => out.push(NULL),
        Some(target) => {
            put_head(out, MAJOR_MAP, 2);
            put_text(out, "origin");
            put_address(out, &target.origin);
            put_text(out, "ask_id");
            put_uint(out, target.ask_id);
        }
    }
    put_text(out, "payload");
    put_bytes(out, e.payload);
    if let Some(trace) = &e.trace {
        put_text(out, "trace");
        put_bytes(out, trace);
    }
    if let Some(DeliveryRef(producer, epoch, seq)) = e.delivery {
        put_text(out, "delivery");
        put_head(out, MAJOR_ARRAY, 3);
        put_text(out, producer);
        put_uint(out, epoch);
        put_uint(out, seq);
    }
    if let Some(line) = e.line {
        put_text(out, "line");
        put_uint(out, line);
    }
}

/// Appends the canonical CBOR of the compact `DataMsg::E`: `{"E":
/// [type_name, fingerprint, shard, generation, entity_id, index, ask_id |
/// null, payload]}`. Only for an envelope [`EnvelopeRef::is_compact_from`]
/// accepts: the receiver takes its hop count as 0 and its asker as the
/// pipe's peer.
pub(crate) fn encode_envelope_compact(out: &mut Vec<u8>, e: &EnvelopeRef<'_>) {
    out.reserve(48 + e.type_name.len() + e.entity_id.len() + e.payload.len());
    put_head(out, MAJOR_MAP, 1);
    put_text(out, "E");
    put_head(out, MAJOR_ARRAY, 8);
    put_text(out, e.type_name);
    put_uint(out, e.fingerprint);
    put_uint(out, u64::from(e.shard));
    put_uint(out, e.generation);
    put_text(out, e.entity_id);
    put_uint(out, u64::from(e.index));
    match &e.reply_to {
        None => out.push(NULL),
        Some(target) => put_uint(out, target.ask_id),
    }
    put_bytes(out, e.payload);
}

/// Appends the canonical CBOR of the compact `DataMsg::R`: `{"R": [ask_id,
/// value]}`, an `Ok` reply.
pub(crate) fn encode_reply_ok_compact(out: &mut Vec<u8>, ask_id: u64, value: &[u8]) {
    out.reserve(16 + value.len());
    put_head(out, MAJOR_MAP, 1);
    put_text(out, "R");
    put_head(out, MAJOR_ARRAY, 2);
    put_uint(out, ask_id);
    put_bytes(out, value);
}

/// Appends the canonical CBOR of `DataMsg::Reply { ask_id, result: Ok(value) }`.
pub(crate) fn encode_reply_ok(out: &mut Vec<u8>, ask_id: u64, value: &[u8]) {
    out.reserve(32 + value.len());
    put_head(out, MAJOR_MAP, 1);
    put_text(out, "Reply");
    put_head(out, MAJOR_MAP, 2);
    put_text(out, "ask_id");
    put_uint(out, ask_id);
    put_text(out, "result");
    put_head(out, MAJOR_MAP, 1);
    put_text(out, "Ok");
    put_bytes(out, value);
}

/// A hot data message decoded in place.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum DataRef<'a> {
    Envelope(EnvelopeRef<'a>),
    ReplyOk { ask_id: u64, value: &'a [u8] },
}

/// Reads a `UniqueAddress` in serde's form (see [`put_address`]).
fn address(r: &mut Reader<'_>) -> Option<UniqueAddress> {
    r.expect(MAJOR_MAP, 3)?;
    r.key("addr")?;
    r.expect(MAJOR_MAP, 1)?;
    let family = r.text_bytes()?;
    r.expect(MAJOR_ARRAY, 2)?;
    let ip = match family {
        b"V4" => IpAddr::V4(Ipv4Addr::from(octets::<4>(r)?)),
        b"V6" => IpAddr::V6(Ipv6Addr::from(octets::<16>(r)?)),
        _ => return None,
    };
    let port = u16::try_from(r.uint()?).ok()?;
    r.key("node_id")?;
    let node_id = NodeId(r.uint()?);
    r.key("incarnation")?;
    let incarnation = r.uint()?;
    Some(UniqueAddress {
        addr: SocketAddr::new(ip, port),
        node_id,
        incarnation,
    })
}

fn octets<const N: usize>(r: &mut Reader<'_>) -> Option<[u8; N]> {
    r.expect(MAJOR_ARRAY, N as u64)?;
    let mut o = [0u8; N];
    for b in &mut o {
        *b = u8::try_from(r.uint()?).ok()?;
    }
    Some(o)
}

/// Decodes an envelope or an `Ok` reply in canonical form, long or
/// compact, that came over the pipe from `from` (a compact envelope's
/// asker); `None` for anything else (which serde then decodes, or refuses).
pub(crate) fn decode<'a>(body: &'a [u8], from: &UniqueAddress) -> Option<DataRef<'a>> {
    let mut r = Reader::new(body);
    r.expect(MAJOR_MAP, 1)?;
    // Tags and keys are compared as bytes, as the frame codec's are
    // (`wire/fast.rs`): one that is not UTF-8 matches none of them.
    let msg = match r.text_bytes()? {
        b"E" => {
            r.expect(MAJOR_ARRAY, 8)?;
            let type_name = r.text()?;
            let fingerprint = r.uint()?;
            let shard = u32::try_from(r.uint()?).ok()?;
            let generation = r.uint()?;
            let entity_id = r.text()?;
            let index = u16::try_from(r.uint()?).ok()?;
            let ask = if r.peek()? == NULL {
                r.take(1)?;
                None
            } else {
                Some(r.uint()?)
            };
            let c = CompactEnvelopeRef(
                type_name,
                fingerprint,
                shard,
                generation,
                entity_id,
                index,
                ask,
                r.bytes()?,
            );
            DataRef::Envelope(EnvelopeRef::from_compact(c, from))
        }
        b"R" => {
            r.expect(MAJOR_ARRAY, 2)?;
            let ask_id = r.uint()?;
            DataRef::ReplyOk {
                ask_id,
                value: r.bytes()?,
            }
        }
        b"Envelope" => {
            // Nine fields, then a trace context, a delivery tag and a
            // line's fingerprint if any.
            let fields = match r.head()? {
                (MAJOR_MAP, n @ 9..=12) => n,
                _ => return None,
            };
            r.key("type_name")?;
            let type_name = r.text()?;
            r.key("fingerprint")?;
            let fingerprint = r.uint()?;
            r.key("shard")?;
            let shard = u32::try_from(r.uint()?).ok()?;
            r.key("generation")?;
            let generation = r.uint()?;
            r.key("entity_id")?;
            let entity_id = r.text()?;
            r.key("index")?;
            let index = u16::try_from(r.uint()?).ok()?;
            r.key("hops")?;
            let hops = u8::try_from(r.uint()?).ok()?;
            r.key("reply_to")?;
            let reply_to = if r.peek()? == NULL {
                r.take(1)?;
                None
            } else {
                r.expect(MAJOR_MAP, 2)?;
                r.key("origin")?;
                let origin = address(&mut r)?;
                r.key("ask_id")?;
                let ask_id = r.uint()?;
                Some(ReplyTarget { origin, ask_id })
            };
            r.key("payload")?;
            let payload = r.bytes()?;
            let (mut trace, mut delivery, mut line) = (None, None, None);
            for _ in 9..fields {
                match r.text_bytes()? {
                    b"trace" if trace.is_none() && delivery.is_none() && line.is_none() => {
                        trace = Some(r.bytes()?.try_into().ok()?);
                    }
                    b"delivery" if delivery.is_none() && line.is_none() => {
                        r.expect(MAJOR_ARRAY, 3)?;
                        delivery = Some(DeliveryRef(r.text()?, r.uint()?, r.uint()?));
                    }
                    b"line" if line.is_none() => line = Some(r.uint()?),
                    _ => return None,
                }
            }
            DataRef::Envelope(EnvelopeRef {
                type_name,
                fingerprint,
                shard,
                generation,
                entity_id,
                index,
                hops,
                reply_to,
                payload,
                trace,
                delivery,
                line,
            })
        }
        b"Reply" => {
            r.expect(MAJOR_MAP, 2)?;
            r.key("ask_id")?;
            let ask_id = r.uint()?;
            r.key("result")?;
            r.expect(MAJOR_MAP, 1)?;
            r.key("Ok")?;
            DataRef::ReplyOk {
                ask_id,
                value: r.bytes()?,
            }
        }
        _ => return None,
    };
    r.at_end().then_some(msg)
}

#[cfg(test)]
#[path = "fast_tests.rs"]
mod tests;
