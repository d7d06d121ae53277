//! The cluster agent: membership run over authenticated node pipes.
//!
//! ```text
//!   ClusterNode (handle, cheap to clone)
//!     ├── Transport ── one authenticated TCP pipe per peer (crate::transport)
//!     │      channel 1: MembershipMsg, CBOR ──┐
//!     └── driver task ◄───────────────────────┘
//!            MembershipCore (sans-IO, crate::membership)
//!            inputs:  inbound messages, timer, leave/down requests
//!            outputs: Send → transport, MarkDown → transport,
//!                     Publish → event subscribers + the state watch
//! ```
//!
//! The driver owns the core and is the only place where its time advances:
//! it reads the clock, feeds the core, carries out the commands in order and
//! re-arms one timer at the core's `poll_timeout()`. Inbound messages are
//! served before a due timer (a `biased` select), so a stall of the driver
//! itself does not make healthy peers look silent.
//!
//! ```no_run
//! # use datum_cluster_sharding::cluster::{ClusterConfig, ClusterNode};
//! # async fn demo() -> Result<(), datum_cluster_sharding::cluster::ClusterError> {
//! let seed = ClusterNode::start(ClusterConfig::builder().cluster_name("orders-1").secret("s3cret").build()).await?;
//! let other = ClusterNode::start(
//!     ClusterConfig::builder()
//!         .cluster_name("orders-1")
//!         .secret("s3cret")
//!         .seed_nodes(vec![seed.bound_addr()])
//!         .build(),
//! )
//! .await?;
//! other.wait_until(|s| s.up_members().count() == 2, std::time::Duration::from_secs(10)).await?;
//! other.shutdown().await?; // graceful leave
//! # Ok(()) }
//! ```

mod config;
mod discovery;
mod node;

pub use config::ClusterConfig;
pub use discovery::{DiscoveryError, SeedDiscovery};
pub use node::{ClusterError, ClusterNode, JoinRefusal, MEMBERSHIP_CHANNEL};
