//! The deadlines of asks waiting on this node for an entity here, or for a
//! buffer to let their envelope go (SPEC §13.5): one table per system,
//! checked by one task, instead of a runtime timer armed and cancelled
//! per ask.
//!
//! An asker whose reply has not come by its first poll enters the table
//! with its deadline and its waker, and leaves it when the reply comes or
//! it stops waiting. The task marks the entries past their deadline every
//! [`CHECK_EVERY`] and wakes their askers, who then answer `AskTimeout` to
//! their callers; it sleeps only while the table is empty (an entry
//! expired and not yet taken by its asker counts). So an ask fails at
//! most about that late, as one kept by the pending table of remote asks
//! does. Each stripe knows a time before which none of its deadlines
//! falls, and a check passes over it until then: a check costs a lock per
//! stripe, however many asks wait.
//!
//! The checking task is [`keep_deadlines`], over any table that is
//! [`Deadlines`]: the sharding layer's pending remote asks are one too.
//!
//! A thread enters its asks in a stripe of its own (of [`STRIPES`]), so
//! the entries of one worker thread's askers share neither lock nor cache
//! line with another's. Measured (BENCHMARKS.md, "Handling futures"): a runtime
//! timer per ask was about 3 % of W1-sat's time, the third of its asks
//! that go to an entity on the asking node paying all of it.

use std::cell::Cell;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

use crate::util::fast_hash::FastMap;

/// How often the table is checked while it holds a deadline: an ask
/// fails at most about this long after its deadline.
pub(crate) const CHECK_EVERY: Duration = Duration::from_millis(5);

/// How many stripes the table is split into.
const STRIPES: usize = 16;

/// Lowers `bound` (a time before which no deadline falls; `None`: no
/// deadline) to `at`, if `at` is earlier.
pub(crate) fn lower(bound: &mut Option<Instant>, at: Instant) {
    *bound = Some(bound.map_or(at, |b| b.min(at)));
}

/// Why an ask stopped waiting without its reply.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Expired {
    /// Its deadline passed.
    TimedOut,
    /// The task that keeps the deadlines stopped (its runtime went away).
    Stopped,
}

/// The asks waiting on this node and their deadlines.
pub(crate) struct AskWaits {
    stripes: [Stripe; STRIPES],
    /// The checking task runs: only then are deadlines entered (read under
    /// a stripe's lock when an entry is made).
    keeping: AtomicBool,
    /// Wakes the checking task when a stripe gets its first entry, or when
    /// the table is dropped.
    wake: Arc<Notify>,
}

/// One lock's share of the table, alone on its cache lines.
#[repr(align(128))]
#[derive(Default)]
struct Stripe(Mutex<Entries>);

#[derive(Default)]
struct Entries {
    waiting: FastMap<u64, Entry>,
    /// The id of the next entry (ids are per stripe).
    next: u64,
    /// No entry still waiting has a deadline before this (`None`: none is
    /// known to): lowered as entries come, made exact when the stripe is
    /// checked, left as it is when an entry leaves. The checking task
    /// passes over a stripe until it is due, so a check costs a lock per
    /// stripe, not a look at every waiting ask.
    due_from: Option<Instant>,
}

struct Entry {
    deadline: Instant,
    state: State,
}

enum State {
    Waiting(Waker),
    Expired(Expired),
}

/// Where an asker's entry is.
#[derive(Clone, Copy, Debug)]
struct Key {
    stripe: usize,
    id: u64,
}

fn lock(stripe: &Stripe) -> MutexGuard<'_, Entries> {
    stripe.0.lock().unwrap_or_else(|p| p.into_inner())
}

/// This thread's stripe, chosen at its first ask.
fn my_stripe() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static MINE: Cell<Option<usize>> = const { Cell::new(None) };
    }
    MINE.with(|mine| match mine.get() {
        Some(stripe) => stripe,
        None => {
            let stripe = NEXT.fetch_add(1, Ordering::Relaxed) % STRIPES;
            mine.set(Some(stripe));
            stripe
        }
    })
}

