//! Transport tests over real sockets on 127.0.0.1.
//!
//! Every wait is event-driven (a reply, an event, an end of stream) under a
//! generous timeout; nothing sleeps to synchronise.

use std::future::Future;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::{BufMut, Bytes, BytesMut};
use futures_util::{SinkExt, StreamExt};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio_util::codec::Framed;

use datum_cluster_sharding::identity::{NodeId, UniqueAddress};
use datum_cluster_sharding::transport::{
    ConnectError, DisconnectReason, Incoming, RequestError, SendFailure, Transport,
    TransportConfig, TransportEvent,
};
use datum_cluster_sharding::wire::{
    Frame, FrameCodec, MIN_PROTOCOL_VERSION, PROTOCOL_VERSION, RejectReason, RemoteFailure,
};

const CH: u16 = 7;
const PATIENCE: Duration = Duration::from_secs(10);

fn init_logs() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_test_writer()
        .try_init();
}

fn config() -> TransportConfig {
    let mut c = TransportConfig::new("test-cluster", "correct horse");
    c.backoff_min = Duration::from_millis(20);
    c.backoff_max = Duration::from_millis(200);
    c.handshake_timeout = Duration::from_secs(3);
    c
}

async fn node() -> Transport {
    node_with(config()).await
}

async fn node_with(c: TransportConfig) -> Transport {
    init_logs();
    Transport::bind(c).await.expect("bind")
}

/// Awaits `f`, failing the test if it takes longer than `PATIENCE`.
async fn within<T>(what: &str, f: impl Future<Output = T>) -> T {
    tokio::time::timeout(PATIENCE, f)
        .await
        .unwrap_or_else(|_| panic!("timed out: {what}"))
}

/// Serves `channel`: answers every request with `"<tag>:" + payload`,
/// forwards oneway messages to the returned receiver.
fn echo(t: &Transport, tag: &'static str) -> mpsc::UnboundedReceiver<(UniqueAddress, Bytes)> {
    let mut inbox = t.register(CH, 16_384).expect("register");
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Some(Incoming {
            from,
            payload,
            reply,
            ..
        }) = inbox.recv().await
        {
            match reply {
                Some(r) => {
                    let mut out = BytesMut::from(format!("{tag}:").as_bytes());
                    out.extend_from_slice(&payload);
                    let _ = r.reply(out.freeze());
                }
                None => {
                    let _ = tx.send((from, payload));
                }
            }
        }
    });
    rx
}

async fn ask(
    from: &Transport,
    to: &UniqueAddress,
    body: &'static str,
) -> Result<Bytes, RequestError> {
    within(
        "request",
        from.request(to, CH, Bytes::from_static(body.as_bytes()), PATIENCE),
    )
    .await
}

async fn next_event(
    events: &mut mpsc::UnboundedReceiver<TransportEvent>,
    pred: impl Fn(&TransportEvent) -> bool,
) -> TransportEvent {
    within("event", async {
        loop {
            let e = events.recv().await.expect("event stream open");
            if pred(&e) {
                return e;
            }
        }
    })
    .await
}

/// Reads until the peer closes; true if it did within the patience.
async fn closed_by_peer(stream: &mut TcpStream) -> bool {
    let mut buf = [0u8; 1024];
    within("peer close", async {
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return true,
                Ok(_) => continue,
            }
        }
    })
    .await
}

fn raw_identity() -> UniqueAddress {
    UniqueAddress::new_at("127.0.0.1:9".parse().expect("literal"))
}

