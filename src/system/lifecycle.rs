//! The lifecycle of a running system: the one graceful stop (`shutdown`,
//! with its leave of the cluster), the fence of a node out of the cluster,
//! and the crash-like stop of a system dropped without `shutdown`.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use super::{ShardedSystem, Shared};
#[cfg(doc)]
use crate::model::error::ShardingError;
use crate::runtime::region::Region;
use crate::runtime::traffic::ShardKey;
use crate::sharding::driver::{BoxFuture, ClusterLink, SystemPort};

impl Drop for Shared {
    /// The last handle (system clone or entity ref) dropped without
    /// `shutdown`: the system stops like a crash. Its actors are killed and
    /// what waits in its buffers fails with `ShuttingDown`; once they have
    /// stopped, nothing holds this node's pipes any more (the cluster link,
    /// dropped with this, stops the sharding tasks).
    ///
    /// After a completed `shutdown` (or the stop of a node that left the
    /// cluster) there is nothing left to kill. A `shutdown` under way holds
    /// the system on its own task, so this never runs in its middle.
    fn drop(&mut self) {
        self.stopped.store(true, Ordering::Release);
        let regions = self.regions.get_mut().unwrap_or_else(|p| p.into_inner());
        for region in regions.values() {
            region.kill();
        }
    }
}

impl Shared {
    /// The graceful stop of [`ShardedSystem::shutdown`], run once, on a
    /// task of its own: later and concurrent callers wait for that one, and
    /// a caller that gives up (a timeout, a dropped future) stops nothing
    /// halfway.
    pub(crate) async fn shutdown(self: &Arc<Self>) {
        let mut done = {
            let mut task = self.stop_task.lock().unwrap_or_else(|p| p.into_inner());
            match &*task {
                Some(done) => done.clone(),
                None => {
                    let (tx, done) = tokio::sync::watch::channel(false);
                    let shared = self.clone();
                    tokio::spawn(async move {
                        shared.stop_gracefully().await;
                        // Let go of the system before saying so: a caller
                        // that drops its last handle next must find nothing
                        // of it held (a store's directory lock, say).
                        drop(shared);
                        let _ = tx.send(true);
                    });
                    *task = Some(done.clone());
                    done
                }
            }
        };
        // An error: the task ended without saying so (it panicked).
        let _ = done.wait_for(|done| *done).await;
    }

    async fn stop_gracefully(&self) {
        // No new type may register from here on (it would make this node a
        // region that is not leaving).
        self.leaving.store(true, Ordering::Release);
        let regions: Vec<Arc<Region>> = self
            .regions
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .cloned()
            .collect();
        // A graceful leave: the shards hosted here move to other nodes while
        // this one still routes (messages that arrive meanwhile wait in the
        // handoff buffers, then follow their shards).
        if let Some(link) = &self.cluster
            && link.leave().await
        {
            let patience = self.config.handoff_timeout + Duration::from_secs(1);
            let deadline = tokio::time::Instant::now() + patience;
            while !regions.iter().all(|r| r.table().leave_done()) {
                if tokio::time::Instant::now() >= deadline {
                    tracing::warn!(
                        ?patience,
                        "graceful leave: not every shard was handed off in time"
                    );
                    break;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            // The states handed over stay until the new owners fetched
            // them (or the migration timeout passes: they start without).
            let patience = self.config.migration_timeout;
            let deadline = tokio::time::Instant::now() + patience;
            while regions.iter().any(|r| r.table().migrations_pending()) {
                if tokio::time::Instant::now() >= deadline {
                    tracing::warn!(
                        ?patience,
                        "graceful leave: migrated states not all fetched in time"
                    );
                    break;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
        // Senders waiting for room in the remember-entities queue give up...
        self.mark_stopped();
        // No new message is accepted from here on (senders see ShuttingDown)...
        for region in &regions {
            region.stop_accepting();
        }
        // ...the coordinator hears the regions go...
        if let Some(link) = &self.cluster {
            link.stop().await;
        }
        // ...and what they hold stops.
        futures_util::future::join_all(regions.iter().map(|r| r.shutdown())).await;
        if let Some(link) = &self.cluster {
            link.remote.stop_waiting();
        }
        // What was recorded reaches the store before shutdown returns.
        let remember = self
            .remember
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        if let Some(remember) = remember {
            let timeout = self.config.shutdown_timeout;
            if tokio::time::timeout(timeout, remember.flush())
                .await
                .is_err()
            {
                tracing::warn!(
                    ?timeout,
                    "remember-entities records not all written at shutdown"
                );
            }
        }
    }

    /// The system can no longer serve (its node is out of the cluster): no
    /// new type may register, and sends through any ref are refused.
    pub(crate) fn mark_stopped(&self) {
        self.stopped.store(true, Ordering::Release);
        // No sender waits for room in the remember-entities queue any more.
        if let Some(remember) = self
            .remember
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
        {
            remember.end_waits();
        }
    }

    /// This node is out of the cluster (downed, removed, or its node
    /// stopped): stop now, so that what the rest of the cluster
    /// reallocates does not also run here. Regions stop accepting at once
    /// and stop their entities on a task; asks waiting on other nodes fail
    /// with `ShutDownInFlight` (they may have been processed there).
    /// The system is the one owner of its regions' lifecycle: this, the
    /// graceful `shutdown`, and `Drop`.
    pub(crate) fn fence(&self) {
        self.mark_stopped();
        let regions = self.all_regions();
        if regions.is_empty() {
            return;
        }
        for region in &regions {
            region.stop_accepting();
        }
        if let Some(link) = &self.cluster {
            link.remote.stop_waiting();
        }
        tokio::spawn(async move {
            for region in regions {
                region.shutdown().await;
            }
        });
    }
}

impl SystemPort for Shared {
    fn region(&self, type_name: &str) -> Option<Arc<Region>> {
        Shared::region(self, type_name)
    }

    fn all_regions(&self) -> Vec<Arc<Region>> {
        Shared::all_regions(self)
    }

    fn cluster_link(&self) -> Option<&ClusterLink> {
        Shared::cluster_link(self)
    }

    fn is_shut_down(&self) -> bool {
        Shared::is_shut_down(self)
    }

    fn fence(&self) {
        Shared::fence(self)
    }

    fn shut_down(self: Arc<Self>) -> BoxFuture<'static, ()> {
        Box::pin(async move { self.shutdown().await })
    }

    fn take_traffic(&self) -> Vec<(ShardKey, ShardKey, u64)> {
        self.traffic.take()
    }
}

impl<S, J> ShardedSystem<S, J> {
    /// Stops every entity, fails buffered and pending messages with
    /// [`ShardingError::ShuttingDown`], and waits for the actors to stop.
    ///
    /// On a cluster this is a graceful leave (SPEC §13.12): first the
    /// shards hosted here are handed off to other members while this node
    /// still routes (no new type may register meanwhile), waiting at most
    /// `handoff_timeout` + 1 s; then the coordinator hears that the regions
    /// stop, and messages that still reach this node are answered
    /// `ShuttingDown`.
    ///
    /// Concurrent and repeated calls wait for the one shutdown, and so does
    /// [`ClusterNode::shutdown`](crate::cluster::ClusterNode::shutdown),
    /// which runs this first: on a cluster node, `node.shutdown()` alone is
    /// the whole graceful stop. The stop runs on a task of its own, so a
    /// caller that stops waiting (a timeout) does not cut it short. Do not
    /// await it inside an entity's handler: that entity's shard waits for
    /// the handler before it is handed off (spawn a task instead).
    pub async fn shutdown(&self) {
        self.shared.shutdown().await;
    }
}
