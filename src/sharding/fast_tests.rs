//! The hand-written envelope and reply codec against serde's, byte for byte,
//! in the long forms and the compact ones of protocol version 3.

use quickcheck::{Arbitrary, Gen, QuickCheck};

use super::*;
use crate::sharding::wire::{
    CompactEnvelope, CompactEnvelopeRef, DataMsg, DataMsgOut, ReplyBody, ReplyBodyOut,
};

/// The pipe's peer the tests decode from.
fn peer() -> UniqueAddress {
    UniqueAddress {
        addr: SocketAddr::from(([10, 0, 0, 9], 4242)),
        node_id: NodeId(77),
        incarnation: 5,
    }
}

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
    line: Option<u64>,
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
            line: Option::arbitrary(g),
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
            line: self.line,
        }
    }
}

fn serde_bytes(c: &Case) -> Vec<u8> {
    DataMsgOut::Envelope(c.as_ref()).encode()
}

impl Case {
    /// The case as its origin sends it, asked (if asked) by `peer()`: what
    /// the compact form carries.
    fn compact(mut self) -> Case {
        self.hops = 0;
        self.trace = None;
        self.delivery = None;
        self.line = None;
        if let Some(r) = &mut self.reply_to {
            let p = peer();
            *r = (
                false,
                [10, 0, 0, 9, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
                4242,
                p.node_id.0,
                p.incarnation,
                r.5,
            );
        }
        assert_eq!(
            self.target().map(|t| t.origin),
            self.reply_to.map(|_| peer())
        );
        self
    }

    fn compact_out(&self) -> CompactEnvelopeRef<'_> {
        CompactEnvelopeRef(
            &self.type_name,
            self.fingerprint,
            self.shard,
            self.generation,
            &self.entity_id,
            self.index,
            self.reply_to.map(|r| r.5),
            &self.payload,
        )
    }
}

/// serde reads `bytes` as `DataMsg::E` with `c`'s values.
fn serde_reads_compact(bytes: &[u8], c: &EnvelopeRef<'_>) -> bool {
    matches!(
        ciborium::from_reader::<DataMsg, _>(bytes),
        Ok(DataMsg::E(CompactEnvelope(t, f, s, g, e, i, a, p)))
            if t == c.type_name && f == c.fingerprint && s == c.shard && g == c.generation
                && e == c.entity_id && i == c.index && a == c.reply_to.map(|r| r.ask_id)
                && p[..] == *c.payload && c.hops == 0
    )
}

fn compact_envelope_agrees(c: Case) -> bool {
    let c = c.compact();
    let e = c.as_ref();
    if !e.is_compact_from(&peer()) {
        return false;
    }
    let mut fast = Vec::new();
    encode_envelope_compact(&mut fast, &e);
    fast == DataMsgOut::E(c.compact_out()).encode()
        && decode(&fast, &peer()) == Some(DataRef::Envelope(e))
        && serde_reads_compact(&fast, &e)
}

fn compact_reply_agrees(ask_id: u64, value: Vec<u8>) -> bool {
    let mut fast = Vec::new();
    encode_reply_ok_compact(&mut fast, ask_id, &value);
    let serde_reads = matches!(
        ciborium::from_reader::<DataMsg, _>(&fast[..]),
        Ok(DataMsg::R(a, v)) if a == ask_id && v[..] == value[..]
    );
    fast == DataMsgOut::R(ask_id, &value).encode()
        && decode(&fast, &peer())
            == Some(DataRef::ReplyOk {
                ask_id,
                value: &value,
            })
        && serde_reads
}

