//! The remote-envelope path (divan): what one message to an entity on
//! another node costs in encoding and decoding, beside the message itself.
//!
//! * `encode_message`: the W1 `Ping` alone (CBOR through serde);
//!   `decode_message`: reading it back as a receiving node does (cbor4ii,
//!   ciborium for what cbor4ii leaves), and `decode_message_ciborium` with
//!   ciborium alone, as before.
//! * `encode_envelope_*`: the data-channel envelope around it (type name,
//!   fingerprint, shard, generation, entity id, index, hops, reply target,
//!   payload), through serde and by hand as `Remote::forward` writes it
//!   for a version-2 pipe (the same bytes), and in the compact form `E` it
//!   writes for a version-3 pipe (SPEC §13.4).
//! * `decode_envelope_*`: the inbound path's decode of that envelope,
//!   through serde and by hand, in place; `decode_envelope_compact`: the
//!   hand decode of the compact form.
//!
//! Run: `cargo bench --bench envelope`.

use datum_cluster_sharding::__private::bench;
use serde::{Deserialize, Serialize};

#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct Ping {
    driver: u32,
    seq: u64,
}

fn main() {
    divan::main();
}

fn ping_bytes() -> Vec<u8> {
    let mut out = Vec::new();
    ciborium::into_writer(
        &Ping {
            driver: 1,
            seq: 123_456,
        },
        &mut out,
    )
    .expect("encodes");
    out
}

#[divan::bench]
fn encode_message() -> Vec<u8> {
    ping_bytes()
}

#[divan::bench]
fn decode_message(bencher: divan::Bencher) {
    let bytes = ping_bytes();
    assert_eq!(
        bench::decode_message::<Ping>(&bytes),
        bench::decode_message_ciborium::<Ping>(&bytes)
    );
    bencher.bench(|| bench::decode_message::<Ping>(divan::black_box(&bytes)));
}

#[divan::bench]
fn decode_message_ciborium(bencher: divan::Bencher) {
    let bytes = ping_bytes();
    bencher.bench(|| bench::decode_message_ciborium::<Ping>(divan::black_box(&bytes)));
}

#[divan::bench]
fn encode_envelope_serde(bencher: divan::Bencher) {
    let payload = ping_bytes();
    bencher.bench(|| bench::encode_envelope_serde(divan::black_box("entity-123"), &payload));
}

#[divan::bench]
fn encode_envelope_fast(bencher: divan::Bencher) {
    let payload = ping_bytes();
    assert_eq!(
        bench::encode_envelope_fast("entity-123", &payload),
        bench::encode_envelope_serde("entity-123", &payload)
    );
    bencher.bench(|| bench::encode_envelope_fast(divan::black_box("entity-123"), &payload));
}

#[divan::bench]
fn encode_envelope_compact(bencher: divan::Bencher) {
    let payload = ping_bytes();
    let long = bench::encode_envelope_fast("entity-123", &payload);
    assert!(bench::encode_envelope_compact("entity-123", &payload).len() < long.len() / 2);
    bencher.bench(|| bench::encode_envelope_compact(divan::black_box("entity-123"), &payload));
}

#[divan::bench]
fn decode_envelope_compact(bencher: divan::Bencher) {
    let bytes = bench::encode_envelope_compact("entity-123", &ping_bytes());
    assert_eq!(
        bench::decode_envelope_fast(&bytes),
        bench::decode_envelope_fast(&bench::encode_envelope_fast("entity-123", &ping_bytes()))
    );
    bencher.bench(|| bench::decode_envelope_fast(divan::black_box(&bytes)));
}

#[divan::bench]
fn decode_envelope_serde(bencher: divan::Bencher) {
    let bytes = bench::encode_envelope_serde("entity-123", &ping_bytes());
    assert!(bench::decode_envelope_serde(&bytes) > 0);
    bencher.bench(|| bench::decode_envelope_serde(divan::black_box(&bytes)));
}

#[divan::bench]
fn decode_envelope_fast(bencher: divan::Bencher) {
    let bytes = bench::encode_envelope_serde("entity-123", &ping_bytes());
    assert!(bench::decode_envelope_fast(&bytes) > 0);
    bencher.bench(|| bench::decode_envelope_fast(divan::black_box(&bytes)));
}
