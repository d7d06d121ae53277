//! `from_cbor` decodes what ciborium writes exactly as ciborium reads it,
//! and takes cbor4ii's fast path for the common shapes.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};

use quickcheck::{Arbitrary, Gen, QuickCheck};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use super::from_cbor;

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Unit;

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Newtype(i64);

#[derive(Debug, Clone, Serialize, Deserialize)]
enum Kind {
    Plain,
    Wrapped(u32),
    Pair(i8, String),
    Named { id: u64, tag: Option<char> },
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(untagged)]
enum Loose {
    Number(i64),
    Text(String),
    Flag(bool),
    List(Vec<u16>),
    Real(f64),
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "t")]
enum Tagged {
    A { x: u32 },
    B { y: String, z: u16 },
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Inner {
    low: u8,
    mid: i16,
    #[serde(default)]
    extra: Option<bool>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Outer {
    #[serde(flatten)]
    inner: Inner,
    name: String,
}

/// What cbor4ii leaves to ciborium: floats ciborium writes shorter than
/// their type, and units (cbor4ii does not read ciborium's `null` as one).
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Odd {
    half: f32,
    whole: f64,
    nothing: (),
    unit: Unit,
    kinds: Vec<Kind>,
}

impl Arbitrary for Odd {
    fn arbitrary(g: &mut Gen) -> Self {
        Odd {
            half: float(g) as f32,
            whole: float(g),
            nothing: (),
            unit: Unit,
            kinds: Vec::arbitrary(g),
        }
    }
}

/// Floats that ciborium writes at their own width (none fits a shorter
/// float), so cbor4ii reads them.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Wide {
    single: f32,
    double: f64,
    loose: Vec<Loose>,
    kinds: Vec<Kind>,
}

/// An f64 that fits no f32: its lowest mantissa bit is set, and its
/// exponent is kept below the top (no infinity or NaN).
fn wide_f64(g: &mut Gen) -> f64 {
    f64::from_bits((u64::arbitrary(g) & 0xbfef_ffff_ffff_ffff) | 1)
}

impl Arbitrary for Wide {
    fn arbitrary(g: &mut Gen) -> Self {
        // The same for an f32 and f16.
        Wide {
            single: f32::from_bits((u32::arbitrary(g) & 0xbf7f_ffff) | 1),
            double: wide_f64(g),
            loose: Vec::arbitrary(g),
            kinds: Vec::arbitrary(g),
        }
    }
}

/// Every other shape serde gives a user message, with values at the edges.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Mixed {
    a: u8,
    b: u16,
    c: u32,
    d: u64,
    e: i8,
    f: i16,
    g: i32,
    h: i64,
    big: u128,
    wide: i128,
    yes: bool,
    letter: char,
    text: String,
    bytes: Vec<u8>,
    maybe: Option<u32>,
    nested: Option<Option<bool>>,
    newtype: Newtype,
    tuple: (u8, String, bool),
    list: Vec<String>,
    map: BTreeMap<String, i64>,
    keyed: BTreeMap<u32, Vec<i8>>,
    kinds: Vec<Kind>,
    loose: Vec<Loose>,
    tagged: Tagged,
    outer: Outer,
}

fn pick<T: Clone>(g: &mut Gen, from: &[T]) -> T {
    g.choose(from).expect("not empty").clone()
}

/// One of `edges` or any value, half the time each.
fn edge<T: Arbitrary>(g: &mut Gen, edges: &[T]) -> T {
    if bool::arbitrary(g) {
        pick(g, edges)
    } else {
        T::arbitrary(g)
    }
}

/// A float that is often one ciborium writes shorter than its type.
fn float(g: &mut Gen) -> f64 {
    match u8::arbitrary(g) % 4 {
        0 => pick(g, &[0.0, -0.0, 1.0, 1.5, 65504.0, f64::INFINITY, f64::NAN]),
        1 => f64::from(f32::arbitrary(g)),
        _ => f64::arbitrary(g),
    }
}

impl Arbitrary for Kind {
    fn arbitrary(g: &mut Gen) -> Self {
        match u8::arbitrary(g) % 4 {
            0 => Kind::Plain,
            1 => Kind::Wrapped(u32::arbitrary(g)),
            2 => Kind::Pair(i8::arbitrary(g), String::arbitrary(g)),
            _ => Kind::Named {
                id: u64::arbitrary(g),
                tag: Option::arbitrary(g),
            },
        }
    }
}

