//! A deterministic simulated cluster for membership tests.
//!
//! Drives N [`MembershipCore`]s over a fake network on simulated time: every
//! message gets a random delay (FIFO per directed link, as over TCP), may be
//! dropped, and links can be cut and healed; nodes can crash, restart under
//! a new identity at the same address, or stall (a delayed tokio task). All
//! randomness comes from one seed, so a failing history replays exactly.
//! The loop jumps straight to the next message or wake-up, and fails loudly
//! if a core keeps asking to be woken at the same instant.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use super::*;
use crate::model::identity::{NodeId, UniqueAddress};

/// splitmix64: tiny, seedable, good enough for fault injection.
#[derive(Clone, Debug)]
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Self {
        Rng(seed)
    }
    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in `0..n` (0 when n is 0).
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.next_u64() % n }
    }
}

/// One message on the wire.
#[derive(Clone, Debug)]
struct Envelope {
    from_slot: usize,
    from: UniqueAddress,
    to_slot: usize,
    to: Target,
    msg: MembershipMsg,
}

/// One simulated process slot (an address); it may host successive
/// incarnations.
pub(crate) struct SimNode {
    pub(crate) addr: SocketAddr,
    pub(crate) id: UniqueAddress,
    pub(crate) core: Option<MembershipCore>,
    /// Identities this node's transport has marked down.
    pub(crate) marked_down: Vec<UniqueAddress>,
    pub(crate) stalled_until: Option<Instant>,
}

/// An event as published, with who published it and when.
#[derive(Clone, Debug)]
pub(crate) struct Logged {
    pub(crate) at: Duration,
    pub(crate) observer: UniqueAddress,
    pub(crate) event: MembershipEvent,
}

/// The simulated cluster.
pub(crate) struct Sim {
    pub(crate) rng: Rng,
    pub(crate) start: Instant,
    pub(crate) now: Instant,
    pub(crate) config: MembershipConfig,
    pub(crate) nodes: Vec<SimNode>,
    in_flight: BTreeMap<(Instant, u64), Envelope>,
    seq: u64,
    link_clock: BTreeMap<(usize, usize), Instant>,
    cut: BTreeSet<(usize, usize)>,
    /// Probability of dropping a message, per mille.
    pub(crate) drop_per_mille: u64,
    /// Delay range of every message.
    pub(crate) min_delay: Duration,
    pub(crate) max_delay: Duration,
    /// Every event every node published, in order.
    pub(crate) log: Vec<Logged>,
    /// Every error a core returned (tests expect none).
    pub(crate) errors: Vec<(UniqueAddress, MembershipError)>,
    /// Identities that crashed (for "no false Down" checks).
    pub(crate) crashed: Vec<UniqueAddress>,
    /// Print every delivery and event to stderr (`MEMBERSHIP_SIM_TRACE=1`).
    trace: bool,
    /// Every running node's next wake-up, soonest first.
    timers: BTreeSet<(Instant, usize)>,
    timer_at: Vec<Option<Instant>>,
    by_addr: BTreeMap<SocketAddr, usize>,
    /// What each slot sent (counted when handed to the network, lost or not).
    pub(crate) sent: Vec<Sent>,
    /// Also count the CBOR size of every message sent (costs an encoding).
    pub(crate) count_bytes: bool,
    /// Messages that reach a stalled node are delivered this long after the
    /// stall ends, behind its timer: its pipes are still behind when its
    /// task resumes (a starved process), not only its task.
    pub(crate) io_lag: Duration,
    /// Nodes added or restarted from now on tick on one grid, `start` being
    /// the epoch ([`MembershipCore::align_ticks`]), as `datum-node`s do.
    pub(crate) align_ticks: bool,
}

/// Traffic counters of one slot.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Sent {
    pub(crate) messages: u64,
    pub(crate) bytes: u64,
    /// `Gossip` and `Welcome` messages (full states).
    pub(crate) states: u64,
}

impl Sim {
    pub(crate) fn new(seed: u64, config: MembershipConfig) -> Self {
        let start = Instant::now();
        Sim {
            rng: Rng::new(seed),
            start,
            now: start,
            config,
            nodes: Vec::new(),
            in_flight: BTreeMap::new(),
            seq: 0,
            link_clock: BTreeMap::new(),
            cut: BTreeSet::new(),
            drop_per_mille: 0,
            min_delay: Duration::from_micros(100),
            max_delay: Duration::from_millis(2),
            log: Vec::new(),
            errors: Vec::new(),
            crashed: Vec::new(),
            trace: std::env::var_os("MEMBERSHIP_SIM_TRACE").is_some(),
            timers: BTreeSet::new(),
            timer_at: Vec::new(),
            by_addr: BTreeMap::new(),
            sent: Vec::new(),
            count_bytes: false,
            io_lag: Duration::ZERO,
            align_ticks: false,
        }
    }