impl AskWaits {
    pub(crate) fn new() -> Arc<Self> {
        Arc::new(AskWaits {
            stripes: Default::default(),
            keeping: AtomicBool::new(false),
            wake: Arc::new(Notify::new()),
        })
    }

    /// Waits for `reply` until `deadline`: its output, or why it stopped
    /// waiting first. Without the checking task, a runtime timer keeps the
    /// deadline.
    pub(crate) fn wait<F: Future + Unpin>(&self, reply: F, deadline: Instant) -> AskWait<'_, F> {
        AskWait {
            waits: self,
            reply,
            deadline,
            kept: Kept::NotYet,
        }
    }

    /// Enters a deadline and the waker to wake at it; `None` when no task
    /// checks the table.
    fn enter(&self, deadline: Instant, waker: &Waker) -> Option<Key> {
        let stripe = my_stripe();
        let mut entries = lock(&self.stripes[stripe]);
        if !self.keeping.load(Ordering::Acquire) {
            return None;
        }
        let id = entries.next;
        entries.next += 1;
        let state = State::Waiting(waker.clone());
        entries.waiting.insert(id, Entry { deadline, state });
        lower(&mut entries.due_from, deadline);
        let first = entries.waiting.len() == 1;
        drop(entries);
        if first {
            // The task may be asleep on an empty table.
            self.wake.notify_one();
        }
        Some(Key { stripe, id })
    }

    /// Whether the entry at `key` is still waiting (its waker now
    /// `waker`), or why not (and then it is gone).
    fn check(&self, key: Key, waker: &Waker) -> Result<(), Expired> {
        let mut entries = lock(&self.stripes[key.stripe]);
        match entries.waiting.get_mut(&key.id).map(|e| &mut e.state) {
            Some(State::Waiting(kept)) => {
                if !kept.will_wake(waker) {
                    kept.clone_from(waker);
                }
                Ok(())
            }
            Some(State::Expired(why)) => {
                let why = *why;
                entries.waiting.remove(&key.id);
                Err(why)
            }
            // Not reached: only the asker removes its entry once it is in.
            None => Err(Expired::Stopped),
        }
    }

    /// The asker at `key` stops waiting.
    fn leave(&self, key: Key) {
        let gone = lock(&self.stripes[key.stripe]).waiting.remove(&key.id);
        // Its waker is dropped outside the lock.
        drop(gone);
    }
}

impl Drop for AskWaits {
    /// The checking task, asleep on an empty table, wakes to find it gone.
    fn drop(&mut self) {
        self.wake.notify_one();
    }
}

/// A table of deadlines that one task checks every [`CHECK_EVERY`]: the
/// asks waiting here, and the sharding layer's pending remote asks.
pub(crate) trait Deadlines: Send + Sync + 'static {
    /// The task starts: from now on the table keeps deadlines. Returns
    /// what wakes the task when it sleeps.
    fn start_keeping(&self) -> Arc<Notify>;
    /// Acts on every deadline past at `now`. Returns 0 when the task may
    /// sleep until woken.
    fn expire(&self, now: Instant) -> usize;
    /// The task stopped (aborted, or its runtime gone): no deadline is
    /// kept any more, and what the table kept must not wait for ever.
    fn stop_keeping(&self);
}

/// Checks `table` every [`CHECK_EVERY`] while it keeps a deadline (asleep
/// while it keeps none), until it is dropped.
pub(crate) async fn keep_deadlines<T: Deadlines>(table: Weak<T>) {
    let Some(wake) = table.upgrade().map(|t| t.start_keeping()) else {
        return;
    };
    // Aborted, or its runtime gone.
    struct Stop<T: Deadlines>(Weak<T>);
    impl<T: Deadlines> Drop for Stop<T> {
        fn drop(&mut self) {
            if let Some(table) = self.0.upgrade() {
                table.stop_keeping();
            }
        }
    }
    let _stop = Stop(table.clone());
    loop {
        let kept = match table.upgrade() {
            Some(table) => table.expire(Instant::now()),
            None => return,
        };
        if kept == 0 {
            wake.notified().await;
        } else {
            tokio::time::sleep(CHECK_EVERY).await;
        }
    }
}

