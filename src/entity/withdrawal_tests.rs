//! Tests of a write withdrawn unwritten: its ask's deadline came before a
//! batch took it.

use super::*;

/// A write still queued for its batch when its sender's time is up is
/// withdrawn — answered at once, and never handed to the store — while
/// the write the store has is waited for.
#[tokio::test]
async fn a_write_queued_past_its_deadline_is_withdrawn_unwritten() {
    let (release, held) = std::sync::mpsc::channel::<()>();
    let held = std::sync::Mutex::new(held);
    let (entered, mut batches) = tokio::sync::mpsc::unbounded_channel::<Vec<u32>>();
    let writer = Arc::new(BatchWriter::start(
        "datum-test-writer",
        Batching::Linger,
        move |writes: &[u32]| {
            let _ = entered.send(writes.to_vec());
            // The store answers once the test lets it.
            let _ = held.lock().unwrap_or_else(|p| p.into_inner()).recv();
            vec![Ok(()); writes.len()]
        },
    ));
    let first = tokio::spawn({
        let writer = writer.clone();
        async move { writer.write(1, None).await }
    });
    assert_eq!(
        batches.recv().await,
        Some(vec![1]),
        "the store has the first"
    );
    let soon = CallDeadline {
        store: std::time::Instant::now() + Duration::from_millis(20),
        wait: tokio::time::Instant::now() + Duration::from_millis(20),
    };
    assert!(
        matches!(
            writer.write(2, Some(soon)).await,
            Err(PersistenceError::Unavailable(_))
        ),
        "queued behind a store that does not answer"
    );
    release.send(()).expect("the writer waits");
    release.send(()).expect("the writer waits");
    assert!(matches!(first.await.expect("the first"), Ok(())));
    assert!(matches!(writer.write(3, None).await, Ok(())));
    assert_eq!(
        batches.recv().await,
        Some(vec![3]),
        "the withdrawn write is not written"
    );
}