    /// A cluster of `n` members that is already formed: every core starts
    /// as a member holding the same state, all Up (for large clusters,
    /// whose joining one by one a test need not replay). Slot 0 is the
    /// oldest.
    pub(crate) fn formed(seed: u64, config: MembershipConfig, n: usize) -> Self {
        let mut sim = Sim::new(seed, config);
        let ids: Vec<UniqueAddress> = (0..n)
            .map(|slot| {
                let addr = SocketAddr::from(([127, 0, 0, 1], 7000 + slot as u16));
                UniqueAddress {
                    addr,
                    node_id: NodeId(sim.rng.next_u64()),
                    incarnation: 1_000_000 + slot as u64,
                }
            })
            .collect();
        let gossip = Gossip::formed_for_tests(&ids);
        for id in ids {
            let core =
                MembershipCore::formed_for_tests(id, sim.config.clone(), sim.now, gossip.clone());
            sim.push_node(id, core);
        }
        sim
    }

    fn push_node(&mut self, id: UniqueAddress, core: MembershipCore) -> usize {
        let slot = self.nodes.len();
        self.nodes.push(SimNode {
            addr: id.addr,
            id,
            core: Some(core),
            marked_down: Vec::new(),
            stalled_until: None,
        });
        self.by_addr.insert(id.addr, slot);
        self.timer_at.push(None);
        self.sent.push(Sent::default());
        self.retime(slot);
        slot
    }

    /// Re-files `slot`'s next wake-up after anything that may change it.
    fn retime(&mut self, slot: usize) {
        if let Some(old) = self.timer_at[slot].take() {
            self.timers.remove(&(old, slot));
        }
        let node = &self.nodes[slot];
        let t = node
            .core
            .as_ref()
            .and_then(|c| c.poll_timeout())
            .map(|t| node.stalled_until.map_or(t, |s| t.max(s)));
        if let Some(t) = t {
            self.timers.insert((t, slot));
            self.timer_at[slot] = Some(t);
        }
    }

    /// Traffic sent by every slot together so far.
    pub(crate) fn total_sent(&self) -> Sent {
        self.sent.iter().fold(Sent::default(), |a, b| Sent {
            messages: a.messages + b.messages,
            bytes: a.bytes + b.bytes,
            states: a.states + b.states,
        })
    }

    pub(crate) fn elapsed(&self) -> Duration {
        self.now - self.start
    }

    /// A core for a new process, on the shared tick grid if `align_ticks`.
    fn new_core(&self, id: UniqueAddress) -> MembershipCore {
        let mut core =
            MembershipCore::new(id, self.config.clone(), self.now).expect("valid config");
        if self.align_ticks {
            core.align_ticks(self.start, Duration::ZERO);
        }
        core
    }

    fn fresh_identity(&mut self, addr: SocketAddr) -> UniqueAddress {
        UniqueAddress {
            addr,
            node_id: NodeId(self.rng.next_u64()),
            incarnation: 1_000_000 + self.elapsed().as_millis() as u64,
        }
    }

    /// Adds a process at a fresh address (not yet joined); returns its slot.
    pub(crate) fn add_node(&mut self) -> usize {
        let slot = self.nodes.len();
        let addr = SocketAddr::from(([127, 0, 0, 1], 7000 + slot as u16));
        let id = self.fresh_identity(addr);
        let core = self.new_core(id);
        self.push_node(id, core)
    }

    pub(crate) fn addr(&self, slot: usize) -> SocketAddr {
        self.nodes[slot].addr
    }

    pub(crate) fn id(&self, slot: usize) -> UniqueAddress {
        self.nodes[slot].id
    }

    pub(crate) fn core(&self, slot: usize) -> &MembershipCore {
        self.nodes[slot].core.as_ref().expect("node is running")
    }

    /// Runs `f` on a node's core and routes what it emitted.
    fn with_core(
        &mut self,
        slot: usize,
        f: impl FnOnce(&mut MembershipCore, Instant) -> Result<(), MembershipError>,
    ) {
        let now = self.now;
        let Some(core) = self.nodes[slot].core.as_mut() else {
            return;
        };
        if let Err(e) = f(core, now) {
            self.errors.push((self.nodes[slot].id, e));
        }
        self.flush(slot);
        self.retime(slot);
    }