fn envelope_agrees(c: Case) -> bool {
    let mut fast = Vec::new();
    encode_envelope(&mut fast, &c.as_ref());
    let same_bytes = fast == serde_bytes(&c);
    let decoded = decode(&fast, &peer()) == Some(DataRef::Envelope(c.as_ref()));
    let serde_reads = match ciborium::from_reader::<DataMsg, _>(&fast[..]) {
        Ok(DataMsg::Envelope(e)) => {
            e.type_name == c.type_name
                && e.entity_id == c.entity_id
                && e.payload[..] == c.payload[..]
                && e.reply_to == c.target()
                && e.generation == c.generation
                && e.delivery == c.delivery
                && e.line == c.line
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
        && decode(&fast, &peer())
            == Some(DataRef::ReplyOk {
                ask_id,
                value: &value,
            })
        && serde_reads
}

/// Whatever the fast decoder accepts (of mutated valid bodies, long or
/// compact envelopes and replies), serde decodes to the same message.
fn mutated_agrees(c: Case, form: u8, flips: Vec<(usize, u8)>) -> bool {
    let mut bytes = Vec::new();
    match form % 4 {
        0 => encode_envelope(&mut bytes, &c.as_ref()),
        1 => encode_envelope_compact(&mut bytes, &c.clone().compact().as_ref()),
        2 => encode_reply_ok(&mut bytes, c.fingerprint, &c.payload),
        _ => encode_reply_ok_compact(&mut bytes, c.fingerprint, &c.payload),
    }
    for (at, x) in flips {
        if !bytes.is_empty() {
            let i = at % bytes.len();
            bytes[i] ^= x;
        }
    }
    let compact = bytes.get(1..3) == Some(&b"\x61E"[..]) || bytes.get(1..3) == Some(&b"\x61R"[..]);
    match decode(&bytes, &peer()) {
        None => true,
        Some(DataRef::Envelope(e)) if compact => serde_reads_compact(&bytes, &e),
        Some(DataRef::Envelope(e)) => matches!(
            ciborium::from_reader::<DataMsg, _>(&bytes[..]),
            Ok(DataMsg::Envelope(s)) if s.type_name == e.type_name && s.entity_id == e.entity_id
                && s.payload[..] == *e.payload && s.reply_to == e.reply_to && s.shard == e.shard
                && s.fingerprint == e.fingerprint && s.generation == e.generation
                && s.index == e.index && s.hops == e.hops
        ),
        Some(DataRef::ReplyOk { ask_id, value }) if compact => matches!(
            ciborium::from_reader::<DataMsg, _>(&bytes[..]),
            Ok(DataMsg::R(a, v)) if a == ask_id && v[..] == *value
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
fn compact_envelopes_are_serdes_bytes() {
    QuickCheck::new()
        .tests(2000)
        .quickcheck(compact_envelope_agrees as fn(Case) -> bool);
}

#[test]
fn compact_replies_are_serdes_bytes() {
    QuickCheck::new()
        .tests(1000)
        .quickcheck(compact_reply_agrees as fn(u64, Vec<u8>) -> bool);
}

#[test]
fn fast_decoder_never_disagrees_with_serde() {
    QuickCheck::new()
        .tests(4000)
        .quickcheck(mutated_agrees as fn(Case, u8, Vec<(usize, u8)>) -> bool);
}

#[test]
fn only_an_origins_plain_envelope_takes_the_compact_form() {
    let mut plain = Case::arbitrary(&mut Gen::new(8));
    plain.reply_to = Some((false, [0; 16], 1, 1, 1, 99));
    let plain = plain.compact();
    assert!(plain.as_ref().is_compact_from(&peer()));
    let mut tell = plain.clone();
    tell.reply_to = None;
    assert!(tell.as_ref().is_compact_from(&peer()));
    let mut forwarded = plain.clone();
    forwarded.hops = 1;
    let mut traced = plain.clone();
    traced.trace = Some([0; 26]);
    let mut tagged = plain.clone();
    tagged.delivery = Some(("p".into(), 1, 2));
    let mut elsewhere = plain.clone();
    elsewhere.reply_to = Some((
        false,
        [10, 0, 0, 8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
        1,
        1,
        1,
        1,
    ));
    for refused in [forwarded, traced, tagged] {
        assert!(!refused.as_ref().is_compact_from(&peer()));
    }
    assert!(!elsewhere.as_ref().is_compact_from(&peer()));
    // A compact envelope's asker is whoever the pipe says sent it.
    let mut bytes = Vec::new();
    encode_envelope_compact(&mut bytes, &plain.as_ref());
    let other = UniqueAddress {
        node_id: NodeId(78),
        ..peer()
    };
    let Some(DataRef::Envelope(read)) = decode(&bytes, &other) else {
        panic!("decodes");
    };
    assert_eq!(
        read.reply_to,
        Some(ReplyTarget {
            origin: other,
            ask_id: 99
        })
    );
}

#[test]
fn a_trace_context_rides_after_the_payload_as_a_tenth_field() {
    let mut c = Case::arbitrary(&mut Gen::new(8));
    c.trace = None;
    c.delivery = None;
    c.line = None;
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
    let Some(DataRef::Envelope(read)) = decode(&traced, &peer()) else {
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
    assert!(decode(&short, &peer()).is_none());
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

/// A tag, key or address family whose last byte is not UTF-8 matches none
/// (they are compared as bytes, with no check of their own).
#[test]
fn text_that_is_not_utf8_matches_no_tag_key_or_family() {
    let c = Case {
        type_name: "t".into(),
        fingerprint: 1,
        shard: 2,
        generation: 3,
        entity_id: "e".into(),
        index: 4,
        hops: 0,
        reply_to: Some((false, [1; 16], 7, 8, 9, 10)),
        payload: vec![0xee],
        trace: Some([1; 26]),
        delivery: None,
        line: Some(11),
    };
    let mut good = Vec::new();
    encode_envelope(&mut good, &c.as_ref());
    assert!(decode(&good, &peer()).is_some());
    for word in [&b"\x68Envelope"[..], b"\x62V4", b"\x65trace", b"\x64line"] {
        let at = good
            .windows(word.len())
            .position(|w| w == word)
            .expect("present");
        let mut bad = good.clone();
        bad[at + word.len() - 1] = 0xff;
        assert_eq!(
            decode(&bad, &peer()),
            None,
            "{}",
            String::from_utf8_lossy(word)
        );
    }
    let mut compact = Vec::new();
    encode_envelope_compact(&mut compact, &c.clone().compact().as_ref());
    assert_eq!(&compact[1..3], b"\x61E");
    compact[2] = 0xff;
    assert_eq!(decode(&compact, &peer()), None);
}
