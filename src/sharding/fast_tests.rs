//! The hand-written envelope and reply codec against serde's, byte for byte.

use quickcheck::{Arbitrary, Gen, QuickCheck};

use super::*;
use crate::sharding::wire::{DataMsg, DataMsgOut, ReplyBody, ReplyBodyOut};

#[derive(Clone, Debug)]
struct Case {
    type_name: String,
    fingerprint: u64,
    shard: u32,
    generation: u64,
    entity_id: String,
    index: u16,
    hops: u8,
    reply_to: Option<(bool, [u8; 16], u16, u64, u64, u64)>,
    payload: Vec<u8>,
    trace: Option<[u8; 26]>,
    delivery: Option<(String, u64, u64)>,
}

impl Arbitrary for Case {
    fn arbitrary(g: &mut Gen) -> Self {
        let mut ip = [0u8; 16];
        for b in &mut ip {
            *b = u8::arbitrary(g);
        }
        Case {
            type_name: String::arbitrary(g),
            fingerprint: u64::arbitrary(g),
            shard: u32::arbitrary(g),
            generation: u64::arbitrary(g),
            entity_id: String::arbitrary(g),
            index: u16::arbitrary(g),
            hops: u8::arbitrary(g),
            reply_to: Option::<(bool, u16, u64, u64, u64)>::arbitrary(g)
                .map(|(v6, port, id, inc, ask)| (v6, ip, port, id, inc, ask)),
            payload: Vec::arbitrary(g),
            trace: bool::arbitrary(g).then(|| std::array::from_fn(|_| u8::arbitrary(g))),
            delivery: Option::arbitrary(g),
        }
    }
}

impl Case {
    fn target(&self) -> Option<ReplyTarget> {
        self.reply_to.map(|(v6, ip, port, id, inc, ask)| {
            let ip = if v6 {
                IpAddr::V6(Ipv6Addr::from(ip))
            } else {
                IpAddr::V4(Ipv4Addr::new(ip[0], ip[1], ip[2], ip[3]))
            };
            ReplyTarget {
                origin: UniqueAddress {
                    addr: SocketAddr::new(ip, port),
                    node_id: NodeId(id),
                    incarnation: inc,
                },
                ask_id: ask,
            }
        })
    }

    fn as_ref(&self) -> EnvelopeRef<'_> {
        EnvelopeRef {
            type_name: &self.type_name,
            fingerprint: self.fingerprint,
            shard: self.shard,
            generation: self.generation,
            entity_id: &self.entity_id,
            index: self.index,
            hops: self.hops,
            reply_to: self.target(),
            payload: &self.payload,
            trace: self.trace,
            delivery: self
                .delivery
                .as_ref()
                .map(|(producer, epoch, seq)| DeliveryRef(producer, *epoch, *seq)),
        }
    }
}

fn serde_bytes(c: &Case) -> Vec<u8> {
    DataMsgOut::Envelope(c.as_ref()).encode()
}

fn envelope_agrees(c: Case) -> bool {
    let mut fast = Vec::new();
    encode_envelope(&mut fast, &c.as_ref());
    let same_bytes = fast == serde_bytes(&c);
    let decoded = decode(&fast) == Some(DataRef::Envelope(c.as_ref()));
    let serde_reads = match ciborium::from_reader::<DataMsg, _>(&fast[..]) {
        Ok(DataMsg::Envelope(e)) => {
            e.type_name == c.type_name
                && e.entity_id == c.entity_id
                && e.payload[..] == c.payload[..]
                && e.reply_to == c.target()
                && e.generation == c.generation
                && e.delivery == c.delivery
        }
        _ => false,
    };
    same_bytes && decoded && serde_reads
}

fn reply_agrees(ask_id: u64, value: Vec<u8>) -> bool {
    let mut fast = Vec::new();
    encode_reply_ok(&mut fast, ask_id, &value);
    let serde = DataMsgOut::Reply {
        ask_id,
        result: ReplyBodyOut::Ok(&value),
    }
    .encode();
    let serde_reads = matches!(
        ciborium::from_reader::<DataMsg, _>(&fast[..]),
        Ok(DataMsg::Reply { ask_id: a, result: ReplyBody::Ok(v) }) if a == ask_id && v[..] == value[..]
    );
    fast == serde
        && decode(&fast)
            == Some(DataRef::ReplyOk {
                ask_id,
                value: &value,
            })
        && serde_reads
}