    pub(crate) fn join(&mut self, slot: usize, seeds: &[usize]) {
        let addrs: Vec<SocketAddr> = seeds.iter().map(|s| self.addr(*s)).collect();
        self.with_core(slot, |c, now| c.join(now, &addrs));
    }

    pub(crate) fn leave(&mut self, slot: usize) {
        self.with_core(slot, |c, now| c.leave(now));
    }

    pub(crate) fn down(&mut self, slot: usize, member: UniqueAddress) {
        self.with_core(slot, |c, now| c.down(now, member));
    }

    /// The process dies without a word; its in-flight outbound messages
    /// still arrive (they are on the wire).
    pub(crate) fn crash(&mut self, slot: usize) {
        if self.nodes[slot].core.take().is_some() {
            self.crashed.push(self.nodes[slot].id);
        }
        self.retime(slot);
    }

    /// A new process at the same address: new node id and incarnation.
    pub(crate) fn restart(&mut self, slot: usize, seeds: &[usize]) {
        self.crash(slot);
        let id = self.fresh_identity(self.nodes[slot].addr);
        let core = self.new_core(id);
        let node = &mut self.nodes[slot];
        node.id = id;
        node.core = Some(core);
        node.marked_down.clear();
        node.stalled_until = None;
        self.retime(slot);
        self.join(slot, seeds);
    }

    /// The node processes nothing (messages nor timers) for `d`.
    pub(crate) fn stall(&mut self, slot: usize, d: Duration) {
        self.nodes[slot].stalled_until = Some(self.now + d);
        self.retime(slot);
    }

    /// Cuts the link between `a` and `b` in both directions.
    pub(crate) fn cut(&mut self, a: usize, b: usize) {
        self.cut.insert((a, b));
        self.cut.insert((b, a));
    }

    /// Cuts the link from `from` to `to` only (`to` no longer hears `from`).
    pub(crate) fn cut_one_way(&mut self, from: usize, to: usize) {
        self.cut.insert((from, to));
    }

    /// Cuts every link of `slot`.
    pub(crate) fn isolate(&mut self, slot: usize) {
        for other in 0..self.nodes.len() {
            if other != slot {
                self.cut(slot, other);
            }
        }
    }

    pub(crate) fn heal_all(&mut self) {
        self.cut.clear();
    }

    fn flush(&mut self, slot: usize) {
        let observer = self.nodes[slot].id;
        let Some(core) = self.nodes[slot].core.as_mut() else {
            return;
        };
        for cmd in core.drain_commands() {
            match cmd {
                Command::Send { to, msg } => self.transmit(slot, to, msg),
                Command::Publish(event) => self.log.push(Logged {
                    at: self.now - self.start,
                    observer,
                    event,
                }),
                Command::MarkDown(m) => self.nodes[slot].marked_down.push(m),
            }
        }
    }

    fn slot_of(&self, addr: SocketAddr) -> Option<usize> {
        self.by_addr.get(&addr).copied()
    }

    fn transmit(&mut self, from_slot: usize, to: Target, msg: MembershipMsg) {
        let from = self.nodes[from_slot].id;
        let dst_addr = match to {
            Target::Member(m) => {
                if self.nodes[from_slot].marked_down.contains(&m) {
                    return; // the transport fails sends to a marked-down member
                }
                m.addr
            }
            Target::Seed(a) => a,
        };
        let Some(to_slot) = self.slot_of(dst_addr) else {
            return;
        };
        let sent = &mut self.sent[from_slot];
        sent.messages += 1;
        if matches!(
            msg,
            MembershipMsg::Gossip { .. } | MembershipMsg::Welcome { .. }
        ) {
            sent.states += 1;
        }
        if self.count_bytes {
            let mut bytes = Vec::new();
            ciborium::into_writer(&msg, &mut bytes).expect("encodable");
            self.sent[from_slot].bytes += bytes.len() as u64;
        }
        if self.cut.contains(&(from_slot, to_slot)) || self.rng.below(1000) < self.drop_per_mille {
            return;
        }
        let spread = self.max_delay.saturating_sub(self.min_delay).as_micros() as u64;
        let delay = self.min_delay + Duration::from_micros(self.rng.below(spread + 1));
        let link = (from_slot, to_slot);
        let mut at = self.now + delay;
        if let Some(prev) = self.link_clock.get(&link) {
            at = at.max(*prev);
        }
        self.link_clock.insert(link, at);
        self.seq += 1;
        self.in_flight.insert(
            (at, self.seq),
            Envelope {
                from_slot,
                from,
                to_slot,
                to,
                msg,
            },
        );
    }

