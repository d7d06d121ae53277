//! The authenticated handshake that opens every connection.
//!
//! ```text
//! initiator (dialer)                                  acceptor (listener)
//!   | -- Hello { version, cluster, from: I, nonce_i } ------> |  check version, cluster,
//!   |                                                         |  quarantine, tie-break
//!   | <-- Welcome { version, from: A, nonce_a, proof_a } ---- |  proof_a = HMAC(secret, T, acceptor)
//!   |  check version, verify proof_a,                         |
//!   |  A.addr == dialed?, then admit (quarantine, duplicate)  |
//!   | -- Proof { proof_i } ---------------------------------> |  proof_i = HMAC(secret, T, initiator)
//!   |                                                         |  verify proof_i, install pipe
//!   | <-- Accepted ------------------------------------------- |
//!   installs the pipe                                   data frames may follow at once
//! ```
//!
//! `T` is the transcript: a domain tag, the role, both sides' announced
//! protocol versions, the cluster name, both nonces and both identities
//! (SPEC §9.2 gives its exact bytes and a test vector). A proof is thus bound
//! to this one exchange: it cannot be replayed in another connection or
//! reflected back in the other role, and a version rewritten in transit (a
//! downgrade) makes the proofs fail. (A forged `Reject{UnsupportedVersion}`
//! can make a dialer try again at an older version it still speaks, which
//! costs only that version's later forms: SPEC §9.1.) The secret itself never crosses the
//! wire; each side proves it knows the secret over the other side's fresh
//! 32-byte nonce (from the OS generator via `getrandom`), and verification is
//! constant-time (`Mac::verify_slice`).
//!
//! Any check that fails makes the refusing side send
//! [`Frame::Reject`] with a [`RejectReason`] and close; the caller logs it
//! with `tracing::warn!`. A frame that does not decode at all (or is over
//! the handshake's frame limit) ends the handshake without a `Reject`: the
//! connection is just closed. The whole exchange runs under the transport's
//! handshake timeout (applied by the caller).
//!
//! One exception to that, over plain TCP: a peer configured with TLS opens
//! with a TLS record (a `ClientHello`, or an alert refusing this node's
//! plaintext), whose first bytes read as a frame of hundreds of MiB. It is
//! recognised as such and reported as [`ConnectError::Tls`] ("the peer
//! speaks TLS"), not as an oversized frame; an acceptor also answers it
//! with a plaintext `Reject{ProtocolViolation}`, which the dialer's TLS
//! layer reports in turn as a peer that speaks plaintext.

use std::net::SocketAddr;

use bytes::Bytes;
use futures_util::{SinkExt, StreamExt};
use hmac::{Hmac, Mac};
use sha2::Sha256;
use tokio::net::TcpStream;

use super::stream::PipeIo;
use tokio_util::codec::Framed;

use super::config::Secret;
use super::error::ConnectError;
use crate::model::identity::UniqueAddress;
use crate::wire::{
    Frame, FrameCodec, MIN_PROTOCOL_VERSION, PROTOCOL_VERSION, RejectReason, WireError,
};

/// Length of each side's challenge nonce, in bytes.
pub const NONCE_LEN: usize = 32;

/// Domain-separation tag at the start of every proof transcript.
const DOMAIN: &[u8] = b"datum-cluster-sharding/handshake/v2";

type HmacSha256 = Hmac<Sha256>;

/// The framed TCP stream a handshake runs over.
pub(crate) type HandshakeStream<S = TcpStream> = Framed<S, FrameCodec>;

/// What one side brings to a handshake.
pub(crate) struct Local<'a> {
    /// This node's identity.
    pub(crate) me: UniqueAddress,
    /// The cluster name both sides must share.
    pub(crate) cluster: &'a str,
    /// The shared secret both sides must prove.
    pub(crate) secret: &'a Secret,
}

/// Which side of the handshake a proof speaks for.
#[derive(Clone, Copy)]
enum Role {
    Acceptor = 1,
    Initiator = 2,
}

