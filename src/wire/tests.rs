//! Codec tests: fixed cases and quickcheck properties.

use std::net::SocketAddr;

use bytes::{BufMut, Bytes, BytesMut};
use quickcheck::{Arbitrary, Gen, TestResult};
use quickcheck_macros::quickcheck;
use tokio_util::codec::{Decoder, Encoder};

use super::*;
use crate::model::identity::{NodeId, UniqueAddress};

fn addr() -> UniqueAddress {
    let addr: SocketAddr = "127.0.0.1:2552".parse().expect("literal address");
    UniqueAddress {
        addr,
        node_id: NodeId(0xfeed),
        incarnation: 1_700_000_000_000,
    }
}

fn all_variants() -> Vec<Frame> {
    vec![
        Frame::Hello {
            version: PROTOCOL_VERSION,
            cluster: "orders".into(),
            from: addr(),
            nonce: Bytes::from(vec![7; 32]),
        },
        Frame::Welcome {
            version: 1,
            from: addr(),
            nonce: Bytes::from(vec![1; 32]),
            proof: Bytes::from(vec![2; 32]),
        },
        Frame::Proof {
            proof: Bytes::from(vec![3; 32]),
        },
        Frame::Accepted,
        Frame::Reject {
            reason: RejectReason::UnsupportedVersion { ours: 1, min: 1 },
        },
        Frame::Reject {
            reason: RejectReason::Quarantined,
        },
        Frame::Oneway {
            channel: 3,
            payload: Bytes::new(),
        },
        Frame::Request {
            corr: u64::MAX,
            channel: u16::MAX,
            payload: Bytes::from_static(b"req"),
        },
        Frame::Reply {
            corr: 0,
            result: ReplyResult::Ok(Bytes::from_static(b"ok")),
        },
        Frame::Reply {
            corr: 9,
            result: ReplyResult::Err(RemoteFailure::Failed("no".into())),
        },
        Frame::Reply {
            corr: 9,
            result: ReplyResult::Err(RemoteFailure::NoHandler(4)),
        },
    ]
}

fn encode(frame: &Frame) -> BytesMut {
    let mut buf = BytesMut::new();
    FrameCodec::default()
        .encode(frame, &mut buf)
        .expect("encodes");
    buf
}

#[test]
fn every_variant_round_trips() {
    let mut codec = FrameCodec::default();
    let mut buf = BytesMut::new();
    for f in all_variants() {
        codec.encode(&f, &mut buf).expect("encodes");
    }
    for f in all_variants() {
        assert_eq!(codec.decode(&mut buf).expect("decodes"), Some(f));
    }
    assert_eq!(codec.decode(&mut buf).expect("empty is fine"), None);
}

#[test]
fn length_prefix_is_big_endian_body_length() {
    let buf = encode(&Frame::Accepted);
    let len = u32::from_be_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize;
    assert_eq!(len, buf.len() - LEN_PREFIX);
}

#[test]
fn payload_is_a_cbor_byte_string() {
    let buf = encode(&Frame::Oneway {
        channel: 1,
        payload: Bytes::from_static(&[0xaa, 0xbb, 0xcc]),
    });
    // Major type 2 (byte string), length 3, then the raw bytes.
    let needle = [0x43, 0xaa, 0xbb, 0xcc];
    assert!(
        buf.windows(4).any(|w| w == needle),
        "payload not a byte string: {buf:x?}"
    );
}

#[test]
fn partial_input_needs_more_bytes() {
    let full = encode(&Frame::Request {
        corr: 1,
        channel: 2,
        payload: Bytes::from_static(b"xyz"),
    });
    let mut codec = FrameCodec::default();
    for cut in 0..full.len() {
        let mut part = BytesMut::from(&full[..cut]);
        assert_eq!(
            codec.decode(&mut part).expect("no error on a prefix"),
            None,
            "cut at {cut}"
        );
    }
}

#[test]
fn oversized_prefix_is_refused_before_reserving() {
    let mut codec = FrameCodec::new(1024);
    let mut buf = BytesMut::with_capacity(8);
    buf.put_u32(1025);
    let cap = buf.capacity();
    match codec.decode(&mut buf) {
        Err(WireError::FrameTooLarge {
            len: 1025,
            max: 1024,
        }) => {}
        other => panic!("expected FrameTooLarge, got {other:?}"),
    }
    assert_eq!(buf.capacity(), cap, "nothing reserved for a refused frame");

    let mut huge = BytesMut::new();
    huge.put_u32(u32::MAX);
    assert!(matches!(
        FrameCodec::default().decode(&mut huge),
        Err(WireError::FrameTooLarge { .. })
    ));
}