    fn deliver(&mut self, env: Envelope) {
        let slot = env.to_slot;
        let node = &self.nodes[slot];
        if node.core.is_none()
            || self.cut.contains(&(env.from_slot, slot))
            || node.marked_down.contains(&env.from)
        {
            return;
        }
        if let Target::Member(m) = env.to
            && node.id != m
        {
            return; // meant for an earlier incarnation at this address
        }
        if let Some(until) = node.stalled_until
            && until > self.now
        {
            self.seq += 1;
            self.in_flight.insert((until + self.io_lag, self.seq), env);
            return;
        }
        if self.trace {
            eprintln!(
                "{:>10?} {} -> {}: {:?}",
                self.now - self.start,
                env.from,
                self.nodes[slot].id,
                env.msg
            );
        }
        let (from, msg) = (env.from, env.msg);
        self.with_core(slot, move |c, now| c.handle_message(now, from, msg));
    }

    /// The next instant something happens, and what.
    fn next_due(&self) -> Option<(Instant, Option<usize>)> {
        let msg = self.in_flight.keys().next().map(|(t, _)| (*t, None));
        let timer = self.timers.first().map(|(t, i)| (*t, Some(*i)));
        match (msg, timer) {
            (Some(m), Some(t)) => Some(if m.0 <= t.0 { m } else { t }),
            (m, t) => m.or(t),
        }
    }

    /// Processes one message or wake-up due no later than `deadline`.
    fn step(&mut self, deadline: Instant, same_instant: &mut u32) -> bool {
        let Some((t, who)) = self.next_due() else {
            return false;
        };
        if t > deadline {
            return false;
        }
        if t <= self.now {
            *same_instant += 1;
            assert!(
                *same_instant < 100_000,
                "livelock: the cluster never goes idle at {:?}",
                self.elapsed()
            );
        } else {
            *same_instant = 0;
            self.now = t;
        }
        match who {
            Some(slot) => self.with_core(slot, |c, now| c.handle_timeout(now)),
            None => {
                if let Some((_, env)) = self.in_flight.pop_first() {
                    self.deliver(env);
                }
            }
        }
        true
    }

    /// Runs the cluster for `d` of simulated time.
    pub(crate) fn run_for(&mut self, d: Duration) {
        let deadline = self.now + d;
        let mut same = 0;
        while self.step(deadline, &mut same) {}
        self.now = self.now.max(deadline);
    }

    /// Runs until `pred` holds (checked after every step) or `max` passes;
    /// returns how long it took.
    pub(crate) fn run_until(
        &mut self,
        max: Duration,
        mut pred: impl FnMut(&Sim) -> bool,
    ) -> Option<Duration> {
        let begin = self.now;
        let deadline = self.now + max;
        let mut same = 0;
        loop {
            if pred(self) {
                return Some(self.now - begin);
            }
            if !self.step(deadline, &mut same) {
                self.now = self.now.max(deadline);
                return pred(self).then(|| self.now - begin);
            }
        }
    }

    /// Like [`run_until`](Self::run_until), but checks `pred` only every
    /// `every` of simulated time (for predicates over large clusters);
    /// the time returned is rounded up to that step.
    pub(crate) fn run_until_every(
        &mut self,
        max: Duration,
        every: Duration,
        mut pred: impl FnMut(&Sim) -> bool,
    ) -> Option<Duration> {
        let begin = self.now;
        while self.now - begin < max {
            if pred(self) {
                return Some(self.now - begin);
            }
            self.run_for(every);
        }
        pred(self).then(|| self.now - begin)
    }

    // ---- views --------------------------------------------------------

    /// Slots running a core that is a member and not terminated.
    pub(crate) fn live_slots(&self) -> Vec<usize> {
        (0..self.nodes.len())
            .filter(|s| {
                self.nodes[*s].core.as_ref().is_some_and(|c| {
                    !c.is_terminated() && c.self_status().is_some_and(|st| st.is_live())
                })
            })
            .collect()
    }

