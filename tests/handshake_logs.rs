//! A refused handshake is logged with `tracing::warn!`. Its own test binary:
//! it installs a process-wide subscriber that records warnings.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use datum_cluster_sharding::transport::{ConnectError, Transport, TransportConfig};
use datum_cluster_sharding::wire::RejectReason;
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_handshakes_are_logged_as_warnings() {
    let warnings = Warnings::default();
    tracing::subscriber::set_global_default(tracing_subscriber::registry().with(warnings.clone()))
        .expect("first subscriber");

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
