//! Cluster membership: who is in the cluster, who is alive, who coordinates.
//!
//! This module is a *sans-IO* core. [`MembershipCore`] holds one node's view
//! and decides every transition; it never touches a socket, a clock or a
//! task. Its driver feeds it inputs, each with the current time, and carries
//! out the [`Command`]s it emits:
//!
//! ```text
//!   driver                                   MembershipCore
//!   ──────                                   ──────────────
//!   join(now, seeds) / leave(now) / down(now, m)  ──►
//!   handle_message(now, from, MembershipMsg)     ──►   decide, merge,
//!   handle_timeout(now) at poll_timeout()        ──►   detect, lead
//!   connection_lost(now, peer)  (advisory)       ──►
//!                                           ◄──  drain_commands():
//!                                                Send { to, msg }
//!                                                Publish(MembershipEvent)
//!                                                MarkDown(member)
//! ```
//!
//! After any input the driver drains the commands and re-arms a single timer
//! at [`MembershipCore::poll_timeout`]. Time is `std::time::Instant`, always
//! passed in, so tests run whole clusters on simulated time. The driver
//! should hand over inbound messages that are already queued *before* a due
//! `handle_timeout` (a biased `select!`, inbound first): after a stall of the
//! driver's own task, the detector must see the heartbeats that arrived
//! meanwhile, or it flags healthy peers.
//!
//! # Member states
//!
//! ```text
//!                  leave()            leader, converged   leader, converged
//!   Joining ───────────────► Leaving ─────────────────► Exiting ───────────► Removed
//!      │                       ▲  │                        │                    ▲
//!      │ leader, converged     │  │                        │                    │
//!      ▼            leave()    │  │                        │                    │
//!      Up ─────────────────────┘  │                        │                    │
//!      │                          │                        │                    │
//!      └──────────────┬───────────┴────────────────────────┘                    │
//!                     │ down(): timeout downing by the leader, or manual         │
//!                     ▼                                                          │
//!                   Down ───────────────────────────────────────────────────────┘
//!                              leader, converged among the others
//! ```
//!
//! Every step raises the status's rank ([`MemberStatus`] derives `Ord` in
//! that order), so a member's status only grows. Members are identified by
//! their full [`UniqueAddress`](crate::model::identity::UniqueAddress): a node
//! restarted at the same address is a *new* member, and when it joins, the
//! member that admits it downs the old incarnation.
//!
//! # Gossip and convergence
//!
//! Each node holds a [`Gossip`]: the member table (status per member) and a
//! reachability table (one row per observer, versioned, written only by that
//! observer). Merging takes the higher status per member and the newer row
//! per observer, which is commutative, associative and idempotent: any two
//! nodes that have received the same set of updates, in any order, hold the
//! same state. Dissemination goes to a few members, never to all: a node
//! that changes the state itself sends it to `gossip_fanout` random members
//! and the leader; a node that learns something by merge sends its digest
//! to as many and the leader; a gossip round (every `gossip_interval`)
//! sends the digest to `gossip_fanout` random members. A receiver whose
//! digest differs answers with its state (and a receiver of gossip that
//! knows more answers back). An idle cluster sends digests only.
//!
//! The **leader** is the oldest reachable Up or Leaving member (or, when none
//! exists, the oldest reachable live one — so the first node can move itself
//! Up). When the state has *converged* — every reachable live member has
//! reported the leader's exact digest — it moves Joining→Up, Leaving→Exiting,
//! Exiting→Removed and Down→Removed. Because merges only raise statuses, two
//! nodes that both believe they lead (during a partition) take decisions that
//! still merge consistently.
//!
//! # Failure detection and downing
//!
//! Each member is watched by `monitored_by` others: its predecessors on the
//! ring of live members sorted by age, not counting flagged ones (see
//! `ring.rs`). Every `heartbeat_interval` a member heartbeats its watchers
//! (and every observer that flags it); a watcher that hears nothing from a
//! member it watches for `heartbeat_interval + acceptable_heartbeat_pause`
//! marks it unreachable in its own reachability row (a deadline detector;
//! `SPEC.md` §10 says why not phi-accrual). A watcher that was itself
//! starved (its wake-up came late) gives the members it watches the time
//! back, up to the pause. A member is Unreachable when any live observer says
//! so, and Reachable again when every observer hears it again. The leader
//! downs a member that has been Unreachable for `downing_timeout`; with
//! `downing_timeout: None` only [`MembershipCore::down`] downs. With the
//! defaults a dead node is Down ≤ 600 ms after its last heartbeat.
//! Timeout downing is not a split-brain resolver: on both sides of a
//! partition the leader downs the other side.
//!
//! # Placement coordinator
//!
//! The oldest reachable Up member by `(incarnation, node_id)`;
//! see [`MembershipState::placement_coordinator`].
//!
//! # Example
//!
//! ```
//! use std::time::{Duration, Instant};
//! use datum_cluster_sharding::identity::{NodeId, UniqueAddress};
//! use datum_cluster_sharding::membership::*;
//!
//! let now = Instant::now();
//! let me = UniqueAddress { addr: "127.0.0.1:7000".parse().unwrap(), node_id: NodeId(1), incarnation: 1 };
//! let mut core = MembershipCore::new(me, MembershipConfig::default(), now).unwrap();
//! core.join(now, &[me.addr]).unwrap(); // the only seed: forms a cluster at once
//! assert_eq!(core.self_status(), Some(MemberStatus::Up));
//! assert!(core.state().is_placement_coordinator(NodeId(1)));
//! let published: Vec<Command> = core.drain_commands();
//! assert!(published.contains(&Command::Publish(MembershipEvent::MemberUp(me))));
//! assert_eq!(core.poll_timeout(), Some(now)); // first heartbeat round is due
//! core.handle_timeout(now + Duration::from_millis(1)).unwrap();
//! ```

mod config;
mod core;
mod error;
mod gossip;
mod protocol;
mod ring;
mod state;
mod status;

#[cfg(test)]
mod props;
#[cfg(test)]
mod sim;
#[cfg(test)]
mod tests;

pub use self::config::{MembershipConfig, SplitBrainStrategy};
pub use self::core::MembershipCore;
pub use self::error::MembershipError;
pub use self::gossip::Gossip;
pub use self::protocol::{Command, MembershipEvent, MembershipMsg, Target};
pub use self::state::{Member, MembershipState};
pub use self::status::MemberStatus;