/// Draws a fresh challenge nonce.
fn nonce() -> Result<Bytes, ConnectError> {
    let mut n = [0u8; NONCE_LEN];
    getrandom::fill(&mut n).map_err(|e| ConnectError::Rng(e.to_string()))?;
    Ok(Bytes::copy_from_slice(&n))
}

/// Appends `bytes` with its length as a big-endian u64 in front.
fn put_field(t: &mut Vec<u8>, bytes: &[u8]) {
    t.extend_from_slice(&(bytes.len() as u64).to_be_bytes());
    t.extend_from_slice(bytes);
}

/// Appends an identity: its address text (length-prefixed), then `node_id`
/// and `incarnation`, each a big-endian u64.
fn put_identity(t: &mut Vec<u8>, who: &UniqueAddress) {
    put_field(t, who.addr.to_string().as_bytes());
    t.extend_from_slice(&who.node_id.0.to_be_bytes());
    t.extend_from_slice(&who.incarnation.to_be_bytes());
}

/// The protocol versions the two sides announced (`Hello`, `Welcome`).
#[derive(Clone, Copy)]
struct Versions {
    initiator: u16,
    acceptor: u16,
}

/// What both proofs of one handshake cover; only the role differs.
struct Transcript<'a> {
    secret: &'a Secret,
    versions: Versions,
    cluster: &'a str,
    nonce_i: &'a [u8],
    nonce_a: &'a [u8],
    initiator: &'a UniqueAddress,
    acceptor: &'a UniqueAddress,
}

impl Transcript<'_> {
    /// The transcript bytes for `role`, in the order SPEC §9.2 gives.
    fn bytes(&self, role: Role) -> Vec<u8> {
        let mut t = Vec::with_capacity(256);
        put_field(&mut t, DOMAIN);
        t.push(role as u8);
        t.extend_from_slice(&self.versions.initiator.to_be_bytes());
        t.extend_from_slice(&self.versions.acceptor.to_be_bytes());
        put_field(&mut t, self.cluster.as_bytes());
        put_field(&mut t, self.nonce_i);
        put_field(&mut t, self.nonce_a);
        put_identity(&mut t, self.initiator);
        put_identity(&mut t, self.acceptor);
        t
    }

    /// The keyed transcript MAC for `role`, before finalisation.
    fn mac(&self, role: Role) -> Result<HmacSha256, ConnectError> {
        let mut mac = HmacSha256::new_from_slice(self.secret.expose())
            .map_err(|e| ConnectError::Protocol(format!("hmac key: {e}")))?;
        mac.update(&self.bytes(role));
        Ok(mac)
    }
}

/// What a plaintext node reports when its peer speaks TLS.
pub(crate) const PEER_SPEAKS_TLS: &str = "the peer speaks TLS and this node does not: TLS must be configured on every node of the cluster, or on none";

/// Reads the next frame, mapping end-of-stream and codec errors.
async fn next<S: PipeIo>(stream: &mut HandshakeStream<S>) -> Result<Frame, ConnectError> {
    match stream.next().await {
        Some(Ok(frame)) => Ok(frame),
        Some(Err(WireError::FrameTooLarge { len, .. })) if !S::TLS && tls_record(len) => {
            Err(ConnectError::Tls(PEER_SPEAKS_TLS.into()))
        }
        Some(Err(e)) => Err(wire_error(e)),
        None => Err(ConnectError::Closed),
    }
}

/// Whether a frame's announced length is in fact the header of a TLS
/// record: a content type from 20 to 23 (change_cipher_spec, alert,
/// handshake, application_data), then protocol version 3.0 to 3.4. Read as a
/// length that is over 320 MiB, far over a handshake frame's 4 KiB, so no
/// frame of this protocol is taken for one.
fn tls_record(len: u64) -> bool {
    let Ok(len) = u32::try_from(len) else {
        return false;
    };
    let [content_type, major, minor, _] = len.to_be_bytes();
    (0x14..=0x17).contains(&content_type) && major == 3 && minor <= 4
}

fn wire_error(e: WireError) -> ConnectError {
    match e {
        WireError::Io(io) => ConnectError::from(io),
        other => ConnectError::Protocol(other.to_string()),
    }
}

