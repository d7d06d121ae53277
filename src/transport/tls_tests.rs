//! TLS pipes between real transports on 127.0.0.1: traffic, each refusal,
//! loading errors, and a reload of the files under an established pipe.

use std::path::Path;
use std::time::Duration;

use bytes::Bytes;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::*;
use crate::wire::RejectReason;

const CH: u16 = 7;
const PATIENCE: Duration = Duration::from_secs(10);
const DAY: Duration = Duration::from_secs(86_400);

fn pki(dir: &Path, names: &[&str]) -> Vec<TlsConfig> {
    generate_test_certificates(dir, names, DAY).expect("certificates")
}

fn plain_config() -> TransportConfig {
    let mut c = TransportConfig::new("unit", "sesame");
    c.handshake_timeout = Duration::from_secs(3);
    c
}

/// A transport on 127.0.0.1 under `tls` that echoes every request on `CH`.
async fn node(tls: Option<&TlsConfig>) -> Transport {
    node_with(tls, Duration::from_secs(3)).await
}

/// [`node`], with this handshake timeout.
async fn node_with(tls: Option<&TlsConfig>, handshake_timeout: Duration) -> Transport {
    let mut c = plain_config();
    c.handshake_timeout = handshake_timeout;
    c.tls = tls.map(|t| Tls::load(t.clone()).expect("loads"));
    node_configured(c).await
}

/// A transport with this configuration that echoes every request on `CH`.
async fn node_configured(c: TransportConfig) -> Transport {
    let t = Transport::bind(c).await.expect("bind");
    let mut inbox = t.register(CH, 1024).expect("register");
    tokio::spawn(async move {
        while let Some(msg) = inbox.recv().await {
            if let Some(reply) = msg.reply {
                let _ = reply.reply(msg.payload);
            }
        }
    });
    t
}

/// `from` dials `to` and a request goes there and back.
async fn round_trip(from: &Transport, to: &Transport) -> Result<(), String> {
    let peer = tokio::time::timeout(PATIENCE, from.connect(to.bound_addr()))
        .await
        .map_err(|_| "connect timed out".to_string())?
        .map_err(|e| e.to_string())?;
    let answer = from
        .request(&peer, CH, Bytes::from_static(b"ping"), PATIENCE)
        .await
        .map_err(|e| e.to_string())?;
    assert_eq!(&answer[..], b"ping");
    Ok(())
}