/// A peer that announces a large frame and sends only its first bytes makes
/// the decoder reserve one chunk ahead, not the announced length.
#[test]
fn announced_length_is_reserved_incrementally() {
    let mut codec = FrameCodec::default();
    let mut buf = BytesMut::new();
    buf.put_u32(4 * 1024 * 1024);
    buf.extend_from_slice(&[0xa1; 10]);
    assert_eq!(codec.decode(&mut buf).expect("needs more"), None);
    assert!(
        buf.capacity() <= 2 * (RESERVE_CHUNK + 14),
        "reserved {} bytes for 14 that arrived",
        buf.capacity()
    );
    // A whole large frame, fed in pieces, still decodes.
    let big = Frame::Oneway {
        channel: 2,
        payload: Bytes::from(vec![7u8; 1_000_000]),
    };
    let mut full = BytesMut::new();
    codec.encode(&big, &mut full).expect("encodes");
    let mut stream = BytesMut::new();
    let mut got = None;
    for piece in full.chunks(50_000) {
        stream.extend_from_slice(piece);
        if let Some(f) = codec.decode(&mut stream).expect("no error") {
            got = Some(f);
        }
    }
    assert_eq!(got, Some(big));
}

/// Large payloads are slices of the received body, small ones copies.
#[test]
fn large_payloads_are_sliced_small_ones_copied() {
    let mut codec = FrameCodec::default();
    for (len, sliced) in [(fast::SLICE_MIN, true), (100, false)] {
        let f = Frame::Oneway {
            channel: 1,
            payload: Bytes::from(vec![3u8; len]),
        };
        let mut buf = BytesMut::new();
        codec.encode(&f, &mut buf).expect("encodes");
        let range = buf.as_ptr() as usize..buf.as_ptr() as usize + buf.len();
        let Some(Frame::Oneway { payload, .. }) = codec.decode(&mut buf).expect("decodes") else {
            panic!("a oneway");
        };
        assert_eq!(payload.len(), len);
        assert_eq!(
            range.contains(&(payload.as_ptr() as usize)),
            sliced,
            "payload of {len} bytes"
        );
    }
}

#[test]
fn encoder_refuses_oversized_body_and_leaves_buffer_intact() {
    let mut codec = FrameCodec::new(16);
    let mut buf = BytesMut::from(&b"keep"[..]);
    let big = Frame::Oneway {
        channel: 1,
        payload: Bytes::from(vec![0; 64]),
    };
    assert!(matches!(
        codec.encode(&big, &mut buf),
        Err(WireError::FrameTooLarge { .. })
    ));
    assert_eq!(&buf[..], b"keep");
}

#[test]
fn empty_body_and_trailing_bytes_are_errors() {
    let mut codec = FrameCodec::default();
    let mut empty = BytesMut::new();
    empty.put_u32(0);
    assert!(matches!(
        codec.decode(&mut empty),
        Err(WireError::Malformed(_))
    ));

    let good = encode(&Frame::Accepted);
    let mut body = good[LEN_PREFIX..].to_vec();
    body.push(0x00);
    let mut buf = BytesMut::new();
    buf.put_u32(body.len() as u32);
    buf.extend_from_slice(&body);
    assert!(matches!(
        codec.decode(&mut buf),
        Err(WireError::TrailingBytes(1))
    ));
}

#[test]
fn deeply_nested_cbor_is_an_error_not_a_stack_overflow() {
    // 100k nested one-element arrays: ciborium's recursion limit must stop it.
    let body = vec![0x81u8; 100_000];
    let mut buf = BytesMut::new();
    buf.put_u32(body.len() as u32);
    buf.extend_from_slice(&body);
    assert!(FrameCodec::default().decode(&mut buf).is_err());
}