/// Sends `Reject{reason}` (best effort) and returns the matching error.
async fn refuse<S: PipeIo>(stream: &mut HandshakeStream<S>, reason: RejectReason) -> ConnectError {
    let _ = stream
        .send(Frame::Reject {
            reason: reason.clone(),
        })
        .await;
    ConnectError::Refused(reason)
}

fn version_ok(version: u16) -> bool {
    (MIN_PROTOCOL_VERSION..=PROTOCOL_VERSION).contains(&version)
}

fn unsupported() -> RejectReason {
    RejectReason::UnsupportedVersion {
        ours: PROTOCOL_VERSION,
        min: MIN_PROTOCOL_VERSION,
    }
}

/// Runs the initiator's side up to and including `Accepted`, announcing
/// version `announce` (this build's, or an older one it still speaks for a
/// peer that refused this build's, §9.1); returns the acceptor's identity
/// and the pipe's version, the lower of the two announced. In this order, once `Welcome` arrives: the
/// acceptor's proof is verified, its proven identity must name `dialed`,
/// and only then is `admit` asked (quarantine, an existing pipe), so no
/// local state is consulted on behalf of an unauthenticated peer.
pub(crate) async fn initiate<S: PipeIo>(
    stream: &mut HandshakeStream<S>,
    local: &Local<'_>,
    dialed: SocketAddr,
    announce: u16,
    admit: impl Fn(&UniqueAddress) -> Result<(), RejectReason>,
) -> Result<(UniqueAddress, u16), ConnectError> {
    let nonce_i = nonce()?;
    let hello = Frame::Hello {
        version: announce,
        cluster: local.cluster.to_owned(),
        from: local.me,
        nonce: nonce_i.clone(),
    };
    stream.send(hello).await.map_err(wire_error)?;
    let (peer, version_a, nonce_a, proof_a) = match next(stream).await? {
        Frame::Welcome {
            version,
            from,
            nonce,
            proof,
        } => {
            if !version_ok(version) {
                return Err(refuse(stream, unsupported()).await);
            }
            // An acceptor answers at most the version announced to it.
            if version > announce || nonce.len() != NONCE_LEN {
                return Err(refuse(stream, RejectReason::ProtocolViolation).await);
            }
            (from, version, nonce, proof)
        }
        Frame::Reject { reason } => return Err(ConnectError::Rejected(reason)),
        _ => return Err(refuse(stream, RejectReason::ProtocolViolation).await),
    };
    if peer.node_id == local.me.node_id {
        return Err(refuse(stream, RejectReason::ProtocolViolation).await);
    }
    let versions = Versions {
        initiator: announce,
        acceptor: version_a,
    };
    let transcript = Transcript {
        secret: local.secret,
        versions,
        cluster: local.cluster,
        nonce_i: &nonce_i,
        nonce_a: &nonce_a,
        initiator: &local.me,
        acceptor: &peer,
    };
    let check = transcript.mac(Role::Acceptor)?;
    if check.verify_slice(&proof_a).is_err() {
        return Err(refuse(stream, RejectReason::BadProof).await);
    }
    // The acceptor's proven identity must name the address we dialed: a
    // relay at another address cannot pass off a real node's handshake as
    // its own.
    if peer.addr != dialed {
        let _ = refuse(stream, RejectReason::ProtocolViolation).await;
        return Err(ConnectError::Protocol(format!(
            "dialed {dialed} but the node there identifies as {}",
            peer.addr
        )));
    }
    if let Err(reason) = admit(&peer) {
        return Err(refuse(stream, reason).await);
    }
    let mine = transcript.mac(Role::Initiator)?;
    let proof = Bytes::copy_from_slice(&mine.finalize().into_bytes());
    stream
        .send(Frame::Proof { proof })
        .await
        .map_err(wire_error)?;
    match next(stream).await? {
        Frame::Accepted => Ok((peer, version_a.min(announce))),
        Frame::Reject { reason } => Err(ConnectError::Rejected(reason)),
        _ => Err(refuse(stream, RejectReason::ProtocolViolation).await),
    }
}