impl Arbitrary for Loose {
    fn arbitrary(g: &mut Gen) -> Self {
        match u8::arbitrary(g) % 5 {
            0 => Loose::Number(i64::arbitrary(g)),
            1 => Loose::Text(String::arbitrary(g)),
            2 => Loose::Flag(bool::arbitrary(g)),
            3 => Loose::List(Vec::arbitrary(g)),
            _ => Loose::Real(wide_f64(g)),
        }
    }
}

impl Arbitrary for Mixed {
    fn arbitrary(g: &mut Gen) -> Self {
        Mixed {
            a: u8::arbitrary(g),
            b: u16::arbitrary(g),
            c: u32::arbitrary(g),
            d: edge(g, &[0, 23, 24, 255, 256, 65_536, u64::MAX]),
            e: i8::arbitrary(g),
            f: i16::arbitrary(g),
            g: i32::arbitrary(g),
            h: edge(g, &[-1, -24, -25, i64::MIN, i64::MAX]),
            big: edge(g, &[u128::MAX, u128::from(u64::MAX) + 1]),
            wide: edge(g, &[i128::MIN, -i128::from(u64::MAX) - 1]),
            yes: bool::arbitrary(g),
            letter: char::arbitrary(g),
            text: String::arbitrary(g),
            bytes: Vec::arbitrary(g),
            maybe: Option::arbitrary(g),
            nested: Option::arbitrary(g),
            newtype: Newtype(i64::arbitrary(g)),
            tuple: Arbitrary::arbitrary(g),
            list: Vec::arbitrary(g),
            map: BTreeMap::arbitrary(g),
            keyed: BTreeMap::arbitrary(g),
            kinds: Vec::arbitrary(g),
            loose: Vec::arbitrary(g),
            tagged: if bool::arbitrary(g) {
                Tagged::A {
                    x: u32::arbitrary(g),
                }
            } else {
                Tagged::B {
                    y: String::arbitrary(g),
                    z: u16::arbitrary(g),
                }
            },
            outer: Outer {
                inner: Inner {
                    low: u8::arbitrary(g),
                    mid: i16::arbitrary(g),
                    extra: Option::arbitrary(g),
                },
                name: String::arbitrary(g),
            },
        }
    }
}

fn encode<T: Serialize>(value: &T) -> Vec<u8> {
    let mut bytes = Vec::new();
    ciborium::into_writer(value, &mut bytes).expect("encodes");
    bytes
}

/// Whether `a` and `b` are the same value: ciborium writes them alike (so
/// NaNs compare), and they print alike (so `Some(None)` and `None` do not).
fn same<T: Serialize + std::fmt::Debug>(a: &T, b: &T) -> bool {
    encode(a) == encode(b) && format!("{a:?}") == format!("{b:?}")
}

/// What `from_cbor` and ciborium make of `bytes`: both fail, or both give
/// the same value. With `lenient`, `from_cbor` may also read what ciborium
/// refuses (SPEC §13.4 names those inputs).
fn agree<T: Serialize + DeserializeOwned + std::fmt::Debug>(
    bytes: &[u8],
    lenient: bool,
) -> Result<(), String> {
    let ours = from_cbor::<T>(bytes);
    let theirs = ciborium::from_reader::<T, _>(bytes);
    match (&ours, &theirs) {
        (Ok(a), Ok(b)) if same(a, b) => Ok(()),
        (Err(_), Err(_)) => Ok(()),
        (Ok(_), Err(_)) if lenient => Ok(()),
        _ => Err(format!(
            "{bytes:02x?}: from_cbor {:?}, ciborium {:?}",
            ours.map(|v| encode(&v)),
            theirs.map(|v| encode(&v))
        )),
    }
}

