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
//! protocol versions, the cluster name, both nonces and both identities, each
//! length-delimited, so a proof is bound to this one exchange and cannot be
//! replayed in another connection or reflected back in the other role, and a
//! version rewritten in transit (a downgrade) makes the proofs fail. The secret itself never crosses the
//! wire; each side proves it knows the secret over the other side's fresh
//! 32-byte nonce (from the OS generator via `getrandom`), and verification is
//! constant-time (`Mac::verify_slice`).
//!
//! Any check that fails makes the refusing side send
//! [`Frame::Reject`] with a [`RejectReason`] and close; the caller logs it
//! with `tracing::warn!`. The whole exchange runs under the transport's
//! handshake timeout (applied by the caller).

use std::net::SocketAddr;

use bytes::Bytes;
use futures_util::{SinkExt, StreamExt};
use hmac::{Hmac, Mac};
use sha2::Sha256;
use tokio::net::TcpStream;
use tokio_util::codec::Framed;

use super::config::Secret;
use super::error::ConnectError;
use crate::identity::UniqueAddress;
use crate::wire::{
    Frame, FrameCodec, MIN_PROTOCOL_VERSION, PROTOCOL_VERSION, RejectReason, WireError,
};

/// Length of each side's challenge nonce, in bytes.
pub const NONCE_LEN: usize = 32;

/// Domain-separation tag at the start of every proof transcript.
const DOMAIN: &[u8] = b"datum-cluster-sharding/handshake/v2";

type HmacSha256 = Hmac<Sha256>;

/// The framed TCP stream a handshake runs over.
pub(crate) type HandshakeStream = Framed<TcpStream, FrameCodec>;

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

fn put_field(mac: &mut HmacSha256, bytes: &[u8]) {
    mac.update(&(bytes.len() as u64).to_be_bytes());
    mac.update(bytes);
}

fn put_identity(mac: &mut HmacSha256, who: &UniqueAddress) {
    put_field(mac, who.addr.to_string().as_bytes());
    mac.update(&who.node_id.0.to_be_bytes());
    mac.update(&who.incarnation.to_be_bytes());
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
    /// The keyed transcript MAC for `role`, before finalisation.
    fn mac(&self, role: Role) -> Result<HmacSha256, ConnectError> {
        let mut mac = HmacSha256::new_from_slice(self.secret.expose())
            .map_err(|e| ConnectError::Protocol(format!("hmac key: {e}")))?;
        put_field(&mut mac, DOMAIN);
        mac.update(&[role as u8]);
        mac.update(&self.versions.initiator.to_be_bytes());
        mac.update(&self.versions.acceptor.to_be_bytes());
        put_field(&mut mac, self.cluster.as_bytes());
        put_field(&mut mac, self.nonce_i);
        put_field(&mut mac, self.nonce_a);
        put_identity(&mut mac, self.initiator);
        put_identity(&mut mac, self.acceptor);
        Ok(mac)
    }
}

/// Reads the next frame, mapping end-of-stream and codec errors.
async fn next(stream: &mut HandshakeStream) -> Result<Frame, ConnectError> {
    match stream.next().await {
        Some(Ok(frame)) => Ok(frame),
        Some(Err(e)) => Err(wire_error(e)),
        None => Err(ConnectError::Closed),
    }
}

fn wire_error(e: WireError) -> ConnectError {
    match e {
        WireError::Io(io) => ConnectError::from(io),
        other => ConnectError::Protocol(other.to_string()),
    }
}

/// Sends `Reject{reason}` (best effort) and returns the matching error.
async fn refuse(stream: &mut HandshakeStream, reason: RejectReason) -> ConnectError {
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

/// Runs the initiator's side up to and including `Accepted`; returns the
/// acceptor's identity. In this order, once `Welcome` arrives: the
/// acceptor's proof is verified, its proven identity must name `dialed`,
/// and only then is `admit` asked (quarantine, an existing pipe), so no
/// local state is consulted on behalf of an unauthenticated peer.
pub(crate) async fn initiate(
    stream: &mut HandshakeStream,
    local: &Local<'_>,
    dialed: SocketAddr,
    admit: impl Fn(&UniqueAddress) -> Result<(), RejectReason>,
) -> Result<UniqueAddress, ConnectError> {
    let nonce_i = nonce()?;
    let hello = Frame::Hello {
        version: PROTOCOL_VERSION,
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
            if nonce.len() != NONCE_LEN {
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
        initiator: PROTOCOL_VERSION,
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
        Frame::Accepted => Ok(peer),
        Frame::Reject { reason } => Err(ConnectError::Rejected(reason)),
        _ => Err(refuse(stream, RejectReason::ProtocolViolation).await),
    }
}

/// Runs the acceptor's side up to the verified `Proof`; returns the
/// initiator's identity. The caller then installs the pipe and sends
/// `Accepted` (or `Reject`). `admit` may refuse the initiator (quarantine,
/// tie-break, shutdown) right after its `Hello`.
pub(crate) async fn accept(
    stream: &mut HandshakeStream,
    local: &Local<'_>,
    admit: impl Fn(&UniqueAddress) -> Result<(), RejectReason>,
) -> Result<UniqueAddress, ConnectError> {
    let (peer, version_i, nonce_i) = match next(stream).await? {
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
    let versions = Versions {
        initiator: version_i,
        acceptor: PROTOCOL_VERSION,
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
        version: PROTOCOL_VERSION,
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
    Ok(peer)
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
}