impl Deadlines for AskWaits {
    fn start_keeping(&self) -> Arc<Notify> {
        self.keeping.store(true, Ordering::Release);
        self.wake.clone()
    }

    /// Marks every entry past its deadline at `now` and wakes its asker.
    /// Returns how many entries the table holds (0: it is empty).
    fn expire(&self, now: Instant) -> usize {
        let mut kept = 0;
        let mut due = Vec::new();
        for stripe in &self.stripes {
            let mut entries = lock(stripe);
            // Every entry counts, the expired ones whose askers have yet to
            // take them too: the task sleeps only on an empty table, so
            // the entry that makes a stripe non-empty is the one that
            // wakes it.
            kept += entries.waiting.len();
            if entries.due_from.is_none_or(|at| at > now) {
                continue;
            }
            let mut due_from: Option<Instant> = None;
            for entry in entries.waiting.values_mut() {
                if !matches!(entry.state, State::Waiting(_)) {
                    continue;
                }
                if entry.deadline > now {
                    lower(&mut due_from, entry.deadline);
                    continue;
                }
                if let State::Waiting(waker) =
                    std::mem::replace(&mut entry.state, State::Expired(Expired::TimedOut))
                {
                    due.push(waker);
                }
            }
            entries.due_from = due_from;
        }
        due.into_iter().for_each(Waker::wake);
        kept
    }

    /// The checking task stopped: no deadline is entered any more, and the
    /// askers waiting stop with [`Expired::Stopped`]. (An entry is made
    /// under its stripe's lock after reading `keeping`, which this takes
    /// after clearing it: each entry is either seen here or sees the flag
    /// cleared.)
    fn stop_keeping(&self) {
        self.keeping.store(false, Ordering::Release);
        let mut woken = Vec::new();
        for stripe in &self.stripes {
            let mut entries = lock(stripe);
            let waiting = entries
                .waiting
                .values_mut()
                .filter(|entry| matches!(entry.state, State::Waiting(_)));
            for entry in waiting {
                if let State::Waiting(waker) =
                    std::mem::replace(&mut entry.state, State::Expired(Expired::Stopped))
                {
                    woken.push(waker);
                }
            }
        }
        woken.into_iter().for_each(Waker::wake);
    }
}

/// An asker's wait: see [`AskWaits::wait`].
pub(crate) struct AskWait<'a, F> {
    waits: &'a AskWaits,
    reply: F,
    deadline: Instant,
    kept: Kept,
}

/// Who keeps an [`AskWait`]'s deadline.
enum Kept {
    /// Nobody yet: the reply has not been waited for.
    NotYet,
    /// The table, at this key.
    Table(Key),
    /// A runtime timer (no task checks the table); boxed, as the rare case.
    Timer(Pin<Box<tokio::time::Sleep>>),
    /// The wait is over.
    Done,
}

impl<F: Future + Unpin> Future for AskWait<'_, F> {
    type Output = Result<F::Output, Expired>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        if let Poll::Ready(reply) = Pin::new(&mut this.reply).poll(cx) {
            if let Kept::Table(key) = std::mem::replace(&mut this.kept, Kept::Done) {
                this.waits.leave(key);
            }
            return Poll::Ready(Ok(reply));
        }
        let expired = match &mut this.kept {
            Kept::NotYet => match this.waits.enter(this.deadline, cx.waker()) {
                Some(key) => {
                    this.kept = Kept::Table(key);
                    None
                }
                None => {
                    let mut timer = Box::pin(tokio::time::sleep_until(this.deadline));
                    let elapsed = timer.as_mut().poll(cx).is_ready();
                    this.kept = Kept::Timer(timer);
                    elapsed.then_some(Expired::TimedOut)
                }
            },
            Kept::Table(key) => this.waits.check(*key, cx.waker()).err(),
            Kept::Timer(timer) => timer
                .as_mut()
                .poll(cx)
                .is_ready()
                .then_some(Expired::TimedOut),
            Kept::Done => None,
        };
        match expired {
            Some(why) => {
                // A table entry that expired is gone already.
                this.kept = Kept::Done;
                Poll::Ready(Err(why))
            }
            None => Poll::Pending,
        }
    }
}

