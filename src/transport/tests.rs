//! Faults on established connections, driven by a raw peer that completes
//! the real handshake and then misbehaves.

use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use futures_util::{SinkExt, StreamExt};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio_util::codec::Framed;

use super::handshake::{self, HandshakeStream, Local};
use super::*;
use crate::identity::UniqueAddress;
use crate::wire::{Frame, FrameCodec, RejectReason};

const CH: u16 = 3;
const PATIENCE: Duration = Duration::from_secs(10);

fn config() -> TransportConfig {
    TransportConfig::new("unit", "sesame")
}

async fn within<T>(f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(PATIENCE, f).await.expect("timed out")
}

/// A raw peer that has completed the handshake with `t`.
async fn raw_peer(t: &Transport) -> (HandshakeStream, UniqueAddress) {
    let me = UniqueAddress::new_at("127.0.0.1:1".parse().expect("literal"));
    let framed = raw_handshake(t, me).await.expect("handshake");
    (framed, me)
}

/// A raw client handshaking with `t` as `me`.
async fn raw_handshake(t: &Transport, me: UniqueAddress) -> Result<HandshakeStream, ConnectError> {
    let secret = Secret::from("sesame");
    let local = Local {
        me,
        cluster: "unit",
        secret: &secret,
    };
    let stream = TcpStream::connect(t.bound_addr()).await.expect("tcp");
    let mut framed = Framed::new(stream, FrameCodec::default());
    let peer = within(handshake::initiate(
        &mut framed,
        &local,
        t.bound_addr(),
        |_| Ok(()),
    ))
    .await?;
    assert_eq!(peer, t.local());
    Ok(framed)
}

async fn disconnected(
    events: &mut tokio::sync::mpsc::UnboundedReceiver<TransportEvent>,
) -> DisconnectReason {
    within(async {
        loop {
            if let Some(TransportEvent::Disconnected { reason, .. }) = events.recv().await {
                return reason;
            }
        }
    })
    .await
}