/// Whatever the fast decoder accepts (of mutated valid bodies), serde
/// decodes to the same message.
fn mutated_agrees(c: Case, flips: Vec<(usize, u8)>) -> bool {
    let mut bytes = Vec::new();
    encode_envelope(&mut bytes, &c.as_ref());
    for (at, x) in flips {
        if !bytes.is_empty() {
            let i = at % bytes.len();
            bytes[i] ^= x;
        }
    }
    match decode(&bytes) {
        None => true,
        Some(DataRef::Envelope(e)) => matches!(
            ciborium::from_reader::<DataMsg, _>(&bytes[..]),
            Ok(DataMsg::Envelope(s)) if s.type_name == e.type_name && s.entity_id == e.entity_id
                && s.payload[..] == *e.payload && s.reply_to == e.reply_to && s.shard == e.shard
                && s.fingerprint == e.fingerprint && s.generation == e.generation
                && s.index == e.index && s.hops == e.hops
        ),
        Some(DataRef::ReplyOk { ask_id, value }) => matches!(
            ciborium::from_reader::<DataMsg, _>(&bytes[..]),
            Ok(DataMsg::Reply { ask_id: a, result: ReplyBody::Ok(v) }) if a == ask_id && v[..] == *value
        ),
    }
}

#[test]
fn fast_envelopes_are_serdes_bytes() {
    QuickCheck::new()
        .tests(2000)
        .quickcheck(envelope_agrees as fn(Case) -> bool);
}

#[test]
fn fast_replies_are_serdes_bytes() {
    QuickCheck::new()
        .tests(1000)
        .quickcheck(reply_agrees as fn(u64, Vec<u8>) -> bool);
}

#[test]
fn fast_decoder_never_disagrees_with_serde() {
    QuickCheck::new()
        .tests(3000)
        .quickcheck(mutated_agrees as fn(Case, Vec<(usize, u8)>) -> bool);
}

#[test]
fn a_trace_context_rides_after_the_payload_as_a_tenth_field() {
    let mut c = Case::arbitrary(&mut Gen::new(8));
    c.trace = None;
    c.delivery = None;
    let mut plain = Vec::new();
    encode_envelope(&mut plain, &c.as_ref());
    let context = TraceContext {
        trace_id: [0x11; 16],
        span_id: [0x22; 8],
        flags: 1,
    };
    c.trace = Some(context.to_bytes());
    let mut traced = Vec::new();
    encode_envelope(&mut traced, &c.as_ref());
    // The map's head says ten fields; the rest is the plain envelope's,
    // then `"trace"` and its 26 bytes.
    assert_eq!((plain[10], traced[10]), (0xa9, 0xaa));
    assert_eq!(traced.len(), plain.len() + 6 + 2 + 26);
    assert_eq!(&traced[traced.len() - 34..traced.len() - 28], b"\x65trace");
    assert_eq!(&traced[traced.len() - 28..traced.len() - 26], &[0x58, 26]);
    let Some(DataRef::Envelope(read)) = decode(&traced) else {
        panic!("the traced envelope decodes");
    };
    assert_eq!(
        read.trace.and_then(|t| TraceContext::from_bytes(&t)),
        Some(context)
    );
    // A node that reads through serde ignores the field and keeps the rest.
    assert!(matches!(
        ciborium::from_reader::<DataMsg, _>(&traced[..]),
        Ok(DataMsg::Envelope(e)) if e.entity_id == c.entity_id
    ));
    // Another length of trace is not the canonical form.
    let mut short = traced.clone();
    short.truncate(short.len() - 1);
    let at = short.len() - 26;
    short[at] = 25;
    assert!(decode(&short).is_none());
}

#[test]
fn trace_contexts_of_another_version_or_invalid_ids_are_refused() {
    let good = TraceContext {
        trace_id: [7; 16],
        span_id: [9; 8],
        flags: 0,
    };
    assert_eq!(TraceContext::from_bytes(&good.to_bytes()), Some(good));
    let mut other_version = good.to_bytes();
    other_version[0] = 1;
    assert_eq!(TraceContext::from_bytes(&other_version), None);
    let zero_trace = TraceContext {
        trace_id: [0; 16],
        ..good
    };
    assert_eq!(TraceContext::from_bytes(&zero_trace.to_bytes()), None);
    let zero_span = TraceContext {
        span_id: [0; 8],
        ..good
    };
    assert_eq!(TraceContext::from_bytes(&zero_span.to_bytes()), None);
    assert_eq!(TraceContext::from_bytes(&good.to_bytes()[..25]), None);
}