#[test]
fn huge_inner_length_is_an_error_not_an_allocation() {
    // A byte string announcing 2^62 bytes inside a small frame.
    let mut body = vec![0xa1, 0x66];
    body.extend_from_slice(b"Oneway");
    body.extend_from_slice(&[0xa2, 0x67]);
    body.extend_from_slice(b"channel");
    body.push(0x01);
    body.extend_from_slice(&[0x67]);
    body.extend_from_slice(b"payload");
    body.extend_from_slice(&[0x5b, 0x40, 0, 0, 0, 0, 0, 0, 0]);
    let mut buf = BytesMut::new();
    buf.put_u32(body.len() as u32);
    buf.extend_from_slice(&body);
    assert!(FrameCodec::default().decode(&mut buf).is_err());
}

// ------------------------------------------------------------ properties

#[derive(Clone, Debug)]
struct AnyFrame(Frame);

fn bytes(g: &mut Gen) -> Bytes {
    Bytes::from(Vec::<u8>::arbitrary(g))
}

fn unique(g: &mut Gen) -> UniqueAddress {
    let ip = std::net::Ipv4Addr::from(u32::arbitrary(g));
    UniqueAddress {
        addr: SocketAddr::from((ip, u16::arbitrary(g))),
        node_id: NodeId(u64::arbitrary(g)),
        incarnation: u64::arbitrary(g),
    }
}

impl Arbitrary for AnyFrame {
    fn arbitrary(g: &mut Gen) -> Self {
        let reasons = [
            RejectReason::UnsupportedVersion {
                ours: u16::arbitrary(g),
                min: u16::arbitrary(g),
            },
            RejectReason::WrongCluster,
            RejectReason::BadProof,
            RejectReason::Duplicate,
            RejectReason::Quarantined,
            RejectReason::ProtocolViolation,
            RejectReason::ShuttingDown,
            RejectReason::CertificateMismatch,
        ];
        let failures = [
            RemoteFailure::NoHandler(u16::arbitrary(g)),
            RemoteFailure::Overloaded,
            RemoteFailure::Dropped,
            RemoteFailure::Failed(String::arbitrary(g)),
        ];
        let frame = match u8::arbitrary(g) % 9 {
            0 => Frame::Hello {
                version: u16::arbitrary(g),
                cluster: String::arbitrary(g),
                from: unique(g),
                nonce: bytes(g),
            },
            1 => Frame::Welcome {
                version: u16::arbitrary(g),
                from: unique(g),
                nonce: bytes(g),
                proof: bytes(g),
            },
            2 => Frame::Proof { proof: bytes(g) },
            3 => Frame::Accepted,
            4 => Frame::Reject {
                reason: g
                    .choose(&reasons)
                    .cloned()
                    .unwrap_or(RejectReason::BadProof),
            },
            5 => Frame::Oneway {
                channel: u16::arbitrary(g),
                payload: bytes(g),
            },
            6 => Frame::Request {
                corr: u64::arbitrary(g),
                channel: u16::arbitrary(g),
                payload: bytes(g),
            },
            7 => Frame::Reply {
                corr: u64::arbitrary(g),
                result: ReplyResult::Ok(bytes(g)),
            },
            _ => Frame::Reply {
                corr: u64::arbitrary(g),
                result: ReplyResult::Err(
                    g.choose(&failures)
                        .cloned()
                        .unwrap_or(RemoteFailure::Dropped),
                ),
            },
        };
        AnyFrame(frame)
    }
}

/// Decodes everything in `buf`, stopping at the first error or "need more".
fn drain(codec: &mut FrameCodec, buf: &mut BytesMut) -> Vec<Frame> {
    let mut out = Vec::new();
    while let Ok(Some(f)) = codec.decode(buf) {
        out.push(f);
    }
    out
}

#[quickcheck]
fn codec_round_trips(frames: Vec<AnyFrame>) -> bool {
    let mut codec = FrameCodec::default();
    let mut buf = BytesMut::new();
    for AnyFrame(f) in &frames {
        if codec.encode(f, &mut buf).is_err() {
            return false;
        }
    }
    let decoded = drain(&mut codec, &mut buf);
    buf.is_empty() && decoded == frames.into_iter().map(|AnyFrame(f)| f).collect::<Vec<_>>()
}

#[quickcheck]
fn decoder_never_panics_on_random_bytes(data: Vec<u8>, max: u16) -> bool {
    let mut codec = FrameCodec::new(usize::from(max));
    let mut buf = BytesMut::from(&data[..]);
    drain(&mut codec, &mut buf);
    true
}

