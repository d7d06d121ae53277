//! Preparing a shard's hosting here, without its IO: which word to host a
//! shard calls for a store read or a states pull before the install
//! ([`Preparing`]), and the states pulled from the old owner chunk by
//! chunk ([`StatesPull`]). The region actor and the cluster simulator run
//! these same rules; the reads, pulls and timers are theirs.

use std::collections::HashSet;

use super::ShardTable;
use crate::model::extractor::ShardId;
use crate::model::identity::UniqueAddress;
use crate::runtime::mailbox::States;

/// What a word to host a shard here calls for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum HostStep {
    /// Nothing: the region stopped, this hosting is being prepared
    /// already (it installs once ready), or the shard is installed under
    /// this generation or a later one.
    Nothing,
    /// Install it now: there is nothing to read or fetch.
    InstallNow,
    /// Read the remembered ids (of a remembered type) and pull the states
    /// kept on `fetch` (of a migratable type moved with a handoff), then
    /// install; [`Preparing::done`] once installed or given up.
    Prepare { fetch: Option<UniqueAddress> },
}

/// The hostings being prepared off the region actor (a store read, states
/// fetched from the old owner): a second word of the same hosting waits for
/// the first rather than start the shard without them.
#[derive(Default)]
pub(crate) struct Preparing(HashSet<(ShardId, u64)>);

/// A word to host a shard, as [`Preparing::begin`] reads it.
pub(crate) struct HostWord {
    pub(crate) shard: ShardId,
    pub(crate) generation: u64,
    /// The old owner that handed the shard off, if it did.
    pub(crate) from: Option<UniqueAddress>,
    /// The type migrates its entities' states.
    pub(crate) migrates: bool,
    /// The type remembers its entities.
    pub(crate) remembers: bool,
}

impl Preparing {
    /// What `word` calls for; and whether the shard moved here without a
    /// handoff although its type migrates (allocated before, its owner
    /// lost or its handoff timed out: no state comes), to be reported.
    pub(crate) fn begin<E: Clone>(
        &mut self,
        table: &ShardTable<E>,
        word: HostWord,
    ) -> (HostStep, bool) {
        let HostWord {
            shard,
            generation,
            from,
            migrates,
            remembers,
        } = word;
        if table.is_stopped()
            || self.0.contains(&(shard, generation))
            || table.hosts(shard, generation)
        {
            return (HostStep::Nothing, false);
        }
        let without_handoff = from.is_none() && generation > 1 && migrates;
        let fetch = from.filter(|_| migrates);
        if !remembers && fetch.is_none() {
            return (HostStep::InstallNow, without_handoff);
        }
        self.0.insert((shard, generation));
        (HostStep::Prepare { fetch }, without_handoff)
    }

    /// The hosting of `shard` under `generation` is prepared (installed or
    /// not).
    pub(crate) fn done(&mut self, shard: ShardId, generation: u64) {
        self.0.remove(&(shard, generation));
    }
}

/// A pull of a shard's migrated states from its old owner, chunk by chunk:
/// chunk 0 first, the next once one came, until the last (the puller then
/// tells the old owner it is done).
#[derive(Default)]
pub(crate) struct StatesPull {
    states: States,
    chunk: u32,
}

impl StatesPull {
    /// The chunk to ask for now.
    pub(crate) fn chunk(&self) -> u32 {
        self.chunk
    }

    /// How many states came so far.
    pub(crate) fn received(&self) -> usize {
        self.states.len()
    }

    /// The chunk asked for came: every state, once it was the `last`.
    pub(crate) fn got(&mut self, states: States, last: bool) -> Option<States> {
        self.states.extend(states);
        self.chunk += 1;
        last.then(|| std::mem::take(&mut self.states))
    }
}
