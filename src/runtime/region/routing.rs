//! Routing into the slots: messages (asks with their deadline), passivation
//! requests, and entities' stop notices, each under its shard's lock, with
//! what could not be delivered answered after it is released.

use std::sync::Arc;
use std::time::Duration;

use super::host::{AskDelivery, Host};
use super::{PassivationCause, Region};
use crate::entity::MigratedState;
use crate::model::envelope::LocalEnvelope;
use crate::model::error::ShardingResult;
use crate::model::extractor::ShardId;

impl Region {
    /// The fingerprint an envelope of message `index` carries: the
    /// protocol's up to that message's line.
    pub(crate) fn line_fingerprint(&self, index: u16) -> u64 {
        (self.lines.get(usize::from(index)).copied()).unwrap_or(self.fingerprint)
    }

    /// Routes one envelope to `entity_id` in `shard`. On error the envelope
    /// was not accepted; it is answered after the lock is released.
    pub(crate) fn deliver(
        &self,
        shard: ShardId,
        entity_id: &Arc<str>,
        envelope: LocalEnvelope,
    ) -> ShardingResult<()> {
        self.table
            .deliver(&mut self.host(), shard, entity_id, envelope)
    }

    /// [`deliver`](Self::deliver) of an ask made on this node whose
    /// envelope is guarded: true when it went to another node in this very
    /// call, its deadline with it — the pending-ask table then answers
    /// `AskTimeout` at `deadline`, and the asker needs no timer of its own.
    pub(crate) fn deliver_ask(
        &self,
        shard: ShardId,
        entity_id: &Arc<str>,
        envelope: LocalEnvelope,
        (deadline, timeout): (tokio::time::Instant, Duration),
    ) -> ShardingResult<bool> {
        let mut host = self.host();
        host.ask = Some(AskDelivery {
            deadline,
            timeout,
            forwarded: false,
        });
        self.table.deliver(&mut host, shard, entity_id, envelope)?;
        Ok(host.ask.is_some_and(|ask| ask.forwarded))
    }

    /// [`deliver`](Self::deliver) for an entity id that is not yet an
    /// `Arc<str>` (a remote envelope's): the common case — a live entity of
    /// a hosted shard — allocates nothing; anything else goes the general way.
    pub(crate) fn deliver_str(
        &self,
        shard: ShardId,
        entity_id: &str,
        envelope: LocalEnvelope,
    ) -> ShardingResult<()> {
        self.table
            .deliver_str(&mut self.host(), shard, entity_id, envelope)
    }

    /// Passivates `entity_id` — only `incarnation` if one is named (a request
    /// from the entity itself), else whichever is current. While the entity's
    /// messages still wait in a buffer (shard not yet allocated, or entity
    /// already passivating), the request is buffered behind them.
    pub(crate) fn passivate(
        &self,
        shard: ShardId,
        entity_id: &Arc<str>,
        incarnation: Option<u64>,
    ) -> ShardingResult<()> {
        self.passivate_from(shard, entity_id, incarnation, false)
    }

    /// An entity incarnation's own request: idle, or asked (its
    /// `ctx.passivate()`, or it retired itself).
    pub(crate) fn passivate_incarnation(
        &self,
        shard: ShardId,
        entity_id: &Arc<str>,
        incarnation: u64,
        idle: bool,
    ) -> ShardingResult<()> {
        let mut host = self.host();
        if idle {
            host.cause = PassivationCause::Idle;
        }
        self.passivate_by(host, shard, entity_id, Some(incarnation), false)
    }

    /// [`passivate`](Self::passivate); a request `from_remote` (another node
    /// sent it here) is not sent on again when the shard is not hosted here,
    /// so two disagreeing tables cannot bounce it between them.
    pub(crate) fn passivate_from(
        &self,
        shard: ShardId,
        entity_id: &Arc<str>,
        incarnation: Option<u64>,
        from_remote: bool,
    ) -> ShardingResult<()> {
        self.passivate_by(self.host(), shard, entity_id, incarnation, from_remote)
    }

    /// The slot's passivation, counted under `host`'s cause.
    fn passivate_by(
        &self,
        mut host: Host<'_>,
        shard: ShardId,
        entity_id: &Arc<str>,
        incarnation: Option<u64>,
        from_remote: bool,
    ) -> ShardingResult<()> {
        self.table
            .passivate(&mut host, shard, entity_id, incarnation, from_remote)
    }

    /// Incarnation `incarnation` of `entity_id` stopped (its stop notice, sent
    /// on every exit path): finish its passivation by replaying the messages
    /// buffered meanwhile, or forget a crashed incarnation.
    pub(crate) fn entity_stopped(
        &self,
        shard: ShardId,
        entity_id: &Arc<str>,
        incarnation: u64,
        state: Option<MigratedState>,
    ) {
        // Every actor spawned sends one stop notice: one fewer live
        // (counted first: answering what waited runs user `Drop` code).
        self.metrics.entities(-1);
        self.table
            .entity_stopped(&mut self.host(), shard, entity_id, incarnation, state);
    }
}
