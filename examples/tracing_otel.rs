//! Tracing across nodes with OpenTelemetry (SPEC §14.2): two nodes on
//! 127.0.0.1, a traced ask from one to an entity on the other, and the
//! spans of the trace printed as a tree.
//!
//! ```sh
//! cargo run --example tracing_otel
//! ```
//!
//! The spans go through `tracing-opentelemetry` into an OpenTelemetry SDK
//! tracer provider, here with an in-memory exporter so that the example
//! prints them. To send them to Jaeger, Tempo or any OTLP collector instead,
//! build the provider with `opentelemetry-otlp`'s span exporter
//! (`.with_batch_exporter(otlp_exporter)`); nothing else changes.

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
use counter::{Counter, Get};

const LONG: Duration = Duration::from_secs(20);

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // OpenTelemetry behind `tracing`: every `tracing` span becomes an
    // OpenTelemetry span.
    let exporter = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .build();
    let layer = tracing_opentelemetry::layer().with_tracer(provider.tracer("tracing-otel-example"));
    tracing::subscriber::set_global_default(tracing_subscriber::registry().with(layer))?;

    // Two nodes whose systems trace, through the OpenTelemetry propagation.
    let mut nodes = Vec::new();
    let mut systems = Vec::new();
    for i in 0..2 {
        let seeds = nodes
            .first()
            .map(ClusterNode::bound_addr)
            .into_iter()
            .collect();
        let config = ClusterConfig::builder()
            .cluster_name("tracing-example")
            .secret("example-secret")
            .seed_nodes(seeds)
            .build();
        let node = ClusterNode::start(config).await?;
        node.wait_until(|s| s.up_members().count() == i + 1, LONG)
            .await?;
        let mut sharding = ShardingConfig::builder().num_shards(16).build();
        sharding.tracing = Some(Tracing::new(otel::OtelPropagation));
        let system = counter::counters_on(&node, sharding).await?;
        nodes.push(node);
        systems.push(system);
    }
    nodes[0]
        .wait_until(|s| s.up_members().count() == 2, LONG)
        .await?;

    // Place some counters, then ask one that lives on the second node from
    // the first, inside a span of the application's own.
    for k in 0..16 {
        systems[0]
            .entity_ref::<Counter>(format!("c-{k}"))
            .ask(Get, LONG)
            .await?;
    }
    let remote = (0..16)
        .map(|k| format!("c-{k}"))
        .find(|id| {
            let shard = systems[0].entity_ref::<Counter>(id.clone()).shard_id();
            systems[1].live_entities::<Counter>(shard) > 0
        })
        .ok_or("no counter landed on the second node")?;
    let _ = provider.force_flush();
    exporter.reset();
    let request = tracing::info_span!("http.request", route = "/counters/{id}");
    let total = systems[0]
        .entity_ref::<Counter>(remote.clone())
        .ask(Get, LONG)
        .instrument(request)
        .await?;
    println!(
        "{remote} = {total}, asked from {} of {}",
        nodes[0].bound_addr(),
        nodes[1].bound_addr()
    );

    // The handler's span ends just after its reply: give it a moment.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let _ = provider.force_flush();
    print_tree(&exporter.get_finished_spans()?);
    for system in &systems {
        system.shutdown().await;
    }
    Ok(())
}

/// Prints every span as a tree under its parent, with its trace id.
fn print_tree(spans: &[SpanData]) {
    fn children(spans: &[SpanData], parent: &SpanData, depth: usize) {
        for child in spans
            .iter()
            .filter(|s| s.parent_span_id == parent.span_context.span_id())
        {
            println!(
                "{:indent$}{} (span {}{})",
                "",
                child.name,
                child.span_context.span_id(),
                if child.parent_span_is_remote {
                    ", remote parent"
                } else {
                    ""
                },
                indent = 2 * depth
            );
            children(spans, child, depth + 1);
        }
    }
    for root in spans.iter().filter(|s| s.name == "http.request") {
        println!("trace {}", root.span_context.trace_id());
        println!("  {} (span {})", root.name, root.span_context.span_id());
        children(spans, root, 2);
    }
}
