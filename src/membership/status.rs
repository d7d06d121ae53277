//! Member statuses and the legal transitions between them.

use serde::{Deserialize, Serialize};

/// The lifecycle status of one member, as recorded in the gossiped table.
///
/// The variants are declared in *rank* order, and the derived `Ord` follows
/// it: every legal transition goes from a lower rank to a higher one, so a
/// member's status only ever grows. That is what lets two tables be merged
/// by taking the higher status per member (see [`Gossip`](super::Gossip)).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum MemberStatus {
    /// Admitted by a member, not yet moved to Up by the leader.
    Joining,
    /// A full member: may host shards and be the placement coordinator.
    Up,
    /// Asked to leave gracefully; still serving while its shards hand off.
    Leaving,
    /// The leader has seen every member acknowledge the leave; about to go.
    Exiting,
    /// Declared dead (by timeout downing or by `down`); never comes back.
    Down,
    /// Gone from the cluster; kept as a tombstone so it is not resurrected.
    Removed,
}

impl MemberStatus {
    /// Whether a *decision* may move a member from `self` to `to` in one step.
    ///
    /// The legal steps are:
    /// `Joining→Up`, `Joining→Leaving`, `Up→Leaving`, `Leaving→Exiting`,
    /// `Exiting→Removed`, `Down→Removed`, and `→Down` from every live status
    /// (Joining, Up, Leaving, Exiting). A node that misses gossip may
    /// *observe* a longer jump (say Up→Removed); every upward jump is a
    /// chain of these steps, so observed histories stay monotone.
    pub fn can_transition_to(self, to: MemberStatus) -> bool {
        use MemberStatus::*;
        matches!(
            (self, to),
            (Joining, Up)
                | (Joining, Leaving)
                | (Up, Leaving)
                | (Leaving, Exiting)
                | (Exiting, Removed)
                | (Down, Removed)
                | (Joining | Up | Leaving | Exiting, Down)
        )
    }

    /// Whether the member still takes part (heartbeats, gossip, convergence):
    /// every status but Down and Removed.
    pub fn is_live(self) -> bool {
        !matches!(self, MemberStatus::Down | MemberStatus::Removed)
    }

    /// A small integer for this status, increasing along every transition.
    pub fn rank(self) -> u8 {
        match self {
            MemberStatus::Joining => 0,
            MemberStatus::Up => 1,
            MemberStatus::Leaving => 2,
            MemberStatus::Exiting => 3,
            MemberStatus::Down => 4,
            MemberStatus::Removed => 5,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::MemberStatus::{self, *};

    const ALL: [MemberStatus; 6] = [Joining, Up, Leaving, Exiting, Down, Removed];

    #[test]
    fn every_legal_step_increases_rank() {
        for from in ALL {
            for to in ALL {
                if from.can_transition_to(to) {
                    assert!(from.rank() < to.rank(), "{from:?}->{to:?}");
                    assert!(from < to, "{from:?}->{to:?}");
                }
            }
        }
    }

    #[test]
    fn every_upward_jump_is_a_chain_of_legal_steps() {
        // Reachability over the legal-step graph.
        for from in ALL {
            for to in ALL {
                if from.rank() >= to.rank() {
                    continue;
                }
                let mut frontier = vec![from];
                let mut found = false;
                while let Some(s) = frontier.pop() {
                    for n in ALL {
                        if s.can_transition_to(n) {
                            if n == to {
                                found = true;
                            }
                            frontier.push(n);
                        }
                    }
                }
                assert!(found, "no legal path {from:?}->{to:?}");
            }
        }
    }

    #[test]
    fn removed_is_terminal_and_removal_needs_exiting_or_down() {
        for to in ALL {
            assert!(!Removed.can_transition_to(to));
        }
        assert!(!Up.can_transition_to(Removed));
        assert!(!Joining.can_transition_to(Removed));
        assert!(!Leaving.can_transition_to(Removed));
        assert!(!Joining.can_transition_to(Exiting));
        assert!(!Down.can_transition_to(Up));
    }
}