#[quickcheck]
fn decoder_never_panics_on_random_body_with_valid_prefix(body: Vec<u8>) -> bool {
    let mut buf = BytesMut::new();
    buf.put_u32(body.len() as u32);
    buf.extend_from_slice(&body);
    drain(&mut FrameCodec::default(), &mut buf);
    true
}

/// Mutations of valid encodings: flipped bytes, truncations, insertions.
#[quickcheck]
fn decoder_never_panics_on_mutated_frames(
    frames: Vec<AnyFrame>,
    edits: Vec<(usize, u8, u8)>,
    cut: Option<usize>,
) -> TestResult {
    let mut codec = FrameCodec::default();
    let mut buf = BytesMut::new();
    for AnyFrame(f) in &frames {
        if codec.encode(f, &mut buf).is_err() {
            return TestResult::failed();
        }
    }
    if buf.is_empty() {
        return TestResult::discard();
    }
    let mut bytes = buf.to_vec();
    for (at, kind, value) in edits {
        let at = at % bytes.len().max(1);
        match kind % 4 {
            0 => bytes[at] = value,
            1 => bytes[at] ^= 1 << (value % 8),
            2 => bytes.insert(at, value),
            _ => {
                bytes.remove(at);
            }
        }
        if bytes.is_empty() {
            break;
        }
    }
    if let Some(cut) = cut {
        bytes.truncate(cut % (bytes.len() + 1));
    }
    // Feed in small pieces too, as a socket would.
    let mut stream = BytesMut::new();
    for chunk in bytes.chunks(7) {
        stream.extend_from_slice(chunk);
        if codec.decode(&mut stream).is_err() {
            break;
        }
        drain(&mut codec, &mut stream);
    }
    TestResult::passed()
}

// ------------------------------------------------------------ fast path

fn serde_body(frame: &Frame) -> Vec<u8> {
    let mut out = Vec::new();
    ciborium::into_writer(frame, &mut out).expect("serde encodes");
    out
}

#[test]
fn fast_path_covers_the_hot_variants_only() {
    for f in all_variants() {
        let mut buf = BytesMut::new();
        let hot = fast::encode(&f, &mut buf);
        let expect_hot = matches!(
            f,
            Frame::Oneway { .. }
                | Frame::Request { .. }
                | Frame::Reply {
                    result: ReplyResult::Ok(_),
                    ..
                }
        );
        assert_eq!(hot, expect_hot, "{f:?}");
        if hot {
            assert_eq!(&buf[..], &serde_body(&f)[..], "{f:?}");
            assert_eq!(fast::decode(&buf, None), Some(f));
        }
    }
}

#[test]
fn fast_path_reads_integer_heads_of_every_width() {
    for corr in [
        0,
        23,
        24,
        255,
        256,
        65_535,
        65_536,
        u64::from(u32::MAX),
        u64::from(u32::MAX) + 1,
        u64::MAX,
    ] {
        let f = Frame::Request {
            corr,
            channel: 300,
            payload: Bytes::from(vec![9; 300]),
        };
        let body = serde_body(&f);
        assert_eq!(fast::decode(&body, None), Some(f), "corr {corr}");
    }
}

#[test]
fn non_canonical_forms_fall_back_to_serde() {
    // channel 5 written with a one-byte argument (18 05) instead of 05.
    let mut body = vec![0xa1, 0x66];
    body.extend_from_slice(b"Oneway");
    body.extend_from_slice(&[0xa2, 0x67]);
    body.extend_from_slice(b"channel");
    body.extend_from_slice(&[0x18, 0x05, 0x67]);
    body.extend_from_slice(b"payload");
    body.extend_from_slice(&[0x41, 0xee]);
    assert_eq!(fast::decode(&body, None), None);
    let expect = Frame::Oneway {
        channel: 5,
        payload: Bytes::from_static(&[0xee]),
    };
    assert_eq!(
        FrameCodec::decode_body(&body).expect("serde decodes it"),
        expect
    );
}

/// The fast encoder writes exactly serde's bytes.
#[quickcheck]
fn fast_encoding_is_byte_identical_to_serde(f: AnyFrame) -> bool {
    let mut buf = BytesMut::new();
    !fast::encode(&f.0, &mut buf) || buf[..] == serde_body(&f.0)[..]
}

