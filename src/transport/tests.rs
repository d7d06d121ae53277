//! Faults on established connections, driven by a raw peer that completes
//! the real handshake and then misbehaves; each over plaintext and, with
//! the `tls` feature, inside a TLS session (`name::plain`, `name::tls`).

use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use futures_util::{SinkExt, StreamExt};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio_util::codec::Framed;

use super::handshake::{self, HandshakeStream, Local};
use super::*;
use crate::model::identity::UniqueAddress;
use crate::wire::{Frame, FrameCodec, RejectReason};

const CH: u16 = 7;
const PATIENCE: Duration = Duration::from_secs(10);

fn config() -> TransportConfig {
    TransportConfig::new("unit", "sesame")
}

async fn within<T>(f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(PATIENCE, f).await.expect("timed out")
}

/// What the hostile-input tests run over: plaintext pipes, or TLS ones
/// (feature `tls`), where the raw peer speaks TLS with a certificate of the
/// transport's CA and then misbehaves inside the session.
#[derive(Clone)]
enum Mode {
    Plain,
    #[cfg(feature = "tls")]
    Tls(std::sync::Arc<TestPki>),
}

/// A test CA's material: every certificate names 127.0.0.1.
#[cfg(feature = "tls")]
struct TestPki {
    _dir: tempfile::TempDir,
    tls: Tls,
}

impl Mode {
    #[cfg(feature = "tls")]
    fn tls() -> Mode {
        let dir = tempfile::tempdir().expect("tempdir");
        let certs =
            generate_test_certificates(dir.path(), &["127.0.0.1"], Duration::from_secs(3_600))
                .expect("certificates");
        let tls = Tls::load(certs[0].clone()).expect("loads");
        Mode::Tls(std::sync::Arc::new(TestPki { _dir: dir, tls }))
    }

    /// The transport's config in this mode.
    fn config(&self) -> TransportConfig {
        let mut c = config();
        #[cfg(feature = "tls")]
        if let Mode::Tls(pki) = self {
            c.tls = Some(pki.tls.clone());
        }
        c
    }

    /// A raw peer's stream to `addr`: TCP, or a TLS session over it.
    async fn dial(&self, addr: std::net::SocketAddr) -> RawIo {
        let tcp = TcpStream::connect(addr).await.expect("tcp");
        match self {
            Mode::Plain => RawIo::Tcp(tcp),
            #[cfg(feature = "tls")]
            Mode::Tls(pki) => RawIo::Tls(Box::new(
                within(pki.tls.connect(tcp, addr)).await.expect("tls"),
            )),
        }
    }
}

/// Runs the async test `$name(mode: Mode)` as `$name::plain` and, with the
/// `tls` feature, as `$name::tls`.
macro_rules! plain_and_tls {
    ($name:ident) => {
        mod $name {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn plain() {
                super::$name(super::Mode::Plain).await
            }

            #[cfg(feature = "tls")]
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn tls() {
                super::$name(super::Mode::tls()).await
            }
        }
    };
}

/// A raw peer's byte stream.
enum RawIo {
    Tcp(TcpStream),
    #[cfg(feature = "tls")]
    Tls(Box<tokio_rustls::client::TlsStream<TcpStream>>),
}

