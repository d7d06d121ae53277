//! Stopping a region: refusing new messages, failing buffered ones, and
//! stopping (or killing) its entity actors and its region actor.

use std::time::Duration;

use ractor::{ActorCell, RactorErr};

use super::Region;

impl Region {
    pub(crate) fn is_stopped(&self) -> bool {
        self.table.is_stopped()
    }

    /// Refuses new messages from now on (`ShuttingDown`), before the
    /// actors are stopped by [`shutdown`](Self::shutdown).
    pub(crate) fn stop_accepting(&self) {
        self.table.stop_accepting();
    }

    /// Stops routing, fails every buffered message with `ShuttingDown`, and
    /// stops all entity actors, then the region actor (killing those that
    /// do not stop within the shutdown timeout).
    pub(crate) async fn shutdown(&self) {
        let (cells, finishing) = self.take_actors();
        let timeout = self.shutdown_timeout;
        let finish = finishing.into_iter().map(|c| finish_or_kill(c, timeout));
        let stop = cells.into_iter().map(|c| stop_or_kill(c, timeout));
        futures_util::future::join(
            futures_util::future::join_all(finish),
            futures_util::future::join_all(stop),
        )
        .await;
        if let Some(actor) = self.region_actor.get() {
            stop_or_kill(actor.get_cell(), timeout).await;
        }
        // Nothing is hosted or live here any more (stop notices that the
        // region actor no longer heard are not counted down).
        self.metrics.release();
    }

    /// What `shutdown` does, at once and without waiting: every actor is
    /// killed (no mailbox is finished). For a system dropped without
    /// `shutdown`, which stops like a crash.
    pub(crate) fn kill(&self) {
        self.metrics.release();
        let (cells, finishing) = self.take_actors();
        for cell in cells.into_iter().chain(finishing) {
            cell.kill();
        }
        if let Some(actor) = self.region_actor.get() {
            actor.get_cell().kill();
        }
    }

    /// Stops routing, fails every buffered message with `ShuttingDown`, and
    /// takes the entity actors out of the slots (remote homes are kept:
    /// envelopes that still arrive are forwarded), and apart from them the
    /// entities finishing after their shard moved away.
    fn take_actors(&self) -> (Vec<ActorCell>, Vec<ActorCell>) {
        let taken = self.table.take_all(&mut self.host());
        let cells = taken.entities.iter().map(|a| a.get_cell()).collect();
        let finishing = taken.finishing.iter().map(|a| a.get_cell()).collect();
        (cells, finishing)
    }
}

/// Waits up to `timeout` for an entity that is finishing its mailbox (its
/// stop marker is queued behind it), then kills it.
async fn finish_or_kill(cell: ActorCell, timeout: Duration) {
    if cell.wait(Some(timeout)).await.is_err() {
        tracing::warn!(actor = %cell.get_id(), ?timeout, "entity did not finish its mailbox in time; killing it");
        let _ = cell.kill_and_wait(Some(timeout)).await;
    }
}

/// Stops an actor after the message in hand; if that takes longer than
/// `timeout` (a handler that never returns), kills it, which abandons the
/// handler and drops its mailbox: the senders waiting there see the system
/// shutting down.
async fn stop_or_kill(cell: ActorCell, timeout: Duration) {
    if let Err(RactorErr::Timeout) = cell
        .stop_and_wait(Some("shutdown".into()), Some(timeout))
        .await
    {
        tracing::warn!(actor = %cell.get_id(), ?timeout, "actor did not stop in time; killing it");
        let _ = cell.kill_and_wait(Some(timeout)).await;
    }
}