/// Whenever the fast decoder accepts a body, serde reads the same frame.
#[quickcheck]
fn fast_decoding_agrees_with_serde(f: AnyFrame, edits: Vec<(usize, u8)>) -> bool {
    let mut body = serde_body(&f.0);
    for (at, value) in edits {
        if body.is_empty() {
            break;
        }
        let at = at % body.len();
        body[at] = value;
    }
    match fast::decode(&body, None) {
        None => true,
        Some(fast_frame) => FrameCodec::decode_body_serde(&body).ok() == Some(fast_frame),
    }
}

/// The reader's in-place `Oneway` peek accepts exactly the `Oneway` bodies
/// the fast decoder accepts, with the same channel and payload, and the
/// whole frame's length (with more bytes behind the frame, or none); an
/// incomplete frame is never peeked. Checked on each generated frame as it
/// is (so the accepting case is common) and mutated.
#[quickcheck]
fn peeking_a_oneway_agrees_with_the_fast_decoder(f: AnyFrame, edits: Vec<(usize, u8)>) -> bool {
    fn agrees(body: &[u8]) -> bool {
        let mut framed = (body.len() as u32).to_be_bytes().to_vec();
        framed.extend_from_slice(body);
        let decoded = match fast::decode(body, None) {
            Some(Frame::Oneway { channel, payload }) => Some((channel, payload.to_vec())),
            _ => None,
        };
        let expected = decoded.map(|(c, p)| (c, p, framed.len()));
        let peek = |bytes: &[u8]| {
            FrameCodec::default()
                .peek_oneway(bytes)
                .map(|(c, p, total)| (c, p.to_vec(), total))
        };
        let alone = peek(&framed);
        let mut followed = framed.clone();
        followed.extend_from_slice(b"next frame");
        alone == expected
            && peek(&followed) == expected
            && peek(&framed[..framed.len() - 1]).is_none()
    }
    let mut body = serde_body(&f.0);
    let unmutated = agrees(&body);
    for (at, value) in edits {
        if body.is_empty() {
            break;
        }
        let at = at % body.len();
        body[at] = value;
    }
    unmutated && agrees(&body)
}

#[test]
fn a_canonical_oneway_is_peeked_in_place_and_a_request_is_not() {
    let mut buf = BytesMut::new();
    let oneway = Frame::Oneway {
        channel: 2,
        payload: Bytes::from_static(b"envelope"),
    };
    FrameCodec::default()
        .encode(&oneway, &mut buf)
        .expect("encodes");
    let len = buf.len();
    let (channel, payload, total) = FrameCodec::default().peek_oneway(&buf).expect("peeked");
    assert_eq!((channel, payload, total), (2, &b"envelope"[..], len));
    let mut req = BytesMut::new();
    let request = Frame::Request {
        corr: 1,
        channel: 2,
        payload: Bytes::from_static(b"envelope"),
    };
    FrameCodec::default()
        .encode(&request, &mut req)
        .expect("encodes");
    assert!(FrameCodec::default().peek_oneway(&req).is_none());
    // An announced length over the limit is left to `decode` to report.
    let mut huge = (u32::MAX).to_be_bytes().to_vec();
    huge.extend_from_slice(&buf[4..]);
    assert!(FrameCodec::default().peek_oneway(&huge).is_none());
}

/// The worked `Hello` example of SPEC §9.1, byte for byte: SPEC and the
/// encoder cannot drift apart. Also pins `UniqueAddress`'s CBOR form: `addr`
/// is serde's non-human-readable form (`{"V4": [[a, b, c, d], port]}`), not
/// text, and `node_id` a bare unsigned integer.
#[test]
fn spec_hello_example_bytes() {
    let from = UniqueAddress {
        addr: "127.0.0.1:7355".parse().expect("literal address"),
        node_id: NodeId(0x0123_4567_89ab_cdef),
        incarnation: 1_700_000_000_000_000,
    };
    let hello = Frame::Hello {
        version: 2,
        cluster: "orders".into(),
        from,
        nonce: Bytes::from((0u8..32).collect::<Vec<u8>>()),
    };
    // As printed in SPEC §9.1, row by row.
    let spec = "
        00 00 00 87
        a1 65 48 65 6c 6c 6f
        a4 67 76 65 72 73 69 6f 6e 02
        67 63 6c 75 73 74 65 72 66 6f 72 64 65 72 73
        64 66 72 6f 6d a3
        64 61 64 64 72 a1 62 56 34 82
        84 18 7f 00 00 01
        19 1c bb
        67 6e 6f 64 65 5f 69 64 1b 01 23 45 67 89 ab cd ef
        6b 69 6e 63 61 72 6e 61 74 69 6f 6e
           1b 00 06 0a 24 18 1e 40 00
        65 6e 6f 6e 63 65 58 20
        00 01 02 03 04 05 06 07 08 09 0a 0b 0c 0d 0e 0f
        10 11 12 13 14 15 16 17 18 19 1a 1b 1c 1d 1e 1f
    ";
    let expected: Vec<u8> = spec
        .split_whitespace()
        .map(|h| u8::from_str_radix(h, 16).expect("hex"))
        .collect();
    assert_eq!(&encode(&hello)[..], &expected[..]);
    let mut codec = FrameCodec::default();
    let mut buf = BytesMut::from(&expected[..]);
    assert_eq!(codec.decode(&mut buf).expect("decodes"), Some(hello));
}