/// [`round_trip`] until it succeeds (within `PATIENCE`): after a failed
/// dial, `connect` fails fast with that error while the next attempt waits
/// out its backoff.
async fn round_trip_eventually(from: &Transport, to: &Transport) -> Result<(), String> {
    let deadline = tokio::time::Instant::now() + PATIENCE;
    loop {
        match round_trip(from, to).await {
            Ok(()) => return Ok(()),
            Err(e) if tokio::time::Instant::now() >= deadline => return Err(e),
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
}

async fn connect_error(from: &Transport, to: &Transport) -> ConnectError {
    tokio::time::timeout(PATIENCE, from.connect(to.bound_addr()))
        .await
        .expect("refused within the handshake timeout")
        .expect_err("refused")
}

#[tokio::test]
async fn a_tls_pipe_carries_requests_both_ways() {
    let dir = tempfile::tempdir().expect("tempdir");
    let certs = pki(dir.path(), &["127.0.0.1", "127.0.0.1"]);
    let (a, b) = (node(Some(&certs[0])).await, node(Some(&certs[1])).await);
    round_trip(&a, &b).await.expect("a to b");
    round_trip(&b, &a).await.expect("b to a, on the same pipe");
    // Many frames in one batch, each through the one session.
    let peer = a.connect(b.bound_addr()).await.expect("connected");
    let asks = (0..500u32).map(|i| {
        let a = a.clone();
        async move {
            let payload = Bytes::from(vec![i as u8; 1 + i as usize * 7]);
            let answer = a.request(&peer, CH, payload.clone(), PATIENCE).await;
            answer.expect("answered") == payload
        }
    });
    let answers = futures_util::future::join_all(asks).await;
    assert!(answers.into_iter().all(|same| same));
    assert_eq!(a.connected_peers().len(), 1);
}

#[tokio::test]
async fn a_certificate_from_another_ca_is_refused_by_either_side() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ours = pki(&dir.path().join("ours"), &["127.0.0.1"]);
    let theirs = pki(&dir.path().join("theirs"), &["127.0.0.1"]);
    let (a, stranger) = (node(Some(&ours[0])).await, node(Some(&theirs[0])).await);
    for (from, to) in [(&a, &stranger), (&stranger, &a)] {
        match connect_error(from, to).await {
            ConnectError::Tls(why) => assert!(why.contains("UnknownIssuer"), "{why}"),
            other => panic!("{other:?}"),
        }
    }
    assert!(a.connected_peers().is_empty() && stranger.connected_peers().is_empty());
}

#[tokio::test]
async fn a_certificate_must_name_the_node_on_both_sides() {
    let dir = tempfile::tempdir().expect("tempdir");
    // One CA; a certificate for 127.0.0.1 and one for another address.
    let certs = pki(dir.path(), &["127.0.0.1", "10.9.9.9"]);
    let honest = node(Some(&certs[0])).await;
    let misnamed = Tls::load(certs[1].clone()).expect("loads");
    // A transport whose own certificate does not name it is refused at
    // bind: every peer would refuse it.
    let mut c = plain_config();
    c.tls = Some(misnamed.clone());
    let refused = Transport::bind(c).await.expect_err("refused at bind");
    assert!(refused.to_string().contains("does not name"), "{refused}");
    // So the misnamed side is played by hand. As the acceptor: its
    // certificate does not name the address dialed.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let impostor = listener.local_addr().expect("addr");
    let acceptor = misnamed.clone();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let _ = acceptor.accept(tcp).await;
        }
    });
    match tokio::time::timeout(PATIENCE, honest.connect(impostor))
        .await
        .expect("answered")
    {
        Err(ConnectError::Tls(why)) => assert!(why.contains("not valid for name"), "{why}"),
        other => panic!("{other:?}"),
    }
    // As the dialer: TLS passes (its chain is good and the acceptor is
    // named), but its Hello claims 127.0.0.1:1, which its certificate does
    // not name.
    let tcp = TcpStream::connect(honest.bound_addr()).await.expect("tcp");
    let tls = misnamed
        .connect(tcp, honest.bound_addr())
        .await
        .expect("TLS passes");
    let mut framed = super::pipe::handshake_framed(tls);
    let secret = Secret::from("sesame");
    let me = crate::model::identity::UniqueAddress::new_at("127.0.0.1:1".parse().expect("literal"));
    let local = super::handshake::Local {
        me,
        cluster: "unit",
        secret: &secret,
    };
    let refused = super::handshake::initiate(
        &mut framed,
        &local,
        honest.bound_addr(),
        crate::wire::PROTOCOL_VERSION,
        |_| Ok(()),
    );
    assert_eq!(
        tokio::time::timeout(PATIENCE, refused)
            .await
            .expect("answered"),
        Err(ConnectError::Rejected(RejectReason::CertificateMismatch))
    );
    assert!(honest.connected_peers().is_empty());
    // Under a shared peer name, the address no longer matters.
    let shared = pki(
        &dir.path().join("named"),
        &["nodes.unit.test", "nodes.unit.test"],
    );
    let named = |i: usize| shared[i].clone().with_peer_name("nodes.unit.test");
    let (x, y) = (node(Some(&named(0))).await, node(Some(&named(1))).await);
    round_trip(&x, &y).await.expect("named peers");
}

