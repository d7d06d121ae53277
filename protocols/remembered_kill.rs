//! One scenario for any remember-entities store that the nodes share (an
//! `InMemoryStore` clone in one process, a PostgreSQL database): three
//! clustered nodes on 127.0.0.1 host a remembered type; node 2 crashes;
//! each id it hosted must be respawned by a survivor, with no message sent.
//! Included with `#[path]` by the tests that run it.

#![allow(dead_code)]

use std::collections::BTreeSet;
use std::time::Duration;

use datum_cluster_sharding::cluster::{ClusterConfig, ClusterNode};
use datum_cluster_sharding::prelude::*;

#[derive(Serialize, Deserialize)]
pub struct Where;

protocol! {
    /// An entity that says which node hosts it.
    pub protocol Kept = "kept" {
        ask Where -> usize;
    }
}

struct KeptEntity {
    node: usize,
}

impl Entity for KeptEntity {
    type Protocol = Kept;
}

impl Handler<Where> for KeptEntity {
    async fn handle(&mut self, _: Where, _: &EntityContext) -> ShardingResult<usize> {
        Ok(self.node)
    }
}

/// Runs the scenario with `stores[i]` as node `i`'s store (three of them,
/// sharing what they remember).
pub async fn remembered_ids_come_back_after_a_kill<S: RememberEntitiesStore>(stores: [S; 3]) {
    let long = Duration::from_secs(30);
    let config = |seeds| {
        ClusterConfig::builder()
            .cluster_name("remembered-kill")
            .secret("remembered-kill-secret")
            .seed_nodes(seeds)
            .build()
    };
    let first = ClusterNode::start(config(vec![]))
        .await
        .expect("node starts");
    let mut clusters = vec![first.clone()];
    for _ in 1..3 {
        let node = ClusterNode::start(config(vec![first.bound_addr()]));
        clusters.push(node.await.expect("node starts"));
    }
    for c in &clusters {
        c.wait_until(|s| s.up_members().count() == 3, long)
            .await
            .expect("three Up");
    }
    let (started_tx, mut started) = tokio::sync::mpsc::unbounded_channel::<(usize, String)>();
    let mut systems = Vec::new();
    for (i, (cluster, store)) in clusters.iter().zip(stores).enumerate() {
        let system = ShardedSystem::builder()
            .num_shards(32)
            .node(cluster.clone())
            .store(store)
            .start()
            .await
            .expect("system starts");
        let tx = started_tx.clone();
        system
            .entity_type::<KeptEntity>()
            .remembered()
            .register(move |ctx| {
                let _ = tx.send((i, ctx.entity_id().to_owned()));
                KeptEntity { node: i }
            })
            .await
            .expect("registered");
        systems.push(system);
    }
    let mut on_victim = BTreeSet::new();
    for k in 0..40 {
        let id = format!("kept-{k}");
        let home = systems[0]
            .entity_ref::<Kept>(id.as_str())
            .ask(Where, Duration::from_secs(10))
            .await
            .expect("ask");
        if home == 2 {
            on_victim.insert(id);
        }
    }
    assert!(!on_victim.is_empty(), "node 2 hosts some");
    for system in &systems {
        system.flush_remember_entities().await.expect("flushed");
    }
    while started.try_recv().is_ok() {}
    clusters[2].crash().await;
    let mut back = BTreeSet::new();
    while !on_victim.is_subset(&back) {
        let (node, id) = tokio::time::timeout(long, started.recv())
            .await
            .expect("respawned in time")
            .expect("factories alive");
        assert_ne!(node, 2, "respawned on the dead node");
        back.insert(id);
    }
    for system in &systems {
        system.shutdown().await;
    }
    for cluster in &clusters[..2] {
        let _ = cluster.shutdown().await;
    }
}