/// A `Hello` whose `addr` is the text form (`"127.0.0.1:7355"`) is not a
/// frame: the node accepts only the binary form SPEC §9.1 gives. The same
/// body with the binary form decodes, so the address is what is refused.
#[test]
fn text_form_address_is_malformed() {
    let frame_with = |addr: &[u8]| {
        let mut body = Vec::new();
        body.extend_from_slice(b"\xa1\x65Hello\xa4\x67version\x02\x67cluster\x61c");
        body.extend_from_slice(b"\x64from\xa3\x64addr");
        body.extend_from_slice(addr);
        body.extend_from_slice(b"\x67node_id\x01\x6bincarnation\x01\x65nonce\x58\x20");
        body.extend_from_slice(&[0; 32]);
        let mut buf = BytesMut::new();
        buf.put_u32(body.len() as u32);
        buf.extend_from_slice(&body);
        FrameCodec::default().decode(&mut buf)
    };
    let binary = frame_with(b"\xa1\x62V4\x82\x84\x18\x7f\x00\x00\x01\x19\x1c\xbb");
    assert!(matches!(binary, Ok(Some(Frame::Hello { from, .. })) if from.addr.port() == 7355));
    let text = frame_with(b"\x6e127.0.0.1:7355");
    assert!(matches!(text, Err(WireError::Malformed(_))), "{text:?}");
}

/// The reader's heads: shortest form only, each width at its floor and top;
/// info 28..=31, values under a width's floor and cut heads are refused,
/// with no panic.
#[test]
fn reader_heads_are_shortest_form_only() {
    fn head(bytes: &[u8]) -> (Option<(u8, u64)>, usize) {
        let mut r = cbor::Reader::new(bytes);
        let h = r.head();
        (h, r.pos())
    }
    for (bytes, arg) in [
        (&[0x17][..], 23),
        (&[0x18, 24][..], 24),
        (&[0x18, 0xff][..], 255),
        (&[0x19, 0x01, 0x00][..], 256),
        (&[0x19, 0xff, 0xff][..], 65_535),
        (&[0x1a, 0x00, 0x01, 0x00, 0x00][..], 65_536),
        (&[0x1a, 0xff, 0xff, 0xff, 0xff][..], u64::from(u32::MAX)),
        (&[0x1b, 0, 0, 0, 1, 0, 0, 0, 0][..], 1 << 32),
        (
            &[0x1b, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff][..],
            u64::MAX,
        ),
    ] {
        assert_eq!(head(bytes), (Some((0, arg)), bytes.len()), "{bytes:02x?}");
        let mut text = bytes.to_vec();
        text[0] |= 0x60;
        assert_eq!(head(&text).0, Some((3, arg)), "{text:02x?}");
        for cut in 0..bytes.len() {
            assert_eq!(head(&bytes[..cut]).0, None, "{:02x?}", &bytes[..cut]);
        }
    }
    for bytes in [
        &[0x18, 0x05][..],
        &[0x18, 23][..],
        &[0x19, 0x00, 0xff][..],
        &[0x19, 0x00, 0x00][..],
        &[0x1a, 0x00, 0x00, 0xff, 0xff][..],
        &[0x1b, 0, 0, 0, 0, 0xff, 0xff, 0xff, 0xff][..],
        &[0x1c][..],
        &[0x1d][..],
        &[0x1e][..],
        &[0x1f][..],
        &[0xff][..],
    ] {
        assert_eq!(head(bytes).0, None, "{bytes:02x?}");
    }
}