impl<F> Drop for AskWait<'_, F> {
    /// A caller that stops waiting leaves the table.
    fn drop(&mut self) {
        if let Kept::Table(key) = self.kept {
            self.waits.leave(key);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::sync::oneshot;

    use super::*;

    /// A table whose checking task runs on the test's runtime.
    async fn kept_table() -> Arc<AskWaits> {
        let waits = AskWaits::new();
        tokio::spawn(keep_deadlines(Arc::downgrade(&waits)));
        // The task has marked the table kept once it first ran.
        while !waits.keeping.load(Ordering::Acquire) {
            tokio::task::yield_now().await;
        }
        waits
    }

    fn entries(waits: &AskWaits) -> usize {
        waits.stripes.iter().map(|s| lock(s).waiting.len()).sum()
    }

    #[tokio::test]
    async fn a_reply_in_time_is_the_output_and_leaves_no_entry() {
        let waits = kept_table().await;
        let (tx, rx) = oneshot::channel::<u32>();
        let deadline = Instant::now() + Duration::from_secs(30);
        let waiting = tokio::spawn({
            let waits = waits.clone();
            async move { waits.wait(rx, deadline).await }
        });
        // Event-driven: the asker has entered the table.
        while entries(&waits) == 0 {
            tokio::task::yield_now().await;
        }
        tx.send(7).unwrap();
        assert_eq!(waiting.await.unwrap().unwrap(), Ok(7));
        assert_eq!(entries(&waits), 0);
    }

    #[tokio::test]
    async fn no_reply_times_out_soon_after_the_deadline() {
        let waits = kept_table().await;
        let (_tx, rx) = oneshot::channel::<u32>();
        let began = Instant::now();
        let timeout = Duration::from_millis(50);
        let out = waits.wait(rx, began + timeout).await;
        assert!(matches!(out, Err(Expired::TimedOut)), "{out:?}");
        assert!(began.elapsed() >= timeout);
        assert_eq!(entries(&waits), 0);
    }

    #[tokio::test]
    async fn a_dropped_wait_leaves_the_table() {
        let waits = kept_table().await;
        let (_tx, rx) = oneshot::channel::<u32>();
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut wait = Box::pin(waits.wait(rx, deadline));
        assert!(futures_util::poll!(wait.as_mut()).is_pending());
        assert_eq!(entries(&waits), 1);
        drop(wait);
        assert_eq!(entries(&waits), 0);
    }

    fn expired(waits: &AskWaits) -> usize {
        let expired = |e: &Entry| matches!(e.state, State::Expired(_));
        let stripes = waits.stripes.iter();
        stripes
            .map(|s| lock(s).waiting.values().filter(|e| expired(e)).count())
            .sum()
    }

    /// An ask that enters a stripe still holding an expired entry its
    /// asker has not taken yet is kept all the same (the task must not
    /// sleep on a table that is not empty).
    #[tokio::test]
    async fn an_entry_beside_an_expired_one_still_times_out() {
        let waits = kept_table().await;
        let (_tx_a, rx_a) = oneshot::channel::<u32>();
        let mut a = Box::pin(waits.wait(rx_a, Instant::now() + Duration::from_millis(10)));
        assert!(futures_util::poll!(a.as_mut()).is_pending());
        while expired(&waits) == 0 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        // The task has had its turn after marking A; B enters A's stripe
        // (one thread, one stripe) before A is taken.
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        let (_tx_b, rx_b) = oneshot::channel::<u32>();
        let mut b = Box::pin(waits.wait(rx_b, Instant::now() + Duration::from_millis(10)));
        assert!(futures_util::poll!(b.as_mut()).is_pending());
        assert!(matches!(a.await, Err(Expired::TimedOut)));
        let b = tokio::time::timeout(Duration::from_secs(10), b).await;
        assert!(matches!(b, Ok(Err(Expired::TimedOut))), "{b:?}");
        assert_eq!(entries(&waits), 0);
    }

    /// A stripe is checked from the earliest deadline it holds: one that
    /// comes after a later one lowers it, and after a check the next one
    /// still waiting is the one it is checked from.
    #[tokio::test]
    async fn deadlines_in_any_order_each_time_out_in_turn() {
        let waits = kept_table().await;
        let began = Instant::now();
        let (_tx_late, rx_late) = oneshot::channel::<u32>();
        let (_tx_early, rx_early) = oneshot::channel::<u32>();
        let (_tx_far, rx_far) = oneshot::channel::<u32>();
        // One thread, one stripe: the late deadline enters first.
        let mut late = Box::pin(waits.wait(rx_late, began + Duration::from_millis(120)));
        assert!(futures_util::poll!(late.as_mut()).is_pending());
        let mut early = Box::pin(waits.wait(rx_early, began + Duration::from_millis(20)));
        assert!(futures_util::poll!(early.as_mut()).is_pending());
        assert_eq!(due_from(&waits), Some(began + Duration::from_millis(20)));
        let mut far = Box::pin(waits.wait(rx_far, began + Duration::from_secs(3600)));
        assert!(futures_util::poll!(far.as_mut()).is_pending());
        let bound = Duration::from_secs(10);
        let early = tokio::time::timeout(bound, early).await;
        assert!(matches!(early, Ok(Err(Expired::TimedOut))), "{early:?}");
        assert!(began.elapsed() >= Duration::from_millis(20));
        let late = tokio::time::timeout(bound, late).await;
        assert!(matches!(late, Ok(Err(Expired::TimedOut))), "{late:?}");
        assert!(began.elapsed() >= Duration::from_millis(120));
        // The far one is still waiting, and its stripe is checked from its
        // deadline now.
        assert!(futures_util::poll!(far.as_mut()).is_pending());
        assert_eq!(due_from(&waits), Some(began + Duration::from_secs(3600)));
    }

    /// The one stripe holding entries: where its checks start from.
    fn due_from(waits: &AskWaits) -> Option<Instant> {
        let mut holding = waits
            .stripes
            .iter()
            .map(lock)
            .filter(|e| !e.waiting.is_empty());
        let stripe = holding.next().expect("a stripe holds the entries");
        assert!(holding.next().is_none(), "one thread, one stripe");
        stripe.due_from
    }

    #[tokio::test]
    async fn without_the_task_a_timer_keeps_the_deadline() {
        let waits = AskWaits::new();
        let (_tx, rx) = oneshot::channel::<u32>();
        let began = Instant::now();
        let out = waits.wait(rx, began + Duration::from_millis(20)).await;
        assert!(matches!(out, Err(Expired::TimedOut)), "{out:?}");
        assert_eq!(entries(&waits), 0);
    }

    #[tokio::test]
    async fn a_stopped_task_stops_the_waits_it_kept() {
        let waits = AskWaits::new();
        let task = tokio::spawn(keep_deadlines(Arc::downgrade(&waits)));
        while !waits.keeping.load(Ordering::Acquire) {
            tokio::task::yield_now().await;
        }
        let (_tx, rx) = oneshot::channel::<u32>();
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut wait = Box::pin(waits.wait(rx, deadline));
        assert!(futures_util::poll!(wait.as_mut()).is_pending());
        task.abort();
        let _ = task.await;
        assert!(matches!(wait.await, Err(Expired::Stopped)));
        // Later waits keep a timer of their own.
        let (_tx, rx) = oneshot::channel::<u32>();
        let mut wait = Box::pin(waits.wait(rx, deadline));
        assert!(futures_util::poll!(wait.as_mut()).is_pending());
        assert_eq!(entries(&waits), 0);
    }
}