// -------------------------------------------------------------- traffic

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_reply_and_oneway_between_two() {
    let (a, b) = (node().await, node().await);
    let mut a_oneway = echo(&a, "a");
    let mut b_oneway = echo(&b, "b");
    let ub = within("connect", a.connect(b.bound_addr()))
        .await
        .expect("connect");
    assert_eq!(ub, b.local());

    assert_eq!(
        ask(&a, &ub, "ping").await.expect("reply"),
        Bytes::from_static(b"b:ping")
    );
    a.send(&ub, CH, Bytes::from_static(b"tell")).expect("send");
    let (from, payload) = within("oneway", b_oneway.recv()).await.expect("delivered");
    assert_eq!((from, &payload[..]), (a.local(), &b"tell"[..]));

    // The other direction reuses the same pipe.
    let ua = a.local();
    assert_eq!(
        ask(&b, &ua, "pong").await.expect("reply"),
        Bytes::from_static(b"a:pong")
    );
    b.send(&ua, CH, Bytes::from_static(b"back")).expect("send");
    assert_eq!(
        within("oneway", a_oneway.recv())
            .await
            .expect("delivered")
            .1,
        Bytes::from_static(b"back")
    );
    let (ca, cb) = (
        a.connection(&ub).expect("a's pipe"),
        b.connection(&ua).expect("b's pipe"),
    );
    assert_eq!(
        (ca.local_socket, ca.remote_socket),
        (cb.remote_socket, cb.local_socket)
    );
    assert!(ca.dialed_by_us && !cb.dialed_by_us);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_oneways_arrive_in_order() {
    let (a, b) = (node().await, node().await);
    let mut inbox = echo(&b, "b");
    let ub = within("connect", a.connect(b.bound_addr()))
        .await
        .expect("connect");
    for i in 0u32..5000 {
        a.send(&ub, CH, Bytes::copy_from_slice(&i.to_be_bytes()))
            .expect("send");
    }
    for i in 0u32..5000 {
        let (_, p) = within("oneway", inbox.recv()).await.expect("delivered");
        assert_eq!(&p[..], &i.to_be_bytes());
    }
    let stats = a.stats();
    assert!(stats.writes > 0 && stats.frames_written >= 5000);
    assert_eq!(b.stats().inbound_overflow, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn send_before_connect_dials_and_delivers() {
    let (a, b) = (node().await, node().await);
    let mut inbox = echo(&b, "b");
    // No connect: the first send dials.
    a.send(&b.local(), CH, Bytes::from_static(b"first"))
        .expect("queued");
    a.send(&b.local(), CH, Bytes::from_static(b"second"))
        .expect("queued");
    assert_eq!(
        within("oneway", inbox.recv()).await.expect("delivered").1,
        Bytes::from_static(b"first")
    );
    assert_eq!(
        within("oneway", inbox.recv()).await.expect("delivered").1,
        Bytes::from_static(b"second")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_transports_talk_pairwise() {
    let nodes = [node().await, node().await, node().await];
    let _inboxes: Vec<_> = nodes
        .iter()
        .zip(["n0", "n1", "n2"])
        .map(|(n, tag)| echo(n, tag))
        .collect();
    for (i, from) in nodes.iter().enumerate() {
        for (j, to) in nodes.iter().enumerate() {
            if i != j {
                let reply = ask(from, &to.local(), "hi").await.expect("reply");
                assert_eq!(reply, Bytes::from(format!("n{j}:hi")));
            }
        }
    }
    for n in &nodes {
        assert_eq!(n.connected_peers().len(), 2, "one pipe to each other node");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn simultaneous_connect_gives_one_pipe() {
    for round in 0..20 {
        let (a, b) = (node().await, node().await);
        let (_ia, _ib) = (echo(&a, "a"), echo(&b, "b"));
        let (mut ea, mut eb) = (a.events(), b.events());
        let (ra, rb) = within("both connect", async {
            tokio::join!(a.connect(b.bound_addr()), b.connect(a.bound_addr()))
        })
        .await;
        assert_eq!(
            (ra.expect("a connects"), rb.expect("b connects")),
            (b.local(), a.local())
        );
        // Traffic both ways goes through.
        ask(&a, &b.local(), "x").await.expect("a->b");
        ask(&b, &a.local(), "y").await.expect("b->a");
        let ca = a.connection(&b.local()).expect("a has a pipe");
        let cb = b.connection(&a.local()).expect("b has a pipe");
        assert_eq!(
            ca.local_socket, cb.remote_socket,
            "round {round}: the same TCP connection"
        );
        assert_eq!(
            ca.remote_socket, cb.local_socket,
            "round {round}: the same TCP connection"
        );
        assert_ne!(ca.dialed_by_us, cb.dialed_by_us);
        // The survivor was dialed by the lower node id (or was the only one).
        assert_eq!(a.connected_peers(), vec![b.local()]);
        assert_eq!(b.connected_peers(), vec![a.local()]);
        for events in [&mut ea, &mut eb] {
            let mut connected = 0;
            while let Ok(e) = events.try_recv() {
                assert!(
                    matches!(e, TransportEvent::Connected { .. }),
                    "round {round}: unexpected {e:?}"
                );
                connected += 1;
            }
            assert_eq!(connected, 1, "round {round}: exactly one Connected");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unregistered_channel_and_dropped_handle_answer_at_once() {
    let (a, b) = (node().await, node().await);
    let ub = b.local();
    let err = within("request", a.request(&ub, 99, Bytes::new(), PATIENCE))
        .await
        .expect_err("no handler");
    assert_eq!(err, RequestError::Remote(RemoteFailure::NoHandler(99)));

    let mut inbox = b.register(CH, 8).expect("register");
    tokio::spawn(async move {
        while let Some(msg) = inbox.recv().await {
            drop(msg); // drops the reply handle unanswered
        }
    });
    let err = within("request", a.request(&ub, CH, Bytes::new(), PATIENCE))
        .await
        .expect_err("dropped");
    assert_eq!(err, RequestError::Remote(RemoteFailure::Dropped));
    assert_eq!(a.pending_requests(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_inbox_answers_overloaded_instead_of_stalling() {
    let (a, b) = (node().await, node().await);
    let mut inbox = b.register(CH, 1).expect("register");
    let ub = within("connect", a.connect(b.bound_addr()))
        .await
        .expect("connect");
    a.send(&ub, CH, Bytes::from_static(b"fills the inbox"))
        .expect("send");
    let err = within("request", a.request(&ub, CH, Bytes::new(), PATIENCE))
        .await
        .expect_err("overloaded");
    assert_eq!(err, RequestError::Remote(RemoteFailure::Overloaded));
    assert_eq!(b.stats().inbound_overflow, 1);
    assert_eq!(
        within("oneway", inbox.recv()).await.expect("kept").payload,
        Bytes::from_static(b"fills the inbox")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn too_large_payload_is_given_back() {
    let mut c = config();
    c.max_frame_len = 1024;
    let (a, b) = (node_with(c.clone()).await, node_with(c).await);
    let big = Bytes::from(vec![1u8; 2000]);
    let err = a.send(&b.local(), CH, big.clone()).expect_err("too large");
    assert!(matches!(
        err.reason,
        SendFailure::TooLarge { len: 2000, .. }
    ));
    assert_eq!(err.into_payload(), big);
}

// -------------------------------------------------------------- timeouts and faults

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_timeout_leaves_no_pending_entry() {
    let (a, b) = (node().await, node().await);
    let mut inbox = b.register(CH, 8).expect("register");
    let held = tokio::spawn(async move {
        let mut keep = Vec::new();
        while let Some(m) = inbox.recv().await {
            keep.push(m); // never answered
        }
    });
    let ub = within("connect", a.connect(b.bound_addr()))
        .await
        .expect("connect");
    let started = Instant::now();
    let err = a
        .request(
            &ub,
            CH,
            Bytes::from_static(b"q"),
            Duration::from_millis(200),
        )
        .await;
    assert_eq!(err, Err(RequestError::Timeout));
    assert!(started.elapsed() < Duration::from_secs(5));
    assert_eq!(a.pending_requests(), 0, "timed-out entry removed");
    held.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pending_requests_fail_promptly_when_peer_dies() {
    let (a, b) = (node().await, node().await);
    let mut inbox = b.register(CH, 8).expect("register");
    let ub = within("connect", a.connect(b.bound_addr()))
        .await
        .expect("connect");
    let mut ea = a.events();
    let a2 = a.clone();
    let pending = tokio::spawn(async move {
        let started = Instant::now();
        let r = a2
            .request(
                &ub,
                CH,
                Bytes::from_static(b"never answered"),
                Duration::from_secs(60),
            )
            .await;
        (r, started.elapsed())
    });
    let held = within("request arrives", inbox.recv())
        .await
        .expect("request delivered");
    assert_eq!(a.pending_requests(), 1);
    b.shutdown().await;
    let (result, waited) = within("request fails", pending).await.expect("task");
    assert_eq!(result, Err(RequestError::ConnectionLost));
    assert!(
        waited < Duration::from_secs(10),
        "failed long before the 60 s timeout"
    );
    let e = next_event(&mut ea, |e| {
        matches!(e, TransportEvent::Disconnected { .. })
    })
    .await;
    assert!(matches!(e, TransportEvent::Disconnected { peer, .. } if peer == ub));
    assert_eq!(a.pending_requests(), 0);
    drop(held);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn send_to_marked_down_node_fails_at_once() {
    let (a, b) = (node().await, node().await);
    let _ib = echo(&b, "b");
    let (mut ea, mut eb) = (a.events(), b.events());
    let ub = within("connect", a.connect(b.bound_addr()))
        .await
        .expect("connect");
    ask(&a, &ub, "before").await.expect("works before");

    a.mark_down(&ub);
    assert!(a.is_marked_down(&ub));
    let err = a
        .send(&ub, CH, Bytes::from_static(b"after"))
        .expect_err("refused");
    assert_eq!(err.reason, SendFailure::MarkedDown);
    assert_eq!(err.payload, Bytes::from_static(b"after"));
    let started = Instant::now();
    let err = a
        .request(&ub, CH, Bytes::from_static(b"q"), PATIENCE)
        .await
        .expect_err("refused");
    assert!(matches!(err, RequestError::NotSent(ref e) if e.reason == SendFailure::MarkedDown));
    assert!(started.elapsed() < Duration::from_secs(1), "failed at once");

    let down = |e: &TransportEvent| matches!(e, TransportEvent::Disconnected { .. });
    let e = next_event(&mut ea, down).await;
    assert_eq!(
        e,
        TransportEvent::Disconnected {
            peer: ub,
            reason: DisconnectReason::MarkedDown
        }
    );
    next_event(&mut eb, down).await; // the connection is really closed
    // The downed identity cannot come back.
    let err = within("redial", b.connect(a.bound_addr()))
        .await
        .expect_err("quarantined");
    assert_eq!(err, ConnectError::Rejected(RejectReason::Quarantined));
    assert!(a.connected_peers().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconnects_to_a_restarted_peer_at_the_same_address() {
    let a = node().await;
    let b = node().await;
    let _ib = echo(&b, "old");
    let addr = b.bound_addr();
    let ub = within("connect", a.connect(addr)).await.expect("connect");
    ask(&a, &ub, "1").await.expect("reply");
    let mut ea = a.events();

    b.shutdown().await;
    drop(b);
    next_event(&mut ea, |e| {
        matches!(e, TransportEvent::Disconnected { .. })
    })
    .await;
    // While it is gone, a request cannot connect.
    let err = within(
        "request",
        a.request(&ub, CH, Bytes::new(), Duration::from_secs(2)),
    )
    .await;
    assert!(
        matches!(err, Err(RequestError::Connect(_) | RequestError::Timeout)),
        "{err:?}"
    );

    let mut c = config();
    c.bind_addr = addr;
    let b2 = node_with(c).await;
    let mut ib2 = echo(&b2, "new");
    let ub2 = b2.local();
    assert_eq!(ub2.addr, addr);
    assert_ne!(ub2.node_id, ub.node_id);

    // A tell to the new identity redials once the backoff allows it and gets
    // through; then requests work too.
    a.send(&ub2, CH, Bytes::from_static(b"hello again"))
        .expect("queued");
    let (from, p) = within("redial delivers", ib2.recv())
        .await
        .expect("delivered");
    assert_eq!((from, p), (a.local(), Bytes::from_static(b"hello again")));
    let reply = ask(&a, &ub2, "2").await.expect("reply");
    assert_eq!(reply, Bytes::from_static(b"new:2"));
    let e = next_event(&mut ea, |e| matches!(e, TransportEvent::Connected { .. })).await;
    assert_eq!(e, TransportEvent::Connected { peer: ub2 });
    // The old identity is stale now.
    let err = a.send(&ub, CH, Bytes::new()).expect_err("stale");
    assert_eq!(err.reason, SendFailure::Stale);
}

// -------------------------------------------------------------- handshake refusals

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_cluster_name_is_refused() {
    let (a, b) = (node().await, node().await);
    let _ib = echo(&b, "b");
    let mut ea = a.events();
    let mut c = config();
    c.cluster_name = "another-cluster".into();
    let stranger = node_with(c).await;
    let err = within("connect", stranger.connect(a.bound_addr()))
        .await
        .expect_err("refused");
    assert_eq!(err, ConnectError::Rejected(RejectReason::WrongCluster));
    // A correct peer still works, and the stranger never became connected.
    ask(&a, &b.local(), "ok").await.expect("a still serves b");
    assert_eq!(a.connected_peers(), vec![b.local()]);
    assert!(stranger.connected_peers().is_empty());
    let only = next_event(&mut ea, |_| true).await;
    assert_eq!(only, TransportEvent::Connected { peer: b.local() });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_secret_is_refused_both_ways() {
    let (a, b) = (node().await, node().await);
    let _ib = echo(&b, "b");
    let mut c = config();
    c.secret = "wrong horse".into();
    let stranger = node_with(c).await;
    // The stranger dials: it cannot verify a's proof and refuses.
    let err = within("connect", stranger.connect(a.bound_addr()))
        .await
        .expect_err("refused");
    assert_eq!(err, ConnectError::Refused(RejectReason::BadProof));
    // a dials the stranger: a cannot verify the stranger's proof.
    let err = within("connect", a.connect(stranger.bound_addr()))
        .await
        .expect_err("refused");
    assert_eq!(err, ConnectError::Refused(RejectReason::BadProof));
    ask(&a, &b.local(), "ok").await.expect("a still serves b");
    assert_eq!(a.connected_peers(), vec![b.local()]);
    assert!(stranger.connected_peers().is_empty());
}

/// A raw client that knows the cluster name but not the secret: its forged
/// proof is refused by the acceptor.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_proof_is_refused_by_the_acceptor() {
    let a = node().await;
    let stream = TcpStream::connect(a.bound_addr()).await.expect("tcp");
    let mut framed = Framed::new(stream, FrameCodec::default());
    let hello = Frame::Hello {
        version: PROTOCOL_VERSION,
        cluster: "test-cluster".into(),
        from: raw_identity(),
        nonce: Bytes::from(vec![5u8; 32]),
    };
    framed.send(hello).await.expect("hello");
    let welcome = within("welcome", framed.next())
        .await
        .expect("frame")
        .expect("decodes");
    assert!(matches!(welcome, Frame::Welcome { .. }), "{welcome:?}");
    framed
        .send(Frame::Proof {
            proof: Bytes::from(vec![0u8; 32]),
        })
        .await
        .expect("proof");
    let reject = within("reject", framed.next())
        .await
        .expect("frame")
        .expect("decodes");
    assert_eq!(
        reject,
        Frame::Reject {
            reason: RejectReason::BadProof
        }
    );
    assert!(
        within("close", framed.next()).await.is_none(),
        "connection closed"
    );
    assert!(a.connected_peers().is_empty());
}

/// An acceptor that cannot prove the secret but names an identity this node
/// already has a pipe to: the dialer verifies the proof before it looks at
/// its own table, so it refuses `BadProof` instead of handing out the
/// existing pipe as if the impostor were that node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dialer_verifies_the_proof_before_looking_up_the_identity() {
    let (a, b) = (node().await, node().await);
    let _ib = echo(&b, "b");
    let ub = within("connect", a.connect(b.bound_addr()))
        .await
        .expect("connect");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let impostor = listener.local_addr().expect("addr");
    let serve = tokio::spawn(async move {
        let (stream, _) = listener.accept().await.expect("accept");
        let mut framed = Framed::new(stream, FrameCodec::default());
        let _hello = framed.next().await;
        framed
            .send(Frame::Welcome {
                version: PROTOCOL_VERSION,
                from: ub,
                nonce: Bytes::from(vec![1u8; 32]),
                proof: Bytes::from(vec![0u8; 32]),
            })
            .await
            .expect("welcome");
        framed.next().await
    });
    let err = within("connect", a.connect(impostor))
        .await
        .expect_err("refused");
    assert_eq!(err, ConnectError::Refused(RejectReason::BadProof));
    let answer = within("impostor", serve).await.expect("task");
    assert!(
        matches!(
            answer,
            Some(Ok(Frame::Reject {
                reason: RejectReason::BadProof
            }))
        ),
        "{answer:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn old_protocol_version_is_refused() {
    let (a, b) = (node().await, node().await);
    let _ib = echo(&b, "b");
    let stream = TcpStream::connect(a.bound_addr()).await.expect("tcp");
    let mut framed = Framed::new(stream, FrameCodec::default());
    let hello = Frame::Hello {
        version: MIN_PROTOCOL_VERSION - 1,
        cluster: "test-cluster".into(),
        from: raw_identity(),
        nonce: Bytes::from(vec![5u8; 32]),
    };
    framed.send(hello).await.expect("hello");
    let reject = within("reject", framed.next())
        .await
        .expect("frame")
        .expect("decodes");
    assert_eq!(
        reject,
        Frame::Reject {
            reason: RejectReason::UnsupportedVersion {
                ours: PROTOCOL_VERSION,
                min: MIN_PROTOCOL_VERSION
            }
        }
    );
    assert!(
        within("close", framed.next()).await.is_none(),
        "connection closed"
    );
    ask(&a, &b.local(), "ok").await.expect("a still serves b");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_client_is_dropped_after_the_handshake_timeout() {
    let mut c = config();
    c.handshake_timeout = Duration::from_millis(300);
    let a = node_with(c).await;
    let mut stream = TcpStream::connect(a.bound_addr()).await.expect("tcp");
    assert!(closed_by_peer(&mut stream).await);
}

// -------------------------------------------------------------- bad bytes

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_bytes_close_only_that_connection() {
    let (a, b) = (node().await, node().await);
    let _ib = echo(&a, "a");
    let ua = a.local();
    ask(&b, &ua, "before").await.expect("works");
    let mut raw = TcpStream::connect(a.bound_addr()).await.expect("tcp");
    let mut garbage = BytesMut::new();
    garbage.put_u32(12);
    garbage.extend_from_slice(b"\xff\xfe not cbor at all");
    raw.write_all(&garbage).await.expect("write");
    assert!(closed_by_peer(&mut raw).await);
    assert_eq!(
        ask(&b, &ua, "after").await.expect("still works"),
        Bytes::from_static(b"a:after")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_length_prefix_closes_only_that_connection() {
    let (a, b) = (node().await, node().await);
    let _ib = echo(&a, "a");
    let ua = a.local();
    ask(&b, &ua, "before").await.expect("works");
    let mut raw = TcpStream::connect(a.bound_addr()).await.expect("tcp");
    raw.write_all(&u32::MAX.to_be_bytes()).await.expect("write");
    assert!(closed_by_peer(&mut raw).await);
    assert_eq!(
        ask(&b, &ua, "after").await.expect("still works"),
        Bytes::from_static(b"a:after")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_to_a_closed_port_fails_and_backs_off() {
    let a = node().await;
    let free: SocketAddr = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("probe");
        l.local_addr().expect("addr")
    };
    let err = within("connect", a.connect(free))
        .await
        .expect_err("nothing listens");
    assert!(matches!(err, ConnectError::Io { .. }), "{err:?}");
    // A oneway to an unreachable identity is accepted (tell) and dropped.
    let ghost = UniqueAddress {
        addr: free,
        node_id: NodeId(1),
        incarnation: 1,
    };
    a.send(&ghost, CH, Bytes::from_static(b"lost"))
        .expect("queued");
    let err = within("connect again", a.connect(free))
        .await
        .expect_err("still nothing");
    assert!(matches!(err, ConnectError::Io { .. }), "{err:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_acceptor_times_the_dial_out() {
    let mut c = config();
    c.handshake_timeout = Duration::from_millis(300);
    let a = node_with(c).await;
    // Accepts TCP, never speaks.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let hold = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = listener.accept().await {
            held.push(s);
        }
    });
    let started = Instant::now();
    let err = within("connect", a.connect(addr))
        .await
        .expect_err("times out");
    assert_eq!(err, ConnectError::Timeout);
    assert!(started.elapsed() < Duration::from_secs(5));
    hold.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn huge_timeout_does_not_overflow() {
    let (a, b) = (node().await, node().await);
    let _ib = echo(&b, "b");
    let r = within(
        "request",
        a.request(&b.local(), CH, Bytes::from_static(b"x"), Duration::MAX),
    )
    .await;
    assert_eq!(r.expect("reply"), Bytes::from_static(b"b:x"));
}

/// Both sides start sending before any pipe exists: the dials race, one
/// pipe survives, and every queued message arrives, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn simultaneous_sends_lose_nothing() {
    for round in 0..10 {
        let (a, b) = (node().await, node().await);
        let (mut ia, mut ib) = (echo(&a, "a"), echo(&b, "b"));
        let (ua, ub) = (a.local(), b.local());
        let (a2, b2) = (a.clone(), b.clone());
        let sa = tokio::spawn(async move {
            for i in 0u32..100 {
                a2.send(&ub, CH, Bytes::copy_from_slice(&i.to_be_bytes()))
                    .expect("queued");
            }
        });
        let sb = tokio::spawn(async move {
            for i in 0u32..100 {
                b2.send(&ua, CH, Bytes::copy_from_slice(&i.to_be_bytes()))
                    .expect("queued");
            }
        });
        sa.await.expect("sender a");
        sb.await.expect("sender b");
        for (side, (inbox, from)) in [(&mut ib, ua), (&mut ia, ub)].into_iter().enumerate() {
            for i in 0u32..100 {
                let what = format!("round {round}, side {side}, message {i}");
                let (who, p) = within(&what, inbox.recv()).await.expect("delivered");
                assert_eq!((who, &p[..]), (from, &i.to_be_bytes()[..]), "round {round}");
            }
        }
        assert_eq!(a.connected_peers(), vec![ub]);
        assert_eq!(b.connected_peers(), vec![ua]);
    }
}

/// Many requests in flight across three nodes while one of them dies: every
/// request ends (reply or error) promptly and nothing stays pending.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_in_flight_survive_a_node_dying() {
    let nodes = [node().await, node().await, node().await];
    let _inboxes: Vec<_> = nodes
        .iter()
        .zip(["n0", "n1", "n2"])
        .map(|(n, t)| echo(n, t))
        .collect();
    let ids: Vec<_> = nodes.iter().map(Transport::local).collect();
    for n in &nodes[..2] {
        for id in &ids {
            if *id != n.local() {
                ask(n, id, "warm").await.expect("warm-up");
            }
        }
    }
    let mut tasks = Vec::new();
    for w in 0..64 {
        let from = nodes[w % 2].clone();
        let ids = ids.clone();
        tasks.push(tokio::spawn(async move {
            let (mut ok, mut failed) = (0, 0);
            for i in 0..200 {
                let to = &ids[if i % 2 == 0 { 2 } else { 1 - w % 2 }];
                match from
                    .request(to, CH, Bytes::from_static(b"r"), Duration::from_secs(5))
                    .await
                {
                    Ok(_) => ok += 1,
                    Err(
                        RequestError::ConnectionLost
                        | RequestError::Connect(_)
                        | RequestError::NotSent(_)
                        | RequestError::Timeout,
                    ) => failed += 1,
                    Err(e) => panic!("unexpected {e:?}"),
                }
            }
            (ok, failed)
        }));
    }
    // Let traffic flow, then kill node 2 while requests are in flight.
    let mut e0 = nodes[0].events();
    ask(&nodes[0], &ids[2], "mid")
        .await
        .expect("node 2 still up");
    nodes[2].shutdown().await;
    next_event(
        &mut e0,
        |e| matches!(e, TransportEvent::Disconnected { peer, .. } if *peer == ids[2]),
    )
    .await;
    let (mut ok, mut failed) = (0, 0);
    for t in tasks {
        let (o, f) = within("requesters finish", t).await.expect("task");
        ok += o;
        failed += f;
    }
    assert_eq!(ok + failed, 64 * 200);
    assert!(
        ok >= 64 * 100,
        "requests between the survivors all succeed: ok {ok}"
    );
    assert_eq!(nodes[0].pending_requests() + nodes[1].pending_requests(), 0);
    // The survivors still talk.
    ask(&nodes[0], &ids[1], "after").await.expect("0 -> 1");
    ask(&nodes[1], &ids[0], "after").await.expect("1 -> 0");
}

/// As `simultaneous_sends_lose_nothing`, on a control channel (priority
/// lane): frames moved from the dial queue into a new pipe's priority lane
/// must still follow the acceptor's `Accepted`, never precede it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn simultaneous_control_channel_sends_lose_nothing() {
    const CONTROL: u16 = 1;
    for round in 0..10 {
        let (a, b) = (node().await, node().await);
        let (mut ia, mut ib) = (
            a.register(CONTROL, 1024).expect("register"),
            b.register(CONTROL, 1024).expect("register"),
        );
        let (ua, ub) = (a.local(), b.local());
        let (a2, b2) = (a.clone(), b.clone());
        let sa = tokio::spawn(async move {
            for i in 0u32..100 {
                a2.send(&ub, CONTROL, Bytes::copy_from_slice(&i.to_be_bytes()))
                    .expect("queued");
            }
        });
        let sb = tokio::spawn(async move {
            for i in 0u32..100 {
                b2.send(&ua, CONTROL, Bytes::copy_from_slice(&i.to_be_bytes()))
                    .expect("queued");
            }
        });
        sa.await.expect("sender a");
        sb.await.expect("sender b");
        for (side, (inbox, from)) in [(&mut ib, ua), (&mut ia, ub)].into_iter().enumerate() {
            for i in 0u32..100 {
                let what = format!("round {round}, side {side}, message {i}");
                let m = within(&what, inbox.recv()).await.expect("delivered");
                assert_eq!(
                    (m.from, &m.payload[..]),
                    (from, &i.to_be_bytes()[..]),
                    "round {round}"
                );
            }
        }
        assert_eq!(a.connected_peers(), vec![ub]);
        assert_eq!(b.connected_peers(), vec![ua]);
    }
}

/// A client that knows the cluster name (it travels in clear) but not the
/// secret keeps sending `Hello`s that claim b's address and then stays
/// silent. Each holds b's slot on a until its handshake times out, and they
/// overlap; still, a's dial to b waits at most one handshake timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unauthenticated_hellos_cannot_keep_a_dial_deferred() {
    let mut c = config();
    c.handshake_timeout = Duration::from_millis(500);
    let (a, b) = (node_with(c.clone()).await, node_with(c).await);
    let _ib = echo(&b, "b");
    let claim = UniqueAddress {
        addr: b.bound_addr(),
        node_id: NodeId(7),
        incarnation: 1,
    };
    let target = a.bound_addr();
    let (admitted_tx, mut admitted) = mpsc::unbounded_channel();
    let attacker = tokio::spawn(async move {
        let mut held = std::collections::VecDeque::new();
        loop {
            let stream = TcpStream::connect(target).await.expect("tcp");
            let mut framed = Framed::new(stream, FrameCodec::default());
            let hello = Frame::Hello {
                version: PROTOCOL_VERSION,
                cluster: "test-cluster".into(),
                from: claim,
                nonce: Bytes::from(vec![3u8; 32]),
            };
            framed.send(hello).await.expect("hello");
            if let Some(Ok(Frame::Welcome { .. })) = framed.next().await {
                let _ = admitted_tx.send(());
            }
            held.push_back(framed);
            if held.len() > 8 {
                held.pop_front();
            }
            // The attack's pace: a new claim every 100 ms, each held open.
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    within("first claim admitted", admitted.recv())
        .await
        .expect("attacker runs");
    let started = Instant::now();
    let found = within("connect despite the claims", a.connect(b.bound_addr()))
        .await
        .expect("connects");
    assert_eq!(found, b.local());
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "took {:?}",
        started.elapsed()
    );
    ask(&a, &b.local(), "ok").await.expect("pipe works");
    attacker.abort();
}

/// Beyond `max_inbound_handshakes` unauthenticated connections at once, a
/// new one is closed at once; a slot frees when one ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_unauthenticated_handshakes_are_capped() {
    let mut c = config();
    c.max_inbound_handshakes = 2;
    c.handshake_timeout = Duration::from_secs(8);
    let a = node_with(c).await;
    let _ia = echo(&a, "a");
    let s1 = TcpStream::connect(a.bound_addr()).await.expect("tcp");
    let s2 = TcpStream::connect(a.bound_addr()).await.expect("tcp");
    let started = Instant::now();
    let mut s3 = TcpStream::connect(a.bound_addr()).await.expect("tcp");
    assert!(closed_by_peer(&mut s3).await);
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "closed at once, not at the handshake timeout"
    );
    drop((s1, s2));
    let b = node().await;
    let reply = within("connect after the silent ones left", async {
        loop {
            match b
                .request(&a.local(), CH, Bytes::from_static(b"hi"), PATIENCE)
                .await
            {
                Ok(r) => return r,
                // The refused attempt may still be backing off.
                Err(RequestError::Connect(_)) => tokio::task::yield_now().await,
                Err(e) => panic!("{e:?}"),
            }
        }
    })
    .await;
    assert_eq!(reply, Bytes::from_static(b"a:hi"));
}

/// Before the handshake, a frame may be at most 4 KiB: a larger announced
/// length closes the connection at once instead of being waited for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_frame_during_the_handshake_closes_at_once() {
    let mut c = config();
    c.handshake_timeout = Duration::from_secs(8);
    let a = node_with(c).await;
    let mut raw = TcpStream::connect(a.bound_addr()).await.expect("tcp");
    let started = Instant::now();
    raw.write_all(&(64u32 * 1024).to_be_bytes())
        .await
        .expect("write");
    raw.write_all(&[0xa1; 100]).await.expect("write");
    assert!(closed_by_peer(&mut raw).await);
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "closed at once, not at the handshake timeout"
    );
}

// -------------------------------------------------------------- TLS on one side only

/// The first bytes a TLS client sends: a `ClientHello`'s record header and
/// the start of its body.
const CLIENT_HELLO_START: [u8; 11] = [
    0x16, 0x03, 0x01, 0x00, 0xc8, 0x01, 0x00, 0x00, 0xc4, 0x03, 0x03,
];

/// A plaintext node meeting a TLS one takes the TLS record it reads for
/// what it is — the peer speaks TLS — and not for a frame of hundreds of
/// MiB: as the dialer (the TLS node's alert refusing its `Hello`), and as
/// the acceptor (a `ClientHello`), which then answers with a plaintext
/// `Reject`, so that the TLS side learns that this node speaks plaintext.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plaintext_node_says_that_its_peer_speaks_tls() {
    let a = node().await;
    // As the dialer, at an acceptor that answers the Hello as rustls does:
    // a fatal `decode_error` alert.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let acceptor = tokio::spawn(async move {
        let (mut tcp, _) = listener.accept().await.expect("accept");
        let mut hello = [0u8; 4096];
        let _ = tcp.read(&mut hello).await;
        tcp.write_all(&[0x15, 0x03, 0x03, 0x00, 0x02, 0x02, 0x32])
            .await
            .expect("alert");
        tcp // held open: the dialer reads the alert, not an end
    });
    let err = within("connect", a.connect(addr))
        .await
        .expect_err("refused");
    match &err {
        ConnectError::Tls(why) => assert!(why.contains("speaks TLS"), "{why}"),
        other => panic!("{other:?}"),
    }
    let _held = acceptor.await.expect("acceptor");

    // As the acceptor, of a ClientHello: a plaintext Reject.
    let mut raw = TcpStream::connect(a.bound_addr()).await.expect("tcp");
    raw.write_all(&CLIENT_HELLO_START).await.expect("write");
    let mut framed = Framed::new(raw, FrameCodec::default());
    let reply = within("reply", framed.next()).await;
    assert!(
        matches!(
            reply,
            Some(Ok(Frame::Reject {
                reason: RejectReason::ProtocolViolation
            }))
        ),
        "{reply:?}"
    );
    assert!(a.connected_peers().is_empty());
}

// -------------------------------------------------------------- stalled handshakes

/// Connections from one source that stall their handshake (silent, or half
/// a `Hello`) hold at most `max_inbound_handshakes_per_source` of the
/// handshake permits; the rest are closed at once, and a node from another
/// source still connects while they stall. (127.0.0.2 is another source on
/// Linux's loopback; a node dialing 127.0.0.1 comes from 127.0.0.1.)
#[cfg(target_os = "linux")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_handshakes_from_one_source_leave_room_for_others() {
    let mut c = config();
    c.max_inbound_handshakes = 16;
    // The stalls outlast the test: only the bound per source makes room.
    c.handshake_timeout = Duration::from_secs(120);
    let per_source = c.max_inbound_handshakes_per_source;
    let a = node_with(c).await;
    let _ia = echo(&a, "a");
    let mut stalled = Vec::new();
    for i in 0..40 {
        let socket = tokio::net::TcpSocket::new_v4().expect("socket");
        socket
            .bind("127.0.0.2:0".parse().expect("literal"))
            .expect("a second source on the loopback");
        let mut tcp = socket.connect(a.bound_addr()).await.expect("tcp");
        if i % 2 == 0 {
            // A length prefix and the first byte of a Hello's body.
            tcp.write_all(&[0x00, 0x00, 0x00, 0x80, 0xa1])
                .await
                .expect("write");
        }
        stalled.push(tcp);
    }
    // Accepted after all of those (in order), b finds a permit free.
    let b = node().await;
    let found = within("connect while they stall", b.connect(a.bound_addr()))
        .await
        .expect("a node from another source connects");
    assert_eq!(found, a.local());
    assert_eq!(
        ask(&b, &a.local(), "ok").await.expect("the pipe works"),
        Bytes::from_static(b"a:ok")
    );
    // The source's first connections hold their handshakes; the others were
    // closed at once (the stalls' timeout is far away).
    for tcp in stalled.iter_mut().skip(per_source) {
        assert!(closed_by_peer(tcp).await);
    }
    let mut buf = [0u8; 16];
    for (i, tcp) in stalled.iter().enumerate().take(per_source) {
        let open =
            matches!(tcp.try_read(&mut buf), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock);
        assert!(open, "connection {i} still waits for its handshake");
    }
}
