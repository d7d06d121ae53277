//! What the coordinator core gives out: the commands its driver carries
//! out (the messages regions hear from it), and the records of the shards
//! it moved (why, from where to where, in which rebalance round).

use std::time::Instant;

use crate::model::extractor::ShardId;
use crate::model::identity::UniqueAddress;
use crate::sharding::wire::ControlMsg;

use super::ShardHome;

/// Why a shard moved.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum RebalanceReason {
    /// Its owner is no longer an eligible member (downed, exited, removed),
    /// or its owner's sharded system stopped. Never throttled.
    DeadOwner,
    /// Moved to spread load (after a node joined), by a handoff, at most
    /// `rebalance_per_round` per type per round.
    GracefulSpread,
    /// Moved by a handoff because its owner's system is shutting down
    /// gracefully (a graceful leave). Never throttled.
    GracefulLeave,
    /// Moved by a handoff to a node of the type's newest protocol version,
    /// because a message of a line its owner's version lacks reached it
    /// (SPEC §13.6). Never throttled.
    NewerVersion,
    /// Moved by a handoff toward the node its traffic goes to, by
    /// placement by traffic (SPEC §13.11), at most `max_moves` per round.
    Traffic,
}

/// One shard moved by the coordinator.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardMovement {
    /// The entity type.
    pub type_name: String,
    /// The shard.
    pub shard: ShardId,
    /// The previous owner.
    pub from: UniqueAddress,
    /// The new owner.
    pub to: UniqueAddress,
    /// The new allocation's generation.
    pub generation: u64,
}

/// The moves the coordinator made for one reason at one moment: the
/// dead-owner moves of one change, or the handoffs one decision started
/// (recorded when the last of them ends, with those that completed; `at`
/// is the decision's time; a handoff that times out is recorded as a
/// DeadOwner round of its own).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RebalanceRound {
    /// When (the `now` the core was given).
    pub at: Instant,
    /// Why.
    pub reason: RebalanceReason,
    /// What moved.
    pub moves: Vec<ShardMovement>,
}

/// What the core asks its driver to do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Command {
    /// Send `msg` to `to` on the control channel (to this node itself: hand
    /// it to the local regions).
    Send { to: UniqueAddress, msg: ControlMsg },
}

pub(super) fn left_msg(to: UniqueAddress, type_name: &str, nowhere: bool, epoch: u64) -> Command {
    Command::Send {
        to,
        msg: ControlMsg::Left {
            type_name: type_name.to_owned(),
            nowhere,
            epoch,
        },
    }
}

pub(super) fn handoff_msg(type_name: &str, shard: u32, home: ShardHome, epoch: u64) -> Command {
    Command::Send {
        to: home.owner,
        msg: ControlMsg::HandOff {
            type_name: type_name.to_owned(),
            shard,
            generation: home.generation,
            epoch,
        },
    }
}

pub(super) fn movement(
    type_name: &str,
    shard: u32,
    from: UniqueAddress,
    home: ShardHome,
) -> ShardMovement {
    ShardMovement {
        type_name: type_name.to_owned(),
        shard: ShardId(shard),
        from,
        to: home.owner,
        generation: home.generation,
    }
}
