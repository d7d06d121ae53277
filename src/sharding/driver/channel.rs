//! The control channel: a peer's message (or this node's own) goes to the
//! control core, or, for the stats exchange, to the stats requests; the
//! control core's commands go out on the pipes, fail asks, or fence.

use std::time::Instant;

use bytes::Bytes;

use crate::model::identity::UniqueAddress;
use crate::sharding::control_core::ControlCommand;
use crate::sharding::wire::{ActiveCoordinator, ControlMsg};
use crate::wire::channels::SHARDING_CONTROL;

use super::Control;
use super::stats_requests::{StatsAnswer, ask_counts, hosted_shards};
use crate::telemetry::AskCounts;

impl Control {
    pub(super) fn handle(&mut self, from: UniqueAddress, msg: ControlMsg) {
        let now = Instant::now();
        match msg {
            ControlMsg::GetStats { id, type_name } => {
                let region = self.region(&type_name);
                let msg = ControlMsg::Stats {
                    id,
                    region: region.is_some(),
                    shards: region.as_deref().map(hosted_shards).unwrap_or_default(),
                    coordinator: self
                        .core
                        .coordinator()
                        .activity(now)
                        .map(|(epoch, allocating)| ActiveCoordinator { epoch, allocating }),
                    app_version: self.core.app_version().map(str::to_owned),
                    asks: region.as_deref().map(ask_counts),
                    roles: self.node.config().roles.iter().cloned().collect(),
                };
                self.send(from, msg);
            }
            ControlMsg::Stats {
                id,
                region,
                shards,
                coordinator,
                app_version,
                asks,
                roles,
            } => {
                let answer = StatsAnswer {
                    region,
                    shards,
                    coordinator,
                    app_version: app_version.and_then(|v| v.parse().ok()).unwrap_or_default(),
                    asks: asks.map(|a| AskCounts {
                        answered: a.answered,
                        failed: a.failed.into_iter().collect(),
                    }),
                    roles: roles.into_iter().collect(),
                };
                self.stats_answer(from, id, answer)
            }
            msg @ (ControlMsg::Register { .. }
            | ControlMsg::NeedsNewer { .. }
            | ControlMsg::Traffic { .. }
            | ControlMsg::Unregister { .. }
            | ControlMsg::GetHome { .. }
            | ControlMsg::ShardStopped { .. }
            | ControlMsg::Leave { .. }
            | ControlMsg::Home { .. }
            | ControlMsg::Table { .. }
            | ControlMsg::HandOff { .. }
            | ControlMsg::Left { .. }
            | ControlMsg::Refused { .. }) => {
                let commands = self.core.control(now, from, msg, &self.hosted());
                self.execute(commands);
            }
        }
    }

    /// `msg` to `to`: this node's own stats exchange is handled at once.
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

    /// Carries out the control core's commands.
    pub(super) fn execute(&mut self, commands: Vec<ControlCommand>) {
        for command in commands {
            match command {
                ControlCommand::Send { to, msg } => self.send_remote(to, &msg),
                ControlCommand::FailAsks(node) => {
                    let failed = self.remote.node_lost(&node);
                    tracing::debug!(node = %self.me, lost = %node, failed_asks = failed, "member gone");
                }
                ControlCommand::Fence => self.fence("this node was downed or removed"),
            }
        }
        self.publish_rounds();
    }
}
