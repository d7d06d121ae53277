//! This node's own lifecycle and the cluster's admissions: joining through
//! seeds (or forming a cluster alone), leaving, manual downing, and a
//! member's answer to a joiner.

use std::net::SocketAddr;
use std::time::Instant;

use tracing::info;

use super::ticks::later;
use super::{MembershipCore, Phase};
use crate::membership::error::MembershipError;
use crate::membership::gossip::{Gossip, MemberKey};
use crate::membership::protocol::{Command, MembershipMsg, Target};
use crate::membership::status::MemberStatus;
use crate::model::identity::UniqueAddress;

impl MembershipCore {
    /// Starts joining through `seeds`.
    ///
    /// * No seed other than this node's own address: this node forms a new
    ///   cluster at once (and becomes Up and leader).
    /// * Otherwise a [`Join`](MembershipMsg::Join) goes to every other seed,
    ///   re-sent every `join_retry_interval` until one admits this node. If
    ///   this node's address is the *first* seed, it forms a new cluster by
    ///   itself after `seed_timeout` without an answer; other nodes never do.
    pub fn join(&mut self, now: Instant, seeds: &[SocketAddr]) -> Result<(), MembershipError> {
        match self.phase {
            Phase::Idle => {}
            Phase::Terminated => return Err(MembershipError::Terminated),
            Phase::Joining { .. } | Phase::Member => return Err(MembershipError::AlreadyJoining),
        }
        let mut others: Vec<SocketAddr> = Vec::new();
        for s in seeds {
            if *s != self.me.addr && !others.contains(s) {
                others.push(*s);
            }
        }
        if others.is_empty() {
            return self.self_join(now);
        }
        let first = seeds.first() == Some(&self.me.addr);
        self.phase = Phase::Joining {
            seeds: others,
            next_attempt: now,
            self_join_at: if first {
                now.checked_add(self.config.seed_timeout)
            } else {
                None
            },
        };
        self.send_joins(now);
        Ok(())
    }

    /// Starts joining through seeds that discovery will name
    /// ([`set_seeds`](Self::set_seeds)): until then nobody is asked, and
    /// the node does not form a cluster by itself.
    pub fn join_discovered(&mut self, now: Instant) -> Result<(), MembershipError> {
        match self.phase {
            Phase::Idle => {}
            Phase::Terminated => return Err(MembershipError::Terminated),
            Phase::Joining { .. } | Phase::Member => return Err(MembershipError::AlreadyJoining),
        }
        self.phase = Phase::Joining {
            seeds: Vec::new(),
            next_attempt: now,
            self_join_at: None,
        };
        Ok(())
    }

    /// While joining: the seeds are now `seeds` (this node's own address
    /// left out). A seed not asked before is asked at once. With `may_form`
    /// this node forms a new cluster by itself once `seed_timeout` passes
    /// without an admission (counted from the first such call); without
    /// it, it never does. A member ignores this.
    pub fn set_seeds(
        &mut self,
        now: Instant,
        seeds: &[SocketAddr],
        may_form: bool,
    ) -> Result<(), MembershipError> {
        let me = self.me.addr;
        let timeout = self.config.seed_timeout;
        let Phase::Joining {
            seeds: current,
            self_join_at,
            ..
        } = &mut self.phase
        else {
            return match self.phase {
                Phase::Idle => Err(MembershipError::NotAMember),
                Phase::Joining { .. } | Phase::Member | Phase::Terminated => Ok(()),
            };
        };
        let mut others: Vec<SocketAddr> = Vec::new();
        for s in seeds {
            if *s != me && !others.contains(s) {
                others.push(*s);
            }
        }
        let new = others.iter().any(|s| !current.contains(s));
        *current = others;
        match (may_form, *self_join_at) {
            (true, None) => *self_join_at = now.checked_add(timeout),
            (false, Some(_)) => *self_join_at = None,
            (true, Some(_)) | (false, None) => {}
        }
        if new {
            self.send_joins(now);
        }
        self.expected_wake = self.poll_timeout();
        Ok(())
    }

    /// Leaves gracefully: this node goes Leaving, then the leader moves it
    /// to Exiting and Removed once every member has seen each step. The node
    /// may shut down when it publishes `MemberRemoved` for itself (or
    /// `is_terminated()` turns true). Idempotent while leaving.
    pub fn leave(&mut self, now: Instant) -> Result<(), MembershipError> {
        match self.phase {
            Phase::Idle | Phase::Joining { .. } => return Err(MembershipError::NotAMember),
            Phase::Terminated => return Err(MembershipError::Terminated),
            Phase::Member => {}
        }
        match self.self_status() {
            Some(MemberStatus::Joining | MemberStatus::Up) => {
                self.decide(self.key, MemberStatus::Leaving)?;
                self.after_input(now).map(|_| ())
            }
            Some(MemberStatus::Leaving | MemberStatus::Exiting) => Ok(()),
            Some(MemberStatus::Down | MemberStatus::Removed) => Err(MembershipError::Terminated),
            None => Err(MembershipError::Bug(
                "member phase without an own entry".into(),
            )),
        }
    }

