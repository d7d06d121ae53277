//! A refused handshake is logged with `tracing::warn!`. Its own test binary:
//! it installs a process-wide subscriber that records warnings.

use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use datum_cluster_sharding::transport::{ConnectError, Transport, TransportConfig};
use datum_cluster_sharding::wire::{Frame, FrameCodec, PROTOCOL_VERSION, RejectReason};
use futures_util::{SinkExt, StreamExt};
use tokio_util::codec::Framed;
use tracing::field::{Field, Visit};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::layer::{Context, Layer, SubscriberExt};

#[derive(Clone, Default)]
struct Warnings(Arc<Mutex<Vec<String>>>);

struct Render(String);

impl Visit for Render {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.push_str(&format!("{}={:?} ", field.name(), value));
    }
}

impl<S: Subscriber> Layer<S> for Warnings {
    fn on_event(&self, event: &Event<'_>, _: Context<'_, S>) {
        if *event.metadata().level() == Level::WARN {
            let mut r = Render(String::new());
            event.record(&mut r);
            self.0.lock().expect("lock").push(r.0);
        }
    }
}

/// The process-wide recorder, installed by whichever test runs first.
fn warnings() -> Warnings {
    static W: OnceLock<Warnings> = OnceLock::new();
    W.get_or_init(|| {
        let warnings = Warnings::default();
        tracing::subscriber::set_global_default(
            tracing_subscriber::registry().with(warnings.clone()),
        )
        .expect("first subscriber");
        warnings
    })
    .clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_handshakes_are_logged_as_warnings() {
    let warnings = warnings();

    let a = Transport::bind(TransportConfig::new("logged", "one"))
        .await
        .expect("bind");
    let wrong_name = Transport::bind(TransportConfig::new("other", "one"))
        .await
        .expect("bind");
    let wrong_secret = Transport::bind(TransportConfig::new("logged", "two"))
        .await
        .expect("bind");
    let patience = Duration::from_secs(10);

    let err = tokio::time::timeout(patience, wrong_name.connect(a.bound_addr()))
        .await
        .expect("in time");
    assert_eq!(err, Err(ConnectError::Rejected(RejectReason::WrongCluster)));
    let err = tokio::time::timeout(patience, wrong_secret.connect(a.bound_addr()))
        .await
        .expect("in time");
    assert_eq!(err, Err(ConnectError::Refused(RejectReason::BadProof)));

    // The acceptor's side of the refusal is logged by its connection task;
    // wait for it (bounded), without sleeping blindly.
    let logged = |needle: &str| {
        warnings
            .0
            .lock()
            .expect("lock")
            .iter()
            .any(|w| w.contains(needle))
    };
    let deadline = tokio::time::Instant::now() + patience;
    while !(logged("WrongCluster") && logged("BadProof")) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "warnings: {:?}",
            warnings.0.lock()
        );
        tokio::task::yield_now().await;
    }
    assert!(a.connected_peers().is_empty());
}

/// Anyone who can reach the port can get a handshake refused: a flood of
/// them yields a bounded number of warnings, not one each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_refused_handshakes_logs_a_bounded_number_of_warnings() {
    let warnings = warnings();
    let a = Transport::bind(TransportConfig::new("flooded", "one"))
        .await
        .expect("bind");
    let me = format!("local={}", a.local());
    let patience = Duration::from_secs(10);
    for _ in 0..50 {
        let stream = tokio::net::TcpStream::connect(a.bound_addr())
            .await
            .expect("tcp");
        let mut framed = Framed::new(stream, FrameCodec::default());
        let hello = Frame::Hello {
            version: PROTOCOL_VERSION,
            cluster: "not-flooded".into(),
            from: datum_cluster_sharding::identity::UniqueAddress::new_at(
                "127.0.0.1:9".parse().expect("literal"),
            ),
            nonce: bytes::Bytes::from(vec![1u8; 32]),
        };
        framed.send(hello).await.expect("hello");
        let reject = tokio::time::timeout(patience, framed.next())
            .await
            .expect("in time");
        assert!(
            matches!(
                reject,
                Some(Ok(Frame::Reject {
                    reason: RejectReason::WrongCluster
                }))
            ),
            "{reject:?}"
        );
        // The acceptor logs after sending the reject; wait for its close.
        let _ = tokio::time::timeout(patience, framed.next()).await;
    }
    let mine = warnings
        .0
        .lock()
        .expect("lock")
        .iter()
        .filter(|w| w.contains(&me))
        .count();
    assert!((1..=10).contains(&mine), "{mine} warnings for 50 refusals");
}

/// A TLS client at a plaintext node is named in the acceptor's warning as
/// what it is — a peer that speaks TLS — not as an oversized frame (its
/// `ClientHello`'s record header read as a length of hundreds of MiB).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_client_at_a_plaintext_node_is_named_in_the_warning() {
    use tokio::io::AsyncWriteExt;
    let warnings = warnings();
    let a = Transport::bind(TransportConfig::new("plain", "one"))
        .await
        .expect("bind");
    let me = format!("local={}", a.local());
    let mut raw = tokio::net::TcpStream::connect(a.bound_addr())
        .await
        .expect("tcp");
    raw.write_all(&[
        0x16, 0x03, 0x01, 0x00, 0xc8, 0x01, 0x00, 0x00, 0xc4, 0x03, 0x03,
    ])
    .await
    .expect("ClientHello");
    let mine = || -> Vec<String> {
        warnings
            .0
            .lock()
            .expect("lock")
            .iter()
            .filter(|w| w.contains(&me))
            .cloned()
            .collect()
    };
    // The acceptor logs from its connection task; wait for it (bounded),
    // without sleeping blindly.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while mine().is_empty() {
        assert!(tokio::time::Instant::now() < deadline, "no warning");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let logged = mine();
    assert!(
        logged
            .iter()
            .all(|w| w.contains("speaks TLS") && !w.contains("exceeds")),
        "{logged:?}"
    );
}