/// Every connection is a full TLS handshake that checks the certificates:
/// no session is resumed (a resumed one checks none, so a peer whose
/// certificate expired since could come back on it).
#[tokio::test]
async fn no_tls_session_is_resumed() {
    let dir = tempfile::tempdir().expect("tempdir");
    let certs = pki(dir.path(), &["127.0.0.1", "127.0.0.1"]);
    let (server, client) = (
        Tls::load(certs[0].clone()).expect("loads"),
        Tls::load(certs[1].clone()).expect("loads"),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    for attempt in 0..3 {
        let accepting = async {
            let (tcp, _) = listener.accept().await.expect("accept");
            let (mut stream, _) = server.accept(tcp).await.expect("accepted");
            // A byte after the handshake, behind any session tickets.
            stream.write_all(b"x").await.expect("write");
            stream.flush().await.expect("flush");
            stream
        };
        let dialing = async {
            let tcp = TcpStream::connect(addr).await.expect("tcp");
            let mut stream = client.connect(tcp, addr).await.expect("connected");
            let mut byte = [0u8; 1];
            stream.read_exact(&mut byte).await.expect("read");
            stream
        };
        let (accepted, dialed) = tokio::join!(accepting, dialing);
        for kind in [
            accepted.get_ref().1.handshake_kind(),
            dialed.get_ref().1.handshake_kind(),
        ] {
            assert_eq!(kind, Some(rustls::HandshakeKind::Full), "attempt {attempt}");
        }
    }
}

#[tokio::test]
async fn plaintext_and_garbage_cost_a_tls_node_only_that_connection() {
    use tracing_subscriber::layer::SubscriberExt;
    // This test's tasks run on its one thread: their logs come here.
    let captured = crate::util::warn_limit::capture::Captured::default();
    let _logs =
        tracing::subscriber::set_default(tracing_subscriber::registry().with(captured.clone()));
    let dir = tempfile::tempdir().expect("tempdir");
    let certs = pki(dir.path(), &["127.0.0.1", "127.0.0.1"]);
    // The secure node's handshake timeout is longer than the test's
    // patience: what closes a connection here is what it received.
    let secure = node_with(Some(&certs[0]), Duration::from_secs(60)).await;
    let friend = node(Some(&certs[1])).await;
    let plain = node(None).await;
    // A plaintext node's Hello is not a TLS ClientHello: the TLS node's
    // alert (a TLS record) tells the plaintext node that its peer speaks
    // TLS, instead of reading as a frame of hundreds of MiB.
    let refused = connect_error(&plain, &secure).await;
    assert_eq!(
        refused,
        ConnectError::Tls(super::handshake::PEER_SPEAKS_TLS.into()),
        "{refused}"
    );
    // A TLS client's ClientHello is not a frame to a plaintext node, which
    // answers in plaintext: the TLS node says that its peer speaks it.
    let refused = connect_error(&secure, &plain).await;
    assert_eq!(
        refused,
        ConnectError::Tls(super::tls::PEER_SPEAKS_PLAINTEXT.into()),
        "{refused}"
    );
    // The warnings say so too: the TLS node's, accepting the plaintext
    // Hello, and the plaintext node's (none an oversized frame). Those of an
    // acceptor come from its connection task: waited for (bounded), not
    // slept on.
    let warned = |text: &str| {
        captured
            .events()
            .into_iter()
            .any(|(level, fields)| level == tracing::Level::WARN && fields.contains(text))
    };
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while !(warned(super::tls::PEER_SPEAKS_PLAINTEXT) && warned(super::handshake::PEER_SPEAKS_TLS))
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{:?}",
            captured.events()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(!warned("exceeds"), "{:?}", captured.events());
    // Garbage before the TLS handshake: the node answers with at most an
    // alert and closes.
    let mut raw = TcpStream::connect(secure.bound_addr()).await.expect("tcp");
    raw.write_all(&[0x16, 0x03, 0x01, 0xff, 0xff, 1, 2, 3, 4, 5, 6, 7])
        .await
        .expect("write");
    let mut buf = [0u8; 256];
    let closed = tokio::time::timeout(PATIENCE, async {
        loop {
            match raw.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    });
    closed.await.expect("closed");
    assert!(secure.connected_peers().is_empty());
    round_trip(&friend, &secure)
        .await
        .expect("the node still serves its peers");
}

/// Connections from one source that stall their TLS handshake (half a
/// `ClientHello`, or nothing at all) hold at most
/// `max_inbound_handshakes_per_source` of the handshake permits; the rest
/// are closed at once, and a node from another source still gets its pipe
/// while they stall. (127.0.0.2 is another source on Linux's loopback.)
#[cfg(target_os = "linux")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_client_hellos_from_one_source_leave_room_for_others() {
    let dir = tempfile::tempdir().expect("tempdir");
    let certs = pki(dir.path(), &["127.0.0.1", "127.0.0.1"]);
    let mut c = plain_config();
    c.max_inbound_handshakes = 16;
    // The stalls outlast the test: only the bound per source makes room.
    c.handshake_timeout = Duration::from_secs(120);
    c.tls = Some(Tls::load(certs[0].clone()).expect("loads"));
    let per_source = c.max_inbound_handshakes_per_source;
    let secure = node_configured(c).await;
    let mut stalled = Vec::new();
    for i in 0..40 {
        let socket = tokio::net::TcpSocket::new_v4().expect("socket");
        socket
            .bind("127.0.0.2:0".parse().expect("literal"))
            .expect("a second source on the loopback");
        let mut tcp = socket.connect(secure.bound_addr()).await.expect("tcp");
        if i % 2 == 0 {
            // A ClientHello's record header and the start of its body.
            tcp.write_all(&[0x16, 0x03, 0x01, 0x02, 0x00, 0x01, 0x00, 0x01])
                .await
                .expect("write");
        }
        stalled.push(tcp);
    }
    // Accepted after all of those (in order), a friend from 127.0.0.1 finds
    // a permit free.
    let friend = node(Some(&certs[1])).await;
    round_trip(&friend, &secure)
        .await
        .expect("a node from another source gets its pipe while they stall");
    // The source's first connections hold their handshakes; the others were
    // closed at once (the stalls' timeout is far away).
    let mut buf = [0u8; 64];
    for (i, tcp) in stalled.iter_mut().enumerate().skip(per_source) {
        let closed = tokio::time::timeout(PATIENCE, async {
            loop {
                match tcp.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {}
                }
            }
        });
        closed
            .await
            .unwrap_or_else(|_| panic!("connection {i} was not closed"));
    }
    for (i, tcp) in stalled.iter().enumerate().take(per_source) {
        let open =
            matches!(tcp.try_read(&mut buf), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock);
        assert!(open, "connection {i} still waits for its handshake");
    }
}