    /// Marks `node` Down (manual downing). Any member may down any live
    /// member, itself included. Downing a Down member is a no-op.
    pub fn down(&mut self, now: Instant, node: UniqueAddress) -> Result<(), MembershipError> {
        match self.phase {
            Phase::Idle | Phase::Joining { .. } => return Err(MembershipError::NotAMember),
            Phase::Terminated => return Err(MembershipError::Terminated),
            Phase::Member => {}
        }
        let key = MemberKey(node);
        match self.gossip.status(&key) {
            None => Err(MembershipError::UnknownMember(node)),
            Some(MemberStatus::Down) => Ok(()),
            Some(MemberStatus::Removed) => Err(MembershipError::IllegalTransition {
                member: node,
                from: MemberStatus::Removed,
                to: MemberStatus::Down,
            }),
            Some(
                MemberStatus::Joining
                | MemberStatus::Up
                | MemberStatus::Leaving
                | MemberStatus::Exiting,
            ) => {
                info!(member = %node, "manual down");
                self.decide(key, MemberStatus::Down)?;
                self.after_input(now).map(|_| ())
            }
        }
    }

    pub(super) fn self_join(&mut self, now: Instant) -> Result<(), MembershipError> {
        self.gossip.put_status(self.key, MemberStatus::Joining);
        self.phase = Phase::Member;
        self.next_heartbeat = now;
        self.next_gossip = now;
        self.dirty = true;
        self.push_pending = true;
        self.after_input(now).map(|_| ())
    }

    pub(super) fn send_joins(&mut self, now: Instant) {
        if let Phase::Joining {
            seeds,
            next_attempt,
            ..
        } = &mut self.phase
        {
            for s in seeds.iter() {
                self.commands.push(Command::Send {
                    to: Target::Seed(*s),
                    msg: MembershipMsg::Join,
                });
            }
            *next_attempt = later(now, self.config.join_retry_interval);
        }
    }

    pub(super) fn on_welcome(
        &mut self,
        now: Instant,
        from: UniqueAddress,
        gossip: Gossip,
    ) -> Result<(), MembershipError> {
        if gossip.status_of(&self.me).is_none() {
            // Not an admission of this identity (say, meant for an earlier
            // incarnation at this address): keep asking.
            return Ok(());
        }
        info!(me = %self.me, by = %from, "admitted to the cluster");
        self.seen.insert(MemberKey(from), gossip.digest());
        self.gossip = self.gossip.merge(&gossip);
        self.phase = Phase::Member;
        self.next_heartbeat = now;
        self.next_gossip = now;
        self.dirty = true;
        self.after_input(now).map(|_| ())
    }

    pub(super) fn on_join(
        &mut self,
        now: Instant,
        from: UniqueAddress,
    ) -> Result<(), MembershipError> {
        if !matches!(
            self.self_status(),
            Some(MemberStatus::Joining | MemberStatus::Up)
        ) || from.addr == self.me.addr
        {
            return Ok(());
        }
        let fk = MemberKey(from);
        match self.gossip.status(&fk) {
            Some(s) if s.is_live() => {
                // A retried join whose welcome was lost.
                self.send(
                    from,
                    MembershipMsg::Welcome {
                        gossip: self.gossip.clone(),
                    },
                );
                return Ok(());
            }
            Some(_) => return Ok(()), // Down or Removed: that identity is out for good.
            None => {}
        }
        let same_addr: Vec<MemberKey> = self
            .gossip
            .member_keys()
            .filter(|(k, s)| k.0.addr == from.addr && s.is_live())
            .map(|(k, _)| k)
            .collect();
        if same_addr.iter().any(|k| !k.0.is_older_than(&from)) {
            // A newer incarnation already holds the address: a stale joiner.
            return Ok(());
        }
        for old in same_addr {
            info!(old = %old.0, new = %from, "a new incarnation joins at the same address: downing the old one");
            self.decide(old, MemberStatus::Down)?;
        }
        info!(me = %self.me, joiner = %from, "admitting");
        self.gossip.put_status(fk, MemberStatus::Joining);
        self.dirty = true;
        self.push_pending = true;
        self.after_input(now)?;
        if !self.is_terminated() {
            self.send(
                from,
                MembershipMsg::Welcome {
                    gossip: self.gossip.clone(),
                },
            );
        }
        Ok(())
    }
}