    /// The status of `member` as `observer` sees it.
    pub(crate) fn status_at(&self, observer: usize, member: UniqueAddress) -> Option<MemberStatus> {
        self.nodes[observer]
            .core
            .as_ref()?
            .gossip()
            .status_of(&member)
    }

    /// Whether every live node other than `member` sees `member` with `status`.
    pub(crate) fn all_see(&self, member: UniqueAddress, status: MemberStatus) -> bool {
        self.live_slots()
            .into_iter()
            .filter(|s| self.id(*s) != member)
            .all(|s| self.status_at(s, member) == Some(status))
    }

    /// Whether every live node holds the same gossip.
    pub(crate) fn converged(&self) -> bool {
        let live = self.live_slots();
        live.windows(2)
            .all(|w| self.core(w[0]).gossip() == self.core(w[1]).gossip())
    }

    /// Events published by the current incarnation at `slot`.
    pub(crate) fn events_of(&self, slot: usize) -> Vec<MembershipEvent> {
        let id = self.id(slot);
        self.log
            .iter()
            .filter(|l| l.observer == id)
            .map(|l| l.event.clone())
            .collect()
    }

    /// A readable dump of every node's view, for assertion messages.
    pub(crate) fn dump(&self) -> String {
        let mut out = format!("t={:?}\n", self.elapsed());
        for (i, n) in self.nodes.iter().enumerate() {
            let _ = write!(out, "[{i}] {} ", n.id);
            match &n.core {
                None => out.push_str("crashed\n"),
                Some(c) => {
                    let st = c.state();
                    let _ = writeln!(
                        out,
                        "self={:?} term={} leader={:?} coord={:?}",
                        c.self_status(),
                        c.is_terminated(),
                        st.leader.map(|l| l.addr.port()),
                        st.coordinator.map(|l| l.addr.port())
                    );
                    for m in &st.members {
                        let _ = writeln!(out, "      {} {:?}", m.address, m.status);
                    }
                    for u in &st.unreachable {
                        let _ = writeln!(out, "      unreachable {u}");
                    }
                }
            }
        }
        if !self.errors.is_empty() {
            let _ = writeln!(out, "errors: {:?}", self.errors);
        }
        out
    }

    // ---- expectations (panic with a dump) -----------------------------

    /// Runs until every live node sees `member` with `status`; returns the
    /// time it took.
    #[track_caller]
    pub(crate) fn expect_all_see(
        &mut self,
        member: UniqueAddress,
        status: MemberStatus,
        within: Duration,
    ) -> Duration {
        match self.run_until(within, |s| s.all_see(member, status)) {
            Some(t) => t,
            None => panic!(
                "not every node saw {member} as {status:?} within {within:?}\n{}",
                self.dump()
            ),
        }
    }

    /// Runs until every live node holds the same gossip.
    #[track_caller]
    pub(crate) fn expect_converged(&mut self, within: Duration) {
        if self.run_until(within, |s| s.converged()).is_none() {
            panic!("no convergence within {within:?}\n{}", self.dump());
        }
    }

    /// Asserts that every live node agrees on `coordinator`.
    #[track_caller]
    pub(crate) fn expect_coordinator_everywhere(&self, coordinator: UniqueAddress) {
        for s in self.live_slots() {
            let c = self.core(s).state().placement_coordinator();
            assert_eq!(
                c,
                Some(coordinator),
                "node {s} sees coordinator {c:?}\n{}",
                self.dump()
            );
        }
    }

    /// Asserts no core returned an error.
    #[track_caller]
    pub(crate) fn expect_no_errors(&self) {
        assert!(self.errors.is_empty(), "core errors: {:?}", self.errors);
    }

    /// Asserts no event matching `pred` was ever published.
    #[track_caller]
    pub(crate) fn reject_event(&self, what: &str, pred: impl Fn(&Logged) -> bool) {
        if let Some(l) = self.log.iter().find(|l| pred(l)) {
            panic!("unexpected {what}: {l:?}\n{}", self.dump());
        }
    }

    /// Only crashed (or replaced) identities were ever flagged or downed.
    #[track_caller]
    pub(crate) fn expect_only_crashed_flagged(&self) {
        let crashed = &self.crashed;
        self.reject_event(
            "a live member flagged",
            |l| matches!(&l.event, MembershipEvent::Unreachable(m) if !crashed.contains(m)),
        );
        self.reject_event(
            "a live member downed",
            |l| matches!(&l.event, MembershipEvent::MemberDowned(m) if !crashed.contains(m)),
        );
    }
}