/// A second, well-behaved peer that must keep working.
async fn healthy_peer_still_works(
    t: &Transport,
    inbox: &mut tokio::sync::mpsc::Receiver<Incoming>,
) {
    let other = Transport::bind(config()).await.expect("bind");
    other
        .send(&t.local(), CH, Bytes::from_static(b"still here"))
        .expect("send");
    let msg = within(inbox.recv()).await.expect("delivered");
    assert_eq!(
        (msg.from, msg.payload),
        (other.local(), Bytes::from_static(b"still here"))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raw_peer_traffic_is_delivered() {
    let t = Transport::bind(config()).await.expect("bind");
    let mut inbox = t.register(CH, 16).expect("register");
    let (mut raw, me) = raw_peer(&t).await;
    raw.send(Frame::Request {
        corr: 42,
        channel: CH,
        payload: Bytes::from_static(b"q"),
    })
    .await
    .expect("send");
    let msg = within(inbox.recv()).await.expect("delivered");
    assert_eq!(msg.from, me);
    msg.reply
        .expect("a request")
        .reply(Bytes::from_static(b"a"))
        .expect("reply");
    let reply = within(raw.next()).await.expect("frame").expect("decodes");
    assert_eq!(
        reply,
        Frame::Reply {
            corr: 42,
            result: crate::wire::ReplyResult::Ok(Bytes::from_static(b"a"))
        }
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_after_handshake_closes_only_that_connection() {
    let t = Transport::bind(config()).await.expect("bind");
    let mut inbox = t.register(CH, 16).expect("register");
    let mut events = t.events();
    let (raw, _) = raw_peer(&t).await;
    let mut io = raw.into_inner();
    let mut bad = BytesMut::new();
    bad.put_u32(3);
    bad.extend_from_slice(&[0xff, 0x00, 0x13]);
    io.write_all(&bad).await.expect("write");
    assert!(matches!(
        disconnected(&mut events).await,
        DisconnectReason::Malformed(_)
    ));
    healthy_peer_still_works(&t, &mut inbox).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_frame_after_handshake_closes_only_that_connection() {
    let t = Transport::bind(config()).await.expect("bind");
    let mut inbox = t.register(CH, 16).expect("register");
    let mut events = t.events();
    let (raw, _) = raw_peer(&t).await;
    let mut io = raw.into_inner();
    io.write_all(&(64u32 * 1024 * 1024).to_be_bytes())
        .await
        .expect("write");
    assert!(matches!(
        disconnected(&mut events).await,
        DisconnectReason::Malformed(_)
    ));
    healthy_peer_still_works(&t, &mut inbox).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handshake_frame_after_handshake_is_a_violation() {
    let t = Transport::bind(config()).await.expect("bind");
    let mut events = t.events();
    let (mut raw, _) = raw_peer(&t).await;
    raw.send(Frame::Proof {
        proof: Bytes::new(),
    })
    .await
    .expect("send");
    assert_eq!(
        disconnected(&mut events).await,
        DisconnectReason::ProtocolViolation
    );
    assert!(within(raw.next()).await.is_none(), "closed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reply_after_timeout_is_ignored() {
    let t = Transport::bind(config()).await.expect("bind");
    let (mut raw, me) = raw_peer(&t).await;
    let err = t
        .request(
            &me,
            CH,
            Bytes::from_static(b"q"),
            Duration::from_millis(100),
        )
        .await;
    assert_eq!(err, Err(RequestError::Timeout));
    let Some(Ok(Frame::Request { corr, .. })) = within(raw.next()).await else {
        panic!("expected the request on the wire");
    };
    raw.send(Frame::Reply {
        corr,
        result: crate::wire::ReplyResult::Ok(Bytes::new()),
    })
    .await
    .expect("late reply");
    // The late reply is harmless: the pipe stays up and usable.
    let t2 = t.clone();
    let next = tokio::spawn(async move {
        t2.request(&me, CH, Bytes::from_static(b"again"), PATIENCE)
            .await
    });
    let Some(Ok(Frame::Request { corr, .. })) = within(raw.next()).await else {
        panic!("expected the second request");
    };
    raw.send(Frame::Reply {
        corr,
        result: crate::wire::ReplyResult::Ok(Bytes::from_static(b"r")),
    })
    .await
    .expect("reply");
    assert_eq!(
        within(next).await.expect("task"),
        Ok(Bytes::from_static(b"r"))
    );
    assert_eq!(t.pending_requests(), 0);
}

/// Regression: data frames that arrive in the same segment as `Accepted`
/// were left in the handshake's read buffer until more bytes came.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn regression_frames_after_accepted_are_not_stranded() {
    let t = Transport::bind(config()).await.expect("bind");
    let mut inbox = t.register(CH, 16).expect("register");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let raw = tokio::spawn(async move {
        let (stream, _) = listener.accept().await.expect("accept");
        let mut framed = Framed::new(stream, FrameCodec::default());
        let me = UniqueAddress::new_at(addr);
        let secret = Secret::from("sesame");
        let local = Local {
            me,
            cluster: "unit",
            secret: &secret,
        };
        within(handshake::accept(&mut framed, &local, |_| Ok(())))
            .await
            .expect("handshake");
        // Accepted and a data frame in one write, then silence.
        let mut out = BytesMut::new();
        let mut codec = FrameCodec::default();
        tokio_util::codec::Encoder::encode(&mut codec, Frame::Accepted, &mut out).expect("enc");
        let oneway = Frame::Oneway {
            channel: CH,
            payload: Bytes::from_static(b"early"),
        };
        tokio_util::codec::Encoder::encode(&mut codec, oneway, &mut out).expect("enc");
        let mut io = framed.into_inner();
        io.write_all(&out).await.expect("write");
        io // keep the connection open
    });
    within(t.connect(addr)).await.expect("connect");
    let msg = within(inbox.recv()).await.expect("delivered");
    assert_eq!(msg.payload, Bytes::from_static(b"early"));
    drop(raw.await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn older_incarnation_cannot_push_out_a_newer_one() {
    let t = Transport::bind(config()).await.expect("bind");
    let addr = "127.0.0.1:7".parse().expect("literal");
    let newer = UniqueAddress {
        addr,
        node_id: crate::identity::NodeId(2),
        incarnation: 20,
    };
    let older = UniqueAddress {
        addr,
        node_id: crate::identity::NodeId(1),
        incarnation: 10,
    };
    let _keep = raw_handshake(&t, newer).await.expect("newer connects");
    let refused = raw_handshake(&t, older).await.map(|_| ());
    assert_eq!(
        refused,
        Err(ConnectError::Rejected(RejectReason::Quarantined))
    );
    assert_eq!(t.connected_peers(), vec![newer]);
}