#[test]
fn bad_files_are_refused_with_the_file_named() {
    let dir = tempfile::tempdir().expect("tempdir");
    let certs = pki(dir.path(), &["127.0.0.1", "127.0.0.1"]);
    let missing = TlsConfig::new(
        dir.path().join("nope.pem"),
        &certs[0].private_key,
        &certs[0].ca_roots,
    );
    match Tls::load(missing).expect_err("refused") {
        TlsError::Read { path, .. } => assert!(path.ends_with("nope.pem")),
        other => panic!("{other:?}"),
    }
    let not_pem = TlsConfig::new(
        &certs[0].cert_chain,
        &certs[0].private_key,
        &certs[1].private_key,
    );
    assert!(matches!(Tls::load(not_pem), Err(TlsError::Pem { .. })));
    // Node 0's certificate with node 1's key.
    let mismatched = TlsConfig::new(
        &certs[0].cert_chain,
        &certs[1].private_key,
        &certs[0].ca_roots,
    );
    match Tls::load(mismatched).expect_err("refused") {
        TlsError::Certificate { path, .. } => assert_eq!(path, certs[1].private_key),
        other => panic!("{other:?}"),
    }
    // A certificate from another CA than the roots.
    let other = pki(&dir.path().join("other"), &["127.0.0.1"]);
    let foreign = TlsConfig::new(
        &other[0].cert_chain,
        &other[0].private_key,
        &certs[0].ca_roots,
    );
    match Tls::load(foreign).expect_err("refused") {
        TlsError::Certificate { path, reason } => {
            assert_eq!(path, other[0].cert_chain);
            assert!(reason.contains("UnknownIssuer"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        Tls::load(certs[0].clone().with_peer_name("not a name")),
        Err(TlsError::PeerName(_))
    ));
}

#[tokio::test]
async fn an_expired_certificate_is_refused_by_name_at_load_and_by_peers() {
    use tracing_subscriber::layer::SubscriberExt;
    // This test's tasks run on its one thread: their logs come here.
    let captured = crate::util::warn_limit::capture::Captured::default();
    let _logs =
        tracing::subscriber::set_default(tracing_subscriber::registry().with(captured.clone()));
    let dir = tempfile::tempdir().expect("tempdir");
    let good = pki(&dir.path().join("good"), &["127.0.0.1", "127.0.0.1"]);
    // Valid for five seconds from now (and since a minute ago); X.509
    // times are whole seconds, so at least four.
    let issued = tokio::time::Instant::now();
    let short = generate_test_certificates(
        &dir.path().join("short"),
        &["127.0.0.1"],
        Duration::from_secs(5),
    )
    .expect("certificates");
    // Both CAs in one bundle, trusted by every node here.
    let bundle = dir.path().join("both.pem");
    let pem = |p: &Path| std::fs::read(p).expect("read");
    std::fs::write(
        &bundle,
        [pem(&good[0].ca_roots), pem(&short[0].ca_roots)].concat(),
    )
    .expect("write");
    let trusting = |c: &TlsConfig| TlsConfig::new(&c.cert_chain, &c.private_key, &bundle);
    let short_lived = trusting(&short[0]);
    let (a, b) = (
        node(Some(&short_lived)).await,
        node(Some(&trusting(&good[0]))).await,
    );
    round_trip(&a, &b).await.expect("valid for now");
    // Past the end of the validity (and the second X.509 rounds to).
    tokio::time::sleep_until(issued + Duration::from_millis(6_200)).await;
    match Tls::load(short_lived).expect_err("expired") {
        TlsError::Certificate { path, reason } => {
            assert_eq!(path, short[0].cert_chain);
            assert!(reason.contains("expired"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
    // A node whose certificate expired while it ran is refused by a peer
    // (which says why in its alert), whichever side dials.
    let c = node(Some(&trusting(&good[1]))).await;
    for refused in [connect_error(&a, &c).await, connect_error(&c, &a).await] {
        match refused {
            ConnectError::Tls(why) => assert!(why.contains("xpired"), "{why}"),
            other => panic!("{other:?}"),
        }
    }
    // The node whose certificate expired says so, naming the file.
    let warned = captured.events().into_iter().any(|(level, fields)| {
        level == tracing::Level::WARN
            && fields.contains("no longer valid")
            && fields.contains(&short[0].cert_chain.display().to_string())
    });
    assert!(warned, "{:?}", captured.events());
    // The established pipe between a and b is unaffected: TLS checked the
    // certificates once, at its handshake.
    let peer = a.connected_peers()[0];
    let answer = a
        .request(&peer, CH, Bytes::from_static(b"old"), PATIENCE)
        .await;
    assert_eq!(&answer.expect("the old pipe still works")[..], b"old");
}

#[tokio::test]
async fn replaced_files_are_used_by_new_connections_and_old_pipes_keep_working() {
    let dir = tempfile::tempdir().expect("tempdir");
    let first = pki(&dir.path().join("first"), &["127.0.0.1", "127.0.0.1"]);
    let second = pki(&dir.path().join("second"), &["127.0.0.1", "127.0.0.1"]);
    // a's files live where they can be replaced.
    let live = dir.path().join("live");
    std::fs::create_dir(&live).expect("mkdir");
    let a_files = TlsConfig::new(
        live.join("a.pem"),
        live.join("a-key.pem"),
        live.join("ca.pem"),
    );
    let install = |from: &TlsConfig| {
        for (src, dst) in [
            (&from.cert_chain, &a_files.cert_chain),
            (&from.private_key, &a_files.private_key),
            (&from.ca_roots, &a_files.ca_roots),
        ] {
            // Written aside, then renamed over: never half a file.
            let tmp = dst.with_extension("tmp");
            std::fs::copy(src, &tmp).expect("copy");
            std::fs::rename(&tmp, dst).expect("rename");
        }
    };
    install(&first[0]);
    let a = node(Some(&a_files)).await;
    let old_friend = node(Some(&first[1])).await;
    let new_friend = node(Some(&second[1])).await;
    round_trip(&old_friend, &a).await.expect("first CA");
    assert!(matches!(
        connect_error(&new_friend, &a).await,
        ConnectError::Tls(_)
    ));

    install(&second[0]);
    // The next connection sees the new files without a restart.
    round_trip_eventually(&new_friend, &a)
        .await
        .expect("second CA, after the reload");
    // The pipe made under the first certificates goes on.
    let peer = old_friend.connected_peers()[0];
    let answer = old_friend
        .request(&peer, CH, Bytes::from_static(b"still"), PATIENCE)
        .await
        .expect("old pipe");
    assert_eq!(&answer[..], b"still");
    // A change that does not load keeps the current material in use.
    std::fs::write(&a_files.cert_chain, b"half a file").expect("write");
    let third = node(Some(&second[1])).await;
    round_trip(&third, &a)
        .await
        .expect("the previous material stays");
}