#[test]
fn from_cbor_reads_what_ciborium_writes_as_ciborium_does() {
    static FAST: AtomicUsize = AtomicUsize::new(0);
    static WIDE: AtomicUsize = AtomicUsize::new(0);
    fn prop(value: Mixed, wide: Wide, odd: Odd) -> bool {
        let report = |e| eprintln!("{e}");
        let (bytes, wide) = (encode(&value), encode(&wide));
        if cbor4ii::serde::from_slice::<Mixed>(&bytes).is_ok() {
            FAST.fetch_add(1, Ordering::Relaxed);
        }
        if cbor4ii::serde::from_slice::<Wide>(&wide).is_ok() {
            WIDE.fetch_add(1, Ordering::Relaxed);
        }
        agree::<Mixed>(&bytes, false).map_err(report).is_ok()
            && agree::<Wide>(&wide, false).map_err(report).is_ok()
            && agree::<Odd>(&encode(&odd), false).map_err(report).is_ok()
    }
    QuickCheck::new()
        .tests(2_000)
        .quickcheck(prop as fn(Mixed, Wide, Odd) -> bool);
    // Most cases test cbor4ii's answers, not only ciborium's fallback.
    let fast = FAST.load(Ordering::Relaxed);
    assert!(fast > 1_000, "only {fast} of 2,000 took the fast path");
    let wide = WIDE.load(Ordering::Relaxed);
    assert!(
        wide > 1_000,
        "only {wide} of 2,000 floats took the fast path"
    );
}

#[test]
fn from_cbor_agrees_with_ciborium_on_damaged_bytes() {
    fn prop(value: Mixed, odd: Odd, which: bool, at: Vec<(usize, u8)>, cut: usize) -> bool {
        let mut bytes = if which { encode(&value) } else { encode(&odd) };
        for (i, b) in at {
            let len = bytes.len();
            bytes[i % len] = b;
        }
        bytes.truncate(bytes.len() - cut % 4);
        // Whatever ciborium reads from damaged bytes, from_cbor reads the
        // same; it may read a few things ciborium refuses.
        let report = |e| eprintln!("{e}");
        agree::<Mixed>(&bytes, true).map_err(report).is_ok()
            && agree::<Odd>(&bytes, true).map_err(report).is_ok()
    }
    QuickCheck::new()
        .tests(5_000)
        .quickcheck(prop as fn(Mixed, Odd, bool, Vec<(usize, u8)>, usize) -> bool);
}

#[test]
fn what_from_cbor_reads_that_ciborium_refuses() {
    // SPEC §13.4 names these: an empty array as a unit...
    assert!(ciborium::from_reader::<(), _>(&[0x80][..]).is_err());
    assert_eq!(from_cbor::<()>(&[0x80]).ok(), Some(()));
    // ...and a field name longer than ciborium's 4 KiB scratch.
    #[derive(Debug, Deserialize)]
    struct One {
        a: u8,
    }
    let mut bytes = vec![0xa2, 0x61, b'a', 0x01, 0x79, 0x13, 0x88];
    bytes.extend(std::iter::repeat_n(b'x', 5_000));
    bytes.push(0x02);
    assert!(ciborium::from_reader::<One, _>(&bytes[..]).is_err());
    assert_eq!(from_cbor::<One>(&bytes).map(|one| one.a).ok(), Some(1));
}

#[test]
fn the_common_shapes_take_the_fast_path() {
    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct Ping {
        driver: u32,
        seq: u64,
    }
    let ping = Ping {
        driver: 7,
        seq: 1 << 40,
    };
    let bytes = encode(&ping);
    assert_eq!(cbor4ii::serde::from_slice::<Ping>(&bytes).ok(), Some(ping));
    let kinds = vec![Kind::Plain, Kind::Wrapped(3), Kind::Pair(-1, "x".into())];
    assert!(cbor4ii::serde::from_slice::<Vec<Kind>>(&encode(&kinds)).is_ok());
    // A float ciborium writes shorter than its type takes the slow path,
    // and still decodes.
    assert!(cbor4ii::serde::from_slice::<f64>(&encode(&1.0f64)).is_err());
    assert_eq!(from_cbor::<f64>(&encode(&1.0f64)).ok(), Some(1.0));
}

#[test]
fn deep_nesting_is_an_error_not_a_stack_overflow() {
    #[derive(Debug, Deserialize)]
    struct Small {
        #[allow(dead_code)]
        a: u32,
    }
    // {"a": 1, "b": [[[[...]]]]}: the unknown field is skipped, 100,000 deep.
    let mut bytes = vec![0xa2, 0x61, b'a', 0x01, 0x61, b'b'];
    bytes.extend(std::iter::repeat_n(0x81, 100_000));
    bytes.push(0x00);
    assert!(from_cbor::<Small>(&bytes).is_err());
    assert!(from_cbor::<Loose>(&bytes[6..]).is_err());
    assert!(from_cbor::<Vec<Vec<u8>>>(&bytes[6..]).is_err());
}
