//! What recording a remembered entity costs the region that spawns it: one
//! push onto the write-behind queue (divan). The store's own work happens on
//! the writer thread, off the message path; here it is a no-op store, so the
//! writer keeps the queue from filling.
//!
//! Run: `cargo bench --bench remember`.

use std::sync::Arc;

use datum_cluster_sharding::__private::bench::RememberQueue;

fn main() {
    divan::main();
}

#[divan::bench]
fn push_one_record(bencher: divan::Bencher) {
    let queue = RememberQueue::new(1_000_000);
    let id: Arc<str> = Arc::from("entity-123");
    bencher.bench(|| queue.push(divan::black_box(&id)));
}
