//! The core's outputs: messages to members, and the events and downings
//! published when this node's view changes.

use super::MembershipCore;
use crate::membership::gossip::MemberKey;
use crate::membership::protocol::{Command, MembershipEvent, MembershipMsg, Target};
use crate::membership::status::MemberStatus;
use crate::model::identity::UniqueAddress;

impl MembershipCore {
    pub(super) fn send(&mut self, to: UniqueAddress, msg: MembershipMsg) {
        self.commands.push(Command::Send {
            to: Target::Member(to),
            msg,
        });
    }

    /// Publishes every difference between the current view and the last
    /// published one; sends a last gossip to members that just went Down or
    /// Removed, then marks them down for the transport.
    pub(super) fn publish_changes(&mut self) {
        let unreachable = self.gossip.unreachable_keys();
        let mut newly_out: Vec<(MemberKey, bool)> = Vec::new();
        let current: Vec<(MemberKey, MemberStatus)> = self.gossip.member_keys().collect();
        for (k, status) in current {
            let prev = self.published.statuses.get(&k).copied();
            if prev == Some(status) {
                continue;
            }
            let m = k.0;
            let event = match (prev, status) {
                // A tombstone learnt on arrival: never seen live, nothing to say.
                (None, MemberStatus::Down | MemberStatus::Removed) => None,
                (_, MemberStatus::Joining) => Some(MembershipEvent::MemberJoined(m)),
                (_, MemberStatus::Up) => Some(MembershipEvent::MemberUp(m)),
                (_, MemberStatus::Leaving) => Some(MembershipEvent::MemberLeft(m)),
                (_, MemberStatus::Exiting) => Some(MembershipEvent::MemberExited(m)),
                (_, MemberStatus::Down) => Some(MembershipEvent::MemberDowned(m)),
                (Some(previous), MemberStatus::Removed) => Some(MembershipEvent::MemberRemoved {
                    member: m,
                    previous,
                }),
            };
            if let Some(e) = event {
                self.commands.push(Command::Publish(e));
            }
            if !status.is_live() && k != self.key && !self.marked_down.contains(&k) {
                newly_out.push((k, prev.is_some_and(|p| p.is_live())));
            }
            self.published.statuses.insert(k, status);
        }
        for k in unreachable.difference(&self.published.unreachable) {
            self.commands
                .push(Command::Publish(MembershipEvent::Unreachable(k.0)));
        }
        for k in self.published.unreachable.difference(&unreachable) {
            if self.gossip.status(k).is_some_and(|s| s.is_live()) {
                self.commands
                    .push(Command::Publish(MembershipEvent::Reachable(k.0)));
            }
        }
        let coordinator = self.coordinator_key(&unreachable).map(|k| k.0);
        if coordinator != self.published.coordinator {
            self.commands
                .push(Command::Publish(MembershipEvent::CoordinatorChanged(
                    coordinator,
                )));
            self.published.coordinator = coordinator;
        }
        self.published.unreachable = unreachable;
        for (k, was_live) in newly_out {
            if was_live {
                // Best effort: tell it its fate, so a wrongly downed node stops.
                self.send(
                    k.0,
                    MembershipMsg::Gossip {
                        gossip: self.gossip.clone(),
                    },
                );
            }
            self.commands.push(Command::MarkDown(k.0));
            self.marked_down.insert(k);
        }
    }
}
