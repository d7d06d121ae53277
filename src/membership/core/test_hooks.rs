//! Test-only access to the core's internals: where its heartbeats go, and a
//! member of an already formed cluster.

use std::time::Instant;

use super::{MembershipCore, Phase};
use crate::membership::config::MembershipConfig;
use crate::membership::gossip::Gossip;
use crate::model::identity::UniqueAddress;

impl MembershipCore {
    /// The former heartbeat targets still heartbeated, and until when.
    pub(crate) fn lingering_for_tests(&self) -> Vec<(UniqueAddress, Instant)> {
        self.lingering.iter().map(|(k, t)| (k.0, *t)).collect()
    }

    /// Where this node's heartbeats go.
    pub(crate) fn targets_for_tests(&self) -> Vec<UniqueAddress> {
        self.targets.iter().map(|k| k.0).collect()
    }

    /// A member of an already formed cluster holding `gossip` (simulations
    /// of large clusters). Its view is published silently.
    pub(crate) fn formed_for_tests(
        me: UniqueAddress,
        config: MembershipConfig,
        now: Instant,
        gossip: Gossip,
    ) -> Self {
        let mut core = MembershipCore::new(me, config, now).expect("valid config");
        core.gossip = gossip;
        core.phase = Phase::Member;
        core.dirty = true;
        core.after_input(now).expect("a formed state");
        core.commands.clear();
        core
    }
}
