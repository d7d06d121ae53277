//! The three in-process nodes a workload runs on: formed and warmed up
//! with the ping entity registered (remembered in a store, or not), and
//! stopped.

use std::sync::Arc;

use datum_cluster_sharding::prelude::*;
use datum_cluster_sharding::transport::Tls;

use super::harness::{self, Node, form_cluster, ping_factory, sharding_config, warm_up};
use super::ping::{Checks, PingEntity};

/// Three nodes with the ping entity registered, warmed up (timeout
/// downing if `timeout_downing`, else the project's default resolver).
pub(super) async fn cluster(
    name: &str,
    checks: &Arc<Checks>,
    timeout_downing: bool,
    tls: &[Tls],
) -> Result<Vec<Node>, Box<dyn std::error::Error>> {
    let (clusters, _) = harness::form_cluster_with(name, timeout_downing, tls).await?;
    let mut nodes = Vec::new();
    for cluster in clusters {
        let builder = ShardedSystem::builder().config(sharding_config());
        let system = builder.node(cluster.clone()).start().await?;
        system
            .entity_type::<PingEntity>()
            .register(ping_factory(checks.clone()))
            .await?;
        nodes.push(Node { cluster, system });
    }
    warm_up(&nodes).await?;
    Ok(nodes)
}

/// The same with the entity remembered in `store` (shared by the three).
pub(super) async fn remembered_cluster<S: RememberEntitiesStore + Clone>(
    name: &str,
    store: S,
    checks: &Arc<Checks>,
) -> Result<Vec<Node<S>>, Box<dyn std::error::Error>> {
    let (clusters, _) = form_cluster(name, false).await?;
    let mut nodes = Vec::new();
    for cluster in clusters {
        let builder = ShardedSystem::builder().config(sharding_config());
        let system = builder
            .node(cluster.clone())
            .store(store.clone())
            .start()
            .await?;
        system
            .entity_type::<PingEntity>()
            .remembered()
            .register(ping_factory(checks.clone()))
            .await?;
        nodes.push(Node { cluster, system });
    }
    warm_up(&nodes).await?;
    Ok(nodes)
}

pub(super) async fn stop<S, J>(nodes: Vec<Node<S, J>>) {
    for n in &nodes {
        n.system.shutdown().await;
    }
    for n in &nodes {
        let _ = n.cluster.shutdown().await;
    }
}
