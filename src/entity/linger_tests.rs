//! Tests of how the batched writer gathers a batch (`Linger`).

use super::*;

/// A journal's append, as its writer queues it.
type Append = Pending<AtomicWrite>;

fn append() -> (
    Append,
    tokio::sync::oneshot::Receiver<PersistenceResult<()>>,
) {
    let (done, result) = tokio::sync::oneshot::channel();
    let write = AtomicWrite {
        persistence_id: crate::persistence::PersistenceId::new("t", "e"),
        expected: 0,
        events: Vec::new(),
        writer: crate::persistence::Writer {
            node_id: 1,
            incarnation: 1,
            generation: 1,
        },
    };
    let pending = Pending {
        write,
        by: None,
        claimed: None,
        done,
    };
    (pending, result)
}

#[test]
fn a_first_batch_takes_what_waits_and_goes() {
    let (tx, rx) = std::sync::mpsc::channel();
    let mut kept = Vec::new();
    for _ in 0..3 {
        let (a, r) = append();
        tx.send(a).unwrap();
        kept.push(r);
    }
    let mut batch = vec![rx.recv().unwrap()];
    Linger::default().gather(&rx, &mut batch);
    assert_eq!(batch.len(), 3);
}

#[test]
fn after_a_commit_a_batch_waits_for_the_answered_then_no_longer() {
    let (tx, rx) = std::sync::mpsc::channel();
    let mut linger = Linger::default();
    // A commit answered 4 while 1 waited: a batch of 5 goes at once...
    linger.committed(4, Duration::from_secs(1), 1);
    let mut kept = Vec::new();
    for _ in 0..6 {
        let (a, r) = append();
        tx.send(a).unwrap();
        kept.push(r);
    }
    let mut batch = vec![rx.recv().unwrap()];
    linger.gather(&rx, &mut batch);
    assert_eq!(batch.len(), 6, "everything waiting, at least the target");
    // ...and a smaller one waits at most the linger, then goes.
    linger.committed(4, Duration::from_secs(1), 0);
    let (a, _r) = append();
    tx.send(a).unwrap();
    let began = Instant::now();
    let mut batch = vec![rx.recv().unwrap()];
    linger.gather(&rx, &mut batch);
    assert_eq!(batch.len(), 1);
    assert!(
        began.elapsed() < Duration::from_secs(1),
        "bounded by MAX_LINGER"
    );
    // A lone writer (one answered, one back) has its batch at once.
    linger.committed(1, Duration::from_secs(1), 0);
    assert_eq!(linger.target, 1, "one append is a whole batch");
}

#[test]
fn an_eager_store_has_no_linger() {
    let (tx, rx) = std::sync::mpsc::channel();
    let mut linger = Linger::new(Batching::Eager);
    // A commit that answered many, taking a second: a lingering batch
    // would wait up to MAX_LINGER for as many again.
    linger.committed(16, Duration::from_secs(1), 0);
    assert_eq!(linger.target, 0, "no target to wait for");
    assert!(linger.until.is_none(), "and no time to wait until");
    let (a, _r) = append();
    tx.send(a).unwrap();
    let mut batch = vec![rx.recv().unwrap()];
    linger.gather(&rx, &mut batch);
    assert_eq!(batch.len(), 1);
}
