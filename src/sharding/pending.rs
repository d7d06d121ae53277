//! The asks this node sent to entities on other nodes and waits on, by ask
//! id, without their IO: who each waits on, and the deadlines the table
//! keeps for askers with no timer of their own. Generic over the reply
//! handle, so the runtime's [`Remote`](super::remote::Remote) (a oneshot
//! to the asker) and the cluster simulator (an ask's number) keep the same
//! table.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::model::error::ShardingError;
use crate::model::identity::UniqueAddress;
use crate::runtime::ask_waits::lower;
use crate::util::fast_hash::FastMap;

/// An ask sent to another node, waiting for its reply.
pub(crate) struct Pending<R> {
    /// The node it was sent to.
    pub(crate) node: UniqueAddress,
    pub(crate) type_name: &'static str,
    pub(crate) entity_id: Arc<str>,
    pub(crate) reply: R,
    /// For an asker waiting with no timer of its own: when, and after
    /// what timeout, this table answers `AskTimeout`.
    pub(crate) deadline: Option<(Instant, Duration)>,
}

impl<R> Pending<R> {
    /// The error for an ask its node stopped waiting on (it shuts down, or
    /// fenced itself): it was handed to a pipe, so it may have been
    /// processed — never `ShuttingDown`, which says it was not.
    pub(crate) fn in_flight(&self) -> ShardingError {
        ShardingError::ShutDownInFlight {
            type_name: self.type_name,
            entity_id: self.entity_id.to_string(),
        }
    }

    /// The error for an ask whose node is lost.
    pub(crate) fn peer_lost(&self) -> ShardingError {
        ShardingError::PeerLost {
            type_name: self.type_name,
            entity_id: self.entity_id.to_string(),
            node: self.node.to_string(),
        }
    }

    /// The error for an ask past the deadline the table kept.
    pub(crate) fn timed_out(&self) -> ShardingError {
        ShardingError::AskTimeout {
            type_name: self.type_name,
            entity_id: self.entity_id.to_string(),
            timeout: self.deadline.map_or(Duration::ZERO, |(_, t)| t),
        }
    }
}

/// A share of the pending asks (the runtime splits its table over several
/// locks, one such share each).
pub(crate) struct PendingStripe<R> {
    pub(crate) asks: FastMap<u64, Pending<R>>,
    /// How many of them have their deadline kept here.
    pub(crate) kept: usize,
    /// No ask whose deadline is kept here is due before this (`None`: none
    /// is kept): lowered as asks come, made exact when the stripe is
    /// checked, left as it is when an ask leaves while others are kept.
    /// [`expire`](Self::expire) passes over a stripe until it is due.
    pub(crate) due_from: Option<Instant>,
}

impl<R> Default for PendingStripe<R> {
    fn default() -> Self {
        PendingStripe {
            asks: FastMap::default(),
            kept: 0,
            due_from: None,
        }
    }
}

impl<R> PendingStripe<R> {
    pub(crate) fn insert(&mut self, ask_id: u64, pending: Pending<R>) {
        if let Some((at, _)) = pending.deadline {
            self.kept += 1;
            lower(&mut self.due_from, at);
        }
        let earlier = self.asks.insert(ask_id, pending);
        debug_assert!(earlier.is_none(), "ask id {ask_id} pending twice");
    }

    /// The ask `ask_id`, which leaves the table: its reply came, or it
    /// could not be sent.
    pub(crate) fn remove(&mut self, ask_id: u64) -> Option<Pending<R>> {
        let pending = self.asks.remove(&ask_id)?;
        if pending.deadline.is_some() {
            self.kept -= 1;
            if self.kept == 0 {
                self.due_from = None;
            }
        }
        Some(pending)
    }

    /// Removes the asks that `leaves` picks, and returns them.
    pub(crate) fn take(&mut self, leaves: impl Fn(&Pending<R>) -> bool) -> Vec<Pending<R>> {
        let ids: Vec<u64> = (self.asks.iter())
            .filter(|(_, p)| leaves(p))
            .map(|(id, _)| *id)
            .collect();
        ids.into_iter().filter_map(|id| self.remove(id)).collect()
    }

    /// Removes the asks whose kept deadline is past at `now` (to be
    /// answered `AskTimeout`), once the stripe is due.
    pub(crate) fn expire(&mut self, now: Instant) -> Vec<Pending<R>> {
        if self.due_from.is_none_or(|at| at > now) {
            return Vec::new();
        }
        let expired = self.take(|p| p.deadline.is_some_and(|(at, _)| at <= now));
        let deadlines = self.asks.values().filter_map(|p| p.deadline);
        self.due_from = deadlines.map(|(at, _)| at).min();
        expired
    }
}
