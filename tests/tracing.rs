//! Tracing across nodes (SPEC §14.2): an ask's span on the asker's node and
//! the handler's span on the entity's node belong to one OpenTelemetry
//! trace, through `tracing-opentelemetry` and an in-memory exporter. The
//! trace context crosses a real pipe between two nodes on 127.0.0.1.

use std::time::Duration;

use datum_cluster_sharding::cluster::{ClusterConfig, ClusterNode};
use datum_cluster_sharding::prelude::*;
use datum_cluster_sharding::telemetry::Tracing;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use tracing::Instrument;
use tracing_subscriber::layer::SubscriberExt;

#[path = "../protocols/counter.rs"]
mod counter;
#[path = "../protocols/otel.rs"]
mod otel;
use counter::{Add, Counter, Get};

const LONG: Duration = Duration::from_secs(20);

async fn node(seeds: Vec<std::net::SocketAddr>) -> ClusterNode {
    let config = ClusterConfig::builder()
        .cluster_name("tracing")
        .secret("tracing-secret")
        .seed_nodes(seeds)
        .build();
    ClusterNode::start(config).await.expect("node starts")
}

async fn counters(node: &ClusterNode, tracing: Option<Tracing>) -> ShardedSystem {
    let mut config = ShardingConfig::builder().num_shards(16).build();
    config.tracing = tracing;
    counter::counters_on(node, config)
        .await
        .expect("counters hosted")
}

fn named<'a>(spans: &'a [SpanData], name: &str) -> Vec<&'a SpanData> {
    spans.iter().filter(|s| s.name == name).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ask_and_its_handling_on_another_node_share_one_trace() {
    let exporter = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .build();
    let subscriber = tracing_subscriber::registry()
        .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("datum-test")));
    tracing::subscriber::set_global_default(subscriber).expect("the only subscriber");

    let a = node(vec![]).await;
    let b = node(vec![a.bound_addr()]).await;
    for n in [&a, &b] {
        n.wait_until(|s| s.up_members().count() == 2, LONG)
            .await
            .expect("both Up");
    }
    let on = Some(Tracing::new(otel::OtelPropagation));
    let system_a = counters(&a, on.clone()).await;
    let system_b = counters(&b, on).await;

    // Entities on both nodes; then one that lives on B and one on A.
    let ids: Vec<String> = (0..32).map(|i| format!("t-{i}")).collect();
    for id in &ids {
        system_a
            .entity_ref::<Counter>(id.clone())
            .tell(Add(1))
            .await
            .unwrap();
        assert_eq!(
            system_a
                .entity_ref::<Counter>(id.clone())
                .ask(Get, LONG)
                .await,
            Ok(1)
        );
    }
    let lives_on = |system: &ShardedSystem, id: &String| {
        let shard = system_a.entity_ref::<Counter>(id.clone()).shard_id();
        system.live_entities::<Counter>(shard) > 0
    };
    let remote = ids
        .iter()
        .find(|id| lives_on(&system_b, id))
        .expect("one on B");
    let local = ids
        .iter()
        .find(|id| lives_on(&system_a, id))
        .expect("one on A");
    let _ = provider.force_flush();
    exporter.reset();

    for id in [remote, local] {
        let request = tracing::info_span!("request", entity = id.as_str());
        let total = system_a
            .entity_ref::<Counter>(id.clone())
            .ask(Get, LONG)
            .instrument(request)
            .await;
        assert_eq!(total, Ok(1));
    }
    // The handler's span closes just after the reply is sent: wait for
    // each request's trace to hold its handling. (Spans of the asks before
    // may still close meanwhile: only the two requests' traces are read.)
    let deadline = std::time::Instant::now() + LONG;
    let spans = loop {
        let _ = provider.force_flush();
        let spans = exporter.get_finished_spans().expect("spans");
        let requests = named(&spans, "request");
        let handled = requests.iter().all(|r| {
            named(&spans, "datum.handle")
                .iter()
                .any(|h| h.span_context.trace_id() == r.span_context.trace_id())
        });
        if requests.len() == 2 && handled {
            let traces: Vec<_> = requests.iter().map(|r| r.span_context.trace_id()).collect();
            break spans
                .into_iter()
                .filter(|s| traces.contains(&s.span_context.trace_id()))
                .collect::<Vec<_>>();
        }
        assert!(std::time::Instant::now() < deadline, "spans: {spans:#?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let requests = named(&spans, "request");
    let asks = named(&spans, "datum.ask");
    let handles = named(&spans, "datum.handle");
    let receives = named(&spans, "datum.receive");
    assert_eq!(
        (asks.len(), receives.len(), handles.len()),
        (2, 1, 2),
        "{spans:#?}"
    );
    // Remote: request → datum.ask (A) → datum.receive (B, remote parent) →
    // datum.handle (B), one trace.
    let (receive, trace) = (receives[0], receives[0].span_context.trace_id());
    let ask = asks
        .iter()
        .find(|s| s.span_context.trace_id() == trace)
        .expect("its ask");
    let request = requests
        .iter()
        .find(|s| s.span_context.trace_id() == trace)
        .expect("its request");
    assert_eq!(ask.parent_span_id, request.span_context.span_id());
    assert_eq!(receive.parent_span_id, ask.span_context.span_id());
    assert!(
        receive.parent_span_is_remote,
        "the context came over the wire"
    );
    let handle = handles
        .iter()
        .find(|s| s.span_context.trace_id() == trace)
        .expect("its handling");
    assert_eq!(handle.parent_span_id, receive.span_context.span_id());
    // Local: request → datum.ask → datum.handle, on A, another trace.
    let other = asks
        .iter()
        .find(|s| s.span_context.trace_id() != trace)
        .unwrap();
    let handle = handles
        .iter()
        .find(|s| s.span_context.trace_id() == other.span_context.trace_id())
        .expect("the local handling");
    assert_eq!(handle.parent_span_id, other.span_context.span_id());
    assert!(!handle.parent_span_is_remote);

    // Off by default: a system without `tracing` makes no spans, and sends
    // no context.
    exporter.reset();
    let c = node(vec![a.bound_addr()]).await;
    c.wait_until(|s| s.up_members().count() == 3, LONG)
        .await
        .unwrap();
    let untraced = counters(&c, None).await;
    let before = std::time::SystemTime::now();
    untraced
        .entity_ref::<Counter>(local.clone())
        .ask(Get, LONG)
        .instrument(tracing::info_span!("untraced"))
        .await
        .expect("answered");
    let _ = provider.force_flush();
    let spans = exporter.get_finished_spans().expect("spans");
    // (Its ask went to an entity on A, which traces, but received no
    // context and so made no span either.)
    assert_eq!(named(&spans, "untraced").len(), 1);
    assert!(
        spans
            .iter()
            .all(|s| !s.name.starts_with("datum.") || s.start_time < before),
        "{spans:#?}"
    );
    for system in [untraced, system_a, system_b] {
        system.shutdown().await;
    }
}
