//! The guide's counter: shared by the quickstart, tests and benches (included
//! with `#[path]`, so that they all use the crate's own types).

use datum_cluster_sharding::prelude::*;

/// Adds to the counter.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Add(pub u64);

/// Reads the counter.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Get;

protocol! {
    /// A counter entity.
    pub protocol Counter = "counter" {
        tell Add;
        ask Get -> u64;
    }
}

/// The counter's state.
#[derive(Debug, Default)]
pub struct CounterEntity {
    /// The sum of everything added.
    pub total: u64,
}

impl Entity for CounterEntity {
    type Protocol = Counter;
}

impl Handler<Add> for CounterEntity {
    async fn handle(&mut self, msg: Add, _ctx: &EntityContext) -> ShardingResult<()> {
        self.total += msg.0;
        Ok(())
    }
}

/// The total moves with its shard (`datum-node --counter` registers it
/// `.migratable()`): a handoff or a rolling restart keeps it.
impl Migratable for CounterEntity {
    type Dehydrated = u64;
    fn dehydrate(&mut self) -> u64 {
        self.total
    }
    fn rehydrate(&mut self, total: u64) {
        self.total = total;
    }
}

impl Handler<Get> for CounterEntity {
    async fn handle(&mut self, _msg: Get, _ctx: &EntityContext) -> ShardingResult<u64> {
        Ok(self.total)
    }
}

/// A sharded system on cluster node `node`, configured by `config`,
/// hosting the counter (the multi-node tests' and examples' setup).
#[allow(dead_code)] // not every program that includes this file forms a cluster
pub async fn counters_on(
    node: &datum_cluster_sharding::cluster::ClusterNode,
    config: ShardingConfig,
) -> ShardingResult<ShardedSystem> {
    let system = ShardedSystem::builder()
        .config(config)
        .node(node.clone())
        .start()
        .await?;
    system
        .entity_type::<CounterEntity>()
        .register(|_| CounterEntity::default())
        .await?;
    Ok(system)
}