/// Runs the acceptor's side up to the verified `Proof`, announcing the
/// lower of the initiator's version and this build's (so an older
/// initiator finds the version it announced); returns the initiator's
/// identity and that version, the pipe's. The caller then installs the pipe and sends
/// `Accepted` (or `Reject`). `admit` may refuse the initiator (quarantine,
/// tie-break, shutdown) right after its `Hello`.
pub(crate) async fn accept<S: PipeIo>(
    stream: &mut HandshakeStream<S>,
    local: &Local<'_>,
    admit: impl Fn(&UniqueAddress) -> Result<(), RejectReason>,
) -> Result<(UniqueAddress, u16), ConnectError> {
    let hello = match next(stream).await {
        Err(e @ ConnectError::Tls(_)) => {
            // A TLS dialer at a plaintext acceptor: answered in plaintext,
            // its TLS layer says that this node speaks plaintext, where a
            // bare close would tell it nothing.
            let _ = refuse(stream, RejectReason::ProtocolViolation).await;
            return Err(e);
        }
        other => other?,
    };
    let (peer, version_i, nonce_i) = match hello {
        Frame::Hello {
            version,
            cluster,
            from,
            nonce,
        } => {
            if !version_ok(version) {
                return Err(refuse(stream, unsupported()).await);
            }
            if cluster != local.cluster {
                return Err(refuse(stream, RejectReason::WrongCluster).await);
            }
            if nonce.len() != NONCE_LEN || from.node_id == local.me.node_id {
                return Err(refuse(stream, RejectReason::ProtocolViolation).await);
            }
            (from, version, nonce)
        }
        _ => return Err(refuse(stream, RejectReason::ProtocolViolation).await),
    };
    if let Err(reason) = admit(&peer) {
        return Err(refuse(stream, reason).await);
    }
    let announced = version_i.min(PROTOCOL_VERSION);
    let versions = Versions {
        initiator: version_i,
        acceptor: announced,
    };
    let nonce_a = nonce()?;
    let transcript = Transcript {
        secret: local.secret,
        versions,
        cluster: local.cluster,
        nonce_i: &nonce_i,
        nonce_a: &nonce_a,
        initiator: &peer,
        acceptor: &local.me,
    };
    let mine = transcript.mac(Role::Acceptor)?;
    let welcome = Frame::Welcome {
        version: announced,
        from: local.me,
        nonce: nonce_a.clone(),
        proof: Bytes::copy_from_slice(&mine.finalize().into_bytes()),
    };
    stream.send(welcome).await.map_err(wire_error)?;
    let proof_i = match next(stream).await? {
        Frame::Proof { proof } => proof,
        Frame::Reject { reason } => return Err(ConnectError::Rejected(reason)),
        _ => return Err(refuse(stream, RejectReason::ProtocolViolation).await),
    };
    let check = transcript.mac(Role::Initiator)?;
    if check.verify_slice(&proof_i).is_err() {
        return Err(refuse(stream, RejectReason::BadProof).await);
    }
    Ok((peer, announced))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn proof(versions: Versions) -> Vec<u8> {
        let who = UniqueAddress::new_at("127.0.0.1:1".parse().expect("literal"));
        let other = UniqueAddress::new_at("127.0.0.1:2".parse().expect("literal"));
        let mac = Transcript {
            secret: &Secret::from("s"),
            versions,
            cluster: "c",
            nonce_i: &[1; NONCE_LEN],
            nonce_a: &[2; NONCE_LEN],
            initiator: &who,
            acceptor: &other,
        }
        .mac(Role::Acceptor)
        .expect("mac");
        mac.finalize().into_bytes().to_vec()
    }

    /// The first bytes of TLS records (a `ClientHello` of TLS 1.0 to 1.3
    /// clients, alerts) are recognised as such; no length a handshake frame
    /// may have, nor the largest lengths, is.
    #[test]
    fn tls_record_headers_are_told_from_frame_lengths() {
        let header = |bytes: [u8; 4]| u64::from(u32::from_be_bytes(bytes));
        for tls in [
            [0x16, 0x03, 0x01, 0x00],
            [0x16, 0x03, 0x03, 0x02],
            [0x15, 0x03, 0x03, 0x00],
            [0x17, 0x03, 0x04, 0xff],
            [0x14, 0x03, 0x00, 0x00],
        ] {
            assert!(tls_record(header(tls)), "{tls:02x?}");
        }
        for frame in [
            0,
            1,
            4 * 1024,
            4 * 1024 * 1024,
            u64::from(u32::MAX),
            u64::MAX,
        ] {
            assert!(!tls_record(frame), "{frame}");
        }
        for other in [
            [0x18, 0x03, 0x03, 0x00],
            [0x16, 0x02, 0x00, 0x00],
            [0x16, 0x03, 0x05, 0x00],
        ] {
            assert!(!tls_record(header(other)), "{other:02x?}");
        }
    }

    /// A version rewritten in transit (either side's) changes both proofs,
    /// so a downgrade is caught as `BadProof`.
    #[test]
    fn both_announced_versions_are_in_the_transcript() {
        let honest = proof(Versions {
            initiator: 2,
            acceptor: 2,
        });
        for (initiator, acceptor) in [(1, 2), (2, 1), (3, 2)] {
            assert_ne!(
                proof(Versions {
                    initiator,
                    acceptor
                }),
                honest
            );
        }
    }

    fn unhex(spec: &str) -> Vec<u8> {
        spec.split_whitespace()
            .flat_map(|word| {
                (0..word.len())
                    .step_by(2)
                    .map(move |i| u8::from_str_radix(&word[i..i + 2], 16).expect("hex"))
            })
            .collect()
    }

    /// The test vector of SPEC §9.2: every input, the acceptor's transcript
    /// row by row, and both proofs, as SPEC prints them.
    #[test]
    fn spec_transcript_test_vector() {
        let initiator = UniqueAddress {
            addr: "127.0.0.1:7355".parse().expect("literal"),
            node_id: crate::model::identity::NodeId(0x0123_4567_89ab_cdef),
            incarnation: 1_700_000_000_000_000,
        };
        let acceptor = UniqueAddress {
            addr: "127.0.0.1:7356".parse().expect("literal"),
            node_id: crate::model::identity::NodeId(0xfedc_ba98_7654_3210),
            incarnation: 1_700_000_000_000_001,
        };
        let nonce_i: Vec<u8> = (0x00..0x20).collect();
        let nonce_a: Vec<u8> = (0x20..0x40).collect();
        let secret = Secret::from("s3cret");
        let transcript = Transcript {
            secret: &secret,
            versions: Versions {
                initiator: 2,
                acceptor: 2,
            },
            cluster: "orders",
            nonce_i: &nonce_i,
            nonce_a: &nonce_a,
            initiator: &initiator,
            acceptor: &acceptor,
        };
        let t_acceptor = unhex(
            "
            0000000000000023
            646174756d2d636c75737465722d7368617264696e672f68616e647368616b652f7632
            01
            0002 0002
            0000000000000006 6f7264657273
            0000000000000020 000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f
            0000000000000020 202122232425262728292a2b2c2d2e2f303132333435363738393a3b3c3d3e3f
            000000000000000e 3132372e302e302e313a37333535 0123456789abcdef 00060a24181e4000
            000000000000000e 3132372e302e302e313a37333536 fedcba9876543210 00060a24181e4001
            ",
        );
        assert_eq!(transcript.bytes(Role::Acceptor), t_acceptor);
        let mut t_initiator = t_acceptor.clone();
        t_initiator[43] = 2; // the role byte, right after the 8 + 35 of the tag
        assert_eq!(transcript.bytes(Role::Initiator), t_initiator);
        let proof = |role| {
            transcript
                .mac(role)
                .expect("mac")
                .finalize()
                .into_bytes()
                .to_vec()
        };
        assert_eq!(
            proof(Role::Acceptor),
            unhex("2573b8a9dea03b4e65e714f68c40f103ac04f8c5ac2e6889a50e8d1c246e4e2d")
        );
        assert_eq!(
            proof(Role::Initiator),
            unhex("109383fcf7e309641129a538a092e4e146888547911503ddc4ca1c252bb63949")
        );
    }
}
