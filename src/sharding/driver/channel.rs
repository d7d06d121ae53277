//! The control channel: a peer's message (or this node's own, handled at
//! once) goes to the coordinator core, the region side or a stats request;
//! the coordinator core's commands go out on the pipes.

use std::collections::VecDeque;
use std::time::Instant;

use bytes::Bytes;

use crate::identity::UniqueAddress;
use crate::sharding::coordinator::Command;
use crate::sharding::wire::{ActiveCoordinator, ControlMsg};
use crate::wire::channels::SHARDING_CONTROL;

use super::Control;
use super::stats_requests::hosted_shards;

impl Control {
    pub(super) fn handle(&mut self, from: UniqueAddress, msg: ControlMsg) {
        let mut queue = VecDeque::from([(from, msg)]);
        while let Some((from, msg)) = queue.pop_front() {
            let now = Instant::now();
            let commands = match msg {
                ControlMsg::Register { types, epoch } => {
                    self.core.observe_epoch(epoch);
                    self.core.register(now, from, &types)
                }
                ControlMsg::Unregister { types } => self.core.unregister(now, from, &types),
                ControlMsg::GetHome {
                    type_name,
                    shard,
                    generation,
                } => self.core.get_home(now, from, &type_name, shard, generation),
                ControlMsg::ShardStopped {
                    type_name,
                    shard,
                    generation,
                } => self
                    .core
                    .shard_stopped(now, from, &type_name, shard, generation),
                ControlMsg::Leave { types } => self.core.leave(now, from, &types),
                ControlMsg::GetStats { id, type_name } => {
                    let region = self.region(&type_name);
                    let msg = ControlMsg::Stats {
                        id,
                        region: region.is_some(),
                        shards: region.as_deref().map(hosted_shards).unwrap_or_default(),
                        coordinator: self
                            .core
                            .activity(now)
                            .map(|(epoch, allocating)| ActiveCoordinator { epoch, allocating }),
                    };
                    self.send_remote(from, &msg);
                    Vec::new()
                }
                ControlMsg::Stats {
                    id,
                    region,
                    shards,
                    coordinator,
                } => {
                    self.stats_answer(from, id, region, shards, coordinator);
                    Vec::new()
                }
                msg @ (ControlMsg::Home { .. }
                | ControlMsg::Table { .. }
                | ControlMsg::HandOff { .. }
                | ControlMsg::Left { .. }
                | ControlMsg::Refused { .. }) => {
                    if !self.side.hears(from) {
                        tracing::debug!(node = %self.me, %from, "a home from a node that is not the coordinator here: ignored");
                    } else if !self.core.accept_epoch(&msg) {
                        // Fencing (SPEC §13.15): a coordinator of an older
                        // term. Register again, carrying the higher epoch, so
                        // that it takes one above it if it is still in charge.
                        tracing::debug!(node = %self.me, %from, epoch = ?msg.coordinator_epoch(), highest = self.core.highest_epoch(), "a coordinator message from an older epoch: ignored");
                        self.side.older_epoch();
                    } else {
                        self.side.coordinator_said(from, msg, &self.hosted());
                    }
                    Vec::new()
                }
            };
            for command in commands {
                match command {
                    Command::Send { to, msg } if to == self.me => queue.push_back((to, msg)),
                    Command::Send { to, msg } => self.send_remote(to, &msg),
                }
            }
        }
        self.publish_rounds();
    }

    pub(super) fn send(&mut self, to: UniqueAddress, msg: ControlMsg) {
        if to == self.me {
            self.handle(to, msg);
        } else {
            self.send_remote(to, &msg);
        }
    }

    pub(super) fn send_remote(&self, to: UniqueAddress, msg: &ControlMsg) {
        let payload = Bytes::from(msg.encode());
        if let Err(error) = self.node.transport().send(&to, SHARDING_CONTROL, payload) {
            tracing::debug!(%to, reason = %error.reason, "sharding control message not sent");
        }
    }

    pub(super) fn execute(&mut self, commands: Vec<Command>) {
        for command in commands {
            match command {
                Command::Send { to, msg } => self.send(to, msg),
            }
        }
        self.publish_rounds();
    }
}