impl tokio::io::AsyncRead for RawIo {
    fn poll_read(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        match self.get_mut() {
            RawIo::Tcp(s) => std::pin::Pin::new(s).poll_read(cx, buf),
            #[cfg(feature = "tls")]
            RawIo::Tls(s) => std::pin::Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl tokio::io::AsyncWrite for RawIo {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        match self.get_mut() {
            RawIo::Tcp(s) => std::pin::Pin::new(s).poll_write(cx, buf),
            #[cfg(feature = "tls")]
            RawIo::Tls(s) => std::pin::Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        match self.get_mut() {
            RawIo::Tcp(s) => std::pin::Pin::new(s).poll_flush(cx),
            #[cfg(feature = "tls")]
            RawIo::Tls(s) => std::pin::Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        match self.get_mut() {
            RawIo::Tcp(s) => std::pin::Pin::new(s).poll_shutdown(cx),
            #[cfg(feature = "tls")]
            RawIo::Tls(s) => std::pin::Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}

impl super::stream::PipeIo for RawIo {
    type Read = tokio::io::ReadHalf<Self>;
    type Write = tokio::io::WriteHalf<Self>;

    fn into_halves(self) -> (Self::Read, Self::Write) {
        tokio::io::split(self)
    }
}

/// A raw peer's framed stream after its handshake.
type RawStream = HandshakeStream<RawIo>;

/// A raw peer that has completed the handshake with `t`.
async fn raw_peer(t: &Transport, mode: &Mode) -> (RawStream, UniqueAddress) {
    let me = UniqueAddress::new_at("127.0.0.1:1".parse().expect("literal"));
    let framed = raw_handshake(t, me, mode).await.expect("handshake");
    (framed, me)
}

/// A raw client handshaking with `t` as `me`.
async fn raw_handshake(
    t: &Transport,
    me: UniqueAddress,
    mode: &Mode,
) -> Result<RawStream, ConnectError> {
    let secret = Secret::from("sesame");
    let local = Local {
        me,
        cluster: "unit",
        secret: &secret,
    };
    let stream = mode.dial(t.bound_addr()).await;
    let mut framed = Framed::new(stream, FrameCodec::default());
    let (peer, version) = within(handshake::initiate(
        &mut framed,
        &local,
        t.bound_addr(),
        crate::wire::PROTOCOL_VERSION,
        |_| Ok(()),
    ))
    .await?;
    assert_eq!(peer, t.local());
    assert_eq!(version, crate::wire::PROTOCOL_VERSION);
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
    mode: &Mode,
) {
    let other = Transport::bind(mode.config()).await.expect("bind");
    other
        .send(&t.local(), CH, Bytes::from_static(b"still here"))
        .expect("send");
    let msg = within(inbox.recv()).await.expect("delivered");
    assert_eq!(
        (msg.from, msg.payload),
        (other.local(), Bytes::from_static(b"still here"))
    );
}

plain_and_tls!(raw_peer_traffic_is_delivered);
async fn raw_peer_traffic_is_delivered(mode: Mode) {
    let t = Transport::bind(mode.config()).await.expect("bind");
    let mut inbox = t.register(CH, 16).expect("register");
    let (mut raw, me) = raw_peer(&t, &mode).await;
    send_request(&mut raw, CH, 42).await;
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

plain_and_tls!(garbage_after_handshake_closes_only_that_connection);
async fn garbage_after_handshake_closes_only_that_connection(mode: Mode) {
    let t = Transport::bind(mode.config()).await.expect("bind");
    let mut inbox = t.register(CH, 16).expect("register");
    let mut events = t.events();
    let (raw, _) = raw_peer(&t, &mode).await;
    let mut io = raw.into_inner();
    let mut bad = BytesMut::new();
    bad.put_u32(3);
    bad.extend_from_slice(&[0xff, 0x00, 0x13]);
    io.write_all(&bad).await.expect("write");
    assert!(matches!(
        disconnected(&mut events).await,
        DisconnectReason::Malformed(_)
    ));
    healthy_peer_still_works(&t, &mut inbox, &mode).await;
}

plain_and_tls!(oversized_frame_after_handshake_closes_only_that_connection);
async fn oversized_frame_after_handshake_closes_only_that_connection(mode: Mode) {
    let t = Transport::bind(mode.config()).await.expect("bind");
    let mut inbox = t.register(CH, 16).expect("register");
    let mut events = t.events();
    let (raw, _) = raw_peer(&t, &mode).await;
    let mut io = raw.into_inner();
    io.write_all(&(64u32 * 1024 * 1024).to_be_bytes())
        .await
        .expect("write");
    assert!(matches!(
        disconnected(&mut events).await,
        DisconnectReason::Malformed(_)
    ));
    healthy_peer_still_works(&t, &mut inbox, &mode).await;
}

plain_and_tls!(handshake_frame_after_handshake_is_a_violation);
async fn handshake_frame_after_handshake_is_a_violation(mode: Mode) {
    let t = Transport::bind(mode.config()).await.expect("bind");
    let mut events = t.events();
    let (mut raw, _) = raw_peer(&t, &mode).await;
    raw.send(Frame::Proof {
        proof: Bytes::new(),
    })
    .await
    .expect("send");
    assert_eq!(
        disconnected(&mut events).await,
        DisconnectReason::ProtocolViolation
    );
    // Closed (under TLS possibly without a close_notify, an error).
    assert!(!matches!(within(raw.next()).await, Some(Ok(_))), "closed");
}

plain_and_tls!(reply_after_timeout_is_ignored);
async fn reply_after_timeout_is_ignored(mode: Mode) {
    let t = Transport::bind(mode.config()).await.expect("bind");
    let (mut raw, me) = raw_peer(&t, &mode).await;
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

plain_and_tls!(older_incarnation_cannot_push_out_a_newer_one);
async fn older_incarnation_cannot_push_out_a_newer_one(mode: Mode) {
    let t = Transport::bind(mode.config()).await.expect("bind");
    let addr = "127.0.0.1:7".parse().expect("literal");
    let newer = UniqueAddress {
        addr,
        node_id: crate::model::identity::NodeId(2),
        incarnation: 20,
    };
    let older = UniqueAddress {
        addr,
        node_id: crate::model::identity::NodeId(1),
        incarnation: 10,
    };
    let _keep = raw_handshake(&t, newer, &mode)
        .await
        .expect("newer connects");
    let refused = raw_handshake(&t, older, &mode).await.map(|_| ());
    assert_eq!(
        refused,
        Err(ConnectError::Rejected(RejectReason::Quarantined))
    );
    assert_eq!(t.connected_peers(), vec![newer]);
}

/// Reads frames from a raw peer's stream (starting with what its handshake
/// had buffered) until the transport closes it. `Err` if the connection was
/// reset instead of closed.
async fn read_to_end(mut io: RawIo, mut buf: BytesMut) -> Result<Vec<Frame>, std::io::Error> {
    use tokio::io::AsyncReadExt;
    use tokio_util::codec::Decoder;
    let mut codec = FrameCodec::default();
    let mut frames = Vec::new();
    loop {
        while let Some(f) = codec.decode(&mut buf).expect("decodes") {
            frames.push(f);
        }
        buf.reserve(64 * 1024);
        if io.read_buf(&mut buf).await? == 0 {
            return Ok(frames);
        }
    }
}

plain_and_tls!(mark_down_flushes_without_a_reset_despite_unread_input);
/// `mark_down` writes what was queued, and the peer receives all of it even
/// though it kept sending after the mark-down: the closing side reads and
/// drops that input instead of closing on it unread (which makes the kernel
/// reset the connection and throw away the flushed frames). Nothing the peer
/// sent after the mark-down is dispatched.
async fn mark_down_flushes_without_a_reset_despite_unread_input(mode: Mode) {
    let t = Transport::bind(mode.config()).await.expect("bind");
    let mut inbox = t.register(CH, 1024).expect("register");
    let (raw, me) = raw_peer(&t, &mode).await;
    const FRAMES: usize = 32;
    for i in 0..FRAMES {
        t.send(&me, CH, Bytes::from(vec![i as u8; 64 * 1024]))
            .expect("queued");
    }
    t.mark_down(&me);
    // The peer, not reading yet, keeps talking.
    let parts = raw.into_parts();
    let mut io = parts.io;
    let mut out = BytesMut::new();
    let mut codec = FrameCodec::default();
    for _ in 0..64 {
        let f = Frame::Oneway {
            channel: CH,
            payload: Bytes::from(vec![9u8; 1024]),
        };
        tokio_util::codec::Encoder::encode(&mut codec, f, &mut out).expect("enc");
    }
    io.write_all(&out).await.expect("write after mark-down");
    let frames = within(read_to_end(io, parts.read_buf))
        .await
        .expect("closed cleanly, not reset");
    assert_eq!(frames.len(), FRAMES, "every queued frame arrived");
    for (i, f) in frames.iter().enumerate() {
        assert!(
            matches!(f, Frame::Oneway { payload, .. } if payload.len() == 64 * 1024 && payload[0] == i as u8),
            "frame {i} in order"
        );
    }
    assert!(
        inbox.try_recv().is_err(),
        "nothing dispatched after mark_down"
    );
}

plain_and_tls!(control_channel_frames_overtake_bulk_traffic);
/// A frame on a control channel (1 by default) queued behind megabytes of
/// bulk frames is written within about one batch, not after all of them;
/// the bulk frames keep their order.
async fn control_channel_frames_overtake_bulk_traffic(mode: Mode) {
    let t = Transport::bind(mode.config()).await.expect("bind");
    let (raw, me) = raw_peer(&t, &mode).await;
    const BULK: usize = 400;
    for i in 0..BULK {
        let mut p = vec![0u8; 64 * 1024];
        p[..4].copy_from_slice(&(i as u32).to_be_bytes());
        t.send(&me, CH, Bytes::from(p)).expect("queued");
    }
    t.send(&me, 1, Bytes::from_static(b"heartbeat"))
        .expect("queued");
    // Read until the heartbeat and every bulk frame arrived.
    let mut raw = raw;
    let (mut bulk_seen, mut heartbeat_at) = (0usize, None);
    while bulk_seen < BULK || heartbeat_at.is_none() {
        match within(raw.next()).await.expect("open").expect("decodes") {
            Frame::Oneway { channel: 1, .. } => heartbeat_at = Some(bulk_seen),
            Frame::Oneway { channel, payload } => {
                assert_eq!(channel, CH);
                assert_eq!(&payload[..4], &(bulk_seen as u32).to_be_bytes());
                bulk_seen += 1;
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    let at = heartbeat_at.expect("heartbeat");
    assert!(
        at < BULK / 2,
        "heartbeat arrived after {at} of {BULK} bulk frames"
    );
}

/// A handshake frame that does not decode — bytes that are not CBOR, or CBOR
/// that is not a `Frame` (here a `Hello` whose address is in text form) —
/// closes the connection without a `Reject`: nothing at all comes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_handshake_frame_closes_without_a_reject() {
    use tokio::io::AsyncReadExt;
    let t = Transport::bind(config()).await.expect("bind");
    let not_cbor: &[u8] = &[0xff, 0x00, 0x13];
    let mut text_addr = Vec::new();
    text_addr.extend_from_slice(b"\xa1\x65Hello\xa4\x67version\x02\x67cluster\x64unit");
    text_addr.extend_from_slice(b"\x64from\xa3\x64addr\x6b127.0.0.1:1");
    text_addr.extend_from_slice(b"\x67node_id\x01\x6bincarnation\x01\x65nonce\x58\x20");
    text_addr.extend_from_slice(&[0; 32]);
    for body in [not_cbor, &text_addr[..]] {
        let mut io = TcpStream::connect(t.bound_addr()).await.expect("tcp");
        let mut frame = BytesMut::new();
        frame.put_u32(body.len() as u32);
        frame.extend_from_slice(body);
        io.write_all(&frame).await.expect("write");
        let mut answer = Vec::new();
        within(io.read_to_end(&mut answer))
            .await
            .expect("closed, not reset");
        assert!(answer.is_empty(), "got {answer:02x?}");
    }
}

plain_and_tls!(inbound_handshakes_claiming_one_address);
/// Two inbound handshakes claiming one address: the second is admitted
/// while the first is still under way (a claim blocks no other claim), and
/// when both complete, the later pipe replaces the earlier one to the same
/// identity (closed; no event).
async fn inbound_handshakes_claiming_one_address(mode: Mode) {
    let t = Transport::bind(mode.config()).await.expect("bind");
    let mut events = t.events();
    let me = UniqueAddress::new_at("127.0.0.1:1".parse().expect("literal"));
    // A: a handshake left hanging after `Welcome`: it holds the address.
    let io = mode.dial(t.bound_addr()).await;
    let mut hanging = Framed::new(io, FrameCodec::default());
    hanging
        .send(Frame::Hello {
            version: crate::wire::PROTOCOL_VERSION,
            cluster: "unit".into(),
            from: me,
            nonce: Bytes::from(vec![9; handshake::NONCE_LEN]),
        })
        .await
        .expect("hello");
    let welcome = within(hanging.next())
        .await
        .expect("frame")
        .expect("decodes");
    assert!(matches!(welcome, Frame::Welcome { .. }), "{welcome:?}");
    // B: the same claim, completed, while A is still under way.
    let mut first = raw_handshake(&t, me, &mode)
        .await
        .expect("admitted despite A");
    assert!(matches!(
        within(events.recv()).await,
        Some(TransportEvent::Connected { peer }) if peer == me
    ));
    // C: the same identity again: replaces B's pipe.
    let _second = raw_handshake(&t, me, &mode).await.expect("admitted");
    // (Under TLS the close may come without a close_notify: an error.)
    assert!(
        !matches!(within(first.next()).await, Some(Ok(_))),
        "the earlier pipe is closed"
    );
    assert_eq!(t.connected_peers(), vec![me]);
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(events.try_recv().is_err(), "a swap emits no event");
    drop(hanging);
}

/// Bad frames from authenticated peers that keep coming back are warned
/// about at most 10 times per 10 s per transport; the rest go to debug.
#[test]
fn bad_frames_on_pipes_log_a_bounded_number_of_warnings() {
    use tracing_subscriber::layer::SubscriberExt;
    let captured = crate::util::warn_limit::capture::Captured::default();
    let subscriber = tracing_subscriber::registry().with(captured.clone());
    // One thread, so every task logs to this thread's subscriber.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    tracing::subscriber::with_default(subscriber, || {
        runtime.block_on(async {
            let t = Transport::bind(config()).await.expect("bind");
            let mut events = t.events();
            for port in 100..115 {
                let me = UniqueAddress::new_at(([127, 0, 0, 1], port).into());
                let mut io = raw_handshake(&t, me, &Mode::Plain)
                    .await
                    .expect("handshake")
                    .into_inner();
                io.write_all(&[0, 0, 0, 3, 0xff, 0x00, 0x13])
                    .await
                    .expect("write");
                assert!(matches!(
                    disconnected(&mut events).await,
                    DisconnectReason::Malformed(_)
                ));
            }
        })
    });
    let bad: Vec<_> = captured
        .events()
        .into_iter()
        .filter(|(_, fields)| fields.contains("bad frame; closing this connection"))
        .collect();
    let warned = bad
        .iter()
        .filter(|(l, _)| *l == tracing::Level::WARN)
        .count();
    let quiet = bad
        .iter()
        .filter(|(l, _)| *l == tracing::Level::DEBUG)
        .count();
    assert_eq!((warned, quiet), (10, 5), "{bad:?}");
}

/// A raw peer's request `q` on `channel`, correlation `corr`.
async fn send_request(raw: &mut RawStream, channel: u16, corr: u64) {
    raw.send(Frame::Request {
        corr,
        channel,
        payload: Bytes::from_static(b"q"),
    })
    .await
    .expect("send");
}

/// Sends a canonical `Oneway` on `CH` from a raw peer.
async fn send_oneway(raw: &mut RawStream, payload: Bytes) {
    raw.send(Frame::Oneway {
        channel: CH,
        payload,
    })
    .await
    .expect("send");
}

plain_and_tls!(a_borrowed_handler_sees_its_channels_oneways_in_order);
/// A borrowed inline handler registered after the pipe is up sees every
/// oneway on its channel in order, in place (canonical frames) or through
/// the general decoder (a frame written in another valid CBOR form), and
/// nothing once unregistered; a request on the channel is answered
/// `Dropped`.
async fn a_borrowed_handler_sees_its_channels_oneways_in_order(mode: Mode) {
    let t = Transport::bind(mode.config()).await.expect("bind");
    let mut other = t.register(CH + 1, 4).expect("register");
    let (mut raw, me) = raw_peer(&t, &mode).await;
    // A request on a channel with a queue: once it is delivered, the
    // reader has handled every frame sent before it.
    let mut corr = 0;
    let mut handled_so_far = async |raw: &mut RawStream| {
        corr += 1;
        send_request(raw, CH + 1, corr).await;
        drop(within(other.recv()).await.expect("delivered"));
        // Dropped unanswered: its `Dropped` reply is the next frame back.
        let reply = within(raw.next()).await.expect("frame").expect("decodes");
        assert!(matches!(reply, Frame::Reply { corr: c, .. } if c == corr));
    };
    // Traffic before the handler exists: dropped, and the reader's copy of
    // the handlers is then of an older version.
    send_oneway(&mut raw, Bytes::from_static(b"early")).await;
    handled_so_far(&mut raw).await;
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    t.register_inline_borrowed(CH, move |from, payload| {
        let _ = tx.send((*from, payload.to_vec()));
    })
    .expect("register");
    for i in 0..100u8 {
        send_oneway(&mut raw, Bytes::from(vec![i; usize::from(i)])).await;
    }
    // The same Oneway with its map keys in the other order: valid CBOR of
    // the same frame, not the canonical form the reader reads in place.
    let mut body = Vec::new();
    ciborium::into_writer(
        &ciborium::Value::Map(vec![(
            "Oneway".into(),
            ciborium::Value::Map(vec![
                (
                    "payload".into(),
                    ciborium::Value::Bytes(b"reordered".to_vec()),
                ),
                ("channel".into(), u64::from(CH).into()),
            ]),
        )]),
        &mut body,
    )
    .expect("encode");
    let mut framed = BytesMut::new();
    framed.put_u32(body.len() as u32);
    framed.extend_from_slice(&body);
    raw.get_mut().write_all(&framed).await.expect("write");
    for i in 0..100u8 {
        let (from, payload) = within(rx.recv()).await.expect("delivered");
        assert_eq!((from, payload), (me, vec![i; usize::from(i)]));
    }
    let (_, payload) = within(rx.recv()).await.expect("delivered");
    assert_eq!(payload, b"reordered");
    send_request(&mut raw, CH, 9).await;
    assert_eq!(within(rx.recv()).await.expect("delivered").1, b"q");
    let reply = within(raw.next()).await.expect("frame").expect("decodes");
    assert_eq!(
        reply,
        Frame::Reply {
            corr: 9,
            result: crate::wire::ReplyResult::Err(crate::wire::RemoteFailure::Dropped)
        }
    );
    t.unregister(CH);
    send_oneway(&mut raw, Bytes::from_static(b"late")).await;
    handled_so_far(&mut raw).await;
    assert!(rx.try_recv().is_err(), "nothing after unregister");
}

/// A version-2 node refuses a later `Hello` (as version-2 builds do) and
/// names its version: the dialer dials again announcing 2, and the pipe is
/// at version 2. A payload in a form version 3 introduced is then not sent
/// on it (`send_slice_if` gives `None`), one every version reads is; with
/// no pipe at all, `send_slice_if` sends nothing either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_older_acceptor_is_dialed_again_at_its_version() {
    use crate::wire::{COMPACT_DATA_VERSION, MIN_PROTOCOL_VERSION, PROTOCOL_VERSION};
    let t = Transport::bind(config()).await.expect("bind");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let old = tokio::spawn(async move {
        let (stream, _) = listener.accept().await.expect("accept");
        let mut framed = Framed::new(stream, FrameCodec::default());
        let Some(Ok(Frame::Hello { version, .. })) = within(framed.next()).await else {
            panic!("expected a Hello");
        };
        assert_eq!(version, PROTOCOL_VERSION);
        let reason = RejectReason::UnsupportedVersion { ours: 2, min: 2 };
        framed.send(Frame::Reject { reason }).await.expect("reject");
        drop(framed);
        let (stream, _) = listener.accept().await.expect("accept again");
        let mut framed = Framed::new(stream, FrameCodec::default());
        let secret = Secret::from("sesame");
        let local = Local {
            me: UniqueAddress::new_at(addr),
            cluster: "unit",
            secret: &secret,
        };
        let (_, version) = within(handshake::accept(&mut framed, &local, |_| Ok(())))
            .await
            .expect("handshake at 2");
        assert_eq!(version, 2);
        framed.send(Frame::Accepted).await.expect("accepted");
        // The first data frame that comes.
        loop {
            match within(framed.next()).await {
                Some(Ok(Frame::Oneway { payload, .. })) => break payload,
                Some(Ok(_)) => {}
                other => panic!("pipe ended: {other:?}"),
            }
        }
    });
    let peer = within(t.connect(addr)).await.expect("connects at 2");
    assert_eq!(t.connection(&peer).expect("a pipe").version, 2);
    assert_eq!(MIN_PROTOCOL_VERSION, 2);
    assert_eq!(
        t.send_slice_if(&peer, CH, b"compact", COMPACT_DATA_VERSION),
        None
    );
    assert_eq!(t.send_slice_if(&peer, CH, b"long", 2), Some(Ok(())));
    let nobody = UniqueAddress::new_at("127.0.0.1:9".parse().expect("literal"));
    assert_eq!(t.send_slice_if(&nobody, CH, b"none", 2), None);
    let got = within(old).await.expect("the old node's task");
    assert_eq!(got, Bytes::from_static(b"long"));
}

/// An initiator that announces 2 is answered at 2 (so a version-2 node
/// can dial a version-3 one), and the pipe is at version 2 on both sides;
/// one that announces this build's version gets a pipe at that version,
/// over which a payload of the latest forms goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acceptor_answers_an_older_initiator_at_its_version() {
    use crate::wire::{COMPACT_DATA_VERSION, PROTOCOL_VERSION};
    let t = Transport::bind(config()).await.expect("bind");
    let secret = Secret::from("sesame");
    let mut kept = Vec::new();
    for (port, announce) in [(41u16, 2u16), (42, PROTOCOL_VERSION)] {
        let me = UniqueAddress::new_at(std::net::SocketAddr::from(([127, 0, 0, 1], port)));
        let local = Local {
            me,
            cluster: "unit",
            secret: &secret,
        };
        let stream = TcpStream::connect(t.bound_addr()).await.expect("tcp");
        let mut framed = Framed::new(stream, FrameCodec::default());
        let (_, version) = within(handshake::initiate(
            &mut framed,
            &local,
            t.bound_addr(),
            announce,
            |_| Ok(()),
        ))
        .await
        .expect("handshake");
        assert_eq!(version, announce);
        assert_eq!(t.connection(&me).expect("a pipe").version, announce);
        let compact = t.send_slice_if(&me, CH, b"compact", COMPACT_DATA_VERSION);
        assert_eq!(compact.is_some(), announce >= COMPACT_DATA_VERSION);
        kept.push(framed);
    }
}
